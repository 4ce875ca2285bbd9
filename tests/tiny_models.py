"""Tiny config-built models and padded batches for clipping tests (offline, seeded, CPU).

Architectures: GPT-2 (transformers `Conv1D`, learned positions, tied LM head), Llama
(RMSNorm, rotary, untied), BERT (LayerNorm, token-type and `(1, T)` position ids), Qwen2
(RMSNorm, q/k/v biases, tied LM head). Heads: sequence classification and causal LM.
Each optionally with a peft LoRA adapter. Also `FlattenedRowsModel`, whose layer sees (batch·time) rows, and
`with_dropout`, BERT and GPT-2 with dropout on.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertLMHeadModel,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

ARCHITECTURES = ("gpt2", "llama", "bert", "qwen2")
HEADS = ("seq_cls", "causal_lm")
VOCAB = 48
PAD = 0  # pad token id; real tokens are drawn from [3, VOCAB)
MAX_POSITIONS = 32

_LORA_TARGETS = {
    "gpt2": ["c_attn"],
    "llama": ["q_proj", "v_proj"],
    "bert": ["query", "value"],
    "qwen2": ["q_proj", "v_proj"],
}

_MODEL_CLASSES = {
    ("gpt2", "seq_cls"): GPT2ForSequenceClassification,
    ("gpt2", "causal_lm"): GPT2LMHeadModel,
    ("llama", "seq_cls"): LlamaForSequenceClassification,
    ("llama", "causal_lm"): LlamaForCausalLM,
    ("bert", "seq_cls"): BertForSequenceClassification,
    ("bert", "causal_lm"): BertLMHeadModel,
    ("qwen2", "seq_cls"): Qwen2ForSequenceClassification,
    ("qwen2", "causal_lm"): Qwen2ForCausalLM,
}


def tiny_config(arch: str, *, hidden: int = 16, layers: int = 2, **overrides):
    """A config for a 2-layer, 16-wide model with no dropout."""
    common = dict(vocab_size=VOCAB, pad_token_id=PAD, num_labels=3)
    if arch == "gpt2":
        config = GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=2, n_positions=MAX_POSITIONS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, **common,
        )
    elif arch == "llama":
        config = LlamaConfig(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, **common,
        )
    elif arch == "bert":
        config = BertConfig(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=2 * hidden,
            max_position_embeddings=MAX_POSITIONS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            type_vocab_size=2, **common,
        )
    elif arch == "qwen2":
        config = Qwen2Config(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, **common,
        )
    else:
        raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(
    arch: str,
    head: str = "seq_cls",
    *,
    lora: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str = "eager",
    **config_overrides,
):
    """A randomly initialised tiny model, optionally wrapped with a peft LoRA adapter (r=4).

    For `bert` with `head="causal_lm"` the config is made a decoder (`BertLMHeadModel`).
    With LoRA and `seq_cls`, peft also trains a copy of the classifier head.
    """
    config = tiny_config(arch, **config_overrides)
    if arch == "bert" and head == "causal_lm":
        config.is_decoder = True
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = _MODEL_CLASSES[(arch, head)](config)
    model = model.to(dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=_LORA_TARGETS[arch],
            task_type="SEQ_CLS" if head == "seq_cls" else "CAUSAL_LM", fan_in_fan_out=arch == "gpt2",
        )
        model = get_peft_model(model, lora_config)
        # peft initialises lora_B to zero; randomise it so every adapter gets a gradient
        # through both factors and the test sees non-trivial norms.
        with torch.no_grad():
            generator = torch.Generator().manual_seed(seed + 1)
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.1 * torch.randn(param.shape, generator=generator).to(param.dtype))
    model.train()
    return model


def tiny_batch(
    batch_size: int = 6,
    seq_len: int = 8,
    *,
    head: str = "seq_cls",
    padding: bool = True,
    padding_side: str = "right",
    num_labels: int = 3,
    seed: int = 0,
) -> Dict[str, torch.Tensor]:
    """Random tokens with ragged lengths padded with `PAD`; the attention mask marks padding.

    Causal-LM labels are the input ids with -100 at padding; classification labels are
    class ids. The first example always has the full length.
    """
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch_size, seq_len), generator=generator)
    if padding:
        lengths = torch.randint(max(2, seq_len // 2), seq_len + 1, (batch_size,), generator=generator)
        lengths[0] = seq_len
    else:
        lengths = torch.full((batch_size,), seq_len)
    positions = torch.arange(seq_len)[None, :]
    if padding_side == "right":
        attention_mask = (positions < lengths[:, None]).long()
    else:
        attention_mask = (positions >= seq_len - lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, PAD)
    if head == "causal_lm":
        labels = input_ids.masked_fill(attention_mask == 0, -100)
    else:
        labels = torch.randint(0, num_labels, (batch_size,), generator=generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor, head: str) -> torch.Tensor:
    """(B,) losses: cross-entropy for classification; for causal LM the mean next-token
    cross-entropy over each example's labelled tokens (-100 ignored)."""
    if head == "seq_cls":
        return F.cross_entropy(logits, labels, reduction="none")
    logits, labels = logits[..., :-1, :], labels[..., 1:]
    token_loss = F.cross_entropy(logits.transpose(-1, -2), labels, ignore_index=-100, reduction="none")
    return token_loss.sum(-1) / (labels != -100).sum(-1).clamp(min=1)


def model_inputs(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The batch without labels (losses are computed per example outside the model)."""
    return {key: value for key, value in batch.items() if key != "labels"}


def trainable_parameters(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class FlattenedRowsModel(torch.nn.Module):
    """Runs its linear layer on the tokens flattened to (B·T, d), batch-major (as OPT) or time-major."""

    def __init__(self, time_major: bool):
        super().__init__()
        self.time_major = time_major
        self.inner, self.outer = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)

    def forward(self, input):  # (B, T, 3)
        batch, tokens = input.shape[:2]
        if self.time_major:
            flat = self.inner(input.transpose(0, 1).reshape(batch * tokens, 3))  # rows: t * B + b
            hidden = flat.reshape(tokens, batch, 4).transpose(0, 1)
        else:
            hidden = self.inner(input.reshape(batch * tokens, 3)).reshape(batch, tokens, 4)  # rows: b * T + t
        return self.outer(torch.tanh(hidden))


def with_dropout(arch: str):
    """A 1-layer BERT classifier or GPT-2 LM with dropout 0.1 everywhere (the probes must see through dropout)."""
    torch.manual_seed(0)
    if arch == "bert":
        return BertForSequenceClassification(BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=2))
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))

