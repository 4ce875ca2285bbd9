"""Poisson sampling of privacy units: every unit independently with probability q, each step.

The accountant assumes exactly this (not shuffled fixed-size batches), so a logical batch has a
random size and may be empty. Step t's draw depends only on (seed, t): every rank draws the same
sample without communication, and a resumed run redraws the steps it skips identically.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

_SAMPLING_STREAM = 0


def step_generator(seed: int, step: int, stream: int) -> np.random.Generator:
    """An independent generator for one (seed, step, stream): sampling and noise use distinct streams."""
    return np.random.default_rng(np.random.SeedSequence([seed, step, stream]))


def poisson_sample(num_units: int, sample_rate: float, seed: int, step: int) -> np.ndarray:
    """Indices of the units sampled at `step`, each with probability `sample_rate`, sorted."""
    draws = step_generator(seed, step, _SAMPLING_STREAM).random(num_units)
    return np.flatnonzero(draws < sample_rate)


class PoissonBatchSampler:
    """Yields, for each step, this rank's share of the Poisson-sampled units.

    The sampled units are split across ranks round-robin, so their union over ranks is exactly the
    sample the accountant assumes; each rank also learns the total sampled size, for logging.

    Args:
        num_units (`int`): how many units (users for ULS, rows otherwise) there are.
        sample_rate (`float`): q, each unit's inclusion probability per step.
        steps (`int`): total logical batches (optimizer steps) in the run.
        seed (`int`): sampling seed, shared by all ranks.
        rank, world_size (`int`): this process's share.
        start_step (`int`): first step to yield (a resumed run starts where the ledger stopped).
        within_budget (`Callable[[int], bool]`, *optional*): asked before drawing each step; iteration ends at
            the first step for which it returns `False` (the privacy budget would be exceeded).
    """

    def __init__(self, num_units: int, sample_rate: float, steps: int, seed: int,
                 rank: int = 0, world_size: int = 1, start_step: int = 0,
                 within_budget: Callable[[int], bool] | None = None):
        self.num_units = num_units
        self.sample_rate = sample_rate
        self.steps = steps
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start_step = start_step
        self.within_budget = within_budget

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for step in range(self.start_step, self.steps):
            if self.within_budget is not None and not self.within_budget(step):
                return
            units = poisson_sample(self.num_units, self.sample_rate, self.seed, step)
            shares = tuple(units[rank :: self.world_size] for rank in range(self.world_size))
            yield SampledUnits(step=step, units=shares[self.rank], total=len(units), shares=shares)


class SampledUnits(NamedTuple):
    """One logical batch: this rank's units, the size of the whole sample, and every rank's units."""

    step: int
    units: np.ndarray
    total: int
    shares: tuple = ()
