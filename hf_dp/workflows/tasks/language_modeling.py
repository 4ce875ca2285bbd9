"""Causal language modelling on user-partitioned text: tokenization, the public-only baseline, one run.

The same shape as [`hf_dp.workflows.tasks.classification`], for next-token fine-tuning of any causal LM (a local
path or a Hub id; LoRA or full):

1. [`load_text_data`]: the Shakespeare speeches or the user's own file, split so that no test user is ever
   trained on (for Shakespeare, `exclude_train_plays` also keeps chosen plays out of training: the study tunes
   its hyper-parameters on them).
2. [`tokenize_causal_lm`]: `input_ids` (EOS appended, truncated to `max_length`) with `labels = input_ids`;
   [`CausalLMCollator`] pads `input_ids` with the pad token and `labels` with -100, so padding never counts
   in the loss or in the per-example gradients DP-SGD clips.
3. [`perplexity`]: exp of the mean next-token negative log-likelihood over all labelled test tokens.
   The **public-only baseline** is the perplexity of the untouched pretrained model on the same test rows
   ([`run_public_baseline`] writes it as a run of its own).
4. [`run_language_modeling`]: baseline, fine-tuning ([`~hf_dp.DPTrainer`] or [`~transformers.Trainer`]),
   test perplexity, model + tokenizer (LoRA merged) and privacy card in `results_dir/models/<run>/`, and
   `results_dir/<run>.json` with the schema of [`hf_dp.workflows.tasks.classification`], except that `"task"` is
   `"causal-lm"` and `"metric_name"` is `"perplexity"` (lower is better): `eval_result` is the fine-tuned model's
   perplexity, `baseline_result` the untouched model's; `eval_nll` and `baseline_nll` are their logarithms, the
   mean next-token negative log-likelihood in nats per token.

Evaluation, cards and results are post-processing: they do not change ε.

Example:

```python
>>> from hf_dp.workflows.tasks.language_modeling import LanguageModelingConfig, run_language_modeling
>>> config = LanguageModelingConfig(run="gpt2-uls", model_name_or_path="gpt2")
>>> result = run_language_modeling(config, config.training_arguments("uls", target_epsilon=8.0))  # doctest: +SKIP
>>> result["eval_result"], result["baseline_result"]  # perplexity after, and before  # doctest: +SKIP
```
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Sequence

import torch
import torch.nn.functional as F

from hf_dp.workflows.run_data import load_splits, subsample_rows, subsample_training_users
from hf_dp.workflows.run_results import baseline_record, result_record, save_result
from hf_dp.workflows.runs import RunConfig, check_user_id_column, fit, mechanism_of_arguments, save_run

__all__ = [
    "CausalLMCollator",
    "LanguageModelingConfig",
    "build_model",
    "load_text_data",
    "perplexity",
    "run_language_modeling",
    "run_public_baseline",
    "tokenize_causal_lm",
]


@dataclass
class LanguageModelingConfig(RunConfig):
    r"""
    One causal-LM run: the fields of [`~hf_dp.workflows.runs.RunConfig`] with LM defaults (privacy and
    optimisation settings are the training arguments', [`RunConfig.training_arguments`]; its learning-rate
    defaults here are 1e-3 for DP runs and 2e-4 for non-private ones).

    Args:
        model_name_or_path (`str`): the causal LM (local path or Hub id). Required unless a model object is
            passed to [`run_language_modeling`], in which case it only names the base model in the card.
        tokenizer_name_or_path (`str`, *optional*): defaults to `model_name_or_path`.
        max_length (`int`, *optional*, defaults to `64`): tokens per text, EOS included (at least 2: a text needs a
            token and its successor).
    """

    max_length: int = 64
    tokenizer_name_or_path: str | None = None

    NUMBER_RULES: ClassVar[dict] = {**RunConfig.NUMBER_RULES, "max_length": "int>=2"}
    DP_TRAINING_DEFAULTS: ClassVar[dict] = {**RunConfig.DP_TRAINING_DEFAULTS, "learning_rate": 1e-3}
    NON_PRIVATE_TRAINING_DEFAULTS: ClassVar[dict] = {**RunConfig.NON_PRIVATE_TRAINING_DEFAULTS, "learning_rate": 2e-4}


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TextData:
    """Train and test rows (user and text columns) and the data set's name; `not_covered`: what the run's
    guarantee does not cover because of how the rows were chosen (the card and the result state it)."""

    train: object  # datasets.Dataset
    test: object  # datasets.Dataset
    dataset_name: str
    not_covered: list = field(default_factory=list)


def load_text_data(config: LanguageModelingConfig) -> TextData:
    """Load the texts, split by user (or read `eval_dataset`), subsample as configured.

    Raises:
        ValueError: a missing column, a test split sharing users with train, or `exclude_train_plays` with data
            that has no `play` column or naming a play that is not among the training plays.
    """
    train, test = load_splits(config)
    name = "shakespeare-speeches" if config.dataset == "shakespeare" else str(config.dataset)
    train, not_covered = subsample_training_users(train, config)
    test = subsample_rows(test, config.max_eval_examples, config.seed)
    if len(train) == 0 or len(test) == 0:
        raise ValueError("No training or no test rows left: check the data, max_train_users and max_eval_examples.")
    return TextData(train=train, test=test, dataset_name=name, not_covered=not_covered)


def tokenize_causal_lm(dataset, tokenizer, *, text_column: str = "text", max_length: int = 64,
                       keep_columns: Sequence[str] = ("user_id",)):
    """`input_ids` (EOS appended when the tokenizer has one, truncated to `max_length`) and `labels = input_ids`.

    Keeps `keep_columns` (the user column for [`~hf_dp.DPTrainer`]); drops every other column. Rows that
    tokenize to fewer than two tokens carry no next-token target and are dropped.
    """
    eos = tokenizer.eos_token_id
    keep = set(keep_columns)
    drop = [c for c in dataset.column_names if c not in keep]

    def encode(batch):
        ids = tokenizer(batch[text_column], add_special_tokens=True, truncation=True,
                        max_length=max_length if eos is None else max_length - 1)["input_ids"]
        if eos is not None:
            ids = [row if row and row[-1] == eos else row + [eos] for row in ids]
        return {"input_ids": ids, "labels": [list(row) for row in ids]}

    tokenized = dataset.map(encode, batched=True, remove_columns=drop, desc="Tokenizing")
    return tokenized.filter(lambda ids: [len(row) >= 2 for row in ids], input_columns="input_ids", batched=True)


class CausalLMCollator:
    """Right-pads `input_ids` with `pad_token_id` (attention mask 0) and `labels` with -100.

    Args:
        pad_token_id (`int`): the tokenizer's pad token (its EOS when it has no pad token: the mask and the
            -100 labels keep padding out of the loss either way).
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = int(pad_token_id)

    def __call__(self, examples: list[dict]) -> dict:
        width = max(len(e["input_ids"]) for e in examples)
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(examples), width, dtype=torch.long)
        labels = torch.full((len(examples), width), -100, dtype=torch.long)
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            input_ids[row, :n] = torch.as_tensor(example["input_ids"])
            attention_mask[row, :n] = 1
            labels[row, :n] = torch.as_tensor(example.get("labels", example["input_ids"]))
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ----------------------------------------------------------------------------------------------------------
# Metric
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def perplexity(model, dataset, collator: CausalLMCollator, *, batch_size: int = 32, progress: bool = False) -> float:
    """exp(total next-token NLL / number of labelled target tokens) over a tokenized dataset.

    Every labelled token after the first of each row is a target (the shift of causal LMs); padding
    (-100) is ignored. Length-sorted batches keep padding small.
    """
    model.eval()
    device = next(model.parameters()).device
    all_ids, all_labels = dataset["input_ids"], dataset["labels"]
    lengths = [len(ids) for ids in all_ids]
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    total_nll, total_tokens = 0.0, 0
    starts = range(0, len(order), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="Perplexity", leave=False)
    for start in starts:
        rows = order[start : start + batch_size]
        batch = collator([{"input_ids": all_ids[i], "labels": all_labels[i]} for i in rows])
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits, targets = logits[:, :-1].float(), batch["labels"][:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                              reduction="sum")
        total_nll += float(nll)
        total_tokens += int((targets != -100).sum())
    if total_tokens == 0:
        raise ValueError("perplexity needs at least one labelled target token.")
    return math.exp(total_nll / total_tokens)


