"""Rules for normalisation layers: their exact per-example gradient norms.

The layers: `nn.LayerNorm`, `nn.RMSNorm` and transformers' RMSNorm
variants (`LlamaRMSNorm`, `Qwen2RMSNorm`, `MistralRMSNorm`, ...: any class whose name
ends in ``RMSNorm``, and T5's `T5LayerNorm`, an RMSNorm by another name: any class
named ``*LayerNorm`` that does not derive from `nn.LayerNorm`).

With normalised inputs ``x̂_t`` and output gradients ``g_t``, the affine parameters
act elementwise, ``y_t = w ⊙ x̂_t + b`` (or ``(1 + w) ⊙ x̂_t``, Gemma style), so one
example's gradients are ``∇w = Σ_t g_t ⊙ x̂_t`` and ``∇b = Σ_t g_t``: only as large as
the parameter, so they are materialised per example
([`~hf_dp.clipping.terms.ExampleGrad`]). ``x̂`` is recomputed from the captured input
in float32:

- LayerNorm: ``x̂ = (x - mean(x)) / sqrt(var(x) + eps)``;
- RMSNorm: ``x̂ = x / sqrt(mean(x²) + eps)``.

Classes matched by name are checked when the clipper attaches: the layer's output on a
probe input must equal ``w ⊙ x̂`` or ``(1 + w) ⊙ x̂`` with the RMS ``x̂``, otherwise the
layer is reported as unsupported rather than clipped with a wrong norm (a custom,
mean-subtracting ``*LayerNorm`` fails the probe and is refused).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..registry import register_rule
from ..terms import EXAMPLE, ExampleGrad, GradTerm, compute_dtype


def _affine_terms(layer: nn.Module, normalized: Tensor, output_grads: Tensor, dims: int) -> Dict[str, GradTerm]:
    """∇w = Σ_t g_t ⊙ x̂_t, ∇b = Σ_t g_t over all token positions (all but the last `dims`)."""
    batch_size = output_grads.shape[0]
    param_shape = output_grads.shape[output_grads.dim() - dims :]
    output_grads = output_grads.to(normalized.dtype).reshape((batch_size, -1) + param_shape)  # (B, N, *shape)
    normalized = normalized.reshape((batch_size, -1) + param_shape)  # (B, N, *shape)
    terms: Dict[str, GradTerm] = {}
    if getattr(layer, "weight", None) is not None:
        terms["weight"] = ExampleGrad((output_grads * normalized).sum(dim=1))
    if getattr(layer, "bias", None) is not None:
        terms["bias"] = ExampleGrad(output_grads.sum(dim=1))
    return terms


@register_rule(nn.LayerNorm, name="layer_norm", params={"weight": EXAMPLE, "bias": EXAMPLE})
def layer_norm_rule(layer: nn.LayerNorm, activations: Tensor, output_grads: Tensor) -> Dict[str, GradTerm]:
    """`nn.LayerNorm`: ∇w = Σ_t g_t ⊙ x̂_t, ∇b = Σ_t g_t."""
    inputs = activations.to(compute_dtype(activations.dtype))
    normalized = F.layer_norm(inputs, layer.normalized_shape, eps=layer.eps)
    return _affine_terms(layer, normalized, output_grads, len(layer.normalized_shape))


def _rms_eps(layer: nn.Module, dtype: torch.dtype) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        eps = getattr(layer, name, None)
        if isinstance(eps, (int, float)):
            return float(eps)
    return torch.finfo(dtype).eps  # nn.RMSNorm with eps=None


def _rms_dims(layer: nn.Module) -> int:
    normalized_shape = getattr(layer, "normalized_shape", None)
    return len(normalized_shape) if normalized_shape is not None else layer.weight.dim()


def _rms_normalize(layer: nn.Module, inputs: Tensor) -> Tensor:
    dims = tuple(range(-_rms_dims(layer), 0))
    eps = _rms_eps(layer, inputs.dtype)
    inputs = inputs.to(compute_dtype(inputs.dtype))
    return inputs * torch.rsqrt(inputs.pow(2).mean(dim=dims, keepdim=True) + eps)


def _check_rms_norm(layer: nn.Module) -> Optional[str]:
    """Probe the layer once: its output must be w ⊙ x̂ or (1 + w) ⊙ x̂."""
    if isinstance(layer, nn.RMSNorm):
        return None
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() < 1:
        return "RMSNorm-like layer without a weight tensor"
    try:
        generator = torch.Generator(device="cpu").manual_seed(0)
        probe = torch.randn((2, 3) + tuple(weight.shape), generator=generator, dtype=torch.float32)
        probe = probe.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            output = layer(probe).to(torch.float32)
            normalized = _rms_normalize(layer, probe).to(torch.float32)
            scale = weight.detach().to(torch.float32)
            low_precision = torch.finfo(weight.dtype).bits < 32
            tolerance = dict(rtol=2e-2, atol=2e-2) if low_precision else dict(rtol=1e-4, atol=1e-5)
            if torch.allclose(output, normalized * scale, **tolerance):
                return None
            if torch.allclose(output, normalized * (1 + scale), **tolerance):
                return None
    except Exception as error:  # noqa: BLE001 - any failure means we cannot vouch for it
        return f"could not probe the layer ({type(error).__name__}: {error})"
    return "its output is neither w * x / rms(x) nor (1 + w) * x / rms(x)"


def _is_rms_norm_class(cls: type) -> bool:
    name = cls.__name__
    return name.endswith("RMSNorm") or (name.endswith("LayerNorm") and not issubclass(cls, nn.LayerNorm))


@register_rule(
    nn.RMSNorm,
    name="rms_norm",
    params={"weight": EXAMPLE, "bias": EXAMPLE},
    validate=_check_rms_norm,
    class_name_predicate=_is_rms_norm_class,
)
def rms_norm_rule(layer: nn.Module, activations: Tensor, output_grads: Tensor) -> Dict[str, GradTerm]:
    """RMSNorm (`*RMSNorm`, T5-style `*LayerNorm`): ∇w = Σ_t g_t ⊙ x̂_t (also for the `(1 + w)` form).

    With one normalised dimension and no bias (the usual case) as Σ_t r_t·(g_t ⊙ x_t), r_t = 1/rms(x_t): one
    batched product over the tokens instead of forming x̂ (one op fewer per layer)."""
    dims = _rms_dims(layer)
    if dims != 1 or getattr(layer, "bias", None) is not None or getattr(layer, "weight", None) is None:
        return _affine_terms(layer, _rms_normalize(layer, activations), output_grads, dims)
    inputs = activations.to(compute_dtype(activations.dtype))
    batch_size, width = output_grads.shape[0], output_grads.shape[-1]
    inputs, output_grads = inputs.reshape(batch_size, -1, width), output_grads.to(inputs.dtype).reshape(
        batch_size, -1, width)  # (B, N, d)
    inverse_rms = torch.rsqrt(inputs.pow(2).mean(dim=-1, keepdim=True) + _rms_eps(layer, activations.dtype))
    weight_grads = torch.bmm(inverse_rms.transpose(1, 2), output_grads * inputs)  # (B, 1, d)
    return {"weight": ExampleGrad(weight_grads.reshape(batch_size, width))}
