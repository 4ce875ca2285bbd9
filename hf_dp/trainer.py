"""DPTrainer: transformers.Trainer with user-level DP-SGD.

Per optimizer step: Poisson-sample units -> per-unit clipped gradients (ghost clipping) ->
all-reduce -> Gaussian noise once -> divide by the expected batch size -> optimizer. The ledger
advances every step, is saved with every checkpoint and restored on resume.

What the logs hold is a release too: with `private_logging` (the default) the loss and the clipped
fraction are noised sums over the same Poisson sample, and the ledger composes gradient, loss and
count as one Gaussian mechanism (see [`PrivacyPlan`]); nothing else computed from the data is logged.

With `adaptive_clipping` (Andrew et al. 2021, [`~hf_dp.clipping.adaptive`]) each step also releases the noised
centred count of units left unclipped at the step's C (always, private logging or not); it replaces the logged
clipped count, sets the next step's C, and joins the same Gaussian mechanism.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import json
import logging
import math
import os
import secrets
import warnings
from collections import Counter
from dataclasses import dataclass

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import numpy as np
import torch
import transformers
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader
from transformers import DataCollatorWithFlattening, Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ProgressCallback, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from . import accounting
from .accounting import planner
from .arguments import DPTrainingArguments
from .batch_independence import check_batch_independence
from .batching import LogicalBatches, identity, poisson_capacity
from .clipping import GhostClipper
from .clipping.adaptive import (
    AdaptiveClipping,
    QuantileTracker,
    centered_unclipped_count,
    effective_noise_multiplier,
    gradient_noise_multiplier,
)
from .clipping.packing import examples_from_position_ids
from .data import examples_per_user, keyed_seed, partition_by_user
from .losses import is_causal_lm, packed_per_example_loss, per_example_loss
from .noise import add_noise, add_scalar_noise, fresh_seed
from .sampling import PoissonBatchSampler
from .transfer import to_device
from .vocabulary import MECHANISMS

logger = logging.getLogger(__name__)

LOCK_NAME = "_hf_dp.lock"  # in output_dir while a run trains there
LEDGER_NAME = "dp_state.json"  # in every checkpoint (never uploaded)
ACCOUNTANT_NAME = "prv-accountant (Gopi, Lee, Wutschitz 2021), both adjacency directions"
# The transformers versions DPTrainer is tested with (pyproject.toml declares the same range): the private Trainer
# methods it overrides or calls are checked against them (`check_trainer_hooks`).
SUPPORTED_TRANSFORMERS = ">=5.24,<6"


@dataclass(frozen=True)
class PrivacyPlan:
    """What the accountant composes, fixed before the first step.

    Each step releases three noised sums over the same Poisson sample: the clipped gradients (sensitivity C,
    noise σ·C), and with private logging the clipped losses (sensitivity `max_loss`, noise σ_log·max_loss)
    and the count of clipped units (sensitivity 1, noise σ_log). Scaled by their noise, they are one Gaussian
    mechanism whose noise multiplier is `effective_noise_multiplier` = (σ⁻² + 2·σ_log⁻²)^(-1/2); for ELS a user
    with k sampled examples moves each sum by at most k times its sensitivity, so the mixture-of-Gaussians
    accountant applies with that σ too. The ledger records it.

    With `adaptive_clipping` the count of clipped units is replaced by the centred count of unclipped units
    (sensitivity 1/2, noise σ_b = `count_noise`), released every step with or without private logging, so
    σ_eff = (σ⁻² + (2σ_b)⁻² [+ σ_log⁻², the logged loss])^(-1/2) (Andrew et al. 2021, Theorem 1); the gradient
    noise of the step clipped at C_t is σ·C_t, so ε does not depend on the C reached.
    """

    mechanism: str  # "uls" | "els" | "example": a key of hf_dp.vocabulary.MECHANISMS
    num_units: int  # units sampled: users (ULS) or rows (ELS, example-level)
    num_privacy_units: int  # units protected: users, or rows for example-level
    sample_rate: float
    steps: int
    noise_multiplier: float
    delta: float
    group_size: int  # G for the ELS mixture-of-Gaussians accountant, else 1
    contribution_bound: int | None
    logging_noise_multiplier: float | None = None  # σ_log of the logged loss (and fixed-C count); None: not logged
    effective_noise_multiplier: float | None = None  # σ_eff the ledger composes (σ without any other release)
    adaptive_clipping: AdaptiveClipping | None = None  # C tracks a quantile from C_0 = max_grad_norm; None: fixed C
    count_noise: float | None = None  # σ_b of the adaptive count, in units; None for a fixed C

    def fingerprint(self, args: DPTrainingArguments) -> dict:
        """Everything a resumed run must share with the checkpoint for the ledger to stay true."""
        adaptive = self.adaptive_clipping
        return {
            "privacy_unit": args.privacy_unit,
            "mechanism": self.mechanism,
            "max_grad_norm": args.max_grad_norm,
            "noise_multiplier": self.noise_multiplier,
            "logging_noise_multiplier": self.logging_noise_multiplier,
            "max_loss": args.max_loss if self.logging_noise_multiplier is not None else None,
            "sample_rate": self.sample_rate,
            "contribution_bound": self.contribution_bound,
            "target_epsilon": args.target_epsilon,
            "target_delta": self.delta,
            "num_units": self.num_units,
            "adaptive_clipping": self.adaptive_clipping is not None,
            "target_unclipped_quantile": adaptive.target_quantile if adaptive else None,
            "clipping_learning_rate": adaptive.learning_rate if adaptive else None,
            "clipping_count_noise": self.count_noise,
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

    Adaptive clipping (`adaptive_clipping=True`, Andrew et al. 2021): C starts at `max_grad_norm` and after every
    step moves towards the `target_unclipped_quantile` of the per-unit gradient norms (which the clipping engine
    computes anyway), from a noised count of unclipped units that the ledger composes with the gradient (see
    [`PrivacyPlan`]). The running C is in the logs (`dp/max_grad_norm`), the checkpoints, the report and the card.

    Packed (padding-free) batches: with a causal LM, `data_collator=DataCollatorWithFlattening()` packs each
    micro-batch into one row (`position_ids` restarting at each example, no attention mask); every example keeps its
    own loss, tokens and user, so clipping, noise and ε are exactly those of the padded run, without the padding.

    Args:
        model, args, data_collator, train_dataset, eval_dataset, processing_class, ...: Trainer's parameters, in
            Trainer's order; `args` must be [`DPTrainingArguments`] and `train_dataset` a `datasets.Dataset` with
            the user column. `model_init` is refused (the clipping hooks are attached to the model at construction).
        compute_loss_func (`Callable`, *optional*):
            As for Trainer, `compute_loss_func(outputs, labels, num_items_in_batch=None)`, but it must return **one
            loss per example**, shape `(batch,)` (DP-SGD clips each unit's gradient, so a batch mean cannot be used),
            each depending on its own example only. Checked on the first training rows at construction; a scalar is
            refused. Not supported with packed rows (`DataCollatorWithFlattening`). Without it the loss is
            cross-entropy (shifted for causal LMs) or squared error for a one-output regression head.
        privacy_card_kwargs (`dict`, *optional*):
            Extra fields for the privacy card, e.g. `dataset_name`, `eval_result`, `baseline_result`
            (the public-only baseline), `non_private_result`, `metric_name`. Post-processing: no effect on ε.

    Trainer's extension points:
    - a subclass overriding `compute_loss` is refused (the DP step needs per-example losses; pass a per-example
      `compute_loss_func`);
    - `create_model_card` (what `push_to_hub` calls) writes the privacy card with Trainer's fields: `model_name`
      (its title), `finetuned_from` (its `base_model`), `tasks` (its pipeline tag), `dataset_tags` or `dataset`
      (its dataset), `language`, `license` and `tags` (its metadata); what `privacy_card_kwargs` sets wins;
      `dataset_args`, several tasks or several datasets are refused;
    - `hyperparameter_search` is refused: each trial would spend ε that no ledger composes;
    - the ledger is written into each checkpoint by an `on_save` callback and restored by
      `train(resume_from_checkpoint=...)`; `training_step` is the DP step.

    Private Trainer hooks still overridden, for want of public ones (checked at construction against
    `SUPPORTED_TRANSFORMERS`, the range pyproject.toml declares; a `RuntimeError` naming it if one is missing or no
    longer called): `_clip_grad_norm` (off: every unit was clipped already, and Trainer's global clipping would
    rescale the noised gradient), `_get_grad_norm` (nothing logged: it would be the norm of the noise),
    `_get_num_items_in_batch` (DP normalises by the expected batch size; a logical batch is no dict of tensors to
    count). The private helper `_remove_unused_columns` is called to drop the columns the model does not take.

    Raises:
        ValueError: missing user column, user ids of mixed types, no user, an impossible budget or sample rate,
            a first step that alone exceeds `target_epsilon`, an adaptive clipping count noise that alone would spend
            the budget (`clipping_count_noise` ≤ σ_eff/2), an invalid privacy field (also one set after the
            arguments were built), a model whose layers mix the examples of a batch (before any step), a
            `torch.compile`d model, `model_init`, a `compute_loss` override or a `compute_loss_func` without
            per-example losses, a checkpoint from a different privacy configuration or whose ledger does not match it.
        TypeError: `args` not [`DPTrainingArguments`]; `train_dataset` not a `datasets.Dataset` (a streamed
            `IterableDataset` included: materialise it first).
        UnsupportedLayerError: a trainable module the clipping engine has no rule for (before any step).
        RuntimeError: a transformers version whose Trainer lacks a hook DPTrainer overrides; (`train`) another
            live run holds `output_dir`.

    Example:

    ```python
    >>> args = DPTrainingArguments("out", target_epsilon=8.0, expected_batch_size=32, report_to="none")
    >>> trainer = DPTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
    >>> _ = trainer.train()  # prints Trainer's closing metrics
    {'train_runtime': ...}
    >>> trainer.privacy_report()["epsilon"] <= 8.0
    True

    ```
    """

    def __init__(
        self,
        model=None,
        args: DPTrainingArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        compute_loss_func=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        *,
        privacy_card_kwargs: dict | None = None,
    ):
        check_trainer_hooks()
        if not isinstance(args, DPTrainingArguments):
            raise TypeError("DPTrainer needs DPTrainingArguments (they carry the privacy settings).")
        # A copy: the plan sets max_steps and this flag, and the caller may reuse its arguments for another run.
        args = copy.copy(args)
        args.validate_privacy_fields()  # again: a field may have been set after the arguments were built
        _check_no_loss_override(type(self))
        _check_model(model, model_init)
        if train_dataset is None:
            raise ValueError("DPTrainer needs a train_dataset with a user column to account privacy.")
        if args.include_num_input_tokens_seen not in ("no", False, None):
            raise ValueError(
                "include_num_input_tokens_seen: the exact number of tokens in each Poisson sample is data-dependent "
                "and not covered by ε; set it to 'no' for DP training."
            )
        # Sampling resumes from the ledger's step, so Trainer's batch skipping is not needed.
        args.ignore_data_skip = True
        # The secret keys G's private draw and each user's rows; saved with checkpoints, never released.
        self._data_secret = _data_secret(args)
        self._user_dataset, self._requested_max_steps = train_dataset, args.max_steps
        self._build_partition(args, self._data_secret)
        if args.per_device_train_batch_size is None:  # a pass holds a Poisson sample: one pass per step
            args.per_device_train_batch_size = self._poisson_micro_batch(args)
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=self.partition.dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, model_init=None,
            compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
            raise ValueError("FSDP / DeepSpeed (from the accelerate config): sharded parameters are not supported by "
                             "the clipping engine yet; launch with a DDP config (recipes/configs/multi_gpu.yaml).")
        self._causal_lm = is_causal_lm(self.model)
        if isinstance(self.data_collator, DataCollatorWithFlattening) and not self._causal_lm:
            raise ValueError(_PACKED_NEEDS_TOKEN_HEAD.format(model=type(_unwrapped(self.model)).__name__))
        probe = self._probe_batch()
        check_batch_independence(self.model, probe)
        self._check_loss_func(probe)
        self.clipper = GhostClipper(self.model)
        self._verify_clipping(probe)
        self.privacy_plan = self._plan_privacy()
        self._plan_fits: bool | None = None  # see _plan_within_budget
        self.quantile_tracker = self._new_quantile_tracker()  # adaptive clipping's running C; None for a fixed C
        self.accountant = accounting.PrivacyAccountant()
        if _bound_epsilon(args):  # G was chosen from the data with ε-DP: a release the ledger must hold
            self.accountant.record_pure_dp("contribution_bound", _bound_epsilon(args))
        self.privacy_card_kwargs = dict(privacy_card_kwargs or {})
        self._seed = self._shared_seed()
        self._epsilon_spent = 0.0
        self._window = {"clipped_fraction": 0.0, "steps": 0}  # noised per-step fractions since the last log
        self.add_callback(_PrivacyProgress(self))
        self.add_callback(_LedgerCheckpoints(self))
        logger.info("DP plan: %s", self.privacy_plan)

    def _build_partition(self, args: DPTrainingArguments, secret: str) -> None:
        """Group the user dataset's rows by user under G (`self.partition`), and count its audit canaries once.

        The canaries' (users, kept rows) depend only on the data and G, both fixed with the partition: counting
        them here keeps [`privacy_report`] (run at the end of training and again for the card) from rescanning
        the user column every call.
        """
        self.partition = _partition(self._user_dataset, args, secret)
        self._canaries = _canary_counts(self._user_dataset, args.user_id_column, self.partition.contribution_bound)

    def _poisson_micro_batch(self, args: DPTrainingArguments) -> int:
        """Rows of one pass for a whole Poisson sample of this rank ([`~hf_dp.batching.poisson_capacity`]), from
        public settings only: the expected batch, G (ULS; without a bound a user counts one row, so long users
        take extra passes) and the world size."""
        rows_per_unit = (self.partition.contribution_bound or 1) if args.mechanism == "uls" else 1
        return poisson_capacity(args.expected_batch_size, rows_per_unit, world_size=max(1, args.world_size))

    # ---- plan -------------------------------------------------------------------------------

    def _plan_privacy(self) -> PrivacyPlan:
        args, part = self.args, self.partition
        mechanism = args.mechanism
        num_units = part.num_users if mechanism == "uls" else part.num_examples
        num_privacy_units = part.num_examples if mechanism == "example" else part.num_users
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
                f"{'users' if mechanism == 'uls' else 'examples'} available: lower --expected_batch_size."
            )
        steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs / sample_rate)
        args.max_steps = steps
        delta = args.target_delta if args.target_delta is not None else 1.0 / (10 * num_privacy_units)
        if delta >= 1.0 / num_privacy_units:
            raise ValueError(
                f"target_delta={delta:g} is not below 1/{num_privacy_units} {unit_name}: such a δ allows "
                f"releasing a whole {args.privacy_unit}'s data. Lower --target_delta (default 1/(10·{unit_name}))."
            )
        group_size = part.contribution_bound if mechanism == "els" else 1
        # σ_log = r·σ for the logged loss (and, for a fixed C, the clipped count); σ_b for the adaptive count.
        ratio = args.logging_noise_ratio if args.private_logging else None
        adaptive = _adaptive_clipping(args)
        count_noise = adaptive.count_noise_for(args.expected_batch_size) if adaptive else None
        sigma = args.noise_multiplier
        effective = None if sigma is None else _effective_noise(sigma, ratio, count_noise)
        bound_epsilon = _bound_epsilon(args)  # spent choosing G: DP-SGD gets the rest of the target
        if sigma is None:
            try:
                effective = accounting.noise_multiplier(
                    target_epsilon=args.target_epsilon - bound_epsilon, delta=delta, sample_rate=sample_rate,
                    steps=steps, group_size=group_size,
                )
            except ValueError as error:
                raise ValueError(
                    f"{error} Planned: {steps} steps at sample rate {sample_rate:.4g}. Raise --target_epsilon, "
                    "or train fewer steps/epochs or with a smaller --expected_batch_size."
                ) from error
            sigma = _gradient_noise(effective, ratio, count_noise, args)
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
        return PrivacyPlan(mechanism, num_units, num_privacy_units, sample_rate, steps, float(sigma), delta, group_size,
                           part.contribution_bound, logging_noise_multiplier=ratio * sigma if ratio else None,
                           effective_noise_multiplier=float(effective), adaptive_clipping=adaptive,
                           count_noise=count_noise)

    def _new_quantile_tracker(self) -> QuantileTracker | None:
        adaptive = self.privacy_plan.adaptive_clipping
        return adaptive.tracker(self.args.expected_batch_size) if adaptive is not None else None

    @property
    def clipping_norm(self) -> float:
        """C the next step clips at: the tracked norm with `adaptive_clipping`, else `max_grad_norm`."""
        return self.quantile_tracker.norm if self.quantile_tracker is not None else self.args.max_grad_norm

    def _probe_batch(self) -> dict:
        """The first training rows collated like a micro-batch, for the batch-independence and loss probes."""
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
        return send_to_device(features, self.args.device)

    def _check_loss_func(self, features: dict) -> None:
        """Refuse a `compute_loss_func` that does not return one loss per example (tried on the probe batch: it only
        decides whether to train, nothing is released)."""
        if self.compute_loss_func is None:
            return
        if isinstance(self.data_collator, DataCollatorWithFlattening):
            raise ValueError(_LOSS_FUNC_PACKED)
        rows = next(v.shape[0] for v in features.values() if torch.is_tensor(v) and v.dim() > 0)
        inputs = {k: v for k, v in features.items() if k != "labels"}
        was_training = self.model.training
        try:
            with torch.no_grad():
                outputs = self.model(**inputs)
                losses = self.compute_loss_func(outputs, features.get("labels"), num_items_in_batch=None)
        except Exception as error:
            reason = (str(error).strip().splitlines() or [""])[0]
            raise ValueError(f"compute_loss_func failed on the first training rows ({type(error).__name__}: "
                             f"{reason}); DPTrainer calls it as compute_loss_func(outputs, labels, "
                             "num_items_in_batch=None) and needs one loss per example, shape (batch,).") from error
        finally:
            self.model.train(was_training)
        _check_per_example(losses, rows)

    def _verify_clipping(self, features: dict) -> None:
        """Run the clipper's one-off checks (every gradient covered by a rule, every layer's rows attributed to
        their examples) on the probe rows, before any step: the first training step then needs no second backward
        pass and no kept graph, so it costs the memory of every other step. Only decides whether to train: the
        gradients are discarded and nothing is released."""
        inputs = {k: v for k, v in features.items() if k != "labels"}
        labels = features.get("labels")
        if labels is None:  # the first step says what is missing
            return
        was_training = self.model.training
        self.model.train()
        try:
            outputs = self.model(**inputs)
            if self.compute_loss_func is not None:
                losses = self.compute_loss_func(outputs, labels, num_items_in_batch=None).float()
            else:
                losses = per_example_loss(outputs.logits, labels, causal_lm=self._causal_lm)
            self.clipper.backward(losses, max_grad_norm=1.0)
        finally:
            self.model.zero_grad(set_to_none=True)
            self.model.train(was_training)

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
            unit_rows=self.partition.user_rows if plan.mechanism == "uls" else None,
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
        the expected batch size; 0 without private logging (then no loss is logged). Everything stays on the
        device: what the host needs about the sample (units, packing) is known before the forward pass, and the
        released sums are read back only when a log line needs them.
        """
        plan, args = self.privacy_plan, self.args
        model.train()
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        max_grad_norm = self._step_clipping_norm()  # C_t: fixed, or the tracked norm (from earlier releases only)
        expected_batch_size = plan.sample_rate * plan.num_units
        # Summed over micro-batches and ranks: [sum of unit losses clipped to [0, max_loss], units whose gradient
        # was clipped, Σ (1[norm ≤ C] − 1/2) over the units (adaptive clipping's centred count)]
        totals = torch.zeros(3, dtype=torch.float64, device=args.device)
        with self.accelerator.no_sync(model):  # clipped sums are all-reduced below, once
            for micro_batch in inputs.micro_batches:
                losses, example_ids = self._per_example_losses(model, micro_batch)
                units = micro_batch.units
                if micro_batch.loss_weights is not None:  # ULS: a user's gradient is that of their mean loss
                    losses = losses * to_device(micro_batch.loss_weights, losses.device)
                # 1/m folded into the clip factors: the clipped sums arrive normalised.
                norms = self.clipper.backward(losses, unit_ids=units, max_grad_norm=max_grad_norm,
                                              example_ids=example_ids, grad_scale=1.0 / expected_batch_size)
                unit_losses = losses.detach().float()
                if units is not None:  # ULS: the user's mean loss, in the order of `norms`
                    unit_losses = units.sum_examples(unit_losses)
                # Bounded per unit, a NaN included, so one unit moves the logged sum by at most max_loss.
                unit_losses = torch.nan_to_num(unit_losses, nan=args.max_loss).clamp(0.0, args.max_loss)
                totals += torch.stack([unit_losses.sum(dtype=torch.float64), (norms > max_grad_norm).sum(),
                                       centered_unclipped_count(norms, max_grad_norm)]).to(totals)
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
        add_noise(params, noise_multiplier=plan.noise_multiplier, max_grad_norm=max_grad_norm,
                  seed=self._seed, step=inputs.step, scale=1.0 / expected_batch_size)
        self._advance_ledger()
        loss_sum = self._release_scalars(totals, inputs.step, expected_batch_size)
        if loss_sum is None:  # nothing computed from the data is logged
            return torch.zeros((), dtype=torch.float32, device=args.device)
        return (loss_sum / expected_batch_size).to(torch.float32)

    def _per_example_losses(self, model, micro_batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One micro-batch's forward pass: `(B,)` losses, and for packed rows the host-side example of each token."""
        features = dict(micro_batch.features)
        # Packed rows (DataCollatorWithFlattening): several examples per row, positions restarting at each.
        example_ids = _packed_example_ids(features)  # on the host, before the copy: no device read
        if example_ids is not None:
            features["use_cache"] = False  # a cache turns off transformers' per-example attention masking
        features = to_device(features, self.args.device)
        labels = features.pop("labels", None)
        if labels is None:
            raise ValueError("DP training batches need 'labels' (per-example losses are computed from them).")
        with self.compute_loss_context_manager():
            outputs = model(**features)
        if self.compute_loss_func is not None:  # the user's loss: one per example (checked)
            if example_ids is not None:
                raise ValueError(_LOSS_FUNC_PACKED)
            losses = self.compute_loss_func(outputs, labels, num_items_in_batch=None)
            _check_per_example(losses, labels.shape[0])
            losses = losses.float()
        elif example_ids is None:
            losses = per_example_loss(outputs.logits, labels, causal_lm=self._causal_lm)
        else:
            logits = outputs.logits
            if logits.dim() != 3:
                raise ValueError(_PACKED_NEEDS_TOKEN_HEAD.format(model=type(_unwrapped(self.model)).__name__))
            num_examples = int(example_ids.numpy().max()) + 1  # a host tensor
            if micro_batch.num_examples is not None and num_examples != micro_batch.num_examples:
                raise ValueError(_examples_lost(num_examples, micro_batch.num_examples))
            losses = packed_per_example_loss(logits, labels, to_device(example_ids, logits.device), num_examples,
                                             causal_lm=self._causal_lm)
        if micro_batch.num_examples is not None and losses.shape[0] != micro_batch.num_examples:
            raise ValueError(_examples_lost(losses.shape[0], micro_batch.num_examples))
        return losses, example_ids

    def _step_clipping_norm(self):
        """C for this step: `max_grad_norm` (a float), or adaptive clipping's tracked C as a device tensor."""
        if self.quantile_tracker is None:
            return self.args.max_grad_norm
        return self.quantile_tracker.norm_on(self.args.device)

    def _release_scalars(self, totals: torch.Tensor, step: int, expected_batch_size: float) -> torch.Tensor | None:
        """Noise the step's scalar sums once, after the all-reduce (the same noise on every rank: shared seed).

        Fixed C, private logging: the loss sum and the clipped count (noise σ_log·max_loss, σ_log). Adaptive clipping:
        the centred unclipped count (noise σ_b; always released: it sets the next C), then with private logging the
        loss sum. Returns the noised loss sum (a device tensor), or `None` when no loss is released. The noise is
        drawn on the host and added on the device: nothing is read back here.
        """
        plan, args, tracker = self.privacy_plan, self.args, self.quantile_tracker
        logging = plan.logging_noise_multiplier is not None
        loss_noise = plan.logging_noise_multiplier * args.max_loss if logging else None
        if tracker is None:
            if not logging:
                return None
            loss_sum, clipped = add_scalar_noise(totals[:2], [loss_noise, plan.logging_noise_multiplier],
                                                 seed=self._seed, step=step)
            clipped_fraction = clipped / expected_batch_size
        else:
            values = torch.stack([totals[2], totals[0]]) if logging else totals[2:]
            released = add_scalar_noise(values, [plan.count_noise, loss_noise] if logging else [plan.count_noise],
                                        seed=self._seed, step=step)
            # ½ − R/m: the logged clipped fraction at this step's C, a post-processing of the count.
            clipped_fraction = tracker.clipped_fraction(released[0], expected_batch_size)
            tracker.update(released[0], expected_batch_size)  # C for the next step, on the device
            loss_sum = released[1] if logging else None
        self._window["clipped_fraction"] = self._window["clipped_fraction"] + clipped_fraction
        self._window["steps"] += 1
        return loss_sum

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

    # Private Trainer hooks with no public equivalent (their existence is checked by `check_trainer_hooks`).

    def _clip_grad_norm(self, model):
        """Global norm clipping is off: every unit was clipped to max_grad_norm already (Trainer's clipping would
        rescale the noised gradient)."""
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        """No `grad_norm` in the logs: the noised gradient's norm is mostly the noise's."""
        return None

    def _get_num_items_in_batch(self, batch_samples, device):
        """DP normalises by the expected batch size, never by the items sampled (a logical batch is no dict of
        tensors to count)."""
        return None

    def floating_point_ops(self, inputs) -> int:
        """Not counted (`total_flos` stays 0): the tokens of a Poisson sample are data-dependent, not covered by ε."""
        return 0

    # ---- reporting --------------------------------------------------------------------------

    def current_epsilon(self) -> float:
        """ε spent so far at the run's δ (the accountant's conservative bound)."""
        return self.accountant.epsilon(self.privacy_plan.delta) if self.accountant.steps \
            else self.accountant.pure_dp_epsilon  # before the first step: the choice of G, if any

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """Adds ε, δ, σ and q to training logs. `loss` and `dp/clipped_fraction` are the noised releases of
        `training_step` (covered by ε); without private logging no loss is logged at all.

        With adaptive clipping, `dp/max_grad_norm` is the tracked C after the last logged step (the next step's C)
        and `dp/clipped_fraction` the mean of ½ − R/m over the logged steps, R the noised centred count: both are
        post-processing of the count released every step, so they are logged with or without private logging."""
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
            if self.quantile_tracker is not None:
                logs["dp/max_grad_norm"] = self.quantile_tracker.norm
            window = self._window
            if not private_logging:
                del logs["loss"]
            if window["steps"]:  # steps with a released count: private logging, or adaptive clipping
                logs["dp/clipped_fraction"] = float(window["clipped_fraction"]) / window["steps"]  # read back here
            self._window = {"clipped_fraction": 0.0, "steps": 0}
        if not private_logging:
            logs.pop("train_loss", None)
        super().log(logs, start_time)

    def privacy_report(self) -> dict:
        """The guarantee earned so far, in the project's vocabulary (what the card and the app show).

        `mechanism` is the key of [`~hf_dp.vocabulary.MECHANISMS`] (`"uls"`, `"els"` or `"example"`) and
        `mechanism_description` its one-sentence account; `sampling` is the `sampling` argument at user level and
        `None` at example level (where it is unused). `num_users` and `num_examples` are rounded to 2 significant
        figures: they are not covered by ε.

        `max_grad_norm` is the clipping norm C: with `adaptive_clipping` the tracked C after the last step (what a
        continued run would clip at; a post-processing of the noised counts, covered by ε), with
        `initial_max_grad_norm` the C it started from and `target_unclipped_quantile`, `clipping_learning_rate`
        and `clipping_count_noise` (σ_b) its settings; for a fixed C those four are `None`.
        """
        from .card import round_count

        canary_users, canary_rows = self._canaries
        plan, args = self.privacy_plan, self.args
        adaptive = plan.adaptive_clipping
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
            "mechanism": plan.mechanism,
            "mechanism_description": MECHANISMS[plan.mechanism].description,
            "sampling": _sampling(args),
            "noise_multiplier": plan.noise_multiplier,
            "logging_noise_multiplier": plan.logging_noise_multiplier,
            "max_loss": args.max_loss if plan.logging_noise_multiplier is not None else None,
            "effective_noise_multiplier": plan.effective_noise_multiplier,
            "sample_rate": plan.sample_rate,
            "expected_batch_size": args.expected_batch_size,
            "steps": steps,
            "max_grad_norm": self.clipping_norm,
            "adaptive_clipping": adaptive is not None,
            "initial_max_grad_norm": args.max_grad_norm if adaptive else None,
            "target_unclipped_quantile": adaptive.target_quantile if adaptive else None,
            "clipping_learning_rate": adaptive.learning_rate if adaptive else None,
            "clipping_count_noise": plan.count_noise,
            "contribution_bound": plan.contribution_bound,
            # ε-DP choice of G ("auto": a DP median on the public grid; 0 when G was given) and DP-SGD's share of ε.
            "contribution_bound_epsilon": bound_epsilon,
            "contribution_bound_choice": _bound_choice(args, plan.mechanism, bound_epsilon),
            "epsilon_training": upper - self.accountant.pure_dp_epsilon,
            "num_users": round_count(self.partition.num_users - canary_users),
            "num_examples": round_count(self.partition.num_examples - canary_rows),
            "accountant": ACCOUNTANT_NAME + ("; mixture-of-Gaussians for ELS" if plan.mechanism == "els" else ""),
            "epsilon_group_privacy": None,
            "noise_seed": "os-entropy" if args.noise_seed is None else f"fixed seed for testing: {args.noise_seed}",
        }
        if plan.mechanism == "els" and steps:
            report["epsilon_group_privacy"] = accounting.group_privacy_epsilon(
                sample_rate=plan.sample_rate, noise_multiplier=plan.effective_noise_multiplier, steps=steps,
                delta=plan.delta, group_size=plan.group_size,
            ) + self.accountant.pure_dp_epsilon  # the same releases as `epsilon`, composed loosely
        return report

    def privacy_ledger(self) -> dict:
        """What `hf-dp publish` recomputes ε from: the accountant's state, δ, unit and mechanism (`privacy_unit`,
        `mechanism` and `sampling` as in [`privacy_report`])."""
        plan = self.privacy_plan
        return {"format": 1, "delta": plan.delta, "privacy_unit": self.args.privacy_unit,
                "mechanism": plan.mechanism, "sampling": _sampling(self.args),
                "accountant": self.accountant.state_dict()}

    def write_privacy_card(self, output_dir: str | None = None, **card_kwargs):
        """Write the privacy card to `output_dir/README.md` and the ledger beside it (`dp_ledger.json`, which
        `hf-dp publish` checks the card against). Post-processing: no effect on ε."""
        from .card import write_privacy_card

        kwargs = {"base_model": _base_model_name(self.model), **self.privacy_card_kwargs, **card_kwargs}
        return write_privacy_card(self.privacy_report(), output_dir or self.args.output_dir,
                                  ledger=self.privacy_ledger(), **kwargs)

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """Write the privacy card as `output_dir/README.md` (what `push_to_hub` publishes), with Trainer's fields.

        `model_name` is the card's title, `finetuned_from` its `base_model`, `tasks` its pipeline tag,
        `dataset_tags` (or `dataset`) its dataset; `language`, `license` and `tags` join its metadata (after the
        card's own tags). What `privacy_card_kwargs` sets wins. Post-processing: no effect on ε.

        Raises:
            ValueError: `dataset_args`, or several tasks or datasets (the card states one of each).
        """
        card_kwargs = _card_fields(model_name=model_name, finetuned_from=finetuned_from, tasks=tasks,
                                   dataset_tags=dataset_tags, dataset=dataset, dataset_args=dataset_args)
        if not self.is_world_process_zero():
            return
        path = self.write_privacy_card(**{k: v for k, v in card_kwargs.items() if k not in self.privacy_card_kwargs})
        _add_card_metadata(path, language=language, license=license, tags=tags)

    def hyperparameter_search(self, *args, **kwargs):
        """Refused: each trial would train on the private data and spend its own ε, which no ledger composes."""
        raise ValueError("hyperparameter_search: every trial trains on the private data and spends ε that no ledger "
                         "composes, so the chosen model's card would understate its privacy cost; tune on public or "
                         "synthetic data, then train once with DPTrainer.")

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

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              **kwargs):
        """Trainer's `train`, holding `output_dir`'s run lock, then the privacy card is written.

        `resume_from_checkpoint` (a folder, or `True` for the newest in `output_dir`) first restores the privacy
        ledger saved there, after checking it against the checkpoint and this run's privacy arguments.

        Raises:
            RuntimeError: another live run holds `output_dir` (its checkpoints and card would be mixed with these).
            ValueError: the checkpoint has no ledger, or one that is edited or does not match (see `_restore_ledger`).
        """
        with _output_dir_lock(self.args.output_dir, enabled=self.is_world_process_zero()):
            if resume_from_checkpoint is True:  # as Trainer does: the newest checkpoint in output_dir
                resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
                if resume_from_checkpoint is None:
                    raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            if resume_from_checkpoint:
                self._restore_ledger(resume_from_checkpoint)
            output = super().train(resume_from_checkpoint=resume_from_checkpoint or None, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            if self.is_world_process_zero():
                self.write_privacy_card()
        return output

    # ---- checkpoints: the ledger travels with every checkpoint ------------------------------

    def _write_checkpoint_ledger(self, folder: str) -> None:
        """Write the ledger (plan fingerprint, accountant, data secret, digest) into a checkpoint folder."""
        if not os.path.isdir(folder):
            raise RuntimeError(f"Trainer reported a checkpoint at {folder}, which does not exist: its privacy ledger "
                               "cannot be saved with it.")
        ledger = {
            "format": 2,
            "config": self.privacy_plan.fingerprint(self.args),
            "accountant": self.accountant.state_dict(),
            "data_secret": self._data_secret,  # a resumed run keeps G and the rows it chose; never released
            # adaptive clipping's running C: a resumed run clips where the checkpoint's would have
            "quantile_tracker": self.quantile_tracker.to_dict() if self.quantile_tracker is not None else None,
        }
        ledger["digest"] = _ledger_digest(ledger)
        with open(os.path.join(folder, LEDGER_NAME), "w") as f:
            json.dump(ledger, f, indent=2)

    def _use_data_secret(self, secret: str) -> None:
        """Resume: redo G's draw and the row choice with the checkpoint's secret, so they match the checkpoint's."""
        self._data_secret = secret
        self._build_partition(self.args, secret)
        self.train_dataset = self.partition.dataset
        self.args.max_steps = self._requested_max_steps  # the plan below sets it again
        self.privacy_plan = self._plan_privacy()
        self._plan_fits = None

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
        saved, current = dict(ledger["config"]), self.privacy_plan.fingerprint(self.args)
        if "mechanism" not in saved and "sampling" in saved:  # written before "sampling" became "mechanism"
            saved["mechanism"] = saved.pop("sampling")
        saved.setdefault("adaptive_clipping", False)  # written before adaptive clipping: a fixed C
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
        tracker = self._restored_tracker(path, ledger.get("quantile_tracker"), restored.steps)
        self.accountant.load_state_dict(ledger["accountant"])
        self.quantile_tracker = tracker
        self._plan_fits = None

    def _restored_tracker(self, path: str, state, steps: int) -> QuantileTracker | None:
        """The checkpoint's adaptive clipping state, checked against the plan and the ledger's step count."""
        plan = self.privacy_plan
        if plan.adaptive_clipping is None:
            if state is not None:
                raise ValueError(f"{path} holds an adaptive clipping state but its configuration says a fixed "
                                 "clipping norm: the ledger is inconsistent; start a new run.")
            return None
        try:
            tracker = QuantileTracker.from_dict(state)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: no valid adaptive clipping state ({error}); resume from a checkpoint of this "
                             "version or start a new run.") from None
        found = (tracker.target_quantile, tracker.learning_rate, tracker.count_noise, tracker.steps)
        expected = (plan.adaptive_clipping.target_quantile, plan.adaptive_clipping.learning_rate, plan.count_noise,
                    steps)
        if not all(_same(a, b) for a, b in zip(found, expected)):
            raise ValueError(f"{path}: its adaptive clipping state has (target_unclipped_quantile, "
                             f"clipping_learning_rate, clipping_count_noise, steps) = {found}, not this run's "
                             f"{expected}: the ledger does not match the plan; start a new run.")
        return tracker


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


