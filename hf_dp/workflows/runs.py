"""What every run shares: its configuration, its training arguments, and how it trains and saves its model.

A run is described by two objects, and each setting lives in exactly one of them:

- [`RunConfig`] (extended by [`hf_dp.workflows.tasks.classification`] and
  [`hf_dp.workflows.tasks.language_modeling`]): the run's name, its data, its model and its evaluation;
- its training arguments: [`~hf_dp.DPTrainingArguments`] for a DP run, plain [`~transformers.TrainingArguments`]
  for a non-private one. Every privacy setting (`target_epsilon`, `target_delta`, `privacy_unit`, `sampling`,
  `expected_batch_size`, `contribution_bound`, `max_grad_norm`, `noise_multiplier`, ...) and every optimisation
  setting is a field there, with its default there; the run's mechanism (a key of
  [`~hf_dp.vocabulary.MECHANISMS`]) follows from them ([`mechanism_of_arguments`]). [`RunConfig.training_arguments`]
  builds them for a mechanism; the recipes parse them from the command line ([`hf_dp.workflows.recipes`]).

The one setting both need is the user column: [`RunConfig.user_id_column`] splits the data by user (for every run,
the non-private one too; [`hf_dp.workflows.run_data`]) and must equal `DPTrainingArguments.user_id_column`, the
privacy unit of a DP run ([`check_user_id_column`]); the recipes' `--user_id_column` flag sets both.

A run trains with [`fit`], saves its model and privacy card to `<results_dir>/models/<run>/` with [`save_run`] and
writes `<results_dir>/<run>.json` ([`hf_dp.workflows.run_results`]). Nothing here affects the privacy accounting
except the training arguments it passes on.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from hf_dp.command_line import check_numbers
from hf_dp.vocabulary import DP_MECHANISMS, mechanism

__all__ = [
    "RunConfig",
    "check_user_id_column",
    "finish_processes",
    "fit",
    "is_main_process",
    "mechanism_of_arguments",
    "plain_training_arguments",
    "privacy_fields",
    "save_model",
    "save_run",
]


@dataclass
class RunConfig:
    r"""
    One fine-tuning run: its data, model and evaluation. Task modules extend it. Privacy and optimisation settings
    are not here: they are the fields of the run's training arguments ([`RunConfig.training_arguments`]).

    Args:
        > Run

        run (`str`): name of the run; the result goes to `results_dir/<run>.json`, the model to
            `results_dir/models/<run>/`.
        results_dir (`str`, *optional*, defaults to `"results"`): where results and models are written.

        > Data

        dataset (`str`, *optional*, defaults to `"shakespeare"`): `"shakespeare"`
            ([`~hf_dp.workflows.corpora.load_shakespeare`]) or a JSONL/CSV/Parquet path or Hub id
            ([`~hf_dp.workflows.corpora.load_user_dataset`]).
        eval_dataset (`str`, *optional*): test data for a custom `dataset`; default: a split by user
            (about `eval_fraction` of the users, [`split_by_user`]), so no test user is ever trained on.
        user_id_column (`str`, *optional*, defaults to `"user_id"`): column with the user id: the split by user,
            and the privacy unit of a DP run, whose `DPTrainingArguments.user_id_column` must be the same.
        text_column (`str`, *optional*, defaults to `"text"`): column with the text.
        max_train_users (`int`, *optional*): train on a sample of this many users (quick runs, [`subsample_users`]).
            The split and this sample are keyed by `seed`: each user's side is a keyed hash of (`seed`, user id)
            alone, so one user more or less moves no other user across the split (but one in or out of this
            fixed-size sample can displace another: replace-one adjacency, which the result and the card then
            state, [`~hf_dp.workflows.run_data.user_sample_statement`]). `seed` is saved in the result JSON; the
            guarantee does not need it secret.
        max_eval_examples (`int`, *optional*): evaluate on a seeded sample of this many test rows.
        exclude_train_plays (`list[str]`, *optional*): `dataset="shakespeare"` only: titles of training plays
            whose roles are left out of training (e.g. [`hf_dp.workflows.study_settings.TUNING_PLAYS`], which the study
            tunes its hyper-parameters on, so that the tuning uses no training user). Preprocessing: the
            guarantee covers the roles trained on.
        seed (`int`, *optional*, defaults to `0`): seed of the split and the samples; [`training_arguments`]
            trains with it too (the recipes set it from `--seed`).

        > Model

        model_name_or_path (`str`, *optional*): local path or Hub id (the task module says what `None` means).
        max_length (`int`, *optional*, defaults to `32`): tokens per text (truncation), train and test.
        use_lora (`bool`, *optional*, defaults to `True`): LoRA adapters instead of full fine-tuning.
        lora_r, lora_alpha, lora_target_modules (`list[str]`, *optional*; peft's default for the
            architecture when `None`), lora_layers (`list[int]`, *optional*; all layers when `None`).

        > Evaluation (post-processing: no effect on ε)

        eval_batch_size (`int`, *optional*, defaults to `128`): texts per evaluation forward pass.
        baseline_result (`float`, *optional*): the public-only baseline's metric on the same test rows when
            already known; computed when `None`.
        non_private_result (`float`, *optional*): a non-private run's metric on the same test rows, when known
            (shown in the card and recorded in the result JSON).
        progress (`bool`, *optional*, defaults to `True`): progress bars.
    """

    run: str
    results_dir: str = "results"
    # data
    dataset: str = "shakespeare"
    eval_dataset: str | None = None
    eval_fraction: float = 0.2
    user_id_column: str = "user_id"
    text_column: str = "text"
    max_train_users: int | None = None
    max_eval_examples: int | None = None
    exclude_train_plays: list | None = None
    seed: int = 0
    # model
    model_name_or_path: str | None = None
    max_length: int = 32
    use_lora: bool = True
    lora_r: int = 8
    lora_alpha: int = 16
    lora_target_modules: list | None = None
    lora_layers: list | None = None
    # evaluation
    eval_batch_size: int = 128
    baseline_result: float | None = None
    non_private_result: float | None = None
    progress: bool = True

    # Optimisation defaults of `training_arguments()` (TrainingArguments field names). Every other field, the
    # privacy fields included, keeps its TrainingArguments / DPTrainingArguments default.
    DP_TRAINING_DEFAULTS: ClassVar[dict] = {"learning_rate": 2e-3, "num_train_epochs": 2.0,
                                            "per_device_train_batch_size": 64}
    NON_PRIVATE_TRAINING_DEFAULTS: ClassVar[dict] = {"learning_rate": 5e-4, "num_train_epochs": 2.0,
                                                     "per_device_train_batch_size": 32}

    # The numeric fields' checks ([`~hf_dp.command_line.check_numbers`] rules); the recipes check their flags with them.
    NUMBER_RULES: ClassVar[dict] = {
        "eval_fraction": "(0,1)", "max_train_users": "int>=1", "max_eval_examples": "int>=1", "seed": "int>=0",
        "max_length": "int>=1", "lora_r": "int>=1", "lora_alpha": "int>=1", "eval_batch_size": "int>=1",
    }

    def __post_init__(self):
        if not self.run or "/" in self.run or os.sep in self.run:
            raise ValueError(f"run={self.run!r}: use a non-empty name without path separators (it names files).")
        check_numbers(self, self.NUMBER_RULES, flags=False)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def model_dir(self) -> Path:
        """Where the trained model, its tokenizer and its card are saved."""
        return Path(self.results_dir) / "models" / self.run

    def training_arguments(self, mechanism: str = "uls", **fields):
        """The training arguments of this run for `mechanism`, a key of [`~hf_dp.vocabulary.MECHANISMS`].

        `"uls"`, `"els"`, `"example"`: [`~hf_dp.DPTrainingArguments`] with that mechanism's `privacy_unit` and
        `sampling` and this config's `user_id_column`; `"non-private"`: plain [`~transformers.TrainingArguments`].
        `fields` are their field names (`target_epsilon=3`, `expected_batch_size=8`, `max_steps=200`, ...); what
        is not given keeps its default there (the optimisation defaults of this class excepted). Output goes to
        [`model_dir`], seeded by `seed`, without checkpoints or reporting integrations.

        Raises:
            ValueError: an unknown mechanism, `"public-only"` (it trains nothing), a privacy field for a
                non-private run, or `privacy_unit`/`sampling`/`user_id_column` in `fields` (they follow from
                `mechanism` and this config). Invalid values raise [`~hf_dp.DPTrainingArguments`]'s own error.

        Example:

        ```python
        >>> args = RunConfig(run="uls-eps3").training_arguments("els", target_epsilon=3.0, expected_batch_size=32)
        >>> args.mechanism, args.target_epsilon, args.contribution_bound
        ('els', 3.0, 'auto')

        ```
        """
        dp_class, plain_class = self.training_argument_classes()
        entry = _training_mechanism(mechanism)
        fixed = sorted({"privacy_unit", "sampling", "user_id_column"} & set(fields))
        if fixed:
            raise ValueError(f"training_arguments({mechanism!r}, {fixed[0]}=...): {fixed[0]} follows from the "
                             "mechanism and RunConfig.user_id_column; pass the mechanism, or set user_id_column on "
                             "the run config.")
        common = dict(
            output_dir=str(self.model_dir), seed=self.seed, logging_steps=5, save_strategy="no", report_to=[],
            disable_tqdm=not self.progress, dataloader_num_workers=0,
        )
        if not entry.is_private:
            privacy = sorted(set(fields) & privacy_fields())
            if privacy:
                raise ValueError(f"{privacy[0]}={fields[privacy[0]]!r}: a non-private run has no privacy settings; "
                                 f"drop it, or pick a DP mechanism ({', '.join(DP_MECHANISMS)}).")
            return plain_class(**{**common, **self.NON_PRIVATE_TRAINING_DEFAULTS, **fields})
        unit = {"privacy_unit": entry.privacy_unit, "user_id_column": self.user_id_column}
        if entry.sampling is not None:
            unit["sampling"] = entry.sampling
        return dp_class(**{**common, **self.DP_TRAINING_DEFAULTS, **unit, **fields})

    def training_argument_classes(self) -> tuple[type, type]:
        """The classes [`training_arguments`] builds: (DP, non-private), [`~hf_dp.DPTrainingArguments`] and
        [`~transformers.TrainingArguments`] here; a task that trains with another trainer returns its own (a
        subclass of each, e.g. TRL's SFT configs in [`hf_dp.workflows.tasks.chat_sft`])."""
        from transformers import TrainingArguments

        from hf_dp.arguments import DPTrainingArguments

        return DPTrainingArguments, TrainingArguments


def _training_mechanism(key: str):
    entry = mechanism(key)
    if key == "public-only":
        raise ValueError("mechanism='public-only' trains nothing (it is the public model itself): evaluate it with "
                         "the task's run_zero_shot_baseline / baseline_result, or pick one of "
                         f"{(*DP_MECHANISMS, 'non-private')}.")
    return entry


def privacy_fields() -> set[str]:
    """The fields [`~hf_dp.DPTrainingArguments`] adds to [`~transformers.TrainingArguments`]."""
    from transformers import TrainingArguments

    from hf_dp.arguments import DPTrainingArguments

    plain = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {f.name for f in dataclasses.fields(DPTrainingArguments)} - plain


def mechanism_of_arguments(training_args) -> str:
    """The run's mechanism: `"non-private"` for plain `TrainingArguments`, else `training_args.mechanism`
    (`"uls"`, `"els"` or `"example"`)."""
    from hf_dp.arguments import DPTrainingArguments

    if not isinstance(training_args, DPTrainingArguments):
        return "non-private"
    return training_args.mechanism


def check_user_id_column(config: RunConfig, training_args) -> None:
    """Raise `ValueError` (one line) when a DP run's `user_id_column` is not the column its config splits by."""
    column = getattr(training_args, "user_id_column", None)
    if mechanism_of_arguments(training_args) != "non-private" and column != config.user_id_column:
        raise ValueError(
            f"user_id_column: the training arguments say {column!r}, the run config {config.user_id_column!r}; "
            "set both to your data's user column (the recipes' --user_id_column sets both, and "
            "RunConfig.training_arguments() copies the config's)."
        )


def plain_training_arguments(training_args, arguments_class: type | None = None):
    """The [`~transformers.TrainingArguments`] part of [`~hf_dp.DPTrainingArguments`], for a non-private run.

    The privacy fields are dropped; `max_grad_norm` becomes Trainer's usual global clipping norm, and an unset
    `per_device_train_batch_size` (DP's default: sized from the Poisson sample) takes the plain class's default.
    `arguments_class` (default `TrainingArguments`) is the class built, from its fields' values: e.g. TRL's
    `SFTConfig` out of a `DPSFTConfig`.
    """
    import enum

    from transformers import TrainingArguments

    arguments_class = arguments_class or TrainingArguments
    values = {}
    for spec in dataclasses.fields(arguments_class):
        if not spec.init or not hasattr(training_args, spec.name):
            continue
        value = getattr(training_args, spec.name)
        if value is None and spec.name == "per_device_train_batch_size":
            continue
        values[spec.name] = value.value if isinstance(value, enum.Enum) else value
    return arguments_class(**values)


# ----------------------------------------------------------------------------------------------------------
# Training and saving (shared by the task modules)
# ----------------------------------------------------------------------------------------------------------


def fit(model, training_args, train_dataset, *, data_collator, tokenizer, card: dict, callbacks=None):
    """Train with [`~hf_dp.DPTrainer`] (DP arguments) or [`~transformers.Trainer`]; return (trainer, seconds).

    `card` holds the privacy card's extra fields (dataset name, baseline...), post-processing only;
    `callbacks` are extra [`~transformers.TrainerCallback`]s (e.g. the Gradio app's progress bar).
    """
    from transformers import Trainer

    callbacks = list(callbacks) if callbacks else None
    if mechanism_of_arguments(training_args) == "non-private":
        trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, data_collator=data_collator,
                          processing_class=tokenizer, callbacks=callbacks)
    else:
        from hf_dp.trainer import DPTrainer

        trainer = DPTrainer(model=model, args=training_args, train_dataset=train_dataset,
                            data_collator=data_collator, processing_class=tokenizer, privacy_card_kwargs=card,
                            callbacks=callbacks)
    announce_plan(trainer)
    start = time.perf_counter()
    trainer.train()
    return trainer, time.perf_counter() - start


