"""DP training as a mixin for any `transformers.Trainer`, and `DPTrainer`, that mixin on `Trainer`.

Per optimizer step: Poisson-sample units -> per-unit clipped gradients (ghost clipping) -> all-reduce -> Gaussian
noise once -> divide by the expected batch size -> optimizer; the ledger advances every step and travels with every
checkpoint. This module only wires the stages, each in its own module: `contribution` (G, the user partition),
`privacy_plan`, `budget` (accountant and target ε), `compatibility` (checks before step 1), `sampling` and
`batching`, `step` (losses, clipping, aggregation), `releases` (scalar releases), `checkpoint`, `report`.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorWithFlattening, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import checkpoint, compatibility, contribution, preflight, sharding
from .arguments import DPTrainingArguments
from .batch_independence import check_batch_independence
from .batching import LogicalBatches, identity, poisson_capacity
from .budget import PrivacyBudget
from .callbacks import PrivacyProgress, agree_on_jit_saves
from .clipping import GhostClipper
from .clipping.adaptive import QuantileTracker
from .data import check_user_column
from .guards import PrivacyGuards
from .losses import PACKED_NEEDS_TOKEN_HEAD
from .model_kind import is_causal_lm, underlying_model
from .mechanisms import get_mechanism
from .noise import fresh_seed
from .privacy_plan import PrivacyPlan, plan_privacy
from .report import PrivacyReporting
from .row_order import check_row_order
from .sampling import PoissonBatchSampler
from .step import DPStep, StepSettings

logger = logging.getLogger(__name__)

__all__ = ["DPTrainerMixin", "DPTrainer", "PrivacyPlan"]


class DPTrainerMixin(PrivacyGuards, PrivacyReporting):
    """User-level (or example-level) DP-SGD for a `transformers.Trainer` subclass: `class T(DPTrainerMixin, Base)`.

    Takes the base trainer's constructor arguments (`model, args, data_collator, train_dataset, ...`, `args` a
    [`DPTrainingArguments`]) plus `privacy_card_kwargs`; replaces the training step, the training data loader, the
    logs and the model card; refuses what would break the guarantee. See [`DPTrainer`] for the behaviour.

    Construction, in order: the base trainer (which may prepare the data, as SFTTrainer tokenizes it, keeping the user
    column); the user partition under G ([`_partition_users`]); the checks of the model, the loss and the clipping on
    the first rows; then the privacy plan, the budget and the [`~hf_dp.step.DPStep`] ([`_plan_step`]). A resumed run
    whose checkpoint drew G and the rows with another secret repeats the partition and the plan the same way.
    """

    # Trainer subclasses whose `compute_loss` override this class knowingly replaces with per-example losses.
    known_loss_overrides: tuple = ()
    # Users trained on like any other (they count in q and δ) but left out of the stated numbers of users and
    # examples: an audit's canaries (`hf_dp.audit` sets it before training).
    uncounted_user_ids: frozenset = frozenset()

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, *trainer_args,
                 privacy_card_kwargs: dict | None = None, **trainer_kwargs):
        base = trainer_base(type(self))
        compatibility.check_trainer_hooks(base)
        if not isinstance(args, DPTrainingArguments):
            raise TypeError(f"{type(self).__name__} needs DPTrainingArguments (they carry the privacy settings).")
        args = args.checked_copy()
        compatibility.check_no_loss_override(type(self), self.known_loss_overrides)
        given = inspect.signature(base.__init__).bind_partial(
            None, model, args, data_collator, train_dataset, *trainer_args, **trainer_kwargs).arguments
        compatibility.check_model(model, given.get("model_init"))
        if given.get("eval_dataset") is not None and train_dataset is not None:
            compatibility.check_eval_users(given["eval_dataset"], train_dataset, args.user_id_column)
        if train_dataset is None:
            raise ValueError("DP training needs a train_dataset with a user column to account privacy.")
        check_user_column(train_dataset, args.user_id_column)
        privacy_card_kwargs = preflight.check_given(type(self), DPTrainerMixin, args, model, privacy_card_kwargs)
        if isinstance(model, torch.nn.Module):
            compatibility.check_model_state(model)  # before Trainer moves it
        # What the user asked for, before the plan sets them: a resumed run replans from these.
        self._requested_pass_rows, self._requested_max_steps = args.per_device_train_batch_size, args.max_steps
        args.per_device_train_batch_size = self._pass_rows(args, partition=None)  # provisional: one row per unit
        # The data secret keys G's private draw and each user's rows; saved with checkpoints, never released. Known
        # before the base trainer builds: one that prepares rows (DPSFTTrainer) draws each user's G rows with it first.
        self._data_secret = checkpoint.secret_to_resume(args) or contribution.data_secret(args)
        super().__init__(model, args, data_collator, train_dataset, *trainer_args, **trainer_kwargs)
        self._user_dataset = self.train_dataset  # as the base trainer prepared it (the user column kept)
        self._partition_users(self._data_secret)
        compatibility.check_model_state(self.model)
        compatibility.check_labels(self.partition.dataset, underlying_model(self.model))
        preflight.check_input_ids(self.partition.dataset, self.model)
        preflight.check_mixed_precision(self.accelerator)
        sharding.check_supported(self)  # FSDP2 trains sharded; DeepSpeed and FSDP1 are refused
        self._causal_lm = is_causal_lm(self.model)
        if isinstance(self.data_collator, DataCollatorWithFlattening) and not self._causal_lm:
            raise ValueError(PACKED_NEEDS_TOKEN_HEAD.format(model=type(underlying_model(self.model)).__name__))
        model_rows = self._remove_unused_columns(self.partition.dataset, description="training")
        self._probe = compatibility.probe_batch(model_rows, self.data_collator, device=self.args.device,
                                                rows=max(2, self.args.per_device_train_batch_size))
        check_row_order(model_rows, self.data_collator)  # rows reach the clipper with their own unit
        check_batch_independence(self.model, self._probe)  # again by the DP step, on the model as it trains
        compatibility.check_loss_func(self.model, self.compute_loss_func, self.data_collator, self._probe)
        self.clipper = GhostClipper(self.model)
        compatibility.verify_clipping(self.model, self.clipper, self._probe, loss_func=self.compute_loss_func,
                                      dataset=self.partition.dataset, causal_lm=self._causal_lm)
        self.privacy_card_kwargs = privacy_card_kwargs
        self._seed = self._shared_seed()
        self.budget = None
        self._plan_step()
        self.add_callback(PrivacyProgress(self))
        agree_on_jit_saves(self)
        self.args.freeze_privacy_fields()  # the plan is made: a privacy field changed now is refused
        logger.info("DP plan: %s", self.privacy_plan)

    # ---- setup: one sequence for a fresh run and a resumed one -------------------------------------------------

    def _partition_users(self, data_secret: str) -> None:
        """Group the user dataset's rows by user under G, drawn with `data_secret` (`self.partition`)."""
        self._data_secret = data_secret
        self.partition = contribution.partition(self._user_dataset, self.args, data_secret)
        self.train_dataset = self.partition.dataset
        self.args.per_device_train_batch_size = self._pass_rows(self.args, self.partition)

    def _plan_step(self) -> None:
        """The privacy plan of this partition, the budget (a fresh one, or the run's, replanned), and the DP step."""
        noised = sum(param.numel() for param in self.model.parameters() if param.requires_grad)
        plan = plan_privacy(self.args, self.partition, noised_elements=noised, max_steps=self._requested_max_steps)
        self.args.max_steps = plan.steps
        if self.budget is None:
            self.budget = PrivacyBudget(plan, self.args.target_epsilon, contribution.bound_epsilon(self.args))
        else:
            self.budget.replan(plan)
        adaptive = plan.adaptive_clipping
        tracker = QuantileTracker.start(adaptive, plan.expected_batch_size) if adaptive is not None else None
        args = self.args
        settings = StepSettings(
            device=args.device, causal_lm=self._causal_lm, max_loss=args.max_loss, secure_noise=args.secure_noise,
            distributed=self.accelerator.num_processes > 1, sharded=self.is_fsdp_enabled,
            keep_state_before_step=args.enable_jit_checkpoint, probe_batch=self._probe,
            half_precision=args.bf16 or args.fp16, loss_func=self.compute_loss_func,
            forward_context=self.compute_loss_context_manager, backward_context=self.accelerator.no_sync)
        self.dp_step = DPStep(self.budget, self.clipper, self._seed, settings, quantile_tracker=tracker)

    def _pass_rows(self, args: DPTrainingArguments, partition) -> int:
        """Rows of one pass: the requested `per_device_train_batch_size`, else enough for this rank's whole Poisson
        sample (a unit's rows for ULS; one row per unit before the users are partitioned), from public settings."""
        if self._requested_pass_rows:
            return self._requested_pass_rows
        bound = partition.contribution_bound if partition is not None else None
        rows_per_unit = get_mechanism(args.mechanism).rows_per_unit(bound)
        return poisson_capacity(args.expected_batch_size, rows_per_unit, world_size=max(1, args.world_size))

    @property
    def privacy_plan(self) -> PrivacyPlan:
        """What the accountant composes at every step (fixed before the first)."""
        return self.budget.plan

    @property
    def accountant(self):
        """The run's [`~hf_dp.accounting.PrivacyAccountant`] (its ledger of releases)."""
        return self.budget.accountant

    @property
    def quantile_tracker(self) -> QuantileTracker | None:
        """Adaptive clipping's running C; `None` for a fixed C."""
        return self.dp_step.quantile_tracker

    @property
    def clipping_norm(self) -> float:
        """C the next step clips at: the tracked norm with `adaptive_clipping`, else `max_grad_norm`."""
        return self.dp_step.clipping_norm()

    @property
    def canary_counts(self) -> tuple[int, int]:
        """(users, kept rows) of `uncounted_user_ids`: trained on, left out of the stated counts."""
        kept = None if self.partition.redraw else self.partition.contribution_bound  # redrawn: every row is trained
        return contribution.counts_of(self._user_dataset, self.args.user_id_column, kept, self.uncounted_user_ids)

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
        batches = LogicalBatches(dataset, unit_rows=plan.dp_mechanism.unit_rows(self.partition),
                                 redraw=self.partition.redraw, data_collator=self.data_collator,
                                 micro_batch_size=self.args.per_device_train_batch_size,
                                 align_passes=self.is_fsdp_enabled)
        sampler = PoissonBatchSampler(
            plan.num_units, plan.sample_rate, plan.steps, self._seed, rank=self.args.process_index,
            world_size=self.args.world_size, start_step=self.budget.steps,
            within_budget=self.budget.allows if self.args.target_epsilon is not None else None,
        )
        return DataLoader(batches, batch_size=None, sampler=sampler, collate_fn=identity,
                          num_workers=self.args.dataloader_num_workers)

    # ---- one DP step ------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One DP step ([`~hf_dp.step.DPStep.run`]): clip every sampled unit, add noise once, record it, release.

        Returns the noised mean loss (see `private_logging`): the clipped unit losses' sum plus noise, divided by
        the expected batch size; 0 without private logging (then no loss is logged). Nothing is read back to the
        host: the released sums are read only when a log line needs them.
        """
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        model.train()
        loss, keep_going = self.dp_step.run(model, params, inputs)  # the first step also prepares it (the probe)
        if not keep_going:
            self.control.should_training_stop = True
        return loss

    # Private Trainer hooks with no public equivalent (their existence is checked by `check_trainer_hooks`).

    def _clip_grad_norm(self, model):
        """Global norm clipping is off: every unit was clipped to max_grad_norm already (Trainer's clipping would
        rescale the noised gradient)."""
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        """No `grad_norm` in the logs: the noised gradient's norm is mostly the noise's."""
        return None

    def _get_num_items_in_batch(self, batch_samples, device):
        """DP normalises by the expected batch size, never by the items sampled."""
        return None

    def floating_point_ops(self, inputs) -> int:
        """Not counted (`total_flos` stays 0): the tokens of a Poisson sample are data-dependent, not covered by ε."""
        return 0

    # ---- reporting --------------------------------------------------------------------------

    def current_epsilon(self) -> float:
        """ε spent so far at the run's δ (the accountant's conservative bound)."""
        return self.budget.epsilon()

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """Adds ε, δ, σ and q to training logs. `loss` and `dp/clipped_fraction` are the noised releases of
        `training_step` (covered by ε); without private logging no loss is logged at all.

        With adaptive clipping, `dp/clipping_norm` (the next step's C) and `dp/clipped_fraction` are post-processing
        of the count released every step, so they are logged with or without private logging."""
        plan = self.privacy_plan
        if "loss" in logs:
            logs.update({"dp/epsilon": self.current_epsilon(), "dp/delta": self.budget.delta(),
                         "dp/noise_multiplier": plan.noise_multiplier, "dp/sample_rate": plan.sample_rate})
            if self.quantile_tracker is not None:
                logs["dp/clipping_norm"] = self.quantile_tracker.norm
            if not plan.private_logging:
                del logs["loss"]
            clipped_fraction = self.dp_step.take_clipped_fraction()
            if clipped_fraction is not None:  # steps with a released count: private logging, or adaptive clipping
                logs["dp/clipped_fraction"] = clipped_fraction
        if not plan.private_logging:
            logs.pop("train_loss", None)
        super().log(logs, start_time)

    def hyperparameter_search(self, *args, **kwargs):
        """Refused: each trial would train on the private data and spend its own ε, which no ledger records."""
        raise ValueError("hyperparameter_search: every trial trains on the private data and spends ε that no ledger "
                         "records, so the chosen model's card would understate its privacy cost; tune on public or "
                         "synthetic data, then train once with DPTrainer.")

    # ---- train, checkpoints and resume ------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              **kwargs):
        """Trainer's `train`, holding `output_dir`'s run lock, then the privacy card is written.

        `resume_from_checkpoint` (a folder, or `True` for the newest in `output_dir`) first restores the ledger
        saved there, after checking it against the checkpoint and this run's privacy arguments.

        Raises:
            RuntimeError: another live run holds `output_dir` (its checkpoints and card would be mixed with these).
            ValueError: the checkpoint has no ledger, or one that is edited or does not match.
        """
        with checkpoint.output_dir_lock(self.args.output_dir, enabled=self.is_world_process_zero()):
            if resume_from_checkpoint is True:  # the newest checkpoint whose privacy state verifies
                resume_from_checkpoint, skipped = checkpoint.newest_complete_checkpoint(self.args.output_dir)
                for reason in skipped:
                    logger.warning("Not resuming from %s", reason)
                logger.warning("Resuming from %s, the newest complete checkpoint.", resume_from_checkpoint)
            if resume_from_checkpoint:
                self._resume_privacy_state(resume_from_checkpoint)
            try:
                output = super().train(resume_from_checkpoint=resume_from_checkpoint or None, trial=trial,
                                       ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            except Exception:
                if self.args.world_size > 1:  # say which rank saw it, and how to go on
                    logger.error(checkpoint.stopped_rank_note(self.args))
                raise
            if self.is_world_process_zero():
                self.write_privacy_card()
        return output

    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint, with the privacy state written first (so a folder holding Trainer's last file,
        `trainer_state.json`, holds it too); also for just-in-time saves, which bypass `on_save`."""
        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            self.save_privacy_state(folder)
        with checkpoint.failure_stated(folder):  # e.g. a full disk inside torch.save
            super()._save_checkpoint(model, trial)

    def save_privacy_state(self, folder: str) -> None:
        """Write the ledger and the resume state of the model's current weights into a checkpoint folder.

        A save between a step's releases and its optimizer update (a just-in-time save) writes the state before
        that step: the weights saved have not taken it, and a resumed run takes it again (with the same sample and
        noise only under a fixed `noise_seed`: a fresh secret is never saved).
        """
        state = self.dp_step.state_to_save(self.state.global_step)
        checkpoint.write_checkpoint(folder, ledger=self.privacy_ledger(state),
                                    fingerprint=self.privacy_plan.fingerprint(self.args), data_secret=self._data_secret,
                                    quantile_tracker=state.quantile_tracker)

    def _resume_privacy_state(self, folder: str) -> None:
        """Restore the ledger, the data secret and adaptive clipping's C from a checkpoint, after checking them."""
        saved = checkpoint.read_checkpoint(folder)
        discarded_draw = 0.0
        if saved.data_secret is not None and saved.data_secret != self._data_secret:
            # Redo G's draw and the row choice with the checkpoint's secret, so they match the checkpoint's (the
            # same sequence as at construction). The draw made at construction read the data too: its ε stays.
            discarded_draw = self.budget.bound_epsilon
            self._partition_users(saved.data_secret)
            self._plan_step()
        tracker = checkpoint.check_saved_run(saved, self.privacy_plan, self.args)
        self.dp_step.restore(saved.accountant, tracker)
        if discarded_draw:
            self.accountant.record_pure_dp("contribution_bound (drawn at construction, replaced on resume)",
                                           discarded_draw)
            logger.warning("contribution_bound='auto' was drawn at construction, then replaced by the checkpoint's: "
                           "ε=%g more in the ledger (set args.resume_from_checkpoint to draw once).", discarded_draw)


class DPTrainer(DPTrainerMixin, Trainer):
    r"""
    A drop-in [`~transformers.Trainer`] that trains with user-level (or example-level) DP-SGD.

    Swap `Trainer` for `DPTrainer` and `TrainingArguments` for [`DPTrainingArguments`]; the training dataset
    needs a user column (`args.user_id_column`). Everything Trainer does (callbacks, logging, evaluation,
    checkpoints, `resume_from_checkpoint`, `push_to_hub`) keeps working; the privacy ledger travels with
    every checkpoint and the privacy card is written to `output_dir/README.md` at the end of `train()`, with the
    ledger beside it (`dp_ledger.json`). Logs hold ε, δ, σ, q and, with `private_logging` (the default), a noised
    `loss` and `dp/clipped_fraction` that the ledger records; nothing else computed from the data.

    Adaptive clipping (`adaptive_clipping=True`), packed batches (`DataCollatorWithFlattening` with a causal LM)
    and several processes work as described in docs/trainer.md; ε is exactly that of the plain run in each case.

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

    Trainer's extension points (`compute_loss` overrides refused, `create_model_card` writing the privacy card,
    `hyperparameter_search` refused, the private Trainer hooks still overridden and checked against
    `SUPPORTED_TRANSFORMERS`): see docs/trainer.md, "Trainer's contract".

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

    def __init__(self, model=None, args: DPTrainingArguments | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, model_init=None, compute_loss_func=None,
                 compute_metrics=None, callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, *, privacy_card_kwargs: dict | None = None):
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, model_init,
                         compute_loss_func, compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics, privacy_card_kwargs=privacy_card_kwargs)


def trainer_base(trainer_class: type) -> type:
    """The transformers Trainer class a DP trainer class builds on (the first after the mixin in its MRO)."""
    for cls in trainer_class.__mro__:
        if issubclass(cls, Trainer) and not issubclass(cls, DPTrainerMixin):
            return cls
    raise TypeError(f"{trainer_class.__name__} takes DPTrainerMixin but no transformers.Trainer: declare it as "
                    f"class {trainer_class.__name__}(DPTrainerMixin, <a Trainer subclass>).")
