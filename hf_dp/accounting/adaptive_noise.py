"""The noise algebra of one DP step, σ ↔ σ_eff, in one place: pure math, no torch.

A step releases the clipped gradient sum with noise multiplier σ (`noise_multiplier`) and, on the same Poisson
sample, a few noised scalars. Scaled by their noise they form one Gaussian release whose noise multiplier σ_eff
(`effective_noise_multiplier`) is what the accountant composes ([`StepReleases`]):

    σ_eff⁻² = σ⁻²·(1 + k·r⁻²) + (2σ_b)⁻²

- private logging (r = `logging_noise_ratio`): the clipped losses at r·σ and, with a fixed C, the clipped count at
  r·σ (k = 2); with adaptive clipping the count release is replaced by the adaptive count (k = 1);
- adaptive clipping (Andrew et al. 2021, Theorem 1): the centred count of unclipped units, sensitivity 1/2, noise
  std σ_b, so noise multiplier 2σ_b; [`default_count_noise`] is the paper's σ_b = m/20.

[`AdaptiveClipping`] is adaptive clipping's configuration (the quantile tracker that runs it, on tensors, is
[`hf_dp.clipping.adaptive.QuantileTracker`]). Used by the privacy plan and by the planner (`hf-dp plan
--adaptive_clipping`, which must not load torch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "AdaptiveClipping",
    "StepReleases",
    "COUNT_SENSITIVITY",
    "DEFAULT_COUNT_NOISE_FRACTION",
    "default_count_noise",
    "effective_noise_multiplier",
    "gradient_noise_multiplier",
    "positive_finite",
    "resolve_count_noise",
]

COUNT_SENSITIVITY = 0.5  # one unit moves Σ (1[‖g‖ ≤ C] − 1/2) by exactly 1/2
DEFAULT_COUNT_NOISE_FRACTION = 1.0 / 20.0  # the paper's σ_b = m/20


def positive_finite(name: str, value) -> float:
    """`value` as a float; a ValueError naming `name` unless it is a positive finite number."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}.") from None
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
    return value


def default_count_noise(expected_batch_size: float) -> float:
    """The paper's count noise σ_b = m/20 (Andrew et al. 2021, Section 5), m the expected units per step.

    Why m/20: b̃ = R/m + 1/2 then carries noise of std 0.05, small next to the sampling noise of a fraction
    (≈ 0.5/√m), while the count's noise multiplier 2σ_b = m/10 is far above any practical σ_eff, so the count
    takes a negligible share of the budget.

    Raises:
        ValueError: `expected_batch_size` is not a positive finite number.
    """
    m = positive_finite("expected_batch_size", expected_batch_size)
    return DEFAULT_COUNT_NOISE_FRACTION * m


def resolve_count_noise(count_noise, expected_batch_size) -> float:
    """σ_b: `count_noise` if given (validated), else the default m/20 for `expected_batch_size` m."""
    if count_noise is None:
        if expected_batch_size is None:
            raise ValueError("count_noise=None means the default σ_b = m/20: pass expected_batch_size (m).")
        return default_count_noise(expected_batch_size)
    if expected_batch_size is not None:
        positive_finite("expected_batch_size", expected_batch_size)
    return positive_finite("count_noise", count_noise)


def _logging_ratio(logging_noise_ratio) -> float | None:
    if logging_noise_ratio is None:
        return None
    return positive_finite("logging_noise_ratio", logging_noise_ratio)


