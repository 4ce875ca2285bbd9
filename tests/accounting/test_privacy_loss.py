"""hf_dp.accounting.privacy_loss: the mixture-of-Gaussians privacy loss random variable, per direction and against
dp-accounting and prv-accountant's Poisson-subsampled Gaussian; its distribution, RDP and truncated mean."""
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution
from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

from hf_dp.accounting import MixtureOfGaussiansPRV
from pld_reference import DELTA, assert_matches_reference, binomial


def test_each_direction_matches_dp_accounting():
    """The MoG privacy random variable, run through prv-accountant's own unmodified
    PRVAccountant, gives dp-accounting's ε for the remove and the add direction separately."""
    sample_rate, noise_multiplier, group_size, steps = 0.05, 1.5, 4, 200
    sensitivities, probs = binomial(group_size, sample_rate)
    pld = privacy_loss_distribution.from_mixture_gaussian_mechanism(
        noise_multiplier, sensitivities, probs, value_discretization_interval=1e-3).self_compose(steps)
    # dp-accounting keeps one distribution per direction (private attributes, test-only use)
    references = {"remove": pld._pmf_remove.get_epsilon_for_delta(DELTA),
                  "add": pld._pmf_add.get_epsilon_for_delta(DELTA)}
    assert references["remove"] != pytest.approx(references["add"], rel=1e-3)  # the directions differ
    for direction, reference in references.items():
        prv = MixtureOfGaussiansPRV(sample_rate, noise_multiplier, group_size, direction)
        acc = PRVAccountant(prvs=[prv], max_self_compositions=[steps], eps_error=0.01, delta_error=DELTA / 1000)
        assert_matches_reference(acc.compute_epsilon(delta=DELTA, num_self_compositions=[steps]), reference)


def test_group_size_one_is_the_poisson_subsampled_gaussian():
    for sample_rate, noise_multiplier, steps in [(0.01, 1.0, 500), (0.5, 0.7, 10), (1e-3, 5.0, 500)]:
        mog = MixtureOfGaussiansPRV(sample_rate, noise_multiplier, 1, "remove")
        plain = PoissonSubsampledGaussianMechanism(sample_rate, noise_multiplier)
        t = np.linspace(math.log1p(-sample_rate) - 0.5, 12.0, 20001)
        np.testing.assert_allclose(mog.cdf(t), np.asarray(plain.cdf(t.astype(np.longdouble)), dtype=float),
                                   rtol=0, atol=1e-14)
        for order in (1.5, 2.0, 3.7, 10.0, 32.0, 63.0):
            assert mog.rdp(order) == pytest.approx(float(plain.rdp(order)), rel=1e-7)
        # the same ε through prv-accountant's own accountant
        eps = [PRVAccountant(prvs=[prv], max_self_compositions=[steps], eps_error=0.05,
                             delta_error=DELTA / 1000).compute_epsilon(DELTA, [steps]) for prv in (mog, plain)]
        np.testing.assert_allclose(eps[0], eps[1], rtol=1e-8, atol=1e-9)


def test_distribution_of_the_loss():
    """CDF and survival function agree, point by point and on arrays, and the cells' masses add up."""
    for group_size, sample_rate, noise_multiplier in [(32, 0.01, 1.0), (8, 0.3, 2.0), (4, 1.0, 0.7)]:
        for direction in ("remove", "add"):
            prv = MixtureOfGaussiansPRV(sample_rate, noise_multiplier, group_size, direction)
            x = np.linspace(-5.0, group_size + 5.0, 4001)
            np.testing.assert_allclose(prv.inverse_privacy_loss(prv.privacy_loss(x)), x, rtol=1e-9, atol=1e-9)
            t = np.linspace(-30, 30, 6001)
            cdf, sf = prv.cdf(t), prv.sf(t)
            assert np.all(np.diff(cdf) >= 0)
            np.testing.assert_allclose(cdf + sf, 1.0, atol=1e-15)
            np.testing.assert_allclose([prv.cdf(float(v)) for v in t[::600]], cdf[::600], atol=1e-15)
            np.testing.assert_allclose(prv.probability(t[:-1], t[1:]).sum(), cdf[-1] - cdf[0], atol=1e-13)


@pytest.mark.parametrize("sample_rate, noise_multiplier, group_size", [
    (1e-4, 0.4, 1), (1e-6, 0.3, 1), (0.5, 0.7, 1), (1.0, 2.0, 1), (3e-5, 0.5, 4), (0.01, 1.0, 32), (0.3, 5.0, 256)])
@pytest.mark.parametrize("direction", ["remove", "add"])
def test_truncated_mean_agrees_with_adaptive_quadrature(sample_rate, noise_multiplier, group_size, direction):
    """The mean that the certificate rests on: Gauss–Legendre in input space against QUADPACK,
    including where all the mass sits in one mesh cell (q ≤ 1e-4)."""
    prv = MixtureOfGaussiansPRV(sample_rate, noise_multiplier, group_size, direction)
    lo, hi = -15.0, 15.0
    adaptive, error = prv.loss_moment_adaptive(lo, hi)
    assert error < 1e-13
    assert prv.loss_moment(lo, hi) == pytest.approx(adaptive, abs=1e-13, rel=1e-10)
    assert prv.loss_moment(lo, hi, panel=0.5) == pytest.approx(adaptive, abs=1e-13, rel=1e-10)


def test_mean_of_the_many_users_corner_is_not_a_mesh_rule():
    """At q=1e-4, σ=0.4 the mean privacy loss is +1.70e-6 (remove) and +1.40e-6 (add): both are
    KL divergences, so positive (a rule on the loss mesh gave −3.35e-6 and −1.5e-4)."""
    for direction, expected in (("remove", 1.6973e-6), ("add", 1.4015e-6)):
        prv = MixtureOfGaussiansPRV(1e-4, 0.4, 1, direction)
        assert prv.loss_moment(-40.0, 40.0) == pytest.approx(expected, rel=1e-3)
