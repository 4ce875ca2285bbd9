"""Chat fine-tuning with TRL's SFTTrainer on per-user conversations: the data, the metric, one run.

The same shape as [`hf_dp.workflows.tasks.language_modeling`], for supervised fine-tuning of a chat model on
conversations written by users, with [`~hf_dp.sft.DPSFTTrainer`] (ULS, ELS or example-level DP-SGD at a target ε;
LoRA optional) or plain TRL `SFTTrainer` (non-private):

1. [`load_chat_data`]: the Shakespeare chat data ([`~hf_dp.workflows.chat_data.load_shakespeare_chat`]: each
   conversation a speech and the reply of another role, the user the replying role, split by play) or the user's
   own file with a user column and a conversations column (TRL's format, lists of `{"role", "content"}`), split so
   that no test user is ever trained on.
2. [`to_prompt_completion`]: each conversation becomes one prompt/completion row, in TRL's conversational format:
   the completion is its last assistant turn, the prompt every message before it (earlier assistant turns are
   context). With `completion_only_loss` (SFTConfig's default for such rows) only the reply is learned: no
   `{% generation %}` marks are needed in the chat template (SmolLM2's has none).
3. [`tokenize_prompt_completion`]: the test rows tokenized as SFTTrainer tokenizes training rows (the chat
   template, the prompt with its generation prompt, truncation to `max_length`), labels -100 on the prompt. A row
   longer than `max_length` loses the start of its prompt and keeps its reply, here and in training
   (`truncation_mode="keep_reply"`, [`hf_dp.sft_truncation`]): no row is lost to truncation.
4. **Completion perplexity** ([`METRIC_NAME`]): exp of the mean next-token cross-entropy over the completion tokens
   of the test rows only (the reply and the template's end-of-turn tokens; never the prompt). Lower is better. The
   **public-only baseline** is the same figure for the untouched chat model.
5. [`run_chat_sft`]: baseline, fine-tuning, evaluation, model + tokenizer (LoRA merged) and privacy card in
   `training_args.output_dir`, and `results_dir/<run>.json` with the schema of
   [`hf_dp.workflows.tasks.classification`], except that `"task"` is `"chat-sft"` and `"metric_name"` is
   `"completion perplexity"`: `eval_result` is the fine-tuned model's, `baseline_result` the untouched model's;
   `eval_nll` and `baseline_nll` are their logarithms (nats per completion token).

Evaluation, cards and results are post-processing: they do not change ε. The prompts count as the user's data
too: the user-level guarantee covers every row of a user, prompt and completion alike.

Example:

```python
>>> from hf_dp.workflows.tasks.chat_sft import ChatSFTConfig, run_chat_sft
>>> config = ChatSFTConfig(run="chat-uls", model_name_or_path="path/to/chat-model", max_train_users=200)
>>> args = config.training_arguments("uls", target_epsilon=8.0, expected_batch_size=32, max_steps=20)
>>> type(args).__name__, args.max_length, args.mechanism
('DPSFTConfig', 256, 'uls')
>>> result = run_chat_sft(config, args)  # doctest: +SKIP
>>> result["eval_result"], result["baseline_result"]  # completion perplexity after, and before  # doctest: +SKIP
```
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

from hf_dp.sft_truncation import KEEP_REPLY, ReplyKeepingMixin, keep_reply
from hf_dp.workflows.run_data import (
    check_disjoint_users,
    load_splits,
    subsample_rows,
    subsample_users,
    without_plays,
)
from hf_dp.workflows.run_results import baseline_record, result_record, save_result
from hf_dp.workflows.runs import RunConfig, announce_plan, check_user_id_column, mechanism_of_arguments, save_run
from hf_dp.workflows.tasks.language_modeling import CausalLMCollator, TextData, perplexity

__all__ = [
    "METRIC_NAME",
    "ChatSFTConfig",
    "completion_perplexity",
    "cpu_has_native_bf16",
    "load_chat_data",
    "lora_config",
    "model_loss_sft_trainer",
    "prepare_chat_tokenizer",
    "run_chat_baseline",
    "run_chat_sft",
    "to_prompt_completion",
    "tokenize_prompt_completion",
]

METRIC_NAME = "completion perplexity"  # lower is better
TASK = "chat-sft"


@dataclass
class ChatSFTConfig(RunConfig):
    r"""
    One chat fine-tuning run: the fields of [`~hf_dp.workflows.runs.RunConfig`] with SFT defaults. Privacy and
    optimisation settings are the training arguments': [`training_arguments`] builds a
    [`~hf_dp.sft.DPSFTConfig`] (DP) or TRL's `SFTConfig` (non-private), whose `max_length` is this config's.

    Args:
        text_column (`str`, *optional*, defaults to `"messages"`): the column with the conversations (TRL's
            conversational format); unused for `dataset="shakespeare"`.
        max_length (`int`, *optional*, defaults to `256`): tokens per conversation, chat template included
            (a longer row loses the start of its prompt and keeps its reply: `truncation_mode="keep_reply"`), train
            and test.
        model_name_or_path (`str`): the chat model (local path or Hub id). Required unless a model object is passed
            to [`run_chat_sft`], in which case it only names the base model in the card.
        tokenizer_name_or_path (`str`, *optional*): defaults to `model_name_or_path`; it needs a chat template.
        system_prompt (`str`, *optional*): a system message put before every conversation, train and test (public
            text, the same for every row); `None` keeps the conversations as they are (the chat template may add
            its own default system message: SmolLM2's adds a 20-token one).
        save_adapter_only (`bool`, *optional*, defaults to `False`): with LoRA, save only the adapter (a few
            hundred kilobytes; it loads onto `model_name_or_path`) instead of the merged model (the app's Train tab).
        load_in_4bit (`bool`, *optional*, defaults to `False`): QLoRA: load the base in 4-bit NF4 (transformers'
            `BitsAndBytesConfig`, double quantization, computing in bf16 when training in bf16, else float32),
            frozen, and train LoRA adapters on it (`use_lora` required). The adapter alone is saved (a 4-bit base
            cannot take the merge), with a card saying how the base was quantized and how to load it. The
            public-only baseline is the quantized base's.
        bf16_on_cpu (`bool`, *optional*, defaults to `False`): with no GPU, train in bf16 mixed precision (autocast;
            float32 weights, gradients and noise) when the CPU has native bf16 matrix instructions
            ([`cpu_has_native_bf16`]): about 1.7x faster steps for SmolLM2 on the 2-core machine. Evaluation stays
            float32. SFTConfig's bf16 default covers GPUs only.
    """

    text_column: str = "messages"
    max_length: int = 256
    tokenizer_name_or_path: str | None = None
    system_prompt: str | None = None
    save_adapter_only: bool = False
    load_in_4bit: bool = False
    bf16_on_cpu: bool = False

    DP_TRAINING_DEFAULTS: ClassVar[dict] = {"learning_rate": 1e-3, "num_train_epochs": 2.0,
                                            "per_device_train_batch_size": 16}
    NON_PRIVATE_TRAINING_DEFAULTS: ClassVar[dict] = {"learning_rate": 2e-4, "num_train_epochs": 2.0,
                                                     "per_device_train_batch_size": 16}

    def __post_init__(self):
        super().__post_init__()
        if self.load_in_4bit and not self.use_lora:
            raise ValueError("load_in_4bit=True freezes the base in 4-bit NF4, which cannot be trained itself: add "
                             "--use_lora to train LoRA adapters on it (QLoRA).")

    def training_argument_classes(self) -> tuple[type, type]:
        """[`~hf_dp.sft.DPSFTConfig`] and TRL's `SFTConfig`."""
        from hf_dp.sft import DPSFTConfig, SFTConfig  # TRL's SFTConfig; hf_dp.sft names the extra if TRL is missing

        return DPSFTConfig, SFTConfig

    def training_arguments(self, mechanism: str = "uls", **fields):
        """[`RunConfig.training_arguments`] as SFT configs, with `max_length` this config's unless given, and `bf16`
        (SFTConfig's default) only where a GPU supports it (or, with `bf16_on_cpu`, a CPU), unless `bf16` or `fp16`
        is given."""
        from transformers.utils import is_torch_bf16_gpu_available

        defaults = {"max_length": self.max_length, "truncation_mode": KEEP_REPLY}
        if not {"bf16", "fp16"} & set(fields):
            gpu = not fields.get("use_cpu") and is_torch_bf16_gpu_available()
            defaults["bf16"] = gpu
            if not gpu and self.bf16_on_cpu and cpu_has_native_bf16():
                defaults.update(bf16=True, use_cpu=True)  # transformers takes bf16 without a GPU with use_cpu only
        return super().training_arguments(mechanism, **{**defaults, **fields})


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX), as oneDNN reports it: elsewhere bf16
    autocast is emulated and slower than float32."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------


def load_chat_data(config: ChatSFTConfig) -> TextData:
    """Train and test conversations as prompt/completion rows ([`to_prompt_completion`]), users disjoint.

    `dataset="shakespeare"`: [`~hf_dp.workflows.chat_data.load_shakespeare_chat`] (train and test plays, the same
    as the causal-LM task's); otherwise `config.dataset` with `config.eval_dataset` or a seeded split by user
    ([`~hf_dp.workflows.run_data.load_splits`]). Then `max_train_users` and `max_eval_examples` subsample.

    Raises:
        ValueError: a missing column, conversations not in TRL's format, a test split sharing users with train, or
            no rows left.
    """
    if config.dataset == "shakespeare":
        from hf_dp.workflows.chat_data import load_shakespeare_chat

        chat = load_shakespeare_chat()
        train, test, column, name = chat["train"], chat["test"], "messages", "shakespeare-chat"
        if config.exclude_train_plays:
            train = without_plays(train, config.exclude_train_plays)
        check_disjoint_users(train, test, config.user_id_column)
    else:
        train, test = load_splits(config)
        column, name = config.text_column, str(config.dataset)
    train = subsample_users(train, config.user_id_column, config.max_train_users, config.seed)
    test = subsample_rows(test, config.max_eval_examples, config.seed)
    keep = (config.user_id_column,)
    train = to_prompt_completion(train, messages_column=column, keep_columns=keep, system_prompt=config.system_prompt)
    test = to_prompt_completion(test, messages_column=column, keep_columns=keep, system_prompt=config.system_prompt)
    if len(train) == 0 or len(test) == 0:
        raise ValueError("No training or no test conversations left: check the data, max_train_users and "
                         "max_eval_examples.")
    return TextData(train=train, test=test, dataset_name=name)


def to_prompt_completion(dataset, *, messages_column: str = "messages", keep_columns: Sequence[str] = ("user_id",),
                         system_prompt: str | None = None):
    """One prompt/completion row per conversation: `completion` = `[last assistant message]`, `prompt` = the
    messages before it (TRL's conversational prompt-completion format), after a `system_prompt` message if one is
    given and the conversation has no system message of its own.

    Messages keep their `role` and `content` only. Conversations with no assistant turn, or nothing before it, are
    dropped. `keep_columns` are kept (the user column); every other column is dropped.

    Raises:
        ValueError: `messages_column` missing or not holding lists of `{"role", "content"}` messages.
    """
    if messages_column not in dataset.column_names:
        raise ValueError(f"No conversations column {messages_column!r} (columns: {dataset.column_names}): set "
                         "--text_column to the column with the messages.")
    from hf_dp.sft import check_conversation

    index = 0
    for batch in dataset.select_columns([messages_column]).iter(batch_size=1000):
        for messages in batch[messages_column]:
            if messages != []:  # an empty conversation has no reply: dropped below
                check_conversation(messages, f"Conversation {index} ({messages_column!r})")
                if any(m.get("content") is None for m in messages):
                    raise ValueError(f"Conversation {index} ({messages_column!r}) has a message with no content (a "
                                     "tool call?): the rows keep each message's role and content only; drop such "
                                     "conversations or give the message its text.")
            index += 1

    def reply_index(messages) -> int:
        return max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)

    def convert(row):
        messages = [{"role": m["role"], "content": m["content"]} for m in row[messages_column]]
        last = reply_index(messages)
        prompt = messages[:last]
        if system_prompt is not None and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": system_prompt}] + prompt
        return {"prompt": prompt, "completion": [messages[last]]}

    keep = set(keep_columns)
    dataset = dataset.filter(lambda messages: reply_index(messages) > 0, input_columns=messages_column)
    return dataset.map(convert, remove_columns=[c for c in dataset.column_names if c not in keep])


