"""The Budget tab: the planner's numbers for a budget, and the result measured near that ε by finished runs.

No privacy math here: σ, the contribution bound G, the sample rate, `expected_batch_size` (users per step for
ULS, examples per step otherwise; its unit is the planner's `sampled_unit`) and δ come from
[`hf_dp.mechanism_table.compare`], called with the compute budget `examples_per_step` (expected examples processed
per step, the same for every mechanism). Its rows are memoised by their inputs ([`plan_budget`]): the planner's
numbers do not change, a repeated budget answers at once. The *expected result* is read off measured runs only
([`expected_accuracy_cost`]): between two measured ε it is interpolated in log ε, elsewhere the tab says that
nothing was measured there.

The tab opens on the study's own budget ([`study_budget_defaults`]): the settings its headline DP run recorded
in `results/` (users, rows per user, G, batch, steps, δ), else the chat study's settings
([`~hf_dp.workflows.study_settings.SFT_SETTINGS`]) with the numbers of its data ([`SFT_STUDY_DATA`]).
"""

from __future__ import annotations

import copy
import functools
import html
import math
import numbers
from typing import Mapping, Sequence

from hf_dp.formatting import format_epsilon, format_number
from hf_dp.vocabulary import DP_MECHANISMS, MECHANISMS, mechanism_of
from hf_dp.vocabulary import lower_is_better as is_lower_better

from .common import AppError, error_md, mechanism_label, one_line
from .results import RunRecord, is_positive, list_runs, main_metric, study_is_quick

# The planner's row keys shown in the Budget tab's table (one column per mechanism), with their row headers.
PLAN_ROWS = (
    ("noise_multiplier", "σ needed"), ("contribution_bound", "G (rows kept per user)"),
    ("sample_rate", "q (sample rate)"), ("expected_batch_size", "expected_batch_size"),
    ("noise_std", "noise std (σ / expected_batch_size)"), ("epsilon_at_fixed_noise", "ε at fixed σ"),
    ("delta", "δ"), ("sampler_delta", "δ the sampler's finite support adds"),
)
# The chat study's training data (docs/studies.md, "What the 64 tokens cut"): its 817 training roles, 19,416
# conversations (23.8 per role), every one kept by the 64-token cut (it keeps each reply). Used only when the results
# folder has no study run to read them from.
SFT_STUDY_DATA = dict(users=817, examples_per_user=24)
# A measured run counts as measured "at" ε within this ratio (the slider's two decimals: 2^1.58 = 2.99 for 3).
_SAME_EPSILON = 1.01


