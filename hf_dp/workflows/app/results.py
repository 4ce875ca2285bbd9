"""Finished runs on disk: result JSONs read into [`RunRecord`]s, and the Results tab's table of them.

A result JSON is what [`hf_dp.workflows.run_results.save_result`] writes (keys `RESULT_KEYS` there): the run's
`mechanism` (a key of [`~hf_dp.vocabulary.MECHANISMS`]), `epsilon`, `delta`, `metric_name`, `eval_result`,
`baseline_result` (the public-only baseline on the same test rows), `non_private_result` when known, `model_dir`...
Files that are not complete results (`summary.json`, an interrupted write) are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Sequence

from hf_dp.formatting import format_epsilon, format_number, format_significant
from hf_dp.vocabulary import DP_MECHANISMS

from .common import AppError, error_md, mechanism_label

logger = logging.getLogger(__name__)

# Runs started from the Train tab go here (inside the results folder), apart from the study's runs: they
# train on small subsets, so they are listed for comparison but left out of the plot and the cost estimate.
APP_RUNS_DIR = "app-runs"
BASELINE = "public-only"
NON_PRIVATE = "non-private"
# Result JSON `task`s of language models (`causal_lm` is read as `causal-lm`): the Compare tab generates with them.
CHAT_TASK = "chat-sft"
LANGUAGE_MODEL_TASKS = ("causal-lm", CHAT_TASK)
# Listing order: the baseline, the non-private run, then the DP mechanisms.
_ORDER = {key: i for i, key in enumerate((BASELINE, NON_PRIVATE) + DP_MECHANISMS)}


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A finished run: its result JSON and the folder it was read from."""

    result: dict
    folder: Path
    from_app: bool = False

    @property
    def name(self) -> str:
        return f"{APP_RUNS_DIR}/{self.result['run']}" if self.from_app else str(self.result["run"])

    @property
    def mechanism(self) -> str:
        """The run's key of [`~hf_dp.vocabulary.MECHANISMS`]."""
        return str(self.result.get("mechanism"))

    @property
    def is_baseline(self) -> bool:
        return self.mechanism == BASELINE

    @property
    def is_dp(self) -> bool:
        return self.mechanism in DP_MECHANISMS

    @property
    def metric_name(self) -> str:
        return str(self.result.get("metric_name") or "accuracy")

    @property
    def eval_result(self) -> float | None:
        return _number(self.result.get("eval_result"))

    @property
    def model_path(self) -> Path | None:
        model_dir = self.result.get("model_dir")
        return (self.folder / model_dir) if model_dir else None

    @property
    def task(self) -> str:
        return str(self.result.get("task") or "classification")

    @property
    def is_language_model(self) -> bool:
        """A generative run ([`LANGUAGE_MODEL_TASKS`]): the Compare tab shows generations, not class probabilities."""
        return self.task.replace("_", "-") in LANGUAGE_MODEL_TASKS

    @property
    def is_chat(self) -> bool:
        """A chat fine-tuning run: its prompts go through the chat template as a user message."""
        return self.task.replace("_", "-") == CHAT_TASK

    def guarantee(self) -> str:
        """The run's guarantee in words: `ε = 7.9, δ = 1e-05 (user-level)`, `no privacy guarantee` (non-private)
        or `no private data` (the public-only baseline)."""
        if self.mechanism == NON_PRIVATE:
            return "no privacy guarantee"
        if self.is_baseline:
            return "no private data"
        unit = (self.result.get("privacy") or {}).get("privacy_unit", "?")
        return (f"ε = {format_epsilon(self.result.get('epsilon'))}, "
                f"δ = {format_significant(self.result.get('delta'), 2, up=True)} ({unit}-level)")

    def label(self) -> str:
        """The run as the dropdowns list it: name, mechanism, ε, result."""
        if self.mechanism == NON_PRIVATE:
            eps_text = "ε = ∞ (no DP)"
        elif self.is_baseline:
            eps_text = "no private data"
        else:
            eps_text = f"ε = {format_epsilon(self.result.get('epsilon'))}"
        return (f"{self.name} — {mechanism_label(self.mechanism)}, {eps_text}, "
                f"{self.metric_name} {format_number(self.result.get('eval_result'), '.3f')}")


