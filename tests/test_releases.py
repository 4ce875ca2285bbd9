"""hf_dp.releases: the step's bounded sums, and the noise each scalar release gets (the same on every rank)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_dp.clipping.adaptive import QuantileTracker
from hf_dp.privacy_plan import PrivacyPlan
from hf_dp.releases import ScalarReleases, StepSums

# q·N = 0.1 · 100 = 10 expected units per step; σ_log = 2.
PLAN = PrivacyPlan("uls", num_units=100, num_privacy_units=100, sample_rate=0.1, steps=10, noise_multiplier=1.0,
                   delta=1e-3, contribution_bound=None, logging_noise_multiplier=2.0, effective_noise_multiplier=0.9)
QUIET = PrivacyPlan(**{**PLAN.__dict__, "logging_noise_multiplier": None})


def sums_of(losses, norms, max_grad_norm=1.0, max_loss=5.0) -> StepSums:
    sums = StepSums("cpu")
    sums.add(torch.tensor(losses), torch.tensor(norms), max_grad_norm, max_loss)
    return sums


# ---- each unit moves each sum by at most its sensitivity ----------------------------------------------------------


def test_step_sums_bound_each_units_loss_and_count_the_clipped_and_unclipped_units():
    sums = sums_of([1.0, 7.0, -2.0, float("nan")], [0.5, 2.0, 1.0, 3.0])
    # losses clipped to [0, max_loss], a NaN counted as max_loss: 1 + 5 + 0 + 5
    assert sums.loss_sum.item() == 11.0
    assert sums.clipped_units.item() == 2  # norms above C (a norm equal to C is not clipped)
    assert sums.centered_unclipped.item() == (1 + 0 + 1 + 0) - 4 / 2  # Σ (1[norm ≤ C] − ½)
    sums.add(torch.tensor([3.0]), torch.tensor([0.1]), 1.0, 5.0)  # a second micro-batch adds to the same sums
    assert sums.values.tolist() == [14.0, 2.0, 0.5] and sums.values.dtype == torch.float64
    view = sums.loss_sum_and_clipped_units
    assert view.tolist() == [14.0, 2.0] and view.data_ptr() == sums.values.data_ptr()  # one tensor, no copy


def test_a_device_tensor_clipping_norm_counts_as_the_float():
    as_float = sums_of([1.0, 2.0, 3.0], [0.2, 0.6, 0.9], max_grad_norm=0.5)
    as_tensor = sums_of([1.0, 2.0, 3.0], [0.2, 0.6, 0.9], max_grad_norm=torch.tensor(0.5, dtype=torch.float64))
    assert torch.equal(as_float.values, as_tensor.values)


# ---- the noise of each release ---------------------------------------------------------------------------------------


def test_fixed_norm_releases_add_the_planned_noise_to_the_loss_and_the_clipped_count():
    """Over many steps the released loss sum and clipped count scatter around the true ones with std σ_log·max_loss
    and σ_log, and the logged clipped fraction is the noised count over the expected batch size."""
    releases = ScalarReleases(PLAN, max_loss=5.0, seed=7)
    steps = 3000
    losses, fractions = [], []
    for step in range(steps):
        losses.append(releases.release(sums_of([1.0, 2.0, 4.0], [0.5, 2.0, 3.0]), step, None).item())
        fractions.append(releases.take_clipped_fraction())
    loss_noise, count_noise = np.array(losses) - 7.0, np.array(fractions) * 10 - 2.0
    for noise, std in ((loss_noise, 2.0 * 5.0), (count_noise, 2.0)):
        assert noise.std() == pytest.approx(std, rel=0.06)
        assert abs(noise.mean()) < 4 * std / np.sqrt(steps)
    assert abs(np.corrcoef(loss_noise, count_noise)[0, 1]) < 0.1  # independent draws


def test_every_rank_adds_the_same_noise_and_each_step_its_own():
    sums = sums_of([1.0, 2.0], [0.5, 2.0])
    a, b = ScalarReleases(PLAN, 5.0, seed=3), ScalarReleases(PLAN, 5.0, seed=3)
    assert a.release(sums, 4, None).item() == b.release(sums, 4, None).item()
    assert a.release(sums, 5, None).item() != a.release(sums, 4, None).item()
    assert ScalarReleases(PLAN, 5.0, seed=4).release(sums, 4, None).item() != b.release(sums, 4, None).item()


def test_the_clipped_fraction_is_the_mean_since_the_last_log_line():
    releases = ScalarReleases(PLAN, max_loss=5.0, seed=1)
    assert releases.take_clipped_fraction() is None  # nothing released yet
    per_step = []
    for step in range(3):
        releases.release(sums_of([1.0], [2.0]), step, None)
        single = ScalarReleases(PLAN, max_loss=5.0, seed=1)
        single.release(sums_of([1.0], [2.0]), step, None)
        per_step.append(single.take_clipped_fraction())
    assert releases.take_clipped_fraction() == pytest.approx(np.mean(per_step))
    assert releases.take_clipped_fraction() is None  # taken: reset


def test_without_private_logging_a_fixed_norm_step_releases_nothing():
    releases = ScalarReleases(QUIET, max_loss=5.0, seed=1)
    assert releases.release(sums_of([1.0], [2.0]), 0, None) is None
    assert releases.take_clipped_fraction() is None


@pytest.mark.parametrize("plan", [PLAN, QUIET], ids=["private-logging", "no-logging"])
def test_adaptive_clipping_releases_the_centred_count_and_moves_c(plan):
    adaptive = PrivacyPlan(**{**plan.__dict__, "count_noise": 0.5})
    tracker = QuantileTracker(target_quantile=0.5, learning_rate=0.2, count_noise=0.5, norm=1.0)
    releases = ScalarReleases(adaptive, max_loss=5.0, seed=2)
    sums = sums_of([1.0, 2.0, 9.0], [0.5, 2.0, 3.0])  # centred count (1 − 1.5) = −0.5: most units clipped
    loss_sum = releases.release(sums, 0, tracker)
    fraction = releases.take_clipped_fraction()
    released_count = (0.5 - fraction) * 10  # the logged fraction is ½ − R/m
    assert tracker.steps == 1
    assert tracker.norm == pytest.approx(np.exp(-0.2 * (min(1, max(0, released_count / 10 + 0.5)) - 0.5)))
    assert released_count != -0.5 and abs(released_count + 0.5) < 6 * 0.5  # the count, noised with σ_b
    if plan is PLAN:
        assert loss_sum.item() != 8.0 and abs(loss_sum.item() - 8.0) < 6 * 10.0  # noised with σ_log·max_loss
    else:
        assert loss_sum is None


def test_the_adaptive_count_noise_has_std_sigma_b():
    adaptive = PrivacyPlan(**{**QUIET.__dict__, "count_noise": 0.5})
    sums = sums_of([1.0, 2.0], [0.5, 2.0])  # centred count 0
    counts = []
    for step in range(3000):
        tracker = QuantileTracker(target_quantile=0.5, learning_rate=0.2, count_noise=0.5, norm=1.0)
        releases = ScalarReleases(adaptive, max_loss=5.0, seed=5)
        releases.release(sums, step, tracker)
        counts.append((0.5 - releases.take_clipped_fraction()) * 10)
    assert np.std(counts) == pytest.approx(0.5, rel=0.06) and abs(np.mean(counts)) < 4 * 0.5 / np.sqrt(3000)
