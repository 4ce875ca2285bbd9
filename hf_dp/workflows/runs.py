"""What every recipe run shares: its configuration, splits by user, and the result JSON.

[`RunConfig`] holds the run name, the method, the data and model names and the training hyperparameters;
[`hf_dp.workflows.tasks.classification`] and [`hf_dp.workflows.tasks.language_modeling`] extend it with their task's fields. A run writes
`<results_dir>/<run>.json` with [`save_result`] (schema in [`hf_dp.workflows.tasks.classification`]'s docstring) and its model
to `<results_dir>/models/<run>/`. Nothing here affects the privacy accounting except the fields that are
passed on to [`~hf_dp.DPTrainingArguments`] (marked "affects accounting").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

__all__ = [
    "METHODS",
    "RESULT_KEYS",
    "RunConfig",
    "check_disjoint_users",
    "fit",
    "is_main_process",
    "load_result",
    "method_of",
    "plain_training_arguments",
    "result_record",
    "save_model",
    "save_result",
    "save_run",
    "split_by_user",
    "subsample_rows",
    "subsample_users",
]

METHODS = ("uls", "els", "example", "non-private")
# Keys every result JSON has (the Gradio app and the study rely on them).
RESULT_KEYS = (
    "run", "method", "target_epsilon", "epsilon", "delta", "privacy", "metric_name", "metric",
    "baseline_metric", "model_dir", "base_model", "task", "train_seconds", "config",
)


@dataclass
class RunConfig:
    r"""
    One fine-tuning run. Task modules extend it; [`RunConfig.training_arguments`] builds the trainer's arguments.

    Args:
        > Run

        run (`str`): name of the run; the result goes to `results_dir/<run>.json`, the model to
            `results_dir/models/<run>/`.
        method (`str`, *optional*, defaults to `"uls"`): `"uls"`, `"els"` (user-level DP), `"example"`
            (example-level DP-SGD) or `"non-private"`. Affects accounting.
        results_dir (`str`, *optional*, defaults to `"results"`): where results and models are written.

        > Data

        dataset (`str`, *optional*, defaults to `"shakespeare"`): `"shakespeare"` ([`~hf_dp.workflows.corpora.load_shakespeare`])
            or a JSONL/CSV/Parquet path or Hub id ([`~hf_dp.workflows.corpora.load_user_dataset`]).
        eval_dataset (`str`, *optional*): test data for a custom `dataset`; default: a split by user
            (about `eval_fraction` of the users, [`split_by_user`]), so no test user is ever trained on.
        user_column, text_column (`str`): column names.
        max_train_users (`int`, *optional*): train on a sample of this many users (quick runs, [`subsample_users`]).
            The split and this sample are keyed by `seed`: each user's side is a keyed hash of (`seed`, user id)
            alone, so one user more or less moves no other user across the split (and at most one in or out of
            this fixed-size sample). `seed` is saved in the result JSON; the guarantee does not need it secret.
        max_eval_examples (`int`, *optional*): evaluate on a seeded sample of this many test rows.

        > Model

        model_name_or_path (`str`, *optional*): local path or Hub id (the task module says what `None` means).
        max_length (`int`, *optional*, defaults to `32`): tokens per text (truncation), train and test.
        use_lora (`bool`, *optional*, defaults to `True`): LoRA adapters instead of full fine-tuning.
        lora_r, lora_alpha, lora_target_modules (`list[str]`, *optional*; peft's default for the
            architecture when `None`), lora_layers (`list[int]`, *optional*; all layers when `None`).

        > Privacy (DP methods; affect accounting; see [`~hf_dp.DPTrainingArguments`])

        target_epsilon, target_delta, expected_batch_size, contribution_bound, max_grad_norm,
        noise_multiplier, noise_seed.

        > Optimisation

        learning_rate, num_train_epochs, max_steps, per_device_train_batch_size, warmup_steps, weight_decay,
        lr_scheduler_type, seed: as in [`~transformers.TrainingArguments`] for DP runs (`num_train_epochs` =
        expected passes over the units). Non-private runs use `nonprivate_learning_rate` and
        `nonprivate_batch_size` (and the same `max_steps`/`num_train_epochs`, in ordinary epochs).
        eval_batch_size (`int`, *optional*, defaults to `128`): texts per evaluation forward pass.
        baseline_metric (`float`, *optional*): the public-only baseline's metric on the same test rows when
            already known; computed when `None`.
        progress (`bool`, *optional*, defaults to `True`): progress bars.
    """

    run: str
    method: str = "uls"
    results_dir: str = "results"
    # data
    dataset: str = "shakespeare"
    eval_dataset: str | None = None
    eval_fraction: float = 0.2
    user_column: str = "user_id"
    text_column: str = "text"
    max_train_users: int | None = None
    max_eval_examples: int | None = None
    # model
    model_name_or_path: str | None = None
    max_length: int = 32
    use_lora: bool = True
    lora_r: int = 8
    lora_alpha: int = 16
    lora_target_modules: list | None = None
    lora_layers: list | None = None
    # privacy (DP methods)
    target_epsilon: float | None = 8.0
    target_delta: float | None = None
    expected_batch_size: int = 128
    contribution_bound: int | str | None = 4
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    noise_seed: int | None = None
    # optimisation
    learning_rate: float = 2e-3
    num_train_epochs: float = 2.0
    max_steps: int = -1
    per_device_train_batch_size: int = 64
    warmup_steps: float = 0.0
    weight_decay: float = 0.0
    lr_scheduler_type: str = "linear"
    nonprivate_batch_size: int = 32
    nonprivate_learning_rate: float = 5e-4
    seed: int = 0
    eval_batch_size: int = 128
    baseline_metric: float | None = None
    progress: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: use one of {METHODS}.")
        if not self.run or "/" in self.run or os.sep in self.run:
            raise ValueError(f"run={self.run!r}: use a non-empty name without path separators (it names files).")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def model_dir(self) -> Path:
        """Where the trained model, its tokenizer and its card are saved."""
        return Path(self.results_dir) / "models" / self.run

    def training_arguments(self):
        """[`~hf_dp.DPTrainingArguments`] for DP methods, [`~transformers.TrainingArguments`] for non-private."""
        common = dict(
            output_dir=str(self.model_dir),
            num_train_epochs=self.num_train_epochs,
            max_steps=self.max_steps,
            warmup_steps=self.warmup_steps,
            weight_decay=self.weight_decay,
            lr_scheduler_type=self.lr_scheduler_type,
            seed=self.seed,
            logging_steps=5,
            save_strategy="no",
            report_to=[],
            disable_tqdm=not self.progress,
            dataloader_num_workers=0,
        )
        if self.method == "non-private":
            from transformers import TrainingArguments

            return TrainingArguments(
                learning_rate=self.nonprivate_learning_rate,
                per_device_train_batch_size=self.nonprivate_batch_size,
                **common,
            )
        from hf_dp.arguments import DPTrainingArguments

        return DPTrainingArguments(
            learning_rate=self.learning_rate,
            per_device_train_batch_size=self.per_device_train_batch_size,
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            privacy_unit="example" if self.method == "example" else "user",
            sampling="els" if self.method == "els" else "uls",
            expected_batch_size=self.expected_batch_size,
            contribution_bound=self.contribution_bound,
            max_grad_norm=self.max_grad_norm,
            noise_multiplier=self.noise_multiplier,
            noise_seed=self.noise_seed,
            user_id_column=self.user_column,
            **common,
        )


def method_of(training_args) -> str:
    """`"non-private"` for plain `TrainingArguments`, else the accounting mode (`"uls"`, `"els"`, `"example"`)."""
    from hf_dp.arguments import DPTrainingArguments

    if not isinstance(training_args, DPTrainingArguments):
        return "non-private"
    return training_args.mechanism


# ----------------------------------------------------------------------------------------------------------
# Splits and subsets (preprocessing: they choose the rows, the guarantee is about the rows trained on)
# ----------------------------------------------------------------------------------------------------------


def split_by_user(dataset, user_column: str, fraction: float = 0.2, seed: int = 0):
    """(train, test): each user goes to test, with all their rows, when its keyed hash is below `fraction`.

    A user's side depends only on (`seed`, user id) ([`~hf_dp.data.keyed_uniform`]): adding or removing one
    user moves no other user, so neighbouring datasets give neighbouring training sets. The test set thus holds
    about `fraction` of the users (at least one, never all: for a split that would be empty on one side, the
    user with the lowest, or highest, hash is moved).

    Raises:
        ValueError: fewer than two users.
    """
    from hf_dp.data import keyed_uniform

    users = dataset.unique(user_column)
    if len(users) < 2:
        raise ValueError(f"Need at least two users to split by user; found {len(users)}.")
    draws = {user: keyed_uniform(seed, user, "split") for user in users}
    test_users = {user for user, draw in draws.items() if draw < fraction}
    if not test_users or len(test_users) == len(users):  # only with very few users
        ranked = sorted(users, key=draws.get)
        test_users = {ranked[0]} if not test_users else set(ranked[:-1])
    is_test = [u in test_users for u in dataset[user_column]]
    return (dataset.select([i for i, t in enumerate(is_test) if not t]),
            dataset.select([i for i, t in enumerate(is_test) if t]))


def subsample_users(dataset, user_column: str, max_users: int | None, seed: int = 0):
    """The rows of the `max_users` users with the lowest keyed hash of (`seed`, user id) (all rows when `None` or
    not fewer users).

    Each user's hash depends on nothing else, so adding or removing an unselected user changes nothing, and a
    selected one displaces at most one other user (a fixed-size sample must).
    """
    from hf_dp.data import keyed_uniform

    if max_users is None:
        return dataset
    users = dataset.unique(user_column)
    if max_users >= len(users):
        return dataset
    chosen = set(sorted(users, key=lambda user: keyed_uniform(seed, user, "subsample"))[:max_users])
    keep = [i for i, u in enumerate(dataset[user_column]) if u in chosen]
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
        ValueError: a missing column, or a test split sharing users with train.
    """
    from hf_dp.workflows import corpora

    if config.dataset == "shakespeare":
        corpus = corpora.load_shakespeare()
        train, test = corpus["train"], corpus["test"]
    else:
        load = dict(user_column=config.user_column, text_column=config.text_column, **columns)
        train = corpora.load_user_dataset(config.dataset, **load)
        if config.eval_dataset is not None:
            test = corpora.load_user_dataset(config.eval_dataset, **load)
        else:
            train, test = split_by_user(train, config.user_column, config.eval_fraction, config.seed)
    check_disjoint_users(train, test, config.user_column)
    return train, test


