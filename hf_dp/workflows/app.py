"""The Gradio app: explore a privacy budget, train, compare with the public-only baseline, read the card.

`hf-dp app` (or `python app/app.py`) serves four tabs over hf_dp's public API; the app does no privacy math
itself, it shows what [`hf_dp.accounting.planner`], [`~hf_dp.DPTrainer`] and the accountant report:

- **Budget**: ε (log-scale slider), δ, privacy unit, ULS/ELS, users, examples per user, units per step and steps
  go to [`hf_dp.accounting.planner.plan`]; the page shows the noise multiplier σ each mechanism needs, the recommended
  contribution bound G, and an *expected accuracy cost* read off the finished runs in `results/`
  (interpolated in log ε between measured runs; said plainly when there is nothing to read it from).
- **Train**: a short DP fine-tuning run of the embedded MiniLM on a small subset of the Shakespeare genres
  ([`hf_dp.workflows.tasks.classification.run_classification`]) in a background thread, with a live progress bar and the ε
  spent so far (a [`~transformers.TrainerCallback`] feeds a queue, a [`gradio.Timer`] polls it). Its model,
  card and JSON go to `results/app-runs/`.
- **Compare**: pick a finished run and a text; the public-only baseline's class probabilities (the run's
  pretrained encoder, zero-shot by embedding similarity to label descriptions) beside the DP model's; for
  causal LMs, greedy generations and next-token probabilities side by side.
- **Results**: metric against ε (log x) per method, the public-only baseline as a line, the non-private run as
  a point at ε = ∞; and the selected run's privacy card, rendered.

Errors (no results yet, an impossible budget, a missing model) are shown in the page as one line, never as a
stack trace. The page needs no network: gradio analytics are off, fonts and scripts are served locally, models
load from the results folder and the embedded MiniLM. (A causal-LM run whose base model is a Hub id needs that
model in the local cache; run with `HF_HUB_OFFLINE=1` to be sure nothing reaches the Hub.)

Example:

```bash
hf-dp app --results-dir results --port 7860     # then open http://127.0.0.1:7860
python app/app.py --results-dir results
```
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "APP_RUNS_DIR",
    "RunRecord",
    "TrainingJob",
    "budget_view",
    "build_app",
    "compare_view",
    "expected_accuracy_cost",
    "list_runs",
    "main",
    "plan_budget",
    "privacy_card_markdown",
    "privacy_utility_figure",
    "run",
    "serve",
]

# Runs started from the Train tab go here (inside the results folder), apart from the study's runs: they
# train on small subsets, so they are listed for comparison but left out of the plot and the cost estimate.
APP_RUNS_DIR = "app-runs"
EPSILON_RANGE = (0.5, 16.0)
DP_METHODS = ("uls", "els", "example")
BASELINE_METHODS = ("public-only", "public-baseline", "baseline")
METHOD_NAMES = {
    "uls": "user-level DP, ULS",
    "els": "user-level DP, ELS",
    "example": "example-level DP-SGD",
    "non-private": "non-private fine-tuning",
    "public-only": "public-only baseline",
    "public-baseline": "public-only baseline",
    "baseline": "public-only baseline",
}
EXAMPLE_TEXTS = [
    "Once more unto the breach, dear friends, once more, or close the wall up with our English dead.",
    "If music be the food of love, play on; give me excess of it.",
    "Out, damned spot! out, I say! Here's the smell of the blood still.",
    "My liege, the French are landed and the nobles of the north rise in arms against the crown.",
    "Sweet lady, will you walk with me to the masque tonight? I have a jest to tell you.",
]


class AppError(Exception):
    """An error the page shows as one line (bad input, nothing to show yet)."""


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def _error_md(error: BaseException | str) -> str:
    message = error if isinstance(error, str) else _one_line(error)
    return f"**⚠️ {message}**"


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "∞"
        if math.isnan(value):
            return "–"
        return format(value, spec)
    return str(value)


# ----------------------------------------------------------------------------------------------------------
# Results on disk
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A finished run: its result JSON (schema in [`hf_dp.workflows.tasks.classification`]) and the folder it was read from."""

    result: dict
    folder: Path
    from_app: bool = False

    @property
    def name(self) -> str:
        return f"{APP_RUNS_DIR}/{self.result['run']}" if self.from_app else str(self.result["run"])

    @property
    def method(self) -> str:
        return str(self.result.get("method"))

    @property
    def is_baseline(self) -> bool:
        return self.method in BASELINE_METHODS

    @property
    def model_path(self) -> Path | None:
        model_dir = self.result.get("model_dir")
        return (self.folder / model_dir) if model_dir else None

    @property
    def task(self) -> str:
        return str(self.result.get("task") or "classification")

    @property
    def is_causal_lm(self) -> bool:
        return self.task.replace("-", "_") == "causal_lm"

    def label(self) -> str:
        eps = self.result.get("epsilon")
        eps_text = "ε = ∞ (no DP)" if self.method == "non-private" else (
            "no private data" if self.is_baseline else f"ε = {_fmt(eps, '.3g')}")
        metric = f"{self.result.get('metric_name', 'metric')} {_fmt(self.result.get('metric'), '.3f')}"
        return f"{self.name} — {METHOD_NAMES.get(self.method, self.method)}, {eps_text}, {metric}"


def _load_result(path: Path) -> dict | None:
    try:
        from hf_dp.workflows.runs import load_result
    except ImportError:  # pragma: no cover - runs.py ships with the package
        load_result = None
    if load_result is not None:
        return load_result(path)
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and "run" in result and "method" in result else None


