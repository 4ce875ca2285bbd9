"""The Budget tab: the planner's numbers for a budget, and the accuracy cost read off finished runs.

No privacy math here: σ, the contribution bound G, the sample rate and `expected_batch_size` (users per step for
ULS, examples per step otherwise; its unit is the planner's `sampled_unit`) come from
[`hf_dp.accounting.planner.plan`], called with the compute budget `examples_per_step` (expected examples processed
per step, the same for every mechanism). The *expected accuracy cost* is interpolated between measured runs.
"""

from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence

from hf_dp.formatting import format_number
from hf_dp.vocabulary import DP_MECHANISMS, MECHANISMS, mechanism_of
from hf_dp.vocabulary import lower_is_better as is_lower_better

from .common import AppError, error_md, mechanism_label, one_line
from .results import RunRecord, is_positive, list_runs, main_metric, study_is_quick

# Columns of the planner's rows shown in the Budget tab, with their headers (the planner's keys).
PLAN_COLUMNS = (
    ("mechanism", "mechanism"), ("privacy_unit", "privacy_unit"), ("contribution_bound", "G"),
    ("sample_rate", "q"), ("expected_batch_size", "expected_batch_size"), ("noise_multiplier", "σ needed"),
    ("noise_std", "noise std (σ / expected_batch_size)"), ("epsilon_at_fixed_noise", "ε at fixed σ"),
    ("sampler_delta", "δ the sampler's finite support adds"),
    ("note", "note"),
)


def plan_budget(*, target_epsilon: float, target_delta: float, users: int, examples_per_user: int,
                examples_per_step: float, steps: int, noise_multiplier: float | None = None) -> list[dict]:
    """The planner's rows (one per mechanism: `"uls"`, `"els"`, `"example"`) for these settings.

    A thin call into [`hf_dp.accounting.planner.plan`] (its docstring lists the keys); the numbers are the planner's.
    `examples_per_step` is the compute budget, expected examples processed per step, the same for every mechanism.

    Raises:
        ValueError: bad input, with the planner's one-line message.
    """
    from hf_dp.accounting import planner

    return list(planner.plan(
        users=_whole(users, "users"), examples_per_user=_whole(examples_per_user, "examples_per_user"),
        examples_per_step=float(examples_per_step), steps=_whole(steps, "steps"),
        target_epsilon=float(target_epsilon), target_delta=float(target_delta),
        noise_multiplier=None if noise_multiplier is None else float(noise_multiplier),
    ))


def _whole(value, name: str) -> int:
    if value is None or not math.isfinite(float(value)) or not float(value).is_integer():
        raise AppError(f"{name} must be a whole number, got {value!r}.")
    return int(float(value))


def batch_text(row: Mapping) -> str:
    """`expected_batch_size` with its unit: "12.5 users" (ULS), "40 examples" (ELS, example-level)."""
    unit = row.get("sampled_unit") or MECHANISMS[str(row.get("mechanism"))].sampled_unit
    return f"{format_number(row.get('expected_batch_size'), '.4g')} {unit}"


def _cell(row: Mapping, key: str) -> str:
    if key == "mechanism":
        return mechanism_label(row.get("mechanism"))
    if key == "expected_batch_size":
        return batch_text(row)
    value = row.get(key)
    return "" if value == "" else format_number(value)


