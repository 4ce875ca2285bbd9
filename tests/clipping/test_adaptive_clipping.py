"""Private adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021): tracking, noise split, accounting.

- Tracking: Poisson-sampled log-normal norms, the paper's count noise σ_b = m/20, C_0 a factor 100 off either
  way; the tracked C must settle at the true γ-quantile and follow a mid-run shift.
- Split: σ_Δ and σ_b composed back give σ_eff exactly, with and without the loss-logging term.
- Accounting, against dp-accounting (independent of hf_dp):
  * dp-accounting's RDP accountant accepts the step as it is, PoissonSampledDpEvent(q, ComposedDpEvent(
    [GaussianDpEvent(σ_Δ), GaussianDpEvent(2σ_b)(, GaussianDpEvent(r·σ_Δ))])); its PLD accountant does not (it
    only takes a GaussianDpEvent or LaplaceDpEvent under Poisson sampling, checked below), so
  * the vector-Gaussian equivalence itself is checked numerically: the one-step privacy profile δ(ε) of the
    Poisson-subsampled *two-dimensional* Gaussian (gradient direction, count), integrated on a 2-D grid, equals
    dp-accounting's analytic δ(ε) of the one-dimensional Gaussian with σ_eff in both adjacency directions. The
    privacy profile determines the privacy-loss distribution, so equal profiles per step mean equal ε after
    any number of compositions;
  * hf_dp's ledger ε with σ_eff matches dp-accounting's PLD accountant on PoissonSampledDpEvent(q,
    GaussianDpEvent(σ_eff)) within 2 % (both are tight numerical accountants: PRV with certified error, PLD with
    a 1e-3 discretisation; measured agreement ≤ 0.5 %), and is at most the RDP ε (RDP is an upper bound, and a
    loose one at these ε: 1.5-3x).
"""
import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import norm as standard_normal

import dp_accounting
from dp_accounting import pld, rdp
from dp_accounting.pld import privacy_loss_mechanism

from hf_dp import accounting
from hf_dp.clipping.adaptive import (
    AdaptiveClipping,
    QuantileTracker,
    centered_unclipped_count,
    default_count_noise,
    effective_noise_multiplier,
    gradient_noise_multiplier,
)

# ---------------------------------------------------------------- tracking a known quantile

POPULATION = 4096
SAMPLE_RATE = 1 / 32  # m = 128 expected units per step
EXPECTED = SAMPLE_RATE * POPULATION
LOG_MEDIAN, LOG_STD = math.log(3.0), 1.0  # per-unit norms ~ LogNormal(log 3, 1), redrawn every step


def true_quantile(gamma: float, log_median: float = LOG_MEDIAN) -> float:
    return math.exp(log_median + LOG_STD * standard_normal.ppf(gamma))


def simulate(tracker: QuantileTracker, steps: int, seed: int, shift_at: int | None = None,
             shift_factor: float = 1.0) -> np.ndarray:
    """C after each step of the full private loop: Poisson sample, centred count at the current C, noise σ_b once."""
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        log_median = LOG_MEDIAN + (math.log(shift_factor) if shift_at is not None and step >= shift_at else 0.0)
        sampled = int(torch.binomial(torch.tensor(float(POPULATION)), torch.tensor(SAMPLE_RATE), generator=generator))
        norms = torch.exp(log_median + LOG_STD * torch.randn(sampled, generator=generator))
        count = centered_unclipped_count(norms, tracker.norm)
        released = float(count) + tracker.count_noise * float(torch.randn((), generator=generator))
        history.append(tracker.update(released, EXPECTED))
    return np.asarray(history)