def study_budget_defaults(results_dir) -> dict:
    """The Budget tab's opening values: the study's budget, as its headline DP run in `results_dir` recorded it.

    The DP run of the study (the Train tab's quick runs are left out) closest to ε = 8, ULS first: `users` and
    `examples_per_user` from its result's `num_train_examples` / `num_train_users` (the rows a user has before G
    keeps some; the report's `num_examples` otherwise), its `contribution_bound`, `steps`, the accountant's δ
    (`delta_accountant`), `target_epsilon`, and
    `examples_per_step` = `expected_batch_size` × min(rows per user, G) for ULS (the table's m(G) for that many
    rows per user), `expected_batch_size` otherwise. Without such a run: the chat study's settings
    ([`~hf_dp.workflows.study_settings.SFT_SETTINGS`]: 16 roles per step, G = 1, 60 steps, ε = 8), its data's
    numbers ([`SFT_STUDY_DATA`]) and the trainer's default δ = 1/(10·users), as the planner states it.

    Returns:
        `dict` with `target_epsilon`, `target_delta`, `privacy_unit`, `sampling`, `users`, `examples_per_user`,
        `examples_per_step`, `steps`, `contribution_bound` and `source` (where they come from, in words).
    """
    try:
        runs = [r for r in list_runs(results_dir, include_app_runs=False) if r.is_dp and r.result.get("privacy")]
    except Exception:  # an unreadable folder: the page says so elsewhere; open on the study's settings
        runs = []
    for run in sorted(runs, key=lambda r: (r.mechanism != "uls", abs(math.log(_target(r) / 8.0)), r.name)):
        report = run.result["privacy"]
        try:
            users, examples = int(report["num_users"]), int(report["num_examples"])
            group = report.get("contribution_bound")
            # the rows a user has before the bound G keeps some (the report counts those kept: 1 per user at G = 1)
            rows, owners = run.result.get("num_train_examples"), run.result.get("num_train_users")
            per_user = max(1, round(rows / owners) if rows and owners else round(examples / users))
            batch = float(report["expected_batch_size"])
            per_step = batch * min(per_user, int(group)) if run.mechanism == "uls" and group else batch
            delta = report.get("delta_accountant") or run.result["delta"]
            return dict(target_epsilon=_target(run), target_delta=float(format_number(float(delta), ".2g")),
                        privacy_unit=report.get("privacy_unit") or MECHANISMS[run.mechanism].privacy_unit,
                        sampling=MECHANISMS[run.mechanism].sampling or "uls", users=users,
                        examples_per_user=per_user, examples_per_step=per_step, steps=int(report["steps"]),
                        contribution_bound=None if group is None else int(group),
                        source=f"the study's run `{run.name}` in `{results_dir}/`")
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            continue
    from hf_dp.workflows.study_settings import SFT_SETTINGS

    dp = SFT_SETTINGS["dp"]
    group = int(dp["contribution_bound"])
    rows_per_user = min(SFT_STUDY_DATA["examples_per_user"], group)  # the planner's m(G) for ULS
    settings = dict(target_epsilon=8.0, privacy_unit="user", sampling="uls", **SFT_STUDY_DATA,
                    examples_per_step=float(dp["expected_batch_size"] * rows_per_user),
                    steps=int(dp["max_steps"]), contribution_bound=group)
    rows = plan_budget(target_delta=None, **{k: settings[k] for k in (
        "target_epsilon", "users", "examples_per_user", "examples_per_step", "steps", "contribution_bound")})
    delta = float(format_number(rows[0]["delta"], ".2g"))  # 1/(10·users), the planner's default: 1.2e-4 for 817
    return dict(settings, target_delta=delta,
                source="the chat study's settings (`SFT_SETTINGS`; no study run in the results folder yet)")


def _target(run: RunRecord) -> float:
    value = run.result.get("target_epsilon") or run.result.get("epsilon")
    return float(value) if is_positive(value) else 8.0


@functools.lru_cache(maxsize=512)
def _planned(key: tuple) -> tuple:
    from hf_dp import mechanism_table

    return tuple(mechanism_table.compare(**dict(key)))


def plan_budget(*, target_epsilon: float, target_delta: float | None, users: int, examples_per_user: int,
                examples_per_step: float, steps: int, noise_multiplier: float | None = None,
                contribution_bound: int | None = None) -> list[dict]:
    """The planner's rows (one per mechanism: `"uls"`, `"els"`, `"example"`) for these settings.

    A thin call into [`hf_dp.mechanism_table.compare`] (its docstring lists the keys).
    `examples_per_step` is the compute budget, expected examples processed per step, the same for every mechanism;
    `contribution_bound` `None` lets the table recommend G, `target_delta` `None` takes its default. The rows of
    each distinct input are computed once and memoised (copies are returned).

    Raises:
        ValueError: bad input, with the planner's one-line message, or [`AppError`] naming the field.
    """
    key = (("users", _whole(users, "users")), ("examples_per_user", _whole(examples_per_user, "examples_per_user")),
           ("examples_per_step", _number(examples_per_step, "examples_per_step")), ("steps", _whole(steps, "steps")),
           ("target_epsilon", _number(target_epsilon, "target_epsilon")),
           ("target_delta", None if target_delta is None else _number(target_delta, "target_delta")),
           ("noise_multiplier", None if noise_multiplier is None else _number(noise_multiplier, "noise_multiplier")),
           ("contribution_bound",
            None if contribution_bound is None else _whole(contribution_bound, "contribution_bound")))
    return copy.deepcopy(list(_planned(key)))


def _whole(value, name: str, low: int = 1) -> int:
    number = _number(value, name)
    if not number.is_integer() or number < low:
        raise AppError(f"{name} = {format_number(value, 'g')}: use a whole number ≥ {low}.")
    return int(number)


def _number(value, name: str) -> float:
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise AppError(f"{name} = {value!r}: type a number." if value is not None else f"Set {name}.")
    return float(value)


