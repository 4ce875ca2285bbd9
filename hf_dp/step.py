"""One DP-SGD step as one object: [`DPStep`] owns the stages of an optimizer step, in order.

    losses → clip → aggregate (all-reduce, noise) → record (the ledger) → release (the noised scalars)

It is built once from values — the privacy plan and budget, the clipper, the run's secret, adaptive clipping's
tracker and [`StepSettings`] (what the step needs from its trainer: device, loss function, forward and no-sync
contexts) — and rebuilt the same way when a resumed run replans. The trainer's `training_step` only hands it the
model, the parameters the optimizer updates and this rank's share of the Poisson sample.

Aggregation all-reduces the clipped sums across ranks (each rank clipped its own units; under FSDP2 they were
reduce-scattered into the gradient shards pass by pass), adds the Gaussian noise once (the same on every rank for
the same element, from the shared secret) and leaves every gradient divided by the expected batch size q·N
(folded into the clip factors and the noise scale). Everything stays on the device: what the host needs about the
sample (units, packing) is known before the forward pass.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from .budget import PrivacyBudget
from .clipping import GhostClipper
from .clipping.accumulate import ClippedGrads
from .clipping.adaptive import QuantileTracker
from .compatibility import check_per_example
from .losses import PACKED_NEEDS_TOKEN_HEAD, LOSS_FUNC_PACKED, base_model, examples_lost, packed_example_ids
from .losses import packed_per_example_loss, per_example_loss
from .noise import add_noise
from .releases import ScalarReleases, StepSums
from .sharding import is_sharded
from .transfer import to_device

__all__ = ["DPStep", "StepSettings", "check_some_gradient"]


@dataclass(frozen=True)
class StepSettings:
    """What one DP step needs from its trainer, as values.

    Attributes:
        device: where the micro-batches go.
        causal_lm: shift labels for a causal LM's default loss.
        max_loss: each unit's logged loss is clipped to [0, max_loss] (private logging).
        secure_noise: draw the noise's bits from SHAKE-256.
        distributed: all-reduce the clipped sums (several processes).
        loss_func: the user's `compute_loss_func(outputs, labels, num_items_in_batch=None)` returning one loss per
            example, or `None` for the default per-example loss.
        forward_context: a context for each forward pass (Trainer's `compute_loss_context_manager`: autocast).
        backward_context: a context around the clipped backward passes, given the model (accelerate's `no_sync`:
            the clipped sums are all-reduced once, in aggregate).
    """

    device: torch.device
    causal_lm: bool
    max_loss: float
    secure_noise: bool = False
    distributed: bool = False
    loss_func: Callable | None = None
    forward_context: Callable = contextlib.nullcontext
    backward_context: Callable = field(default=lambda model: contextlib.nullcontext())


class DPStep:
    """One optimizer step of DP-SGD: clipped per-unit gradients, noised once, in the ledger, scalars released.

    Args:
        budget: the run's [`~hf_dp.budget.PrivacyBudget`] (its plan says q·N, σ, what is released).
        clipper: the [`~hf_dp.clipping.GhostClipper`] attached to the model.
        seed: the run's secret (keys the noise of every release).
        settings: [`StepSettings`].
        quantile_tracker: adaptive clipping's running C, or `None` for a fixed C (`max_grad_norm`).
        max_grad_norm: the fixed C (or adaptive clipping's C₀, already in the tracker).
    """

    def __init__(self, budget: PrivacyBudget, clipper: GhostClipper, seed: int, settings: StepSettings, *,
                 max_grad_norm: float, quantile_tracker: QuantileTracker | None = None):
        self.budget, self.clipper, self.seed, self.settings = budget, clipper, seed, settings
        self.max_grad_norm, self.quantile_tracker = max_grad_norm, quantile_tracker
        self.releases = ScalarReleases(budget.plan, settings.max_loss, seed, settings.secure_noise)

    @property
    def plan(self):
        return self.budget.plan

    def clipping_norm(self, device=None):
        """C_t, the norm this step clips at: the fixed `max_grad_norm`, or adaptive clipping's tracked C (from
        earlier releases only), as a 0-dim tensor on `device` when given (no host read), else a float."""
        if self.quantile_tracker is None:
            return self.max_grad_norm
        return self.quantile_tracker.norm_on(device) if device is not None else self.quantile_tracker.norm

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
                raise ValueError(PACKED_NEEDS_TOKEN_HEAD.format(model=type(base_model(model)).__name__))
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
        expected_batch_size, settings = self.plan.expected_batch_size, self.settings
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
                                              into=clipped)
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
        plan = self.plan
        add_noise(params, names=names, noise_multiplier=plan.noise_multiplier, max_grad_norm=max_grad_norm,
                  seed=self.seed, step=step, scale=1.0 / plan.expected_batch_size, secure=self.settings.secure_noise,
                  grads=grads)
        clipped.round_into_grads()

    def record(self) -> bool:
        """The step's entry in the ledger; `False` when one more step would exceed the target ε."""
        return self.budget.record_step()

    def release(self, sums: StepSums, step: int) -> torch.Tensor | None:
        """The step's noised scalars (adaptive clipping's C moves on the device); the noised loss sum, or `None`."""
        return self.releases.release(sums, step, self.quantile_tracker)

    # ---- the whole step ----

    def run(self, model, params: list, names: list, batch, *, before_record: Callable | None = None
            ) -> tuple[torch.Tensor, bool]:
        """The stages in order on this rank's share of one logical batch; returns (the noised mean loss, or 0
        without private logging, and whether training may go on). `before_record` runs between the noise and the
        ledger entry (a just-in-time save there keeps the state before this step)."""
        max_grad_norm = self.clipping_norm(self.settings.device if self.quantile_tracker is not None else None)
        clipped = ClippedGrads()  # the clipped sums, float32 until the noise is added
        sums = self.clip(model, batch.micro_batches, max_grad_norm, into=clipped)
        check_some_gradient(params, batch.micro_batches, clipped)
        self.aggregate(params, names, sums, max_grad_norm=max_grad_norm, step=batch.step, clipped=clipped)
        if before_record is not None:
            before_record()
        keep_going = self.record()
        loss_sum = self.release(sums, batch.step)
        if loss_sum is None:  # nothing computed from the data is logged
            return torch.zeros((), dtype=torch.float32, device=self.settings.device), keep_going
        return (loss_sum / self.plan.expected_batch_size).to(torch.float32), keep_going


def check_some_gradient(params: list, micro_batches, clipped: ClippedGrads | None = None) -> None:
    """A non-empty sample that produced no gradient means the optimizer's parameters are not the model's."""
    buffers = clipped.buffers if clipped is not None else {}
    if micro_batches and not any(param.grad is not None or param in buffers for param in params):
        raise RuntimeError(
            "A non-empty batch produced no gradient for any parameter the optimizer updates: the trainable "
            "parameters are not those in the forward pass (e.g. LoRA adapters replaced after the optimizer was "
            "built) or everything is frozen. Stopping instead of spending privacy budget on nothing."
        )
