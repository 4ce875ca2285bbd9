"""Where a logical batch's clipped sums accumulate until the noise: in float32 (float64) whatever the parameters' dtype.

The accountant assumes that adding or removing one unit moves the clipped sum by at most C. Rounding *after* the
noise is post-processing; rounding *before* it is not: summing clipped gradients in bf16 (an 8-bit mantissa) rounds
every partial sum to about 2⁻⁸ of its size, so with a few hundred units pulling the same way the rounding alone moves
the sum by more than one unit's C. [`ClippedGrads`] therefore keeps the sums of parameters stored in a narrower dtype
(bf16, fp16) in float32 buffers across micro-batches and ranks; the noise is added to those buffers, and only then is
each rounded, once, into the parameter's `.grad`. Parameters in float32 or float64 accumulate in `.grad` itself, at
no extra memory. The cost is 4 bytes per narrow trainable parameter during the step (freed when it is rounded).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..sharding import is_sharded

__all__ = ["ClippedGrads"]


class ClippedGrads:
    """The clipped sums of one logical batch, per parameter, until the noise is added.

    [`add`] takes a parameter's clipped sum in the compute dtype (float32, or float64 for float64 models): the whole
    parameter's, or this rank's rows of it for an FSDP2-sharded parameter. [`grads`] gives each parameter's sum so far
    (what the all-reduce and the noise act on, in place); [`round_into_grads`] then rounds the narrow ones once into
    `.grad`.
    """

    def __init__(self):
        self.buffers: Dict[nn.Parameter, Tensor] = {}  # float32 sums of parameters narrower than float32

    @staticmethod
    def accumulates_in_grad(param: nn.Parameter) -> bool:
        """float32 and float64 parameters sum in their own `.grad`; narrower ones in a float32 buffer."""
        return param.dtype in (torch.float32, torch.float64)

    def add(self, param: nn.Parameter, clipped_sum: Tensor) -> None:
        """Add a parameter's clipped sum (a plain tensor: for a sharded parameter, this rank's rows)."""
        if self.accumulates_in_grad(param):
            if param.grad is None:
                param.grad = _like(param, clipped_sum.to(param.dtype))
            else:
                _local(param.grad).add_(clipped_sum)
            return
        buffer = self.buffers.get(param)
        if buffer is None:
            buffer = _like(param, clipped_sum.to(torch.float32).contiguous())
            if param.grad is not None:  # what `.grad` already held joins the sum, in float32
                _local(buffer).add_(_local(param.grad))
            self.buffers[param] = buffer
        else:
            _local(buffer).add_(clipped_sum)

    def ensure(self, params: Sequence[nn.Parameter]) -> None:
        """Zeros as `.grad` where a parameter has neither a sum nor a `.grad` (no unit reached it), so that the noise
        reaches every trainable parameter."""
        for param in params:
            if param.grad is None and param not in self.buffers:
                param.grad = torch.zeros_like(param)

    def grads(self, params: Sequence[nn.Parameter]) -> List[Tensor]:
        """Each parameter's sum so far, in its accumulation dtype: its float32 buffer, else its `.grad` (created as
        zeros where missing). The caller all-reduces and noises these tensors in place."""
        self.ensure(params)
        for param in params:
            if param not in self.buffers and not param.grad.is_contiguous():
                param.grad = param.grad.contiguous()
        return [self.buffers.get(param, param.grad) for param in params]

    def round_into_grads(self) -> None:
        """Round every float32 buffer once into its parameter's dtype, as its `.grad`, and free the buffers."""
        for param, buffer in self.buffers.items():
            param.grad = _like(param, _local(buffer).to(param.dtype))
        self.buffers.clear()


def _local(tensor: Tensor) -> Tensor:
    """The elements this rank holds: a sharded (DTensor) gradient's local rows, else the tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def _like(param: nn.Parameter, local: Tensor) -> Tensor:
    """`local` as a gradient of `param`: a DTensor sharded as `param` is when it is sharded (FSDP2)."""
    if not is_sharded(param):
        return local
    return DTensor.from_local(local.contiguous(), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