def batch_text(row: Mapping) -> str:
    """`expected_batch_size` with its unit: "12.5 users" (ULS), "40 examples" (ELS, example-level)."""
    unit = row.get("sampled_unit") or MECHANISMS[str(row.get("mechanism"))].sampled_unit
    return f"{format_number(row.get('expected_batch_size'), '.4g')} {unit}"


def _cell(row: Mapping, key: str) -> str:
    if key == "expected_batch_size":
        return batch_text(row)
    if key == "contribution_bound" and row.get(key) is None:
        return "every row"
    return format_number(row.get(key), ".2g" if "delta" in key else ".4g")


def plan_table(rows: Sequence[Mapping], highlight: str | None) -> str:
    """The planner's rows as an HTML table readable on a phone: one column per mechanism (the `highlight` one in
    bold), one row per quantity; every number is a `<span class="num">` that never wraps (the table scrolls
    sideways instead), and the planner's notes are listed under it."""
    if not rows:
        return ""
    cell = "padding:2px 6px;border-bottom:1px solid #ddd;vertical-align:top"
    head = "".join(
        f"<th style='{cell};text-align:right'>{'<b>' if r.get('mechanism') == highlight else ''}"
        f"{html.escape(mechanism_label(r.get('mechanism')))}{'</b>' if r.get('mechanism') == highlight else ''}</th>"
        for r in rows)
    lines = [f"<tr><th style='{cell};text-align:left'></th>{head}</tr>"]
    for key, header in PLAN_ROWS:
        if not any(row.get(key) is not None for row in rows):
            continue
        cells = []
        for row in rows:
            text = f"<span class='num' style='white-space:nowrap'>{html.escape(_cell(row, key))}</span>"
            if row.get("mechanism") == highlight:
                text = f"<b>{text}</b>"
            cells.append(f"<td style='{cell};text-align:right'>{text}</td>")
        lines.append(f"<tr><th style='{cell};text-align:left;font-weight:normal'>{html.escape(header)}</th>"
                     + "".join(cells) + "</tr>")
    notes = "".join(f"<li><b>{html.escape(mechanism_label(r.get('mechanism')))}</b>: {html.escape(str(r['note']))}"
                    "</li>" for r in rows if r.get("note"))
    return ("<div class='plan-table' style='overflow-x:auto;max-width:100%'>"
            "<table style='border-collapse:collapse;word-break:normal;overflow-wrap:normal;font-size:0.95em'>"
            + "".join(lines) + "</table>" + (f"<ul style='margin-top:6px'>{notes}</ul>" if notes else "")
            + "</div>")


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
    """The result measured at `target_epsilon` by finished runs; `None` when there are no DP runs to read.

    Runs of `mechanism` are used (of any DP mechanism when `mechanism` has none), each placed at its target ε (the
    ε it spent when it has no target). At the ε of a run (within 1 %) its result is the measured one; between two
    measured ε the result is interpolated linearly in log ε; below the smallest or above the largest measured ε
    nothing was measured, and `expected_result` is `None` (a single run at ε = 8 says nothing about ε = 1). The
    cost is measured against the non-private run, the gain against the public-only baseline, when present. The
    Train tab's runs are left out (small subsets, their own test rows).

    Returns:
        `dict` with `metric_name`, `expected_result` (`None` outside the measured range), `measured` (whether
        `target_epsilon` is in it), `interpolated` (between two measured ε, not at one), `mechanism_used`
        (`mechanism`, or `"any DP mechanism"`), `points` ([(ε, mean eval_result)]), `non_private_result`,
        `baseline_result`, `cost` (non-private − expected, for accuracy; expected − non-private for perplexity;
        `None` when either is missing) and `lower_is_better`, or `None`.

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
    # A run is placed at the ε it aimed for (what the user types here), else at the ε it spent; runs at one ε
    # (seeds, fixed and adaptive C) are averaged.
    by_epsilon: dict[float, list[float]] = {}
    for r in used:
        by_epsilon.setdefault(float(r.result.get("target_epsilon") or r.result["epsilon"]), []).append(r.eval_result)
    points = sorted((e, sum(v) / len(v)) for e, v in by_epsilon.items())
    target = float(target_epsilon)
    expected = next((m for e, m in points if max(target, e) / min(target, e) <= _SAME_EPSILON), None)
    interpolated = False
    if expected is None:
        for (e0, m0), (e1, m1) in zip(points, points[1:]):
            if e0 <= target <= e1:
                t = (math.log(target) - math.log(e0)) / (math.log(e1) - math.log(e0))
                expected, interpolated = m0 + t * (m1 - m0), True
                break
    non_private = _measured(study, used, "non-private", "non_private_result")
    baseline = _measured(study, used, "public-only", "baseline_result")
    lower_is_better = is_lower_better(metric_name)
    cost = None
    if non_private is not None and expected is not None:
        cost = (expected - non_private) if lower_is_better else (non_private - expected)
    return {
        "metric_name": metric_name, "expected_result": expected, "measured": expected is not None,
        "interpolated": interpolated,
        "mechanism_used": mechanism if same else "any DP mechanism", "points": points,
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
    """The Budget tab's paragraph on the result measured at this ε and the cost of privacy."""
    if cost is None:
        return (f"**Measured result:** no finished DP runs in `{results_dir}/` to read it from. "
                "Run `hf-dp demo` (or `hf-dp demo --grid` for several ε) and reload; the Train tab's quick runs "
                "are not used here.")
    name = cost["metric_name"]
    used = cost["mechanism_used"]
    used_label = mechanism_label(used) if used in MECHANISMS else used
    measured = ", ".join(f"ε = {format_epsilon(e)}: {m:.3f}" for e, m in cost["points"])
    if not cost["measured"]:
        text = (f"**Nothing was measured at ε = {target_epsilon:.3g}:** the {used_label} runs in `{results_dir}/` "
                f"measured {name} at {measured}, and a result is only read between measured ε (interpolated in "
                "log ε), never extrapolated. Run `hf-dp demo --grid` to measure ε = 1, 3 and 8.")
    else:
        text = (f"**Measured {name} at ε = {target_epsilon:.3g}:** {cost['expected_result']:.3f} "
                f"(from the {used_label} runs in `{results_dir}/`: {measured}"
                + ("; interpolated in log ε between the two nearest" if cost["interpolated"] else "") + ")")
        if cost["cost"] is not None:
            word = "higher" if cost["lower_is_better"] else "lower"
            text += (f". **Cost of privacy:** {abs(cost['cost']):.3f} {name} "
                     f"{word if cost['cost'] >= 0 else 'better'} than non-private fine-tuning "
                     f"({cost['non_private_result']:.3f})")
    if cost["baseline_result"] is not None:
        text = text.rstrip(".") + f"; public-only baseline: {cost['baseline_result']:.3f}"
    text = text.rstrip(".") + (". These runs used the study's model and data: with other data, model or settings "
                               "the cost will differ.")
    if study_is_quick(results_dir):
        text += " ⚠️ The results come from a `--quick` study: their numbers mean nothing."
    if used != mechanism:
        text += f" (No {mechanism_label(mechanism)} runs were found, so all DP runs were used.)"
    return text


