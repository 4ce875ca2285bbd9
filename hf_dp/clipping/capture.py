"""Forward capture: what each hooked layer saw in the forward pass, kept for the clipping backward.

A per-example gradient is built from a layer's input and the gradient at its output, so the forward
hooks keep, per call of a hooked layer, its first input (detached) and a handle on the autograd node
that produced its output ([`Capture`]). The backward pass then stops at those nodes: it yields every
hooked layer's output gradient and computes no parameter gradient at all.

Forward passes under `torch.no_grad()`, or with the capture disabled, record nothing.

Three layouts need the hooks to change what the model computes, without changing its values:

- ids broadcast over the batch (`(1, T)` position ids): the layer's output is expanded to `(B, T, d)` so
  that its gradient keeps one row per example;
- T5's relative attention bias, one lookup shared by every example: computed here and passed to the
  attention already expanded to the batch (see [`~hf_dp.clipping.position_bias`]);
- a layer whose class has its own `forward` (Gemma's scaled token embedding): captured at its rule's torch
  function call inside that forward.

Gradient checkpointing (transformers' `gradient_checkpointing_enable()`, non-reentrant, the default):
layers inside a checkpointed block keep only the handle on their output in the forward pass; their
inputs are taken from the block's recomputation during the backward pass (which captures nothing else),
so they are not held from the forward.
"""
from __future__ import annotations

import contextlib
import functools
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from . import position_bias
from .attach import HookedLayer

_BATCH_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "labels", "pixel_values", "input_values")


@dataclass
class Capture:
    """One forward call of a hooked layer."""

    layer: HookedLayer
    activations: Optional[Tensor]  # the layer's first input, detached
    output_edge: object  # autograd GradientEdge of the output's node
    output_shape: torch.Size
    pending: bool = False  # activations still to come from the checkpoint recomputation
    fingerprint: Optional[Tensor] = None  # of a pending call's input, to tell calls of a shared layer apart
    grad_transform: Optional[Callable[[Tensor], Tensor]] = None  # edge gradient -> the layer output's layout


