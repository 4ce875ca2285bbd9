"""DPTrainer: transformers.Trainer with user-level DP-SGD.

Per optimizer step: Poisson-sample units -> per-unit clipped gradients (ghost clipping) ->
all-reduce -> Gaussian noise once -> divide by the expected batch size -> optimizer. The ledger
advances every step, is saved with every checkpoint and restored on resume.

What the logs hold is a release too: with `private_logging` (the default) the loss and the clipped
fraction are noised sums over the same Poisson sample, and the ledger composes gradient, loss and
count as one Gaussian mechanism (see [`PrivacyPlan`]); nothing else computed from the data is logged.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import secrets
from dataclasses import dataclass

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorWithFlattening, Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ProgressCallback, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import accounting
from .accounting import planner
from .arguments import DPTrainingArguments
from .batch_independence import check_batch_independence
from .batching import LogicalBatches, identity
from .clipping import GhostClipper
from .clipping.packing import examples_from_position_ids
from .data import examples_per_user, keyed_seed, partition_by_user
from .losses import is_causal_lm, packed_per_example_loss, per_example_loss
from .noise import add_noise, add_scalar_noise, fresh_seed
from .sampling import PoissonBatchSampler

logger = logging.getLogger(__name__)

LOCK_NAME = "_hf_dp.lock"  # in output_dir while a run trains there
LEDGER_NAME = "dp_state.json"  # in every checkpoint (never uploaded)
ACCOUNTANT_NAME = "prv-accountant (Gopi, Lee, Wutschitz 2021), both adjacency directions"


@dataclass(frozen=True)
class PrivacyPlan:
    """What the accountant composes, fixed before the first step.

    Each step releases three noised sums over the same Poisson sample: the clipped gradients (sensitivity C,
    noise σ·C), and with private logging the clipped losses (sensitivity `max_loss`, noise σ_log·max_loss)
    and the count of clipped units (sensitivity 1, noise σ_log). Scaled by their noise, they are one Gaussian
    mechanism whose noise multiplier is `effective_noise_multiplier` = (σ⁻² + 2·σ_log⁻²)^(-1/2); for ELS a user
    with k sampled examples moves each sum by at most k times its sensitivity, so the mixture-of-Gaussians
    accountant applies with that σ too. The ledger records it.
    """

    mode: str  # "uls" | "els" | "example"
    num_units: int  # units sampled: users (ULS) or rows (ELS, example-level)
    num_privacy_units: int  # units protected: users, or rows for example-level
    sample_rate: float
    steps: int
    noise_multiplier: float
    delta: float
    group_size: int  # G for the ELS mixture-of-Gaussians accountant, else 1
    contribution_bound: int | None
    logging_noise_multiplier: float | None = None  # σ_log of the logged loss and count; None: nothing logged
    effective_noise_multiplier: float | None = None  # σ_eff the ledger composes (σ without private logging)

    def fingerprint(self, args: DPTrainingArguments) -> dict:
        """Everything a resumed run must share with the checkpoint for the ledger to stay true."""
        return {
            "privacy_unit": args.privacy_unit,
            "sampling": self.mode,
            "max_grad_norm": args.max_grad_norm,
            "noise_multiplier": self.noise_multiplier,
            "logging_noise_multiplier": self.logging_noise_multiplier,
            "max_loss": args.max_loss if self.logging_noise_multiplier is not None else None,
            "sample_rate": self.sample_rate,
            "contribution_bound": self.contribution_bound,
            "target_epsilon": args.target_epsilon,
            "target_delta": self.delta,
            "num_units": self.num_units,
        }


class DPTrainer(Trainer):
    r"""
    A drop-in [`~transformers.Trainer`] that trains with user-level (or example-level) DP-SGD.

    Swap `Trainer` for `DPTrainer` and `TrainingArguments` for [`DPTrainingArguments`]; the training dataset
    needs a user column (`args.user_id_column`). Everything Trainer does (callbacks, logging, evaluation,
    checkpoints, `resume_from_checkpoint`, `push_to_hub`) keeps working; the privacy ledger travels with
    every checkpoint and the privacy card is written to `output_dir/README.md` at the end of `train()`, with the
    ledger beside it (`dp_ledger.json`). Logs hold ε, δ, σ, q and, with `private_logging` (the default), a noised
    `loss` and `dp/clipped_fraction` that the ledger accounts; nothing else computed from the data.

    Packed (padding-free) batches: with a causal LM, `data_collator=DataCollatorWithFlattening()` packs each
    micro-batch into one row (`position_ids` restarting at each example, no attention mask); every example keeps its
    own loss, tokens and user, so clipping, noise and ε are exactly those of the padded run, without the padding.

    Args:
        model, args, train_dataset, ...: as for [`~transformers.Trainer`]; `args` must be [`DPTrainingArguments`].
        privacy_card_kwargs (`dict`, *optional*):
            Extra fields for the privacy card, e.g. `dataset_name`, `eval_result`, `baseline_result`
            (the public-only baseline), `nonprivate_result`, `metric_name`. Post-processing: no effect on ε.

    Raises:
        ValueError: missing user column, no user, an impossible budget or sample rate, a first step that alone
            exceeds `target_epsilon`, a model whose layers mix the examples of a batch (before any step), a
            checkpoint from a different privacy configuration or whose ledger does not match it.
        UnsupportedLayerError: a trainable module the clipping engine has no rule for (before any step).
        RuntimeError: (`train`) another live run holds `output_dir`.

    Example:

    ```python
    >>> trainer = DPTrainer(model=model, args=DPTrainingArguments("out", target_epsilon=8.0),
    ...                     train_dataset=train, processing_class=tokenizer)
    >>> trainer.train()
    >>> trainer.privacy_report()["epsilon"]
    ```
    """

    def __init__(self, model=None, args: DPTrainingArguments | None = None, train_dataset=None, *,
                 privacy_card_kwargs: dict | None = None, **kwargs):
        if not isinstance(args, DPTrainingArguments):
            raise TypeError("DPTrainer needs DPTrainingArguments (they carry the privacy settings).")
        if train_dataset is None:
            raise ValueError("DPTrainer needs a train_dataset with a user column to account privacy.")
        if args.include_num_input_tokens_seen not in ("no", False, None):
            raise ValueError(
                "include_num_input_tokens_seen: the exact number of tokens in each Poisson sample is data-dependent "
                "and not covered by ε; set it to 'no' for DP training."
            )
        # A copy: the plan sets max_steps and this flag, and the caller may reuse its arguments for another run.
        args = copy.copy(args)
        # Sampling resumes from the ledger's step, so Trainer's batch skipping is not needed.
        args.ignore_data_skip = True
        # The secret keys G's private draw and each user's rows; saved with checkpoints, never released.
        self._data_secret = _data_secret(args)
        self._user_dataset, self._requested_max_steps = train_dataset, args.max_steps
        self.partition = _partition(train_dataset, args, self._data_secret)
        super().__init__(model=model, args=args, train_dataset=self.partition.dataset, **kwargs)
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
            raise ValueError("FSDP / DeepSpeed (from the accelerate config): sharded parameters are not supported by "
                             "the clipping engine yet; launch with a DDP config (recipes/configs/multi_gpu.yaml).")
        self._causal_lm = is_causal_lm(self.model)
        if isinstance(self.data_collator, DataCollatorWithFlattening) and not self._causal_lm:
            raise ValueError(_PACKED_NEEDS_TOKEN_HEAD.format(model=type(_unwrapped(self.model)).__name__))
        check_batch_independence(self.model, self._probe_batch())
        self.clipper = GhostClipper(self.model)
        self.privacy_plan = self._plan_privacy()
        self._plan_fits: bool | None = None  # see _plan_within_budget
        self.accountant = accounting.PrivacyAccountant()
        if _bound_epsilon(args):  # G was chosen from the data with ε-DP: a release the ledger must hold
            self.accountant.record_pure_dp("contribution_bound", _bound_epsilon(args))
        self.privacy_card_kwargs = dict(privacy_card_kwargs or {})
        self._seed = self._shared_seed()
        self._epsilon_spent = 0.0
        self._window = {"clipped_fraction": 0.0, "steps": 0}  # noised per-step fractions since the last log
        self.add_callback(_PrivacyProgress(self))
        logger.info("DP plan: %s", self.privacy_plan)

    # ---- plan -------------------------------------------------------------------------------

    def _plan_privacy(self) -> PrivacyPlan:
        args, part = self.args, self.partition
        mode = args.mechanism
        num_units = part.num_users if mode == "uls" else part.num_examples
        num_privacy_units = part.num_examples if mode == "example" else part.num_users
        unit_name = "users" if args.privacy_unit == "user" else "examples"
        if num_privacy_units < 2:
            raise ValueError(
                f"The training data has {num_privacy_units} {unit_name[:-1]}: a {args.privacy_unit}-level guarantee "
                f"needs many {unit_name}. Check --user_id_column ({args.user_id_column!r}) or add data."
            )
        sample_rate = args.expected_batch_size / num_units
        if sample_rate > 1:
            raise ValueError(
                f"expected_batch_size={args.expected_batch_size} exceeds the {num_units} "
                f"{'users' if mode == 'uls' else 'examples'} available: lower --expected_batch_size."
            )
        steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs / sample_rate)
        args.max_steps = steps
        delta = args.target_delta if args.target_delta is not None else 1.0 / (10 * num_privacy_units)
        if delta >= 1.0 / num_privacy_units:
            raise ValueError(
                f"target_delta={delta:g} is not below 1/{num_privacy_units} {unit_name}: such a δ allows "
                f"releasing a whole {args.privacy_unit}'s data. Lower --target_delta (default 1/(10·{unit_name}))."
            )
        group_size = part.contribution_bound if mode == "els" else 1
        # σ_log = r·σ for the logged loss and count: σ_eff = (σ⁻² + 2·σ_log⁻²)^(-1/2) = σ / spread.
        ratio = args.logging_noise_ratio if args.private_logging else None
        spread = math.sqrt(1.0 + 2.0 / ratio**2) if ratio else 1.0
        sigma = args.noise_multiplier
        effective = None if sigma is None else sigma / spread
        bound_epsilon = _bound_epsilon(args)  # spent choosing G: DP-SGD gets the rest of the target
        if sigma is None:
            try:
                effective = accounting.noise_multiplier(
                    target_epsilon=args.target_epsilon - bound_epsilon, delta=delta, sample_rate=sample_rate,
                    steps=steps, group_size=group_size,
                )
                sigma = effective * spread
            except ValueError as error:
                raise ValueError(
                    f"{error} Planned: {steps} steps at sample rate {sample_rate:.4g}. Raise --target_epsilon, "
                    "or train fewer steps/epochs or with a smaller --expected_batch_size."
                ) from error
        elif args.target_epsilon is not None:
            first = accounting.epsilon(
                sample_rate=sample_rate, noise_multiplier=effective, steps=1, delta=delta, group_size=group_size
            )
            if first + bound_epsilon > args.target_epsilon:
                raise ValueError(
                    f"noise_multiplier={sigma:g} spends ε={first:.3g} on the first step alone, above "
                    f"target_epsilon={args.target_epsilon:g}: raise --target_epsilon or --noise_multiplier."
                )
            planned = accounting.epsilon(
                sample_rate=sample_rate, noise_multiplier=effective, steps=steps, delta=delta, group_size=group_size
            )
            if planned + bound_epsilon > args.target_epsilon:
                logger.warning(
                    "noise_multiplier=%g spends ε=%.3g over the %d planned steps, above target_epsilon=%g: "
                    "training will stop early, before the budget is exceeded.", sigma, planned, steps,
                    args.target_epsilon,
                )
        return PrivacyPlan(mode, num_units, num_privacy_units, sample_rate, steps, float(sigma), delta, group_size,
                           part.contribution_bound, logging_noise_multiplier=ratio * sigma if ratio else None,
                           effective_noise_multiplier=float(effective))

    def _probe_batch(self) -> dict:
        """The first training rows collated like a micro-batch, for the batch-independence probe."""
        dataset = self._remove_unused_columns(self.partition.dataset, description="training")
        examples = [dataset[i] for i in range(min(len(dataset), max(2, self.args.per_device_train_batch_size), 4))]
        features = self.data_collator(examples)
        if _packed_example_ids(features) is not None:
            # Packed into one row: the probe perturbs one row and watches the others, so give it one example per
            # row (each collated alone, cut to the shortest).
            singles = [self.data_collator([example]) for example in examples]
            width = min(single["position_ids"].shape[-1] for single in singles)
            features = {key: torch.cat([single[key][:, :width] for single in singles])
                        for key, value in singles[0].items() if torch.is_tensor(value) and value.dim() == 2}
        return self._prepare_inputs(features)

    def _shared_seed(self) -> int:
        seed = self.args.noise_seed if self.args.noise_seed is not None else fresh_seed()
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            seed = broadcast_object_list([seed], from_process=0)[0]
        return seed

    # ---- data -------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """One item per optimizer step: this rank's share of the step's Poisson sample, in micro-batches."""
        plan = self.privacy_plan
        dataset = self._remove_unused_columns(self.partition.dataset, description="training")
        batches = LogicalBatches(
            dataset,
            unit_rows=self.partition.user_rows if plan.mode == "uls" else None,
            data_collator=self.data_collator,
            micro_batch_size=self.args.per_device_train_batch_size,
        )
        sampler = PoissonBatchSampler(
            plan.num_units, plan.sample_rate, plan.steps, self._seed,
            rank=self.args.process_index, world_size=self.args.world_size, start_step=self.accountant.steps,
            within_budget=self._within_budget if self.args.target_epsilon is not None else None,
        )
        return DataLoader(batches, batch_size=None, sampler=sampler, collate_fn=identity,
                          num_workers=self.args.dataloader_num_workers)

    def _plan_within_budget(self) -> bool:
        """Whether every planned step keeps ε within target_epsilon (ε grows with the steps, so then no step
        needs its own check: one accounting, not one per step, which matters at small ε and long runs)."""
        if self._plan_fits is None:
            plan = self.privacy_plan
            self._plan_fits = self.accountant.epsilon_after(
                plan.delta, steps=max(0, plan.steps - self.accountant.steps), sample_rate=plan.sample_rate,
                noise_multiplier=plan.effective_noise_multiplier, group_size=plan.group_size,
            ) <= self.args.target_epsilon
        return self._plan_fits

    def _within_budget(self, step: int) -> bool:
        """Whether step `step` (0-based) keeps ε within target_epsilon: asked before its batch is drawn."""
        if self._plan_within_budget():
            return True
        plan = self.privacy_plan
        epsilon = self.accountant.epsilon_after(
            plan.delta, steps=step + 1 - self.accountant.steps, sample_rate=plan.sample_rate,
            noise_multiplier=plan.effective_noise_multiplier, group_size=plan.group_size,
        )
        if epsilon <= self.args.target_epsilon:
            return True
        if step == self.accountant.steps:  # later steps: _advance_ledger has said so already
            logger.warning("Privacy budget spent: step %d would bring ε to %.4g > target_epsilon=%g; no step taken.",
                           step + 1, epsilon, self.args.target_epsilon)
        return False

    # ---- one DP step ------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Clip every sampled unit, add noise once, normalise by the expected batch size.

        Returns the noised mean loss (see `private_logging`): the clipped unit losses' sum plus noise, divided by
        the expected batch size; 0 without private logging (then no loss is logged).
        """
        plan, args = self.privacy_plan, self.args
        model.train()
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        # Summed over ranks below: [sum of unit losses clipped to [0, max_loss], units whose gradient was clipped]
        totals = torch.zeros(2, dtype=torch.float64, device=args.device)
        with self.accelerator.no_sync(model):  # clipped sums are all-reduced below, once
            for micro_batch in inputs.micro_batches:
                features = self._prepare_inputs(dict(micro_batch.features))
                labels = features.pop("labels", None)
                if labels is None:
                    raise ValueError("DP training batches need 'labels' (per-example losses are computed from them).")
                # Packed rows (DataCollatorWithFlattening): several examples per row, positions restarting at each.
                example_ids = _packed_example_ids(features)
                if example_ids is not None:
                    features["use_cache"] = False  # a cache turns off transformers' per-example attention masking
                with self.compute_loss_context_manager():
                    logits = model(**features).logits
                if example_ids is None:
                    losses = per_example_loss(logits, labels, causal_lm=self._causal_lm)
                else:
                    if logits.dim() != 3:
                        raise ValueError(_PACKED_NEEDS_TOKEN_HEAD.format(model=type(_unwrapped(self.model)).__name__))
                    num_examples = int(example_ids.max()) + 1
                    if micro_batch.num_examples is not None and num_examples != micro_batch.num_examples:
                        raise ValueError(_examples_lost(num_examples, micro_batch.num_examples))
                    losses = packed_per_example_loss(logits, labels, example_ids, num_examples,
                                                     causal_lm=self._causal_lm)
                if micro_batch.num_examples is not None and losses.shape[0] != micro_batch.num_examples:
                    raise ValueError(_examples_lost(losses.shape[0], micro_batch.num_examples))
                if micro_batch.loss_weights is not None:  # ULS: a user's gradient is that of their mean loss
                    weighted, unit_ids = losses * micro_batch.loss_weights.to(losses.device), micro_batch.unit_ids.to(losses.device)
                else:
                    weighted, unit_ids = losses, None
                norms = self.clipper.backward(weighted, unit_ids=unit_ids, max_grad_norm=args.max_grad_norm,
                                              example_ids=example_ids)
                unit_losses = weighted.detach().float()
                if unit_ids is not None:  # ULS: the user's mean loss (units in sorted id order, as `norms`)
                    index = torch.unique(unit_ids, return_inverse=True)[1]
                    unit_losses = unit_losses.new_zeros(len(norms)).index_add_(0, index, unit_losses)
                # Bounded per unit, a NaN included, so one unit moves the logged sum by at most max_loss.
                unit_losses = torch.nan_to_num(unit_losses, nan=args.max_loss).clamp(0.0, args.max_loss)
                # Accumulated on the device: no host sync per micro-batch.
                totals[0] += unit_losses.sum().to(totals)
                totals[1] += (norms > args.max_grad_norm).sum().to(totals)
        if inputs.micro_batches and not any(p.grad is not None for p in params):
            raise RuntimeError(
                "A non-empty batch produced no gradient for any parameter the optimizer updates: the trainable "
                "parameters are not those in the forward pass (e.g. LoRA adapters replaced after the optimizer was "
                "built) or everything is frozen. Stopping instead of spending privacy budget on nothing."
            )
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        if self.accelerator.num_processes > 1:
            for param in params:
                torch.distributed.all_reduce(param.grad)
            torch.distributed.all_reduce(totals)
        add_noise(params, noise_multiplier=plan.noise_multiplier, max_grad_norm=args.max_grad_norm,
                  seed=self._seed, step=inputs.step)
        expected_batch_size = plan.sample_rate * plan.num_units
        for param in params:
            param.grad.div_(expected_batch_size)
        self._advance_ledger()
        if plan.logging_noise_multiplier is None:  # nothing computed from the data is released
            return torch.zeros((), dtype=torch.float32, device=args.device)
        # The same noise on every rank (shared seed), after the all-reduce: released once.
        loss_sum, clipped = add_scalar_noise(
            totals.tolist(), [plan.logging_noise_multiplier * args.max_loss, plan.logging_noise_multiplier],
            seed=self._seed, step=inputs.step,
        )
        self._window["clipped_fraction"] += clipped / expected_batch_size
        self._window["steps"] += 1
        return torch.tensor(loss_sum / expected_batch_size, dtype=torch.float32, device=args.device)

    def _advance_ledger(self) -> None:
        plan = self.privacy_plan
        self.accountant.step(sample_rate=plan.sample_rate, noise_multiplier=plan.effective_noise_multiplier,
                             group_size=plan.group_size)
        if self.args.target_epsilon is not None and not self._plan_within_budget():
            next_epsilon = self.accountant.epsilon_after(plan.delta, steps=1)
            if next_epsilon > self.args.target_epsilon and self.accountant.steps < plan.steps:
                logger.warning("Stopping after step %d: one more step would spend ε=%.4g > target %g.",
                               self.accountant.steps, next_epsilon, self.args.target_epsilon)
                self.control.should_training_stop = True

    def _clip_grad_norm(self, model):
        """Global norm clipping is off: every unit was clipped to max_grad_norm already."""
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        return None

    def _get_num_items_in_batch(self, batch_samples, device):
        """DP normalises by the expected batch size, never by the items sampled."""
        return None

    def floating_point_ops(self, inputs) -> int:
        """Not counted (`total_flos` stays 0): the tokens of a Poisson sample are data-dependent, not covered by ε."""
        return 0

    def _track_num_input_tokens(self, inputs):
        """Not counted: `include_num_input_tokens_seen` is refused (exact token counts are not covered by ε)."""

    # ---- reporting --------------------------------------------------------------------------

    def current_epsilon(self) -> float:
        """ε spent so far at the run's δ (the accountant's conservative bound)."""
        return self.accountant.epsilon(self.privacy_plan.delta) if self.accountant.steps \
            else self.accountant.pure_dp_epsilon  # before the first step: the choice of G, if any

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """Adds ε, δ, σ and q to training logs. `loss` and `dp/clipped_fraction` are the noised releases of
        `training_step` (covered by ε); without private logging no loss is logged at all."""
        private_logging = self.privacy_plan.logging_noise_multiplier is not None
        if "loss" in logs:
            plan = self.privacy_plan
            self._epsilon_spent = self.current_epsilon()
            logs.update({
                "dp/epsilon": self._epsilon_spent,
                "dp/delta": plan.delta,
                "dp/noise_multiplier": plan.noise_multiplier,
                "dp/sample_rate": plan.sample_rate,
            })
            window = self._window
            if not private_logging:
                del logs["loss"]
            elif window["steps"]:
                logs["dp/clipped_fraction"] = window["clipped_fraction"] / window["steps"]
            self._window = {"clipped_fraction": 0.0, "steps": 0}
        if not private_logging:
            logs.pop("train_loss", None)
        super().log(logs, start_time)

    def privacy_report(self) -> dict:
        """The guarantee earned so far, in the project's vocabulary (what the card and the app show).

        `num_users` and `num_examples` are rounded to 2 significant figures: they are not covered by ε.
        """
        from .card import round_count

        plan, args = self.privacy_plan, self.args
        steps = self.accountant.steps
        if steps:
            lower, estimate, upper = self.accountant.epsilon_bounds(plan.delta)
        else:
            lower = estimate = upper = self.accountant.pure_dp_epsilon
        bound_epsilon = sum(r["epsilon"] for r in self.accountant.pure_dp if r["label"] == "contribution_bound")
        report = {
            "epsilon": upper,
            "epsilon_lower": lower,
            "epsilon_estimate": estimate,
            "delta": plan.delta,
            "target_epsilon": args.target_epsilon,
            "privacy_unit": args.privacy_unit,
            "sampling": plan.mode,
            "mechanism": _MECHANISMS[plan.mode],
            "noise_multiplier": plan.noise_multiplier,
            "logging_noise_multiplier": plan.logging_noise_multiplier,
            "max_loss": args.max_loss if plan.logging_noise_multiplier is not None else None,
            "effective_noise_multiplier": plan.effective_noise_multiplier,
            "sample_rate": plan.sample_rate,
            "expected_batch_size": args.expected_batch_size,
            "steps": steps,
            "max_grad_norm": args.max_grad_norm,
            "contribution_bound": plan.contribution_bound,
            # ε-DP choice of G ("auto": a DP median on the public grid; 0 when G was given) and DP-SGD's share of ε.
            "contribution_bound_epsilon": bound_epsilon,
            "contribution_bound_choice": _bound_choice(args, plan.mode, bound_epsilon),
            "epsilon_training": upper - self.accountant.pure_dp_epsilon,
            "num_users": round_count(self.partition.num_users),
            "num_examples": round_count(self.partition.num_examples),
            "accountant": ACCOUNTANT_NAME + ("; mixture-of-Gaussians for ELS" if plan.mode == "els" else ""),
            "epsilon_group_privacy": None,
            "noise_seed": "os-entropy" if args.noise_seed is None else f"fixed seed for testing: {args.noise_seed}",
        }
        if plan.mode == "els" and steps:
            report["epsilon_group_privacy"] = accounting.group_privacy_epsilon(
                sample_rate=plan.sample_rate, noise_multiplier=plan.effective_noise_multiplier, steps=steps,
                delta=plan.delta, group_size=plan.group_size,
            ) + self.accountant.pure_dp_epsilon  # the same releases as `epsilon`, composed loosely
        return report

    def privacy_ledger(self) -> dict:
        """What `hf-dp publish` recomputes ε from: the accountant's state, δ, unit and mechanism."""
        plan = self.privacy_plan
        return {"format": 1, "delta": plan.delta, "privacy_unit": self.args.privacy_unit, "sampling": plan.mode,
                "accountant": self.accountant.state_dict()}

    def write_privacy_card(self, output_dir: str | None = None, **card_kwargs):
        """Write the privacy card to `output_dir/README.md` and the ledger beside it (`dp_ledger.json`, which
        `hf-dp publish` checks the card against). Post-processing: no effect on ε."""
        from .card import write_privacy_card

        kwargs = {"base_model": _base_model_name(self.model), **self.privacy_card_kwargs, **card_kwargs}
        return write_privacy_card(self.privacy_report(), output_dir or self.args.output_dir,
                                  ledger=self.privacy_ledger(), **kwargs)

    def create_model_card(self, *args, **kwargs) -> None:
        """`push_to_hub` publishes the privacy card as the repo README."""
        if self.is_world_process_zero():
            self.write_privacy_card()

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Offline or unreachable Hub: one clear `HubUnreachableError` before any repo is created."""
        from .hub import ensure_hub_reachable

        ensure_hub_reachable()
        super().init_hf_repo(token=token, private=private)

    def push_to_hub(self, *args, **kwargs):
        """Trainer's `push_to_hub` (privacy card as README), after checking the Hub is reachable: nothing is
        uploaded offline (`HF_HUB_OFFLINE=1`) or when the endpoint does not answer (`HubUnreachableError`)."""
        from .hub import ensure_hub_reachable

        ensure_hub_reachable()
        return super().push_to_hub(*args, **kwargs)

    def train(self, *args, **kwargs):
        """Trainer's `train`, holding `output_dir`'s run lock, then the privacy card is written.

        Raises:
            RuntimeError: another live run holds `output_dir` (its checkpoints and card would be mixed with these).
        """
        with _output_dir_lock(self.args.output_dir, enabled=self.is_world_process_zero()):
            output = super().train(*args, **kwargs)
            if self.is_world_process_zero():
                self.write_privacy_card()
        return output

    # ---- checkpoints: the ledger travels with every checkpoint ------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            ledger = {
                "format": 2,
                "config": self.privacy_plan.fingerprint(self.args),
                "accountant": self.accountant.state_dict(),
                "data_secret": self._data_secret,  # a resumed run keeps G and the rows it chose; never released
            }
            ledger["digest"] = _ledger_digest(ledger)
            with open(os.path.join(folder, LEDGER_NAME), "w") as f:
                json.dump(ledger, f, indent=2)
        super()._save_checkpoint(model, trial)

    def _use_data_secret(self, secret: str) -> None:
        """Resume: redo G's draw and the row choice with the checkpoint's secret, so they match the checkpoint's."""
        self._data_secret = secret
        self.partition = _partition(self._user_dataset, self.args, secret)
        self.train_dataset = self.partition.dataset
        self.args.max_steps = self._requested_max_steps  # the plan below sets it again
        self.privacy_plan = self._plan_privacy()
        self._plan_fits = None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self._restore_ledger(resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _restore_ledger(self, checkpoint: str) -> None:
        """Restore the ledger after checking it against its checkpoint: digest, plan, step count.

        Raises `ValueError` (one line naming the file) for a missing, unreadable, edited or mismatched ledger.
        """
        path = os.path.join(checkpoint, LEDGER_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint} has no privacy ledger ({LEDGER_NAME}): it was not written by DPTrainer. Resuming "
                "from it would lose the ε already spent; start a new run instead."
            )
        ledger = _read_json(path, "the privacy ledger")
        if not isinstance(ledger, dict) or not isinstance(ledger.get("config"), dict) \
                or not isinstance(ledger.get("accountant"), dict) or not isinstance(ledger.get("digest"), str):
            raise ValueError(f"{path} is not a DPTrainer ledger with 'config', 'accountant' and 'digest' (written by "
                             "an older hf_dp, or edited): resume from a checkpoint of this version or start a new run.")
        if ledger["digest"] != _ledger_digest(ledger):
            raise ValueError(f"{path}: its integrity digest does not match its contents (the ledger was edited or "
                             "corrupted): resume from an intact checkpoint or start a new run.")
        if ledger.get("data_secret", self._data_secret) != self._data_secret:
            self._use_data_secret(ledger["data_secret"])
        saved, current = ledger["config"], self.privacy_plan.fingerprint(self.args)
        changed = {k: (saved.get(k), v) for k, v in current.items() if not _same(saved.get(k), v)}
        if changed:
            details = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in changed.items())
            raise ValueError(
                f"Checkpoint {checkpoint} was trained under a different privacy configuration ({details}). "
                "Resume with the same privacy arguments and data, or start a new run."
            )
        restored = accounting.PrivacyAccountant()
        try:
            restored.load_state_dict(ledger["accountant"])
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from error
        plan = self.privacy_plan
        expected = (plan.sample_rate, plan.effective_noise_multiplier, plan.group_size)
        for i, segment in enumerate(restored.history):
            found = (segment["sample_rate"], segment["noise_multiplier"], segment["group_size"])
            if not all(_same(a, b) for a, b in zip(found, expected)):
                raise ValueError(f"{path}: segment {i} has (sample_rate, noise_multiplier, group_size) = {found}, "
                                 f"not this run's {expected}: the ledger does not match the plan; start a new run.")
        state = _read_json(os.path.join(checkpoint, TRAINER_STATE_NAME), "the trainer state")
        global_step = state.get("global_step") if isinstance(state, dict) else None
        if restored.steps != global_step:
            raise ValueError(f"{path} records {restored.steps} steps but its checkpoint is at global step "
                             f"{global_step} ({TRAINER_STATE_NAME}): the ledger does not match its checkpoint; resume "
                             "from an intact checkpoint or start a new run.")
        self.accountant.load_state_dict(ledger["accountant"])
        self._plan_fits = None