def tokenize_prompt_completion(dataset, tokenizer, *, max_length: int | None = 256,
                               truncation_mode: str = KEEP_REPLY, keep_columns: Sequence[str] = ()):
    """`input_ids` and `labels` of prompt/completion rows, as SFTTrainer prepares them.

    `input_ids` is the chat template applied to prompt + completion; the completion starts where it and the prompt
    rendered with its generation prompt diverge (their common prefix, as TRL does); `labels` are -100 on the prompt.
    Rows are truncated to `max_length` (`truncation_mode` as DPSFTConfig's: by default a long row loses the start
    of its prompt and keeps its reply), and rows left with no completion token dropped. Every other column but
    `keep_columns` (e.g. the user column) is dropped.
    """
    def encode(row):
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=True, return_dict=True,
                                               add_generation_prompt=True)["input_ids"]
        ids = list(tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True,
                                                 return_dict=True)["input_ids"])
        start = 0
        while start < min(len(prompt), len(ids)) and prompt[start] == ids[start]:
            start += 1
        labels = [-100] * start + ids[start:]
        if max_length is not None and truncation_mode == KEEP_REPLY:
            ids, labels = keep_reply(ids, labels, max_length)
        elif max_length is not None:  # TRL's own modes
            cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            ids, labels = ids[cut], labels[cut]
        return {"input_ids": ids, "labels": labels}

    tokenized = dataset.map(encode, remove_columns=[c for c in dataset.column_names if c not in keep_columns],
                            desc="Tokenizing conversations")
    return tokenized.filter(lambda labels: any(label != -100 for label in labels[1:]), input_columns="labels")


