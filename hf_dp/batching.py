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
        padding: a pass that only keeps the ranks in step (FSDP2): one row with loss weight 0, so its gradient is
            exactly zero and nothing of it is released.
    """

    features: dict
    units: UnitIndex | None = None
    loss_weights: torch.Tensor | None = None
    num_examples: int | None = None
    padding: bool = False


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
        redraw ([`~hf_dp.data.RowRedraw`], *optional*): draws the rows a sampled user trains on at each step (among
            `unit_rows`); `None`: all of `unit_rows`.
        data_collator: turns a list of row dicts into model features.
        micro_batch_size (`int`): rows per physical micro-batch (a user with more rows goes alone).
        align_passes (`bool`): give every rank as many passes as the rank with the most (padding passes), as
            sharded training (FSDP2) needs: its collectives run in every forward and backward pass.
    """

    def __init__(self, dataset, unit_rows, data_collator, micro_batch_size: int, align_passes: bool = False,
                 redraw=None):
        self.dataset = dataset
        self.unit_rows = unit_rows
        self.redraw = redraw
        self.data_collator = data_collator
        self.micro_batch_size = micro_batch_size
        self.align_passes = align_passes

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, sampled: SampledUnits) -> LogicalBatch:
        batch = LogicalBatch(step=sampled.step, total_units=sampled.total)
        if self.unit_rows is None:
            for part in self._groups(sampled.units):
                batch.micro_batches.append(MicroBatch(self._collate([int(r) for r in part]), num_examples=len(part)))
        else:
            for group in self._groups(sampled.units):
                batch.micro_batches.append(self._user_micro_batch([self._rows(unit, sampled.step) for unit in group]))
        if self.align_passes:  # every rank's passes are known on the host: they all draw the same sample
            passes = max(len(self._groups(share)) for share in sampled.shares)
            while len(batch.micro_batches) < passes:
                batch.micro_batches.append(MicroBatch(self._collate([0]), loss_weights=torch.zeros(1),
                                                      num_examples=1, padding=True))
        return batch

    def _groups(self, units) -> list[list]:
        """`units` in the fewest balanced passes of at most `micro_batch_size` rows (a user whole)."""
        if self.unit_rows is None:
            sizes = [1] * len(units)
        else:
            size = len if self.redraw is None else self.redraw.size
            sizes = [size(self.unit_rows[unit]) for unit in units]
        return _balanced(list(units), sizes, math.ceil(sum(sizes) / self.micro_batch_size))

    def _rows(self, unit: int, step: int):
        """The rows user `unit` trains on at `step`."""
        rows = self.unit_rows[unit]
        return rows if self.redraw is None else self.redraw.rows(unit, rows, step)

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