class _LedgerCheckpoints(TrainerCallback):
    """Saves the privacy ledger into every checkpoint, right after Trainer wrote it (`on_save`)."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        if args.should_save:
            self.trainer._write_checkpoint_ledger(
                os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))


# Private Trainer methods DPTrainer overrides or calls, with the leading parameters (after self) each must take.
_TRAINER_HOOKS = {
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_get_num_items_in_batch": ("batch_samples", "device"),
    "_remove_unused_columns": ("dataset", "description"),
}


@functools.lru_cache(maxsize=None)
def check_trainer_hooks(trainer_class: type = Trainer) -> None:
    """Check that `trainer_class` has the private hooks DPTrainer overrides or calls, and that its training loop
    calls the overridden ones (else, e.g., its global clipping would rescale the noised gradient).

    Raises:
        RuntimeError: one line naming the hooks missing, the transformers version and the supported range.
    """
    problems = []
    for name, parameters in _TRAINER_HOOKS.items():
        hook = getattr(trainer_class, name, None)
        if not callable(hook):
            problems.append(f"{name} is missing")
            continue
        try:
            found = tuple(inspect.signature(hook).parameters)[1:]
        except (TypeError, ValueError):
            continue
        if found[: len(parameters)] != parameters:
            problems.append(f"{name}{tuple(found)} does not take {parameters}")
    try:
        source = inspect.getsource(trainer_class)
    except (OSError, TypeError):  # no source shipped: the names above are all that can be checked
        source = None
    if source is not None:
        problems += [f"its training loop never calls {name}" for name in _TRAINER_HOOKS
                     if name != "_remove_unused_columns" and f"self.{name}(" not in source]
    if problems:
        raise RuntimeError(
            f"hf_dp.DPTrainer supports transformers{SUPPORTED_TRANSFORMERS}; the installed transformers "
            f"{transformers.__version__} has a Trainer where {'; '.join(problems)}: install a supported version "
            f"(pip install 'transformers{SUPPORTED_TRANSFORMERS}')."
        )
    if trainer_class is Trainer and not _version_supported(transformers.__version__):
        warnings.warn(f"hf_dp is tested with transformers{SUPPORTED_TRANSFORMERS}, not {transformers.__version__}: "
                      "DPTrainer's Trainer hooks exist there, but install a tested version if anything misbehaves.",
                      stacklevel=3)


def _version_supported(version: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(SUPPORTED_TRANSFORMERS).contains(version, prereleases=True)


def _check_no_loss_override(trainer_class: type) -> None:
    """A subclass's `compute_loss` would be ignored by the DP step (it needs one loss per example): refused."""
    if trainer_class.compute_loss is not Trainer.compute_loss:
        raise ValueError(
            f"{trainer_class.__name__} overrides compute_loss, which DP training cannot use (it clips each unit's "
            "gradient, so it needs one loss per example, not a batch loss): remove the override and pass "
            "compute_loss_func=f, where f(outputs, labels, num_items_in_batch=None) returns a (batch,) tensor."
        )