def check_disjoint_users(train, test, user_column: str) -> None:
    """Raise `ValueError` when a user has rows in both splits (the test set must hold other users)."""
    if user_column not in test.column_names:
        return
    overlap = set(train.unique(user_column)) & set(test.unique(user_column))
    if overlap:
        raise ValueError(
            f"{len(overlap)} users are in both the training and the test data (e.g. {sorted(overlap, key=str)[:3]}): "
            "the test set must hold other users. Drop --eval_dataset to split by user."
        )


# ----------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------

_TRAINING_KEYS = (
    "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size", "lr_scheduler_type",
    "warmup_steps", "weight_decay", "seed", "target_epsilon", "target_delta", "privacy_unit", "sampling",
    "expected_batch_size", "contribution_bound", "max_grad_norm", "noise_multiplier",
)


def training_summary(training_args) -> dict:
    """The hyperparameters of `training_args` that a result should record."""
    out = {}
    for key in _TRAINING_KEYS:
        if hasattr(training_args, key):
            value = getattr(training_args, key)
            out[key] = value if isinstance(value, (int, float, str, type(None))) else str(value)
    return out


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
    if method_of(training_args) == "non-private":
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
    [`~hf_dp.workflows.tasks.classification.EmbeddingClassifier`] with [`~hf_dp.workflows.tasks.classification.load_classifier`].
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