class ForwardCapture:
    """The hooks that record the hooked layers' forward calls, and what they recorded since the last backward.

    Args:
        model (`torch.nn.Module`): the model (possibly wrapped) the layers belong to.
        layers (`dict`): the hooked layers by module ([`~hf_dp.clipping.attach.AttachedLayers.by_module`]).

    `captures` holds the calls of the current forward pass, in call order; `enabled = False` records nothing.
    """

    def __init__(self, model: nn.Module, layers: Dict[nn.Module, HookedLayer]):
        self.layers = layers
        self.enabled = True
        self.captures: List[Capture] = []
        self._pending: Dict[nn.Module, Deque[Capture]] = {}  # per layer, in call order
        self._function_modes: Dict[nn.Module, List[Optional[TorchFunctionMode]]] = {}
        self._batched_bias: Dict[nn.Module, bool] = {}  # T5-style attention -> bias supplied expanded
        self._batch_size: Optional[int] = None
        self._in_backward = False
        self._handles = []
        for layer in layers.values():
            module = layer.module
            if layer.functional:
                enter = functools.partial(self._enter_function_capture, layer)
                leave = functools.partial(self._exit_function_capture, layer)
                self._handles.append(module.register_forward_pre_hook(enter))
                self._handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True))
            else:
                self._handles.append(module.register_forward_hook(self._layer_hook(layer), with_kwargs=True))
            if layer.checkpoint_blocks:
                self._handles.append(module.register_forward_pre_hook(self._on_recompute, with_kwargs=True))
        for module in model.modules():
            if position_bias.is_relative_bias_attention(module) and module.relative_attention_bias in layers:
                self._handles.append(module.register_forward_pre_hook(self._supply_batched_bias, with_kwargs=True))
        for root in _roots(model):
            self._handles.append(root.register_forward_pre_hook(self._on_model_forward, with_kwargs=True))

    def remove(self) -> None:
        """Remove every hook and captured tensor. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.forget()

    def forget(self) -> None:
        """Drop what was captured (and the calls still waiting for their recomputed inputs)."""
        self.captures = []
        self._pending = {}

    def take(self) -> List[Capture]:
        """The captured calls, handed over: the next forward pass starts a new list."""
        captures, self.captures = self.captures, []
        return captures

    @contextlib.contextmanager
    def backward_pass(self) -> Iterator[None]:
        """Within the clipping backward: forward calls are checkpoint recomputations, which only supply the
        inputs of pending calls; afterwards everything captured is forgotten."""
        self._in_backward = True
        try:
            yield
        finally:
            self._in_backward = False
            self.forget()

    def record(self, layer: HookedLayer, inputs: Optional[Tensor], output, at_module: bool = True) -> Optional[Tensor]:
        """Record one call of `layer` (its module's input and output, or `at_module=False` a function
        call inside its forward); returns the output to use instead, or `None`."""
        if not (self.enabled and torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad):
            return None
        activations = inputs.detach() if (layer.rule.capture_input and isinstance(inputs, Tensor)) else None
        replaced = None
        batch_size = self._batch_size
        if (
            activations is not None
            and not torch.is_floating_point(activations)
            and activations.dim() >= 1
            and activations.shape[0] == 1
            and batch_size is not None
            and batch_size > 1
            and output.shape[0] == 1
        ):
            # Ids broadcast over the batch (position ids as (1, T)): expand the output so
            # that its gradient keeps one row per example. Also in a checkpoint's
            # recomputation, which must rebuild the same shapes.
            replaced = output.expand((batch_size,) + output.shape[1:])
            activations = activations.expand((batch_size,) + activations.shape[1:])
            output = replaced
        if self._in_backward:  # a checkpoint recomputation: inputs come through `_on_recompute`
            return replaced
        # Inside a block transformers checkpoints: the input is taken again from the recomputation.
        pending = (
            activations is not None
            and torch.is_floating_point(activations)
            and at_module
            and _checkpointed(layer)
        )
        capture = Capture(
            layer=layer,
            activations=None if pending else activations,
            output_edge=_output_edge(output),
            output_shape=output.shape,
            pending=pending,
            fingerprint=_fingerprint(activations) if pending else None,
        )
        self.captures.append(capture)
        if pending:
            self._pending.setdefault(layer.module, deque()).append(capture)
        return replaced

    # -- hooks -------------------------------------------------------------------------

    def _on_model_forward(self, module, args, kwargs):
        if not (self.enabled and not self._in_backward and torch.is_grad_enabled()):
            return None
        self.forget()  # a new forward pass: captures of an abandoned one go
        self._batch_size = _batch_size(args, kwargs)
        return None

    def _layer_hook(self, layer: HookedLayer):
        def hook(module, args, kwargs, output):
            return self.record(layer, _first_input(args, kwargs), output, at_module=True)

        return hook

    def _on_recompute(self, module, args, kwargs):
        """A checkpointed block recomputed in the backward pass: the layer's input for its pending call.

        A layer called once per forward pass has one pending call. A layer called in several
        checkpointed blocks (a block shared across depths) is recomputed block by block in
        backward order: each recomputed input goes to the call whose input fingerprint it matches.
        """
        queue = self._pending.get(module) if self._in_backward else None
        if not queue:
            return None
        inputs = _first_input(args, kwargs).detach()
        if len(queue) == 1:
            capture = queue.popleft()
        else:
            fingerprint = _fingerprint(inputs)
            distances = torch.stack([(c.fingerprint - fingerprint).abs().sum() for c in queue])
            best = int(distances.argmin())
            scale = float(queue[best].fingerprint.abs().sum())
            if float(distances[best]) > 1e-3 * scale + 1e-12:
                return None  # no call matches: left pending, reported after the backward pass
            capture = queue[best]
            del queue[best]
        capture.activations = inputs
        capture.pending = False
        capture.fingerprint = None
        return None

    def _enter_function_capture(self, layer: HookedLayer, module, args):
        mode = _FunctionCapture(self, layer) if self.enabled and torch.is_grad_enabled() else None
        if mode is not None:
            mode.__enter__()
        self._function_modes.setdefault(module, []).append(mode)
        return None

    def _exit_function_capture(self, layer: HookedLayer, module, args, kwargs, output):
        modes = self._function_modes.get(module)
        mode = modes.pop() if modes else None
        if mode is None:
            return None
        mode.__exit__(None, None, None)
        if mode.calls:
            return None
        # Its forward did not call the function with its weight (e.g. `x @ W.T + b`): capture
        # its input and output as for the base type; the coverage check vouches for that.
        return self.record(layer, _first_input(args, kwargs), output, at_module=True)

    def _supply_batched_bias(self, module, args, kwargs):
        """T5-style attention: compute the shared relative bias here and pass it on expanded to the batch."""
        if not self.enabled or not torch.is_grad_enabled():
            return None
        queries = position_bias.self_attention_queries(args, kwargs)
        if queries is None:
            return None
        batch_size, length = queries.shape[0], queries.shape[1]
        if self._in_backward:  # checkpoint recomputation: rebuild what the forward pass built
            if not self._batched_bias.get(module):
                return None
            bias = module.compute_bias(length, length, device=queries.device)
            return args, dict(kwargs, position_bias=position_bias.expand_to_batch(bias, batch_size))
        table = self.layers[module.relative_attention_bias]
        first = len(self.captures)
        bias = module.compute_bias(length, length, device=queries.device)  # (1, heads, T, T), captured below
        lookups = [capture for capture in self.captures[first:] if capture.layer is table]
        self._batched_bias[module] = (
            len(lookups) == 1
            and lookups[0].activations is not None
            and position_bias.matches_lookup(bias, table.module.weight, lookups[0].activations)
        )
        if not self._batched_bias[module]:  # left shared: refused on backward, naming the table
            return args, dict(kwargs, position_bias=bias)
        batched = position_bias.expand_to_batch(bias, batch_size)
        lookup = lookups[0]
        lookup.activations = lookup.activations.expand((batch_size,) + lookup.activations.shape)  # (B, T, T)
        lookup.output_edge, lookup.output_shape = _output_edge(batched), batched.shape
        lookup.grad_transform = position_bias.bias_to_lookup_layout
        return args, dict(kwargs, position_bias=batched)


def check_recomputed(captures: Sequence[Capture], output_grads: Sequence[Optional[Tensor]]) -> None:
    """After the backward pass: every call that reached the loss has its input."""
    missing = sorted({c.layer.path for c, g in zip(captures, output_grads) if c.pending and g is not None})
    if missing:
        raise RuntimeError(
            f"GhostClipper: layers inside a gradient-checkpointed block were not recomputed in the backward "
            f"pass, so their inputs are unknown: {missing}. Disable gradient checkpointing for this model."
        )


class _FunctionCapture(TorchFunctionMode):
    """Within one call of a layer whose class has its own `forward`: capture its rule's function call.

    Active only between the layer's forward pre-hook and forward hook; every other torch
    function passes through unchanged.
    """

    def __init__(self, recorder: ForwardCapture, layer: HookedLayer):
        super().__init__()
        self.recorder, self.layer = recorder, layer
        self.calls = 0  # calls of the function with the layer's weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if func is not self.layer.rule.function:
            return output
        module = self.layer.module
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if weight is not module.weight or (func is torch.nn.functional.linear and bias is not module.bias):
            return output  # another use: the coverage check on the first backward sees it
        self.calls += 1
        replaced = self.recorder.record(self.layer, args[0] if args else kwargs.get("input"), output, at_module=False)
        return output if replaced is None else replaced


def _checkpointed(layer: HookedLayer) -> bool:
    """Whether transformers will recompute this call of `layer` in the backward pass."""
    return torch.is_grad_enabled() and any(
        block.gradient_checkpointing is True and block.training for block in layer.checkpoint_blocks
    )


def _fingerprint(inputs: Tensor) -> Tensor:
    """Two numbers that tell one call's input from another's: its sum and its norm (float64)."""
    inputs = inputs.detach()
    return torch.stack([inputs.sum(dtype=torch.float64), torch.linalg.vector_norm(inputs, dtype=torch.float64)])


def _first_input(args, kwargs) -> Optional[Tensor]:
    return args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)


def _roots(model: nn.Module) -> List[nn.Module]:
    """The model and, for wrappers such as DistributedDataParallel, the wrapped module."""
    roots = [model]
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module):
        roots.append(inner)
    return roots


def _batch_size(args, kwargs) -> Optional[int]:
    for key in _BATCH_KEYS:
        value = kwargs.get(key)
        if isinstance(value, Tensor) and value.dim() > 0:
            return value.shape[0]
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


def _output_edge(output: Tensor):
    """The gradient edge of the layer output's producing node.

    When the output is a same-sized view (a 3-D `nn.Linear` output views its 2-D matmul
    result) the edge of the base is used: a later in-place op on the view rewrites the
    view's history, but the base's producing node still receives the gradient with
    respect to the layer's original output.
    """
    base = output._base  # torch's view base (None for a tensor that is not a view)
    if (
        base is not None
        and base.grad_fn is not None
        and base.numel() == output.numel()
        and base.is_contiguous()
        and output.is_contiguous()
    ):
        return get_gradient_edge(base)
    return get_gradient_edge(output)
