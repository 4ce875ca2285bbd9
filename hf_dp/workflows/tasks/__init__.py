"""The tasks the study, the demo's audit and the recipes run, each one registered [`StudyTask`] object.

A task's object holds everything the study and the audit tell tasks apart by: its runs (the default study's, the
grid's, the headline ones `--seeds` repeats), its settings (default, `--quick`, `--full`), the name its results
and summary record, what it imports beyond the core, its audit defaults, and its functions (run config class,
data, baseline, training run, audit). The study, the plan, the settings and the audit ask the registry and never
test a task's name.

A new task is one module that builds a [`StudyTask`] and calls [`register_task`]. The built-in tasks register in
[`hf_dp.workflows.tasks.studies`], which the registry imports by its module path ([`BUILT_IN_TASKS`]) at the first
lookup: their declarations name the study's settings and runs, whose modules ask this registry, so importing them
here would make an import circle. Their functions live in the task modules (`chat_sft`, `language_modeling`,
`classification`), which load torch; a task's `functions` imports its module only when a run needs it, so
`hf-dp --help` and the commands' argument checks stay fast.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Mapping

__all__ = ["BUILT_IN_TASKS", "AuditDefaults", "StudyTask", "TaskFunctions", "get_task", "register_task",
           "registered_tasks", "task_of_result"]

BUILT_IN_TASKS = "hf_dp.workflows.tasks.studies"  # the module registering the study's three tasks


@dataclass(frozen=True)
class TaskFunctions:
    """What a task runs, from its (heavy) module.

    Attributes:
        config_class: its run config class (a [`~hf_dp.workflows.runs.RunConfig`]).
        load_data: `(config) -> data`, once per seed (the seed draws the test sample).
        run_baseline: `(config, *, data) -> result`: the public-only baseline, no private data.
        run_training: `(config, training_args, *, data) -> result`: a DP or non-private fine-tuning run.
        run_audit: `(fields, training, audit, *, results_dir, progress, log) -> dict`: its audited ULS run with
            canaries (`hf-dp audit`), or `None`.
    """

    config_class: type
    load_data: Callable
    run_baseline: Callable
    run_training: Callable
    run_audit: Callable | None = None


@dataclass(frozen=True)
class AuditDefaults:
    """The audited run of a task (`hf-dp audit --task`): what its flags default to, and what it imports.

    Attributes:
        max_steps, max_eval_examples, canaries: steps of the audited run, test rows for its metric, canary users.
        max_train_users: real users (a seeded sample); `None`: all.
        target_delta: δ of the run and its bound; `None`: the trainer's 1/(10 N).
        score: the canary score `--score auto` picks.
        extras: modules it imports beyond the core (all in the `demo` extra).
    """

    max_steps: int
    max_eval_examples: int
    canaries: int
    max_train_users: int | None
    target_delta: float | None
    score: str
    extras: tuple[str, ...] = ()


@dataclass(frozen=True)
class StudyTask:
    """One task of the study, with everything the study, its plan and the audit read of it.

    Attributes:
        key: the study's name for it (`hf-dp demo --task`).
        result_task: the `task` its result JSONs and the study's `summary.json` record.
        functions: `() -> TaskFunctions`, importing the task's module (only when a run needs it).
        settings: `"default"`, `"quick"` and, where it has one, `"full"`: the settings dicts of
            [`hf_dp.workflows.study_settings`].
        runs: the default study's runs after the baseline and the non-private run
            ([`~hf_dp.workflows.study_runs.StudyRun`]s).
        grid_runs: the same for `--grid`.
        headline_runs: the run names `--seeds N` repeats (the baseline and the non-private run among them).
        baseline: what the baseline is, in words (the study's progress lines).
        generative: a causal LM: the embedded SmolLM2 unless the settings name a model.
        learns: what the model learns to predict, in words (the plot's title).
        scored_token: what the test NLL is per (the plot's axis), for a generative task.
        extras: modules the study imports for it beyond the core (all in the `demo` extra).
        audit: its audit defaults, or `None` when `hf-dp audit` does not offer it.
    """

    key: str
    result_task: str
    functions: Callable[[], TaskFunctions]
    settings: Mapping[str, dict]
    runs: tuple = ()
    grid_runs: tuple = ()
    headline_runs: tuple[str, ...] = ("baseline", "non-private")
    baseline: str = "the untouched model"
    generative: bool = False
    learns: str = ""
    scored_token: str = "token"
    extras: tuple[str, ...] = field(default=())
    audit: AuditDefaults | None = None

    def config(self) -> type:
        """The run config class."""
        return self.functions().config_class

    def load(self, config):
        return self.functions().load_data(config)

    def run(self, config, training_args, *, data):
        """The baseline when `training_args` is `None`, else a fine-tuning run; returns the written result."""
        if training_args is None:
            return self.functions().run_baseline(config, data=data)
        return self.functions().run_training(config, training_args, data=data)


_TASKS: dict[str, StudyTask] = {}


def register_task(task: StudyTask) -> StudyTask:
    """Add `task` to the registry (under `task.key`) and return it; `ValueError` when another task has its key."""
    if _TASKS.get(task.key, task) is not task:
        raise ValueError(f"task {task.key!r} is registered already")
    _TASKS[task.key] = task
    return task


def registered_tasks() -> dict[str, StudyTask]:
    """Every registered task by key (the built-in ones, [`BUILT_IN_TASKS`], are registered on the first call)."""
    importlib.import_module(BUILT_IN_TASKS)
    return _TASKS


def get_task(key: str) -> StudyTask:
    """The registered task `key`; `ValueError` naming the registered ones otherwise."""
    tasks = registered_tasks()
    try:
        return tasks[key]
    except (KeyError, TypeError):
        raise ValueError(f"task={key!r}: use one of {tuple(tasks)}.") from None


def task_of_result(result: dict) -> StudyTask:
    """The task a result JSON was written by (its `task`); causal LM for results that do not say (they predate the
    field)."""
    name = result.get("task")
    return next((task for task in registered_tasks().values() if task.result_task == name), get_task("causal_lm"))