class _PrivacyProgress(TrainerCallback):
    """Shows ε spent and σ on Trainer's progress bar (never the sampled batch size: it is data-dependent)."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        bar = next((cb.training_bar for cb in trainer.callback_handler.callbacks
                    if isinstance(cb, ProgressCallback) and cb.training_bar is not None), None)
        if bar is None:
            return
        every = max(1, trainer.privacy_plan.steps // 50)
        if state.global_step % every == 0 or state.global_step == trainer.privacy_plan.steps:
            trainer._epsilon_spent = trainer.current_epsilon()
        bar.set_postfix(eps=f"{trainer._epsilon_spent:.3g}", sigma=f"{trainer.privacy_plan.noise_multiplier:.3g}",
                        refresh=False)


_MECHANISMS = {
    "uls": "user-level sampling (ULS): Poisson-sampled users, per-user clipped mean gradient, Gaussian noise",
    "els": "example-level sampling (ELS): Poisson-sampled examples, per-example clipping, at most G examples "
           "per user, user-level guarantee by the mixture-of-Gaussians accountant",
    "example": "DP-SGD: Poisson-sampled examples, per-example clipping, Gaussian noise (example-level guarantee)",
}


_PACKED_NEEDS_TOKEN_HEAD = (
    "Packed (padding-free) batches, e.g. from DataCollatorWithFlattening, put several examples in one row and are "
    "supported for causal language models; {model} is not one: a sequence-classification head pools each row into "
    "one prediction, which cannot be split into the row's examples (DP needs per-example losses and gradients). "
    "Use a padding collator (DataCollatorWithPadding) for this model."
)


def _unwrapped(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _packed_example_ids(features: dict) -> torch.Tensor | None:
    """For packed rows, the example of each token (`(rows, T)`, see
    [`~hf_dp.clipping.packing.examples_from_position_ids`]); `None` for one example per row.

    Rows are packed when `position_ids` restart inside a row (DataCollatorWithFlattening: one row, no
    attention mask). With an attention mask transformers would let a row's examples attend to each other: refused.
    """
    position_ids = features.get("position_ids")
    if not torch.is_tensor(position_ids) or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return None
    mask = features.get("attention_mask")
    real = mask.bool() if torch.is_tensor(mask) and mask.shape == position_ids.shape else \
        torch.ones_like(position_ids, dtype=torch.bool)
    # Padding (left or right) may carry any position: only restarts between two real tokens count.
    restarts = (torch.diff(position_ids, dim=-1) != 1) & real[:, 1:] & real[:, :-1]
    if not bool(restarts.any()):
        return None
    if mask is not None:
        raise ValueError(
            "Packed rows (position_ids restart inside a row) with an attention_mask: transformers then lets the "
            "examples of a row attend to each other, so one example's gradient would depend on the others. Drop the "
            "attention_mask (DataCollatorWithFlattening returns none) or pad one example per row."
        )
    return examples_from_position_ids(position_ids)


def _examples_lost(found: int, sampled: int) -> str:
    return (f"The data collator returned {found} examples for {sampled} sampled rows: a unit's rows must stay "
            "distinct examples to be clipped as sampled. DataCollatorWithFlattening drops rows with no tokens: "
            "filter them out of the training data.")


def _partition(dataset, args: DPTrainingArguments, secret: str):
    """Rows grouped by user under the bound G, G and every user's rows drawn with `secret`."""
    return partition_by_user(dataset, args.user_id_column, _contribution_bound(dataset, args, secret), secret)


