"""One DP step, in three stages: per-example losses of a micro-batch, per-unit clipping, and aggregation.

Aggregation all-reduces the clipped sums across ranks (each rank clipped its own units; under FSDP2 they were
reduce-scattered into the gradient shards pass by pass), adds the Gaussian noise once (the same on every rank for
the same element, from the shared seed) and leaves every gradient divided by the expected batch size
q·N (folded into the clip factors and the noise scale). Everything stays on the device: what the host needs about
the sample (units, packing) is known before the forward pass.
"""

from __future__ import annotations

import torch

from .losses import PACKED_NEEDS_TOKEN_HEAD, LOSS_FUNC_PACKED, base_model, examples_lost, packed_example_ids
from .losses import packed_per_example_loss, per_example_loss
from .compatibility import check_per_example
from .noise import add_noise
from .releases import StepSums
from .sharding import is_sharded
from .transfer import to_device


def micro_batch_losses(trainer, model, micro_batch, *, causal_lm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One micro-batch's forward pass: `(B,)` losses, and for packed rows the host-side example of each token."""
    features = dict(micro_batch.features)
    # Packed rows (DataCollatorWithFlattening): several examples per row, positions restarting at each.
    example_ids = packed_example_ids(features)  # on the host, before the copy: no device read
    if example_ids is not None:
        features["use_cache"] = False  # a cache turns off transformers' per-example attention masking
    features = to_device(features, trainer.args.device)
    labels = features.pop("labels", None)
    if labels is None:
        raise ValueError("DP training batches need 'labels' (per-example losses are computed from them).")
    with trainer.compute_loss_context_manager():
        outputs = model(**features)
    if trainer.compute_loss_func is not None:  # the user's loss: one per example (checked)
        if example_ids is not None:
            raise ValueError(LOSS_FUNC_PACKED)
        losses = trainer.compute_loss_func(outputs, labels, num_items_in_batch=None)
        check_per_example(losses, labels.shape[0])
        losses = losses.float()
    elif example_ids is None:
        losses = per_example_loss(outputs.logits, labels, causal_lm=causal_lm)
    else:
        logits = outputs.logits
        if logits.dim() != 3:
            raise ValueError(PACKED_NEEDS_TOKEN_HEAD.format(model=type(base_model(model)).__name__))
        num_examples = int(example_ids.numpy().max()) + 1  # a host tensor
        if micro_batch.num_examples is not None and num_examples != micro_batch.num_examples:
            raise ValueError(examples_lost(num_examples, micro_batch.num_examples))
        losses = packed_per_example_loss(logits, labels, to_device(example_ids, logits.device), num_examples,
                                         causal_lm=causal_lm)
    if micro_batch.num_examples is not None and losses.shape[0] != micro_batch.num_examples:
        raise ValueError(examples_lost(losses.shape[0], micro_batch.num_examples))
    return losses, example_ids


def clip_units(trainer, model, micro_batches, *, max_grad_norm, expected_batch_size: float,
               causal_lm: bool) -> StepSums:
    """Forward and clipped backward of every micro-batch: each unit's gradient clipped to `max_grad_norm` and
    summed into `.grad`, divided by `expected_batch_size`; returns the step's summed scalar statistics."""
    sums = StepSums(trainer.args.device)
    for micro_batch in micro_batches:
        losses, example_ids = micro_batch_losses(trainer, model, micro_batch, causal_lm=causal_lm)
        units = micro_batch.units
        if micro_batch.loss_weights is not None:  # ULS: a user's gradient is that of their mean loss
            losses = losses * to_device(micro_batch.loss_weights, losses.device)
        norms = trainer.clipper.backward(losses, unit_ids=units, max_grad_norm=max_grad_norm,
                                         example_ids=example_ids, grad_scale=1.0 / expected_batch_size)
        unit_losses = losses.detach().float()
        if units is not None:  # ULS: the user's mean loss, in the order of `norms` (the unit index owns it)
            unit_losses = units.sum_examples(unit_losses)
        if not micro_batch.padding:  # a padding pass (FSDP2) contributes zero and releases nothing
            sums.add(unit_losses, norms, max_grad_norm, trainer.args.max_loss)
    return sums


def aggregate(params: list, names: list, sums: StepSums, *, noise_multiplier: float, max_grad_norm, seed: int,
              step: int, expected_batch_size: float, distributed: bool, secure_noise: bool = False) -> None:
    """All-reduce the clipped sums (sharded gradients were reduce-scattered already, pass by pass), then add
    N(0, (σ·C/(q·N))²) once to every gradient element, keyed by the parameters' `names`."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    if distributed:
        for param in params:
            if not is_sharded(param.grad):
                torch.distributed.all_reduce(param.grad)
        sums.all_reduce()
    add_noise(params, names=names, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, seed=seed,
              step=step, scale=1.0 / expected_batch_size, secure=secure_noise)


def check_some_gradient(params: list, micro_batches) -> None:
    """A non-empty sample that produced no gradient means the optimizer's parameters are not the model's."""
    if micro_batches and not any(param.grad is not None for param in params):
        raise RuntimeError(
            "A non-empty batch produced no gradient for any parameter the optimizer updates: the trainable "
            "parameters are not those in the forward pass (e.g. LoRA adapters replaced after the optimizer was "
            "built) or everything is frozen. Stopping instead of spending privacy budget on nothing."
        )