def list_runs(results_dir: str | os.PathLike, *, include_app_runs: bool = True) -> list[RunRecord]:
    """Finished runs in `results_dir/*.json` (and `results_dir/app-runs/*.json`), sorted by method and ε.

    Files that are not complete results (`summary.json`, an interrupted write) are skipped.
    """
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
            result = _load_result(path)
            if result is not None and result.get("run") is not None:
                records.append(RunRecord(result, folder, from_app))
    order = {m: i for i, m in enumerate(BASELINE_METHODS + ("non-private",) + DP_METHODS)}
    return sorted(records, key=lambda r: (r.from_app, order.get(r.method, 99),
                                          r.result.get("epsilon") or 0.0, r.name))


def _find_run(results_dir, name: str | None) -> RunRecord:
    runs = list_runs(results_dir)
    if not runs:
        raise AppError(f"No finished runs in {results_dir}/ yet: run `hf-dp demo` or start one in the Train tab.")
    if not name:  # nothing picked yet (the list may still be loading): the first DP run with a model
        default = _default_run(runs)
        if default is None:
            raise AppError(f"No fine-tuned run in {results_dir}/ yet: run `hf-dp demo` or start one in the Train tab.")
        return default
    for run in runs:
        if name in (run.name, run.label()):
            return run
    raise AppError(f"No run named {name!r} in {results_dir}/ (reload the page to refresh the list).")


def _default_run(runs: Sequence[RunRecord]) -> RunRecord | None:
    with_model = [r for r in runs if r.model_path is not None]
    return next((r for r in with_model if r.method in DP_METHODS), with_model[0] if with_model else None)


def _study_is_quick(results_dir) -> bool:
    try:
        return bool(json.loads((Path(results_dir) / "summary.json").read_text()).get("quick"))
    except (OSError, ValueError, AttributeError):
        return False


# ----------------------------------------------------------------------------------------------------------
# Budget tab: the planner's numbers and the accuracy cost read from finished runs
# ----------------------------------------------------------------------------------------------------------


def mechanism_of(privacy_unit: str, sampling: str) -> str:
    """`"example"` for example-level DP, else `"uls"`/`"els"` (the planner's and the results' vocabulary)."""
    if privacy_unit == "example":
        return "example"
    if privacy_unit != "user":
        raise AppError(f"privacy unit must be 'user' or 'example', got {privacy_unit!r}.")
    sampling = str(sampling).lower()
    if sampling not in ("uls", "els"):
        raise AppError(f"sampling must be ULS or ELS, got {sampling!r}.")
    return sampling


def plan_budget(*, target_epsilon: float, delta: float, num_users: int, examples_per_user: int,
                units_per_step: float, steps: int, noise_multiplier: float | None = None) -> list[dict]:
    """The planner's rows (one per mode: `"uls"`, `"els"`, `"example"`) for these settings.

    A thin call into [`hf_dp.accounting.planner.plan`] (its docstring lists the keys); the numbers are the planner's.
    `units_per_step` is the compute budget, expected examples processed per step, the same for every mode.

    Raises:
        ValueError: bad input, with the planner's one-line message.
    """
    from hf_dp.accounting import planner

    return list(planner.plan(
        users=_whole(num_users, "users"), examples_per_user=_whole(examples_per_user, "examples per user"),
        units_per_step=float(units_per_step), steps=_whole(steps, "steps"), target_epsilon=float(target_epsilon),
        delta=float(delta), noise_multiplier=None if noise_multiplier is None else float(noise_multiplier),
    ))


def _whole(value, name: str) -> int:
    if value is None or float(value) != int(float(value)):
        raise AppError(f"{name} must be a whole number, got {value!r}.")
    return int(float(value))


# Columns of the planner's rows shown in the Budget tab, with their headers.
PLAN_COLUMNS = (
    ("label", "mechanism"), ("privacy_unit", "unit"), ("contribution_bound", "G"), ("sample_rate", "q"),
    ("units_per_step", "units / step"), ("noise_multiplier", "σ needed"),
    ("noise_std", "noise std (σ / units)"), ("epsilon_at_fixed_noise", "ε at fixed σ"), ("note", "note"),
)


def _row_mechanism(row: Mapping) -> str | None:
    mode = row.get("mode")
    return None if mode is None else str(mode)


def expected_accuracy_cost(runs: Sequence[RunRecord], target_epsilon: float, method: str) -> dict | None:
    """The metric expected at `target_epsilon`, read off finished runs; `None` when there is nothing to read.

    Interpolates the measured metric linearly in log ε between the two nearest DP runs of `method` (of any DP
    method when `method` has none), each run placed at its target ε (the ε it spent when it has no target); outside the measured range it takes the nearest run and says so. The cost
    is measured against the non-private run, the gain against the public-only baseline, when present.

    Returns:
        `dict` with `metric_name`, `metric`, `method_used`, `points` ([(ε, metric)]), `extrapolated`,
        `nonprivate`, `baseline`, `cost` (non-private − expected, for accuracy; expected − non-private for
        perplexity), or `None`.
    """
    study = [r for r in runs if not r.from_app]
    dp_runs = [r for r in study if r.method in DP_METHODS and _positive(r.result.get("epsilon"))
               and r.result.get("metric") is not None]
    if not dp_runs:
        return None
    metric_name = _main_metric(dp_runs)
    study = [r for r in study if r.result.get("metric_name", "accuracy") == metric_name]
    dp_runs = [r for r in dp_runs if r.result.get("metric_name", "accuracy") == metric_name]
    same = [r for r in dp_runs if r.method == method]
    used = same or dp_runs
    # A run is placed at the ε it aimed for (what the user types here), else at the ε it spent.
    points = sorted((float(r.result.get("target_epsilon") or r.result["epsilon"]), float(r.result["metric"]))
                    for r in used)
    target = float(target_epsilon)
    extrapolated = target < points[0][0] or target > points[-1][0]
    if target <= points[0][0]:
        metric = points[0][1]
    elif target >= points[-1][0]:
        metric = points[-1][1]
    else:
        for (e0, m0), (e1, m1) in zip(points, points[1:]):
            if e0 <= target <= e1:
                t = 0.0 if e1 == e0 else (math.log(target) - math.log(e0)) / (math.log(e1) - math.log(e0))
                metric = m0 + t * (m1 - m0)
                break
    nonprivate = next((float(r.result["metric"]) for r in study if r.method == "non-private"), None)
    baseline = next((float(r.result["metric"]) for r in study if r.is_baseline), None)
    if baseline is None:
        baseline = next((float(r.result["baseline_metric"]) for r in used
                         if r.result.get("baseline_metric") is not None), None)
    lower_is_better = metric_name == "perplexity"
    cost = None
    if nonprivate is not None:
        cost = (metric - nonprivate) if lower_is_better else (nonprivate - metric)
    return {
        "metric_name": metric_name, "metric": metric, "method_used": method if same else "any DP method",
        "points": points, "extrapolated": extrapolated, "nonprivate": nonprivate, "baseline": baseline,
        "cost": cost, "lower_is_better": lower_is_better,
    }


