"""DPTrainer: transformers.Trainer with user-level DP-SGD.

Per optimizer step: Poisson-sample units -> per-unit clipped gradients (ghost clipping) ->
all-reduce -> Gaussian noise once -> divide by the expected batch size -> optimizer. The ledger
advances every step, is saved with every checkpoint and restored on resume.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_callback import ProgressCallback, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import accounting, planner
from .arguments import DPTrainingArguments
from .batching import LogicalBatches, identity
from .clipping import GhostClipper
from .data import examples_per_user, partition_by_user
from .losses import is_causal_lm, per_example_loss
from .noise import add_noise, fresh_seed
from .sampling import PoissonBatchSampler

logger = logging.getLogger(__name__)

LEDGER_NAME = "dp_state.json"
ACCOUNTANT_NAME = "prv-accountant (Gopi, Lee, Wutschitz 2021), both adjacency directions"


@dataclass(frozen=True)
class PrivacyPlan:
    """What the accountant composes, fixed before the first step."""

    mode: str  # "uls" | "els" | "example"
    num_units: int  # units sampled: users (ULS) or rows (ELS, example-level)
    num_privacy_units: int  # units protected: users, or rows for example-level
    sample_rate: float
    steps: int
    noise_multiplier: float
    delta: float
    group_size: int  # G for the ELS mixture-of-Gaussians accountant, else 1
    contribution_bound: int | None

    def fingerprint(self, args: DPTrainingArguments) -> dict:
        """Everything a resumed run must share with the checkpoint for the ledger to stay true."""
        return {
            "privacy_unit": args.privacy_unit,
            "sampling": self.mode,
            "max_grad_norm": args.max_grad_norm,
            "noise_multiplier": self.noise_multiplier,
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
    every checkpoint and the privacy card is written to `output_dir/README.md` at the end of `train()`.

    Args:
        model, args, train_dataset, ...: as for [`~transformers.Trainer`]; `args` must be [`DPTrainingArguments`].
        privacy_card_kwargs (`dict`, *optional*):
            Extra fields for the privacy card, e.g. `dataset_name`, `eval_result`, `baseline_result`
            (the public-only baseline), `nonprivate_result`, `metric_name`. Post-processing: no effect on ε.

    Raises:
        ValueError: missing user column, no user, an impossible budget or sample rate, a checkpoint from a
            different privacy configuration.
        UnsupportedLayerError: a trainable module the clipping engine has no rule for (before any step).

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
        # A copy: the plan sets max_steps and this flag, and the caller may reuse its arguments for another run.
        args = copy.copy(args)
        # Sampling resumes from the ledger's step, so Trainer's batch skipping is not needed.
        args.ignore_data_skip = True
        self.partition = partition_by_user(
            train_dataset, args.user_id_column, _contribution_bound(train_dataset, args), seed=args.seed
        )
        super().__init__(model=model, args=args, train_dataset=self.partition.dataset, **kwargs)
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
            raise ValueError("FSDP / DeepSpeed (from the accelerate config): sharded parameters are not supported by "
                             "the clipping engine yet; launch with a DDP config (recipes/configs/multi_gpu.yaml).")
        self.clipper = GhostClipper(self.model)
        self.privacy_plan = self._plan_privacy()
        self.accountant = accounting.PrivacyAccountant()
        self.privacy_card_kwargs = dict(privacy_card_kwargs or {})
        self._seed = self._shared_seed()
        self._causal_lm = is_causal_lm(self.model)
        self._epsilon_spent = 0.0
        self._window = {"units": 0, "clipped": 0}
        self._last_batch_units = 0
        self.add_callback(_PrivacyProgress(self))
        logger.info("DP plan: %s", self.privacy_plan)

    # ---- plan -------------------------------------------------------------------------------

    def _plan_privacy(self) -> PrivacyPlan:
        args, part = self.args, self.partition
        mode = args.accounting_mode
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
        sigma = args.noise_multiplier
        if sigma is None:
            try:
                sigma = accounting.noise_multiplier(
                    target_epsilon=args.target_epsilon, delta=delta, sample_rate=sample_rate, steps=steps,
                    group_size=group_size,
                )
            except ValueError as error:
                raise ValueError(
                    f"{error} Planned: {steps} steps at sample rate {sample_rate:.4g}. Raise --target_epsilon, "
                    "or train fewer steps/epochs or with a smaller --expected_batch_size."
                ) from error
        elif args.target_epsilon is not None:
            planned = accounting.epsilon(
                sample_rate=sample_rate, noise_multiplier=sigma, steps=steps, delta=delta, group_size=group_size
            )
            if planned > args.target_epsilon:
                logger.warning(
                    "noise_multiplier=%g spends ε=%.3g over the %d planned steps, above target_epsilon=%g: "
                    "training will stop early, before the budget is exceeded.", sigma, planned, steps,
                    args.target_epsilon,
                )
        return PrivacyPlan(mode, num_units, num_privacy_units, sample_rate, steps, float(sigma), delta, group_size,
                           part.contribution_bound)

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
        )
        return DataLoader(batches, batch_size=None, sampler=sampler, collate_fn=identity,
                          num_workers=self.args.dataloader_num_workers)

    # ---- one DP step ------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Clip every sampled unit, add noise once, normalise by the expected batch size."""
        plan, args = self.privacy_plan, self.args
        model.train()
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        # Summed over ranks below: [loss sum, rows, units clipped-or-not, units clipped]
        totals = torch.zeros(4, dtype=torch.float64, device=args.device)
        with self.accelerator.no_sync(model):  # clipped sums are all-reduced below, once
            for micro_batch in inputs.micro_batches:
                features = self._prepare_inputs(dict(micro_batch.features))
                labels = features.pop("labels", None)
                if labels is None:
                    raise ValueError("DP training batches need 'labels' (per-example losses are computed from them).")
                with self.compute_loss_context_manager():
                    logits = model(**features).logits
                losses = per_example_loss(logits, labels, causal_lm=self._causal_lm)
                if micro_batch.loss_weights is not None:  # ULS: a user's gradient is that of their mean loss
                    weighted, unit_ids = losses * micro_batch.loss_weights.to(losses.device), micro_batch.unit_ids.to(losses.device)
                else:
                    weighted, unit_ids = losses, None
                norms = self.clipper.backward(weighted, unit_ids=unit_ids, max_grad_norm=args.max_grad_norm)
                # Accumulated on the device: no host sync per micro-batch.
                totals[0] += losses.detach().sum().to(totals)
                totals[1] += len(losses)
                totals[2] += len(norms)
                totals[3] += (norms > args.max_grad_norm).sum().to(totals)
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
        loss_total, rows, units, clipped = totals.tolist()
        self._advance_ledger(inputs.total_units, int(units), int(clipped))
        return torch.tensor(loss_total / max(rows, 1.0), dtype=torch.float32, device=args.device)

    def _advance_ledger(self, sampled_units: int, clipped_units_seen: int, clipped_units: int) -> None:
        plan = self.privacy_plan
        self.accountant.step(sample_rate=plan.sample_rate, noise_multiplier=plan.noise_multiplier,
                             group_size=plan.group_size)
        self._last_batch_units = sampled_units
        self._window["units"] += clipped_units_seen
        self._window["clipped"] += clipped_units
        if self.args.target_epsilon is not None:
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
        return sum(super(DPTrainer, self).floating_point_ops(mb.features) for mb in inputs.micro_batches)

    def _track_num_input_tokens(self, inputs):
        for micro_batch in inputs.micro_batches:
            super()._track_num_input_tokens(micro_batch.features)

    # ---- reporting --------------------------------------------------------------------------

    def current_epsilon(self) -> float:
        """ε spent so far at the run's δ (the accountant's conservative bound)."""
        return self.accountant.epsilon(self.privacy_plan.delta) if self.accountant.steps else 0.0

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "loss" in logs:
            plan = self.privacy_plan
            self._epsilon_spent = self.current_epsilon()
            window = self._window
            logs.update({
                "dp/epsilon": self._epsilon_spent,
                "dp/delta": plan.delta,
                "dp/noise_multiplier": plan.noise_multiplier,
                "dp/sample_rate": plan.sample_rate,
                "dp/batch_units": self._last_batch_units,
                "dp/clipped_fraction": window["clipped"] / window["units"] if window["units"] else 0.0,
            })
            self._window = {"units": 0, "clipped": 0}
        super().log(logs, start_time)

    def privacy_report(self) -> dict:
        """The guarantee earned so far, in the project's vocabulary (what the card and the app show)."""
        plan, args = self.privacy_plan, self.args
        steps = self.accountant.steps
        if steps:
            lower, estimate, upper = self.accountant.epsilon_bounds(plan.delta)
        else:
            lower = estimate = upper = 0.0
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
            "sample_rate": plan.sample_rate,
            "expected_batch_size": args.expected_batch_size,
            "steps": steps,
            "max_grad_norm": args.max_grad_norm,
            "contribution_bound": plan.contribution_bound,
            "num_users": self.partition.num_users,
            "num_examples": self.partition.num_examples,
            "accountant": ACCOUNTANT_NAME + ("; mixture-of-Gaussians for ELS" if plan.mode == "els" else ""),
            "epsilon_group_privacy": None,
            "noise_seed": "os-entropy" if args.noise_seed is None else f"fixed seed for testing: {args.noise_seed}",
        }
        if plan.mode == "els" and steps:
            report["epsilon_group_privacy"] = accounting.group_privacy_epsilon(
                sample_rate=plan.sample_rate, noise_multiplier=plan.noise_multiplier, steps=steps,
                delta=plan.delta, group_size=plan.group_size,
            )
        return report

    def write_privacy_card(self, output_dir: str | None = None, **card_kwargs):
        """Write the privacy card to `output_dir/README.md` (post-processing: no effect on ε)."""
        from .model_card import write_privacy_card

        kwargs = {"base_model": _base_model_name(self.model), **self.privacy_card_kwargs, **card_kwargs}
        return write_privacy_card(self.privacy_report(), output_dir or self.args.output_dir, **kwargs)

    def create_model_card(self, *args, **kwargs) -> None:
        """`push_to_hub` publishes the privacy card as the repo README."""
        if self.is_world_process_zero():
            self.write_privacy_card()

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Offline or unreachable Hub: one clear `HubUnreachableError` before any repo is created."""
        from .publish import ensure_hub_reachable

        ensure_hub_reachable()
        super().init_hf_repo(token=token, private=private)

    def push_to_hub(self, *args, **kwargs):
        """Trainer's `push_to_hub` (privacy card as README), after checking the Hub is reachable: nothing is
        uploaded offline (`HF_HUB_OFFLINE=1`) or when the endpoint does not answer (`HubUnreachableError`)."""
        from .publish import ensure_hub_reachable

        ensure_hub_reachable()
        return super().push_to_hub(*args, **kwargs)

    def train(self, *args, **kwargs):
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
                "format": 1,
                "config": self.privacy_plan.fingerprint(self.args),
                "accountant": self.accountant.state_dict(),
            }
            with open(os.path.join(folder, LEDGER_NAME), "w") as f:
                json.dump(ledger, f, indent=2)
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self._restore_ledger(resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _restore_ledger(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, LEDGER_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint} has no privacy ledger ({LEDGER_NAME}): it was not written by DPTrainer. Resuming "
                "from it would lose the ε already spent; start a new run instead."
            )
        with open(path) as f:
            ledger = json.load(f)
        saved, current = ledger["config"], self.privacy_plan.fingerprint(self.args)
        changed = {k: (saved.get(k), v) for k, v in current.items() if not _same(saved.get(k), v)}
        if changed:
            details = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in changed.items())
            raise ValueError(
                f"Checkpoint {checkpoint} was trained under a different privacy configuration ({details}). "
                "Resume with the same privacy arguments and data, or start a new run."
            )
        self.accountant.load_state_dict(ledger["accountant"])


class _PrivacyProgress(TrainerCallback):
    """Shows ε spent, σ and the sampled batch size on Trainer's progress bar."""

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
                        batch=trainer._last_batch_units, refresh=False)