def g_change_note(previous: Mapping | None, current: Mapping) -> str:
    """Why σ moved the same way as ε between two views of one budget: the planner's recommended G changed.

    `previous` and `current` are the states [`budget_view`] returns. Empty unless both are of the same mechanism
    and settings but ε, G was the planner's recommendation in both, it changed, and σ rose with ε (or fell as ε
    fell), which a fixed G never does.
    """
    if not previous or not current or previous.get("settings") != current.get("settings"):
        return ""
    if not (previous.get("auto_bound") and current.get("auto_bound")) or previous["G"] == current["G"]:
        return ""
    (e0, s0), (e1, s1) = (previous["epsilon"], previous["sigma"]), (current["epsilon"], current["sigma"])
    if None in (s0, s1) or e0 == e1 or (s1 - s0) * (e1 - e0) <= 0:
        return ""
    moved = "rose" if s1 > s0 else "fell"
    way = "grew" if e1 > e0 else "shrank"
    std = "falls" if current["noise_std"] < previous["noise_std"] else "rises"
    unit = current["unit"]
    return (f"**Why σ {moved} although ε {way}:** the recommended contribution bound changed from G = {previous['G']} "
            f"at ε = {e0:.3g} to G = {current['G']} here. With G = {current['G']} each sampled user contributes "
            f"{'fewer' if current['G'] < previous['G'] else 'more'} rows, so the same examples_per_step takes "
            f"{format_number(previous['batch'], '.4g')} → {format_number(current['batch'], '.4g')} {unit} per step "
            f"(q {format_number(previous['q'], '.3g')} → {format_number(current['q'], '.3g')}), and σ follows q. "
            f"The noise in the averaged update, σ / expected_batch_size, {std} "
            f"({format_number(previous['noise_std'], '.3g')} → {format_number(current['noise_std'], '.3g')}). "
            "Set contribution_bound to hold G fixed.")