def plan_table(rows: Sequence[Mapping], highlight: str | None) -> str:
    """The planner's rows as a markdown table, the row of mechanism `highlight` in bold."""
    if not rows:
        return ""
    columns = [(key, header) for key, header in PLAN_COLUMNS if any(key in row for row in rows)]
    lines = ["| " + " | ".join(header for _, header in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [_cell(row, key) for key, _ in columns]
        if highlight is not None and row.get("mechanism") == highlight:
            cells = [f"**{c}**" if c else c for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def impossible_budget(row: Mapping, target_epsilon: float) -> str:
    """One line saying why the planner found no σ for `row`, and what to change."""
    delta, examples, rate = row.get("delta"), row.get("examples_used"), row.get("sample_rate")
    if row.get("mechanism") == "example" and delta and examples and delta >= 1.0 / examples:
        return (f"Impossible budget: example-level DP needs target_delta below 1/examples = {1.0 / examples:.2g} "
                f"({examples} examples), got {delta:.2g}: lower target_delta.")
    if rate is not None and rate > 1:
        return (f"Impossible budget: expected_batch_size = {batch_text(row)} per step is more than there are "
                f"(sample rate {rate:.3g} > 1): lower examples_per_step.")
    reason = f" ({row['note']})" if row.get("note") else ""
    return (f"Impossible budget: no noise multiplier reaches ε = {float(target_epsilon):.3g} with these "
            f"settings{reason}. Raise target_epsilon, or lower examples_per_step or steps.")


def expected_accuracy_cost(runs: Sequence[RunRecord], target_epsilon: float, mechanism: str) -> dict | None:
    """The result expected at `target_epsilon`, read off finished runs; `None` when there is nothing to read.

    Interpolates the measured `eval_result` linearly in log ε between the two nearest DP runs of `mechanism` (of
    any DP mechanism when `mechanism` has none), each run placed at its target ε (the ε it spent when it has no
    target); outside the measured range it takes the nearest run and says so. The cost is measured against the
    non-private run, the gain against the public-only baseline, when present. The Train tab's runs are left out.

    Returns:
        `dict` with `metric_name`, `expected_result`, `mechanism_used` (`mechanism`, or `"any DP mechanism"`),
        `points` ([(ε, eval_result)]), `extrapolated`, `non_private_result`, `baseline_result`, `cost`
        (non-private − expected, for accuracy; expected − non-private for perplexity) and `lower_is_better`,
        or `None`.

    Raises:
        ValueError: `target_epsilon` is not a finite number > 0, or `mechanism` is not a DP key of
            [`~hf_dp.vocabulary.MECHANISMS`].
    """
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, numbers.Real) \
            or not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon={target_epsilon!r}: use a finite number > 0 (e.g. 8).")
    if mechanism not in DP_MECHANISMS:
        raise ValueError(f"mechanism={mechanism!r}: use one of {DP_MECHANISMS}.")
    study = [r for r in runs if not r.from_app]
    dp_runs = [r for r in study if r.is_dp and is_positive(r.result.get("epsilon")) and r.eval_result is not None]
    if not dp_runs:
        return None
    metric_name = main_metric(dp_runs)
    study = [r for r in study if r.metric_name == metric_name]
    dp_runs = [r for r in dp_runs if r.metric_name == metric_name]
    same = [r for r in dp_runs if r.mechanism == mechanism]
    used = same or dp_runs
    # A run is placed at the ε it aimed for (what the user types here), else at the ε it spent.
    points = sorted((float(r.result.get("target_epsilon") or r.result["epsilon"]), r.eval_result) for r in used)
    target = float(target_epsilon)
    extrapolated = target < points[0][0] or target > points[-1][0]
    expected = points[0][1] if target <= points[0][0] else points[-1][1]
    for (e0, m0), (e1, m1) in zip(points, points[1:]):
        if e0 <= target <= e1:
            t = 0.0 if e1 == e0 else (math.log(target) - math.log(e0)) / (math.log(e1) - math.log(e0))
            expected = m0 + t * (m1 - m0)
            break
    non_private = _measured(study, used, "non-private", "non_private_result")
    baseline = _measured(study, used, "public-only", "baseline_result")
    lower_is_better = is_lower_better(metric_name)
    cost = None
    if non_private is not None:
        cost = (expected - non_private) if lower_is_better else (non_private - expected)
    return {
        "metric_name": metric_name, "expected_result": expected,
        "mechanism_used": mechanism if same else "any DP mechanism", "points": points, "extrapolated": extrapolated,
        "non_private_result": non_private, "baseline_result": baseline, "cost": cost,
        "lower_is_better": lower_is_better,
    }


def _measured(study: Sequence[RunRecord], used: Sequence[RunRecord], mechanism: str, key: str) -> float | None:
    """The comparison run's `eval_result`, else the figure the DP runs recorded under `key`."""
    own = next((r.eval_result for r in study if r.mechanism == mechanism and r.eval_result is not None), None)
    if own is not None:
        return own
    return next((float(r.result[key]) for r in used if r.result.get(key) is not None), None)


def cost_markdown(cost: dict | None, target_epsilon: float, results_dir, mechanism: str) -> str:
    """The Budget tab's paragraph on the expected result and the cost of privacy."""
    if cost is None:
        return (f"**Expected accuracy cost:** no finished DP runs in `{results_dir}/` to estimate it from. "
                "Run `hf-dp demo` (or `hf-dp demo --grid` for several ε) and reload; the Train tab's quick runs "
                "are not used for this estimate.")
    name = cost["metric_name"]
    used = cost["mechanism_used"]
    measured = ", ".join(f"ε={e:.3g}: {m:.3f}" for e, m in cost["points"])
    text = (f"**Expected {name} at ε = {target_epsilon:.3g}:** {cost['expected_result']:.3f} "
            f"(from {mechanism_label(used) if used in MECHANISMS else used} runs in `{results_dir}/`: {measured}")
    text += "; outside the measured range, nearest run shown)" if cost["extrapolated"] else ", interpolated in log ε)"
    if cost["cost"] is not None:
        word = "higher" if cost["lower_is_better"] else "lower"
        text += (f". **Cost of privacy:** {abs(cost['cost']):.3f} {name} {word if cost['cost'] >= 0 else 'better'} "
                 f"than non-private fine-tuning ({cost['non_private_result']:.3f})")
    if cost["baseline_result"] is not None:
        text += f"; public-only baseline: {cost['baseline_result']:.3f}"
    text += (". These runs used the study's model and data: with other data, model or settings the cost will "
             "differ.")
    if study_is_quick(results_dir):
        text += " ⚠️ The results come from a `--quick` study: their numbers mean nothing."
    if used != mechanism:
        text += f" (No {mechanism_label(mechanism)} runs were found, so all DP runs were used.)"
    return text


def budget_view(results_dir, target_epsilon: float, target_delta: float, privacy_unit: str, sampling: str,
                users: float, examples_per_user: float, examples_per_step: float, steps: float,
                noise_multiplier: float | None = None) -> tuple[str, str]:
    """The Budget tab: (headline markdown, table markdown). Errors come back as one line in the headline."""
    try:
        mechanism = mechanism_of(privacy_unit, sampling)
        if target_epsilon is None or target_delta is None:
            raise AppError("Set target_epsilon and target_delta.")
        if noise_multiplier is not None and not noise_multiplier > 0:
            noise_multiplier = None
        rows = plan_budget(target_epsilon=target_epsilon, target_delta=target_delta, users=users,
                           examples_per_user=examples_per_user, examples_per_step=examples_per_step, steps=steps,
                           noise_multiplier=noise_multiplier)
        row = next(r for r in rows if r.get("mechanism") == mechanism)
    except Exception as error:  # the planner's ValueError, AppError, anything: one line in the page
        return error_md(error), ""
    epsilon = float(target_epsilon)
    headline = [f"### {MECHANISMS[mechanism].name} at ε = {epsilon:.3g}, δ = {float(target_delta):.2g} + "
                f"{format_number(row.get('sampler_delta'), '.1g')}"]
    sigma = row.get("noise_multiplier")
    if sigma is None:
        headline.append(error_md(impossible_budget(row, epsilon)))
    else:
        headline.append(f"**Noise multiplier needed: σ = {format_number(sigma, '.4g')}**")
    details = []
    if row.get("contribution_bound") is not None:
        details.append(f"recommended contribution bound **G = {row['contribution_bound']}**")
    details.append(f"expected_batch_size = {batch_text(row)} per step (sample rate q = "
                   f"{format_number(row.get('sample_rate'), '.4g')}), {row.get('steps')} steps")
    if row.get("epsilon_at_fixed_noise") is not None:
        details.append(f"at the fixed σ = {format_number(row.get('fixed_noise_multiplier'), '.3g')} it would spend "
                       f"ε = {format_number(row['epsilon_at_fixed_noise'], '.3g')}")
    headline.append("; ".join(details) + ".")
    headline.append(f"The stated δ adds {format_number(row.get('sampler_delta'), '.1g')}, what the noise sampler's "
                    "finite support leaves out (draws reach 14.85σ; planned for up to 10¹¹ trainable parameters).")
    if mechanism == "example":
        headline.append("⚠️ Example-level DP protects single rows: a user with many rows is not protected as a "
                        "whole.")
    try:
        cost = expected_accuracy_cost(list_runs(results_dir), epsilon, mechanism)
        headline.append(cost_markdown(cost, epsilon, results_dir, mechanism))
    except Exception as error:
        headline.append(error_md(f"Could not read the runs in {results_dir}/: {one_line(error)}"))
    return "\n\n".join(headline), plan_table(rows, mechanism)