# ----------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------


def build_model(config: LanguageModelingConfig):
    """`AutoModelForCausalLM.from_pretrained(config.model_name_or_path)`, see [`wrap_lora`]."""
    from transformers import AutoModelForCausalLM

    if config.model_name_or_path is None:
        raise ValueError("Causal LM runs need --model_name_or_path (a local path or a Hub id).")
    return wrap_lora(AutoModelForCausalLM.from_pretrained(config.model_name_or_path), config)


def wrap_lora(model, config: LanguageModelingConfig):
    """Wrap with LoRA adapters (peft `CAUSAL_LM`) when `config.use_lora`; the model unchanged otherwise."""
    if not config.use_lora:
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(task_type="CAUSAL_LM", r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                      target_modules=config.lora_target_modules, layers_to_transform=config.lora_layers)
    return get_peft_model(model, lora)


def _load_tokenizer(config: LanguageModelingConfig):
    from transformers import AutoTokenizer

    name = config.tokenizer_name_or_path or config.model_name_or_path
    if name is None:
        raise ValueError("Pass a tokenizer, or set model_name_or_path / tokenizer_name_or_path.")
    return AutoTokenizer.from_pretrained(name)


def _with_pad_token(tokenizer):
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("The tokenizer has neither a pad nor an EOS token: set tokenizer.pad_token.")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def run_public_baseline(config: LanguageModelingConfig, *, model=None, tokenizer=None,
                        data: TextData | None = None) -> dict:
    """The public-only baseline as a run: the untouched model's test perplexity, written to `<run>.json`.

    No private data is used (`epsilon` and `delta` are 0, `model_dir` is `None`: it is the base model itself);
    the schema is [`run_language_modeling`]'s, with `mechanism="public-only"`.

    Args:
        config ([`LanguageModelingConfig`]): data, model and evaluation (its LoRA fields are unused).
        model (`PreTrainedModel`, *optional*): a causal LM object instead of loading `config.model_name_or_path`.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): used instead of loading one.
        data ([`TextData`], *optional*): already loaded data (only its test rows are read).

    Returns:
        `dict`: the result, also written to `results_dir/<run>.json`.
    """
    from transformers import AutoModelForCausalLM

    data = data if data is not None else load_text_data(config)
    tokenizer = _with_pad_token(tokenizer if tokenizer is not None else _load_tokenizer(config))
    if model is None:
        if config.model_name_or_path is None:
            raise ValueError("Causal LM runs need --model_name_or_path (a local path or a Hub id).")
        model = AutoModelForCausalLM.from_pretrained(config.model_name_or_path)
    test = tokenize_causal_lm(data.test, tokenizer, text_column=config.text_column, max_length=config.max_length,
                              keep_columns=())
    start = time.perf_counter()
    metric = perplexity(model, test, CausalLMCollator(tokenizer.pad_token_id), batch_size=config.eval_batch_size,
                        progress=config.progress)
    eval_seconds = time.perf_counter() - start
    result = baseline_record(
        config, task="causal-lm", metric_name="perplexity", eval_result=metric,
        base_model=config.model_name_or_path or _model_name(model), eval_seconds=eval_seconds,
        description="the untouched pretrained model (no private data)", eval_nll=math.log(metric),
        baseline_nll=math.log(metric), num_eval_examples=len(test), num_eval_tokens=_target_tokens(test))
    save_result(result, config.results_dir)
    return result