def gradient_noise_multiplier(effective_noise_multiplier: float, count_noise: float | None = None,
                              expected_batch_size: float | None = None,
                              logging_noise_ratio: float | None = None) -> float:
    """σ_Δ, the gradient noise multiplier that leaves the whole step at the accounted σ_eff.

    Solves σ_eff⁻² = σ_Δ⁻² + (2σ_b)⁻² [+ (r·σ_Δ)⁻²] (Andrew et al. 2021, Section 3, Theorem 1, plus the
    loss-logging release when `logging_noise_ratio` r is given): σ_Δ = √(1 + r⁻²) / √(σ_eff⁻² − (2σ_b)⁻²).
    The clipped-count logging release is not in the sum: the adaptive count replaces it (see the module
    docstring), so with r given this differs from the fixed-norm trainer's σ = σ_eff·√(1 + 2r⁻²).

    Args:
        effective_noise_multiplier (`float`): σ_eff > 0, what the accountant composes (calibrated to the target ε).
        count_noise (`float`, *optional*): σ_b > 0, std of the noise on the centred count, in count units;
            `None` for the paper's default m/20 (needs `expected_batch_size`).
        expected_batch_size (`float`, *optional*): m = q × number of units; only needed when `count_noise` is None.
        logging_noise_ratio (`float`, *optional*): r > 0 when the clipped losses are released with noise
            multiplier r·σ_Δ (private logging); `None` when nothing else is released.

    Returns:
        `float`: σ_Δ ≥ σ_eff.

    Raises:
        ValueError: an argument is not positive and finite, or σ_b ≤ σ_eff/2. Then the count alone, whose noise
            multiplier is 2σ_b, already spends at least the whole budget, and no σ_Δ exists; the message says
            what to change (more count noise, a larger expected batch size for the m/20 default, or a larger σ_eff,
            i.e. a larger target ε).
    """
    sigma_b = resolve_count_noise(count_noise, expected_batch_size)
    releases = StepReleases(logging_noise_ratio=_logging_ratio(logging_noise_ratio), count_noise=sigma_b)
    try:
        return releases.gradient_noise_multiplier(effective_noise_multiplier)
    except ValueError:
        default = ("" if count_noise is not None
                   else f" (the default m/20 with expected_batch_size={expected_batch_size:g})")
        sigma_eff = positive_finite("effective_noise_multiplier", effective_noise_multiplier)
        raise ValueError(
            f"count_noise σ_b={sigma_b:g}{default} gives the clipped-count release a noise multiplier "
            f"2σ_b={sigma_b / COUNT_SENSITIVITY:g}, not above the effective noise multiplier σ_eff={sigma_eff:g} that "
            f"the whole step may spend: the count alone would exceed the budget and no gradient noise multiplier "
            f"exists. Raise count_noise above {sigma_eff / 2:g} (a few times that keeps the gradient noise close to "
            f"σ_eff), raise the expected batch size, or raise the target ε (a smaller σ_eff)."
        ) from None


def effective_noise_multiplier(noise_multiplier: float, count_noise: float | None = None,
                               expected_batch_size: float | None = None,
                               logging_noise_ratio: float | None = None) -> float:
    """σ_eff = (σ_Δ⁻² + (2σ_b)⁻² [+ (r·σ_Δ)⁻²])^(-1/2): the one Gaussian release a step amounts to.

    The inverse of [`gradient_noise_multiplier`] (Andrew et al. 2021, Section 3, Theorem 1): use it to account a
    run given its gradient noise multiplier σ_Δ (`noise_multiplier`), e.g. when the user fixes σ instead of ε.
    Same arguments as there, with σ_Δ in place of σ_eff.

    Raises:
        ValueError: an argument is not positive and finite (or `count_noise` and `expected_batch_size` are both None).
    """
    sigma_b = resolve_count_noise(count_noise, expected_batch_size)
    releases = StepReleases(logging_noise_ratio=_logging_ratio(logging_noise_ratio), count_noise=sigma_b)
    return releases.effective_noise_multiplier(positive_finite("noise_multiplier", noise_multiplier))


