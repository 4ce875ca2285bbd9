"""`hf_dp/accounting/floating_point.py`: what the noise sampler's finite support adds to δ, checked against an exact
computation, an attack that reaches the floor, and the settings an outside review measured."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from hf_dp.accounting.floating_point import (
    NOISE_REACH,
    TAIL_PER_DRAW,
    MAX_SAMPLER_DELTA_SHARE,
    check_sampler_delta,
    max_sampler_epsilon,
    sampler_delta,
    sampler_range_error,
    support_floor,
)

# (q, σ, T, stated δ) of the review's table: the chat study (`hf-dp demo`) and three runs where many users live.
SETTINGS = [(0.0209, 0.474, 60, 1.3e-4), (1e-3, 0.55, 10**4, 1e-5), (5e-4, 0.5, 5 * 10**4, 1e-6),
            (2e-4, 0.45, 10**5, 1e-5)]
TORCH_CPU_FLOAT32_REACH = math.sqrt(2 * 24 * math.log(2))  # Box–Muller on 24-bit uniforms: 5.768σ
CURAND_FLOAT32_REACH = math.sqrt(2 * 32 * math.log(2))  # 6.660σ


def test_the_reach_is_where_a_159_bit_uniform_stops():
    assert NOISE_REACH == pytest.approx(14.8466, abs=1e-4)
    assert TAIL_PER_DRAW == pytest.approx(math.exp(-NOISE_REACH**2 / 2), rel=1e-12)


def test_sampler_delta_is_the_stated_formula_and_grows_with_draws():
    assert sampler_delta(epsilon=8.0, delta=1e-5, draws=0) == 0.0
    p = 10**15 * TAIL_PER_DRAW
    assert sampler_delta(epsilon=8.0, delta=1e-5, draws=10**15) == pytest.approx((math.exp(8) + 1e-5) * p / (1 - p))
    assert sampler_delta(epsilon=1.0, delta=1e-5, draws=2e40) > sampler_delta(epsilon=1.0, delta=1e-5, draws=1e40)
    assert sampler_delta(epsilon=1.0, delta=1e-5, draws=1e48) == math.inf  # p ≥ 1: no bound


@pytest.mark.parametrize("reach, epsilon", [(1.5, 0.5), (2.0, 1.0), (2.5, 0.2), (3.0, 2.0)])
def test_the_bound_holds_for_an_exactly_computed_truncated_gaussian(reach, epsilon):
    """One Gaussian release of sensitivity 1, σ = 1, its noise cut at ±reach (and renormalised): its exact δ(ε) in
    both directions, by integration, never exceeds the ideal Gaussian's δ(ε) plus `sampler_delta` for one draw of
    tail P(|Z| > reach)."""
    tail = 2 * stats.norm.sf(reach)

    def density(y, shift):
        return stats.norm.pdf(y - shift) / (1 - tail) if abs(y - shift) <= reach else 0.0

    def hockey_stick(p_shift, q_shift):
        points = sorted({-reach, reach, 1 - reach, 1 + reach, 0.5 - epsilon})
        value, _ = integrate.quad(lambda y: max(0.0, density(y, p_shift) - math.exp(epsilon) * density(y, q_shift)),
                                  -reach - 1, reach + 2, points=points, limit=200)
        return value

    exact = max(hockey_stick(0.0, 1.0), hockey_stick(1.0, 0.0))
    ideal = stats.norm.cdf(0.5 - epsilon) - math.exp(epsilon) * stats.norm.cdf(-0.5 - epsilon)
    bound = ideal + sampler_delta(epsilon=epsilon, delta=ideal, draws=1, tail_per_draw=tail)
    assert exact <= bound * (1 + 1e-9)
    assert exact > ideal  # the cut support costs something: the bound is not vacuous here


def test_the_floor_is_what_an_attack_on_a_bounded_sampler_reaches():
    """An independent check of `support_floor`: simulate the attack on a sampler that stops at 2.5σ (Poisson
    sampling, one user whose clipped gradient sits on one coordinate) and count how often the released coordinate
    lands where it cannot without the user."""
    rng = np.random.default_rng(0)
    q, sigma, steps, reach, runs = 0.2, 0.8, 6, 2.5, 200_000
    draws = stats.truncnorm.rvs(-reach, reach, size=(runs, steps), random_state=rng)
    present = rng.random((runs, steps)) < q
    released = draws + present / sigma  # in units of σC: the user shifts it by C = 1/σ
    caught = (released > reach).any(axis=1).mean()  # impossible without the user
    floor = support_floor(sample_rate=q, noise_multiplier=sigma, steps=steps, reach=reach)
    truncated_tail = stats.truncnorm.sf(reach - 1 / sigma, -reach, reach)  # the sampler's own tail, not Φ̄
    expected = 1 - (1 - q * truncated_tail) ** steps
    assert caught == pytest.approx(expected, rel=0.03)
    assert floor == pytest.approx(expected, rel=0.25)  # Φ̄ for the truncated sampler's tail: close, as intended


def test_a_user_moving_several_rows_lowers_the_floor_of_els():
    kwargs = dict(sample_rate=1e-3, noise_multiplier=0.5, steps=10**4, reach=TORCH_CPU_FLOAT32_REACH)
    assert support_floor(group_size=4, **kwargs) > support_floor(group_size=1, **kwargs)


@pytest.mark.parametrize("q, sigma, steps, delta", SETTINGS)
def test_float32_samplers_make_the_stated_delta_false_where_users_live(q, sigma, steps, delta):
    """The review's table: the floor of torch's CPU float32 normals (5.77σ) is above each stated δ (1.3× to
    2,100×); curand's (6.66σ) is 0.4× to 40× δ in the many-users rows."""
    floor = support_floor(sample_rate=q, noise_multiplier=sigma, steps=steps, reach=TORCH_CPU_FLOAT32_REACH)
    assert floor > delta
    review = {0.0209: 1.6e-4, 1e-3: 3.9e-4, 5e-4: 2.1e-3, 2e-4: 3.9e-3}[q]
    assert floor == pytest.approx(review, rel=0.06)
    if q < 0.01:
        ratio = support_floor(sample_rate=q, noise_multiplier=sigma, steps=steps, reach=CURAND_FLOAT32_REACH) / delta
        assert 0.3 < ratio < 50


