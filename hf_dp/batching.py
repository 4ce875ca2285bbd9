"""Logical batches: the sampled units of one step, packed into physical micro-batches.

A unit never straddles two micro-batches: its gradient is clipped as a whole inside one
backward pass. The logical batch may exceed memory; micro-batches bound it.

A Poisson batch has a random size, so a capacity equal to its *expected* size spills into a second pass in
about 40 % of steps. [`poisson_capacity`] sizes a pass from the tail of the sampled size instead (the default
of `per_device_train_batch_size`), and a sample that does exceed the capacity is split into the fewest passes
of balanced sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from scipy.stats import poisson

from .clipping.units import UnitIndex
from .sampling import SampledUnits


@dataclass
class MicroBatch:
    """Collated features of whole units.

    Attributes:
        features: the data collator's output (labels included).
        units: which rows form each unit (a user's rows are consecutive), built on the host; `None` when every row
            is its own unit. The clipping engine reads it without touching the device.
        loss_weights: `(B,)` multiplier of each row's loss: `1 / n_u` for ULS, so a unit's gradient is the
            gradient of its rows' *mean* loss; `None` for weight 1.
        num_examples: the dataset rows collated (B). A packing collator (`DataCollatorWithFlattening`) puts them
            all in one row of `features`; the trainer then finds them again from `position_ids`.
    """

    features: dict
    units: UnitIndex | None = None
    loss_weights: torch.Tensor | None = None
    num_examples: int | None = None


@dataclass
class LogicalBatch:
    """One optimizer step's data on this rank; `total_units` counts the sample over all ranks."""

    step: int
    total_units: int
    micro_batches: list = field(default_factory=list)


class LogicalBatches(torch.utils.data.Dataset):
    """Maps a step's [`~hf_dp.sampling.SampledUnits`] to a [`LogicalBatch`] (used as a DataLoader's dataset).

    Args:
        dataset: training rows (a `datasets.Dataset` without the user column).
        unit_rows (`list`, *optional*): rows of each unit, when units are users (ULS); `None` when a unit is a row.
        data_collator: turns a list of row dicts into model features.
        micro_batch_size (`int`): rows per physical micro-batch (a user with more rows goes alone).
    """

    def __init__(self, dataset, unit_rows, data_collator, micro_batch_size: int):
        self.dataset = dataset
        self.unit_rows = unit_rows
        self.data_collator = data_collator
        self.micro_batch_size = micro_batch_size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, sampled: SampledUnits) -> LogicalBatch:
        batch = LogicalBatch(step=sampled.step, total_units=sampled.total)
        if self.unit_rows is None:
            rows = [int(r) for r in sampled.units]
            passes = math.ceil(len(rows) / self.micro_batch_size)
            for part in _balanced(rows, [1] * len(rows), passes):
                batch.micro_batches.append(MicroBatch(self._collate(part), num_examples=len(part)))
            return batch
        users = [self.unit_rows[unit] for unit in sampled.units]
        sizes = [len(rows) for rows in users]
        passes = math.ceil(sum(sizes) / self.micro_batch_size)
        for group in _balanced(users, sizes, passes):
            batch.micro_batches.append(self._user_micro_batch(group))
        return batch

    def _user_micro_batch(self, users) -> MicroBatch:
        rows = [int(r) for user_rows in users for r in user_rows]
        loss_weights = torch.cat([torch.full((len(r),), 1.0 / len(r)) for r in users])
        return MicroBatch(self._collate(rows), units=UnitIndex.from_counts([len(r) for r in users]),
                          loss_weights=loss_weights, num_examples=len(rows))

    def _collate(self, rows: list) -> dict:
        columns = self.dataset[rows]
        examples = [dict(zip(columns, values)) for values in zip(*columns.values())]
        return self.data_collator(examples)


def identity(batch):
    """DataLoader collate_fn: batches are built by [`LogicalBatches`] already (picklable for workers)."""
    return batch


def poisson_capacity(expected_units: float, rows_per_unit: int = 1, world_size: int = 1,
                     spill_probability: float = 1e-3) -> int:
    """Rows a physical pass must hold so that a rank's share of a step's Poisson sample fits in one pass in all but
    `spill_probability` of the steps.

    The sampled size is Binomial(N, q) with mean `expected_units`; the Poisson quantile of the same mean bounds its
    quantile from above (a Poisson has the larger variance), and depends on nothing but public settings. Each unit
    counts `rows_per_unit` rows (the contribution bound G for ULS, 1 for a row), and the sample is split evenly
    over `world_size` ranks.
    """
    units = poisson.ppf(1.0 - spill_probability, expected_units)
    return max(1, math.ceil(units / world_size)) * max(1, int(rows_per_unit))


def _balanced(units: list, sizes: list[int], passes: int) -> list[list]:
    """`units` in order, in about `passes` consecutive groups of balanced total size (a unit whole): each group
    takes its share of what is left, so sizes differ by at most one row when units are rows."""
    groups, group, filled, left = [], [], 0, sum(sizes)
    target = math.ceil(left / max(1, passes))
    for unit, size in zip(units, sizes):
        if group and filled + size > target:
            groups.append(group)
            left -= filled
            group, filled = [], 0
            target = math.ceil(left / max(1, passes - len(groups)))
        group.append(unit)
        filled += size
    return groups + [group] if group else groups