def _check_model(model, model_init) -> None:
    if model_init is not None:
        raise ValueError("model_init: DPTrainer attaches its per-unit clipping to the model at construction and "
                         "Trainer would replace that model in train(); pass model=model_init() instead.")
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        raise ValueError(
            "model is a torch.compile wrapper: the per-unit clipping hooks into the model's layers, which makes the "
            "compiled graph break and recompile at every batch shape (slower, not faster); pass the model itself "
            "(model._orig_mod)."
        )


def _check_per_example(losses, rows: int) -> None:
    if not (torch.is_tensor(losses) and tuple(losses.shape) == (rows,)):
        shape = tuple(losses.shape) if torch.is_tensor(losses) else type(losses).__name__
        raise ValueError(
            f"compute_loss_func returned {shape} for a batch of {rows} examples: DP training clips each unit's "
            f"gradient, so it needs one loss per example, shape ({rows},) (e.g. reduction='none', then each "
            "example's mean over its tokens); return that, or drop compute_loss_func."
        )


def _sampling(args: DPTrainingArguments) -> str | None:
    """The `sampling` argument where it applies (user level), else `None`."""
    return args.sampling if args.privacy_unit == "user" else None


def _one(name: str, value):
    """A card field Trainer may pass as a list: one value, or a clear refusal."""
    if isinstance(value, (list, tuple)):
        if len(value) > 1:
            raise ValueError(f"create_model_card({name}={list(value)!r}): the privacy card states one; pass one.")
        return value[0] if value else None
    return value