@pytest.mark.parametrize("gamma", [0.5, 0.9])
@pytest.mark.parametrize("start_factor", [100.0, 0.01])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tracks_the_target_quantile_from_far_away(gamma, start_factor, seed):
    target = true_quantile(gamma)
    config = AdaptiveClipping(target_quantile=gamma, learning_rate=0.2, initial_norm=start_factor * target)
    tracker = QuantileTracker.start(config, EXPECTED)
    assert tracker.count_noise == pytest.approx(EXPECTED / 20)  # the paper's default σ_b = m/20
    history = simulate(tracker, steps=600, seed=seed)
    log_error = np.log(history / target)

    # Reaching the quantile: log C moves by at most η·max(b̃ − γ) per step, so a factor 100 takes ≥ ln 100 / (0.2·0.5)
    # = 46 steps at γ = 0.5 and ≥ 230 steps down from above at γ = 0.9 (b̃ − γ ≤ 0.1). Measured: 57-64 and 321-332.
    arrival = int(np.argmax(np.abs(log_error) < math.log(1.2)))
    assert np.abs(log_error[arrival]) < math.log(1.2)
    assert arrival <= (400 if (gamma == 0.9 and start_factor > 1) else 100)

    # Settled: the last 200 steps average within 10 % of the true quantile (measured ≤ 5.3 %), no step strays beyond
    # 25 % (measured ≤ 16 %; the stationary std of log C is ≈ 0.04 at these η, m, σ_b), and the quantile level of
    # the averaged C is within 0.03 of γ (measured ≤ 0.02).
    settled = log_error[-200:]
    assert abs(math.expm1(settled.mean())) < 0.10
    assert math.expm1(np.abs(settled).max()) < 0.25
    level = standard_normal.cdf((math.log(target) + settled.mean() - LOG_MEDIAN) / LOG_STD)
    assert abs(level - gamma) < 0.03


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shift_factor", [0.1, 10.0])
def test_follows_a_shift_in_the_norm_distribution(seed, shift_factor):
    """Gradients shrink (or grow) tenfold mid-run, as they do over fine-tuning: C follows within ~50 steps."""
    config = AdaptiveClipping(target_quantile=0.5, initial_norm=1.0)
    history = simulate(QuantileTracker.start(config, EXPECTED), steps=800, seed=seed, shift_at=400,
                       shift_factor=shift_factor)
    before = np.log(history[:400] / true_quantile(0.5))
    after = np.log(history[400:] / true_quantile(0.5, LOG_MEDIAN + math.log(shift_factor)))
    assert abs(math.expm1(before[-150:].mean())) < 0.10
    assert np.abs(after[0]) > math.log(5)  # the old C is far off the new quantile
    arrival = int(np.argmax(np.abs(after) < math.log(1.2)))
    assert np.abs(after[arrival]) < math.log(1.2) and arrival <= 80  # measured 33-42 for the 0.1 shift
    assert abs(math.expm1(after[-200:].mean())) < 0.10
    assert math.expm1(np.abs(after[-200:]).max()) < 0.25


def test_logged_clipped_fraction_is_unbiased():
    """1/2 − R/m, the release that replaces the clipped-count log, has mean E[#clipped]/m = P(norm > C)."""
    generator = torch.Generator().manual_seed(5)
    norm_bound, sigma_b, steps = 5.0, default_count_noise(EXPECTED), 3000
    fractions = []
    for _ in range(steps):
        sampled = int(torch.binomial(torch.tensor(float(POPULATION)), torch.tensor(SAMPLE_RATE), generator=generator))
        norms = torch.exp(LOG_MEDIAN + LOG_STD * torch.randn(sampled, generator=generator))
        noise = sigma_b * float(torch.randn((), generator=generator))
        released = float(centered_unclipped_count(norms, norm_bound)) + noise
        fractions.append(QuantileTracker.clipped_fraction(released, EXPECTED))
    expected = 1.0 - standard_normal.cdf((math.log(norm_bound) - LOG_MEDIAN) / LOG_STD)
    standard_error = np.std(fractions) / math.sqrt(steps)
    assert abs(np.mean(fractions) - expected) < 4 * standard_error
    assert np.std(fractions) < 0.08  # noise 0.05 (σ_b/m) and sampling ≈ 0.05: the log is usable per step


def test_centered_unclipped_count():
    norms = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0])
    count = centered_unclipped_count(norms, 1.5)  # 0.5, 1.0 and 1.5 (equal to C: clip factor 1) are unclipped
    assert count.dim() == 0 and count.dtype == torch.float32 and count.device == norms.device
    assert count.item() == 3 - 2.5
    assert centered_unclipped_count(norms, torch.tensor(0.1)).item() == -2.5  # all clipped
    assert centered_unclipped_count(norms.double(), torch.tensor(10.0, dtype=torch.float64)).item() == 2.5
    assert centered_unclipped_count(torch.empty(0), 1.0).item() == 0.0  # an empty Poisson sample releases 0 + noise
    # Partial counts (micro-batches, ranks) add up to the count over the whole batch.
    assert (centered_unclipped_count(norms[:2], 1.5) + centered_unclipped_count(norms[2:], 1.5)).item() == count.item()
    # Sensitivity 1/2: adding any one unit moves the count by exactly ±1/2.
    for extra in (0.1, 100.0):
        grown = centered_unclipped_count(torch.cat([norms, torch.tensor([extra])]), 1.5)
        assert abs(grown.item() - count.item()) == 0.5


