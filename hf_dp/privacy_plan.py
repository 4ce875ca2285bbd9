"""The privacy plan: what the accountant composes, fixed from the arguments and the user partition before step 1.

Each step releases up to three noised sums over the same Poisson sample: the clipped gradients (sensitivity C,
noise σ·C); with private logging the clipped losses (sensitivity `max_loss`, noise σ_log·max_loss, σ_log = r·σ,
r = `logging_noise_ratio`) and, for a fixed C, the count of clipped units (sensitivity 1, noise σ_log); with
adaptive clipping the centred count of unclipped units (sensitivity 1/2, noise σ_b), released every step because
it sets the next C. Scaled by their noise they are one Gaussian release whose noise multiplier is

    σ_eff = (σ⁻² + 2·σ_log⁻²)^(-1/2)                     fixed C, private logging
    σ_eff = (σ⁻² + (2σ_b)⁻² [+ σ_log⁻²])^(-1/2)          adaptive clipping (Andrew et al. 2021, Theorem 1)

For ELS a user with k sampled examples moves each sum by at most k times its sensitivity, so the
mixture-of-Gaussians accountant applies with that σ_eff too. The gradient noise of a step clipped at C_t is σ·C_t,
so ε does not depend on the C reached.

Every step draws one noise value per trainable parameter and per released scalar (`noise_draws_per_step`): the
stated δ adds what the sampler's finite support leaves ([`~hf_dp.accounting.floating_point.sampler_delta`]), and
a plan where that exceeds 1% of δ is refused.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from . import accounting
from .accounting.adaptive_noise import AdaptiveClipping, StepReleases
from .accounting.floating_point import check_sampler_delta, sampler_delta
from .arguments import DPTrainingArguments
from .contribution import bound_epsilon
from .data import UserPartition
from .mechanisms import DPMechanism, get_mechanism

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrivacyPlan:
    """What the accountant composes at every step; `steps` and the noise are final once it is built."""

    mechanism: str  # "uls" | "els" | "example": a key of hf_dp.vocabulary.MECHANISMS
    num_units: int  # units sampled: users (ULS) or rows (ELS, example-level)
    num_privacy_units: int  # units protected: users, or rows for example-level
    sample_rate: float
    steps: int
    noise_multiplier: float  # σ of the gradient
    delta: float
    contribution_bound: int | None  # G: the most rows one user contributes; None: every row kept
    logging_noise_multiplier: float | None = None  # σ_log of the logged loss (and fixed-C count); None: not logged
    effective_noise_multiplier: float | None = None  # σ_eff the accountant composes
    adaptive_clipping: AdaptiveClipping | None = None  # C tracks a quantile from C_0 = max_grad_norm; None: fixed C
    count_noise: float | None = None  # σ_b of the adaptive count, in units; None for a fixed C
    noise_draws_per_step: int | None = None  # Gaussian draws per step (trainable parameters + released scalars)
    max_grad_norm: float | None = None  # C, fixed, or adaptive clipping's C_0

    @property
    def dp_mechanism(self) -> DPMechanism:
        """The mechanism object of `mechanism` ([`~hf_dp.mechanisms`])."""
        return get_mechanism(self.mechanism)

    @property
    def group_size(self) -> int:
        """The accountant's mixture size: G for ELS (a user moves up to G sampled rows), else 1."""
        return self.dp_mechanism.group_size(self.contribution_bound)

    @property
    def expected_batch_size(self) -> float:
        """q·N, what every step's clipped sums and noise are divided by."""
        return self.sample_rate * self.num_units

    @property
    def private_logging(self) -> bool:
        return self.logging_noise_multiplier is not None

    def sampler_delta(self, epsilon: float, steps: int) -> float:
        """δ the noise sampler's finite support adds after `steps` steps at total ε `epsilon` (0 with no step)."""
        if self.noise_draws_per_step is None:
            raise ValueError("This PrivacyPlan does not say how many noise values a step draws "
                             "(noise_draws_per_step), so the δ its noise adds cannot be stated.")
        return sampler_delta(epsilon=epsilon, delta=self.delta, draws=steps * self.noise_draws_per_step)

    def fingerprint(self, args: DPTrainingArguments) -> dict:
        """Everything a resumed run must share with the checkpoint for the ledger to stay true."""
        adaptive = self.adaptive_clipping
        return {
            "privacy_unit": args.privacy_unit,
            "mechanism": self.mechanism,
            "max_grad_norm": args.max_grad_norm,
            "noise_multiplier": self.noise_multiplier,
            "logging_noise_multiplier": self.logging_noise_multiplier,
            "max_loss": args.max_loss if self.private_logging else None,
            "sample_rate": self.sample_rate,
            "contribution_bound": self.contribution_bound,
            "redraw_rows": args.redraw_rows,
            "target_epsilon": args.target_epsilon,
            "target_delta": self.delta,
            "num_units": self.num_units,
            "adaptive_clipping": adaptive is not None,
            "target_unclipped_quantile": adaptive.target_quantile if adaptive else None,
            "clipping_learning_rate": adaptive.learning_rate if adaptive else None,
            "clipping_count_noise": self.count_noise,
        }


