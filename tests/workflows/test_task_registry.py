"""`hf_dp/workflows/tasks`: a study task is one registered `StudyTask`. A toy task, defined and registered here
(no other file edited), is planned, configured and run through the whole study loop (summary, table, plot) with
stand-in functions that train nothing."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from hf_dp.workflows import study, study_runs, study_settings
from hf_dp.workflows.tasks import StudyTask, TaskFunctions, get_task, register_task, registered_tasks


@dataclass
class ToyConfig:
    """The run config's fields the study sets, and `training_arguments` as a dict (nothing is trained)."""

    run: str
    results_dir: str = ""
    progress: bool = False
    baseline_result: float | None = None
    non_private_result: float | None = None
    seed: int = 0
    users: int = 4
    user_id_column: str = "user_id"
    extra: dict = field(default_factory=dict)

    def training_arguments(self, mechanism: str, **fields) -> dict:
        return dict(fields, mechanism=mechanism)


def _load(config: ToyConfig):
    return SimpleNamespace(train={"user_id": [f"u{i % config.users}" for i in range(3 * config.users)]})


def _result(config: ToyConfig, mechanism: str, eval_result: float, args: dict | None = None) -> dict:
    args = args or {}
    return {"run": config.run, "task": "toy-task", "mechanism": mechanism, "metric_name": "accuracy",
            "base_model": "toy", "eval_result": eval_result, "baseline_result": config.baseline_result or 0.5,
            "target_epsilon": args.get("target_epsilon"), "epsilon": args.get("target_epsilon"),
            "train_seconds": 0.0, "steps": None if not args else args["max_steps"], "config": args}


def _baseline(config: ToyConfig, *, data) -> dict:
    return _result(config, "public-only", 0.5)


def _train(config: ToyConfig, training_args: dict, *, data) -> dict:
    private = training_args["mechanism"] != "non-private"
    return _result(config, training_args["mechanism"], 0.6 if private else 0.7, training_args)


TOY_SETTINGS = {"config": {"users": 5}, "dp": {"expected_batch_size": 2, "contribution_bound": 2, "max_steps": 1},
                "adaptive": {}, "non_private": {"max_steps": 1}}
TOY = StudyTask(
    key="toy", result_task="toy-task", functions=lambda: TaskFunctions(ToyConfig, _load, _baseline, _train),
    settings={"default": TOY_SETTINGS, "quick": dict(TOY_SETTINGS, config={"users": 3})},
    runs=study_runs.fixed_and_adaptive_runs(["els"], [4])[:1],
    grid_runs=study_runs.fixed_and_adaptive_runs(["uls"], [2]),
    headline_runs=("baseline", "els-eps4"), baseline="a coin", learns="toy labels", extras=("json",),
)


@pytest.fixture
def toy_task(monkeypatch):
    tasks = registered_tasks()
    register_task(TOY)
    yield TOY
    monkeypatch.delitem(tasks, TOY.key)  # registered for this test only


def test_a_registered_task_is_planned_configured_and_run_by_the_study(toy_task, tmp_path):
    assert get_task("toy") is toy_task and "toy" in study_settings.task_names()
    assert study_settings.study_settings("toy", quick=True)["config"] == {"users": 3}
    with pytest.raises(ValueError, match="--full: only sft has a full study; --task toy"):
        study_settings.study_settings("toy", full=True)
    plan = study_runs.runs_of_study(grid=False, task="toy", seeds=2)
    assert [e.run for e in plan] == ["baseline", "non-private", "els-eps4", "baseline-seed1", "els-eps4-seed1"]
    assert [e.run for e in study_runs.runs_of_study(grid=True, task="toy")][2:] == ["uls-eps2", "uls-eps2-adaptive"]

    summary = study.run_study(str(tmp_path), task="toy", progress=False, log=lambda _: None)
    assert summary["task"] == "toy-task"  # the task's result_task
    assert [row["run"] for row in summary["table"]] == ["baseline", "non-private", "els-eps4"]
    els = summary["runs"][2]
    # ELS samples the matching examples per step: 2 users x mean min(3, G = 2) rows of the 5 users' data.
    assert els["config"]["expected_batch_size"] == 4 and els["config"]["target_epsilon"] == 4.0
    assert summary["table"][2]["gap_closed"] == pytest.approx(0.5)
    assert json.loads((tmp_path / "summary.json").read_text())["task"] == "toy-task"
    assert (tmp_path / "privacy_utility.png").stat().st_size > 0

