"""`hf_dp/batching.py`: passes sized for a Poisson batch (one pass per step at the defaults), balanced splits."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import poisson
from trainer_fixtures import make_trainer, tiny_llama, user_dataset

from hf_dp.batching import _balanced, poisson_capacity
from hf_dp.sampling import poisson_sample


@pytest.mark.parametrize("expected, rows, world", [(8, 2, 1), (64, 4, 1), (64, 1, 2), (1000, 1, 8)])
def test_capacity_holds_all_but_a_thousandth_of_the_samples(expected, rows, world):
    capacity = poisson_capacity(expected, rows, world_size=world)
    units_per_rank = capacity // rows
    # The share of one rank of a Binomial(N, expected/N) sample overflows it at most ~1e-3 of the time.
    num_units = 50 * expected
    sizes = np.array([len(poisson_sample(num_units, expected / num_units, seed=1, step=t)) for t in range(4000)])
    overflow = np.mean(np.ceil(sizes / world) > units_per_rank)
    assert overflow <= 3e-3
    assert poisson.sf(units_per_rank * world, expected) <= 1e-3  # from the tail, not an arbitrary margin
    assert capacity < 2 * rows * (expected / world) + 10 * rows * np.sqrt(expected)  # and not wastefully large


def test_balanced_splits_keep_units_whole_and_in_order():
    units, sizes = list("abcdefg"), [1, 2, 3, 1, 1, 2, 3]
    groups = _balanced(units, sizes, passes=2)
    assert [u for group in groups for u in group] == units
    totals = [sum(sizes[units.index(u)] for u in group) for group in groups]
    assert totals == [7, 6]
    assert _balanced([], [], 3) == []
    assert _balanced(["big", "x"], [10, 1], 2) == [["big"], ["x"]]  # a unit larger than the share goes alone


@pytest.mark.parametrize("overrides", [dict(sampling="uls", contribution_bound=3),
                                       dict(sampling="els", contribution_bound=3), dict(privacy_unit="example")],
                         ids=["uls", "els", "example"])
def test_a_step_is_one_pass_at_the_default_micro_batch(tmp_path, overrides):
    trainer = make_trainer(tmp_path, model=tiny_llama(), dataset=user_dataset(200, causal_lm=True),
                           per_device_train_batch_size=None, expected_batch_size=8, max_steps=60, **overrides)
    rows = 3 if overrides.get("sampling") == "uls" else 1
    assert trainer.args.per_device_train_batch_size == poisson_capacity(8, rows)
    passes = [len(batch.micro_batches) for batch in trainer.get_train_dataloader()]
    assert len(passes) == 60 and max(passes) == 1


def test_a_sample_above_a_set_micro_batch_takes_balanced_passes(tmp_path):
    trainer = make_trainer(tmp_path, model=tiny_llama(), dataset=user_dataset(200, causal_lm=True), sampling="els",
                           contribution_bound=3, per_device_train_batch_size=5, expected_batch_size=12, max_steps=10)
    for batch in trainer.get_train_dataloader():
        sizes = [micro.num_examples for micro in batch.micro_batches]
        assert max(sizes) <= 5 and len(sizes) == -(-sum(sizes) // 5)
        assert max(sizes) - min(sizes) <= 1