def completion_perplexity(model, tokenized, *, pad_token_id: int, batch_size: int = 32,
                          progress: bool = False) -> float:
    """exp(total cross-entropy of the completion tokens / their number) over [`tokenize_prompt_completion`]'s rows.

    Each completion token is predicted from everything before it (prompt included); prompt tokens and padding are
    never targets.
    """
    return perplexity(model, tokenized, CausalLMCollator(pad_token_id), batch_size=batch_size, progress=progress)


def completion_tokens(tokenized) -> int:
    """The targets of [`completion_perplexity`]: labelled tokens after the first of each row."""
    return sum(sum(label != -100 for label in labels[1:]) for labels in tokenized["labels"])


# ----------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------


def run_chat_sft(config: ChatSFTConfig, training_args=None, *, model=None, tokenizer=None,
                 data: TextData | None = None, callbacks=None) -> dict:
    """Baseline completion perplexity, SFT, test completion perplexity; save model, tokenizer, card and JSON.

    Args:
        config ([`ChatSFTConfig`]): data, model and evaluation.
        training_args ([`~hf_dp.sft.DPSFTConfig`] or `trl.SFTConfig`, *optional*): every privacy and optimisation
            setting of the run; a plain `SFTConfig` means non-private (TRL's `SFTTrainer`). Default:
            `config.training_arguments("uls")`.
        model (`PreTrainedModel`, *optional*): a causal LM object, used instead of loading
            `config.model_name_or_path`; LoRA adapters go on it when `config.use_lora`.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): used instead of loading one; it needs a chat template.
        data (`TextData`, *optional*): already loaded prompt/completion rows ([`load_chat_data`]).
        callbacks (`list[TrainerCallback]`, *optional*): added to the trainer.

    Returns:
        `dict`: the result (`metric_name="completion perplexity"`), also written to `results_dir/<run>.json`.

    Raises:
        TypeError: training arguments that are not SFT configs.
        ValueError: a `max_length` other than the config's, a user column other than the config's, no model.
    """
    from transformers import set_seed

    from hf_dp.sft import SFTConfig

    if training_args is None:
        training_args = config.training_arguments()
    if not isinstance(training_args, SFTConfig):
        raise TypeError(f"run_chat_sft trains with TRL's SFTTrainer: pass DPSFTConfig or SFTConfig arguments "
                        f"(ChatSFTConfig.training_arguments builds them), not {type(training_args).__name__}.")
    if training_args.max_length != config.max_length:
        raise ValueError(f"max_length: the training arguments say {training_args.max_length}, the run config "
                         f"{config.max_length}; set both (the recipe's --max_length sets both).")
    check_user_id_column(config, training_args)
    mechanism = mechanism_of_arguments(training_args)
    data = data if data is not None else load_chat_data(config)
    tokenizer = prepare_chat_tokenizer(tokenizer, config)
    model, base_model = _chat_model(model, config, training_args)
    if not config.load_in_4bit:
        model = model.to(training_args.device)  # the baseline on the device the run trains on
    test = tokenize_prompt_completion(data.test, tokenizer, max_length=training_args.max_length,
                                      truncation_mode=training_args.truncation_mode)
    evaluate = dict(pad_token_id=tokenizer.pad_token_id, batch_size=config.eval_batch_size, progress=config.progress)

    baseline_result = config.baseline_result
    if baseline_result is None:  # the untouched chat model, before any adapter or training
        baseline_result = completion_perplexity(model, test, **evaluate)
    card = dict(dataset_name=data.dataset_name, metric_name=METRIC_NAME, baseline_result=baseline_result,
                non_private_result=config.non_private_result, base_model=base_model, task="text-generation")
    adapter_only = bool((config.save_adapter_only or config.load_in_4bit) and config.use_lora)
    if adapter_only:
        card["library_name"] = "peft"
    if config.load_in_4bit:
        card["base_quantization"] = QUANTIZATION
    columns = ["prompt", "completion"] + ([config.user_id_column] if mechanism != "non-private" else [])
    set_seed(training_args.seed)  # LoRA starts from the run's seed, whatever ran before
    trainer = _sft_trainer(model, training_args, data.train.select_columns(columns), tokenizer, card,
                           peft_config=lora_config(config), callbacks=callbacks)
    announce_plan(trainer)
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start

    start = time.perf_counter()
    eval_result = completion_perplexity(trainer.model, test, **evaluate)
    eval_seconds = time.perf_counter() - start

    model_dir = Path(training_args.output_dir)
    privacy = save_run(trainer, tokenizer, model_dir, eval_result=eval_result, card=card, adapter_only=adapter_only)
    result = result_record(
        config, training_args=training_args, privacy=privacy, task=TASK, metric_name=METRIC_NAME,
        eval_result=eval_result, baseline_result=baseline_result, model_dir=model_dir, base_model=base_model,
        train_seconds=train_seconds, eval_seconds=eval_seconds, eval_nll=math.log(eval_result),
        baseline_nll=math.log(baseline_result), num_eval_examples=len(test), num_eval_tokens=completion_tokens(test),
        num_train_users=len(data.train.unique(config.user_id_column)), num_train_examples=len(data.train),
        steps=int(trainer.state.global_step),
    )
    save_result(result, config.results_dir)
    return result


