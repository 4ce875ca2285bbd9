"""DP training as a mixin for any `transformers.Trainer`, and `DPTrainer`, that mixin on `Trainer`.

Per optimizer step: Poisson-sample units -> per-unit clipped gradients (ghost clipping) -> all-reduce -> Gaussian
noise once -> divide by the expected batch size -> optimizer; the ledger advances every step and travels with every
checkpoint. This module only wires the stages, each in its own module: `contribution` (G, the user partition),
`privacy_plan`, `budget` (accountant and target ε), `compatibility` (checks before step 1), `sampling` and
`batching`, `step` (losses, clipping, aggregation), `releases` (scalar releases), `checkpoint`, `report`.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os

import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorWithFlattening, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import checkpoint, compatibility, contribution, sharding, step
from .arguments import DPTrainingArguments
from .batch_independence import check_batch_independence
from .batching import LogicalBatches, identity, poisson_capacity
from .budget import PrivacyBudget
from .callbacks import PrivacyProgress
from .clipping import GhostClipper
from .clipping.adaptive import QuantileTracker
from .losses import PACKED_NEEDS_TOKEN_HEAD, base_model, is_causal_lm
from .noise import fresh_seed
from .privacy_plan import PrivacyPlan, plan_privacy
from .releases import ScalarReleases
from .report import PrivacyReporting
from .sampling import PoissonBatchSampler

logger = logging.getLogger(__name__)

__all__ = ["DPTrainerMixin", "DPTrainer", "PrivacyPlan"]


class DPTrainerMixin(PrivacyReporting):
    """User-level (or example-level) DP-SGD for a `transformers.Trainer` subclass: `class T(DPTrainerMixin, Base)`.

    Takes the base trainer's constructor arguments (`model, args, data_collator, train_dataset, ...`, `args` a
    [`DPTrainingArguments`]) plus `privacy_card_kwargs`; replaces the training step, the training data loader, the
    logs and the model card; refuses what would break the guarantee. See [`DPTrainer`] for the behaviour.
    """

    # Trainer subclasses whose `compute_loss` override this class knowingly replaces with per-example losses.
    known_loss_overrides: tuple = ()
    # Whether the base trainer prepares (e.g. tokenizes) `train_dataset` in its constructor, keeping the user column:
    # the users are then partitioned from its result instead of from the dataset given.
    prepares_train_dataset: bool = False

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, *trainer_args,
                 privacy_card_kwargs: dict | None = None, **trainer_kwargs):
        base = trainer_base(type(self))
        compatibility.check_trainer_hooks(base)
        if not isinstance(args, DPTrainingArguments):
            raise TypeError(f"{type(self).__name__} needs DPTrainingArguments (they carry the privacy settings).")
        args = _dp_arguments(args)
        compatibility.check_no_loss_override(type(self), self.known_loss_overrides)
        given = inspect.signature(base.__init__).bind_partial(
            None, model, args, data_collator, train_dataset, *trainer_args, **trainer_kwargs).arguments
        compatibility.check_model(model, given.get("model_init"))
        if given.get("eval_dataset") is not None and train_dataset is not None:
            compatibility.check_eval_users(given["eval_dataset"], train_dataset, args.user_id_column)
        if train_dataset is None:
            raise ValueError("DP training needs a train_dataset with a user column to account privacy.")
        # The data secret keys G's private draw and each user's rows; saved with checkpoints, never released.
        self._user_dataset, self._requested_max_steps = train_dataset, args.max_steps
        self._data_secret = checkpoint.secret_to_resume(args) or contribution.data_secret(args)
        requested = args.per_device_train_batch_size  # None: a pass holds a whole Poisson sample
        if isinstance(model, torch.nn.Module):
            compatibility.check_model_state(model)  # before Trainer moves it
        if not self.prepares_train_dataset:
            self._partition_users(args)
            train_dataset = self.partition.dataset
        args.per_device_train_batch_size = requested or self._pass_rows(args)  # provisional until partitioned
        super().__init__(model, args, data_collator, train_dataset, *trainer_args, **trainer_kwargs)
        if self.prepares_train_dataset:  # the base prepared it (the user column kept): partition the result
            self._user_dataset = self.train_dataset
            self._partition_users(self.args)
            self.train_dataset = self.partition.dataset
            self.args.per_device_train_batch_size = requested or self._pass_rows(self.args)
        compatibility.check_model_state(self.model)
        compatibility.check_labels(self.partition.dataset, base_model(self.model))
        sharding.check_supported(self)  # FSDP2 trains sharded; DeepSpeed and FSDP1 are refused
        self._sharded_clipping = False  # the clipper follows FSDP2's sharded parameters from the first step
        self._causal_lm = is_causal_lm(self.model)
        if isinstance(self.data_collator, DataCollatorWithFlattening) and not self._causal_lm:
            raise ValueError(PACKED_NEEDS_TOKEN_HEAD.format(model=type(base_model(self.model)).__name__))
        probe = compatibility.probe_batch(self, self.partition.dataset)
        check_batch_independence(self.model, probe)
        self._probe = probe  # probed again on the model as it trains (the base trainer attaches hooks in train())
        compatibility.check_loss_func(self, probe)
        self.clipper = GhostClipper(self.model)
        compatibility.verify_clipping(self, probe, causal_lm=self._causal_lm)
        self.budget = PrivacyBudget(self._plan(), self.args.target_epsilon, contribution.bound_epsilon(self.args))
        self.quantile_tracker = self._new_quantile_tracker()  # adaptive clipping's running C; None for a fixed C
        self.privacy_card_kwargs = dict(privacy_card_kwargs or {})
        self._seed = self._shared_seed()
        self.releases = ScalarReleases(self.privacy_plan, self.args.max_loss, self._seed, self.args.secure_noise)
        self._state_before_step = None  # (ledger, tracker) before the last step's releases, see save_privacy_state
        self.add_callback(PrivacyProgress(self))
        logger.info("DP plan: %s", self.privacy_plan)

    # ---- setup ------------------------------------------------------------------------------

    def _partition_users(self, args: DPTrainingArguments) -> None:
        """Group the user dataset's rows by user under G (`self.partition`), and count its audit canaries once."""
        self.partition = contribution.partition(self._user_dataset, args, self._data_secret)
        self.canary_counts = contribution.canary_counts(self._user_dataset, args.user_id_column,
                                                    self.partition.contribution_bound)

    def _pass_rows(self, args: DPTrainingArguments) -> int:
        """Rows of one pass holding this rank's whole Poisson sample (G rows per user for ULS), from public settings."""
        partition = getattr(self, "partition", None)  # before it (a base that prepares the data): one row per unit
        rows_per_unit = (partition.contribution_bound or 1) if partition is not None and args.mechanism == "uls" else 1
        return poisson_capacity(args.expected_batch_size, rows_per_unit, world_size=max(1, args.world_size))

    def _plan(self) -> PrivacyPlan:
        """The privacy plan of these arguments and this partition; every trainable value is noised each step."""
        noised = sum(param.numel() for param in self.model.parameters() if param.requires_grad)
        return plan_privacy(self.args, self.partition, noised_elements=noised)

    @property
    def privacy_plan(self) -> PrivacyPlan:
        """What the accountant composes at every step (fixed before the first)."""
        return self.budget.plan

    @property
    def accountant(self):
        """The run's [`~hf_dp.accounting.PrivacyAccountant`] (its ledger of releases)."""
        return self.budget.accountant

    def _new_quantile_tracker(self) -> QuantileTracker | None:
        adaptive = self.privacy_plan.adaptive_clipping
        return adaptive.tracker(self.args.expected_batch_size) if adaptive is not None else None

    @property
    def clipping_norm(self) -> float:
        """C the next step clips at: the tracked norm with `adaptive_clipping`, else `max_grad_norm`."""
        return self.quantile_tracker.norm if self.quantile_tracker is not None else self.args.max_grad_norm

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
        batches = LogicalBatches(dataset, unit_rows=self.partition.user_rows if plan.mechanism == "uls" else None,
                                 data_collator=self.data_collator,
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
        """Clip every sampled unit, add noise once, normalise by the expected batch size.

        Returns the noised mean loss (see `private_logging`): the clipped unit losses' sum plus noise, divided by
        the expected batch size; 0 without private logging (then no loss is logged). Nothing is read back to the
        host: the released sums are read only when a log line needs them.
        """
        plan = self.privacy_plan
        if self._probe is not None:  # the first step: the model as it trains, with every hook Trainer.train attached
            check_batch_independence(model, self._probe)
            self._probe = None
        model.train()
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        if self.is_fsdp_enabled and not self._sharded_clipping:  # accelerate has sharded the model by now
            sharding.check_sharded(params)
            self.clipper.shard(sharding.add_to_shard)
            self._sharded_clipping = True
        # C_t: fixed, or adaptive clipping's tracked norm (from earlier releases only), as a device tensor
        max_grad_norm = self.quantile_tracker.norm_on(self.args.device) if self.quantile_tracker is not None \
            else self.args.max_grad_norm
        with self.accelerator.no_sync(model):  # clipped sums are all-reduced once, in aggregate
            sums = step.clip_units(self, model, inputs.micro_batches, max_grad_norm=max_grad_norm,
                                   expected_batch_size=plan.expected_batch_size, causal_lm=self._causal_lm)
        step.check_some_gradient(params, inputs.micro_batches)
        step.aggregate(params, self._parameter_names(params), sums, noise_multiplier=plan.noise_multiplier,
                       max_grad_norm=max_grad_norm, seed=self._seed, step=inputs.step,
                       expected_batch_size=plan.expected_batch_size, distributed=self.accelerator.num_processes > 1,
                       secure_noise=self.args.secure_noise)
        if self.args.enable_jit_checkpoint:  # only a just-in-time save lands between here and the update
            self._state_before_step = self._privacy_state()
        if not self.budget.record_step():
            self.control.should_training_stop = True
        loss_sum = self.releases.release(sums, inputs.step, self.quantile_tracker)
        if loss_sum is None:  # nothing computed from the data is logged
            return torch.zeros((), dtype=torch.float32, device=self.args.device)
        return (loss_sum / plan.expected_batch_size).to(torch.float32)

    def _parameter_names(self, params) -> list[str]:
        """The parameters' names in the model, the same on every rank, sharded or not: they key the noise."""
        names = getattr(self, "_names_by_id", {})
        if any(id(param) not in names for param in params):
            names = self._names_by_id = {id(param): name for name, param in self.model.named_parameters()}
        return [names.get(id(param), f"#{index}") for index, param in enumerate(params)]

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

        With adaptive clipping, `dp/max_grad_norm` (the next step's C) and `dp/clipped_fraction` are post-processing
        of the count released every step, so they are logged with or without private logging."""
        plan = self.privacy_plan
        if "loss" in logs:
            logs.update({"dp/epsilon": self.current_epsilon(), "dp/delta": self.budget.delta(),
                         "dp/noise_multiplier": plan.noise_multiplier, "dp/sample_rate": plan.sample_rate})
            if self.quantile_tracker is not None:
                logs["dp/max_grad_norm"] = self.quantile_tracker.norm
            if not plan.private_logging:
                del logs["loss"]
            clipped_fraction = self.releases.take_clipped_fraction()
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
            sharding.check_resume(self, resume_from_checkpoint)  # refused under FSDP2, as saving is
            if resume_from_checkpoint is True:  # the newest checkpoint whose privacy state verifies
                resume_from_checkpoint, skipped = checkpoint.newest_complete_checkpoint(self.args.output_dir)
                for reason in skipped:
                    logger.warning("Not resuming from %s", reason)
                logger.warning("Resuming from %s, the newest complete checkpoint.", resume_from_checkpoint)
            if resume_from_checkpoint:
                self._resume_privacy_state(resume_from_checkpoint)
            output = super().train(resume_from_checkpoint=resume_from_checkpoint or None, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
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

    def _privacy_state(self) -> tuple[dict, QuantileTracker | None]:
        """The ledger and adaptive clipping's tracker as they stand (the tracker copied without a device read)."""
        tracker = self.quantile_tracker.copy() if self.quantile_tracker is not None else None
        return self.privacy_ledger(), tracker

    def save_privacy_state(self, folder: str) -> None:
        """Write the ledger and the resume state of the model's current weights into a checkpoint folder.

        A save between a step's releases and its optimizer update (a just-in-time save) writes the state before
        that step: the weights saved have not taken it, and a resumed run takes it again (with the same sample and
        noise only under a fixed `noise_seed`: a fresh secret is never saved).
        """
        ledger, tracker = self._privacy_state()
        if self.budget.steps == self.state.global_step + 1 and self._state_before_step is not None:
            ledger, tracker = self._state_before_step
        checkpoint.write_checkpoint(folder, ledger=ledger, fingerprint=self.privacy_plan.fingerprint(self.args),
                                    data_secret=self._data_secret, quantile_tracker=tracker)

    def _resume_privacy_state(self, folder: str) -> None:
        """Restore the ledger, the data secret and adaptive clipping's C from a checkpoint, after checking them."""
        saved = checkpoint.read_checkpoint(folder)
        discarded_draw = 0.0
        if saved.data_secret is not None and saved.data_secret != self._data_secret:
            # Redo G's draw and the row choice with the checkpoint's secret, so they match the checkpoint's. The
            # draw made at construction read the data too: its ε stays in the ledger.
            discarded_draw = self.budget.bound_epsilon
            self._data_secret = saved.data_secret
            self._partition_users(self.args)
            self.train_dataset = self.partition.dataset
            self.args.max_steps = self._requested_max_steps  # the plan sets it again
            self.budget.replan(self._plan())
            self.releases = ScalarReleases(self.privacy_plan, self.args.max_loss, self._seed, self.args.secure_noise)
        tracker = checkpoint.check_saved_run(saved, self.privacy_plan, self.args)
        self.budget.restore(saved.accountant)
        if discarded_draw:
            self.accountant.record_pure_dp("contribution_bound (drawn at construction, replaced on resume)",
                                           discarded_draw)
            logger.warning("contribution_bound='auto' was drawn at construction, then replaced by the checkpoint's: "
                           "ε=%g more in the ledger (set args.resume_from_checkpoint to draw once).", discarded_draw)
        self.quantile_tracker = tracker


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


def _dp_arguments(args: DPTrainingArguments) -> DPTrainingArguments:
    """A checked copy of the arguments (the plan sets `max_steps`, and the caller may reuse its arguments)."""
    args = copy.copy(args)
    args.validate_privacy_fields()  # again: a field may have been set after the arguments were built
    if args.include_num_input_tokens_seen not in ("no", False, None):
        raise ValueError("include_num_input_tokens_seen: the exact number of tokens in each Poisson sample is "
                         "data-dependent and not covered by ε; set it to 'no' for DP training.")
    args.ignore_data_skip = True  # sampling resumes from the ledger's step: no batches to skip
    return args
