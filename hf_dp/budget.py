"""The run's privacy budget: its accountant, the plan it composes and the target ε it must stay within.

The trainer reaches the accountant only through this object: the sampler asks `allows(step)` before drawing a
step's batch, the step calls `record_step()` once its releases are made, and logs, reports and checkpoints read
`epsilon()` and `accountant`.
"""

from __future__ import annotations

import logging

from . import accounting
from .privacy_plan import PrivacyPlan

logger = logging.getLogger(__name__)


class PrivacyBudget:
    """ε spent so far, and whether the next step keeps it within `target_epsilon` (`None`: no target, a fixed σ).

    Args:
        plan: the privacy plan whose steps are composed.
        target_epsilon: the budget; `None` when σ was given without one.
        bound_epsilon: ε spent choosing the contribution bound from the data (recorded as a pure-DP release).
    """

    def __init__(self, plan: PrivacyPlan, target_epsilon: float | None, bound_epsilon: float = 0.0):
        self.target_epsilon = target_epsilon
        self.accountant = accounting.PrivacyAccountant()
        if bound_epsilon:
            self.accountant.record_pure_dp("contribution_bound", bound_epsilon)
        self.replan(plan)

    def replan(self, plan: PrivacyPlan) -> None:
        """Use `plan` from now on (a resumed run rebuilds its plan with the checkpoint's data secret)."""
        self.plan = plan
        self._plan_fits: bool | None = None
        # What each step composes, read from the plan once.
        self._step_entry = {"sample_rate": plan.sample_rate, "noise_multiplier": plan.effective_noise_multiplier,
                            "group_size": plan.group_size}

    def restore(self, accountant: accounting.PrivacyAccountant) -> None:
        """Continue from a checkpoint's accountant (already checked against the plan)."""
        self.accountant.load_state_dict(accountant.state_dict())
        self._plan_fits = None

    def copy(self) -> PrivacyBudget:
        """An independent copy, its ledger copied (the state before a step, which a just-in-time save writes)."""
        other = PrivacyBudget(self.plan, self.target_epsilon)
        other.restore(self.accountant)
        return other

    @property
    def steps(self) -> int:
        return self.accountant.steps

    @property
    def bound_epsilon(self) -> float:
        """ε of the ε-DP choice of the contribution bound (0 when G was given)."""
        return sum(r["epsilon"] for r in self.accountant.pure_dp if r["label"] == "contribution_bound")

    def epsilon(self) -> float:
        """ε spent so far at the plan's δ (the accountant's conservative bound)."""
        if self.accountant.steps:
            return self.accountant.epsilon(self.plan.delta)
        return self.accountant.pure_dp_epsilon  # before the first step: the choice of G, if any

    def delta(self) -> float:
        """The stated δ: the plan's (the accountant's) plus what the noise sampler's finite support adds so far."""
        return self.plan.delta + self.sampler_delta()

    def sampler_delta(self) -> float:
        """What the noise sampler's finite support adds to δ over the steps taken (at the ε spent)."""
        return self.plan.sampler_delta(self.epsilon(), self.accountant.steps)

    def epsilon_bounds(self) -> tuple[float, float, float]:
        """(lower, estimate, upper) ε so far."""
        if self.accountant.steps:
            return self.accountant.epsilon_bounds(self.plan.delta)
        return (self.accountant.pure_dp_epsilon,) * 3

    def allows(self, step: int) -> bool:
        """Whether step `step` (0-based) keeps ε within the target: asked before its batch is drawn."""
        if self.target_epsilon is None or self._whole_plan_fits():
            return True
        epsilon = self._epsilon_after(step + 1 - self.accountant.steps)
        if epsilon <= self.target_epsilon:
            return True
        if step == self.accountant.steps:  # later steps: record_step has said so already
            logger.warning("Privacy budget spent: step %d would bring ε to %.4g > target_epsilon=%g; no step taken.",
                           step + 1, epsilon, self.target_epsilon)
        return False

    def record_step(self) -> bool:
        """Compose one step's releases; `False` when one more step would exceed the target (training stops)."""
        plan = self.plan
        self.accountant.step(**self._step_entry)
        if self.target_epsilon is None or self._whole_plan_fits() or self.accountant.steps >= plan.steps:
            return True
        next_epsilon = self.accountant.epsilon_after(plan.delta, steps=1)
        if next_epsilon > self.target_epsilon:
            logger.warning("Stopping after step %d: one more step would spend ε=%.4g > target %g.",
                           self.accountant.steps, next_epsilon, self.target_epsilon)
            return False
        return True

    def _whole_plan_fits(self) -> bool:
        """Whether every planned step keeps ε within the target (then no step needs its own check: one accounting,
        not one per step, which matters at small ε and long runs)."""
        if self._plan_fits is None:
            self._plan_fits = self._epsilon_after(max(0, self.plan.steps - self.accountant.steps)) \
                <= self.target_epsilon
        return self._plan_fits

    def _epsilon_after(self, steps: int) -> float:
        plan = self.plan
        return self.accountant.epsilon_after(plan.delta, steps=steps, sample_rate=plan.sample_rate,
                                             noise_multiplier=plan.effective_noise_multiplier,
                                             group_size=plan.group_size)
