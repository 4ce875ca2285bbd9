"""Private adaptive clipping: the clipping norm follows a quantile of the per-unit gradient norms.

Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially private learning with adaptive clipping"
(NeurIPS 2021, arXiv 1905.03871). A fixed `max_grad_norm` C has no good default: the norm distribution
depends on the model, the loss, the learning rate, the number of examples per user, and it drifts as training
goes. The paper instead clips at the γ-quantile of the per-unit norms (γ = 0.5 in its experiments) and estimates
that quantile online, privately, for a negligible share of the budget.

Per DP-SGD step, over the same Poisson sample of units (users for ULS, examples for ELS and example-level):

1. clip every unit's gradient to the current norm C_t and release the noised sum (sensitivity C_t, noise σ_Δ·C_t);
2. release the noised *centred* count of unclipped units
   R_t = Σ_i (1[‖g_i‖ ≤ C_t] − 1/2) + N(0, σ_b²)      ([`centered_unclipped_count`] plus the noise);
3. b̃_t = R_t / m + 1/2 (m the *expected* batch size, never the sampled one: that one is private) estimates the
   fraction of units left unclipped, and the geometric update (Section 2 of the paper)
   C_{t+1} = C_t · exp(−η_C · (b̃_t − γ))                      ([`QuantileTracker.update`])
   moves C towards the γ-quantile: up when too many units are clipped, down when too few.

Why the count is centred: adding or removing one unit moves Σ_i 1[·] by 1, but moves Σ_i (1[·] − 1/2) by
exactly 1/2, so the count's sensitivity is 1/2 and its noise multiplier is σ_b / (1/2) = 2σ_b.

Privacy (Section 3, Theorem 1 of the paper): both sums are Gaussian releases on the *same* Poisson sample. Scaled
by their noise, one unit shifts the pair (gradient sum / (σ_Δ C_t), count / σ_b) by a vector of norm at most
(σ_Δ⁻² + (2σ_b)⁻²)^(1/2), and an isotropic Gaussian is rotation invariant, so the step is exactly one
Poisson-subsampled Gaussian release with noise multiplier

    σ_eff = (σ_Δ⁻² + (2σ_b)⁻²)^(-1/2).

C_t depends only on earlier releases (post-processing), so the T steps are an adaptive composition of such
releases and the accountant composes them exactly as it composes fixed-norm DP-SGD with σ_eff. For ELS a user
with k sampled examples shifts every component by at most k times its sensitivity, so the mixture-of-Gaussians
accountant applies with the same σ_eff. The trainer calibrates σ_eff to the target ε and derives σ_Δ with
[`gradient_noise_multiplier`]; ε does not depend on C, so the data-driven C costs nothing beyond the count.

Logging: with private logging the fixed-norm trainer releases the clipped losses (noise σ_log = r·σ) *and* the
count of clipped units (noise σ_log). With adaptive clipping the count release is REPLACED by R_t: it is already
a noised count of the units clipped at C_t, so the logged `dp/clipped_fraction` is 1 − b̃_t = 1/2 − R_t/m
([`QuantileTracker.clipped_fraction`]), an unbiased estimate of E[#clipped]/m (the same mean as the old
release; it differs from #clipped/m by the zero-mean sampling term (n − m)/(2m)). Releasing a second count would
spend budget on a number already published. Only the loss term remains from logging, so

    σ_eff⁻² = σ_Δ⁻² + (2σ_b)⁻² + (r·σ_Δ)⁻²        (r = `logging_noise_ratio`, the loss term only with r given).

Units and defaults: σ_b is in count units (absolute), not a multiplier; the paper's default is σ_b = m/20
([`default_count_noise`]): the noise on b̃ then has std 0.05, and for any practical DP-SGD batch 2σ_b = m/10 ≫ σ_eff,
so the count costs little (m = 64, σ_eff = 0.8: σ_Δ = 0.806, +0.8 % gradient noise). The paper's other defaults:
γ = 0.5, η_C = 0.2, C_0 = 0.1 (Section 5); with the geometric update C_0 a factor 100 off costs only tens to a few
hundred steps (rate ≤ η_C·max(γ, 1 − γ) in log C per step).

```python
from hf_dp.clipping.adaptive import AdaptiveClipping, centered_unclipped_count

config = AdaptiveClipping(target_quantile=0.5)               # σ_b = m/20 by default
sigma = config.gradient_noise_multiplier(sigma_eff, expected_batch_size=m, logging_noise_ratio=10.0)
tracker = QuantileTracker.start(config, expected_batch_size=m)
# per step: clip at tracker.norm, noise the gradient sum with sigma * tracker.norm, and
count = centered_unclipped_count(norms, tracker.norm)        # on device, summed over micro-batches and ranks
released = float(count) + noise_with_std(tracker.count_noise)  # noised once, after the all-reduce
logged_clipped_fraction = tracker.clipped_fraction(released, m)
tracker.update(released, m)                                  # C for the next step
```
"""
from __future__ import annotations

