"""The noise algebra of private adaptive clipping (Andrew et al. 2021): pure math, no torch.

Each adaptive-clipping step releases the clipped gradient sum (noise multiplier σ_Δ) and a centred count of
unclipped units (sensitivity 1/2, noise std σ_b, so noise multiplier 2σ_b) on the same Poisson sample; together
they are one Gaussian release with σ_eff = (σ_Δ⁻² + (2σ_b)⁻²)^(-1/2) (plus (r·σ_Δ)⁻² with private loss
logging), which is what the accountant composes. [`gradient_noise_multiplier`] and [`effective_noise_multiplier`]
convert between the two, [`default_count_noise`] is the paper's σ_b = m/20.

Used by the planner (`hf-dp plan --adaptive_clipping`, which must not load torch) and by the trainer through
[`hf_dp.clipping.adaptive`] (the quantile tracker, on tensors), which re-exports these names.
"""
from __future__ import annotations

import math

__all__ = [
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
    sigma_eff = positive_finite("effective_noise_multiplier", effective_noise_multiplier)
    sigma_b = resolve_count_noise(count_noise, expected_batch_size)
    ratio = _logging_ratio(logging_noise_ratio)
    count_multiplier = sigma_b / COUNT_SENSITIVITY
    remaining = sigma_eff ** -2 - count_multiplier ** -2  # the precision left for the gradient (and loss)
    if not remaining > 0.0 or not math.isfinite(1.0 / remaining):
        default = ("" if count_noise is not None
                   else f" (the default m/20 with expected_batch_size={expected_batch_size:g})")
        raise ValueError(
            f"count_noise σ_b={sigma_b:g}{default} gives the clipped-count release a noise multiplier "
            f"2σ_b={count_multiplier:g}, not above the effective noise multiplier σ_eff={sigma_eff:g} that the whole "
            f"step may spend: the count alone would exceed the budget and no gradient noise multiplier exists. "
            f"Raise count_noise above {sigma_eff / 2:g} (a few times that keeps the gradient noise close to σ_eff), "
            f"raise the expected batch size, or raise the target ε (a smaller σ_eff)."
        )
    gradient_precision = remaining / (1.0 + ratio ** -2) if ratio is not None else remaining
    return 1.0 / math.sqrt(gradient_precision)


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
    sigma = positive_finite("noise_multiplier", noise_multiplier)
    sigma_b = resolve_count_noise(count_noise, expected_batch_size)
    ratio = _logging_ratio(logging_noise_ratio)
    precision = sigma ** -2 + (sigma_b / COUNT_SENSITIVITY) ** -2
    if ratio is not None:
        precision += (ratio * sigma) ** -2
    return 1.0 / math.sqrt(precision)