@pytest.mark.parametrize("q, sigma, steps, delta", SETTINGS)
def test_hf_dps_stated_delta_stands_above_the_floor_and_its_sampler_term_is_tiny(q, sigma, steps, delta):
    """With draws reaching 14.85σ, the stated δ (the accountant's plus `sampler_delta`, here for a 10⁹-parameter
    model at ε = 8, and at ε = 40) is far above the floor an attacker can reach, and the sampler's term far below
    1% of δ."""
    floor = support_floor(sample_rate=q, noise_multiplier=sigma, steps=steps, reach=NOISE_REACH)
    assert floor < 1e-25 * delta
    assert sampler_delta(epsilon=8.0, delta=delta, draws=steps * (10**9 + 2)) < 1e-20 * delta
    assert sampler_delta(epsilon=40.0, delta=delta, draws=steps * (10**9 + 2)) < 1e-6 * delta


def test_a_plan_whose_sampler_term_passes_one_percent_of_delta_is_refused():
    assert check_sampler_delta(epsilon=8.0, delta=1e-5, draws=10**16) < 1e-20
    with pytest.raises(ValueError, match="fewer steps or fewer parameters"):
        check_sampler_delta(epsilon=8.0, delta=1e-10, draws=10**34)
    with pytest.raises(ValueError, match="the largest ε this plan can state; ask for ε ≤ 61.8"):  # a vacuous ε
        check_sampler_delta(epsilon=80.0, delta=1e-5, draws=10**14)


@pytest.mark.parametrize("delta, draws", [(1e-5, 10**12), (1.3e-4, 60 * 10**6), (1e-9, 10**18), (0.1, 1)])
def test_the_largest_epsilon_the_sampler_states_is_where_its_delta_reaches_its_share(delta, draws):
    """At the largest ε the sampler's δ is its share of δ (to rounding), above it more: the limit is exact."""
    largest = max_sampler_epsilon(delta=delta, draws=draws)
    assert 30 < largest < 110
    assert sampler_delta(epsilon=largest, delta=delta, draws=draws) == pytest.approx(MAX_SAMPLER_DELTA_SHARE * delta,
                                                                                       rel=1e-9)
    assert sampler_delta(epsilon=largest + 0.01, delta=delta, draws=draws) > MAX_SAMPLER_DELTA_SHARE * delta
    assert check_sampler_delta(epsilon=largest - 0.01, delta=delta, draws=draws) <= MAX_SAMPLER_DELTA_SHARE * delta
    assert sampler_range_error(epsilon=largest - 0.01, delta=delta, draws=draws) is None


@pytest.mark.parametrize("epsilon", [100.0, 1000.0, 1e6, math.inf])
def test_an_epsilon_beyond_the_sampler_is_refused_in_one_line_naming_the_largest(epsilon):
    """Never "δ = inf" or an overflow: one line that says why and names the largest ε, rounded down."""
    largest = max_sampler_epsilon(delta=1e-5, draws=10**12)
    with pytest.raises(ValueError) as error:
        check_sampler_delta(epsilon=epsilon, delta=1e-5, draws=10**12)
    message = str(error.value)
    assert "\n" not in message and "beyond what the noise sampler can state" in message
    assert f"ask for ε ≤ {math.floor(largest * 10) / 10:.1f}" in message and "14.85σ" in message
    assert "δ = inf" not in message and "e+0" not in message.split("draws")[1]


def test_so_many_draws_that_no_epsilon_is_left_says_so():
    assert max_sampler_epsilon(delta=1e-5, draws=10**44) == -math.inf
    with pytest.raises(ValueError, match="for no ε at all; train fewer steps or fewer parameters"):
        check_sampler_delta(epsilon=1.0, delta=1e-5, draws=10**44)