def run_chat_baseline(config: ChatSFTConfig, *, model=None, tokenizer=None, data: TextData | None = None) -> dict:
    """The public-only baseline as a run: the untouched chat model's test completion perplexity, in `<run>.json`.

    No private data is used (`epsilon` and `delta` are 0, `model_dir` is `None`: the model is the base model
    itself); the schema is [`run_chat_sft`]'s, with `mechanism="public-only"`. Test rows are tokenized as a run
    with `config.max_length` and SFTConfig's default truncation tokenizes them.
    """
    data = data if data is not None else load_chat_data(config)
    tokenizer = prepare_chat_tokenizer(tokenizer, config)
    model, base_model = _chat_model(model, config)
    test = tokenize_prompt_completion(data.test, tokenizer, max_length=config.max_length)
    start = time.perf_counter()
    metric = completion_perplexity(model, test, pad_token_id=tokenizer.pad_token_id,
                                   batch_size=config.eval_batch_size, progress=config.progress)
    result = baseline_record(
        config, task=TASK, metric_name=METRIC_NAME, eval_result=metric, base_model=base_model,
        eval_seconds=time.perf_counter() - start, description="the untouched chat model (no private data)",
        eval_nll=math.log(metric), baseline_nll=math.log(metric), num_eval_examples=len(test),
        num_eval_tokens=completion_tokens(test))
    save_result(result, config.results_dir)
    return result