import math
import torch

from ..accounting.adaptive_noise import (
    COUNT_SENSITIVITY,
    AdaptiveClipping,
    DEFAULT_COUNT_NOISE_FRACTION,
    default_count_noise,
    effective_noise_multiplier,
    gradient_noise_multiplier,
    positive_finite,
)

__all__ = [
    "COUNT_SENSITIVITY",
    "DEFAULT_COUNT_NOISE_FRACTION",
    "AdaptiveClipping",
    "QuantileTracker",
    "centered_unclipped_count",
    "default_count_noise",
    "effective_noise_multiplier",
    "gradient_noise_multiplier",
]

_NORM_RANGE = (1e-300, 1e300)  # a tracked C outside this range has left the floating-point range


def _tracked_norm(norm: float, steps: int) -> float:
    """`norm` if it is a usable clipping norm; else the error that says why training cannot go on."""
    if not (math.isfinite(norm) and _NORM_RANGE[0] < norm < _NORM_RANGE[1]):  # only after ~10⁴ steps all one way
        raise ValueError(f"the tracked clipping norm left the floating-point range ({norm!r}) after "
                         f"{steps} steps: the per-unit norms are 0 or infinite.")
    return norm


def centered_unclipped_count(norms: torch.Tensor, max_grad_norm) -> torch.Tensor:
    """Σ_i (1[norms_i ≤ C] − 1/2): the centred count of units left unclipped at C, before noise.

    A unit with norm exactly C is unclipped (its clip factor min(1, C/‖g‖) is 1). Centring makes the sensitivity
    1/2 instead of 1 (Andrew et al. 2021, Section 3), which halves the noise the count needs. Partial counts over
    micro-batches and ranks add up to the count over the whole logical batch, so sum them (all-reduce) and noise
    the total once. Stays on the tensor's device with no host sync: the comparison and sum are device ops and the
    number of units comes from the shape.

    Args:
        norms (`torch.Tensor`): 1-D per-unit gradient norms (only the units in the sample; no padding units).
        max_grad_norm (`float` or 0-dim `torch.Tensor`): the clipping norm C used this step.

    Returns:
        `torch.Tensor`: 0-dim float32 on `norms.device` (exact: half-integers up to 2²³ units).

    Raises:
        ValueError: `norms` is not 1-D.
    """
    if norms.dim() != 1:
        raise ValueError(f"norms must be 1-D (one norm per unit), got shape {tuple(norms.shape)}.")
    if isinstance(max_grad_norm, torch.Tensor):
        max_grad_norm = max_grad_norm.to(device=norms.device, dtype=norms.dtype)
    unclipped = (norms <= max_grad_norm).sum(dtype=torch.float32)
    return unclipped - COUNT_SENSITIVITY * norms.shape[0]