def _bound_epsilon(args: DPTrainingArguments) -> float:
    """ε spent choosing G from the data: `contribution_bound_epsilon` for "auto" at user level, else 0."""
    auto = args.contribution_bound == "auto" and args.mechanism != "example"
    return float(args.contribution_bound_epsilon) if auto else 0.0


def _contribution_bound(dataset, args: DPTrainingArguments, secret: str) -> int | None:
    """G from the arguments; "auto" is chosen with ε-DP ([`~hf_dp.accounting.planner.private_contribution_bound`]).

    ELS: a DP median of the rows per user, from the public grid. ULS: the noise-prediction heuristic of
    Charles et al. 2024 run on that DP median (compute budget of `expected_batch_size` users × the median
    rows), for the run's steps and the ε left to DP-SGD. The draw is keyed by `secret` (OS entropy, or
    `noise_seed` for tests); its ε is recorded in the ledger by the trainer.
    """
    if args.contribution_bound is None or (args.mechanism == "example" and args.contribution_bound == "auto"):
        return None  # no bound: every row is kept
    if args.contribution_bound != "auto":
        return int(args.contribution_bound)
    counts = examples_per_user(dataset, args.user_id_column)
    if len(counts) == 0:
        return None  # partition_by_user raises the clear error
    sample_rate = min(1.0, args.expected_batch_size / len(counts))  # above 1: the plan raises the clear error
    steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs / sample_rate)
    return planner.private_contribution_bound(
        counts, sampling=args.mechanism, epsilon=args.contribution_bound_epsilon,
        expected_batch_size=args.expected_batch_size, steps=steps,
        target_epsilon=(args.target_epsilon or planner.DEFAULT_TARGET_EPSILON) - _bound_epsilon(args),
        delta=args.target_delta, rng=np.random.default_rng(keyed_seed(secret, "contribution_bound", "bound")),
    )