def _chat_model(model, config: ChatSFTConfig, training_args=None):
    """(`model`, or `config.model_name_or_path` loaded when `model` is None, in 4-bit NF4 with `load_in_4bit`; the
    base model's name for the card)."""
    if model is None:
        from transformers import AutoModelForCausalLM

        if config.model_name_or_path is None:
            raise ValueError("Chat SFT runs need --model_name_or_path (a local path or a Hub id).")
        quantized = {}
        if config.load_in_4bit:  # each process's copy on its own device (DDP: one GPU per rank)
            device = getattr(training_args, "device", None)
            quantized = {"quantization_config": nf4_config(training_args),
                         **({"device_map": {"": device}} if device is not None else {})}
        model = AutoModelForCausalLM.from_pretrained(config.model_name_or_path, **quantized)
    return model, config.model_name_or_path or getattr(model.config, "_name_or_path", None) or type(model).__name__


QUANTIZATION = "4-bit NF4 (bitsandbytes, double quantization)"


def nf4_config(training_args=None):
    """transformers' `BitsAndBytesConfig` for QLoRA: NF4 with double quantization, computing in bf16 when the run
    trains in bf16 (else float32)."""
    import importlib.util

    import torch
    from transformers import BitsAndBytesConfig

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("load_in_4bit needs bitsandbytes: pip install 'hf_dp[qlora]'.")
    compute = torch.bfloat16 if getattr(training_args, "bf16", False) else torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute)


