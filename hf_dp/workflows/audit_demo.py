"""`hf-dp audit`: an empirical privacy audit of a demo-sized DP run on the embedded default, offline, on a CPU.

`--task sft` (the default) audits an audit run of the chat setup `hf-dp demo` trains ([`hf_dp.workflows.study`],
[`~hf_dp.workflows.study_settings.SFT_SETTINGS`]): `DPSFTTrainer` on SmolLM2-135M-Instruct (LoRA on the queries and
values of the top 4 layers) learns Shakespeare roles' replies, users = speaking roles, user-level DP (ULS, G = 1,
adaptive clipping). The audit run is its own configuration, sized for power, and the ε it checks is the accountant's
for it: `--max_train_users` 32 real roles, `--canaries` 512 (about half included by their coins, so q = 16/N ≈
0.055 and each included canary is drawn q x 300 ≈ 16 times in `--max_steps` 300), `--target_delta` 1e-5 (room for
the bound: 512 canaries can show 3.8) and `--target_epsilon` 2. Each canary is one conversation in the real rows'
format (the study's system prompt, a user message of random words) whose reply is 12 rare tokens of SmolLM2's
vocabulary used by no other canary ([`~hf_dp.audit.canaries.rare_words`]: new tokens cannot be learnt by LoRA with
frozen embeddings). After training each canary is scored by its reply's loss under the trained model alone
(`--score trained-loss`, tokenized as DPSFTTrainer tokenizes; lower = guessed "in"), and the guesses give an ε
lower bound at the run's δ with `--confidence` ([`hf_dp.audit.audit_training`]). `--task classification` audits
the classification study's ULS run on the embedded MiniLM instead (100 of its 200 steps), as before.

`--sabotage no-noise` exists only to test the audit: it silently turns the gradient noise of that run off while the
card and report still claim the accountant's ε ([`sabotage`]). When the lower bound exceeds the proven ε the audit
FAILED: `audit.json`, the card and the printed table say so, and the command exits with code 3
([`AUDIT_FAILED_EXIT_CODE`]).

Writes:

- `<results_dir>/audit.json`: the audit ([`~hf_dp.audit.AuditReport.to_dict`]) beside the proven ε, the audited
  model's test metric (completion perplexity, or accuracy) and the public-only baseline's on the same test rows
  (canaries removed), the settings and the timings;
- `<results_dir>/models/audit/`: the audited model, its privacy card with the "Empirical audit" section and the
  report that section is rendered from (`dp_audit.json`, which `hf-dp publish` checks it against), and `_audit/`
  (the canaries with their coins, and the report), which `hf-dp publish` and `push_to_hub` never upload.

The audited model trained on the canaries: it is a check of the implementation, not the model to release (the card
says so). Measured at the default on the 2-core machine (2 threads, nothing else running): with `--sabotage
no-noise` the lower bound is 3.28 (254 of 256 guesses right; ceiling 3.84 at δ = 1e-5, 95 %) against the proven ε
2.00, so the audit FAILED as it should, in 11.0 minutes; the correct run's bound (fresh canaries) is 0.00 (16 of 26
right; ceiling 4.21), below the proven 2.00, in 10.8 minutes. `docs/audit.md` has the numbers and how the score was
chosen. `--quick` runs the same pipeline on a tiny subset (for tests; its numbers mean nothing).

Example:

```bash
hf-dp audit                                   # the chat audit run: 512 canaries, ULS at ε = 2, 300 steps
hf-dp audit --sabotage no-noise               # a run broken on purpose: the audit should FAIL (exit code 3)
hf-dp audit --task classification             # the MiniLM study's run, 100 steps
python -m hf_dp.workflows.audit_demo --quick --results_dir /tmp/audit
```
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

from hf_dp.formatting import format_epsilon
from hf_dp.command_line import ArgumentParser, check_numbers, require_extra, run_command
from hf_dp.workflows.study_settings import DEFAULT_TASK, study_settings
from hf_dp.workflows.tasks import get_task, registered_tasks

__all__ = ["AuditArguments", "build_parser", "main", "run", "run_audit"]

RUN_NAME = "audit"
# The tasks with an audited run: its steps, test rows, canaries and score are the task's `audit` (the reasons beside
# them, in hf_dp.workflows.tasks.studies).
TASKS = tuple(key for key, task in registered_tasks().items() if task.audit is not None)
SABOTAGES = ("no-noise",)
SCORE_CHOICES = ("auto", "trained-loss", "black-box", "white-box")  # --score
REPLY_WORDS = 12  # rare tokens per canary reply (make_canaries' words_per_row)
AUDIT_FAILED_EXIT_CODE = 3  # `hf-dp audit` exits with it when the lower bound exceeds the proven ε


@contextlib.contextmanager
def sabotage(kind: str | None):
    """A deliberately broken DP step, to test the audit only: `"no-noise"` silently skips the gradient noise of
    every DP step run inside the context (the accountant, the card and the report still claim their ε). Reachable
    only through `hf-dp audit --sabotage` and the tuning probe's `--no_noise` measurement
    (`benchmarks/chat_sft_tuning.py`), never from `DPTrainer`'s arguments; restored on exit."""
    if kind is None:
        yield
        return
    if kind not in SABOTAGES:
        raise ValueError(f"sabotage={kind!r}: use one of {SABOTAGES} (or none).")
    from hf_dp import step

    original = step.add_noise
    step.add_noise = lambda *args, **kwargs: None
    try:
        yield
    finally:
        step.add_noise = original


