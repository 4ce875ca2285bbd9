"""What every recipe run shares: its configuration, splits by user, and the result JSON.

A run is described by two objects, and each setting lives in exactly one of them:

- [`RunConfig`] (extended by [`hf_dp.workflows.tasks.classification`] and
  [`hf_dp.workflows.tasks.language_modeling`]): the run's name, its data, its model and its evaluation;
- its training arguments: [`~hf_dp.DPTrainingArguments`] for a DP run, plain [`~transformers.TrainingArguments`]
  for a non-private one. Every privacy setting (`target_epsilon`, `target_delta`, `privacy_unit`, `sampling`,
  `expected_batch_size`, `contribution_bound`, `max_grad_norm`, `noise_multiplier`, ...) and every optimisation
  setting is a field there, with its default there; the run's mechanism (a key of
  [`~hf_dp.vocabulary.MECHANISMS`]) follows from them ([`mechanism_of_arguments`]). [`RunConfig.training_arguments`]
  builds them for a mechanism; the recipes parse them from the command line.

The one setting both need is the user column: [`RunConfig.user_id_column`] splits the data by user (for every run,
the non-private one too) and must equal `DPTrainingArguments.user_id_column`, the privacy unit of a DP run
([`check_user_id_column`]); the recipes' `--user_id_column` flag sets both.

A run writes `<results_dir>/<run>.json` with [`save_result`] (keys [`RESULT_KEYS`], schema in
[`hf_dp.workflows.tasks.classification`]'s docstring; its `config` records the run config and the training
arguments the run used) and its model to `<results_dir>/models/<run>/`. Nothing here affects the privacy accounting
except the training arguments it passes on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Mapping

import numpy as np

from hf_dp.vocabulary import DP_MECHANISMS, MECHANISMS, mechanism

__all__ = [
    "RESULT_KEYS",
    "RunConfig",
    "check_disjoint_users",
    "check_user_id_column",
    "fit",
    "is_main_process",
    "load_result",
    "mechanism_of_arguments",
    "plain_training_arguments",
    "result_record",
    "run_config_record",
    "save_model",
    "save_result",
    "save_run",
    "split_by_user",
    "subsample_rows",
    "subsample_users",
    "without_plays",
]

# Keys every result JSON has (the Gradio app and the study rely on them); `non_private_result` is added when known.
RESULT_KEYS = (
    "run", "mechanism", "target_epsilon", "epsilon", "delta", "privacy", "metric_name", "eval_result",
    "baseline_result", "model_dir", "base_model", "task", "train_seconds", "eval_seconds", "config",
)


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
            alone, so one user more or less moves no other user across the split (and at most one in or out of
            this fixed-size sample). `seed` is saved in the result JSON; the guarantee does not need it secret.
        max_eval_examples (`int`, *optional*): evaluate on a seeded sample of this many test rows.
        exclude_train_plays (`list[str]`, *optional*): `dataset="shakespeare"` only: titles of training plays
            whose roles are left out of training (e.g. [`hf_dp.workflows.study.TUNING_PLAYS`], which the study
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

    def __post_init__(self):
        if not self.run or "/" in self.run or os.sep in self.run:
            raise ValueError(f"run={self.run!r}: use a non-empty name without path separators (it names files).")

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
        from transformers import TrainingArguments

        from hf_dp.arguments import DPTrainingArguments

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
            privacy = sorted(set(fields) & _privacy_fields())
            if privacy:
                raise ValueError(f"{privacy[0]}={fields[privacy[0]]!r}: a non-private run has no privacy settings; "
                                 f"drop it, or pick a DP mechanism ({', '.join(DP_MECHANISMS)}).")
            return TrainingArguments(**{**common, **self.NON_PRIVATE_TRAINING_DEFAULTS, **fields})
        unit = {"privacy_unit": entry.privacy_unit, "user_id_column": self.user_id_column}
        if entry.sampling is not None:
            unit["sampling"] = entry.sampling
        return DPTrainingArguments(**{**common, **self.DP_TRAINING_DEFAULTS, **unit, **fields})


def _training_mechanism(key: str):
    entry = mechanism(key)
    if key == "public-only":
        raise ValueError("mechanism='public-only' trains nothing (it is the public model itself): evaluate it with "
                         "the task's run_zero_shot_baseline / baseline_result, or pick one of "
                         f"{(*DP_MECHANISMS, 'non-private')}.")
    return entry


def _privacy_fields() -> set[str]:
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


# ----------------------------------------------------------------------------------------------------------
# Splits and subsets (preprocessing: they choose the rows, the guarantee is about the rows trained on)
# ----------------------------------------------------------------------------------------------------------


def split_by_user(dataset, user_id_column: str, fraction: float = 0.2, seed: int = 0):
    """(train, test): each user goes to test, with all their rows, when its keyed hash is below `fraction`.

    A user's side depends only on (`seed`, user id) ([`~hf_dp.data.keyed_uniform`]): adding or removing one
    user moves no other user, so neighbouring datasets give neighbouring training sets. The test set thus holds
    about `fraction` of the users (at least one, never all: for a split that would be empty on one side, the
    user with the lowest, or highest, hash is moved).

    Raises:
        ValueError: fewer than two users.
    """
    from hf_dp.data import keyed_uniform

    users = dataset.unique(user_id_column)
    if len(users) < 2:
        raise ValueError(f"Need at least two users to split by user; found {len(users)}.")
    draws = {user: keyed_uniform(seed, user, "split") for user in users}
    test_users = {user for user, draw in draws.items() if draw < fraction}
    if not test_users or len(test_users) == len(users):  # only with very few users
        ranked = sorted(users, key=draws.get)
        test_users = {ranked[0]} if not test_users else set(ranked[:-1])
    is_test = [u in test_users for u in dataset[user_id_column]]
    return (dataset.select([i for i, t in enumerate(is_test) if not t]),
            dataset.select([i for i, t in enumerate(is_test) if t]))


def subsample_users(dataset, user_id_column: str, max_users: int | None, seed: int = 0):
    """The rows of the `max_users` users with the lowest keyed hash of (`seed`, user id) (all rows when `None` or
    not fewer users).

    Each user's hash depends on nothing else, so adding or removing an unselected user changes nothing, and a
    selected one displaces at most one other user (a fixed-size sample must).
    """
    from hf_dp.data import keyed_uniform

    if max_users is None:
        return dataset
    users = dataset.unique(user_id_column)
    if max_users >= len(users):
        return dataset
    chosen = set(sorted(users, key=lambda user: keyed_uniform(seed, user, "subsample"))[:max_users])
    keep = [i for i, u in enumerate(dataset[user_id_column]) if u in chosen]
    return dataset.select(keep)


def subsample_rows(dataset, max_rows: int | None, seed: int = 0):
    """A seeded sample of `max_rows` rows, in their original order (all rows when `None` or not fewer)."""
    if max_rows is None or max_rows >= len(dataset):
        return dataset
    rows = np.random.default_rng(seed).choice(len(dataset), size=max_rows, replace=False)
    return dataset.select(np.sort(rows).tolist())


def load_splits(config, **columns):
    """Train and test rows of `config.dataset`, users disjoint: Shakespeare split by play, or the caller's data
    with `config.eval_dataset` (or a seeded split by user) as the test set.

    `columns`: extra required columns of [`~hf_dp.workflows.corpora.load_user_dataset`] (e.g. `label_column`).

    Raises:
        ValueError: a missing column, a test split sharing users with train, or `exclude_train_plays` with data
            that has no `play` column or naming a play that is not among the training plays.
    """
    from hf_dp.workflows import corpora

    if config.dataset == "shakespeare":
        corpus = corpora.load_shakespeare()
        train, test = corpus["train"], corpus["test"]
    else:
        load = dict(user_id_column=config.user_id_column, text_column=config.text_column, **columns)
        train = corpora.load_user_dataset(config.dataset, **load)
        if config.eval_dataset is not None:
            test = corpora.load_user_dataset(config.eval_dataset, **load)
        else:
            train, test = split_by_user(train, config.user_id_column, config.eval_fraction, config.seed)
    if getattr(config, "exclude_train_plays", None):
        train = without_plays(train, config.exclude_train_plays)
    check_disjoint_users(train, test, config.user_id_column)
    return train, test


def without_plays(train, plays):
    """`train` without the rows of `plays` (its `play` column).

    Raises:
        ValueError: no `play` column, or a play that is not in `train`.
    """
    if "play" not in train.column_names:
        raise ValueError("exclude_train_plays needs a 'play' column (dataset='shakespeare'); unset it for other data.")
    present = set(train.unique("play"))
    unknown = sorted(set(plays) - present)
    if unknown:
        raise ValueError(f"exclude_train_plays: {unknown} are not training plays (they are: {sorted(present)}).")
    excluded = set(plays)
    return train.filter(lambda play: [p not in excluded for p in play], input_columns="play", batched=True)


def check_disjoint_users(train, test, user_id_column: str) -> None:
    """Raise `ValueError` when a user has rows in both splits (the test set must hold other users)."""
    if user_id_column not in test.column_names:
        return
    overlap = set(train.unique(user_id_column)) & set(test.unique(user_id_column))
    if overlap:
        raise ValueError(
            f"{len(overlap)} users are in both the training and the test data (e.g. {sorted(overlap, key=str)[:3]}): "
            "the test set must hold other users. Drop --eval_dataset to split by user."
        )


# ----------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------

# The TrainingArguments fields a result records (besides every field DPTrainingArguments adds).
_TRAINING_KEYS = (
    "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size", "lr_scheduler_type",
    "warmup_steps", "weight_decay", "seed", "max_grad_norm",
)


def training_summary(training_args) -> dict:
    """The values of `training_args` a result records: the optimisation fields above and, for
    [`~hf_dp.DPTrainingArguments`], every privacy field under its own name (`sampling` is `None` at the example
    level, where it is unused, as in the privacy report)."""
    keys = list(_TRAINING_KEYS)
    if mechanism_of_arguments(training_args) != "non-private":
        keys += sorted(_privacy_fields())
    out = {}
    for key in keys:
        if hasattr(training_args, key):
            value = getattr(training_args, key)
            out[key] = value if isinstance(value, (int, float, str, type(None))) else str(value)
    if out.get("privacy_unit") == "example":
        out["sampling"] = None
    return out


def run_config_record(config: RunConfig, training_args=None) -> dict:
    """A result's `config`: the run config's fields and the training arguments' values the run used, each under
    its own name (so `config["target_epsilon"]` is what the trainer was given). When the run trained with another
    seed than the config's (which seeded the split), the config's is kept as `split_seed`."""
    record = config.to_dict()
    if training_args is None:
        return record
    summary = training_summary(training_args)
    if summary.get("seed", record["seed"]) != record["seed"]:
        record["split_seed"] = record["seed"]
    record.update(summary)
    return record


def relative_path(path, root) -> str:
    """`path` relative to `root` (results stay valid when the results folder moves)."""
    try:
        return os.path.relpath(Path(path).resolve(), Path(root).resolve())
    except ValueError:  # another drive on Windows
        return str(path)


def save_result(result: Mapping, results_dir) -> Path:
    """Write `results_dir/<run>.json` atomically (a resumed study never reads half a file); main process only."""
    folder = Path(results_dir)
    path = folder / f"{result['run']}.json"
    if not is_main_process():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(result), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def load_result(path) -> dict | None:
    """A result JSON, or `None` when it is missing or not a complete result (e.g. an interrupted write)."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or any(key not in result for key in RESULT_KEYS):
        return None
    return result