def result_record(config: RunConfig, *, method: str, training_args, privacy: dict | None, task: str,
                  metric_name: str, metric: float, baseline_metric: float, model_dir, base_model: str,
                  train_seconds: float, eval_seconds: float, **extra) -> dict:
    """The result dict of a fine-tuning run (schema in [`hf_dp.workflows.tasks.classification`])."""
    return {
        "run": config.run,
        "method": method,
        "target_epsilon": None if privacy is None else privacy.get("target_epsilon"),
        "epsilon": None if privacy is None else privacy["epsilon"],
        "delta": None if privacy is None else privacy["delta"],
        "privacy": privacy,
        "metric_name": metric_name,
        "metric": float(metric),
        "baseline_metric": float(baseline_metric),
        "model_dir": relative_path(model_dir, config.results_dir),
        "base_model": base_model,
        "task": task,
        "train_seconds": float(train_seconds),
        "eval_seconds": float(eval_seconds),
        **extra,
        "config": {**config.to_dict(), "training_args": training_summary(training_args)},
    }


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
    """Data, model and reporting flags every recipe shares (training flags: [`~hf_dp.DPTrainingArguments`])."""

    dataset: str = dataclasses.field(
        default="shakespeare",
        metadata={"help": "'shakespeare' (speeches by speaking role, the embedded user-partitioned corpus) or a "
                          "JSONL/CSV/Parquet path or Hub dataset id."},
    )
    eval_dataset: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Test data (other users than --dataset). Default: a seeded 20%% of the users of "
                          "--dataset, held out."},
    )
    user_column: str = dataclasses.field(default="user_id",
                                         metadata={"help": "Column with the user id (the privacy unit)."})
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

    Flags that name a field of `config_class` are copied by name; run name, method, evaluation batch size,
    progress bars and seed come from the training arguments, which become plain `TrainingArguments` with
    `--non_private`. `overrides` replace fields whose flag needs converting (e.g. a JSON file's contents).
    """
    if script_args.non_private:
        training_args = plain_training_arguments(training_args)
    names = {f.name for f in dataclasses.fields(config_class)}
    kwargs = {f.name: getattr(script_args, f.name) for f in dataclasses.fields(script_args) if f.name in names}
    kwargs.update(
        run=Path(training_args.run_name or training_args.output_dir).name,
        method=method_of(training_args),
        eval_batch_size=training_args.per_device_eval_batch_size,
        progress=not training_args.disable_tqdm,
        seed=training_args.seed,
    )
    kwargs.update(overrides)
    return config_class(**kwargs), training_args


def summary_line(result: dict, metric_label: str, output_dir: str) -> str:
    """One line a recipe prints at the end: run, method, ε, metric beside the public-only baseline."""
    epsilon = "no DP" if result["epsilon"] is None else f"ε = {result['epsilon']:.3g}, δ = {result['delta']:.3g}"
    return (f"{result['run']} ({result['method']}, {epsilon}): {metric_label} {result['metric']:.4g}; "
            f"public-only baseline {result['baseline_metric']:.4g}. Model and card: {output_dir}")