def contribution_bound(task: str) -> int:
    """G of the task's audited ULS run: a canary with more rows would lose some to the bound."""
    return study_settings(task)["dp"]["contribution_bound"]


def run_audit(*, task: str = DEFAULT_TASK, target_epsilon: float = 2.0, canaries: int | None = None,
              rows_per_canary: int = 1, confidence: float = 0.95, score: str = "auto", results_dir: str = "results",
              max_steps: int | None = None, max_eval_examples: int | None = None, canary_seed: int | None = None,
              noise_seed: int | None = None, quick: bool = False, progress: bool = True, log=print,
              settings: dict | None = None, max_train_users: int | None = None, target_delta: float | None = None,
              sabotage_run: str | None = None) -> dict:
    """Train the study's ULS run with canaries, audit it, save model, card and `audit.json`; return the result.

    Arguments are the flags of [`build_parser`], checked as [`AuditArguments`] checks them (before anything is
    loaded); `canaries`, `max_steps`, `max_eval_examples`, `max_train_users` and `target_delta` default to the
    task's ([`~hf_dp.workflows.tasks.AuditDefaults`]); `quick` keeps its own 2 steps, rows and δ, with 16
    canaries. `sabotage_run` (`--sabotage`) breaks the run on purpose ([`sabotage`]) to test that the audit catches
    it. `settings` replaces the study's ([`~hf_dp.workflows.study_settings.study_settings`]; tests run a tiny model
    on a few rows with it).

    Returns:
        `dict`: what `results_dir/audit.json` holds (`audit`: the [`~hf_dp.audit.AuditReport`] as a dict).
    """
    from hf_dp.audit.run import AUDIT_DIR, CANARIES_FILE
    from hf_dp.workflows.run_results import save_result
    from hf_dp.workflows.runs import save_run

    AuditArguments(task=task, target_epsilon=target_epsilon, canaries=canaries, rows_per_canary=rows_per_canary,
                   confidence=confidence, score=score, results_dir=results_dir, max_steps=max_steps,
                   max_eval_examples=max_eval_examples, canary_seed=canary_seed, noise_seed=noise_seed,
                   max_train_users=max_train_users, target_delta=target_delta, sabotage=sabotage_run)  # the checks
    start = time.perf_counter()
    defaults = get_task(task).audit
    score = defaults.score if score == "auto" else score
    if canaries is None:
        canaries = 16 if quick else defaults.canaries
    settings = settings or study_settings(task, quick)
    fields = dict(settings["config"])
    training = dict(settings["dp"], **settings["adaptive"], target_epsilon=target_epsilon)  # the study's ULS run
    if not quick:
        fields["max_eval_examples"] = max_eval_examples or defaults.max_eval_examples
        training["max_steps"] = max_steps or defaults.max_steps
        if max_train_users or defaults.max_train_users:
            fields["max_train_users"] = max_train_users or defaults.max_train_users
        if target_delta or defaults.target_delta:
            training["target_delta"] = target_delta or defaults.target_delta
    else:
        if max_train_users:
            fields["max_train_users"] = max_train_users
        if training.get("adaptive_clipping") and training.get("clipping_count_noise") is None:
            # --quick samples 4 users a step: σ_b = 4/20 would fall below σ_eff/2 at the audit's ε = 2.
            training["clipping_count_noise"] = 1.0
    if quick and target_delta:
        training["target_delta"] = target_delta
    if noise_seed is not None:
        training["noise_seed"] = noise_seed
    check_canary_count(canaries, training)
    audit = dict(canaries=canaries, rows_per_canary=rows_per_canary, confidence=confidence, seed=canary_seed,
                 score=score, progress=progress)
    audited_run = get_task(task).functions().run_audit
    if sabotage_run:
        log(f"[!] --sabotage {sabotage_run}: this run is broken on purpose, to test the audit (no gradient noise)")
    with sabotage(sabotage_run):
        done = audited_run(fields, training, audit, results_dir=results_dir, progress=progress, log=log)
    trainer, report, card = done["trainer"], done["report"], done["card"]
    model_dir = Path(trainer.args.output_dir)
    privacy = save_run(trainer, done["tokenizer"], model_dir, eval_result=done["eval_result"], card=card)
    report.write_to_card(model_dir, audited_model=True)
    result = {
        "run": RUN_NAME,
        "task": "privacy-audit",
        "audited_task": task,
        "base_model": card["base_model"],
        "dataset": card["dataset_name"],
        "mechanism": "uls",
        "target_epsilon": target_epsilon,
        "epsilon": privacy["epsilon"],
        "delta": privacy["delta"],
        "audit": report.to_dict(),
        "audit_failed": report.failed,
        "verdict": report.verdict,
        "sabotage": sabotage_run,
        "visits_per_canary": privacy["sample_rate"] * privacy["steps"],  # expected draws of an included canary
        "privacy": privacy,
        "metric_name": card["metric_name"],
        "eval_result": done["eval_result"],
        "baseline_result": card["baseline_result"],
        "num_eval_examples": done["num_eval_examples"],
        "num_train_users": done["num_train_users"],
        "num_train_examples": done["num_train_examples"],
        "not_covered": list(card.get("extra_not_covered", ())),
        "model_dir": os.path.relpath(model_dir, results_dir),
        "audit_record": os.path.relpath(model_dir / AUDIT_DIR / CANARIES_FILE, results_dir),
        "quick": quick,
        "settings": {"config": done["config"], "training": training, "canaries": canaries,
                     "rows_per_canary": rows_per_canary, "confidence": confidence, "score": score,
                     "sabotage": sabotage_run, "canary_replies": done.get("canary_replies", "text")},
        "train_and_audit_seconds": done["train_and_audit_seconds"],
        "seconds": time.perf_counter() - start,
    }
    save_result(result, results_dir)
    return result


