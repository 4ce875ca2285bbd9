"""The tasks the study, the demo and the recipes run, one module each, behind one contract ([`StudyTask`]).

A task module holds its run config (a [`~hf_dp.workflows.runs.RunConfig`]), loads its data once per seed, runs its
public-only baseline and its fine-tuning runs (each evaluates and records its result through
[`~hf_dp.workflows.run_results`]). The registry below names those pieces; the study asks it and never tests a
task's name, so a new task is one module and one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["StudyTask", "TASK_REGISTRY", "get_task", "task_of_result"]


@dataclass(frozen=True)
class StudyTask:
    """One task's contract, by name (its module is imported only when a run needs it).

    Attributes:
        key: the study's name for it (`hf-dp demo --task`).
        module: the module holding the functions below.
        config_class: its run config class.
        load_data: `(config) -> data`, once per seed (the seed draws the test sample).
        run_baseline: `(config, *, data) -> result`: the public-only baseline, no private data.
        run_training: `(config, training_args, *, data) -> result`: a DP or non-private fine-tuning run.
        baseline: what the baseline is, in words (the study's progress lines).
        generative: a causal LM: the embedded SmolLM2 unless the settings name a model.
        result_task: the `task` its result JSONs record.
        learns: what the model learns to predict, in words (the plot's title).
        scored_token: what the test NLL is per (the plot's axis), for a generative task.
    """

    key: str
    module: str
    config_class: str
    load_data: str
    run_baseline: str
    run_training: str
    baseline: str
    generative: bool
    result_task: str
    learns: str
    scored_token: str = "token"

    def _get(self, name: str):
        return getattr(importlib.import_module(self.module), name)

    def config(self) -> type:
        """The run config class."""
        return self._get(self.config_class)

    def load(self, config):
        return self._get(self.load_data)(config)

    def run(self, config, training_args, *, data):
        """The baseline when `training_args` is `None`, else a fine-tuning run; returns the written result."""
        if training_args is None:
            return self._get(self.run_baseline)(config, data=data)
        return self._get(self.run_training)(config, training_args, data=data)


TASK_REGISTRY = {task.key: task for task in (
    StudyTask("sft", "hf_dp.workflows.tasks.chat_sft", "ChatSFTConfig", "load_chat_data", "run_chat_baseline",
              "run_chat_sft", baseline="the untouched model", generative=True, result_task="chat-sft",
              learns="replies in Shakespeare conversations", scored_token="reply token"),
    StudyTask("causal_lm", "hf_dp.workflows.tasks.language_modeling", "LanguageModelingConfig", "load_text_data",
              "run_public_baseline", "run_language_modeling", baseline="the untouched model", generative=True,
              result_task="causal-lm", learns="next token on Shakespeare speeches"),
    StudyTask("classification", "hf_dp.workflows.tasks.classification", "ClassificationConfig",
              "load_classification_data", "run_zero_shot_baseline", "run_classification",
              baseline="zero-shot embedding similarity", generative=False, result_task="classification",
              learns="Shakespeare genres"),
)}


def get_task(key: str) -> StudyTask:
    """The registered task `key`; `ValueError` naming the registered ones otherwise."""
    try:
        return TASK_REGISTRY[key]
    except (KeyError, TypeError):
        raise ValueError(f"task={key!r}: use one of {tuple(TASK_REGISTRY)}.") from None


def task_of_result(result: dict) -> StudyTask:
    """The task a result JSON was written by (its `task`); causal LM for results that do not say."""
    name = result.get("task")
    return next((task for task in TASK_REGISTRY.values() if task.result_task == name), TASK_REGISTRY["causal_lm"])
