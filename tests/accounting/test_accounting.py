"""hf_dp.accounting against an independent accountant (Google's dp-accounting PLD accountant).

One reference function, one table of settings: ε of T Poisson-sampled DP-SGD steps (G = 1) and
of T steps of the ELS mixture-of-Gaussians mechanism (G > 1), both adjacency directions. The
reference is dp-accounting's pessimistic privacy-loss-distribution accountant; its own
discretisation (value_discretization_interval) is fine enough to sit well within 0.1 % of the
exact ε at these settings.
"""
import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution
from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant
from scipy import stats

from hf_dp import accounting
from hf_dp.accounting import MixtureOfGaussiansMechanism, PrivacyAccountant
from hf_dp.accounting import AccountingError, calibration, composition, discretisation

DELTA = 1e-5


def _binomial(group_size, sample_rate):
    k = np.arange(group_size + 1)
    return [float(s) for s in k], [float(p) for p in stats.binom.pmf(k, group_size, sample_rate)]


def _event(sample_rate, noise_multiplier, group_size):
    if group_size == 1:
        return dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(noise_multiplier))
    sensitivities, probs = _binomial(group_size, sample_rate)
    return dp_event.MixtureOfGaussiansDpEvent(noise_multiplier, sensitivities, probs)


def reference_epsilon(segments, delta=DELTA, interval=1e-3):
    """dp-accounting's ε (both directions, add-or-remove) of [(q, σ, G, steps), ...]."""
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    for sample_rate, noise_multiplier, group_size, steps in segments:
        acc.compose(_event(sample_rate, noise_multiplier, group_size), steps)
    return acc.get_epsilon(delta)


def assert_matches_reference(bounds, reference):
    lower, estimate, upper = bounds
    assert lower <= estimate <= upper
    assert abs(upper - reference) <= 0.01 * reference, (bounds, reference)
    # never below the reference by more than our own stated error (an understated ε is a bug)
    assert upper >= reference - (upper - lower), (bounds, reference)
    # the true ε is ≥ lower and ≤ the (pessimistic) reference
    assert lower <= reference, (bounds, reference)