def audit_classification(fields: dict, training: dict, audit: dict, *, results_dir: str, progress: bool,
                          log) -> dict:
    """The classification study's ULS run on the embedded MiniLM, audited; what [`run_audit`] saves."""
    import datasets
    from transformers import AutoTokenizer, DataCollatorWithPadding, set_seed

    from hf_dp.audit import audit_training, remove_canaries
    from hf_dp.trainer import DPTrainer
    from hf_dp.workflows.tasks.classification import (
        ClassificationConfig,
        accuracy,
        build_model,
        load_classification_data,
        tokenize_classification,
    )
    from hf_dp.workflows.tasks.classifier_models import DEFAULT_BASE_MODEL, predict_labels, resolve_model_path

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

    def evaluate(model):
        return accuracy(predict_labels(model, tokenizer, test[text], max_length=config.max_length,
                                       batch_size=config.eval_batch_size, progress=progress), test["labels"])

    card = dict(dataset_name=data.dataset_name, metric_name="accuracy", base_model=DEFAULT_BASE_MODEL,
                task="text-classification", extra_not_covered=list(data.not_covered))
    done: dict = {"tokenizer": tokenizer, "num_eval_examples": len(test), "config": dataclasses.asdict(config)}

    def make_trainer(training_rows):
        set_seed(config.seed)
        model = build_model(config, data.label_names)  # starts as the zero-shot, public-only baseline
        log("[2/4] public-only baseline on the test plays (canaries removed)")
        card["baseline_result"] = evaluate(model)
        _count_real(done, training_rows, user)
        trainer = DPTrainer(model=model, args=training_args, train_dataset=training_rows,
                            data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                            privacy_card_kwargs=card)
        return _started(done, trainer, training, audit, log)

    done["report"] = audit_training(make_trainer, raw, user_id_column=user, text_column=text, tokenize=tokenize,
                                    **audit)
    done["train_and_audit_seconds"] = time.perf_counter() - done["train_start"]
    log("[4/4] test accuracy of the audited model; saving model, card and audit.json")
    done["eval_result"] = evaluate(done["trainer"].model)
    return dict(done, card=card)