class QuantileTracker:
    """The running clipping norm C of private quantile tracking: the state a checkpoint must carry.

    `norm` is the C to clip at in the next step; `update` applies one step's released count. `to_dict` /
    `from_dict` round-trip it through JSON (resume must continue from the same C, or the run differs from an
    uninterrupted one; ε does not depend on C). `count_noise` σ_b is part of the state because the ledger's σ_eff
    was derived with it: a resumed run must noise the count the same way.

    C has one home: a float, or, once a step moved it on an accelerator, a 0-dim float64 tensor there
    ([`norm_on`]; `update` with a tensor count), so a step never reads it back. `norm` reads it when asked (logs,
    checkpoints, the report).
    """

    def __init__(self, target_quantile: float, learning_rate: float, count_noise: float, norm: float,
                 steps: int = 0):
        config = AdaptiveClipping(target_quantile, learning_rate, 1.0, count_noise)  # validates
        self.target_quantile = config.target_quantile
        self.learning_rate = config.learning_rate
        self.count_noise = positive_finite("count_noise", count_noise)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be a non-negative integer, got {steps!r}.")
        self.steps = steps
        self._norm: float | torch.Tensor = positive_finite("norm", norm)
        self._read: tuple | None = None  # (device tensor, its float value): read back once per change

    @classmethod
    def start(cls, config: AdaptiveClipping, expected_batch_size: float) -> QuantileTracker:
        """A fresh tracker at C_0 = `config.initial_norm`, σ_b resolved for expected batch size m."""
        return cls(target_quantile=config.target_quantile, learning_rate=config.learning_rate,
                   count_noise=config.count_noise_for(expected_batch_size), norm=config.initial_norm)

    @property
    def norm(self) -> float:
        """C for the next step (read back from the device when it lives there; raises if it left the float range)."""
        if not isinstance(self._norm, torch.Tensor):
            return self._norm
        if self._read is None or self._read[0] is not self._norm:
            self._read = (self._norm, _tracked_norm(float(self._norm), self.steps))
        return self._read[1]

    def norm_on(self, device) -> torch.Tensor:
        """C as a 0-dim float64 tensor on `device`, the one the next [`update`] with a tensor count moves."""
        target = torch.device(device)
        norm = self._norm
        if not (isinstance(norm, torch.Tensor) and norm.device.type == target.type
                and (target.index is None or norm.device.index == target.index)):
            norm = self._norm = torch.tensor(self.norm, dtype=torch.float64, device=target)
        return norm

    def copy(self) -> QuantileTracker:
        """An independent copy (a device C is cloned on its device, not read back)."""
        other = QuantileTracker(self.target_quantile, self.learning_rate, self.count_noise, 1.0, self.steps)
        other._norm = self._norm.clone() if isinstance(self._norm, torch.Tensor) else self._norm
        return other

    def __repr__(self) -> str:
        return (f"QuantileTracker(target_quantile={self.target_quantile}, learning_rate={self.learning_rate}, "
                f"count_noise={self.count_noise}, norm={self.norm}, steps={self.steps})")

    def __eq__(self, other) -> bool:
        return isinstance(other, QuantileTracker) and self.to_dict() == other.to_dict()

    @staticmethod
    def unclipped_fraction(noised_centered_count, expected_batch_size: float):
        """b̃ = R/m + 1/2: the released estimate of the fraction of units with norm ≤ C, unclamped.

        Divided by the expected batch size m, not the sampled size (which is private and not released); for
        Poisson sampling E[b̃] = E[#unclipped]/m exactly. A tensor count gives a tensor, on its device.
        """
        expected_batch_size = positive_finite("expected_batch_size", expected_batch_size)
        if isinstance(noised_centered_count, torch.Tensor):
            return noised_centered_count / expected_batch_size + 0.5
        released = float(noised_centered_count)
        if not math.isfinite(released):
            raise ValueError(f"noised_centered_count must be finite, got {released!r}.")
        return released / expected_batch_size + 0.5

    @classmethod
    def clipped_fraction(cls, noised_centered_count, expected_batch_size: float):
        """1 − b̃ = 1/2 − R/m: the logged `dp/clipped_fraction` (replaces the fixed-norm clipped-count release).

        Unclamped, so that its average over a logging window stays unbiased for E[#clipped]/m.
        """
        return 1.0 - cls.unclipped_fraction(noised_centered_count, expected_batch_size)

    def update(self, noised_centered_count, expected_batch_size: float):
        """One geometric step C ← C·exp(−η_C·(b̃ − γ)) (Andrew et al. 2021, Section 2); returns the new C.

        `noised_centered_count` is R = [`centered_unclipped_count`] at the current C, summed over the whole logical
        batch, plus N(0, σ_b²) drawn once. b̃ = R/m + 1/2 is clamped to [0, 1] before the step (post-processing,
        as in the paper's TensorFlow Privacy implementation): noise cannot push it outside the range a fraction
        can take, so C moves by at most a factor exp(η_C·max(γ, 1 − γ)) per step.

        A 0-dim tensor count updates C on its device and returns it as a tensor, with no host sync (a C that left
        the floating-point range is reported when `norm` is next read); a number updates and returns a float.

        Raises:
            ValueError: the count is not finite or `expected_batch_size` is not positive and finite.
        """
        fraction = self.unclipped_fraction(noised_centered_count, expected_batch_size)
        if isinstance(fraction, torch.Tensor):
            norm = self.norm_on(fraction.device)
            norm = norm * torch.exp(-self.learning_rate * (fraction.clamp(0.0, 1.0) - self.target_quantile))
            self._norm = norm.clamp(_NORM_RANGE[0], _NORM_RANGE[1])  # outside: reported when `norm` is read
            self.steps += 1
            return self._norm
        fraction = min(1.0, max(0.0, fraction))
        norm = _tracked_norm(self.norm * math.exp(-self.learning_rate * (fraction - self.target_quantile)), self.steps)
        self._norm = norm  # the host's C is the current one
        self.steps += 1
        return norm

    def to_dict(self) -> dict:
        """JSON-serialisable state for checkpoints."""
        return {"target_quantile": self.target_quantile, "learning_rate": self.learning_rate,
                "count_noise": self.count_noise, "norm": self.norm, "steps": self.steps}

    @classmethod
    def from_dict(cls, state: dict) -> QuantileTracker:
        """The tracker saved by [`to_dict`]; raises ValueError on missing or unknown keys or invalid values."""
        expected = {"target_quantile", "learning_rate", "count_noise", "norm", "steps"}
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a QuantileTracker state: expected keys {sorted(expected)}, got {got}.")
        return cls(**state)