def plan_line(trainer) -> str | None:
    """The DP plan of a built DP trainer in one line (G, σ, q, steps, δ, target ε); `None` for a plain Trainer.

    Public settings and the ε-DP choice of G only (no statistic of the data beyond it): printing it costs no ε.
    """
    plan = getattr(trainer, "privacy_plan", None)
    if plan is None:
        return None
    from hf_dp.formatting import format_significant
    from hf_dp.vocabulary import MECHANISMS

    entry, args = MECHANISMS[plan.mechanism], trainer.args
    spent = trainer.budget.bound_epsilon
    if plan.contribution_bound is None:
        bound = "no contribution bound (every row kept)"
    else:
        bound = f"G = {plan.contribution_bound}" + (f" (chosen from the data with ε = {spent:g})" if spent else "")
    target = "fixed σ" if args.target_epsilon is None else f"target ε = {args.target_epsilon:g}"
    return (f"DP plan ({entry.label}): {bound}, σ = {format_significant(plan.noise_multiplier, 3, up=False)}, "
            f"q = {format_significant(plan.sample_rate, 3, up=True)} ({args.expected_batch_size:g} "
            f"{entry.sampled_unit} expected per step), {plan.steps} steps, "
            f"δ = {format_significant(plan.delta, 3, up=True)}, {target}.")