def audit_sft(fields: dict, training: dict, audit: dict, *, results_dir: str, progress: bool, log) -> dict:
    """The chat study's ULS run (DPSFTTrainer, SmolLM2, LoRA), audited with conversation canaries scored on their
    replies; what [`run_audit`] saves."""
    from functools import partial

    from transformers import AutoModelForCausalLM, set_seed

    from hf_dp.audit import audit_training, rare_words, remove_canaries
    from hf_dp.sft import DPSFTTrainer
    from hf_dp.workflows.tasks.chat_sft import (
        METRIC_NAME,
        ChatSFTConfig,
        completion_perplexity,
        load_chat_data,
        lora_config,
        prepare_chat_tokenizer,
        tokenize_prompt_completion,
    )
    from hf_dp.workflows.tasks.language_modeling import CausalLMCollator

    if fields.get("model_name_or_path") is None:
        from hf_dp.workflows.pretrained import smollm2_path

        fields["model_name_or_path"] = str(smollm2_path())
    config = ChatSFTConfig(run=RUN_NAME, results_dir=results_dir, progress=progress, **fields)
    training_args = config.training_arguments("uls", **training)
    log("[1/4] loading the Shakespeare conversations and the embedded SmolLM2-135M-Instruct")
    data = load_chat_data(config)
    user = config.user_id_column
    tokenizer = prepare_chat_tokenizer(None, config)
    # Scored and evaluated rows are tokenized as DPSFTTrainer tokenizes its training rows (same length, same cut).
    tokenize = partial(tokenize_prompt_completion, tokenizer=tokenizer, max_length=training_args.max_length,
                       truncation_mode=training_args.truncation_mode)
    test = tokenize(remove_canaries(data.test, user))  # evaluation never counts a canary
    collator = CausalLMCollator(tokenizer.pad_token_id)

    def evaluate(net):
        return completion_perplexity(net, test, pad_token_id=tokenizer.pad_token_id,
                                     batch_size=config.eval_batch_size, progress=progress)

    card = dict(dataset_name=data.dataset_name, metric_name=METRIC_NAME, base_model=config.model_name_or_path,
                task="text-generation")
    done: dict = {"tokenizer": tokenizer, "num_eval_examples": len(test), "config": dataclasses.asdict(config)}

    def make_trainer(training_rows):
        net = AutoModelForCausalLM.from_pretrained(config.model_name_or_path).to(training_args.device)
        log("[2/4] public-only baseline: the untouched model's completion perplexity on the test plays")
        card["baseline_result"] = evaluate(net)
        _count_real(done, training_rows, user)
        set_seed(training_args.seed)  # LoRA starts from the run's seed, as in the study's run
        trainer = DPSFTTrainer(model=net, args=training_args, train_dataset=training_rows, processing_class=tokenizer,
                               peft_config=lora_config(config), privacy_card_kwargs=card)
        return _started(done, trainer, training, audit, log)

    # Canaries are conversations like the real rows (system prompt, a user message, a reply), their replies made
    # of rare tokens each used by one canary only (`rare_words`), scored black box on the reply tokens only: the
    # trained model's loss against the untouched model's (LoRA starts at zero).
    try:
        reply_words = rare_words(tokenizer, audit["canaries"] * audit["rows_per_canary"] * REPLY_WORDS)
    except ValueError as error:  # a toy vocabulary (tests): replies of shared words, a weaker audit
        log(f"[!] {error} Canary replies fall back to shared random words (a weaker audit).")
        reply_words = None
    done["canary_replies"] = "shared-words" if reply_words is None else "rare-words"
    done["report"] = audit_training(
        make_trainer, data.train.select_columns([user, "prompt", "completion"]), user_id_column=user,
        text_column="completion", prompt_column="prompt", system_prompt=config.system_prompt,
        score_tokenize=tokenize, score_collator=collator, reply_vocabulary=reply_words, **audit)
    done["train_and_audit_seconds"] = time.perf_counter() - done["train_start"]
    log("[4/4] test completion perplexity of the audited model; saving model, card and audit.json")
    done["eval_result"] = evaluate(done["trainer"].model)
    return dict(done, card=card)


