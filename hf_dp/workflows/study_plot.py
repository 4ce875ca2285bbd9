"""The study's figures: the plotted metric, the gap a run closes, and the privacy/utility plot.

Shared by both tasks of [`hf_dp.workflows.study`]: accuracy for classification, test NLL (log perplexity, nats per
token) for a causal LM; labels, markers and colours come from [`~hf_dp.vocabulary.MECHANISMS`].
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from hf_dp.vocabulary import DP_MECHANISMS, MECHANISMS, lower_is_better
from hf_dp.workflows.tasks import task_of_result

__all__ = ["gap_closed", "is_adaptive", "metric_value", "plot_privacy_utility", "plot_title"]


def is_adaptive(result: dict) -> bool:
    """Whether a result's run clipped with an adaptive norm (its recorded training arguments say so)."""
    return bool((result.get("config") or {}).get("adaptive_clipping"))


def metric_value(result: dict) -> float:
    """The plotted figure: test NLL (log perplexity, nats per token) for a causal LM, accuracy otherwise."""
    if lower_is_better(result["metric_name"]):
        return math.log(result["eval_result"])
    return float(result["eval_result"])


def gap_closed(result: dict, baseline: dict | None, non_private: dict | None) -> float | None:
    """Fraction of the gap between the public-only baseline and non-private fine-tuning that a run closes, on the
    plotted scale (accuracy; NLL for a causal LM): 0 at the baseline, 1 at non-private, negative below the
    baseline. `None` when either reference is missing or they coincide."""
    if not baseline or not non_private:
        return None
    gap = metric_value(non_private) - metric_value(baseline)
    if gap == 0:
        return None
    return (metric_value(result) - metric_value(baseline)) / gap + 0.0  # + 0.0: the baseline closes 0 %, not -0 %


def plot_title(results: list[dict], quick: bool) -> str:
    """The plot's title: model, task and number of training roles (flagged when `--quick`)."""
    first = next((r for r in results if r.get("privacy")), None)
    prefix = "[--quick: meaningless numbers] " if quick else ""
    if lower_is_better(results[0]["metric_name"]):
        users = f"{first['privacy']['num_users']} training roles" if first else "roles"
        name = Path(str(results[0]["base_model"])).name
        if name.startswith("smollm2"):
            name = "SmolLM2-135M-Instruct"
        return f"{prefix}{name}: {task_of_result(results[0]).learns} ({users})"
    users = f"{first['privacy']['num_users']} training roles" if first else "Shakespeare"
    return f"{prefix}all-MiniLM-L6-v2 on Shakespeare genres ({users})"


def _standard_error(result: dict) -> float | None:
    """Binomial standard error of a test accuracy over `num_eval_examples` rows (`None` if not recorded)."""
    n = result.get("num_eval_examples")
    if not n or result.get("metric_name", "accuracy") != "accuracy":
        return None
    p = float(result["eval_result"])
    return (p * (1.0 - p) / n) ** 0.5


def plot_privacy_utility(results: list[dict], path, *, title: str = "") -> Path:
    """The metric against the ε spent (log x): one series per DP mechanism (and per clipping, fixed or adaptive,
    adaptive dashed with open markers), baseline and non-private as lines; labels, markers and colours from
    [`~hf_dp.vocabulary.MECHANISMS`]. Accuracy for classification; test NLL (nats per token, lower is better) for
    a causal LM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    perplexity = lower_is_better(results[0]["metric_name"])
    fig, ax = plt.subplots(figsize=(7.5, 5.4), dpi=120)
    # Value labels: the first series below its points, the second above, the others to the right.
    label_offsets = (((0, -16), "center"), ((0, 8), "center"), ((9, -3), "left"), ((9, 5), "left"),
                     ((-9, -12), "right"), ((-9, 6), "right"))
    series = [(key, adaptive) for key in DP_MECHANISMS for adaptive in (False, True)
              if any(r["mechanism"] == key and is_adaptive(r) == adaptive and r.get("epsilon") for r in results)]
    epsilons = []
    for (key, adaptive), (offset, align) in zip(series, label_offsets):
        entry = MECHANISMS[key]
        points = sorted((r["epsilon"], metric_value(r), _standard_error(r)) for r in results
                        if r["mechanism"] == key and is_adaptive(r) == adaptive and r.get("epsilon"))
        xs, ys, errors = zip(*points)
        epsilons += xs
        ax.errorbar(xs, ys, yerr=None if None in errors else errors, linestyle="--" if adaptive else "-",
                    linewidth=1.5, markersize=7, capsize=3, marker=entry.marker, color=entry.color,
                    markerfacecolor="white" if adaptive else entry.color,
                    label=entry.label + (", adaptive clipping" if adaptive else ", fixed clipping norm"))
        for x, y, _ in points if len(series) <= 3 else ():  # more series crowd the labels: the table has them
            ax.annotate(f"{y:.4f}" if not perplexity else f"{y:.3f}", (x, y), textcoords="offset points",
                        xytext=offset, ha=align, fontsize=8, color=entry.color)
    low, high = (min(epsilons), max(epsilons)) if epsilons else (1.0, 8.0)
    ax.set_xscale("log")
    ax.set_xlim(low / 1.6, high * 1.6)
    for key, linestyle, epsilon in (("public-only", "--", "ε = 0"), ("non-private", ":", "ε = ∞")):
        entry = MECHANISMS[key]
        reference = next((r for r in results if r["mechanism"] == key), None)
        if reference is not None:
            ax.axhline(metric_value(reference), color=entry.color, linestyle=linestyle, linewidth=1.5,
                       label=f"{entry.label}, {epsilon} ({metric_value(reference):.4f})")
    # ε spent to 2 significant figures (7.99 is labelled 8: no two labels on top of each other)
    ticks = sorted({float(f"{e:.2g}") for e in epsilons} | {1.0, 3.0, 8.0}) if epsilons else [1, 3, 8]
    ax.set_xticks([t for t in ticks if low / 1.6 <= t <= high * 1.6])
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.minorticks_off()
    delta = next((r["delta"] for r in results if r.get("privacy") and r["privacy"]["privacy_unit"] == "user"), None)
    ax.set_xlabel("ε spent (log scale)" + (f"; user-level δ = {delta:.2g}" if delta else ""))
    if perplexity:
        ax.set_ylabel(f"test NLL, nats per {task_of_result(results[0]).scored_token} (held-out plays; lower is better)")
    else:
        ax.set_ylabel("test accuracy (held-out plays)" + ("; bars: ±1 s.e." if any(_standard_error(r) for r in results)
                                                           else ""))
    ax.set_title(textwrap.fill(title, 90), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
