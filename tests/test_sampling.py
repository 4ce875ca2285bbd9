"""hf_dp.sampling: every unit independently with probability q at every step, the same draw on every rank, each rank
its disjoint share."""

from __future__ import annotations

import numpy as np
from scipy import stats

from hf_dp.sampling import PoissonBatchSampler, poisson_sample


# ---- the sampled sizes follow the binomial; ranks split the sample ------------------------------------------------


def test_poisson_batch_sizes_follow_the_binomial():
    num_units, q, steps = 200, 0.05, 2000
    sizes = np.array([s.total for s in PoissonBatchSampler(num_units, q, steps, seed=7)])
    assert (sizes == 0).sum() >= 0  # empty batches are legal
    observed = np.bincount(sizes, minlength=num_units + 1)
    expected = stats.binom.pmf(np.arange(num_units + 1), num_units, q) * steps
    keep = expected >= 5  # chi-square validity; pool the tails
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    # Two ranks split the same sample: their shares are disjoint and cover it.
    rank0 = list(PoissonBatchSampler(num_units, q, 50, seed=7, rank=0, world_size=2))
    rank1 = list(PoissonBatchSampler(num_units, q, 50, seed=7, rank=1, world_size=2))
    single = list(PoissonBatchSampler(num_units, q, 50, seed=7))
    for a, b, whole in zip(rank0, rank1, single):
        assert sorted(np.concatenate([a.units, b.units]).tolist()) == whole.units.tolist()


# ---- each unit is drawn independently with probability q ----------------------------------------------------------


def test_each_unit_is_in_a_step_with_probability_q_whatever_the_other_units_and_steps():
    num_units, q, steps = 400, 0.1, 500
    draws = np.zeros((steps, num_units), dtype=bool)
    for step in range(steps):
        draws[step, poisson_sample(num_units, q, seed=11, step=step)] = True
    # Marginal: each unit's count over the steps is Binomial(steps, q) (every unit within 5 sigma; the pooled rate
    # within 4 sigma of q).
    counts = draws.sum(axis=0)
    sigma = np.sqrt(steps * q * (1 - q))
    assert np.abs(counts - steps * q).max() < 5 * sigma
    assert abs(draws.mean() - q) < 4 * np.sqrt(q * (1 - q) / draws.size)
    # Independent across units: sample sizes have the binomial variance N q (1 - q) (positively correlated units
    # would inflate it, a fixed-size batch would have none); chi-square interval on the sample variance.
    sizes = draws.sum(axis=1)
    ratio = sizes.var(ddof=1) / (num_units * q * (1 - q))
    low, high = stats.chi2.ppf([1e-4, 1 - 1e-4], steps - 1) / (steps - 1)
    assert low < ratio < high
    # Independent across steps: two consecutive samples share Binomial(N, q²) units.
    overlaps = (draws[1:] & draws[:-1]).sum(axis=1)
    expected = num_units * q * q
    assert abs(overlaps.mean() - expected) < 4 * np.sqrt(expected * (1 - q * q) / len(overlaps))


def test_a_steps_draw_depends_only_on_the_seed_and_the_step():
    first = poisson_sample(1000, 0.05, seed=3, step=17)
    assert np.array_equal(first, poisson_sample(1000, 0.05, seed=3, step=17))  # every rank draws the same
    assert np.all(np.diff(first) > 0)  # sorted, no unit twice
    assert not np.array_equal(first, poisson_sample(1000, 0.05, seed=3, step=18))
    assert not np.array_equal(first, poisson_sample(1000, 0.05, seed=4, step=17))
    assert len(poisson_sample(50, 1.0, seed=0, step=0)) == 50
    # A resumed run (start_step) draws exactly the steps the uninterrupted run would have drawn.
    whole = list(PoissonBatchSampler(300, 0.05, 20, seed=8))
    resumed = list(PoissonBatchSampler(300, 0.05, 20, seed=8, start_step=12))
    assert [s.step for s in resumed] == list(range(12, 20))
    for a, b in zip(whole[12:], resumed):
        assert np.array_equal(a.units, b.units) and a.total == b.total


def test_iteration_stops_at_the_first_step_the_budget_refuses():
    asked = []

    def within_budget(step):
        asked.append(step)
        return step < 3

    sampler = PoissonBatchSampler(100, 0.1, 10, seed=1, within_budget=within_budget)
    assert len(sampler) == 10
    assert [s.step for s in sampler] == [0, 1, 2]
    assert asked == [0, 1, 2, 3]  # asked before each draw; nothing drawn after the refusal