def test_update_is_the_geometric_step_and_state_round_trips():
    tracker = QuantileTracker.start(AdaptiveClipping(target_quantile=0.9, learning_rate=0.2, initial_norm=2.0), 100)
    assert tracker.count_noise == 5.0
    # b̃ = R/m + 1/2 = 0.7 → C·exp(−0.2·(0.7 − 0.9)).
    assert tracker.update(20.0, 100) == pytest.approx(2.0 * math.exp(0.04))
    assert tracker.steps == 1
    # b̃ clamps to [0, 1] (post-processing): a huge noised count moves C by at most exp(η·max(γ, 1 − γ)).
    before = tracker.norm
    assert tracker.update(1e6, 100) == pytest.approx(before * math.exp(-0.2 * 0.1))
    before = tracker.norm
    assert tracker.update(-1e6, 100) == pytest.approx(before * math.exp(0.2 * 0.9))
    assert QuantileTracker.clipped_fraction(-20.0, 100) == pytest.approx(0.7)
    assert QuantileTracker.unclipped_fraction(-20.0, 100) == pytest.approx(0.3)

    # Checkpoint mid-run through JSON: the resumed tracker continues exactly like the uninterrupted one.
    restored = QuantileTracker.from_dict(json.loads(json.dumps(tracker.to_dict())))
    assert restored == tracker
    for released in (3.0, -7.5, 12.25):
        assert restored.update(released, 100) == tracker.update(released, 100)
    assert restored.to_dict() == tracker.to_dict() and restored.steps == 6


# ---------------------------------------------------------------- the noise split


@pytest.mark.parametrize("sigma_eff", [0.3, 0.6, 0.8, 1.0, 5.0])
@pytest.mark.parametrize("count_noise", [None, 0.5, 3.2, 50.0])
@pytest.mark.parametrize("ratio", [None, 10.0, 2.0])
def test_split_is_exact(sigma_eff, count_noise, ratio):
    m = 64
    sigma_b = count_noise if count_noise is not None else m / 20
    if 2 * sigma_b <= sigma_eff:
        with pytest.raises(ValueError, match="count alone would exceed the budget"):
            gradient_noise_multiplier(sigma_eff, count_noise, m, ratio)
        return
    sigma = gradient_noise_multiplier(sigma_eff, count_noise, m, ratio)
    composed = sigma ** -2 + (2 * sigma_b) ** -2 + ((ratio * sigma) ** -2 if ratio else 0.0)
    assert composed ** -0.5 == pytest.approx(sigma_eff, rel=1e-12)
    assert effective_noise_multiplier(sigma, count_noise, m, ratio) == pytest.approx(sigma_eff, rel=1e-12)
    assert sigma >= sigma_eff
    config = AdaptiveClipping(count_noise=count_noise)
    assert config.gradient_noise_multiplier(sigma_eff, m, ratio) == sigma
    assert config.effective_noise_multiplier(sigma, m, ratio) == pytest.approx(sigma_eff, rel=1e-12)


def test_split_replaces_the_logged_count():
    """With adaptive clipping only the loss term remains from logging: σ_Δ → σ_eff·√(1 + r⁻²) as σ_b → ∞, not the
    fixed-norm trainer's σ_eff·√(1 + 2r⁻²) (which also pays for a clipped-count release)."""
    sigma_eff, ratio = 0.8, 10.0
    huge = gradient_noise_multiplier(sigma_eff, 1e12, logging_noise_ratio=ratio)
    assert huge == pytest.approx(sigma_eff * math.sqrt(1 + ratio ** -2), rel=1e-12)
    assert huge < sigma_eff * math.sqrt(1 + 2 * ratio ** -2)
    # The paper's default costs little at DP-SGD batch sizes: m = 64, σ_eff = 0.8 → +0.8 % gradient noise.
    assert gradient_noise_multiplier(sigma_eff, None, 64) / sigma_eff == pytest.approx(1.0079, abs=1e-4)


# ---------------------------------------------------------------- accounting against dp-accounting

DELTA = 1e-6
ACCOUNTING_CASES = [
    # (q, σ_eff, σ_b, r, T): the paper's σ_b = m/20 at m = 64, and a small σ_b where the count takes a big share.
    (1e-3, 0.8, 3.2, None, 2000),
    (1e-3, 0.8, 3.2, 10.0, 2000),
    (1e-3, 0.7, 0.5, None, 10_000),
    (1e-3, 0.6, 0.5, 10.0, 5000),
]


