"""Refuse a data collator that changes the order of the rows it is given.

The DP step matches each collated row to its unit (user) by position: a micro-batch's rows are collated in the order
of its units, and the unit index says which consecutive rows form each unit. A collator that reverses, sorts or
shuffles its rows would have rows clipped under other users, so one user could move the clipped sum by more than C.

[`check_row_order`] runs once, at construction, on up to 8 training rows (of different lengths where the first 64
rows allow): each row is collated alone, then all of them in one order and in the reverse order; every row of a batch
must come back where it was given. A collator whose order depends only on the rows it gets (sorted by any key)
returns the same batch for both orders, so one of the two differs from the order given. Each batch row must be
nearest to its own row collated alone; values a collator draws at random (masked language modelling's tokens and
labels) are compared by their lengths only. Nothing is collated per step for this check, and it trains and releases
nothing. A collator that reorders only some batches (by their size, or at random steps) is not seen.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch


def check_row_order(dataset, data_collator, *, rows: int = 8, scan: int = 64) -> None:
    """Raise `ValueError` when `data_collator` returns the rows of `dataset` (the columns the model takes) in another
    order than it was given them. RNG states (python, numpy, torch) are restored afterwards."""
    examples = _distinct_examples(dataset, rows, scan)
    if len(examples) < 2:
        return
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            singles = [data_collator([example]) for example in examples]
            drawn = _drawn_keys(data_collator, examples, singles)
            for order in (list(range(len(examples))), list(range(len(examples)))[::-1]):
                _check_order(data_collator, examples, singles, order, drawn)
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _drawn_keys(data_collator, examples: list, singles: list, repeats: int = 2) -> set:
    """Keys whose values a collator draws at random (masked language modelling's `input_ids` and `labels`): those
    that differ between collations of the same row alone. Only their lengths are compared."""
    drawn = set()
    for _ in range(repeats):
        for example, single in zip(examples, singles):
            again = data_collator([example])
            drawn |= {k for k, v in single.items()
                      if torch.is_tensor(v) and not (torch.is_tensor(again.get(k)) and torch.equal(again[k], v))}
    return drawn


def _check_order(data_collator, examples: list, singles: list, order: list, drawn: set) -> None:
    batch = data_collator([examples[i] for i in order])
    rows = _row_values(batch, len(order))
    if rows is None:  # packed into one row (or not row-aligned): compare with the rows packed in the order given
        _check_packed(data_collator, singles, order, batch, drawn)
        return
    alone = [_row_values(single, 1) for single in singles]
    for position, index in enumerate(order):
        distances = [_distance(rows[position], single[0], drawn) if single else math.inf for single in alone]
        if distances[index] > min(distances):
            found = order.index(int(np.argmin(distances)))
            raise ValueError(_MOVED.format(collator=_name(data_collator), given=found, returned=position))


def _check_packed(data_collator, singles: list, order: list, batch: dict, drawn: set) -> None:
    """A packing collator's one row must be the rows collated alone, concatenated in the order given (compared on
    the tokens, labels and positions it does not draw at random; an index of each token's example, such as
    `seq_idx`, counts from 0 in every single and is not compared)."""
    for key, value in batch.items():
        if key in drawn or key not in _PACKED_KEYS or not (torch.is_tensor(value) and value.dim() == 2
                                                           and value.shape[0] == 1):
            continue
        parts = [singles[i].get(key) for i in order]
        if all(torch.is_tensor(p) and p.dim() == 2 for p in parts) and not torch.equal(torch.cat(parts, 1), value):
            raise ValueError(_MOVED_PACKED.format(collator=_name(data_collator), key=key))


def _row_values(features: dict, count: int) -> list | None:
    """Per row, `{key: 1-D values at its real positions}` for the tensors with `count` rows (positions where the
    attention mask is 1, when there is one of the same shape); `None` when no tensor has `count` rows."""
    tensors = {k: v for k, v in features.items() if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == count}
    if not tensors:
        return None
    mask = tensors.get("attention_mask")
    rows = []
    for row in range(count):
        values = {}
        for key, value in tensors.items():
            item = value[row]
            if mask is not None and mask.dim() == 2 and item.shape[:1] == mask.shape[1:]:
                item = item[mask[row].bool()]
            values[key] = item.reshape(-1).cpu()
        rows.append(values)
    return rows


def _distance(row: dict, single: dict, drawn: set) -> float:
    """Mismatched values between a batch row and a row collated alone, over their common keys (only the length of a
    key in `drawn`); with an attention mask the real lengths must agree, without one a batch row may be longer
    (padding): the single is aligned to its start or its end, whichever matches best."""
    total = 0
    for key in row.keys() & single.keys():
        a, b = row[key], single[key]
        if "attention_mask" in row and a.numel() != b.numel():
            return math.inf
        if key in drawn:
            continue
        if a.shape == b.shape:
            total += int((a != b).sum())
        elif a.numel() > b.numel():
            width = b.numel()
            total += min(int((a[:width] != b).sum()), int((a[-width:] != b).sum()))
        else:
            total += b.numel()
    return total


def _distinct_examples(dataset, rows: int, scan: int) -> list[dict]:
    """Up to `rows` rows of the first `scan`, rows of lengths not seen yet first, as the dicts a collator receives."""
    first = dataset[: min(len(dataset), scan)]
    examples = [dict(zip(first, values)) for values in zip(*first.values())]
    lengths, chosen, rest = set(), [], []
    for example in examples:
        length = next((len(v) for v in example.values() if isinstance(v, (list, tuple))), None)
        (rest if length in lengths else chosen).append(example)
        lengths.add(length)
    return (chosen + rest)[:rows]


_PACKED_KEYS = ("input_ids", "labels", "position_ids")
_MOVED = ("The data collator ({collator}) returned the row given at position {given} at position {returned}: it "
          "changes the order of a batch's rows (reversed, sorted or shuffled), and DP training matches each row to "
          "its user by position, so rows would be clipped under other users. Make the collator keep the order of the "
          "examples it receives (sort or shuffle the dataset before training instead).")
_MOVED_PACKED = ("The data collator ({collator}) packed the rows it was given in another order ({key!r} is not the "
                 "rows concatenated in order): DP training matches each packed example to its user by position, so "
                 "examples would be clipped under other users. Make the collator keep the order of the examples it "
                 "receives.")


def _name(data_collator) -> str:
    return getattr(data_collator, "__name__", None) or type(data_collator).__name__
