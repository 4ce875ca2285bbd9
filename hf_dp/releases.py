"""The scalars a DP step releases beside the gradient, and their noise.

Per step the clipped units give three sums (`StepSums`): their losses clipped to [0, max_loss], the count of units
whose gradient was clipped, and adaptive clipping's centred count Σ (1[norm ≤ C] − ½). After the all-reduce,
`ScalarReleases` noises the ones the plan releases, once, with the same noise on every rank (the shared seed):
- fixed C with private logging: the loss sum (σ_log·max_loss) and the clipped count (σ_log);
- adaptive clipping: the centred count (σ_b, always: it sets the next C), and with private logging the loss sum.
The accountant composes them with the gradient (see `hf_dp.privacy_plan`). Nothing is read back to the host until
a log line needs it.
"""

from __future__ import annotations

import torch

from .clipping.adaptive import QuantileTracker, centered_unclipped_count
from .noise import add_scalar_noise
from .privacy_plan import PrivacyPlan


class StepSums:
    """The step's summed statistics over its clipped units, on the device, in float64 (one tensor: one all-reduce)."""

    _LOSS, _CLIPPED, _CENTERED_UNCLIPPED = range(3)

    def __init__(self, device):
        self.values = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, unit_losses: torch.Tensor, norms: torch.Tensor, max_grad_norm, max_loss: float) -> None:
        """Add one micro-batch: `unit_losses` and `norms` are `(U,)`, one per unit in the same order."""
        # Bounded per unit, a NaN included, so one unit moves the loss sum by at most max_loss.
        unit_losses = torch.nan_to_num(unit_losses.float(), nan=max_loss).clamp(0.0, max_loss)
        self.values += torch.stack([unit_losses.sum(dtype=torch.float64), (norms > max_grad_norm).sum(),
                                    centered_unclipped_count(norms, max_grad_norm)]).to(self.values)

    def all_reduce(self) -> None:
        torch.distributed.all_reduce(self.values)

    @property
    def loss_sum_and_clipped_units(self) -> torch.Tensor:
        """`(2,)`: the loss sum and the clipped count, as one view (one noise addition, no copy)."""
        return self.values[self._LOSS: self._CLIPPED + 1]

    @property
    def loss_sum(self) -> torch.Tensor:
        return self.values[self._LOSS]

    @property
    def clipped_units(self) -> torch.Tensor:
        return self.values[self._CLIPPED]

    @property
    def centered_unclipped(self) -> torch.Tensor:
        return self.values[self._CENTERED_UNCLIPPED]


class ScalarReleases:
    """Noises a step's sums as the plan says, and keeps the noised clipped fractions until the next log line."""

    def __init__(self, plan: PrivacyPlan, max_loss: float, seed: int, secure_noise: bool = False):
        self.plan, self.max_loss, self.seed, self.secure = plan, max_loss, seed, secure_noise
        self._private_logging, self._expected_batch_size = plan.private_logging, plan.expected_batch_size  # read once
        self._fraction_sum, self._steps = 0.0, 0  # noised per-step clipped fractions since the last log

    def release(self, sums: StepSums, step: int, tracker: QuantileTracker | None) -> torch.Tensor | None:
        """Noise the step's sums (after the all-reduce); update adaptive clipping's C on the device.

        Returns the noised loss sum (a device tensor), or `None` when no loss is released.
        """
        plan, private_logging, expected_batch_size = self.plan, self._private_logging, self._expected_batch_size
        loss_noise = plan.logging_noise_multiplier * self.max_loss if private_logging else None

        def noised(values, stds):
            return add_scalar_noise(values, stds, seed=self.seed, step=step, secure=self.secure)

        if tracker is None:
            if not private_logging:
                return None
            loss_sum, clipped = noised(sums.loss_sum_and_clipped_units, [loss_noise, plan.logging_noise_multiplier])
            fraction = clipped / expected_batch_size
        else:
            if private_logging:
                released = noised(torch.stack([sums.centered_unclipped, sums.loss_sum]), [plan.count_noise, loss_noise])
            else:
                released = noised(sums.centered_unclipped.reshape(1), [plan.count_noise])
            # ½ − R/m: the clipped fraction at this step's C, a post-processing of the count.
            fraction = tracker.clipped_fraction(released[0], expected_batch_size)
            tracker.update(released[0], expected_batch_size)  # C for the next step, on the device
            loss_sum = released[1] if private_logging else None
        self._fraction_sum = self._fraction_sum + fraction
        self._steps += 1
        return loss_sum

    def take_clipped_fraction(self) -> float | None:
        """The mean noised clipped fraction since the last call (read back here), or `None` if none was released."""
        fraction = float(self._fraction_sum) / self._steps if self._steps else None
        self._fraction_sum, self._steps = 0.0, 0
        return fraction