def _count_real(done: dict, training_rows, user: str) -> None:
    """The counts we report: real users and rows only (canaries are never counted)."""
    from hf_dp.audit import remove_canaries

    real = remove_canaries(training_rows, user)
    done["num_train_users"], done["num_train_examples"] = len(set(real[user])), len(real)


def _started(done: dict, trainer, training: dict, audit: dict, log):
    log(f"[3/4] training with user-level DP (ULS) at ε = {training['target_epsilon']:g} for "
        f"{training['max_steps']} steps with {audit['canaries']} canary users added by fair coins, then scoring them")
    done["trainer"], done["train_start"] = trainer, time.perf_counter()
    return trainer


def format_result(result: dict) -> str:
    """The audit as a short aligned table."""
    audit = result["audit"]
    metric = result.get("metric_name", "accuracy")
    digits = ".4f" if metric == "accuracy" else ".2f"
    def down(value):  # lower bounds are shown rounded down, the proven ε rounded up, as in the card
        return f"{math.floor(value * 100) / 100:.2f}"

    rows = [
        ("ε proven (accountant, upper bound)", format_epsilon(result['epsilon'])),
        ("ε audited (lower bound, Steinke et al.)", down(audit["epsilon_lower_bound"])),
        (f"ceiling of m = {audit['canaries']} (every guess right)", down(audit["epsilon_ceiling"])),
        ("correct guesses", f"{audit['correct']} of {sum(audit['guesses'])}"),
        ("expected visits per included canary (q x steps)",
         "-" if result.get("visits_per_canary") is None else f"{result['visits_per_canary']:.1f}"),
        (f"test {metric} (public-only baseline)",
         f"{result['eval_result']:{digits}} ({result['baseline_result']:{digits}})"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [
        f"Empirical privacy audit (one run): {result['base_model']} on {result['dataset']}, user-level DP (ULS)",
        f"  m = {audit['canaries']} canary users x k = {audit['rows_per_canary']} rows, {audit['score']} score, "
        f"δ = {audit['delta']:.2g}, confidence {100 * audit['confidence']:g} %",
    ]
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows]
    if result.get("sabotage"):
        lines.append(f"  (--sabotage {result['sabotage']}: this run was broken on purpose to test the audit)")
    if audit["exceeds_upper_bound"]:
        lines.append(f"  WARNING: {audit.get('verdict') or 'the audit FAILED: lower bound > proven ε'}.")
    else:
        lines.append("  A lower bound below the proven ε is expected; one above it would reveal a bug.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def _per_task(describe) -> str:
    """`describe(task)` for each audited task ([`TASKS`]), for the flags' help: "300 for sft, 100 for ..."."""
    return ", ".join(f"{describe(get_task(key))} for {key}" for key in TASKS)


@dataclasses.dataclass
class AuditArguments:
    """The `hf-dp audit` flags (`python -m hf_dp.workflows.audit_demo` takes the same), named as the training
    arguments they set."""

    task: str = dataclasses.field(
        default=DEFAULT_TASK,
        metadata={"help": "sft (default: the chat study's ULS run, DPSFTTrainer on SmolLM2-135M-Instruct, "
                          "conversation canaries scored on their replies) or classification (the MiniLM study's).",
                  "choices": TASKS})
    target_epsilon: float = dataclasses.field(
        default=2.0, metadata={"help": "ε the audited DP run claims (the accountant calibrates its noise to it). "
                                       "Default: 2, below what the default audit can show (its ceiling 3.9)"})
    canaries: int | None = dataclasses.field(
        default=None, metadata={"help": f"Canary users m. Default: {_per_task(lambda task: task.audit.canaries)} "
                                        "(16 with --quick)"})
    rows_per_canary: int = dataclasses.field(
        default=1,
        metadata={"help": "Rows per canary k, at most the run's contribution bound G "
                          f"({_per_task(lambda task: contribution_bound(task.key))}). "
                          "Default: 1"})
    confidence: float = dataclasses.field(
        default=0.95, metadata={"help": "Probability that the reported lower bounds hold. Default: 0.95"})
    score: str = dataclasses.field(
        default="auto",
        metadata={"help": "Canary score: trained-loss (the trained model's loss on the canary), black-box (its drop "
                          "from the base model) or white-box (how far the update went along the canary's gradient); "
                          f"auto = the task's: {_per_task(lambda task: task.audit.score)}. Default: auto",
                  "choices": SCORE_CHOICES})
    results_dir: str = dataclasses.field(
        default="results", metadata={"help": "Folder for audit.json and models/audit/. Default: results"})
    max_steps: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Optimizer steps of the audited run (more steps sample each canary more often, at more "
                          f"noise per step). Default: {_per_task(lambda task: task.audit.max_steps)}"})
    max_train_users: int | None = dataclasses.field(
        default=None,
        metadata={"help": f"Real users of the audited run (a seeded sample): fewer make the canaries a larger share, "
                          "so each is drawn more often (q = users per step / N). Default: "
                          f"{_per_task(lambda task: task.audit.max_train_users or 'all')}"})
    target_delta: float | None = dataclasses.field(
        default=None,
        metadata={"help": "δ of the audited run (and of its bound; a smaller δ lets the bound go higher). Default: "
                          + _per_task(lambda task: f"{task.audit.target_delta:g}" if task.audit.target_delta
                                      else "the trainer's 1/(10 N)")})
    sabotage: str | None = dataclasses.field(
        default=None,
        metadata={"help": "TESTS THE AUDIT ONLY: no-noise silently turns the gradient noise off while the card and "
                          "report still claim the accountant's ε; the audit should then FAIL (exit code 3). "
                          "Default: none", "choices": SABOTAGES})
    max_eval_examples: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Test rows for the metric (a seeded sample). Default: "
                          f"{_per_task(lambda task: task.audit.max_eval_examples)}"})
    canary_seed: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Seed of the canaries and their coins. Default: OS entropy (saved in the record)"})
    noise_seed: int | None = dataclasses.field(
        default=None, metadata={"help": "Seed of sampling and noise, for tests only. Default: OS entropy"})
    quick: bool = dataclasses.field(
        default=False,
        metadata={"help": "Tiny subset, 16 canaries and 2 steps (tests, a minute or two; numbers mean nothing)"})
    num_threads: int | None = dataclasses.field(
        default=None,
        metadata={"help": "torch CPU threads. Default: torch's choice (1 is faster on a machine busy with other "
                          "work)"})
    no_progress: bool = dataclasses.field(default=False, metadata={"help": "No progress bars."})

    def __post_init__(self):
        check_numbers(self, {"target_epsilon": "float>0", "canaries": "int>=2", "rows_per_canary": "int>=1",
                             "max_train_users": "int>=1", "target_delta": "(0,1)",
                             "confidence": "(0,1)", "max_steps": "int>=1", "max_eval_examples": "int>=1",
                             "canary_seed": "int>=0", "noise_seed": "int>=0", "num_threads": "int>=1"})
        if self.task not in TASKS:
            raise ValueError(f"--task {self.task!r}: use one of {', '.join(TASKS)}.")
        bound = contribution_bound(self.task)
        if self.rows_per_canary > bound:
            raise ValueError(f"--rows_per_canary {self.rows_per_canary}: the audited run keeps at most G = {bound} "
                             f"row{'s' if bound > 1 else ''} per user, so use at most {bound}.")
        if self.score not in SCORE_CHOICES:
            raise ValueError(f"--score {self.score!r}: use {', '.join(SCORE_CHOICES)}.")
        if self.sabotage is not None and self.sabotage not in SABOTAGES:
            raise ValueError(f"--sabotage {self.sabotage!r}: use {', '.join(SABOTAGES)} (to test the audit only).")