def plan_privacy(args: DPTrainingArguments, partition: UserPartition, *, noised_elements: int,
                 max_steps: int | None = None) -> PrivacyPlan:
    """The plan for these arguments and this partition, noising `noised_elements` gradient values per step (the
    trainable parameters), for `max_steps` steps (default `args.max_steps`; ≤ 0: from `num_train_epochs`). The
    arguments are not changed (the trainer sets `args.max_steps` to `plan.steps`).

    Raises:
        ValueError: fewer than 2 privacy units, an expected batch above the units, δ ≥ 1/units, a budget no noise
            meets, a first step that alone exceeds `target_epsilon`, an adaptive count noise that alone would
            spend the budget, or an ε beyond what the noise sampler can state (its finite support would add more
            than 1% of δ: the message names the largest ε it can state).
    """
    mechanism = get_mechanism(args.mechanism)
    num_units, num_privacy_units = mechanism.num_units(partition), mechanism.num_privacy_units(partition)
    unit_name = "users" if mechanism.protects_users else "examples"
    if num_privacy_units < 2:
        raise ValueError(
            f"The training data has {num_privacy_units} {unit_name[:-1]}: a {args.privacy_unit}-level guarantee "
            f"needs many {unit_name}. Check --user_id_column ({args.user_id_column!r}) or add data."
        )
    sample_rate = args.expected_batch_size / num_units
    if sample_rate > 1:
        raise ValueError(
            f"expected_batch_size={args.expected_batch_size} exceeds the {num_units} "
            f"{'users' if mechanism.samples_users else 'examples'} available: lower --expected_batch_size."
        )
    max_steps = args.max_steps if max_steps is None else max_steps
    steps = max_steps if max_steps > 0 else math.ceil(args.num_train_epochs / sample_rate)
    delta = args.target_delta if args.target_delta is not None else 1.0 / (10 * num_privacy_units)
    if delta >= 1.0 / num_privacy_units:
        raise ValueError(
            f"target_delta={delta:g} is not below 1/{num_privacy_units} {unit_name}: such a δ allows "
            f"releasing a whole {args.privacy_unit}'s data. Lower --target_delta (default 1/(10·{unit_name}))."
        )
    group_size = mechanism.group_size(partition.contribution_bound)
    ratio = args.logging_noise_ratio if args.private_logging else None
    adaptive = adaptive_clipping(args)
    count_noise = adaptive.count_noise_for(args.expected_batch_size) if adaptive else None
    releases = StepReleases(ratio, count_noise)
    sigma = args.noise_multiplier
    effective = None if sigma is None else releases.effective_noise_multiplier(sigma)
    spent_on_bound = bound_epsilon(args)  # spent choosing G: DP-SGD gets the rest of the target
    if sigma is None:
        try:
            effective = accounting.noise_multiplier(
                target_epsilon=args.target_epsilon - spent_on_bound, delta=delta, sample_rate=sample_rate,
                steps=steps, group_size=group_size,
            )
        except ValueError as error:
            raise ValueError(
                f"{error} Planned: {steps} steps at sample rate {sample_rate:.4g}. Raise --target_epsilon, "
                "or train fewer steps/epochs or with a smaller --expected_batch_size."
            ) from error
        sigma = _gradient_noise(effective, releases, args)
    else:
        _check_fixed_noise(args, sigma, effective, sample_rate, steps, delta, group_size, spent_on_bound)
    # The released scalars: the loss sum and the clipped count (private logging, fixed C); adaptive clipping's count.
    scalars = (2 if ratio else 0) if count_noise is None else 1 + (1 if ratio else 0)
    draws = int(noised_elements) + scalars
    planned_epsilon = args.target_epsilon if args.target_epsilon is not None else spent_on_bound + accounting.epsilon(
        sample_rate=sample_rate, noise_multiplier=effective, steps=steps, delta=delta, group_size=group_size)
    named = "target_epsilon" if args.target_epsilon is not None else f"the ε of noise_multiplier={sigma:g}"
    check_sampler_delta(epsilon=planned_epsilon, delta=delta, draws=steps * draws, what=named)
    return PrivacyPlan(mechanism.key, num_units, num_privacy_units, sample_rate, steps, float(sigma), delta,
                       partition.contribution_bound, logging_noise_multiplier=ratio * sigma if ratio else None,
                       effective_noise_multiplier=float(effective), adaptive_clipping=adaptive,
                       count_noise=count_noise, noise_draws_per_step=draws, max_grad_norm=args.max_grad_norm)