def _jsonable(value):
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (np.floating, float)):
        value = float(value)
        if not math.isfinite(value):
            return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return value
    if isinstance(value, Path):
        return str(value)
    return value


# ----------------------------------------------------------------------------------------------------------
# Training, saving, reporting (shared by the task modules)
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
    start = time.perf_counter()
    trainer.train()
    return trainer, time.perf_counter() - start


def save_model(model, tokenizer, model_dir) -> None:
    """Save the model with its LoRA adapters merged (no peft needed to load it) and its tokenizer.

    A transformers model reloads with `from_pretrained(model_dir)`; an
    [`~hf_dp.workflows.tasks.classification.EmbeddingClassifier`] with
    [`~hf_dp.workflows.tasks.classification.load_classifier`].
    """
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def save_run(trainer, tokenizer, model_dir, *, eval_result: float, card: dict) -> dict | None:
    """Save model, tokenizer and card (main process only); return the privacy report (`None` if non-private).

    The card is rewritten with the evaluation beside the public-only baseline (post-processing: no effect on ε).
    """
    from hf_dp.card import write_privacy_card

    privacy = trainer.privacy_report() if hasattr(trainer, "privacy_report") else None
    if trainer.is_world_process_zero():
        save_model(trainer.model, tokenizer, model_dir)
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