@pytest.mark.parametrize("q, sigma_eff, sigma_b, ratio, steps", ACCOUNTING_CASES)
def test_ledger_epsilon_matches_dp_accounting(q, sigma_eff, sigma_b, ratio, steps):
    sigma = gradient_noise_multiplier(sigma_eff, sigma_b, logging_noise_ratio=ratio)
    ledger_sigma = effective_noise_multiplier(sigma, sigma_b, logging_noise_ratio=ratio)
    ours = accounting.epsilon(sample_rate=q, noise_multiplier=ledger_sigma, steps=steps, delta=DELTA)

    # RDP on the step as released: the Poisson-subsampled composition of the separate Gaussian releases.
    releases = [dp_accounting.GaussianDpEvent(sigma), dp_accounting.GaussianDpEvent(2 * sigma_b)]
    if ratio is not None:
        releases.append(dp_accounting.GaussianDpEvent(ratio * sigma))
    step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.ComposedDpEvent(releases))
    rdp_composed = rdp.RdpAccountant().compose(step, steps).get_epsilon(DELTA)
    rdp_single = rdp.RdpAccountant().compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma_eff)), steps).get_epsilon(DELTA)
    assert rdp_composed == pytest.approx(rdp_single, rel=1e-9)  # dp-accounting composes the releases to our σ_eff
    assert ours <= rdp_composed  # RDP is an upper bound (a loose one here)

    # PLD: does not take the composed event under Poisson sampling (hence the 2-D check below) ...
    assert not pld.PLDAccountant().supports(step)
    # ... so account the equivalent one-dimensional Gaussian, whose equivalence the next test checks numerically.
    pld_accountant = pld.PLDAccountant(value_discretization_interval=1e-3)
    pld_accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma_eff)), steps)
    reference = pld_accountant.get_epsilon(DELTA)
    assert ours == pytest.approx(reference, rel=0.02)


def _two_dimensional_profile(mu: np.ndarray, q: float, epsilons, step: float = 0.02):
    """δ(ε) of the Poisson-subsampled 2-D Gaussian: N(0, I) vs (1 − q)N(0, I) + qN(μ, I), both directions,
    by quadrature on a grid (exponentially accurate for smooth Gaussian integrands; the kink of max(0, ·) is what
    limits it: ≤ 1.5e-6 relative at this step)."""
    x = np.arange(-11.0, 11.0 + mu[0], step)
    y = np.arange(-11.0, 11.0 + mu[1], step)

    def density(z, shift):
        return np.exp(-0.5 * (z - shift) ** 2) / math.sqrt(2 * math.pi)

    absent = np.outer(density(x, 0.0), density(y, 0.0))
    present = (1 - q) * absent + q * np.outer(density(x, mu[0]), density(y, mu[1]))
    remove = [np.sum(np.maximum(0.0, present - math.exp(e) * absent)) * step * step for e in epsilons]
    add = [np.sum(np.maximum(0.0, absent - math.exp(e) * present)) * step * step for e in epsilons]
    return np.asarray(remove), np.asarray(add)


@pytest.mark.parametrize("q", [1e-3, 0.1, 1.0])
def test_two_dimensional_release_is_the_gaussian_with_effective_multiplier(q):
    """Theorem 1 of the paper, numerically: the step's privacy profile equals that of one Gaussian with σ_eff.

    In noise units one unit shifts the (gradient-direction, count) pair by μ = (1/σ_Δ, (1/2)/σ_b); the other
    gradient directions carry no shift and integrate out. σ_b = 0.6 makes the count carry a large share
    (σ_Δ = 0.7 → σ_eff = 0.605), so a wrong split would show.
    """
    sigma, sigma_b = 0.7, 0.6
    sigma_eff = effective_noise_multiplier(sigma, sigma_b)
    epsilons = [0.0, 0.05, 0.2, 0.5, 1.0, 1.5]
    remove, add = _two_dimensional_profile(np.array([1 / sigma, 0.5 / sigma_b]), q, epsilons)

    def profile(noise_multiplier, adjacency):
        loss = privacy_loss_mechanism.GaussianPrivacyLoss(noise_multiplier, sampling_prob=q, adjacency_type=adjacency)
        return np.array([loss.get_delta_for_epsilon(e) for e in epsilons])

    expected_remove = profile(sigma_eff, privacy_loss_mechanism.AdjacencyType.REMOVE)
    expected_add = profile(sigma_eff, privacy_loss_mechanism.AdjacencyType.ADD)
    # Measured: ≤ 1.5e-6 relative; the add direction's exact zeros (ε ≥ −log(1 − q)) are zero in both.
    np.testing.assert_allclose(remove, expected_remove, rtol=1e-5, atol=1e-15)
    np.testing.assert_allclose(add, expected_add, rtol=1e-5, atol=1e-15)
    assert remove[0] > 0 and remove[-1] > 0
    # The check has teeth: ignoring the count (σ_Δ alone) or a 1 % error in σ_eff is far outside that tolerance.
    for wrong in (sigma, 1.01 * sigma_eff):
        assert np.max(np.abs(profile(wrong, privacy_loss_mechanism.AdjacencyType.REMOVE)[1:] / remove[1:] - 1)) > 1e-3


