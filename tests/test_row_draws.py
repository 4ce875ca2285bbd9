"""hf_dp.row_draws: the rows every user keeps, computed for all users at once, are numpy's `default_rng(seed).choice(n,
size=G, replace=False)` exactly, including where numpy redraws (a rejected bounded draw) or tail-shuffles (a user
above 10,000 rows), and a vectorised copy that disagreed with numpy would be caught and replaced by numpy's draws."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from hf_dp import row_draws
from hf_dp.row_draws import choose_positions, numpy_positions


def _numpy(seeds, sizes, bound) -> np.ndarray:
    return np.array([np.sort(np.random.default_rng(int(s)).choice(int(n), size=bound, replace=False))
                     for s, n in zip(seeds, sizes)]).reshape(len(seeds), bound)


@pytest.mark.parametrize("bound", [1, 2, 3, 4, 7, 8, 33])
def test_every_users_positions_are_numpys(bound):
    rng = np.random.default_rng(bound)
    seeds = rng.integers(0, 2**64, size=600, dtype=np.uint64)
    seeds[:5] = [0, 1, 2**32 - 1, 2**32, 2**64 - 1]  # one or two 32-bit words of entropy
    sizes = rng.integers(bound + 1, bound + 80, size=600)
    sizes[:2] = [bound + 1, 10_001]  # the smallest population, and one above 10,000 drawn by Floyd's algorithm
    assert (choose_positions(seeds, sizes, bound) == _numpy(seeds, sizes, bound)).all()


def test_where_numpy_redraws_or_tail_shuffles_the_positions_are_still_numpys():
    # Seeds 2558 and 2739: numpy rejects their first draw among 2,000,000 rows (Lemire's method) and draws again.
    seeds = np.array([2558, 2739, 5, 6], dtype=np.uint64)
    sizes = np.array([2_000_000, 2_000_000, 2_000_000, 2_000_000])
    assert row_draws._floyd(seeds, sizes, 1)[1].tolist() == [True, True, False, False]  # the redraws are seen
    assert (choose_positions(seeds, sizes, 1) == _numpy(seeds, sizes, 1)).all()
    # above 10,000 rows with G > n // 50, numpy shuffles the tail instead of Floyd's algorithm
    seeds, sizes = np.array([11, 12], dtype=np.uint64), np.array([10_050, 11_999])
    assert row_draws._floyd(seeds, sizes, 240)[1].all()
    assert (choose_positions(seeds, sizes, 240) == _numpy(seeds, sizes, 240)).all()


def test_a_copy_that_disagrees_with_numpy_is_replaced_by_numpys_draws(monkeypatch, caplog):
    seeds, sizes = np.arange(1, 41, dtype=np.uint64), np.full(40, 9)
    def wrong(seeds, sizes, bound):  # the first G positions of every user, none left to numpy
        return np.tile(np.arange(bound), (len(seeds), 1)), np.zeros(len(seeds), bool)

    monkeypatch.setattr(row_draws, "_floyd", wrong)
    with caplog.at_level(logging.WARNING, logger="hf_dp.row_draws"):
        chosen = choose_positions(seeds, sizes, 3)
    assert "draws differently" in caplog.text
    assert (chosen == _numpy(seeds, sizes, 3)).all()
    assert (numpy_positions(7, 9, 3) == _numpy([7], [9], 3)[0]).all()
