"""hf_dp.accounting.renyi: the Rényi divergences of one step, per direction, against closed forms and each other."""
import pytest
from prv_accountant import PoissonSubsampledGaussianMechanism

from hf_dp.accounting.mixture_loss import MixtureLoss
from hf_dp.accounting.renyi import (RDP_ORDERS, add_divergences, remove_divergences, remove_divergences_fractional,
                                    remove_divergences_integer)


def test_rdp_quadrature_agrees_with_exact_orders():
    """The fractional orders' quadrature and the exact integer moments agree where both apply."""
    loss = MixtureLoss(0.02, 1.5, 16)
    quadrature = remove_divergences_fractional(loss, [2.0, 3.0, 7.0])
    exact = remove_divergences_integer(loss, [2, 3, 7])
    for order in (2.0, 3.0, 7.0):
        assert quadrature[order] == pytest.approx(exact[order], rel=1e-8)
    assert remove_divergences(loss, [2.5])[0] <= remove_divergences(loss, [3.0])[0]


def test_group_size_one_is_the_poisson_subsampled_gaussian():
    """G = 1, "remove": prv-accountant's own Poisson-subsampled Gaussian's RDP."""
    loss = MixtureLoss(0.01, 1.0, 1)
    plain = PoissonSubsampledGaussianMechanism(0.01, 1.0)
    orders = [1.5, 2.0, 3.7, 10.0, 32.0, 63.0]
    for order, value in zip(orders, remove_divergences(loss, orders)):
        assert value == pytest.approx(float(plain.rdp(order)), rel=1e-7)


def test_every_order_is_a_nonnegative_bound_and_grows_with_the_order():
    loss = MixtureLoss(0.05, 1.2, 4)
    for divergences in (remove_divergences, add_divergences):
        values = divergences(loss, RDP_ORDERS)
        assert all(v >= 0 for v in values)
        assert all(a <= b * (1 + 1e-9) for a, b in zip(values, values[1:]))  # D_α is non-decreasing in α