def list_runs(results_dir: str | os.PathLike, *, include_app_runs: bool = True) -> list[RunRecord]:
    """Finished runs in `results_dir/*.json` (and `results_dir/app-runs/*.json`), sorted by mechanism and ε."""
    from hf_dp.workflows.run_results import load_result

    folders = [(Path(results_dir), False)]
    if include_app_runs:
        folders.append((Path(results_dir) / APP_RUNS_DIR, True))
    records = []
    for folder, from_app in folders:
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.json")):
            if path.name == "summary.json":
                continue
            try:
                result = load_result(path)
            except ValueError as error:  # a hand-edited result: left out of the page, said in the log
                logger.warning("%s", error)
                continue
            if result is not None and result.get("run") is not None:
                records.append(RunRecord(result, folder, from_app))
    return sorted(records, key=lambda r: (r.from_app, _ORDER.get(r.mechanism, 99),
                                          r.result.get("epsilon") or 0.0, r.name))


def find_run(results_dir, name: str | None) -> RunRecord:
    """The run called `name` (its name or its dropdown label); the first DP run with a model when `name` is empty.

    Raises:
        AppError: no runs yet, or none of that name.
    """
    runs = list_runs(results_dir)
    if not runs:
        raise AppError(f"No finished runs in {results_dir}/ yet: run `hf-dp demo` or start one in the Train tab.")
    if not name:  # nothing picked yet (the list may still be loading): the first DP run with a model
        default = default_run(runs)
        if default is None:
            raise AppError(f"No fine-tuned run in {results_dir}/ yet: run `hf-dp demo` or start one in the Train tab.")
        return default
    for run in runs:
        if name in (run.name, run.label()):
            return run
    raise AppError(f"No run named {name!r} in {results_dir}/ (reload the page to refresh the list).")


def default_run(runs: Sequence[RunRecord]) -> RunRecord | None:
    """The run the Compare and Results tabs open with: the first DP run with a model, else any run with one."""
    with_model = [r for r in runs if r.model_path is not None]
    return next((r for r in with_model if r.is_dp), with_model[0] if with_model else None)


def study_is_quick(results_dir) -> bool:
    """Whether the study in `results_dir` ran with `--quick` (its numbers mean nothing)."""
    try:
        return bool(json.loads((Path(results_dir) / "summary.json").read_text()).get("quick"))
    except (OSError, ValueError, AttributeError):
        return False


def main_metric(runs: Sequence[RunRecord]) -> str:
    """The metric the plot and the estimate use when runs of several tasks share a folder (accuracy first)."""
    names = [r.metric_name for r in runs]
    return "accuracy" if "accuracy" in names else (names[0] if names else "accuracy")


def is_positive(value) -> bool:
    """A finite number above 0 (a DP run's ε)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def results_overview_markdown(results_dir) -> str:
    """The Results tab's table: one row per finished run (mechanism, ε, δ, `eval_result`, `baseline_result`)."""
    runs = list_runs(results_dir)
    if not runs:
        return error_md(f"No finished runs in {results_dir}/ yet: run `hf-dp demo` (or `hf-dp demo --grid`), "
                        "or start a run in the Train tab, then reload.")
    lines = ["| run | mechanism | ε | δ | eval_result | baseline_result |", "|---|---|---|---|---|---|"]
    for run in runs:
        r = run.result
        eps = "∞" if run.mechanism == NON_PRIVATE else format_epsilon(r.get("epsilon"))
        lines.append(f"| {run.name} | {mechanism_label(run.mechanism)} | {eps} | {format_significant(r.get('delta'), 2, up=True)} | "
                     f"{run.metric_name} {format_number(r.get('eval_result'), '.3f')} | {format_number(r.get('baseline_result'), '.3f')} |")
    return "\n".join(lines)