def budget_view(results_dir, target_epsilon: float, target_delta: float, privacy_unit: str, sampling: str,
                users: float, examples_per_user: float, examples_per_step: float, steps: float,
                noise_multiplier: float | None = None, contribution_bound: float | None = None,
                previous: Mapping | None = None) -> tuple[str, str, dict | None]:
    """The Budget tab: (headline markdown, table HTML, state). Errors come back as one line in the headline, with
    an empty table (no stale numbers) and state `None`.

    `contribution_bound` `None` (an empty box) lets the table recommend G; `noise_multiplier` `None` or 0 leaves
    out "ε at fixed σ". `previous` is the state of the view shown before: when the recommended G changed and σ
    moved with ε, the headline says why ([`g_change_note`]).
    """
    try:
        mechanism = mechanism_of(privacy_unit, sampling)
        if target_epsilon is None:
            raise AppError("Set target_epsilon (ε).")
        if target_delta is None:
            raise AppError("Set target_delta (δ), e.g. 1/(10·users).")
        if noise_multiplier is not None and not noise_multiplier > 0:
            noise_multiplier = None
        rows = plan_budget(target_epsilon=target_epsilon, target_delta=target_delta, users=users,
                           examples_per_user=examples_per_user, examples_per_step=examples_per_step, steps=steps,
                           noise_multiplier=noise_multiplier, contribution_bound=contribution_bound)
        row = next(r for r in rows if r.get("mechanism") == mechanism)
    except Exception as error:  # the planner's ValueError, AppError, anything: one line in the page
        return error_md(error), "", None
    epsilon = float(target_epsilon)
    headline = [f"### {MECHANISMS[mechanism].name} at ε = {epsilon:.3g}, δ = {float(target_delta):.2g} + "
                f"{format_number(row.get('sampler_delta'), '.1g')}"]
    sigma, group = row.get("noise_multiplier"), row.get("contribution_bound")
    auto_bound = contribution_bound is None
    # G beside σ: σ is the noise for the q that G gives, so a recommended G that changes with ε moves σ with it
    at_g = "" if group is None else f" at G = {group}"
    why = ("" if group is None else " (G given)" if not auto_bound else
           " (G is the planner's pick for this ε; a G picked anew for another ε changes q, and σ with it: set "
           "contribution_bound to hold G fixed)")
    if sigma is None:
        headline.append(error_md(impossible_budget(row, epsilon)))
    else:
        headline.append(f"**Noise multiplier needed: σ = {format_number(sigma, '.4g')}{at_g}**{why}")
    details = [f"expected_batch_size = {batch_text(row)} per step (sample rate q = "
               f"{format_number(row.get('sample_rate'), '.4g')}), {row.get('steps')} steps"]
    if row.get("epsilon_at_fixed_noise") is not None:
        details.append(f"at the fixed σ = {format_number(row.get('fixed_noise_multiplier'), '.3g')} it would spend "
                       f"ε = {format_number(row['epsilon_at_fixed_noise'], '.3g')}")
    headline.append("; ".join(details) + ".")
    state = {"mechanism": mechanism, "epsilon": epsilon, "sigma": sigma, "G": row.get("contribution_bound"),
             "auto_bound": auto_bound, "batch": row.get("expected_batch_size"), "q": row.get("sample_rate"),
             "noise_std": row.get("noise_std"), "unit": row.get("sampled_unit"),
             "settings": [mechanism, target_delta, users, examples_per_user, examples_per_step, steps,
                          noise_multiplier, contribution_bound]}
    note = g_change_note(previous, state)
    if note:
        headline.append(note)
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
    return "\n\n".join(headline), plan_table(rows, mechanism), state
