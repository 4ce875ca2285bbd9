"""Noise calibration: the smallest noise multiplier σ whose ε meets a target (ε, δ)."""
from __future__ import annotations

import math

from scipy.optimize import brentq

from .checks import Kind, check_delta, check_steps, check_target_epsilon, make_kind
from .composition import coarse_discretisations, composition_bounds, direction_bounds, eps_error_target, horizon, \
    rdp_epsilon

__all__ = ["noise_multiplier", "rdp_noise_multiplier"]

NOISE_MULTIPLIER_RANGE = (0.1, 1000.0)
# Calibration stops when the bracket [σ_lo, σ_hi] (σ_lo fails, σ_hi meets the target) is this
# narrow, relatively: the σ returned is within 0.1 % of the smallest one that meets the target.
NOISE_MULTIPLIER_RTOL = 1e-3


def noise_multiplier(*, target_epsilon: float, delta: float, sample_rate: float, steps: int,
                     group_size: int = 1) -> float:
    """The smallest σ whose [`epsilon`] meets `target_epsilon`, to 0.1 % (bracketing search).

    A coarse discretisation locates the root cheaply; secant steps on the full computation then
    close a bracket σ_lo < σ ≤ σ_hi (σ_lo spends more than the target, σ_hi does not) to 0.1 %,
    with bisection as the fallback; σ_hi is returned.

    Affects accounting: training with the returned σ for `steps` steps spends at most
    `target_epsilon` (the same computation as [`epsilon`] and the ledger).

    Args:
        target_epsilon (`float`): ε > 0 to meet.
        delta (`float`): δ ∈ (0, 1).
        sample_rate (`float`): q ∈ (0, 1].
        steps (`int`): T ≥ 1.
        group_size (`int`, *optional*, defaults to `1`): G ≥ 1 (see [`epsilon`]).

    Returns:
        `float`: σ ∈ [0.1, 1000] with `epsilon(σ) ≤ target_epsilon`, at most 0.1 % above the
        smallest such σ (σ = 0.1 when even that meets the target).

    Raises:
        ValueError: an argument is out of range, or even σ = 1000 spends more than the target
            (the message says what to change).

    Example:
        >>> from hf_dp.accounting import epsilon, noise_multiplier
        >>> sigma = noise_multiplier(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=1000)
        >>> epsilon(sample_rate=0.01, noise_multiplier=sigma, steps=1000, delta=1e-5) <= 3.0
        True
    """
    target = check_target_epsilon(target_epsilon)
    kind = make_kind(sample_rate, 1.0, group_size)
    steps = check_steps(steps, minimum=1)
    delta = check_delta(delta)
    q, group = kind.sample_rate, kind.group_size
    sigma_min, sigma_max = NOISE_MULTIPLIER_RANGE
    rtol = NOISE_MULTIPLIER_RTOL
    spent: dict[float, float] = {}

    def spends(sigma: float) -> float:
        """The ε `epsilon()` reports at σ; ∞ where σ is too small for the accountant to resolve ε."""
        if sigma not in spent:
            try:
                spent[sigma] = composition_bounds([(Kind(q, sigma, group), steps)], delta)[2]
            except (RuntimeError, ValueError, FloatingPointError, OverflowError):  # ε beyond the accountant's range
                spent[sigma] = math.inf
        return spent[sigma]

    def infeasible() -> ValueError:
        return ValueError(
            f"No noise_multiplier up to {sigma_max:g} reaches ε={target:g} at δ={delta:g} with sample_rate={q:.4g}, "
            f"{steps} steps" + (f" and contribution bound G={group}" if group > 1 else "")
            + ": raise the target ε, or take fewer steps or a smaller sample rate"
            + (" or a smaller G." if group > 1 else ".")
        )

    # Cheap feasibility check at σ_max: the RDP ε bounds the true ε; only a target near it needs
    # the full computation.
    if rdp_epsilon((Kind(q, sigma_max, group),), (steps,), delta) > target / 2 and spends(sigma_max) > target:
        raise infeasible()
    # 1. Locate the root on a cheap proxy (a coarse discretisation): σ and d log ε / d log σ.
    guess, slope = _coarse_root(q, group, steps, delta, target)
    # 2. Secant steps on the real computation (in log σ, log ε), then close the bracket
    #    lo < σ* ≤ hi (lo never meets the target, hi always does) to within rtol by probing
    #    just above and just below the root estimate.
    lo, hi = sigma_min, sigma_max
    if guess is None and spends(sigma_min) <= target:
        return sigma_min
    sigma = guess
    for _ in range(10):
        if sigma is None or hi / lo <= 1 + rtol:
            break
        if spends(sigma) <= target:
            hi = min(hi, sigma)
        else:
            lo = max(lo, sigma)
        if hi / lo <= 1 + rtol:
            break
        known = sorted((abs(math.log(e / target)), s_, e) for s_, e in spent.items()
                       if math.isfinite(e) and e > 0)
        if not known:
            sigma = math.sqrt(lo * hi)
            continue
        if len(known) >= 2 and known[0][2] != known[1][2]:
            (_, s0, e0), (_, s1, e1) = known[:2]
            slope = (math.log(e1) - math.log(e0)) / (math.log(s1) - math.log(s0))
        s0, e0 = known[0][1], known[0][2]
        root = math.exp(math.log(s0) + math.log(target / e0) / slope) if slope and slope < 0 else math.sqrt(lo * hi)
        # Probe above the root until hi is within rtol/2 of it, then below it for lo.
        sigma = root * (1 + rtol / 2) if hi > root * (1 + rtol) else root / (1 + rtol / 2)
        if not lo < sigma < hi:
            sigma = math.sqrt(lo * hi)
    # 3. Bisection for whatever is left (no usable guess).
    while hi / lo > 1 + rtol:
        mid = math.sqrt(lo * hi)
        if spends(mid) <= target:
            hi = mid
        else:
            lo = mid
    if lo == sigma_min and spends(sigma_min) <= target:
        return sigma_min
    if spends(hi) > target:  # only σ_max can be unverified here
        raise infeasible()
    return hi


