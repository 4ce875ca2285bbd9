"""hf_dp.accounting.discretisation: prv-accountant's routine reimplemented for speed, and the guard on the mean."""
import numpy as np
import pytest

from hf_dp.accounting import AccountingError, MixtureOfGaussiansPRV, composition, discretisation
from pld_reference import DELTA


def test_discretisation_internals_match_prv_accountant():
    """The routine reimplemented for speed gives prv-accountant's result."""
    prv = MixtureOfGaussiansPRV(0.01, 1.0, 4, "remove")
    disc = discretisation.Discretisation([prv], [300], eps_error=0.05, delta_error=DELTA / 1000)
    pmf = disc.compute_composition([300])
    ours = composition.epsilon_from_pmf(pmf, DELTA, disc.delta_error, disc.eps_error)
    np.testing.assert_allclose(ours, pmf.compute_epsilon(DELTA, disc.delta_error, disc.eps_error), rtol=1e-12)


def test_unresolved_mean_falls_back_then_raises(monkeypatch):
    """The run-time guard: when the two Gauss–Legendre rules disagree, adaptive quadrature decides;
    when that is not resolved either, no ε."""
    prv = MixtureOfGaussiansPRV(1e-3, 0.5, 1, "remove")
    honest = discretisation.Discretisation([prv], [1000], eps_error=0.05, delta_error=DELTA / 1000)
    monkeypatch.setattr(prv, "loss_moment", lambda lo, hi, panel=0.25: 1e-3 * panel)
    fallback = discretisation.Discretisation([prv], [1000], eps_error=0.05, delta_error=DELTA / 1000)
    shifts = [d.composer.self_composers[0].domain.shifts() for d in (honest, fallback)]
    assert shifts[1] == pytest.approx(shifts[0], abs=1e-12)
    monkeypatch.setattr(prv, "loss_moment_adaptive", lambda lo, hi: (2e-3, 1e-6))
    with pytest.raises(AccountingError, match="not resolved"):
        discretisation.Discretisation([prv], [1000], eps_error=0.05, delta_error=DELTA / 1000)
