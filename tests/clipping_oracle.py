"""The oracle shared by the clipping tests: per-example gradients by brute force, summed per
unit, clipped, and compared with [`~hf_dp.clipping.GhostClipper`].

Per-example gradients come from `torch.func` (`functional_call` + `vmap(grad)`); forwards
that `vmap` cannot trace (BERT's mask creation branches on values) take the same
`torch.func.grad` one example at a time, and forwards `torch.func` cannot transform at all
(BLOOM's custom `autograd.Function` GELU in train mode, bitsandbytes' 4-bit matmul, the
`requires_grad_()` hook of `enable_input_require_grads()`) take plain `torch.autograd.grad`
on a batch of one, one example at a time. All three are independent of the engine's hooks.

Every comparison is in float64, to a relative error of `REL_TOL`.

This is the only reference implementation of per-unit clipping in the tests: the files of
`tests/clipping/` (one per module of `hf_dp/clipping/`: `test_engine.py`, `test_attach.py`,
`test_capture.py`, `test_rows.py`, `test_attribution.py`, `test_clip.py`, `test_registry.py`,
`test_terms.py`, `test_linear.py`, `test_embedding.py`, `test_norm.py`, `test_position_bias.py`,
`test_packing.py`, plus the model tables `test_architectures.py` and `test_clipping_families.py`)
check the engine against it.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from tiny_models import per_example_loss, trainable_parameters
from torch import nn
from torch.func import functional_call, grad, vmap

from hf_dp.clipping import GhostClipper

REL_TOL = 1e-5
UNIT_IDS = torch.tensor([5, 2, 5, 9, 2, 2])  # 3 users, 1-3 examples each, not contiguous


def oracle_unit_grads(
    model: nn.Module,
    inputs: Dict[str, torch.Tensor],
    labels: torch.Tensor,
    loss_fn: Callable[[object, torch.Tensor], torch.Tensor],
    unit_ids: Optional[torch.Tensor],
) -> Dict[str, torch.Tensor]:
    """Per-unit gradients {name: (U, *shape)}: per-example gradients by vmap(grad), segment-summed."""
    params = {name: p.detach() for name, p in trainable_parameters(model).items()}
    # Frozen weights of a subclass (bitsandbytes' 4-bit `Params4bit`, whose quantisation state a plain
    # tensor would lose) stay in the model; they carry no gradient either way.
    frozen = {
        name: p.detach() for name, p in model.named_parameters() if not p.requires_grad and type(p) is nn.Parameter
    }
    buffers = dict(model.named_buffers())

    def example_loss(params, example_inputs, example_labels):
        batch_of_one = {key: value.unsqueeze(0) for key, value in example_inputs.items()}
        output = functional_call(model, (params, frozen, buffers), (), batch_of_one)
        return loss_fn(output, example_labels.unsqueeze(0))[0]

    def autograd_grad(params, example_inputs, example_labels):
        leaves = {name: p.clone().requires_grad_(True) for name, p in params.items()}
        gradients = torch.autograd.grad(example_loss(leaves, example_inputs, example_labels), list(leaves.values()))
        return dict(zip(leaves, gradients))

    def one_at_a_time(per_example_grad):
        rows = [
            per_example_grad(params, {k: v[i] for k, v in inputs.items()}, labels[i]) for i in range(len(labels))
        ]
        return {name: torch.stack([row[name] for row in rows]) for name in params}

    per_example_grad = grad(example_loss)
    try:
        try:
            grads = vmap(per_example_grad, in_dims=(None, 0, 0))(params, inputs, labels)
        except RuntimeError as error:
            if "vmap" not in str(error) or "setup_context" in str(error):
                raise
            grads = one_at_a_time(per_example_grad)  # a forward branching on values: same grad, one at a time
    except RuntimeError as error:  # a custom autograd.Function, or a hook calling requires_grad_(): plain autograd
        if "setup_context" not in str(error) and "functorch transform" not in str(error):
            raise
        grads = one_at_a_time(autograd_grad)
    batch_size = len(labels)
    ids = torch.arange(batch_size) if unit_ids is None else unit_ids
    _, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    num_units = int(inverse.max()) + 1
    return {
        name: g.new_zeros((num_units,) + g.shape[1:]).index_add_(0, inverse, g) for name, g in grads.items()
    }


def hf_loss(head: str) -> Callable[[object, torch.Tensor], torch.Tensor]:
    """Per-example losses `(B,)` from a transformers output's logits (`tiny_models.per_example_loss`)."""
    return lambda output, labels: per_example_loss(output.logits, labels, head)


def squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-example losses `(B,)` of the small hand-built models: squared error summed over all but the
    batch axis (`(T, d)` for token outputs)."""
    return ((output - target) ** 2).sum(dim=tuple(range(1, output.dim())))


def clip_by_oracle(unit_grads: Dict[str, torch.Tensor], max_grad_norm: float) -> Tuple[torch.Tensor, Dict]:
    norms = torch.sqrt(sum(g.pow(2).flatten(1).sum(1) for g in unit_grads.values()))
    weights = (max_grad_norm / norms).clamp(max=1.0)
    return norms, {name: torch.tensordot(weights, g, dims=1) for name, g in unit_grads.items()}


def oracle_clip(model, inputs, labels, loss_fn, unit_ids, max_grad_norm: float) -> Tuple[torch.Tensor, Dict]:
    """The oracle's pre-clip per-unit norms `(U,)` and clipped sums {name: tensor} at `max_grad_norm`."""
    return clip_by_oracle(oracle_unit_grads(model, inputs, labels, loss_fn, unit_ids), max_grad_norm)


def oracle_clip_micro_batches(model, micro_batches, loss_fn, max_grad_norm: float) -> Dict[str, torch.Tensor]:
    """The clipped sums accumulated over micro-batches `[(inputs, labels, unit_ids), ...]`, each
    micro-batch's units clipped on their own (what repeated `GhostClipper.backward` calls add to `.grad`)."""
    expected: Dict[str, torch.Tensor] = {}
    for inputs, labels, unit_ids in micro_batches:
        for name, clipped in oracle_clip(model, inputs, labels, loss_fn, unit_ids, max_grad_norm)[1].items():
            expected[name] = expected.get(name, 0) + clipped
    return expected


def clip_by_engine(model, inputs, labels, loss_fn, unit_ids, max_grad_norm, strategy="auto", clipper=None):
    own = clipper is None
    clipper = clipper or GhostClipper(model, strategy=strategy)
    try:
        losses = loss_fn(model(**inputs), labels)
        norms = clipper.backward(losses, unit_ids=unit_ids, max_grad_norm=max_grad_norm)
    finally:
        if own:
            clipper.detach()
    return norms, {name: p.grad.detach().clone() for name, p in trainable_parameters(model).items()}


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = REL_TOL):
    actual, expected = actual.double(), expected.double()
    error = (actual - expected).norm()
    scale = expected.norm()
    assert error <= tol * scale + 1e-12, f"{what}: relative error {float(error / scale.clamp_min(1e-300)):.2e}"


def check_against_oracle(model, inputs, labels, loss_fn, unit_ids, strategy="auto", clip_fraction=0.5):
    unit_grads = oracle_unit_grads(model, inputs, labels, loss_fn, unit_ids)
    norms_oracle, _ = clip_by_oracle(unit_grads, 1.0)
    # A clip norm that clips some units and leaves others untouched.
    max_grad_norm = float(torch.quantile(norms_oracle, clip_fraction))
    _, clipped_oracle = clip_by_oracle(unit_grads, max_grad_norm)
    norms, clipped = clip_by_engine(model, inputs, labels, loss_fn, unit_ids, max_grad_norm, strategy)
    assert norms.dtype == torch.float32
    assert norms.shape == norms_oracle.shape
    assert_rel_close(norms, norms_oracle, "norms", tol=max(REL_TOL, 1e-6))  # float32 output
    # Each norm individually, too (a wrong small norm could hide behind a large one).
    assert torch.allclose(norms.double(), norms_oracle.double(), rtol=REL_TOL, atol=0)
    assert set(clipped) == set(clipped_oracle)
    for name in clipped_oracle:
        assert_rel_close(clipped[name], clipped_oracle[name], f"clipped sum of {name}")
    return norms_oracle, max_grad_norm