def test_calibrated_split_meets_the_target():
    """The trainer's flow: calibrate σ_eff to ε, split; the released pair composes back to within the target."""
    q, steps, target = 1e-3, 3000, 1.0
    sigma_eff = accounting.noise_multiplier(target_epsilon=target, delta=DELTA, sample_rate=q, steps=steps)
    config = AdaptiveClipping()
    sigma = config.gradient_noise_multiplier(sigma_eff, expected_batch_size=64, logging_noise_ratio=10.0)
    recomposed = config.effective_noise_multiplier(sigma, expected_batch_size=64, logging_noise_ratio=10.0)
    spent = accounting.epsilon(sample_rate=q, noise_multiplier=recomposed, steps=steps, delta=DELTA)
    assert spent <= target * (1 + 1e-9)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, message", [
    ({"target_quantile": 0.0}, "target_quantile"),
    ({"target_quantile": 1.0}, "target_quantile"),
    ({"target_quantile": float("nan")}, "target_quantile"),
    ({"target_quantile": "0.5"}, "target_quantile"),
    ({"learning_rate": 0.0}, "learning_rate"),
    ({"learning_rate": -0.2}, "learning_rate"),
    ({"initial_norm": 0.0}, "initial_norm"),
    ({"initial_norm": float("inf")}, "initial_norm"),
    ({"count_noise": 0.0}, "count_noise"),
    ({"count_noise": float("nan")}, "count_noise"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveClipping(**kwargs)


def test_split_validation():
    with pytest.raises(ValueError, match="count alone would exceed the budget"):
        gradient_noise_multiplier(1.0, 0.5)  # 2σ_b = σ_eff: the count spends the whole budget
    with pytest.raises(ValueError, match=r"m/20 with expected_batch_size=8"):
        gradient_noise_multiplier(1.0, None, 8)  # the default σ_b = 0.4 at m = 8
    with pytest.raises(ValueError, match="pass expected_batch_size"):
        gradient_noise_multiplier(1.0)
    with pytest.raises(ValueError, match="pass expected_batch_size"):
        effective_noise_multiplier(1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan"), None):
        with pytest.raises(ValueError, match="effective_noise_multiplier"):
            gradient_noise_multiplier(bad, 1.0)
        with pytest.raises(ValueError, match="noise_multiplier"):
            effective_noise_multiplier(bad, 1.0)
    with pytest.raises(ValueError, match="logging_noise_ratio"):
        gradient_noise_multiplier(1.0, 5.0, logging_noise_ratio=0.0)
    with pytest.raises(ValueError, match="expected_batch_size"):
        default_count_noise(0)
    with pytest.raises(ValueError, match="expected_batch_size"):
        gradient_noise_multiplier(1.0, 5.0, -3)


def test_tracker_validation():
    tracker = QuantileTracker.start(AdaptiveClipping(), 64)
    with pytest.raises(ValueError, match="finite"):
        tracker.update(float("nan"), 64)
    with pytest.raises(ValueError, match="expected_batch_size"):
        tracker.update(1.0, 0)
    assert tracker.steps == 0 and tracker.norm == 0.1  # a rejected update changes nothing
    with pytest.raises(ValueError, match="1-D"):
        centered_unclipped_count(torch.ones(2, 3), 1.0)
    state = tracker.to_dict()
    with pytest.raises(ValueError, match="expected keys"):
        QuantileTracker.from_dict({k: v for k, v in state.items() if k != "norm"})
    with pytest.raises(ValueError, match="expected keys"):
        QuantileTracker.from_dict({**state, "extra": 1})
    with pytest.raises(ValueError, match="steps"):
        QuantileTracker.from_dict({**state, "steps": -1})
    with pytest.raises(ValueError, match="norm must be"):  # a corrupt norm in the checkpoint
        QuantileTracker.from_dict({**state, "norm": -1.0})