def _target_tokens(tokenized) -> int:
    """Next-token targets of a tokenized set: every labelled token after the first of each row."""
    return sum(sum(label != -100 for label in labels[1:]) for labels in tokenized["labels"])


def run_language_modeling(config: LanguageModelingConfig, training_args=None, *, model=None, tokenizer=None,
                          data: TextData | None = None, callbacks=None) -> dict:
    """Baseline perplexity, fine-tuning, test perplexity; save model, tokenizer, card and JSON.

    Args:
        config ([`LanguageModelingConfig`]): data, model and evaluation.
        training_args ([`~hf_dp.DPTrainingArguments`] or [`~transformers.TrainingArguments`], *optional*):
            every privacy and optimisation setting of the run; plain `TrainingArguments` mean non-private.
            Default: `config.training_arguments("uls")`.
        model (`PreTrainedModel`, *optional*): a causal LM object (e.g. built from a config in tests), used
            instead of loading `config.model_name_or_path`; LoRA is applied to it when `config.use_lora`.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): used instead of loading one.
        data ([`TextData`], *optional*): already loaded data.
        callbacks (`list[TrainerCallback]`, *optional*): added to the trainer (progress reporting).

    Returns:
        `dict`: the result (schema of [`hf_dp.workflows.tasks.classification`], `metric_name="perplexity"`), also
        written to `results_dir/<run>.json`.

    Raises:
        ValueError: no model name and no model, no tokenizer, or a bad configuration.
    """
    from transformers import set_seed

    if training_args is None:
        training_args = config.training_arguments()
    check_user_id_column(config, training_args)
    mechanism = mechanism_of_arguments(training_args)
    data = data if data is not None else load_text_data(config)
    tokenizer = _with_pad_token(tokenizer if tokenizer is not None else _load_tokenizer(config))
    set_seed(training_args.seed)  # LoRA starts from the run's seed, whatever ran before
    model = wrap_lora(model, config) if model is not None else build_model(config)
    collator = CausalLMCollator(tokenizer.pad_token_id)
    keep = (config.user_id_column,) if mechanism != "non-private" else ()
    train = tokenize_causal_lm(data.train, tokenizer, text_column=config.text_column, max_length=config.max_length,
                               keep_columns=keep)
    test = tokenize_causal_lm(data.test, tokenizer, text_column=config.text_column, max_length=config.max_length,
                              keep_columns=())

    baseline_result = config.baseline_result
    if baseline_result is None:  # the untouched model (LoRA's B matrices start at zero: same function)
        baseline_result = perplexity(model, test, collator, batch_size=config.eval_batch_size,
                                     progress=config.progress)
    base_model = config.model_name_or_path or _model_name(model)
    card = dict(dataset_name=data.dataset_name, metric_name="perplexity", baseline_result=baseline_result,
                non_private_result=config.non_private_result, base_model=base_model, task="text-generation",
                extra_not_covered=list(data.not_covered))
    trainer, train_seconds = fit(model, training_args, train, data_collator=collator, tokenizer=tokenizer,
                                 card=card, callbacks=callbacks)

    start = time.perf_counter()
    eval_result = perplexity(trainer.model, test, collator, batch_size=config.eval_batch_size,
                             progress=config.progress)
    eval_seconds = time.perf_counter() - start

    model_dir = Path(training_args.output_dir)
    privacy = save_run(trainer, tokenizer, model_dir, eval_result=eval_result, card=card)
    result = result_record(
        config, training_args=training_args, privacy=privacy, task="causal-lm", metric_name="perplexity",
        eval_result=eval_result, baseline_result=baseline_result, model_dir=model_dir, base_model=base_model,
        train_seconds=train_seconds, eval_seconds=eval_seconds, eval_nll=math.log(eval_result),
        baseline_nll=math.log(baseline_result), num_eval_examples=len(test), num_eval_tokens=_target_tokens(test),
        num_train_users=len(data.train.unique(config.user_id_column)), num_train_examples=len(data.train),
        steps=int(trainer.state.global_step), not_covered=list(data.not_covered),
    )
    save_result(result, config.results_dir)
    return result


def _model_name(model) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config, "_name_or_path", None) or type(base).__name__
