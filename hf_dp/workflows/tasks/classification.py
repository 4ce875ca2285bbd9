"""Text classification on user-partitioned data: tokenization, the public-only baseline, one run.

The pieces of a classification run, in the order the data flows:

1. [`load_classification_data`]: the Shakespeare corpus of [`hf_dp.workflows.corpora`] or the user's own file, split so
   that no test user is ever trained on; label names from a `ClassLabel` or the sorted label values.
2. [`tokenize_classification`]: `input_ids`/`attention_mask`/`labels`, keeping the user column for
   [`~hf_dp.DPTrainer`].
3. [`~hf_dp.workflows.tasks.classifier_models.EmbeddingClassifier`] ([`hf_dp.workflows.tasks.classifier_models`]):
   `logits = 20 * cos(mean-pooled embedding of the text, label prototype)`. With the pretrained encoder and each
   prototype the mean embedding of short descriptions of its label ([`LABEL_DESCRIPTIONS`] for the Shakespeare
   genres) it is the **public-only baseline** (Tramèr, Kamath and Carlini 2024): zero-shot, no private data.
   Fine-tuning starts from it (`head="similarity"`, the default): the objective stays the one the encoder was
   pretrained with, as Li et al. (2021) advise for DP. `head="linear"` fine-tunes
   `AutoModelForSequenceClassification` with a new head instead (any architecture).
4. [`run_classification`]: fine-tunes one configuration with its training arguments ([`~hf_dp.DPTrainer`] for
   [`~hf_dp.DPTrainingArguments`], mechanism `"uls"`, `"els"` or `"example"`; plain [`~transformers.Trainer`] for
   `TrainingArguments`, mechanism `"non-private"`), evaluates test accuracy (computed locally, no `evaluate.load`),
   saves the model and tokenizer (LoRA adapters merged; [`~hf_dp.workflows.tasks.classifier_models.load_classifier`]
   loads either head kind), writes the privacy card beside them with the DP accuracy and the baseline, and returns
   (and writes) the result below.

Everything after training (evaluation, the card, the JSON) is post-processing: it does not change ε. What the
guarantee does not cover: the choice of hyperparameters if they were tuned on the private data, and the
pretraining data of the public model.

Result JSON (`<results_dir>/<run>.json`, keys [`~hf_dp.workflows.run_results.RESULT_KEYS`]; the Gradio app and
[`hf_dp.workflows.study`] read it; evaluation figures named by [`~hf_dp.vocabulary.EVAL_KEYS`] as in the card):

```
{
  "run": str,                      # run name, also the JSON's file stem
  "mechanism": str,                # a key of hf_dp.vocabulary.MECHANISMS: "uls" | "els" | "example" |
                                   # "non-private" | "public-only"
  "target_epsilon": float | None,  # None for non-private and the public-only baseline
  "epsilon": float | None,         # ε spent (accountant's upper bound); 0.0 for the public-only
                                   # baseline (no private data used); None for non-private (no guarantee)
  "delta": float | None,           # δ of the guarantee (0.0 for the baseline, None for non-private)
  "privacy": dict | None,          # DPTrainer.privacy_report(), None for non-private and the baseline
  "metric_name": "accuracy",
  "eval_result": float,            # test accuracy of this run
  "baseline_result": float,        # test accuracy of the public-only (zero-shot) baseline, same test rows
  "non_private_result": float,     # only when known: a non-private run's test accuracy, same test rows
  "model_dir": str | None,         # model + tokenizer + privacy card, relative to the results folder
                                   # (None for the baseline: it is the base model itself)
  "base_model": str,               # Hub id (or path) of the pretrained model
  "task": "classification",
  "train_seconds": float,          # wall-clock seconds of trainer.train() (0.0 for the baseline)
  "eval_seconds": float,           # wall-clock seconds of the test evaluation
  "label_names": [str, ...],       # class index -> name
  "num_eval_examples": int,
  "not_covered": [str, ...],       # what the guarantee does not cover because of how the training rows were
                                   # chosen, also in the card (a fixed-size sample of users: max_train_users)
  "config": {...}                  # the ClassificationConfig's fields (model_name_or_path None = embedded
                                   # MiniLM) and the training arguments' values the run used, each under its
                                   # own name (target_epsilon, expected_batch_size, contribution_bound, ...),
                                   # plus "label_descriptions"
}
```

Example:

```python
>>> from hf_dp.workflows.tasks.classification import ClassificationConfig, run_classification
>>> config = ClassificationConfig(run="uls-eps8")
>>> result = run_classification(config, config.training_arguments("uls", target_epsilon=8.0))  # doctest: +SKIP
>>> result["eval_result"], result["baseline_result"], result["epsilon"]  # doctest: +SKIP
```
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from hf_dp.workflows.run_data import load_splits, subsample_rows, subsample_training_users
from hf_dp.workflows.run_results import baseline_record, result_record, save_result
from hf_dp.workflows.runs import RunConfig, check_user_id_column, fit, mechanism_of_arguments, save_run
from hf_dp.workflows.tasks.classifier_models import (
    DEFAULT_BASE_MODEL,
    EmbeddingClassifier,
    predict_labels,
    resolve_model_path,
)

logger = logging.getLogger(__name__)

__all__ = [
    "LABEL_DESCRIPTIONS",
    "ClassificationConfig",
    "ClassificationData",
    "accuracy",
    "build_model",
    "compute_metrics",
    "load_classification_data",
    "run_classification",
    "run_zero_shot_baseline",
    "tokenize_classification",
]

# Descriptions of the First Folio genres for the zero-shot baseline, written once from what the genres are
# about (not tuned on any split of the corpus). Each label's prototype is the mean of its descriptions'
# normalised embeddings.
LABEL_DESCRIPTIONS: dict[str, list[str]] = {
    "comedy": [
        "A witty, playful speech from a comedy: lovers' banter, jests and puns, wooing and marriage.",
        "Merry talk of love, disguise, mistaken identity, fools and clowns, ending in a wedding feast.",
        "A lady and her suitor trade clever insults; a servant jokes about his master's foolish love.",
    ],
    "history": [
        "A speech from an English history play about kings, the crown and the throne of England.",
        "Nobles, dukes and lords plot rebellion and war; armies march against France to battle.",
        "The king addresses his peers and soldiers about his title, his realm, treason and the succession.",
    ],
    "tragedy": [
        "A speech from a tragedy: death, murder, revenge, grief and despair.",
        "A doomed hero rages against fate; blood, poison, ghosts and the grave.",
        "Lamenting the slain, a mourner curses the gods and the cruel villain who brought ruin.",
    ],
}


def _base_model_name(model_name_or_path: str | None) -> str:
    return DEFAULT_BASE_MODEL if model_name_or_path is None else str(model_name_or_path)


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ClassificationConfig(RunConfig):
    r"""
    One classification run: the fields of [`~hf_dp.workflows.runs.RunConfig`] (run, data, model, evaluation) plus
    the labels. Privacy and optimisation settings are the training arguments' ([`RunConfig.training_arguments`]).

    Args:
        label_column (`str`, *optional*, defaults to `"label"`): column with the class (a `ClassLabel`, or any
            values: their sorted distinct values become the classes).
        label_descriptions (`dict`, *optional*): label name -> descriptions for the zero-shot baseline;
            defaults to [`LABEL_DESCRIPTIONS`] for Shakespeare and to the label names otherwise.
        head (`str`, *optional*, defaults to `"similarity"`): `"similarity"` fine-tunes an
            [`~hf_dp.workflows.tasks.classifier_models.EmbeddingClassifier`] that starts as the zero-shot baseline
            (sentence encoders such as MiniLM); `"linear"` fine-tunes `AutoModelForSequenceClassification` with a
            new head (any architecture).
        logit_scale (`float`, *optional*, defaults to `20.0`): inverse temperature of the similarity head.
        model_name_or_path (`str`, *optional*): `None` = the embedded MiniLM
            ([`~hf_dp.workflows.tasks.classifier_models.default_model_path`]).

    Example:

    ```python
    >>> args = ClassificationConfig(run="els-eps8").training_arguments("els", target_epsilon=8.0)
    >>> args.sampling, args.target_epsilon
    ('els', 8.0)

    ```
    """

    label_column: str = "label"
    label_descriptions: dict | None = None
    head: str = "similarity"
    logit_scale: float = 20.0

    NUMBER_RULES: ClassVar[dict] = {**RunConfig.NUMBER_RULES, "logit_scale": "float>0"}

    def __post_init__(self):
        super().__post_init__()
        if self.head not in ("similarity", "linear"):
            raise ValueError(f"head={self.head!r}: use 'similarity' (start from the zero-shot baseline) or 'linear'.")


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ClassificationData:
    """Train and test rows (columns: user, text, `labels` as class indices) and the label names; `not_covered`:
    what the run's guarantee does not cover because of how the rows were chosen (the card and the result state
    it; [`~hf_dp.workflows.run_data.user_sample_statement`])."""

    train: object  # datasets.Dataset
    test: object  # datasets.Dataset
    label_names: list
    dataset_name: str
    not_covered: list = dataclasses.field(default_factory=list)


def load_classification_data(config: ClassificationConfig) -> ClassificationData:
    """Load, split by user, encode labels as `labels` (class indices) and subsample as configured.

    Raises:
        ValueError: a missing column, or a test split sharing users with train.
    """
    import datasets

    train, test = load_splits(config, label_column=config.label_column)
    name = "shakespeare-first-folio-genres" if config.dataset == "shakespeare" else str(config.dataset)
    label_names, train, test = _encode_labels(train, test, config.label_column)
    train, not_covered = subsample_training_users(train, config)
    test = subsample_rows(test, config.max_eval_examples, config.seed)
    if not isinstance(train, datasets.Dataset) or len(train) == 0:
        raise ValueError("No training rows left: check the data and max_train_users.")
    return ClassificationData(train=train, test=test, label_names=label_names, dataset_name=name,
                              not_covered=not_covered)


def _encode_labels(train, test, label_column: str):
    """Return label names and both splits with an integer `labels` column."""
    import datasets

    feature = train.features[label_column]
    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
        mapping = None
    else:
        values = sorted(set(train[label_column]) | set(test[label_column]), key=str)
        names = [str(v) for v in values]
        mapping = {v: i for i, v in enumerate(values)}

    def encode(split):
        labels = split[label_column]
        encoded = [int(v) for v in labels] if mapping is None else [mapping[v] for v in labels]
        if "labels" in split.column_names:
            split = split.remove_columns("labels")
        return split.add_column("labels", encoded)

    return names, encode(train), encode(test)


def tokenize_classification(dataset, tokenizer, *, text_column: str = "text", max_length: int = 32,
                            keep_columns: Sequence[str] = ("user_id",)):
    """Tokenize `text_column` (truncated to `max_length`, not padded: the collator pads each micro-batch).

    Keeps `labels` and `keep_columns` (the user column for [`~hf_dp.DPTrainer`]); drops every other column.
    """
    keep = {"labels", *keep_columns}
    drop = [c for c in dataset.column_names if c not in keep]
    return dataset.map(
        lambda batch: tokenizer(batch[text_column], truncation=True, max_length=max_length),
        batched=True, remove_columns=drop, desc="Tokenizing",
    )


# ----------------------------------------------------------------------------------------------------------
# Metrics and inference
# ----------------------------------------------------------------------------------------------------------


def accuracy(predictions, references) -> float:
    """Share of equal entries (computed locally: `evaluate.load` would reach for the Hub)."""
    predictions, references = np.asarray(predictions), np.asarray(references)
    if predictions.shape != references.shape or predictions.size == 0:
        raise ValueError(f"accuracy needs two equal-length non-empty arrays, got {predictions.shape} and "
                         f"{references.shape}.")
    return float((predictions == references).mean())


def compute_metrics(eval_pred) -> dict:
    """`compute_metrics` for [`~transformers.Trainer`]: accuracy of the arg-max logits."""
    logits, labels = eval_pred
    logits = logits[0] if isinstance(logits, tuple) else logits
    return {"accuracy": accuracy(np.argmax(logits, axis=-1), labels)}


def _label_descriptions(config: ClassificationConfig, label_names: Sequence[str]) -> dict:
    if config.label_descriptions is not None:
        return {name: list(config.label_descriptions.get(name) or [name]) for name in label_names}
    if config.dataset == "shakespeare":
        return {name: list(LABEL_DESCRIPTIONS[name]) for name in label_names}
    return {name: [name] for name in label_names}


# ----------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------


def run_zero_shot_baseline(config: ClassificationConfig, data: ClassificationData | None = None) -> dict:
    """Evaluate the public-only baseline on the test rows, write `<run>.json`, return the result dict.

    The baseline is [`~hf_dp.workflows.tasks.classifier_models.EmbeddingClassifier.from_descriptions`]: the pretrained
    encoder, no private data.
    """
    data = data if data is not None else load_classification_data(config)
    descriptions = _label_descriptions(config, data.label_names)
    start = time.perf_counter()
    zero_shot = EmbeddingClassifier.from_descriptions(config.model_name_or_path, data.label_names, descriptions,
                                                      max_length=config.max_length, logit_scale=config.logit_scale)
    predictions = predict_labels(zero_shot, zero_shot.tokenizer, data.test[config.text_column],
                                 max_length=config.max_length, batch_size=config.eval_batch_size,
                                 progress=config.progress)
    metric = accuracy(predictions, data.test["labels"])
    eval_seconds = time.perf_counter() - start
    result = baseline_record(
        config, task="classification", metric_name="accuracy", eval_result=metric,
        base_model=_base_model_name(config.model_name_or_path), eval_seconds=eval_seconds,
        description="zero-shot: cosine similarity of mean-pooled embeddings to label descriptions",
        config_extra={"label_descriptions": descriptions}, label_names=list(data.label_names),
        num_eval_examples=len(data.test))
    save_result(result, config.results_dir)
    return result


def build_model(config: ClassificationConfig, label_names: Sequence[str]):
    """The model a run fine-tunes, LoRA-wrapped when `config.use_lora`.

    `config.head="similarity"`: an [`~hf_dp.workflows.tasks.classifier_models.EmbeddingClassifier`] that starts as
    the zero-shot baseline (encoder adapted by LoRA or fully, prototypes trained). `"linear"`:
    `AutoModelForSequenceClassification` with a new, randomly initialised head (LoRA also trains the head and, for
    BERT, its pooler).
    """
    if config.head == "similarity":
        model = EmbeddingClassifier.from_descriptions(
            config.model_name_or_path, label_names, _label_descriptions(config, label_names),
            max_length=config.max_length, logit_scale=config.logit_scale,
        )
        if getattr(model.encoder, "pooler", None) is not None:
            model.encoder.pooler = None  # unused by mean pooling: no parameter without a gradient
        if config.use_lora:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(task_type="FEATURE_EXTRACTION", r=config.lora_r, lora_alpha=config.lora_alpha,
                              lora_dropout=0.0, target_modules=config.lora_target_modules,
                              layers_to_transform=config.lora_layers)
            model.encoder = get_peft_model(model.encoder, lora)
        return model
    from transformers import AutoModelForSequenceClassification

    path = resolve_model_path(config.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=len(label_names),
        id2label=dict(enumerate(label_names)), label2id={n: i for i, n in enumerate(label_names)},
    )
    if model.config.pad_token_id is None and getattr(model.config, "eos_token_id", None) is not None:
        model.config.pad_token_id = model.config.eos_token_id  # decoder classifiers find the last token by it
    if not config.use_lora:
        return model
    from peft import LoraConfig, get_peft_model

    # The pooler (BERT: CLS -> dense -> tanh) feeds the new head: train it with the head.
    modules_to_save = ["pooler"] if getattr(getattr(model, "base_model", None), "pooler", None) is not None else None
    lora = LoraConfig(
        task_type="SEQ_CLS", r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
        target_modules=config.lora_target_modules, layers_to_transform=config.lora_layers,
        modules_to_save=modules_to_save,
    )
    return get_peft_model(model, lora)


def run_classification(config: ClassificationConfig, training_args=None, *,
                       data: ClassificationData | None = None, card_extra: dict | None = None,
                       callbacks=None) -> dict:
    """Fine-tune one configuration, evaluate it beside the public-only baseline, save model, card and JSON.

    Args:
        config ([`ClassificationConfig`]): data, model and evaluation.
        training_args ([`~hf_dp.DPTrainingArguments`] or [`~transformers.TrainingArguments`], *optional*):
            every privacy and optimisation setting of the run (the recipes pass their parsed flags). Plain
            `TrainingArguments` mean a non-private run; `DPTrainingArguments` a DP run whose mechanism follows
            from their `privacy_unit`/`sampling`, and whose `user_id_column` must be `config.user_id_column`.
            Their `output_dir` receives the model, tokenizer and card. Default:
            `config.training_arguments("uls")` (DPTrainingArguments' privacy defaults).
        data ([`ClassificationData`], *optional*): already loaded data (the study loads it once).
        card_extra (`dict`, *optional*): more fields for the privacy card ([`~hf_dp.card.render_privacy_card`]).
        callbacks (`list[TrainerCallback]`, *optional*): added to the trainer (progress reporting).

    Returns:
        `dict`: the result (schema in the module docstring), also written to `results_dir/<run>.json`.

    Raises:
        ValueError: a bad configuration (see [`~hf_dp.DPTrainingArguments`] and [`~hf_dp.DPTrainer`]), or a
            `user_id_column` that differs between config and training arguments.
    """
    from transformers import AutoTokenizer, DataCollatorWithPadding, set_seed

    if training_args is None:
        training_args = config.training_arguments()
    check_user_id_column(config, training_args)
    mechanism = mechanism_of_arguments(training_args)
    data = data if data is not None else load_classification_data(config)
    baseline_result = config.baseline_result
    if baseline_result is None:
        baseline = run_zero_shot_baseline(dataclasses.replace(config, run=f"{config.run}-baseline"), data)
        baseline_result = baseline["eval_result"]

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model_name_or_path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    keep = (config.user_id_column,) if mechanism != "non-private" else ()
    train = tokenize_classification(data.train, tokenizer, text_column=config.text_column,
                                    max_length=config.max_length, keep_columns=keep)
    base_model = _base_model_name(config.model_name_or_path)
    card_extra = dict(card_extra or {})
    not_covered = [*data.not_covered, *card_extra.pop("extra_not_covered", ())]
    card = dict(dataset_name=data.dataset_name, metric_name="accuracy", baseline_result=baseline_result,
                non_private_result=config.non_private_result, base_model=base_model, task="text-classification",
                extra_not_covered=not_covered, **card_extra)
    set_seed(training_args.seed)  # LoRA and new heads start from the run's seed, whatever ran before
    trainer, train_seconds = fit(build_model(config, data.label_names), training_args, train,
                                 data_collator=DataCollatorWithPadding(tokenizer), tokenizer=tokenizer, card=card,
                                 callbacks=callbacks)

    start = time.perf_counter()
    predictions = predict_labels(trainer.model, tokenizer, data.test[config.text_column],
                                 max_length=config.max_length, batch_size=config.eval_batch_size,
                                 progress=config.progress)
    eval_result = accuracy(predictions, data.test["labels"])
    eval_seconds = time.perf_counter() - start

    model_dir = Path(training_args.output_dir)
    privacy = save_run(trainer, tokenizer, model_dir, eval_result=eval_result, card=card)
    result = result_record(
        config, training_args=training_args, privacy=privacy, task="classification", metric_name="accuracy",
        eval_result=eval_result, baseline_result=baseline_result, model_dir=model_dir, base_model=base_model,
        train_seconds=train_seconds, eval_seconds=eval_seconds, label_names=list(data.label_names),
        num_eval_examples=len(data.test), num_train_users=len(data.train.unique(config.user_id_column)),
        num_train_examples=len(data.train), steps=int(trainer.state.global_step), not_covered=not_covered,
    )
    result["config"]["label_descriptions"] = _label_descriptions(config, data.label_names)
    save_result(result, config.results_dir)
    return result
