"""hf_dp.accounting.mixture_loss: the privacy loss function L of one step and its inverse (Newton), on sorted
points (prv-accountant's mesh), unsorted points and single floats."""
import math

import numpy as np
import pytest

from hf_dp.accounting.mixture_loss import MixtureLoss, binomial_log_weights


def test_binomial_weights_are_the_binomial_distribution():
    from scipy.stats import binom

    np.testing.assert_allclose(np.exp(binomial_log_weights(7, 0.3)), binom.pmf(np.arange(8), 7, 0.3), rtol=1e-12)
    assert binomial_log_weights(3, 1.0)[0] == -math.inf  # q = 1: no user is left out


@pytest.mark.parametrize("group_size, sample_rate, noise_multiplier",
                         [(32, 0.01, 1.0), (8, 0.3, 2.0), (4, 1.0, 0.7), (1, 0.05, 1.0)])
def test_the_inverse_inverts_the_increasing_loss(group_size, sample_rate, noise_multiplier):
    loss = MixtureLoss(sample_rate, noise_multiplier, group_size)
    x = np.linspace(-5.0, group_size + 5.0, 4001)
    values = loss(x)
    assert np.all(np.diff(values) > 0)
    np.testing.assert_allclose(loss.inverse(values), x, rtol=1e-9, atol=1e-9)  # sorted: anchors + Hermite
    np.testing.assert_allclose(loss.inverse(values[::-1]), x[::-1], rtol=1e-9, atol=1e-9)  # descending
    shuffled = np.random.default_rng(0).permutation(x.size)
    np.testing.assert_allclose(loss.inverse(values[shuffled]), x[shuffled], rtol=1e-9, atol=1e-9)  # unsorted
    np.testing.assert_allclose([loss.inverse_scalar(float(v)) for v in values[::400]], x[::400],
                               rtol=1e-9, atol=1e-9)


def test_losses_below_the_range_invert_to_minus_infinity():
    loss = MixtureLoss(0.1, 1.0, 4)
    floor = 4 * math.log1p(-0.1)  # L(x) → G·log(1−q) as x → −∞
    assert np.all(loss.inverse([floor - 1.0, floor]) == -np.inf)
    assert loss.inverse_scalar(floor - 1.0) == -math.inf
    assert np.isfinite(loss.inverse(floor + 1e-6)[0])
