"""What floating-point noise adds to δ: the sampler's finite support, as a sound bound, and the attack floor.

The accountant assumes Gaussian noise. hf_dp's sampler (`hf_dp.noise`) draws each value as the first coordinate
of a Box–Muller pair whose radius R = sqrt(-2 ln u₁) comes from a 159-bit uniform u₁ ≥ 2⁻¹⁵⁹: in exact
arithmetic its law is the two-dimensional standard normal *conditioned on R ≤ a*, a = sqrt(318 ln 2) ≈ 14.85, and
each pair leaves out exactly P(R > a) = e^(−a²/2) = 2⁻¹⁵⁹ of the Gaussian's mass.

Let M be the ideal mechanism (every draw Gaussian), (ε, δ)-DP by the accountant, and M̃ the real one: M conditioned
on the event G that none of its N draws has R > a. G concerns the noise alone (not the data, not the sample), so
for every output event E and neighbouring datasets D, D', with p = P(not G) ≤ N·2⁻¹⁵⁹,

    P[M̃(D) ∈ E] ≤ P[M(D) ∈ E] / (1 − p) ≤ (e^ε P[M(D') ∈ E] + δ) / (1 − p)
                ≤ (e^ε ((1 − p) P[M̃(D') ∈ E] + p) + δ) / (1 − p),

so M̃ is (ε, δ + δ_fp)-DP with δ_fp = (e^ε + δ)·p / (1 − p). The bound holds for any adaptive composition
(ULS, ELS with a user moving several rows, example-level; any sample rate and clip norm), since it uses only M's
(ε, δ) and the number of draws. [`support_floor`] is the matching lower bound an attacker reaches with one
coordinate (what a sampler of smaller reach a forces): it checks that the stated δ is never below it.

Pure math: no torch.
"""

from __future__ import annotations

import math

from scipy import stats

__all__ = ["NOISE_REACH", "TAIL_PER_DRAW", "sampler_delta", "support_floor", "check_sampler_delta",
           "MAX_SAMPLER_DELTA_SHARE", "max_sampler_epsilon", "sampler_range_error", "check_sampler_range"]

TAIL_BITS = 159  # bits of the uniform u₁ that sets a draw's radius
TAIL_PER_DRAW = 2.0 ** -TAIL_BITS  # P(R > NOISE_REACH) for a Gaussian pair: the mass each draw leaves out
NOISE_REACH = math.sqrt(2 * TAIL_BITS * math.log(2))  # the largest |draw|, in standard deviations (≈ 14.85)
MAX_SAMPLER_DELTA_SHARE = 0.01  # a plan whose δ_fp exceeds this share of δ is refused


def sampler_delta(*, epsilon: float, delta: float, draws: float, tail_per_draw: float = TAIL_PER_DRAW) -> float:
    """δ_fp = (e^ε + δ)·p/(1 − p), p = draws·tail_per_draw: what `draws` draws of the bounded sampler add to the
    (ε, δ) of the Gaussian mechanism (see the module docstring). `inf` when p ≥ 1 (no bound)."""
    if draws < 0 or epsilon < 0 or not 0 <= delta < 1:
        raise ValueError(f"sampler_delta needs draws ≥ 0, ε ≥ 0 and δ in [0, 1); got {draws}, {epsilon}, {delta}.")
    p = draws * tail_per_draw
    if p >= 1 or epsilon > 700:
        return math.inf
    return (math.exp(epsilon) + delta) * p / (1 - p)


def support_floor(*, sample_rate: float, noise_multiplier: float, steps: int, reach: float,
                  group_size: int = 1) -> float:
    """The δ no (ε, δ) can go below when no draw exceeds `reach` standard deviations: one user puts its clipped
    gradient C on one coordinate, and the event "that coordinate lies beyond s + reach·σC" happens only with them.

    Per step it happens with probability Σ_k P(k of the user's rows sampled)·P(Z > reach − k/σ) (k = 1 with
    probability q for ULS and example-level; k ~ Binomial(G, q) for ELS); over `steps` steps, 1 − (1 − that)^T.
    An independent check of the stated δ, not a bound hf_dp uses: the Gaussian's own tail is part of δ already.
    """
    if group_size == 1:
        per_step = sample_rate * stats.norm.sf(reach - 1.0 / noise_multiplier)
    else:
        k = range(1, group_size + 1)
        per_step = sum(stats.binom.pmf(j, group_size, sample_rate) * stats.norm.sf(reach - j / noise_multiplier)
                       for j in k)
    return -math.expm1(steps * math.log1p(-per_step))


def max_sampler_epsilon(*, delta: float, draws: float, share: float = MAX_SAMPLER_DELTA_SHARE,
                        tail_per_draw: float = TAIL_PER_DRAW) -> float:
    """The largest ε at which `draws` draws add at most `share`·δ: δ_fp = (e^ε + δ)·p/(1 − p) ≤ share·δ gives
    ε ≤ ln(share·δ·(1 − p)/p − δ). `-inf` when no ε ≥ 0 is left (so many draws that even ε = 0 passes it).

    Computed in logarithms: never overflows, whatever ε the caller has in mind.
    """
    p = draws * tail_per_draw
    if p >= 1:
        return -math.inf
    if p <= 0:
        return math.inf
    room = share * delta * (1 - p) / p - delta  # what e^ε may reach
    return math.log(room) if room >= 1 else -math.inf


def sampler_range_error(*, epsilon: float, delta: float, draws: float, what: str = "ε") -> str | None:
    """One line refusing an ε beyond what the noise sampler can state at this plan (naming the largest it can, and
    why), or `None` when `epsilon` is within it."""
    largest = max_sampler_epsilon(delta=delta, draws=draws)
    if epsilon <= largest:
        return None
    why = (f"its draws reach {NOISE_REACH:.2f}σ, so over this plan's {draws:.3g} draws the δ they add, "
           f"(e^ε + δ)·p/(1 − p) with p = draws·2⁻¹⁵⁹, stays within {MAX_SAMPLER_DELTA_SHARE:.0%} of δ = {delta:.3g}")
    if largest == -math.inf:
        return (f"{what} = {epsilon:.4g} cannot be stated by the noise sampler: {why} for no ε at all; train fewer "
                "steps or fewer parameters, or raise --target_delta.")
    shown = math.floor(largest * 10) / 10
    return (f"{what} = {epsilon:.4g} is beyond what the noise sampler can state: {why} only up to ε = {shown:.1f}, "
            f"the largest ε this plan can state; ask for ε ≤ {shown:.1f}, or train fewer steps or fewer parameters, or "
            "raise --target_delta.")


def check_sampler_delta(*, epsilon: float, delta: float, draws: float, what: str = "ε") -> float:
    """δ_fp for a plan, or a one-line `ValueError` naming the largest ε the sampler can state
    ([`max_sampler_epsilon`]) when `epsilon` is beyond it (δ_fp above `MAX_SAMPLER_DELTA_SHARE` of δ)."""
    check_sampler_range(epsilon=epsilon, delta=delta, draws=draws, what=what)
    return sampler_delta(epsilon=epsilon, delta=delta, draws=draws)


def check_sampler_range(*, epsilon: float, delta: float, draws: float, what: str = "ε") -> None:
    """Raise [`sampler_range_error`]'s one line as a `ValueError` when `epsilon` is beyond the sampler's range."""
    message = sampler_range_error(epsilon=epsilon, delta=delta, draws=draws, what=what)
    if message is not None:
        raise ValueError(message)