def adaptive_clipping(args: DPTrainingArguments) -> AdaptiveClipping | None:
    """The adaptive clipping configuration of the arguments (C_0 = `max_grad_norm`), or `None` for a fixed C."""
    if not args.adaptive_clipping:
        return None
    return AdaptiveClipping(target_quantile=args.target_unclipped_quantile, learning_rate=args.clipping_learning_rate,
                            initial_norm=args.max_grad_norm, count_noise=args.clipping_count_noise)


def _check_fixed_noise(args, sigma, effective, sample_rate, steps, delta, group_size, spent_on_bound) -> None:
    """A given σ: refuse one whose ε the accountant cannot compute or whose first step exceeds the target; warn
    when the plan would stop early."""
    def epsilon(steps):
        try:
            with np.errstate(all="ignore"):  # an overflow here is reported below, as what it means
                return accounting.epsilon(sample_rate=sample_rate, noise_multiplier=effective, steps=steps,
                                          delta=delta, group_size=group_size)
        except (RuntimeError, ValueError, OverflowError, FloatingPointError) as error:
            raise ValueError(f"noise_multiplier={sigma:g} is too small for the accountant to bound ε over {steps} "
                             f"step(s) at sample rate {sample_rate:.3g} ({error}): ε would be astronomically large. "
                             "Raise --noise_multiplier (typically 0.3 to 5) or set --target_epsilon to calibrate it."
                             ) from None

    if args.target_epsilon is None:
        epsilon(steps)  # the ε the run will report must be computable before any step
        return
    first = epsilon(1)
    if first + spent_on_bound > args.target_epsilon:
        raise ValueError(
            f"noise_multiplier={sigma:g} spends ε={first:.3g} on the first step alone, above "
            f"target_epsilon={args.target_epsilon:g}: raise --target_epsilon or --noise_multiplier."
        )
    planned = epsilon(steps)
    if planned + spent_on_bound > args.target_epsilon:
        logger.warning("noise_multiplier=%g spends ε=%.3g over the %d planned steps, above target_epsilon=%g: "
                       "training will stop early, before the budget is exceeded.", sigma, planned, steps,
                       args.target_epsilon)


def _gradient_noise(effective: float, releases: StepReleases, args: DPTrainingArguments) -> float:
    """σ, the gradient noise multiplier that leaves the step at σ_eff.

    Raises:
        ValueError: with adaptive clipping, a count noise σ_b ≤ σ_eff/2 (the count alone would spend the budget).
    """
    try:
        return releases.gradient_noise_multiplier(effective)
    except ValueError:
        count_noise = releases.count_noise
        default = " (the default expected_batch_size/20)" if args.clipping_count_noise is None else ""
        raise ValueError(
            f"clipping_count_noise={count_noise:g}{default} is not above σ_eff/2 = {effective / 2:g}, half the "
            f"noise multiplier target_epsilon allows for the whole step: adaptive clipping's count of unclipped "
            f"units alone would spend the budget. Raise --clipping_count_noise (a few times {effective / 2:g} keeps "
            "the gradient noise near σ_eff), raise --expected_batch_size or --target_epsilon, or turn "
            "--adaptive_clipping off."
        ) from None
