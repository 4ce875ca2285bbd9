"""hf_dp.row_order: a collator that changes the order of a batch's rows is refused; transformers' collators (padding,
packing, masked language modelling's random tokens) pass, and the check leaves every RNG as it found it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from app_fixtures import make_tokenizer
from trainer_fixtures import pad_collator, user_dataset
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, DataCollatorWithPadding

from hf_dp.row_order import check_row_order


def _rows(causal_lm=False, labels=True):
    dataset = user_dataset(causal_lm=causal_lm).remove_columns("user_id")
    return dataset if labels else dataset.remove_columns("labels")


def _masking_tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.mask_token = "[UNK]"
    return tokenizer


@pytest.mark.parametrize("make_collator, rows", [
    (lambda: pad_collator, _rows()),
    (lambda: DataCollatorWithPadding(make_tokenizer()), _rows()),
    (lambda: DataCollatorWithFlattening(), _rows(causal_lm=True)),
    (lambda: DataCollatorForLanguageModeling(_masking_tokenizer(), mlm_probability=0.3), _rows(labels=False)),
], ids=["pad", "with-padding", "flattening", "masked-lm"])
def test_order_keeping_collators_pass_and_leave_the_rngs_alone(make_collator, rows):
    collator = make_collator()
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    for _ in range(5):  # the masked-LM collator draws other tokens each time
        check_row_order(rows, collator)
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])


def _sorted_by_label(examples):
    return pad_collator(sorted(examples, key=lambda example: example["labels"]))


def _reversed_packing(examples):
    return DataCollatorWithFlattening()(examples[::-1])


def _reversed_masking(examples, collator=DataCollatorForLanguageModeling(_masking_tokenizer())):
    return collator(examples[::-1])


@pytest.mark.parametrize("collator, rows, words", [
    (_sorted_by_label, _rows(), "returned the row given at position"),  # sorted by a key other than length
    (_reversed_packing, _rows(causal_lm=True), "packed the rows it was given in another order"),
    (_reversed_masking, _rows(labels=False), "returned the row given at position"),
], ids=["sorted-by-label", "reversed-packing", "reversed-masked-lm"])
def test_reordering_collators_are_refused(collator, rows, words):
    with pytest.raises(ValueError, match=words):
        check_row_order(rows, collator)