def result_record(config: RunConfig, *, training_args, privacy: dict | None, task: str, metric_name: str,
                  eval_result: float, baseline_result: float, model_dir, base_model: str, train_seconds: float,
                  eval_seconds: float, **extra) -> dict:
    """The result dict of a fine-tuning run (keys [`RESULT_KEYS`], schema in [`hf_dp.workflows.tasks.classification`]),
    with `non_private_result` when the config knows it."""
    result = {
        "run": config.run,
        "mechanism": mechanism_of_arguments(training_args),
        "target_epsilon": None if privacy is None else privacy.get("target_epsilon"),
        "epsilon": None if privacy is None else privacy["epsilon"],
        "delta": None if privacy is None else privacy["delta"],
        "privacy": privacy,
        "metric_name": metric_name,
        "eval_result": float(eval_result),
        "baseline_result": float(baseline_result),
    }
    if config.non_private_result is not None:
        result["non_private_result"] = float(config.non_private_result)
    result.update({
        "model_dir": relative_path(model_dir, config.results_dir),
        "base_model": base_model,
        "task": task,
        "train_seconds": float(train_seconds),
        "eval_seconds": float(eval_seconds),
        **extra,
        "config": run_config_record(config, training_args),
    })
    return result


def plain_training_arguments(training_args):
    """The [`~transformers.TrainingArguments`] part of [`~hf_dp.DPTrainingArguments`], for a non-private run.

    The privacy fields are dropped; `max_grad_norm` becomes Trainer's usual global clipping norm.
    """
    import enum

    from transformers import TrainingArguments

    values = {}
    for spec in dataclasses.fields(TrainingArguments):
        if not spec.init or not hasattr(training_args, spec.name):
            continue
        value = getattr(training_args, spec.name)
        values[spec.name] = value.value if isinstance(value, enum.Enum) else value
    return TrainingArguments(**values)


