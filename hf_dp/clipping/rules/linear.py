"""Rules for linear maps: per-example weight gradients kept factored, their norms by the ghost trick.

The maps: `nn.Linear` (classifier heads, peft LoRA `lora_A`/`lora_B`,
`modules_to_save` copies) and transformers' `Conv1D` (GPT-2).

For one example with inputs ``a_t ∈ R^d`` and output gradients ``g_t ∈ R^p`` over its
tokens t:

- `nn.Linear`, ``y_t = W a_t + b`` with W `(p, d)`: ``∇W = Σ_t g_t a_tᵀ``, ``∇b = Σ_t g_t``;
- `Conv1D`, ``y_t = a_t W + b`` with W `(d, p)`: ``∇W = Σ_t a_t g_tᵀ``, ``∇b = Σ_t g_t``.

The weight gradient is returned factored ([`~hf_dp.clipping.terms.OuterGrad`]); per
unit its squared norm is ``Σ_{t,s} (a_t·a_s)(g_t·g_s)`` (ghost) or that of the
materialised matrix, whichever is cheaper for the batch.
"""
from __future__ import annotations

from typing import Dict

import torch.nn.functional as F
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ..registry import register_rule
from ..terms import EXAMPLE, OUTER, ExampleGrad, GradTerm, OuterGrad, compute_dtype


def _tokens(tensor: Tensor, batch_size: int) -> Tensor:
    """`(B, ..., k)` -> `(B, N, k)`: every position before the last dim is a token."""
    return tensor.reshape(batch_size, -1, tensor.shape[-1])


def _dense_terms(layer, activations: Tensor, output_grads: Tensor, *, outputs_first: bool) -> Dict[str, GradTerm]:
    """Weight as a sum of outer products over tokens, bias as the summed output gradient."""
    batch_size = output_grads.shape[0]
    activations = _tokens(activations, batch_size)  # (B, N, d_in)
    output_grads = _tokens(output_grads, batch_size)  # (B, N, d_out)
    left, right = (output_grads, activations) if outputs_first else (activations, output_grads)
    terms: Dict[str, GradTerm] = {"weight": OuterGrad(left=left, right=right)}
    if layer.bias is not None:
        terms["bias"] = ExampleGrad(output_grads.sum(dim=1, dtype=compute_dtype(output_grads.dtype)))  # (B, d_out)
    return terms


@register_rule(nn.Linear, name="linear", params={"weight": OUTER, "bias": EXAMPLE}, function=F.linear)
def linear_rule(layer: nn.Linear, activations: Tensor, output_grads: Tensor) -> Dict[str, GradTerm]:
    """`nn.Linear`: ∇W = Σ_t g_t a_tᵀ (rows: outputs), ∇b = Σ_t g_t."""
    return _dense_terms(layer, activations, output_grads, outputs_first=True)


@register_rule(Conv1D, name="conv1d", params={"weight": OUTER, "bias": EXAMPLE})
def conv1d_rule(layer: Conv1D, activations: Tensor, output_grads: Tensor) -> Dict[str, GradTerm]:
    """transformers `Conv1D` (weight `(d_in, d_out)`): ∇W = Σ_t a_t g_tᵀ, ∇b = Σ_t g_t."""
    return _dense_terms(layer, activations, output_grads, outputs_first=False)