def prepare_chat_tokenizer(tokenizer, config: ChatSFTConfig):
    """`tokenizer` (or the config's, loaded) checked for a chat template, its pad token set (EOS if none)."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        name = config.tokenizer_name_or_path or config.model_name_or_path
        if name is None:
            raise ValueError("Pass a tokenizer, or set model_name_or_path / tokenizer_name_or_path.")
        tokenizer = AutoTokenizer.from_pretrained(name)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The tokenizer has no chat template: use a chat model's tokenizer (--tokenizer_name_or_path).")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("The tokenizer has neither a pad nor an EOS token: set tokenizer.pad_token.")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def lora_config(config: ChatSFTConfig):
    """The run's `peft.LoraConfig` (None without `use_lora`)."""
    if not config.use_lora:
        return None
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                      target_modules=config.lora_target_modules, layers_to_transform=config.lora_layers)


def _sft_trainer(model, training_args, train, tokenizer, card: dict, *, peft_config, callbacks):
    """[`~hf_dp.sft.DPSFTTrainer`] for DP arguments (the card's fields given), [`ModelLossSFTTrainer`] (TRL's
    `SFTTrainer`) otherwise."""
    from hf_dp.sft import DPSFTTrainer

    callbacks = list(callbacks) if callbacks else None
    if mechanism_of_arguments(training_args) == "non-private":
        return model_loss_sft_trainer()(model=model, args=training_args, train_dataset=train,
                                        processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    return DPSFTTrainer(model=model, args=training_args, train_dataset=train, processing_class=tokenizer,
                        peft_config=peft_config, callbacks=callbacks, privacy_card_kwargs=card)


@functools.cache
def model_loss_sft_trainer() -> type:
    """`ModelLossSFTTrainer`: TRL's `SFTTrainer` (its data preparation, collator and loss masks, with
    `truncation_mode="keep_reply"` as DPSFTTrainer's) whose loss is the
    model's own, as `transformers.Trainer` computes it: the mean cross-entropy over the completion tokens, TRL's
    `"nll"` loss, from the logits the DP runs compute too. TRL's default path runs the LM head fused with its
    log-softmax and entropy metrics in chunks, which on a CPU made a non-private step 1.2x a DP step; its
    `entropy` and `mean_token_accuracy` logs are not kept. Built once (TRL is imported only when it is needed)."""
    from transformers import Trainer

    from hf_dp.sft import SFTTrainer

    class ModelLossSFTTrainer(ReplyKeepingMixin, SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs["use_cache"] = False
            return Trainer.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    return ModelLossSFTTrainer