def _card_fields(*, model_name, finetuned_from, tasks, dataset_tags, dataset, dataset_args) -> dict:
    """Trainer's `create_model_card` fields as privacy card arguments (those given)."""
    if dataset_args is not None:
        raise ValueError(f"create_model_card(dataset_args={dataset_args!r}): the privacy card names its dataset "
                         "(dataset_tags or dataset) but no dataset configuration; leave dataset_args unset.")
    fields = {"model_name": model_name, "base_model": finetuned_from, "task": _one("tasks", tasks),
              "dataset_name": _one("dataset_tags", dataset_tags) or _one("dataset", dataset)}
    return {key: value for key, value in fields.items() if value is not None}


def _add_card_metadata(path, *, language=None, license=None, tags=None) -> None:
    """Add `language`, `license` and `tags` (after the card's own) to a written card's front matter."""
    if language is None and license is None and not tags:
        return
    from huggingface_hub import ModelCard

    card = ModelCard.load(path)
    if language is not None:
        card.data.language = language
    if license is not None:
        card.data.license = license
    if tags:
        own = list(card.data.tags or [])
        card.data.tags = own + [tag for tag in ([tags] if isinstance(tags, str) else tags) if tag not in own]
    card.save(path)


_PACKED_NEEDS_TOKEN_HEAD = (
    "Packed (padding-free) batches, e.g. from DataCollatorWithFlattening, put several examples in one row and are "
    "supported for causal language models; {model} is not one: a sequence-classification head pools each row into "
    "one prediction, which cannot be split into the row's examples (DP needs per-example losses and gradients). "
    "Use a padding collator (DataCollatorWithPadding) for this model."
)