def _bound_choice(args: DPTrainingArguments, mode: str, bound_epsilon: float) -> str:
    """How G was chosen, for the report and the card."""
    if mode == "example" or args.contribution_bound is None:
        return "none: every row is kept"
    if not bound_epsilon:
        return "given (contribution_bound): not read from the data"
    rule = "the ELS median" if mode == "els" else "the ULS noise-prediction heuristic on that median"
    return (f"auto: an ε-DP median of the rows per user (exponential mechanism over the public grid "
            f"{', '.join(map(str, planner.CONTRIBUTION_BOUND_GRID))}; ε = {bound_epsilon:g}, in the ledger), "
            f"then {rule}")


def _data_secret(args: DPTrainingArguments) -> str:
    """The key of G's private draw and of every user's row choice: fresh OS entropy, shared by all ranks, or
    derived from `noise_seed` for tests. Saved in checkpoints (`dp_state.json`), never in a card, report or log."""
    if args.noise_seed is not None:
        return hashlib.sha256(f"hf_dp data secret {args.noise_seed}".encode()).hexdigest()[:32]
    secret = secrets.token_hex(16)
    if args.world_size > 1:
        from accelerate.utils import broadcast_object_list

        secret = broadcast_object_list([secret], from_process=0)[0]
    return secret


