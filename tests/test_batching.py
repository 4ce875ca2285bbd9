"""`hf_dp/batching.py`: passes sized for a Poisson batch (one pass per step at the defaults), balanced splits."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import poisson
from trainer_fixtures import make_trainer, tiny_llama, user_dataset

from datasets import Dataset

from hf_dp.batching import LogicalBatches, _balanced, poisson_capacity
from hf_dp.sampling import SampledUnits, poisson_sample


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


def _rows_collator(examples: list[dict]) -> dict:
    return {"row": [example["row"] for example in examples]}


def test_a_logical_batch_holds_the_sampled_users_whole_with_their_mean_loss_weights():
    dataset = Dataset.from_dict({"row": [f"r{i}" for i in range(10)]})
    unit_rows = [np.array([0, 1, 2]), np.array([3]), np.array([4, 5]), np.array([6, 7, 8, 9])]
    batches = LogicalBatches(dataset, unit_rows=unit_rows, data_collator=_rows_collator, micro_batch_size=4)
    batch = batches[SampledUnits(step=5, units=np.array([0, 2, 3]), total=3)]
    assert (batch.step, batch.total_units) == (5, 3)
    rows = [row for micro in batch.micro_batches for row in micro.features["row"]]
    assert rows == ["r0", "r1", "r2", "r4", "r5", "r6", "r7", "r8", "r9"]  # the sampled users' rows, in order
    for micro in batch.micro_batches:
        counts = micro.units.counts.tolist()
        assert micro.num_examples == sum(counts) == len(micro.features["row"])
        assert micro.loss_weights.tolist() == pytest.approx([1 / n for n in counts for _ in range(n)])
    assert [micro.units.counts.tolist() for micro in batch.micro_batches] == [[3], [2], [4]]  # users never split
    assert batches[SampledUnits(step=6, units=np.array([], dtype=int), total=0)].micro_batches == []


def test_a_logical_batch_of_rows_collates_the_sampled_rows():
    dataset = Dataset.from_dict({"row": [f"r{i}" for i in range(10)]})
    batches = LogicalBatches(dataset, unit_rows=None, data_collator=_rows_collator, micro_batch_size=3)
    batch = batches[SampledUnits(step=0, units=np.array([1, 4, 5, 8, 9]), total=5)]
    assert [micro.features["row"] for micro in batch.micro_batches] == [["r1", "r4", "r5"], ["r8", "r9"]]
    assert all(micro.units is None and micro.loss_weights is None for micro in batch.micro_batches)


@pytest.mark.parametrize("unit_rows", [None, [np.array([0, 1, 2]), np.array([3]), np.array([4, 5]), np.array([6])]],
                         ids=["rows", "users"])
def test_sharded_ranks_get_as_many_passes_as_the_busiest_with_zero_weight_padding(unit_rows):
    """FSDP2 runs collectives in every pass: a rank with fewer (or no) units pads with one-row passes of loss
    weight 0 up to the busiest rank's count, computed on the host from every rank's share."""
    dataset = Dataset.from_dict({"row": [f"r{i}" for i in range(10)]})
    batches = LogicalBatches(dataset, unit_rows=unit_rows, data_collator=_rows_collator, micro_batch_size=2,
                             align_passes=True)
    shares = (np.array([0, 1, 2]), np.array([], dtype=int))
    busy, idle = (batches[SampledUnits(step=1, units=share, total=3, shares=shares)] for share in shares)
    assert len(busy.micro_batches) == len(idle.micro_batches) >= 2
    assert not any(micro.padding for micro in busy.micro_batches)
    for micro in idle.micro_batches:
        assert micro.padding and micro.num_examples == 1 and micro.loss_weights.tolist() == [0.0]
    unaligned = LogicalBatches(dataset, unit_rows=unit_rows, data_collator=_rows_collator, micro_batch_size=2)
    assert unaligned[SampledUnits(step=1, units=shares[1], total=3, shares=shares)].micro_batches == []