def check_canary_count(canaries: int, training: dict) -> None:
    """Refuse more canaries than the audited run can train on, before anything is built: T steps of B users each
    draw about B·T users in all, so beyond 2·B·T canaries (half of them included by their coins) most included
    canaries are never in a batch and add nothing to the audit but time."""
    batch, steps = training.get("expected_batch_size"), training.get("max_steps")
    if not (isinstance(batch, (int, float)) and isinstance(steps, int)) or steps <= 0:
        return
    most = int(2 * batch * steps)
    if canaries > most:
        raise ValueError(f"--canaries {canaries:,}: the audited run samples {batch:g} users a step for {steps:,} steps "
                         f"(about {batch * steps:,.0f} draws in all), so at most {most:,} canaries (half of them "
                         "included) can each be trained on; use at most that, or raise --max_steps.")


def build_parser() -> ArgumentParser:
    """The `hf-dp audit` parser, over [`AuditArguments`]."""
    return ArgumentParser(
        AuditArguments, prog="hf-dp audit", one_line_errors=True, formatter_class=argparse.HelpFormatter,
        description="Empirical privacy audit in one training run (Steinke, Nasr & Jagielski 2023) on the embedded "
                    "default: canary users added by fair coins to the demo's ULS run (SmolLM2 chat fine-tuning on "
                    "Shakespeare roles; --task classification: MiniLM), then an ε lower bound beside the proven ε.",
    )