def _base_model_name(model) -> str | None:
    """The Hub id the model was loaded from; `None` for a local folder (pass `base_model` to the card)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = getattr(getattr(base, "config", None), "_name_or_path", None)
    return name if name and not os.path.exists(name) else None


@contextlib.contextmanager
def _output_dir_lock(output_dir: str, enabled: bool = True):
    """Hold an exclusive lock on `output_dir/_hf_dp.lock` (never uploaded: `_*`) while one run writes there.

    The OS releases the lock when the run ends, even if it crashes: a leftover file does not block a later run.
    """
    if not enabled or fcntl is None:  # no flock on Windows
        yield
        return
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_NAME)
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise RuntimeError(f"output_dir={output_dir!r} is in use by another live training run ({path} is locked "
                               f"by {lock.read().strip() or 'another process'}): wait for it to finish or choose "
                               "another --output_dir.") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}\n")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ledger_digest(ledger: dict) -> str:
    """sha256 of the canonical JSON of everything in the ledger but the digest (catches edits and corruption)."""
    content = {key: value for key, value in ledger.items() if key != "digest"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: cannot read {what} ({type(error).__name__}: {error}); the checkpoint is truncated "
                         "or corrupted: resume from an intact checkpoint or start a new run.") from error


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and np.isclose(a, b, rtol=1e-9, atol=0)
    return a == b