# ----------------------------------------------------------------------------------------------------------
# Recipes (`recipes/*.py`): the flags they share and the run config their flags describe
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RecipeArguments:
    """Data, model and reporting flags every recipe shares.

    Training flags, the privacy ones and `--user_id_column` included, are [`~hf_dp.DPTrainingArguments`]'s: the
    recipes parse both, and [`recipe_run`] takes the user column from there.
    """

    dataset: str = dataclasses.field(
        default="shakespeare",
        metadata={"help": "'shakespeare' (speeches by speaking role, the embedded user-partitioned corpus) or a "
                          "JSONL/CSV/Parquet path or Hub dataset id (its user column: --user_id_column)."},
    )
    eval_dataset: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Test data (other users than --dataset). Default: a seeded 20%% of the users of "
                          "--dataset, held out."},
    )
    text_column: str = dataclasses.field(default="text", metadata={"help": "Column with the text."})
    use_lora: bool = dataclasses.field(default=False,
                                       metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_r: int = dataclasses.field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = dataclasses.field(default=16, metadata={"help": "LoRA alpha."})
    lora_target_modules: list[str] | None = dataclasses.field(
        default=None, metadata={"help": "Modules to adapt (default: peft's choice for the architecture)."}
    )
    non_private: bool = dataclasses.field(
        default=False,
        metadata={"help": "Train without DP (plain transformers.Trainer; privacy flags ignored), for comparison."},
    )
    results_dir: str = dataclasses.field(default="results", metadata={"help": "Where <run>.json is written."})
    max_train_users: int | None = dataclasses.field(default=None,
                                                    metadata={"help": "Train on a seeded sample of users."})
    max_eval_examples: int | None = dataclasses.field(default=None,
                                                      metadata={"help": "Evaluate on a seeded sample of rows."})


def recipe_run(config_class, script_args, training_args, **overrides):
    """The run config and training arguments a recipe's parsed flags describe.

    Flags that name a field of `config_class` are copied by name. The user column, run name, evaluation batch size,
    progress bars and seed come from the training arguments (`--user_id_column`, `--run_name` or `--output_dir`,
    `--per_device_eval_batch_size`, `--disable_tqdm`, `--seed`), which become plain `TrainingArguments` with
    `--non_private`; the privacy settings stay in the training arguments only. `overrides` replace fields whose
    flag needs converting (e.g. a JSON file's contents).
    """
    user_id_column = training_args.user_id_column  # the split by user, and a DP run's privacy unit
    if script_args.non_private:
        training_args = plain_training_arguments(training_args)
    names = {f.name for f in dataclasses.fields(config_class)}
    kwargs = {f.name: getattr(script_args, f.name) for f in dataclasses.fields(script_args) if f.name in names}
    kwargs.update(
        run=Path(training_args.run_name or training_args.output_dir).name,
        user_id_column=user_id_column,
        eval_batch_size=training_args.per_device_eval_batch_size,
        progress=not training_args.disable_tqdm,
        seed=training_args.seed,
    )
    kwargs.update(overrides)
    return config_class(**kwargs), training_args


def summary_line(result: dict, metric_label: str, output_dir: str) -> str:
    """One line a recipe prints at the end: run, mechanism, ε, metric beside the public-only baseline."""
    epsilon = "no DP" if result["epsilon"] is None else f"ε = {result['epsilon']:.3g}, δ = {result['delta']:.3g}"
    return (f"{result['run']} ({MECHANISMS[result['mechanism']].label}, {epsilon}): {metric_label} "
            f"{result['eval_result']:.4g}; public-only baseline {result['baseline_result']:.4g}. Model and card: "
            f"{output_dir}")