def main(argv=None) -> int:
    """Entry point of `python -m hf_dp.workflows.audit_demo` (`hf-dp audit` calls [`run`])."""
    return run_command(build_parser(), run, argv)


def run(args: AuditArguments) -> int:
    """Run the audit with parsed [`AuditArguments`] and print its table; return 0, or [`AUDIT_FAILED_EXIT_CODE`]
    (3) when the audit FAILED (its lower bound exceeds the proven ε)."""
    require_extra("demo", *get_task(args.task).audit.extras)  # what the audited run imports beyond the core
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never reach for the Hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    result = run_audit(task=args.task, target_epsilon=args.target_epsilon, canaries=args.canaries,
                       rows_per_canary=args.rows_per_canary,
                       confidence=args.confidence, score=args.score, results_dir=args.results_dir,
                       max_steps=args.max_steps, max_eval_examples=args.max_eval_examples,
                       canary_seed=args.canary_seed, noise_seed=args.noise_seed, quick=args.quick,
                       progress=not args.no_progress, max_train_users=args.max_train_users,
                       target_delta=args.target_delta, sabotage_run=args.sabotage)
    print(format_result(result))
    print(f"Results: {args.results_dir}/audit.json; model and card: {args.results_dir}/{result['model_dir']} "
          f"(canary record in its _audit/, never uploaded) ({result['seconds'] / 60:.1f} min)")
    if result["audit_failed"]:
        print(f"hf-dp audit: {result['verdict']} (exit code {AUDIT_FAILED_EXIT_CODE})", file=sys.stderr)
        return AUDIT_FAILED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
