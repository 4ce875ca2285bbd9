"""The Results tab's plot: the test metric against ε spent (log x) per DP mechanism, styled from MECHANISMS.

Accuracy for classification; for a language model (a lower-is-better perplexity: the causal LM's, the chat model's
completion perplexity) its logarithm, the test NLL in nats per token, as the study's plot shows it
([`hf_dp.workflows.study_plot.metric_value`]).
"""

from __future__ import annotations

import math
from typing import Sequence

from hf_dp.vocabulary import DP_MECHANISMS, MECHANISMS, lower_is_better
from hf_dp.workflows.study_plot import is_adaptive, metric_value

from .results import NON_PRIVATE, RunRecord, is_positive, main_metric, study_is_quick

TRAIN_TAB_MARKER = "P"  # a filled plus: no mechanism's marker (MECHANISMS), so a Train-tab run never reads as a study's


def privacy_utility_figure(runs: Sequence[RunRecord]):
    """The metric against ε spent (log x) per DP mechanism (adaptive clipping as its own dashed series), the
    public-only baseline and the non-private run as horizontal lines (the non-private run also as a point at
    ε = ∞). Markers, colors and labels are those of [`~hf_dp.vocabulary.MECHANISMS`]. The Train tab's runs of the
    same metric are drawn as filled plus signs ([`TRAIN_TAB_MARKER`], a shape no study series uses) in their
    mechanism's color, labelled "Train tab" (they train on small subsets and score on their own test rows, so they
    are not joined to the study's lines). The legend sits under the axes, one entry a line, readable on a phone.
    Accuracy, or test NLL (log perplexity, lower is better) for language models.

    Returns a matplotlib `Figure` (for `gr.Plot`), or `None` when there is no run to plot.
    """
    from matplotlib.figure import Figure

    scored = [r for r in runs if r.eval_result is not None]
    study = [r for r in scored if not r.from_app]
    if not scored:
        return None
    metric_name = main_metric(study or scored)
    study = [r for r in study if r.metric_name == metric_name]
    app_runs = [r for r in scored if r.from_app and r.metric_name == metric_name]
    lower = lower_is_better(metric_name)
    fig = Figure(figsize=(6.4, 6.0), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    epsilons = []
    for key in DP_MECHANISMS:
        style = MECHANISMS[key]
        for adaptive in (False, True):
            points = sorted((float(r.result["epsilon"]), metric_value(r.result)) for r in study
                            if r.mechanism == key and is_adaptive(r.result) == adaptive
                            and is_positive(r.result.get("epsilon")))
            if not points:
                continue
            xs, ys = zip(*points)
            epsilons += xs
            ax.plot(xs, ys, marker=style.marker, color=style.color, linestyle="--" if adaptive else "-",
                    markerfacecolor="white" if adaptive else style.color,
                    label=style.label + (", adaptive clipping" if adaptive else ""))
    app_points = {}
    for r in app_runs:
        if r.is_dp and is_positive(r.result.get("epsilon")):
            app_points.setdefault(r.mechanism, []).append((float(r.result["epsilon"]), metric_value(r.result)))
        elif r.mechanism == NON_PRIVATE:
            app_points.setdefault(NON_PRIVATE, []).append((None, metric_value(r.result)))
    epsilons += [e for points in app_points.values() for e, _ in points if e is not None]
    low, high = (min(epsilons), max(epsilons)) if epsilons else (1.0, 8.0)
    right = high * 2.5
    for key, points in app_points.items():
        style = MECHANISMS[key]
        xs = [right if e is None else e for e, _ in points]
        ax.plot(xs, [y for _, y in points], marker=TRAIN_TAB_MARKER, markersize=11, color=style.color,
                markeredgecolor="black", linestyle="none", label=f"{style.label}, Train tab (own test rows)")
    baseline = next((metric_value(r.result) for r in study if r.is_baseline), None)
    if baseline is None:  # the DP runs record the baseline's figure on their test rows
        recorded = next((float(r.result["baseline_result"]) for r in study or app_runs
                         if r.result.get("baseline_result") is not None), None)
        baseline = None if recorded is None else (math.log(recorded) if lower else recorded)
    if baseline is not None:
        style = MECHANISMS["public-only"]
        ax.axhline(baseline, color=style.color, linestyle="--", label=f"{style.label} ({baseline:.3f})")
    non_private = next((metric_value(r.result) for r in study if r.mechanism == NON_PRIVATE), None)
    if non_private is not None:
        style = MECHANISMS[NON_PRIVATE]
        ax.axhline(non_private, color=style.color, linestyle=":")
        ax.plot([right], [non_private], marker=style.marker, markersize=14, color=style.color, linestyle="none",
                label=f"{style.label}, ε = ∞ ({non_private:.3f})")
    ax.set_xscale("log")
    ax.set_xlim(low / 1.8, right * 1.6)
    ticks = [t for t in (0.25, 0.5, 1, 2, 3, 4, 8, 16, 32, 64) if low / 1.8 <= t <= high * 1.3]
    ax.minorticks_off()
    ax.set_xticks(ticks + [right])
    ax.set_xticklabels([f"{t:g}" for t in ticks] + ["∞"])
    ax.set_xlabel("ε spent (log scale)")
    ax.set_ylabel(f"test NLL = log {metric_name}\n(nats per token; lower is better)" if lower
                  else f"test {metric_name}")
    quick = bool(study) and study_is_quick(study[0].folder)
    ax.set_title("Privacy / utility" + (" (quick study: the numbers mean nothing)" if quick else ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    fig.legend(loc="lower center", ncol=1, fontsize=10, frameon=False)  # below the axes: never over a point
    fig.tight_layout(rect=(0, 0.055 * len(handles) + 0.02, 1, 1))
    return fig