def announce_plan(trainer) -> None:
    """Print [`plan_line`] once, before training (main process only)."""
    line = plan_line(trainer)
    if line is not None and is_main_process():
        print(line, flush=True)


def save_model(model, tokenizer, model_dir, *, adapter_only: bool = False) -> None:
    """Save the model with its LoRA adapters merged (no peft needed to load it) and its tokenizer.

    A transformers model reloads with `from_pretrained(model_dir)`; an
    [`~hf_dp.workflows.tasks.classifier_models.EmbeddingClassifier`] with
    [`~hf_dp.workflows.tasks.classifier_models.load_classifier`]. `adapter_only` with a peft model: only the LoRA
    adapter is saved (peft's `adapter_config.json` and `adapter_model.safetensors`, kilobytes where the merged model
    takes hundreds of megabytes); it reloads onto its base model with `peft.PeftModel.from_pretrained`.
    """
    if adapter_only and hasattr(model, "peft_config"):
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        return
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def save_run(trainer, tokenizer, model_dir, *, eval_result: float, card: dict,
             adapter_only: bool = False) -> dict | None:
    """Save model, tokenizer and card (main process only); return the privacy report (`None` if non-private).

    The card is rewritten with the evaluation beside the public-only baseline (post-processing: no effect on ε).
    `adapter_only`: save the LoRA adapter instead of the merged model ([`save_model`]).
    """
    from hf_dp.card import write_privacy_card

    privacy = trainer.privacy_report() if hasattr(trainer, "privacy_report") else None
    if trainer.is_world_process_zero():
        save_model(trainer.model, tokenizer, model_dir, adapter_only=adapter_only)
        if privacy is None:
            write_privacy_card({"non_private": True}, model_dir, eval_result=eval_result, **card)
        else:
            trainer.write_privacy_card(str(model_dir), eval_result=eval_result, **card)
    return privacy


def finish_processes() -> None:
    """End a multi-process run cleanly: wait for every rank, then destroy the process group.

    Without this, a rank that finishes first can exit while gloo still holds a connection to the
    others, and abort ("terminate called without an active exception"), failing `accelerate launch`.
    """
    from accelerate import PartialState

    state = PartialState()
    if state.use_distributed:
        state.wait_for_everyone()
        state.destroy_process_group()


def is_main_process() -> bool:
    """Whether this is the process that writes files (always true without `accelerate launch`)."""
    from accelerate import PartialState

    return PartialState().is_main_process