# (q, σ, T, G, reference interval): q ∈ [1e-3, 0.5], σ ∈ [0.5, 10], T ≤ 1e4, G ≤ 32, ε ∈ [0.8, 25].
# dp-accounting's pessimistic rounding grows with T, so its long runs use a finer interval.
GRID = [
    pytest.param(0.01, 1.0, 1000, 1, 1e-3, id="q0.01-s1-T1e3"),
    pytest.param(0.5, 5.0, 100, 1, 1e-3, id="q0.5-s5-T100"),
    pytest.param(0.2, 0.5, 20, 1, 1e-3, id="q0.2-s0.5-T20"),
    pytest.param(0.5, 10.0, 1000, 1, 1e-3, id="q0.5-s10-T1e3"),
    pytest.param(0.01, 1.0, 10000, 1, 1e-4, id="q0.01-s1-T1e4"),
    pytest.param(0.1, 2.0, 100, 2, 1e-3, id="G2-q0.1-s2-T100"),
    pytest.param(0.01, 4.0, 1000, 32, 1e-3, id="G32-q0.01-s4-T1e3"),
    pytest.param(0.001, 0.8, 10000, 1, 1e-4, id="q1e-3-s0.8-T1e4", marks=pytest.mark.slow),
    pytest.param(0.01, 1.0, 1000, 4, 1e-3, id="G4-q0.01-s1-T1e3", marks=pytest.mark.slow),
    pytest.param(0.05, 3.0, 200, 8, 1e-3, id="G8-q0.05-s3-T200", marks=pytest.mark.slow),
    pytest.param(0.5, 10.0, 10, 16, 1e-3, id="G16-q0.5-s10-T10", marks=pytest.mark.slow),
    pytest.param(0.001, 2.0, 10000, 32, 1e-3, id="G32-q1e-3-s2-T1e4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("sample_rate, noise_multiplier, steps, group_size, interval", GRID)
def test_epsilon_matches_dp_accounting(sample_rate, noise_multiplier, steps, group_size, interval):
    bounds = accounting.epsilon_bounds(sample_rate=sample_rate, noise_multiplier=noise_multiplier, steps=steps,
                                       delta=DELTA, group_size=group_size)
    reference = reference_epsilon([(sample_rate, noise_multiplier, group_size, steps)], interval=interval)
    assert_matches_reference(bounds, reference)
    assert accounting.epsilon(sample_rate=sample_rate, noise_multiplier=noise_multiplier, steps=steps,
                              delta=DELTA, group_size=group_size) == bounds[2]


def test_each_direction_matches_dp_accounting():
    """The MoG privacy random variable, run through prv-accountant's own unmodified
    PRVAccountant, gives dp-accounting's ε for the remove and the add direction separately."""
    sample_rate, noise_multiplier, group_size, steps = 0.05, 1.5, 4, 200
    sensitivities, probs = _binomial(group_size, sample_rate)
    pld = privacy_loss_distribution.from_mixture_gaussian_mechanism(
        noise_multiplier, sensitivities, probs, value_discretization_interval=1e-3).self_compose(steps)
    # dp-accounting keeps one distribution per direction (private attributes, test-only use)
    references = {"remove": pld._pmf_remove.get_epsilon_for_delta(DELTA),
                  "add": pld._pmf_add.get_epsilon_for_delta(DELTA)}
    assert references["remove"] != pytest.approx(references["add"], rel=1e-3)  # the directions differ
    for direction, reference in references.items():
        prv = MixtureOfGaussiansMechanism(sample_rate, noise_multiplier, group_size, direction)
        acc = PRVAccountant(prvs=[prv], max_self_compositions=[steps], eps_error=0.01, delta_error=DELTA / 1000)
        assert_matches_reference(acc.compute_epsilon(delta=DELTA, num_self_compositions=[steps]), reference)


def test_group_size_one_is_the_poisson_subsampled_gaussian():
    for sample_rate, noise_multiplier, steps in [(0.01, 1.0, 500), (0.5, 0.7, 10), (1e-3, 5.0, 500)]:
        mog = MixtureOfGaussiansMechanism(sample_rate, noise_multiplier, 1, "remove")
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


def test_privacy_loss_inverse_and_distribution():
    for group_size, sample_rate, noise_multiplier in [(32, 0.01, 1.0), (8, 0.3, 2.0), (4, 1.0, 0.7)]:
        for direction in ("remove", "add"):
            prv = MixtureOfGaussiansMechanism(sample_rate, noise_multiplier, group_size, direction)
            x = np.linspace(-5.0, group_size + 5.0, 4001)
            loss = prv.privacy_loss(x)
            assert np.all(np.diff(loss) > 0)
            np.testing.assert_allclose(prv.inverse_privacy_loss(loss), x, rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose([prv.inverse_privacy_loss(float(v))[0] for v in loss[::400]], x[::400],
                                       rtol=1e-9, atol=1e-9)
            t = np.linspace(-30, 30, 6001)
            cdf, sf = prv.cdf(t), prv.sf(t)
            assert np.all(np.diff(cdf) >= 0)
            np.testing.assert_allclose(cdf + sf, 1.0, atol=1e-15)
            np.testing.assert_allclose([prv.cdf(float(v)) for v in t[::600]], cdf[::600], atol=1e-15)
            np.testing.assert_allclose(prv.probability(t[:-1], t[1:]).sum(), cdf[-1] - cdf[0], atol=1e-13)


def test_rdp_quadrature_agrees_with_exact_orders():
    """The fractional orders' quadrature and the exact integer moments agree where both apply."""
    prv = MixtureOfGaussiansMechanism(0.02, 1.5, 16, "remove")
    quadrature = prv._rdp_remove_fractional([2.0, 3.0, 7.0])
    exact = prv._rdp_remove_integer([2, 3, 7])
    for order in (2.0, 3.0, 7.0):
        assert quadrature[order] == pytest.approx(exact[order], rel=1e-8)
    assert prv.rdp(2.5) <= prv.rdp(3.0)


def test_discretisation_internals_match_prv_accountant():
    """The routine reimplemented for speed gives prv-accountant's result."""
    prv = MixtureOfGaussiansMechanism(0.01, 1.0, 4, "remove")
    disc = discretisation.Discretisation([prv], [300], eps_error=0.05, delta_error=DELTA / 1000)
    pmf = disc.compute_composition([300])
    ours = composition.epsilon_from_pmf(pmf, DELTA, disc.delta_error, disc.eps_error)
    np.testing.assert_allclose(ours, pmf.compute_epsilon(DELTA, disc.delta_error, disc.eps_error), rtol=1e-12)


@pytest.mark.parametrize("sample_rate, noise_multiplier, group_size", [
    (1e-4, 0.4, 1), (1e-6, 0.3, 1), (0.5, 0.7, 1), (1.0, 2.0, 1), (3e-5, 0.5, 4), (0.01, 1.0, 32), (0.3, 5.0, 256)])
@pytest.mark.parametrize("direction", ["remove", "add"])
def test_truncated_mean_agrees_with_adaptive_quadrature(sample_rate, noise_multiplier, group_size, direction):
    """The mean that the certificate rests on: Gauss–Legendre in input space against QUADPACK,
    including where all the mass sits in one mesh cell (q ≤ 1e-4)."""
    prv = MixtureOfGaussiansMechanism(sample_rate, noise_multiplier, group_size, direction)
    lo, hi = -15.0, 15.0
    adaptive, error = prv.loss_moment_adaptive(lo, hi)
    assert error < 1e-13
    assert prv.loss_moment(lo, hi) == pytest.approx(adaptive, abs=1e-13, rel=1e-10)
    assert prv.loss_moment(lo, hi, panel=0.5) == pytest.approx(adaptive, abs=1e-13, rel=1e-10)


def test_mean_of_the_many_users_corner_is_not_a_mesh_rule():
    """At q=1e-4, σ=0.4 the mean privacy loss is +1.70e-6 (remove) and +1.40e-6 (add): both are
    KL divergences, so positive (a rule on the loss mesh gave −3.35e-6 and −1.5e-4)."""
    for direction, expected in (("remove", 1.6973e-6), ("add", 1.4015e-6)):
        prv = MixtureOfGaussiansMechanism(1e-4, 0.4, 1, direction)
        assert prv.loss_moment(-40.0, 40.0) == pytest.approx(expected, rel=1e-3)


def test_unresolved_mean_falls_back_then_raises(monkeypatch):
    """The run-time guard: when the two Gauss–Legendre rules disagree, adaptive quadrature decides;
    when that is not resolved either, no ε."""
    prv = MixtureOfGaussiansMechanism(1e-3, 0.5, 1, "remove")
    honest = discretisation.Discretisation([prv], [1000], eps_error=0.05, delta_error=DELTA / 1000)
    monkeypatch.setattr(prv, "loss_moment", lambda lo, hi, panel=0.25: 1e-3 * panel)
    fallback = discretisation.Discretisation([prv], [1000], eps_error=0.05, delta_error=DELTA / 1000)
    shifts = [d.composer.self_composers[0].domain.shifts() for d in (honest, fallback)]
    assert shifts[1] == pytest.approx(shifts[0], abs=1e-12)
    monkeypatch.setattr(prv, "loss_moment_adaptive", lambda lo, hi: (2e-3, 1e-6))
    with pytest.raises(AccountingError, match="not resolved"):
        discretisation.Discretisation([prv], [1000], eps_error=0.05, delta_error=DELTA / 1000)


def test_mog_is_far_tighter_than_group_privacy():
    setting = dict(sample_rate=0.005, noise_multiplier=2.0, steps=500, delta=1e-5)
    mog = accounting.epsilon(**setting, group_size=32)
    group = accounting.group_privacy_epsilon(**setting, group_size=32)
    assert group > 4 * mog
    # group privacy of G=1 is the example-level guarantee itself
    assert accounting.group_privacy_epsilon(**setting, group_size=1) == accounting.epsilon(**setting)
    # the tight accountant never certifies more than group privacy does
    small = dict(sample_rate=0.01, noise_multiplier=2.0, steps=200, delta=1e-5)
    tight_lower = accounting.epsilon_bounds(**small, group_size=4)[0]
    assert tight_lower <= accounting.group_privacy_epsilon(**small, group_size=4)


def test_noise_multiplier_inverts_epsilon():
    for group_size, sample_rate, steps, target in [(1, 0.01, 1000, 2.0), (8, 0.01, 300, 4.0)]:
        sigma = accounting.noise_multiplier(target_epsilon=target, delta=DELTA, sample_rate=sample_rate,
                                            steps=steps, group_size=group_size)
        spent = accounting.epsilon(sample_rate=sample_rate, noise_multiplier=sigma, steps=steps, delta=DELTA,
                                   group_size=group_size)
        assert spent <= target
        smaller = sigma / (1 + calibration.NOISE_MULTIPLIER_RTOL)
        assert accounting.epsilon(sample_rate=sample_rate, noise_multiplier=smaller, steps=steps, delta=DELTA,
                                  group_size=group_size) > target
        # the ledger of that run stays within the target too
        ledger = PrivacyAccountant()
        ledger.step(sample_rate=sample_rate, noise_multiplier=sigma, group_size=group_size, steps=steps)
        assert ledger.epsilon(DELTA) == spent


def test_noise_multiplier_unreachable_target_says_what_to_change():
    with pytest.raises(ValueError, match="raise the target"):
        accounting.noise_multiplier(target_epsilon=1e-4, delta=DELTA, sample_rate=0.5, steps=10000)


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
    values = [accounting.epsilon(sample_rate=0.02, noise_multiplier=1.0, steps=t, delta=DELTA) for t in (1, 10, 100)]
    assert 0 < values[0] < values[1] < values[2]
    assert accounting.epsilon(sample_rate=0.02, noise_multiplier=2.0, steps=100, delta=DELTA) < values[2]
    assert accounting.epsilon_bounds(sample_rate=0.02, noise_multiplier=1.0, steps=0, delta=DELTA) == (0, 0, 0)


BAD_ARGUMENTS = [
    ({"sample_rate": 0.0}, "sample_rate"),
    ({"sample_rate": -0.1}, "sample_rate"),
    ({"sample_rate": 1.5}, "sample_rate"),
    ({"noise_multiplier": 0.0}, "noise_multiplier"),
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier"),
    ({"delta": 0.0}, "delta"),
    ({"delta": 1.0}, "delta"),
    ({"delta": 2.0}, "delta"),
    ({"steps": -1}, "steps"),
    ({"steps": 2.5}, "steps"),
    ({"group_size": 0}, "group_size"),
    ({"group_size": 10**6}, "group_size"),   # beyond the tested domain: refused at once, not 7 TiB later
    ({"steps": 10**9}, "steps"),             # refused at once, not after minutes
    ({"delta": 1e-16}, "delta"),
]


@pytest.mark.parametrize("change, name", BAD_ARGUMENTS)
def test_bad_arguments_raise_clear_errors(change, name):
    kwargs = {"sample_rate": 0.01, "noise_multiplier": 1.0, "steps": 10, "delta": DELTA, "group_size": 1, **change}
    with pytest.raises(ValueError, match=name):
        accounting.epsilon(**kwargs)
    calibration = {k: v for k, v in kwargs.items() if k != "noise_multiplier"}
    if name != "noise_multiplier":
        with pytest.raises(ValueError, match=name):
            accounting.noise_multiplier(target_epsilon=1.0, **calibration)
    ledger = PrivacyAccountant()
    step = {k: kwargs[k] for k in ("sample_rate", "noise_multiplier", "group_size", "steps")}
    if name == "delta":
        ledger.step(**step)
        with pytest.raises(ValueError, match=name):
            ledger.epsilon(kwargs["delta"])
    else:
        with pytest.raises(ValueError, match=name):
            ledger.step(**step)


def test_noise_multiplier_rejects_bad_target():
    for target in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="target_epsilon"):
            accounting.noise_multiplier(target_epsilon=target, delta=DELTA, sample_rate=0.01, steps=10)


# ---- the ledger -------------------------------------------------------------------------------

def test_empty_ledger():
    ledger = PrivacyAccountant()
    assert ledger.steps == 0 and ledger.history == []
    assert ledger.epsilon(DELTA) == 0.0
    assert ledger.epsilon_bounds(DELTA) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="empty"):
        ledger.epsilon_after(DELTA)
    assert ledger.epsilon_after(DELTA, steps=10, sample_rate=0.01, noise_multiplier=1.0) == accounting.epsilon(
        sample_rate=0.01, noise_multiplier=1.0, steps=10, delta=DELTA)


def test_ledger_merges_segments_and_composes_them():
    ledger = PrivacyAccountant()
    for _ in range(5):
        ledger.step(sample_rate=0.02, noise_multiplier=1.2)
    ledger.step(sample_rate=0.02, noise_multiplier=1.2, steps=95)
    ledger.step(sample_rate=0.05, noise_multiplier=2.0, steps=50)
    ledger.step(sample_rate=0.02, noise_multiplier=1.2, group_size=4, steps=30)
    assert ledger.steps == 180
    assert ledger.history == [
        {"sample_rate": 0.02, "noise_multiplier": 1.2, "group_size": 1, "steps": 100},
        {"sample_rate": 0.05, "noise_multiplier": 2.0, "group_size": 1, "steps": 50},
        {"sample_rate": 0.02, "noise_multiplier": 1.2, "group_size": 4, "steps": 30},
    ]
    assert "mixture-of-Gaussians" in ledger.mechanism and "180 steps" in ledger.mechanism
    reference = reference_epsilon([(0.02, 1.2, 1, 100), (0.05, 2.0, 1, 50), (0.02, 1.2, 4, 30)])
    assert_matches_reference(ledger.epsilon_bounds(DELTA), reference)


def test_ledger_state_dict_round_trips_through_json():
    ledger = PrivacyAccountant()
    ledger.step(sample_rate=0.02, noise_multiplier=1.2, steps=40)
    ledger.step(sample_rate=0.03, noise_multiplier=0.9, group_size=2, steps=7)
    text = json.dumps(ledger.state_dict())
    restored = PrivacyAccountant()
    restored.load_state_dict(json.loads(text))
    assert restored.history == ledger.history
    assert restored.epsilon(DELTA) == ledger.epsilon(DELTA)
    restored.step(sample_rate=0.03, noise_multiplier=0.9, group_size=2)
    assert restored.history[-1]["steps"] == 8  # resumes merging into the last segment


@pytest.mark.parametrize("state, match", [
    ({"segments": []}, "format"),
    ({"format": 2, "segments": []}, "format"),
    ({"format": 1, "segments": [{"sample_rate": 0.1}]}, "keys"),
    ({"format": 1, "segments": [{"sample_rate": 1.5, "noise_multiplier": 1.0, "group_size": 1, "steps": 3}]},
     "sample_rate"),
    ({"format": 1, "segments": [{"sample_rate": 0.1, "noise_multiplier": 1.0, "group_size": 1, "steps": -3}]},
     "steps"),
    ("not a dict", "format"),
])
def test_load_state_dict_validates(state, match):
    ledger = PrivacyAccountant()
    ledger.step(sample_rate=0.1, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=match):
        ledger.load_state_dict(state)
    assert ledger.steps == 1  # untouched


def test_epsilon_after_is_the_epsilon_after_stepping():
    ledger = PrivacyAccountant()
    ledger.step(sample_rate=0.01, noise_multiplier=1.1, steps=200)
    for _ in range(3):
        predicted = ledger.epsilon_after(DELTA, steps=1)
        ledger.step(sample_rate=0.01, noise_multiplier=1.1)
        assert ledger.epsilon(DELTA) == predicted
    assert ledger.epsilon_after(DELTA, steps=0) == ledger.epsilon(DELTA)
    assert ledger.epsilon(DELTA) == accounting.epsilon(sample_rate=0.01, noise_multiplier=1.1, steps=203,
                                                       delta=DELTA)
    # with other parameters: a new segment
    predicted = ledger.epsilon_after(DELTA, steps=20, noise_multiplier=2.0, group_size=3)
    ledger.step(sample_rate=0.01, noise_multiplier=2.0, group_size=3, steps=20)
    assert ledger.epsilon(DELTA) == predicted
    assert predicted > accounting.epsilon(sample_rate=0.01, noise_multiplier=1.1, steps=203, delta=DELTA)