@dataclass(frozen=True)
class StepReleases:
    """What one step releases beside the gradient sum, and so how σ and σ_eff relate (the module docstring).

    Args:
        logging_noise_ratio (`float`, *optional*): r of private logging; `None` when nothing is logged.
        count_noise (`float`, *optional*): σ_b of adaptive clipping's count; `None` for a fixed C.
    """

    logging_noise_ratio: float | None = None
    count_noise: float | None = None

    def effective_noise_multiplier(self, noise_multiplier: float) -> float:
        """σ_eff of a step whose gradient noise multiplier is σ = `noise_multiplier`."""
        ratio, sigma = self.logging_noise_ratio, noise_multiplier
        if self.count_noise is None:  # fixed C: the loss sum and the clipped count, each at r·σ
            return sigma / math.sqrt(1.0 + 2.0 / ratio**2) if ratio else sigma
        precision = sigma ** -2 + (self.count_noise / COUNT_SENSITIVITY) ** -2
        if ratio is not None:  # adaptive C: the count replaces the clipped count; the loss sum at r·σ
            precision += (ratio * sigma) ** -2
        return 1.0 / math.sqrt(precision)

    def gradient_noise_multiplier(self, effective_noise_multiplier: float) -> float:
        """σ that leaves the step at σ_eff = `effective_noise_multiplier` (the inverse).

        Raises:
            ValueError: the scalars alone would spend the budget (2σ_b ≤ σ_eff): no σ exists.
        """
        ratio = self.logging_noise_ratio
        effective = positive_finite("effective_noise_multiplier", effective_noise_multiplier)
        if self.count_noise is None:
            return effective * math.sqrt(1.0 + 2.0 / ratio**2) if ratio else effective
        remaining = effective ** -2 - (self.count_noise / COUNT_SENSITIVITY) ** -2
        if not remaining > 0.0 or not math.isfinite(1.0 / remaining):
            raise ValueError(f"the step's released scalars alone spend more than σ_eff = {effective:g} allows: no "
                             "gradient noise multiplier exists.")
        return 1.0 / math.sqrt(remaining / (1.0 + ratio ** -2) if ratio is not None else remaining)


@dataclass(frozen=True)
class AdaptiveClipping:
    """Configuration of private quantile-tracking clipping (Andrew et al. 2021); immutable.

    Args:
        target_quantile (`float`, defaults to 0.5): γ ∈ (0, 1), the quantile of the per-unit norms to clip at.
            The paper's experiments clip at the median.
        learning_rate (`float`, defaults to 0.2): η_C > 0 of the geometric update C ← C·exp(−η_C(b̃ − γ)); the paper's
            value. log C moves by at most η_C·max(γ, 1 − γ) per step.
        initial_norm (`float`, defaults to 0.1): C_0 > 0, the paper's initial clip; the geometric update recovers
            from a C_0 that is orders of magnitude off in tens to hundreds of steps.
        count_noise (`float`, *optional*): σ_b > 0, the std of the noise on the centred count in count units;
            `None` for the paper's m/20 once the expected batch size m is known.
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    initial_norm: float = 0.1
    count_noise: float | None = None

    def __post_init__(self):
        quantile = self.target_quantile
        if not (isinstance(quantile, (int, float)) and 0.0 < quantile < 1.0):
            raise ValueError(f"target_quantile must lie strictly between 0 and 1, got {quantile!r} "
                             "(0.5 clips at the median norm).")
        object.__setattr__(self, "target_quantile", float(quantile))
        object.__setattr__(self, "learning_rate", positive_finite("learning_rate", self.learning_rate))
        object.__setattr__(self, "initial_norm", positive_finite("initial_norm", self.initial_norm))
        if self.count_noise is not None:
            object.__setattr__(self, "count_noise", positive_finite("count_noise", self.count_noise))

    def count_noise_for(self, expected_batch_size: float) -> float:
        """σ_b for expected batch size m: `count_noise`, or m/20 when it is None."""
        return resolve_count_noise(self.count_noise, expected_batch_size)

    def gradient_noise_multiplier(self, effective_noise_multiplier: float, expected_batch_size: float,
                                  logging_noise_ratio: float | None = None) -> float:
        """[`gradient_noise_multiplier`] with this config's σ_b."""
        return gradient_noise_multiplier(effective_noise_multiplier, self.count_noise_for(expected_batch_size),
                                         expected_batch_size, logging_noise_ratio)

    def effective_noise_multiplier(self, noise_multiplier: float, expected_batch_size: float,
                                   logging_noise_ratio: float | None = None) -> float:
        """[`effective_noise_multiplier`] with this config's σ_b."""
        return effective_noise_multiplier(noise_multiplier, self.count_noise_for(expected_batch_size),
                                          expected_batch_size, logging_noise_ratio)
