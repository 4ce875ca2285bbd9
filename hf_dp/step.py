"""One DP-SGD step as one object: [`DPStep`] owns the stages of an optimizer step, in order.

    losses → clip → aggregate (all-reduce, noise) → record (the ledger) → release (the noised scalars)

It is built once from values — the privacy plan and budget, the clipper, the run's secret, adaptive clipping's
tracker and [`StepSettings`] (what the step needs from its trainer: device, loss function, forward and no-sync
contexts, the probe rows) — and rebuilt the same way when a resumed run replans. The trainer's `training_step` only
hands it the model, the parameters the optimizer updates and this rank's share of the Poisson sample.

What only a new model needs is done once, in [`DPStep.prepare`], before the first step and again whenever the
parameters, the module tree, a module's hooks or its gradient checkpointing change: the parameters' names (they key
the noise), the switch of the clipper to FSDP2's shards, the batch-independence probe on the model as it trains
(with every hook attached), and the clipper's model check. A steady-state step runs the stages only.

Aggregation all-reduces the clipped sums across ranks (each rank clipped its own units; under FSDP2 they were
reduce-scattered into the gradient shards pass by pass), adds the Gaussian noise once (the same on every rank for
the same element, from the shared secret) and leaves every gradient divided by the expected batch size q·N
(folded into the clip factors and the noise scale). Everything stays on the device: what the host needs about the
sample (units, packing) is known before the forward pass.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.nn.modules import module as torch_module

from .batch_independence import check_batch_independence
from .budget import PrivacyBudget
from .clipping import GhostClipper
from .clipping.accumulate import ClippedGrads
from .clipping.adaptive import QuantileTracker
from .compatibility import check_per_example
from .losses import PACKED_NEEDS_TOKEN_HEAD, LOSS_FUNC_PACKED, examples_lost, packed_example_ids
from .model_kind import underlying_model
from .losses import packed_per_example_loss, per_example_loss
from .noise import add_noise
from .releases import ScalarReleases, StepSums
from .sharding import check_sharded, is_sharded, reduce_scatter_rows, reshard
from .transfer import to_device

__all__ = ["DPStep", "StepSettings", "StepState", "check_some_gradient"]


@dataclass(frozen=True)
class StepSettings:
    """What one DP step needs from its trainer, as values.

    Attributes:
        device: where the micro-batches go.
        causal_lm: shift labels for a causal LM's default loss.
        max_loss: each unit's logged loss is clipped to [0, max_loss] (private logging).
        secure_noise: draw the noise's bits from SHAKE-256.
        distributed: all-reduce the clipped sums (several processes).
        sharded: FSDP2 shards the parameters (the clipper follows the shards from the first step).
        keep_state_before_step: keep the ledger and tracker as they stand before each step's ledger entry (a
            just-in-time save lands between the noise and the optimizer update and must save the state before it).
        probe_batch: the first training rows, collated on the device, that the batch-independence probe runs on at
            the first step (and after any change to the model); `None`: no probe.
        half_precision: the forward pass computes in half precision (the probe's tolerance).
        loss_func: the user's `compute_loss_func(outputs, labels, num_items_in_batch=None)` returning one loss per
            example, or `None` for the default per-example loss.
        forward_context: a context for each forward pass (Trainer's `compute_loss_context_manager`, autocast: a
            method, since a Trainer subclass may override it).
        backward_context: a context around the clipped backward passes, given the model (accelerate's `no_sync`:
            the clipped sums are all-reduced once, in aggregate).
    """

    device: torch.device
    causal_lm: bool
    max_loss: float
    secure_noise: bool = False
    distributed: bool = False
    sharded: bool = False
    keep_state_before_step: bool = False
    probe_batch: dict | None = None
    half_precision: bool = False
    loss_func: Callable | None = None
    forward_context: Callable = contextlib.nullcontext
    backward_context: Callable = field(default=lambda model: contextlib.nullcontext())


@dataclass(frozen=True)
class StepState:
    """The step's privacy state at one moment, independent of the live one: the budget (its ledger) and adaptive
    clipping's tracker (`None` for a fixed C). What a checkpoint saves."""

    budget: PrivacyBudget
    quantile_tracker: QuantileTracker | None

    @property
    def clipping_norm(self) -> float:
        """C the next step clips at, as of this state."""
        return self.quantile_tracker.norm if self.quantile_tracker is not None else self.budget.plan.max_grad_norm


class DPStep:
    """One optimizer step of DP-SGD: clipped per-unit gradients, noised once, in the ledger, scalars released.

    Args:
        budget: the run's [`~hf_dp.budget.PrivacyBudget`] (its plan says q·N, σ, C, what is released).
        clipper: the [`~hf_dp.clipping.GhostClipper`] attached to the model.
        seed: the run's secret (keys the noise of every release).
        settings: [`StepSettings`].
        quantile_tracker: adaptive clipping's running C (from C₀, the plan's `max_grad_norm`), or `None` for the
            plan's fixed C.
    """

    def __init__(self, budget: PrivacyBudget, clipper: GhostClipper, seed: int, settings: StepSettings, *,
                 quantile_tracker: QuantileTracker | None = None):
        self.budget, self.clipper, self.seed, self.settings = budget, clipper, seed, settings
        self._tracker = quantile_tracker
        plan = budget.plan
        self.releases = ScalarReleases(plan, settings.max_loss, seed, settings.secure_noise)
        # The plan's values every step reads, read once (the plan is fixed before the first step).
        self._expected_batch_size, self._noise_multiplier = plan.expected_batch_size, plan.noise_multiplier
        self._max_grad_norm = plan.max_grad_norm
        self._prepared_for = None  # what `prepare` last saw: (parameters, the model's structure)
        self._names: list = []
        self._before_step: StepState | None = None  # see `state_to_save`

    @property
    def plan(self):
        return self.budget.plan

    @property
    def quantile_tracker(self) -> QuantileTracker | None:
        """Adaptive clipping's running C; `None` for a fixed C."""
        return self._tracker

    def clipping_norm(self, device=None):
        """C_t, the norm this step clips at: the plan's fixed `max_grad_norm`, or adaptive clipping's tracked C (from
        earlier releases only), as a 0-dim tensor on `device` when given (no host read), else a float."""
        if self._tracker is None:
            return self._max_grad_norm
        return self._tracker.norm_on(device) if device is not None else self._tracker.norm

    # ---- what a new model needs, once ----

    def prepare(self, model, params: list) -> None:
        """What only a new model needs, before the step that first sees it (see the module's docstring); `run`
        calls it whenever `params` or the model's structure changed since the last call.

        Raises:
            ValueError: (FSDP2) a trainable parameter not sharded along its first dimension on a 1-D mesh; a model
                whose outputs mix the examples of a batch (the probe); reentrant gradient checkpointing.
        """
        settings = self.settings
        named = {id(param): name for name, param in self.clipper.model.named_parameters()}
        # Before any forward: FSDP2 swaps in whole parameters while one runs. The names are the same on every rank,
        # sharded or not: they key the noise.
        self._names = [named.get(id(param), f"#{index}") for index, param in enumerate(params)]
        if settings.sharded:  # accelerate has sharded the model by now
            check_sharded(params)
            self.clipper.shard(reduce_scatter_rows)
        if settings.probe_batch is not None:  # the model as it trains, with every hook attached by now
            check_batch_independence(model, settings.probe_batch, half_precision=settings.half_precision)
            reshard(model)  # the probe's forward left the root's parameters whole
        self.clipper.check_model()
        self._prepared_for = (list(params), _structure(model))

    def _unchanged(self, model, params: list) -> bool:
        """Whether `params` and the model's structure are those `prepare` last saw (`params` held there: their ids
        cannot be reused)."""
        prepared = self._prepared_for
        return (prepared is not None and len(params) == len(prepared[0])
                and all(map(operator.is_, params, prepared[0])) and _structure(model) == prepared[1])

    # ---- the stages, in order ----

    # ---- the stages, in order ----

    def losses(self, model, micro_batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One micro-batch's forward pass: `(B,)` losses, and for packed rows the host-side example of each token."""
        settings = self.settings
        features = dict(micro_batch.features)
        # Packed rows (DataCollatorWithFlattening): several examples per row, positions restarting at each.
        example_ids = packed_example_ids(features)  # on the host, before the copy: no device read
        if example_ids is not None:
            features["use_cache"] = False  # a cache turns off transformers' per-example attention masking
        features = to_device(features, settings.device)
        labels = features.pop("labels", None)
        if labels is None:
            raise ValueError("DP training batches need 'labels' (per-example losses are computed from them).")
        with settings.forward_context():
            outputs = model(**features)
        if settings.loss_func is not None:  # the user's loss: one per example (checked)
            if example_ids is not None:
                raise ValueError(LOSS_FUNC_PACKED)
            losses = settings.loss_func(outputs, labels, num_items_in_batch=None)
            check_per_example(losses, labels.shape[0])
            losses = losses.float()
        elif example_ids is None:
            losses = per_example_loss(outputs.logits, labels, causal_lm=settings.causal_lm)
        else:
            logits = outputs.logits
            if logits.dim() != 3:
                raise ValueError(PACKED_NEEDS_TOKEN_HEAD.format(model=type(underlying_model(model)).__name__))
            num_examples = int(example_ids.numpy().max()) + 1  # a host tensor
            if micro_batch.num_examples is not None and num_examples != micro_batch.num_examples:
                raise ValueError(examples_lost(num_examples, micro_batch.num_examples))
            losses = packed_per_example_loss(logits, labels, to_device(example_ids, logits.device), num_examples,
                                             causal_lm=settings.causal_lm)
        if micro_batch.num_examples is not None and losses.shape[0] != micro_batch.num_examples:
            raise ValueError(examples_lost(losses.shape[0], micro_batch.num_examples))
        return losses, example_ids

    def clip(self, model, micro_batches, max_grad_norm, into: ClippedGrads | None = None) -> StepSums:
        """Forward and clipped backward of every micro-batch: each unit's gradient clipped to `max_grad_norm` and
        summed into `into` (float32 whatever the parameters' dtype; unset: rounded into `.grad` at the end),
        divided by the expected batch size; returns the step's summed scalar statistics."""
        expected_batch_size, settings = self._expected_batch_size, self.settings
        sums = StepSums(settings.device)
        clipped = ClippedGrads() if into is None else into
        with settings.backward_context(model):
            for micro_batch in micro_batches:
                losses, example_ids = self.losses(model, micro_batch)
                units = micro_batch.units
                if micro_batch.loss_weights is not None:  # ULS: a user's gradient is that of their mean loss
                    losses = losses * to_device(micro_batch.loss_weights, losses.device)
                norms = self.clipper.backward(losses, unit_ids=units, max_grad_norm=max_grad_norm,
                                              example_ids=example_ids, grad_scale=1.0 / expected_batch_size,
                                              into=clipped, check_model=self._prepared_for is None)
                unit_losses = losses.detach().float()
                if units is not None:  # ULS: the user's mean loss, in the order of `norms` (the unit index owns it)
                    unit_losses = units.sum_examples(unit_losses)
                if not micro_batch.padding:  # a padding pass (FSDP2) contributes zero and releases nothing
                    sums.add(unit_losses, norms, max_grad_norm, settings.max_loss)
        if into is None:
            clipped.round_into_grads()
        return sums

    def aggregate(self, params: list, names: list, sums: StepSums, *, max_grad_norm, step: int,
                  clipped: ClippedGrads | None = None) -> None:
        """All-reduce the clipped sums (sharded gradients were reduce-scattered already, pass by pass), then add
        N(0, (σ·C/(q·N))²) once to every gradient element, keyed by the parameters' `names`, and round each sum once
        into its parameter's `.grad` (sums of bf16/fp16 parameters stay float32 until then)."""
        clipped = ClippedGrads() if clipped is None else clipped
        grads = clipped.grads(params)  # float32 buffers of narrow parameters, else `.grad` (zeros where missing)
        if self.settings.distributed:
            for grad in grads:
                if not is_sharded(grad):
                    torch.distributed.all_reduce(grad)
            sums.all_reduce()
        add_noise(params, names=names, noise_multiplier=self._noise_multiplier, max_grad_norm=max_grad_norm,
                  seed=self.seed, step=step, scale=1.0 / self._expected_batch_size,
                  secure=self.settings.secure_noise, grads=grads)
        clipped.round_into_grads()

    def record(self) -> bool:
        """The step's entry in the ledger; `False` when one more step would exceed the target ε."""
        return self.budget.record_step()

    def release(self, sums: StepSums, step: int) -> torch.Tensor | None:
        """The step's noised scalars (adaptive clipping's C moves on the device); the noised loss sum, or `None`."""
        return self.releases.release(sums, step, self._tracker)

    # ---- the whole step ----

    def run(self, model, params: list, batch) -> tuple[torch.Tensor, bool]:
        """The stages in order on this rank's share of one logical batch, after [`prepare`] when `params` or the
        model changed; returns (the noised mean loss, or 0 without private logging, and whether training may go
        on)."""
        if not self._unchanged(model, params):
            self.prepare(model, params)
        max_grad_norm = self.clipping_norm(self.settings.device if self._tracker is not None else None)
        clipped = ClippedGrads()  # the clipped sums, float32 until the noise is added
        sums = self.clip(model, batch.micro_batches, max_grad_norm, into=clipped)
        check_some_gradient(params, batch.micro_batches, clipped)
        self.aggregate(params, self._names, sums, max_grad_norm=max_grad_norm, step=batch.step, clipped=clipped)
        if self.settings.keep_state_before_step:  # before the ledger entry: a just-in-time save keeps this state
            self._before_step = self.state()
        keep_going = self.record()
        loss_sum = self.release(sums, batch.step)
        if loss_sum is None:  # nothing computed from the data is logged
            return torch.zeros((), dtype=torch.float32, device=self.settings.device), keep_going
        return (loss_sum / self._expected_batch_size).to(torch.float32), keep_going

    # ---- its state: logged, saved, restored ----

    def take_clipped_fraction(self) -> float | None:
        """The mean noised clipped fraction of the steps since the last call (a host read), or `None` if none was
        released (see [`~hf_dp.releases.ScalarReleases`])."""
        return self.releases.take_clipped_fraction()

    def state(self) -> StepState:
        """The budget and the tracker as they stand, copied (the tracker without a device read)."""
        tracker = self._tracker.copy() if self._tracker is not None else None
        return StepState(self.budget.copy(), tracker)

    def state_to_save(self, optimizer_steps: int) -> StepState:
        """The state a checkpoint taken after `optimizer_steps` optimizer updates saves: the current one, or, for a
        just-in-time save between a step's ledger entry and its optimizer update, the state before that step (the
        weights saved have not taken it; a resumed run takes it again)."""
        if self.budget.steps == optimizer_steps + 1 and self._before_step is not None:
            return self._before_step
        return self.state()

    def restore(self, accountant, quantile_tracker: QuantileTracker | None) -> None:
        """Continue from a checkpoint: its ledger and adaptive clipping's tracker (both checked against the plan)."""
        self.budget.restore(accountant)
        self._tracker = quantile_tracker
        self._before_step = None


def _structure(model) -> list:
    """What `DPStep.prepare` depends on in the model: every module, its forward hooks, a `forward` set on the
    instance and its gradient checkpointing, and torch's global forward hooks (a new hook or forward may mix the
    batch; reentrant checkpointing is refused). Compared by identity."""
    hooks = tuple(tuple(getattr(torch_module, name, ())) for name in ("_global_forward_pre_hooks",
                                                                      "_global_forward_hooks"))
    return [hooks] + [(module, tuple(module._forward_pre_hooks), tuple(module._forward_hooks),
                       module.__dict__.get("forward"), module.__dict__.get("gradient_checkpointing"),
                       module.__dict__.get("_gradient_checkpointing_func"))
                      for module in model.modules()]


def check_some_gradient(params: list, micro_batches, clipped: ClippedGrads | None = None) -> None:
    """A non-empty sample that produced no gradient means the optimizer's parameters are not the model's."""
    buffers = clipped.buffers if clipped is not None else {}
    if micro_batches and not any(param.grad is not None or param in buffers for param in params):
        raise RuntimeError(
            "A non-empty batch produced no gradient for any parameter the optimizer updates: the trainable "
            "parameters are not those in the forward pass (e.g. LoRA adapters replaced after the optimizer was "
            "built) or everything is frozen. Stopping instead of spending privacy budget on nothing."
        )