def _coarse_root(q: float, group: int, steps: int, delta: float, target: float):
    """(σ, d log ε / d log σ) where a coarse discretisation predicts `epsilon()` to reach the target.

    `epsilon()` reports (estimate at δ − delta_error) + eps_error; the coarse discretisation's
    estimate is within ~0.5 % of the first term and `eps_error_target` gives the second, so this lands
    within a fraction of a percent of the answer at a fraction of the cost. The caller refines
    on the real computation. (None, None) when the root is outside [σ_min, σ_max] or the proxy
    fails.
    """
    steps_horizon = horizon(steps)
    sigma_min, sigma_max = NOISE_MULTIPLIER_RANGE

    def predicted(log_sigma: float) -> float:
        kind = Kind(q, math.exp(log_sigma), group)
        try:
            fine_error = eps_error_target((kind,), (steps_horizon,), delta)
            estimate = max(direction_bounds(acc, [steps], delta)[1]
                           for acc in coarse_discretisations((kind,), (steps_horizon,), delta))
        except (RuntimeError, ValueError, FloatingPointError, OverflowError):
            return math.inf  # ε beyond what the accountant resolves: far above any sane target
        return estimate + fine_error - target

    # G = 1: bracket just below the RDP σ (which meets the target: RDP bounds ε from above); else by
    # doubling/halving from σ = 1; then Brent's method on log σ.
    lo = hi = 0.0
    start = None
    if group == 1:  # (for the mixture of Gaussians RDP is cheap neither to compute nor tight)
        try:
            start = math.log(rdp_noise_multiplier(target_epsilon=target, delta=delta, sample_rate=q, steps=steps))
        except ValueError:
            pass
    if start is not None and predicted(start) <= 0:
        hi, lo = start, start - math.log(1.25)
        while predicted(lo) <= 0:
            lo, hi = lo - math.log(1.25), lo
            if lo < math.log(sigma_min):
                return None, None
    elif predicted(lo) > 0:
        while predicted(hi) > 0:
            lo, hi = hi, hi + math.log(2)
            if hi > math.log(sigma_max):
                return None, None
    else:
        while predicted(lo) <= 0:
            lo, hi = lo - math.log(2), lo
            if lo < math.log(sigma_min):
                return None, None
    try:
        root = brentq(predicted, lo, hi, xtol=3e-4, rtol=1e-5, maxiter=60)
    except (ValueError, RuntimeError):
        return None, None
    step = math.log(1.02)
    above = predicted(root + step) + target
    slope = (math.log(above) - math.log(target)) / step if 0 < above < math.inf else -1.0
    return math.exp(root), min(slope, -0.1)


def rdp_noise_multiplier(*, target_epsilon: float, delta: float, sample_rate: float, steps: int,
                         group_size: int = 1) -> float:
    """The smallest σ whose RDP ε meets the target, to 1 %: cheap (milliseconds) and conservative.

    RDP bounds ε from above, so this σ is at least [`noise_multiplier`]'s (typically 5-15 % more):
    fit for comparing choices (the planner ranks contribution bounds with it), not for training.

    Raises:
        ValueError: an argument is out of range, or no σ ≤ 1000 meets the target.
    """
    target = check_target_epsilon(target_epsilon)
    kind = make_kind(sample_rate, 1.0, group_size)
    steps, delta = check_steps(steps, minimum=1), check_delta(delta)
    lo, hi = NOISE_MULTIPLIER_RANGE

    def spends(sigma: float) -> float:
        return rdp_epsilon((Kind(kind.sample_rate, sigma, kind.group_size),), (steps,), delta)

    if spends(hi) > target:
        raise ValueError(f"No noise_multiplier up to {hi:g} reaches ε={target:g} at δ={delta:g} (RDP bound): raise the "
                         "target ε, or take fewer steps or a smaller sample rate.")
    while hi / lo > 1.01:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if spends(mid) > target else (lo, mid)
    return hi
