"""`hf_dp/clipping/units.py`: `UnitIndex`: which examples form which unit, known on the host."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_dp.clipping.units import UnitIndex


def test_units_are_ordered_by_sorted_id_and_read_on_the_host():
    units = UnitIndex(torch.tensor([5, 2, 5, 9, 2, 2]), 6)
    assert units.num_units == 3 and units.inverse.tolist() == [1, 0, 1, 2, 0, 0]
    assert units.counts.tolist() == [3, 2, 1] and not units.identity and units.group_size is None
    assert UnitIndex([7, 7, 8], 3).inverse.tolist() == [0, 0, 1]  # a list works too


def test_one_example_per_unit_and_equal_consecutive_units_need_no_index():
    identity = UnitIndex(None, 4)
    assert identity.identity and identity.group_size == 1
    factor = torch.randn(4, 3, 2)
    assert identity.grouped(factor) is factor
    pairs = UnitIndex.from_counts([2, 2, 2])
    assert pairs.group_size == 2 and not pairs.identity
    factor = torch.randn(6, 3, 5)
    torch.testing.assert_close(pairs.grouped(factor), factor.reshape(3, 6, 5))
    torch.testing.assert_close(pairs.sum_examples(factor), factor.reshape(3, 2, 3, 5).sum(1))
    torch.testing.assert_close(pairs.example_weights(torch.tensor([1.0, 2.0, 3.0])),
                               torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0]))
    assert UnitIndex.from_counts([1, 3]).grouped(factor[:4]) is None


def test_uneven_units_go_through_example_pairs():
    units = UnitIndex(torch.tensor([0, 1, 0, 2, 1, 1]), 6)
    pairs = units.on("pairs", torch.device("cpu"))
    assert {(int(i), int(j)) for i, j in pairs[:2].T} == {
        (0, 0), (0, 2), (2, 2), (1, 1), (1, 4), (1, 5), (4, 4), (4, 5), (5, 5), (3, 3)}
    assert units.example_pairs_per_unit() == pytest.approx(3 + 6 + 1)
    per_example = torch.arange(6.0)[:, None]
    torch.testing.assert_close(units.sum_examples(per_example), torch.tensor([[2.0], [10.0], [3.0]]))
    assert units.on("pairs", torch.device("cpu")) is pairs  # built once


def test_bad_unit_ids_are_refused():
    with pytest.raises(ValueError, match="3 entries for a batch of 2"):
        UnitIndex(torch.tensor([0, 1, 2]), 2)
    with pytest.raises(TypeError, match="integer"):
        UnitIndex(torch.tensor([0.5, 1.0]), 2)
    assert UnitIndex(np.zeros(0, dtype=np.int64), 0).num_units == 0