def _main_metric(runs: Sequence[RunRecord]) -> str:
    """The metric the plot and the estimate use when runs of several tasks share a folder (accuracy first)."""
    names = [r.result.get("metric_name", "accuracy") for r in runs]
    return "accuracy" if "accuracy" in names else (names[0] if names else "accuracy")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _rows_table(rows: Sequence[Mapping], highlight: str | None) -> str:
    if not rows:
        return ""
    columns = [(key, header) for key, header in PLAN_COLUMNS if any(key in row for row in rows)]
    lines = ["| " + " | ".join(header for _, header in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [_fmt(row.get(key)) if row.get(key) != "" else "" for key, _ in columns]
        if highlight is not None and _row_mechanism(row) == highlight:
            cells = [f"**{c}**" if c else c for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cost_markdown(cost: dict | None, target_epsilon: float, results_dir, mechanism: str) -> str:
    if cost is None:
        return (f"**Expected accuracy cost:** no finished DP runs in `{results_dir}/` to estimate it from. "
                "Run `hf-dp demo` (or `hf-dp demo --grid` for several ε) and reload; the Train tab's quick runs "
                "are not used for this estimate.")
    name = cost["metric_name"]
    measured = ", ".join(f"ε={e:.3g}: {m:.3f}" for e, m in cost["points"])
    text = (f"**Expected {name} at ε = {target_epsilon:.3g}:** {cost['metric']:.3f} "
            f"(from {cost['method_used']} runs in `{results_dir}/`: {measured}")
    text += "; outside the measured range, nearest run shown)" if cost["extrapolated"] else ", interpolated in log ε)"
    if cost["cost"] is not None:
        word = "higher" if cost["lower_is_better"] else "lower"
        text += (f". **Cost of privacy:** {abs(cost['cost']):.3f} {name} {word if cost['cost'] >= 0 else 'better'} "
                 f"than non-private fine-tuning ({cost['nonprivate']:.3f})")
    if cost["baseline"] is not None:
        text += f"; public-only baseline: {cost['baseline']:.3f}"
    text += (". These runs used the study's model and data: with other data, model or settings the cost will "
             "differ.")
    if _study_is_quick(results_dir):
        text += " ⚠️ The results come from a `--quick` study: their numbers mean nothing."
    if cost["method_used"] != mechanism:
        text += f" (No {mechanism.upper()} runs were found, so all DP runs were used.)"
    return text


def budget_view(results_dir, epsilon: float, delta: float, privacy_unit: str, sampling: str, num_users: float,
                examples_per_user: float, units_per_step: float, steps: float,
                noise_multiplier: float | None = None) -> tuple[str, str]:
    """The Budget tab: (headline markdown, table markdown). Errors come back as one line in the headline."""
    try:
        mechanism = mechanism_of(privacy_unit, sampling)
        if epsilon is None or delta is None:
            raise AppError("Set ε and δ.")
        if noise_multiplier is not None and not noise_multiplier > 0:
            noise_multiplier = None
        rows = plan_budget(target_epsilon=epsilon, delta=delta, num_users=num_users,
                           examples_per_user=examples_per_user, units_per_step=units_per_step, steps=steps,
                           noise_multiplier=noise_multiplier)
        row = next(r for r in rows if _row_mechanism(r) == mechanism)
    except Exception as error:  # the planner's ValueError, AppError, anything: one line in the page
        return _error_md(error), ""
    label = {"uls": "ULS (user-level sampling)", "els": "ELS (example-level sampling, MoG accountant)",
             "example": "example-level DP-SGD (protects rows, not users)"}[mechanism]
    headline = [f"### {label} at ε = {float(epsilon):.3g}, δ = {float(delta):.2g}"]
    sigma = row.get("noise_multiplier")
    if sigma is None:
        reason = f" ({row['note']})" if row.get("note") else ""
        headline.append(_error_md(f"Impossible budget: no noise multiplier reaches ε = {float(epsilon):.3g} with "
                                  f"these settings{reason}. Raise ε, or lower the units per step or the steps."))
    else:
        headline.append(f"**Noise multiplier needed: σ = {_fmt(sigma, '.4g')}**")
    details = []
    if row.get("contribution_bound") is not None:
        details.append(f"recommended contribution bound **G = {row['contribution_bound']}**")
    unit_word = "users" if mechanism == "uls" else "examples"
    details.append(f"sample rate q = {_fmt(row.get('sample_rate'), '.4g')} "
                   f"({_fmt(row.get('units_per_step'), '.4g')} {unit_word} per step), {row.get('steps')} steps")
    if row.get("epsilon_at_fixed_noise") is not None:
        details.append(f"at the fixed σ = {_fmt(row.get('fixed_noise_multiplier'), '.3g')} it would spend "
                       f"ε = {_fmt(row['epsilon_at_fixed_noise'], '.3g')}")
    headline.append("; ".join(details) + ".")
    if mechanism == "example":
        headline.append("⚠️ Example-level DP protects single rows: a user with many rows is not protected as a "
                        "whole.")
    try:
        cost = expected_accuracy_cost(list_runs(results_dir), float(epsilon), mechanism)
        headline.append(_cost_markdown(cost, float(epsilon), results_dir, mechanism))
    except Exception as error:
        headline.append(_error_md(f"Could not read the runs in {results_dir}/: {_one_line(error)}"))
    return "\n\n".join(headline), _rows_table(rows, mechanism)


# ----------------------------------------------------------------------------------------------------------
# Train tab: a short run in a background thread, progress through a TrainerCallback and a queue
# ----------------------------------------------------------------------------------------------------------


def _queue_callback_class():
    from transformers import TrainerCallback

    class QueueCallback(TrainerCallback):
        """Puts (event, fields) on a queue at each step and log: step, max_steps, ε spent, loss."""

        def __init__(self, events: queue.Queue):
            self.events = events

        def on_train_begin(self, args, state, control, **kwargs):
            self.events.put(("begin", {"step": state.global_step, "max_steps": state.max_steps}))

        def on_step_end(self, args, state, control, **kwargs):
            self.events.put(("step", {"step": state.global_step, "max_steps": state.max_steps}))

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            fields = {"step": state.global_step, "max_steps": state.max_steps}
            if "dp/epsilon" in logs:
                fields["epsilon"] = float(logs["dp/epsilon"])
            if "loss" in logs:
                fields["loss"] = float(logs["loss"])
            self.events.put(("log", fields))

    return QueueCallback


@dataclasses.dataclass
class TrainingSettings:
    """What the Train tab asks for; the rest of the run follows the study's settings on a small subset."""

    method: str = "uls"
    target_epsilon: float = 8.0
    max_train_users: int = 96
    max_steps: int = 8
    expected_batch_size: int = 24
    max_eval_examples: int = 128


class TrainingJob:
    """One background training run with its progress (only one at a time per app).

    Args:
        run_fn (`Callable`): `run_fn(settings, results_dir, callbacks) -> result dict`; defaults to
            [`run_app_training`]. Tests pass a fake.
    """

    def __init__(self, run_fn: Callable | None = None):
        self.run_fn = run_fn or run_app_training
        self.events: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.state: dict = {"status": "idle"}
        self.lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, settings: TrainingSettings, results_dir) -> None:
        with self.lock:
            if self.running:
                raise AppError("A training run is already in progress: wait for it to finish.")
            self.events = queue.Queue()
            self.state = {"status": "starting", "step": 0, "max_steps": settings.max_steps, "epsilon": 0.0,
                          "target_epsilon": settings.target_epsilon if settings.method in DP_METHODS else None,
                          "method": settings.method, "started": time.time()}
            callback = _queue_callback_class()(self.events)
            self.thread = threading.Thread(target=self._work, args=(settings, results_dir, callback),
                                           name="hf-dp-app-training", daemon=True)
            self.thread.start()

    def _work(self, settings, results_dir, callback) -> None:
        try:
            result = self.run_fn(settings, results_dir, [callback])
            self.events.put(("done", {"result": result}))
        except BaseException as error:  # shown in the page as one line
            self.events.put(("error", {"error": _one_line(error)}))

    def poll(self) -> dict:
        """Drain the queue into the state and return a copy (several open pages may poll at once)."""
        with self.lock:
            state = self.state
            while True:
                try:
                    event, fields = self.events.get_nowait()
                except queue.Empty:
                    break
                if event in ("begin", "step", "log"):
                    state["status"] = "training"
                    for key in ("step", "max_steps", "epsilon", "loss"):
                        if fields.get(key) is not None and (key != "max_steps" or fields[key] > 0):
                            state[key] = fields[key]
                elif event == "done":
                    state["status"] = "done"
                    state["result"] = fields["result"]
                elif event == "error":
                    state["status"] = "error"
                    state["error"] = fields["error"]
            return dict(state)


def run_app_training(settings: TrainingSettings, results_dir, callbacks: Sequence) -> dict:
    """A short fine-tuning run of the embedded MiniLM on a subset of the Shakespeare genres.

    Writes `results_dir/app-runs/<run>.json` and the model + privacy card to `results_dir/app-runs/models/<run>/`.
    The guarantee is the DPTrainer's for the rows trained on (a seeded subset of the training roles).
    """
    from hf_dp.workflows.tasks.classification import ClassificationConfig, run_classification

    method = settings.method
    stamp = time.strftime("%H%M%S")
    run = f"app-{method}-{stamp}" if method == "non-private" else f"app-{method}-eps{settings.target_epsilon:g}-{stamp}"
    config = ClassificationConfig(
        run=run, method=method, results_dir=str(Path(results_dir) / APP_RUNS_DIR),
        target_epsilon=float(settings.target_epsilon) if method in DP_METHODS else None,
        max_train_users=int(settings.max_train_users), max_eval_examples=int(settings.max_eval_examples),
        max_steps=int(settings.max_steps), expected_batch_size=int(settings.expected_batch_size),
        max_length=32, use_lora=True, lora_target_modules=["query", "value"], contribution_bound=2,
        per_device_train_batch_size=64, nonprivate_batch_size=16, progress=False,
    )
    training_args = config.training_arguments()
    training_args.logging_steps = 1  # ε and loss at every step, for the progress bar
    return run_classification(config, training_args, callbacks=list(callbacks))


def progress_html(state: Mapping) -> str:
    """The Train tab's progress bar and status line (HTML)."""
    status = state.get("status", "idle")
    if status == "idle":
        return "<div id='train-progress'>No run started.</div>"
    total = max(int(state.get("max_steps") or 0), 1)
    step = min(int(state.get("step") or 0), total)
    fraction = 1.0 if status == "done" else step / total
    eps = state.get("epsilon")
    target = state.get("target_epsilon")
    if state.get("method") == "non-private":
        eps_text = "no privacy guarantee (non-private)"
    else:
        eps_text = f"ε spent {eps:.3g}" + (f" of {target:g}" if target else "") if eps is not None else "ε spent 0"
    loss = f", loss {state['loss']:.3f}" if state.get("loss") is not None else ""
    elapsed = time.time() - state.get("started", time.time())
    words = {"starting": "Loading data and model…", "training": "Training", "done": "Finished", "error": "Failed"}
    color = {"error": "#c0392b", "done": "#2e7d32"}.get(status, "#1f6feb")
    return (
        "<div id='train-progress'>"
        f"<div style='background:#e5e7eb;border-radius:6px;height:18px;width:100%;overflow:hidden'>"
        f"<div style='background:{color};height:18px;width:{100 * fraction:.1f}%'></div></div>"
        f"<div style='margin-top:6px'>{words.get(status, status)}: step {step}/{total}, {eps_text}{loss} "
        f"({elapsed:.0f} s)</div></div>"
    )


def _job_status_markdown(state: Mapping) -> str:
    if state.get("status") == "error":
        return _error_md(f"Training failed: {state.get('error')}")
    if state.get("status") == "done":
        result = state.get("result") or {}
        eps = result.get("epsilon")
        eps_text = "no guarantee (non-private)" if eps is None else f"ε = {eps:.3g}, δ = {result.get('delta'):.2g}"
        return (f"**Finished `{result.get('run')}`**: {result.get('metric_name', 'metric')} "
                f"{_fmt(result.get('metric'), '.3f')} (public-only baseline {_fmt(result.get('baseline_metric'), '.3f')}), "
                f"{eps_text}. It is listed in the Compare and Results tabs as `{APP_RUNS_DIR}/{result.get('run')}`. "
                "Quick runs on small subsets: the numbers are noisy.")
    return ""


# ----------------------------------------------------------------------------------------------------------
# Compare tab
# ----------------------------------------------------------------------------------------------------------


class _ModelCache:
    """A few loaded models, least recently used dropped first (loading is the slow part of a comparison)."""

    def __init__(self, size: int = 4):
        self.size = size
        self.items: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key, load: Callable):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        value = load()
        with self.lock:
            self.items[key] = value
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return value


_MODELS = _ModelCache()


def _load_classifier(path: Path):
    from hf_dp.workflows.tasks.classification import load_classifier

    if not path.is_dir():
        raise AppError(f"The run's model folder {path} does not exist (was the results folder moved?).")
    model, tokenizer = load_classifier(path)
    return model.eval(), tokenizer


def _label_names(run: RunRecord, model=None) -> list[str]:
    names = run.result.get("label_names") or getattr(model, "label_names", None)
    if names:
        return [str(n) for n in names]
    if model is not None and getattr(model.config, "id2label", None):
        return [model.config.id2label[i] for i in sorted(model.config.id2label)]
    raise AppError(f"Run {run.name} does not record its label names.")


def _zero_shot(run: RunRecord, label_names: Sequence[str]):
    """The run's public-only baseline: its pretrained encoder, zero-shot against the label descriptions."""
    from hf_dp.workflows.tasks.classification import LABEL_DESCRIPTIONS, EmbeddingClassifier

    config = run.result.get("config") or {}
    model_path = config.get("model_name_or_path")
    descriptions = config.get("label_descriptions")
    if descriptions is None and set(label_names) <= set(LABEL_DESCRIPTIONS):
        descriptions = LABEL_DESCRIPTIONS
    settings = dict(max_length=int(config.get("max_length") or 128), logit_scale=float(config.get("logit_scale") or 20.0))
    key = ("zero-shot", model_path, json.dumps(descriptions, sort_keys=True), tuple(label_names),
           tuple(sorted(settings.items())))
    return _MODELS.get(key, lambda: EmbeddingClassifier.from_descriptions(model_path, label_names, descriptions,
                                                                          **settings))


def _probabilities(model, tokenizer, text: str, max_length: int) -> list[float]:
    import torch

    with torch.no_grad():
        encoded = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
        return torch.softmax(model(**encoded).logits[0].float(), dim=-1).tolist()


def _classify(run: RunRecord, text: str) -> tuple[dict, dict]:
    path = run.model_path
    if path is None:
        raise AppError(f"{run.name} is the public-only baseline (no fine-tuned model): pick a fine-tuned run.")
    model, tokenizer = _MODELS.get(("classifier", str(path.resolve())), lambda: _load_classifier(path))
    names = _label_names(run, model)
    max_length = int((run.result.get("config") or {}).get("max_length") or 128)
    dp = dict(zip(names, _probabilities(model, tokenizer, text, max_length)))
    zero_shot = _zero_shot(run, names)
    baseline = dict(zip(names, _probabilities(zero_shot, zero_shot.tokenizer, text, max_length)))
    return baseline, dp


def _load_causal_lm(path_or_name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path_or_name).eval()
    tokenizer = AutoTokenizer.from_pretrained(path_or_name)
    return model, tokenizer


def _generate(model, tokenizer, text: str, max_new_tokens: int) -> tuple[str, dict]:
    import torch

    encoded = tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits[0, -1].float()
        top = torch.topk(torch.softmax(logits, dim=-1), k=min(5, logits.shape[-1]))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        output = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    continuation = tokenizer.decode(output[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
    next_tokens = {}
    for p, i in zip(top.values.tolist(), top.indices.tolist()):
        token = repr(tokenizer.decode([i]))
        next_tokens[token] = next_tokens.get(token, 0.0) + float(p)
    return continuation, next_tokens


def _compare_causal_lm(run: RunRecord, text: str, max_new_tokens: int = 30):
    path = run.model_path
    if path is None or not path.is_dir():
        raise AppError(f"{run.name} has no saved model to generate with.")
    config = run.result.get("config") or {}
    base = config.get("model_name_or_path") or run.result.get("base_model")
    try:
        base_model, base_tokenizer = _MODELS.get(("lm", str(base)), lambda: _load_causal_lm(str(base)))
    except Exception as error:
        raise AppError(f"The base model {base!r} is not available offline ({_one_line(error)}).") from error
    dp_model, dp_tokenizer = _MODELS.get(("lm", str(path.resolve())), lambda: _load_causal_lm(str(path)))
    base_text, base_next = _generate(base_model, base_tokenizer, text, max_new_tokens)
    dp_text, dp_next = _generate(dp_model, dp_tokenizer, text, max_new_tokens)
    return base_next, dp_next, base_text, dp_text


def compare_view(results_dir, run_name: str | None, text: str | None) -> dict:
    """The Compare tab for one run and one text.

    Returns:
        `dict` with `baseline` and `dp` (label -> probability; next token -> probability for causal LMs),
        `baseline_text` and `dp_text` (generations, causal LMs only), `causal_lm`, `header` (markdown) and
        `error` (one line, or `""`).
    """
    out = {"baseline": None, "dp": None, "baseline_text": "", "dp_text": "", "causal_lm": False,
           "header": "", "error": ""}
    try:
        run = _find_run(results_dir, run_name)
        if not text or not text.strip():
            raise AppError("Type or pick a text to compare.")
        text = text.strip()
        if run.is_causal_lm:
            out["causal_lm"] = True
            out["baseline"], out["dp"], out["baseline_text"], out["dp_text"] = _compare_causal_lm(run, text)
        else:
            out["baseline"], out["dp"] = _classify(run, text)
        eps = run.result.get("epsilon")
        guarantee = ("no privacy guarantee" if run.method == "non-private"
                     else f"({_fmt(eps, '.3g')}, {_fmt(run.result.get('delta'), '.2g')})-DP, "
                          f"{(run.result.get('privacy') or {}).get('privacy_unit', '?')}-level")
        out["header"] = (f"**{run.name}**: {METHOD_NAMES.get(run.method, run.method)}, {guarantee}; "
                         f"test {run.result.get('metric_name', 'metric')} {_fmt(run.result.get('metric'), '.3f')} "
                         f"vs public-only baseline {_fmt(run.result.get('baseline_metric'), '.3f')}.")
    except Exception as error:
        out["error"] = _error_md(error)
    return out


# ----------------------------------------------------------------------------------------------------------
# Results tab
# ----------------------------------------------------------------------------------------------------------


def privacy_utility_figure(runs: Sequence[RunRecord]):
    """Metric against ε spent (log x) per DP method, the baseline as a line, non-private as a point at ε = ∞.

    Returns a matplotlib `Figure` (for `gr.Plot`), or `None` when there is no run to plot.
    """
    from matplotlib.figure import Figure

    study = [r for r in runs if not r.from_app and r.result.get("metric") is not None]
    if not study:
        return None
    metric_name = _main_metric(study)
    study = [r for r in study if r.result.get("metric_name", "accuracy") == metric_name]
    fig = Figure(figsize=(7.5, 4.6), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    styles = {"uls": ("o", "tab:blue"), "els": ("s", "tab:orange"), "example": ("^", "tab:green")}
    epsilons = []
    for method, (marker, color) in styles.items():
        points = sorted((float(r.result["epsilon"]), float(r.result["metric"])) for r in study
                        if r.method == method and _positive(r.result.get("epsilon")))
        if points:
            xs, ys = zip(*points)
            epsilons += xs
            ax.plot(xs, ys, marker=marker, color=color, label=METHOD_NAMES[method])
    low, high = (min(epsilons), max(epsilons)) if epsilons else (1.0, 8.0)
    right = high * 2.5
    baseline = next((r for r in study if r.is_baseline), None)
    baseline_value = float(baseline.result["metric"]) if baseline else next(
        (float(r.result["baseline_metric"]) for r in study if r.result.get("baseline_metric") is not None), None)
    if baseline_value is not None:
        ax.axhline(baseline_value, color="gray", linestyle="--",
                   label=f"public-only baseline ({baseline_value:.3f})")
    nonprivate = next((r for r in study if r.method == "non-private"), None)
    if nonprivate is not None:
        value = float(nonprivate.result["metric"])
        ax.plot([right], [value], marker="*", markersize=14, color="black", linestyle="none",
                label=f"non-private, ε = ∞ ({value:.3f})")
    ax.set_xscale("log")
    ax.set_xlim(low / 1.8, right * 1.6)
    ticks = [t for t in (0.25, 0.5, 1, 2, 3, 4, 8, 16, 32, 64) if low / 1.8 <= t <= high * 1.3]
    ax.minorticks_off()
    ax.set_xticks(ticks + [right])
    ax.set_xticklabels([f"{t:g}" for t in ticks] + ["∞"])
    ax.set_xlabel("ε spent (log scale)")
    ax.set_ylabel(f"test {metric_name}")
    quick = _study_is_quick(study[0].folder)
    ax.set_title("Privacy / utility" + (" (quick study: the numbers mean nothing)" if quick else ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def privacy_card_markdown(results_dir, run_name: str | None) -> str:
    """The selected run's privacy card (its README.md without the YAML front matter), or a one-line reason."""
    try:
        run = _find_run(results_dir, run_name)
        path = run.model_path
        if path is None:
            return (f"**{run.name}** is the public-only baseline: the pretrained model used without any private "
                    "data, so it has no privacy card.")
        readme = path / "README.md"
        if not readme.is_file():
            raise AppError(f"{readme} does not exist: this run has no privacy card.")
        from huggingface_hub import ModelCard

        return ModelCard.load(readme).text
    except Exception as error:
        return _error_md(error)


def results_overview_markdown(results_dir) -> str:
    runs = list_runs(results_dir)
    if not runs:
        return _error_md(f"No finished runs in {results_dir}/ yet: run `hf-dp demo` (or `hf-dp demo --grid`), "
                         "or start a run in the Train tab, then reload.")
    lines = ["| run | method | ε | δ | metric | baseline |", "|---|---|---|---|---|---|"]
    for run in runs:
        r = run.result
        eps = "∞" if run.method == "non-private" else _fmt(r.get("epsilon"), ".3g")
        lines.append(f"| {run.name} | {METHOD_NAMES.get(run.method, run.method)} | {eps} | "
                     f"{_fmt(r.get('delta'), '.2g')} | {r.get('metric_name', '')} {_fmt(r.get('metric'), '.3f')} | "
                     f"{_fmt(r.get('baseline_metric'), '.3f')} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The page
# ----------------------------------------------------------------------------------------------------------


def _eps_from_log2(value: float) -> float:
    return round(2.0 ** float(value), 2)


def _log2_from_eps(value: float | None) -> float:
    if value is None or not value > 0:
        return 3.0
    return math.log2(min(max(float(value), EPSILON_RANGE[0]), EPSILON_RANGE[1]))


def build_app(results_dir: str | os.PathLike = "results", *, training_job: TrainingJob | None = None):
    """Build the Gradio page over `results_dir` (finished runs are read from disk at each action).

    Args:
        results_dir (`str` or `os.PathLike`, *optional*, defaults to `"results"`): the study's output folder.
        training_job ([`TrainingJob`], *optional*): the Train tab's runner (tests pass one with a fake run).

    Returns:
        `gradio.Blocks`: call `.launch()` on it, or use [`serve`].
    """
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no version check, no telemetry
    import gradio as gr

    results_dir = str(results_dir)
    job = training_job or TrainingJob()

    with gr.Blocks(title="hf_dp: user-level DP fine-tuning", analytics_enabled=False) as demo:
        gr.Markdown(
            "# hf_dp — user-level differentially private fine-tuning\n"
            f"Results folder: `{results_dir}`. Set a privacy budget, train a short run, compare the DP model "
            "with the public-only baseline, and read each run's privacy card."
        )
        with gr.Tabs():
            # ---- Budget -------------------------------------------------------------------------
            with gr.Tab("Budget", id="budget"):
                with gr.Row():
                    with gr.Column(scale=1):
                        eps_log2 = gr.Slider(math.log2(EPSILON_RANGE[0]), math.log2(EPSILON_RANGE[1]), value=3.0,
                                             step=0.05, label="log₂ ε (slider: 0.5 … 16)",
                                             info="−1 → ε 0.5, 0 → 1, 1.58 → 3, 3 → 8, 4 → 16",
                                             elem_id="eps-log2")
                        epsilon = gr.Number(8.0, label="target ε", step=0.1, elem_id="epsilon")
                        delta = gr.Number(1e-5, label="δ (below 1 / users)", step=1e-6, elem_id="delta")
                        unit = gr.Radio(["user", "example"], value="user", label="privacy unit",
                                        elem_id="privacy-unit")
                        sampling = gr.Radio(["ULS", "ELS"], value="ULS", label="sampling (user level)",
                                            elem_id="sampling")
                    with gr.Column(scale=1):
                        users = gr.Number(1101, label="users", precision=0, minimum=1, elem_id="users")
                        per_user = gr.Number(14, label="examples per user", precision=0, minimum=1,
                                             elem_id="examples-per-user")
                        per_step = gr.Number(175, label="units per step: expected examples processed per step "
                                             "(the compute budget, the same for every mechanism)", minimum=1,
                                             elem_id="units-per-step")
                        steps = gr.Number(40, label="steps", precision=0, minimum=1, elem_id="steps")
                        fixed_sigma = gr.Number(1.0, label="fixed σ (for ‘ε at this σ’)", minimum=0, step=0.05,
                                                elem_id="fixed-sigma")
                budget_md = gr.Markdown(elem_id="budget-result")
                budget_table = gr.Markdown(elem_id="budget-table")

                budget_inputs = [epsilon, delta, unit, sampling, users, per_user, per_step, steps, fixed_sigma]

                def on_budget(*values):
                    return budget_view(results_dir, *values)

                # The slider moves ε (log scale); typing ε moves the slider. Only ε's change recomputes.
                eps_log2.input(_eps_from_log2, eps_log2, epsilon, queue=False, show_progress="hidden")
                epsilon.input(_log2_from_eps, epsilon, eps_log2, queue=False, show_progress="hidden")
                for control in budget_inputs:
                    control.change(on_budget, budget_inputs, [budget_md, budget_table], trigger_mode="always_last",
                                   concurrency_id="budget", concurrency_limit=1)
                demo.load(on_budget, budget_inputs, [budget_md, budget_table])

            # ---- Train --------------------------------------------------------------------------
            with gr.Tab("Train", id="train"):
                gr.Markdown(
                    "A short run of the embedded MiniLM on a small subset of the Shakespeare genres (users are "
                    "speaking roles). It uses the study's recipe (LoRA, 32 tokens); its results go to "
                    f"`{results_dir}/{APP_RUNS_DIR}/`. On 2 CPU cores expect about a minute."
                )
                with gr.Row():
                    train_method = gr.Radio(["uls", "els", "example", "non-private"], value="uls", label="method")
                    train_eps = gr.Number(8.0, label="target ε", minimum=0.1)
                    train_users = gr.Slider(16, 512, value=96, step=8, label="training users (subset)")
                    train_steps = gr.Slider(1, 50, value=8, step=1, label="steps")
                    train_batch = gr.Number(24, label="expected units per step (users for ULS, examples otherwise)",
                                            precision=0, minimum=1)
                start = gr.Button("Start training", variant="primary", elem_id="start-training")
                progress = gr.HTML(progress_html(job.poll()), elem_id="train-progress-box")
                train_status = gr.Markdown(_job_status_markdown(job.poll()))
                timer = gr.Timer(1.0, active=job.running)

                def on_start(method, eps, n_users, n_steps, batch):
                    try:
                        settings = TrainingSettings(method=method, target_epsilon=float(eps or 8.0),
                                                    max_train_users=int(n_users), max_steps=int(n_steps),
                                                    expected_batch_size=int(batch or 24))
                        job.start(settings, results_dir)
                    except Exception as error:
                        gr.Warning(_one_line(error))
                        return progress_html(job.poll()), _error_md(error), gr.Timer(active=job.running)
                    return progress_html(job.poll()), "", gr.Timer(active=True)

                def on_tick():
                    state = job.poll()
                    active = state.get("status") in ("starting", "training")
                    return progress_html(state), _job_status_markdown(state), gr.Timer(active=active)

                start.click(on_start, [train_method, train_eps, train_users, train_steps, train_batch],
                            [progress, train_status, timer])
                timer.tick(on_tick, None, [progress, train_status, timer])

            # ---- Compare ------------------------------------------------------------------------
            with gr.Tab("Compare", id="compare"):
                with gr.Row():
                    compare_run = gr.Dropdown(choices=[], label="fine-tuned run", elem_id="compare-run", scale=3)
                    refresh = gr.Button("Reload runs", scale=1)
                compare_text = gr.Textbox(EXAMPLE_TEXTS[0], label="text", lines=2, elem_id="compare-text")
                gr.Examples([[t] for t in EXAMPLE_TEXTS], [compare_text], label="pick a text")
                compare_button = gr.Button("Compare", variant="primary", elem_id="compare-button")
                compare_header = gr.Markdown(elem_id="compare-header")
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("#### Public-only baseline (no private data)")
                        baseline_label = gr.Label(label="baseline: class / next-token probabilities",
                                                  num_top_classes=5, elem_id="baseline-label")
                        baseline_text = gr.Textbox(label="baseline generation", visible=False,
                                                   elem_id="baseline-text")
                    with gr.Column():
                        gr.Markdown("#### DP fine-tuned model")
                        dp_label = gr.Label(label="DP model: class / next-token probabilities",
                                            num_top_classes=5, elem_id="dp-label")
                        dp_text = gr.Textbox(label="DP model generation", visible=False, elem_id="dp-text")

                def on_compare(run_name, text):
                    out = compare_view(results_dir, run_name, text)
                    if out["error"]:
                        return (out["error"], None, None, gr.Textbox(visible=False), gr.Textbox(visible=False))
                    lm = out["causal_lm"]
                    return (out["header"], out["baseline"], out["dp"],
                            gr.Textbox(value=out["baseline_text"], visible=lm),
                            gr.Textbox(value=out["dp_text"], visible=lm))

                compare_button.click(on_compare, [compare_run, compare_text],
                                     [compare_header, baseline_label, dp_label, baseline_text, dp_text])

            # ---- Results ------------------------------------------------------------------------
            with gr.Tab("Results", id="results"):
                overview = gr.Markdown(elem_id="results-overview")
                plot = gr.Plot(label="privacy / utility", elem_id="privacy-utility-plot")
                card_run = gr.Dropdown(choices=[], label="privacy card of run", elem_id="card-run")
                card_md = gr.Markdown(elem_id="privacy-card")

                card_run.change(lambda name: privacy_card_markdown(results_dir, name), card_run, card_md)

        def on_reload():
            runs = list_runs(results_dir)
            with_model = [(r.label(), r.name) for r in runs if r.model_path is not None]
            default = _default_run(runs)
            dp_first = default.name if default is not None else None
            try:
                figure = privacy_utility_figure(runs)
            except Exception:  # a plot is decoration: the table still shows the numbers
                figure = None
            return (gr.Dropdown(choices=with_model, value=dp_first),
                    gr.Dropdown(choices=with_model, value=dp_first),
                    results_overview_markdown(results_dir), figure)

        reload_outputs = [compare_run, card_run, overview, plot]
        demo.load(on_reload, None, reload_outputs)
        refresh.click(on_reload, None, reload_outputs)
        train_status.change(on_reload, None, reload_outputs)
    return demo


def serve(results_dir: str | os.PathLike = "results", *, host: str = "127.0.0.1", port: int | None = 7860,
          share: bool = False, block: bool = True, demo=None, **launch_kwargs):
    """Build (unless `demo` is given) and launch the app; returns the `gradio.Blocks` (serving in the background
    when `block=False`: call `.close()` to stop it)."""
    demo = demo if demo is not None else build_app(results_dir)
    demo.queue(default_concurrency_limit=2)
    demo.launch(server_name=host, server_port=port, share=share, prevent_thread_lock=not block, show_error=False,
                quiet=not block, ssr_mode=False, inbrowser=False, **launch_kwargs)
    return demo


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The `hf-dp app` flags (pass a subparser to add them to it)."""
    parser = parser or argparse.ArgumentParser(
        prog="hf-dp app",
        description="Gradio app: explore a privacy budget, train a short DP run, compare DP models with the "
                    "public-only baseline, read privacy cards.",
    )
    parser.add_argument("--results-dir", default="results", help="The study's output folder (hf-dp demo).")
    parser.add_argument("--port", type=int, default=7860, help="Port to serve on.")
    parser.add_argument("--host", default="127.0.0.1", help="Interface to bind (0.0.0.0 exposes it to the network).")
    parser.add_argument("--share", action="store_true", help="Ask gradio for a public share link (needs internet).")
    return parser


def main(argv=None) -> int:
    """Entry point of `python app/app.py` and `python -m hf_dp.workflows.app` (`hf-dp app` calls [`run`])."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Serve the app with parsed [`build_parser`] flags until interrupted; 1 with one line when it cannot bind."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        serve(args.results_dir, host=args.host, port=args.port, share=args.share, block=True)
    except OSError as error:  # port in use, cannot bind
        print(f"hf-dp app: error: {_one_line(error)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
