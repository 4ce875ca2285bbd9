"""Which rows of a captured tensor belong to which example.

Per-example gradients are only per-example if every row the rules read is one example's. The
clipper reads a layer's input and output gradient in one of these layouts:

- batch first, `(B, ...)`;
- rows flattened over (batch, time), `(B·T, ...)` (OPT's feed-forward block): read batch-major,
  `(B, T, ...)`;
- packed rows, several examples per row: `(rows, T, ...)`, each token later regrouped by example
  ([`~hf_dp.clipping.packing.PackedRows`]), so the token axis must be there.

A tensor with no batch dimension (computed once and shared by every example, such as DeBERTa's
relative-position table) has no per-example gradient: it is refused, naming the layer, before any
gradient is written. Whether batch-major is the right reading is verified once per layer and layout
([`~hf_dp.clipping.attribution`]).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from torch import Tensor

from .capture import Capture
from .packing import PackedRows
from .registry import UnsupportedLayerError


def row_layout(capture: Capture, batch_size: int, packing: Optional[PackedRows] = None) -> str:
    """How `capture`'s rows are read: `"batch"`, `"flattened"` or `"shared"`, prefixed `"packed "` for packed
    rows; the attribution check is done once per layer and layout."""
    leading = capture.output_shape[0] if len(capture.output_shape) else 0
    if leading == batch_size:
        layout = "batch"
    else:
        layout = "flattened" if leading and leading % batch_size == 0 else "shared"
    return layout if packing is None else f"packed {layout}"


def check_rows(captures: Sequence[Capture], batch_size: int) -> None:
    """Before the backward pass: every captured tensor must have rows that belong to examples."""
    shared = []
    for capture in captures:
        leading = [capture.output_shape[0] if len(capture.output_shape) else None]
        if capture.activations is not None:
            leading.append(capture.activations.shape[0] if capture.activations.dim() else None)
        if _unattributable(leading, batch_size):
            shared.append((capture, leading))
    if shared:
        _raise_shared(shared, batch_size)


def batch_first(
    capture: Capture, grads: Tensor, batch_size: int, packing: Optional[PackedRows] = None
) -> Tuple[Optional[Tensor], Tensor]:
    """`capture`'s activations and its output gradients `grads` as `(B, ...)`; rows flattened over (batch,
    time) are read batch-major; for packed rows, `(B, T, ...)` with the rows' token axis."""
    grads = grads.reshape(capture.output_shape)
    if capture.grad_transform is not None:
        grads = capture.grad_transform(grads)
    activations = capture.activations
    leading = [grads.shape[0] if grads.dim() else None]
    if activations is not None:
        leading.append(activations.shape[0] if activations.dim() else None)
    if _unattributable(leading, batch_size):
        _raise_shared([(capture, leading)], batch_size)
    activations, grads = _unflatten(activations, batch_size), _unflatten(grads, batch_size)
    if packing is not None:
        tokens = packing.tokens
        if any(t is not None and (t.dim() < 2 or t.shape[1] != tokens) for t in (activations, grads)):
            layer = capture.layer
            raise UnsupportedLayerError(
                f"GhostClipper: layer {layer.path} ({type(layer.module).__name__}) has tensors without the "
                f"rows' token axis of length {tokens} (shapes {tuple(grads.shape)}), so they cannot be split "
                "into the packed examples of each row: freeze it, or do not pack the batch."
            )
    return activations, grads


def _unattributable(leading: List[Optional[int]], batch_size: int) -> bool:
    """Leading dimensions that are neither the batch nor (batch x something)."""
    return any(not size or size % batch_size for size in leading)


def _raise_shared(shared: List[Tuple[Capture, List[Optional[int]]]], batch_size: int) -> None:
    layers = sorted({
        f"{capture.layer.path} ({type(capture.layer.module).__name__}, leading dimensions {leading})"
        for capture, leading in shared
    })
    raise UnsupportedLayerError(
        f"GhostClipper: these layers saw tensors whose rows cannot be attributed to the {batch_size} examples of "
        f"the batch: {layers}. A tensor computed once and shared by every example (a relative-position table "
        "such as DeBERTa's) has no per-example gradient: freeze these layers (requires_grad_(False)), or leave "
        "them out of the LoRA target modules. Otherwise call the model with input_ids / inputs_embeds of shape "
        "(batch_size, ...)."
    )


def _unflatten(tensor: Optional[Tensor], batch_size: int) -> Optional[Tensor]:
    """`(B·k, ...)` -> `(B, k, ...)` batch-major; `(B, ...)` unchanged."""
    if tensor is None or tensor.shape[0] == batch_size:
        return tensor
    return tensor.reshape((batch_size, tensor.shape[0] // batch_size) + tuple(tensor.shape[1:]))