_MECHANISMS = {
    "uls": "user-level sampling (ULS): Poisson-sampled users, per-user clipped mean gradient, Gaussian noise",
    "els": "example-level sampling (ELS): Poisson-sampled examples, per-example clipping, at most G examples "
           "per user, user-level guarantee by the mixture-of-Gaussians accountant",
    "example": "DP-SGD: Poisson-sampled examples, per-example clipping, Gaussian noise (example-level guarantee)",
}


def _contribution_bound(dataset, args: DPTrainingArguments) -> int | None:
    """G from the arguments; 'auto' follows Charles et al. 2024.

    ELS: the median rows per user. ULS: the noise-prediction heuristic under the compute budget of
    `expected_batch_size` users at the median rows per user (examples per step), for the run's
    steps and target ε (see [`~hf_dp.planner.recommend_contribution_bound_uls`]).
    """
    if args.contribution_bound is None or (args.accounting_mode == "example" and args.contribution_bound == "auto"):
        return None  # no bound: every row is kept
    if args.contribution_bound != "auto":
        return int(args.contribution_bound)
    counts = examples_per_user(dataset, args.user_id_column)
    if len(counts) == 0:
        return None  # partition_by_user raises the clear error
    median = planner.recommend_contribution_bound_els(counts)
    if args.accounting_mode == "els" or args.expected_batch_size > len(counts):
        return median  # (ULS with too few users: the plan raises the clear error)
    sample_rate = args.expected_batch_size / len(counts)
    steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs / sample_rate)
    return planner.recommend_contribution_bound_uls(
        counts, units_per_step=args.expected_batch_size * median, steps=steps,
        target_epsilon=args.target_epsilon or planner.DEFAULT_TARGET_EPSILON, delta=args.target_delta,
    )


def _base_model_name(model) -> str | None:
    """The Hub id the model was loaded from; `None` for a local folder (pass `base_model` to the card)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = getattr(getattr(base, "config", None), "_name_or_path", None)
    return name if name and not os.path.exists(name) else None


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and np.isclose(a, b, rtol=1e-9, atol=0)
    return a == b
