"""Tiny models and user datasets for DPTrainer tests (built in code, offline, seeded)."""

from __future__ import annotations

import random

import numpy as np
import torch
from datasets import Dataset
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import SequenceClassifierOutput

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.data import UserPartition

VOCAB = 40


def tiny_bert(num_labels: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=num_labels,
    )
    return BertForSequenceClassification(config)


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


class TinyDecoder(LlamaForCausalLM):
    """A causal LM whose class name says nothing about its head."""


class MeanCentering(nn.Module):
    """Subtracts the batch mean: no parameter, no known type, caught only by the probe."""

    def forward(self, hidden):
        return hidden - hidden.mean(dim=0, keepdim=True)



class ChannelFirst(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, hidden):  # (B, d) -> (B, 1, d) for InstanceNorm1d
        return self.inner(hidden.unsqueeze(1)).squeeze(1)



class PooledClassifier(nn.Module):
    """Embedding -> masked mean -> `mixer` -> linear head."""

    def __init__(self, mixer: nn.Module, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, width)
        self.mixer = mixer
        self.head = nn.Linear(width, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        return SequenceClassifierOutput(logits=self.head(self.mixer(pooled)))



def frozen(module: nn.Module) -> nn.Module:
    for param in module.parameters():
        param.requires_grad_(False)
    return module



def user_dataset(num_users: int = 24, max_rows: int = 6, seed: int = 0, causal_lm: bool = False,
                 user_ids=None) -> Dataset:
    """Users with 1..max_rows rows of random tokens; label = parity of the first token (learnable)."""
    rng = random.Random(seed)
    rows = {"user_id": [], "input_ids": [], "labels": []}
    ids = user_ids if user_ids is not None else [f"user-{i}" for i in range(num_users)]
    for user in ids:
        for _ in range(rng.randint(1, max_rows)):
            tokens = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 9))]
            rows["user_id"].append(user)
            rows["input_ids"].append(tokens)
            rows["labels"].append(list(tokens) if causal_lm else tokens[0] % 2)
    return Dataset.from_dict(rows)


def user_partition(rows_per_user, contribution_bound: int | None = None) -> UserPartition:
    """A partition of users holding `rows_per_user[u]` consecutive rows each (no dataset: what the plan reads)."""
    user_rows = [np.arange(start, start + n) for start, n in zip(np.cumsum([0, *rows_per_user[:-1]]), rows_per_user)]
    row_user = np.repeat(np.arange(len(rows_per_user)), rows_per_user)
    return UserPartition(dataset=None, row_user=row_user, user_rows=user_rows, contribution_bound=contribution_bound)


def pad_collator(examples: list[dict]) -> dict:
    """Right-pads input_ids with 0 (masked); token labels are padded with -100."""
    width = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.zeros(len(examples), width, dtype=torch.long)
    attention_mask = torch.zeros(len(examples), width, dtype=torch.long)
    token_labels = isinstance(examples[0]["labels"], list)
    labels = torch.full((len(examples), width), -100) if token_labels else torch.tensor([e["labels"] for e in examples])
    for i, example in enumerate(examples):
        n = len(example["input_ids"])
        input_ids[i, :n] = torch.tensor(example["input_ids"])
        attention_mask[i, :n] = 1
        if token_labels:
            labels[i, :n] = torch.tensor(example["labels"])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_args(tmp_path, **overrides) -> DPTrainingArguments:
    settings = dict(
        output_dir=str(tmp_path / "out"), max_steps=4, expected_batch_size=8, per_device_train_batch_size=4,
        learning_rate=1e-2, target_epsilon=8.0, noise_seed=1234, report_to=[], logging_steps=1, save_strategy="no",
        use_cpu=True, disable_tqdm=True,
    )
    settings.update(overrides)
    return DPTrainingArguments(**settings)


def make_trainer(tmp_path, model=None, dataset=None, **overrides) -> DPTrainer:
    return DPTrainer(
        model=model if model is not None else tiny_bert(),
        args=make_args(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else user_dataset(),
        data_collator=pad_collator,
    )


def one_line(error) -> str:
    """The message of a `pytest.raises` result, asserted to be one line."""
    message = str(error.value)
    assert "\n" not in message, message
    return message