_LOSS_FUNC_PACKED = (
    "compute_loss_func with packed rows (DataCollatorWithFlattening): its losses would be one per packed row, not one "
    "per example; use a padding collator with compute_loss_func, or drop compute_loss_func (the built-in loss "
    "splits packed rows into their examples)."
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
    # Padding (left or right) may carry any position: only restarts between two real tokens count. Host tensors
    # (the collator's), read with numpy.
    restarts = (torch.diff(position_ids, dim=-1) != 1) & real[:, 1:] & real[:, :-1]
    if not restarts.cpu().numpy().any():
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


def _adaptive_clipping(args: DPTrainingArguments) -> AdaptiveClipping | None:
    """The adaptive clipping configuration of the arguments (C_0 = `max_grad_norm`), or `None` for a fixed C."""
    if not args.adaptive_clipping:
        return None
    return AdaptiveClipping(target_quantile=args.target_unclipped_quantile, learning_rate=args.clipping_learning_rate,
                            initial_norm=args.max_grad_norm, count_noise=args.clipping_count_noise)


def _effective_noise(sigma: float, ratio: float | None, count_noise: float | None) -> float:
    """σ_eff the ledger composes for gradient noise multiplier σ: (σ⁻² + 2·(r·σ)⁻²)^(-1/2) for a fixed C (loss and
    clipped count logged, r = `logging_noise_ratio`), (σ⁻² + (2σ_b)⁻² [+ (r·σ)⁻²])^(-1/2) with adaptive clipping."""
    if count_noise is not None:
        return effective_noise_multiplier(sigma, count_noise, logging_noise_ratio=ratio)
    return sigma / math.sqrt(1.0 + 2.0 / ratio**2) if ratio else sigma


def _gradient_noise(effective: float, ratio: float | None, count_noise: float | None,
                    args: DPTrainingArguments) -> float:
    """σ, the gradient noise multiplier that leaves the step at σ_eff (the inverse of [`_effective_noise`]).

    Raises:
        ValueError: with adaptive clipping, a count noise σ_b ≤ σ_eff/2 (the count alone would spend the budget).
    """
    if count_noise is None:
        return effective * math.sqrt(1.0 + 2.0 / ratio**2) if ratio else effective
    try:
        return gradient_noise_multiplier(effective, count_noise, logging_noise_ratio=ratio)
    except ValueError:
        default = " (the default expected_batch_size/20)" if args.clipping_count_noise is None else ""
        raise ValueError(
            f"clipping_count_noise={count_noise:g}{default} is not above σ_eff/2 = {effective / 2:g}, half the "
            f"noise multiplier target_epsilon allows for the whole step: adaptive clipping's count of unclipped "
            f"units alone would spend the budget. Raise --clipping_count_noise (a few times {effective / 2:g} keeps "
            "the gradient noise near σ_eff), raise --expected_batch_size or --target_epsilon, or turn "
            "--adaptive_clipping off."
        ) from None


def _bound_choice(args: DPTrainingArguments, mechanism: str, bound_epsilon: float) -> str:
    """How G was chosen, for the report and the card."""
    if mechanism == "example" or args.contribution_bound is None:
        return "none: every row is kept"
    if not bound_epsilon:
        return "given (contribution_bound): not read from the data"
    rule = "the ELS median" if mechanism == "els" else "the ULS noise-prediction heuristic on that median"
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


def _canary_counts(dataset, user_id_column: str, bound: int | None) -> tuple[int, int]:
    """(users, kept rows) of audit canaries ([`hf_dp.audit`]): trained on like any user (they count in q and δ),
    never counted in the report's or the card's number of users and examples."""
    from .audit.canaries import is_canary_user

    rows = Counter(user for user in dataset[user_id_column] if is_canary_user(user))
    return len(rows), sum(n if bound is None else min(n, bound) for n in rows.values())
