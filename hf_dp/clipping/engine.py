"""`GhostClipper`: per-unit gradient norms and clipped gradient sums in one backward pass.

The clipper hooks every module that owns trainable parameters. In a forward pass with
gradients enabled each hook keeps the layer's input and a handle on the autograd node
that produced its output. [`GhostClipper.backward`] then runs **one** backward pass that
stops at those nodes: it yields every hooked layer's output gradients and computes no
parameter gradient at all. The rules of [`~hf_dp.clipping.registry`] turn inputs and
output gradients into factored per-example gradients; [`~hf_dp.clipping.terms`] groups
them into units, computes each unit's squared norm (ghost or materialised, whichever is
cheaper per layer and batch), and forms Σ_u min(1, C/‖g_u‖)·g_u by book-keeping
(Bu et al. 2023), which is added to `p.grad`.

Which rows belong to which example:

- tensors with the batch first, `(B, ...)`;
- rows flattened over (batch, time), `(B·T, ...)` (OPT's feed-forward block): read
  batch-major, `(B, T, ...)`;
- ids broadcast over the batch, `(1, T)` position ids: the layer's output is expanded
  to `(B, T, d)` (same values) so that its gradient keeps one row per example;
- T5's relative attention bias, one lookup shared by all examples: supplied to the
  attention already expanded to the batch (see [`~hf_dp.clipping.position_bias`]);
- packed rows, several examples per row (`backward(..., example_ids=...)`): each layer's
  tokens are regrouped by example (see [`~hf_dp.clipping.packing`]).

The first time a layer is seen with a given layout (and a batch of two or more) the
attribution is verified: a backward of Σ_b c_b·L_b, with weights c_b drawn from the powers
of two 1/8 ... 8 (exact in floating point), must scale each example's rows of the output
gradient by its own c_b (compared through each row's sum, norm, largest and smallest entry).
A tensor with no batch dimension (shared by all examples) fails this or has no rows to read,
and is refused before any gradient is written, naming the layer. That check keeps the graph
for extra backward passes, so it raises the peak memory of that one backward (1.02-1.13x on
small GPT-2 and Llama models, full fine-tuning, `benchmarks/step_memory.py`): run the first
backward on a few rows (DPTrainer does, on its probe rows at construction) and every later
step costs what a plain step costs.

In the steady state (every layout verified) a backward reads nothing back from the device:
the units and packed rows are built on the host ([`~hf_dp.clipping.terms.UnitIndex`],
[`~hf_dp.clipping.packing.PackedRows`]), every layer's norms are combined once, and C may
be a device tensor.

Gradient checkpointing (transformers' `gradient_checkpointing_enable()`, non-reentrant,
the default): layers inside a checkpointed block keep only the handle on their output
in the forward pass; their inputs are taken from the block's recomputation during the
backward pass (which captures nothing else), so they are not held from the forward.
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

# Importing the rule modules registers their rules.
from . import embedding as _embedding  # noqa: F401
from . import linear as _linear  # noqa: F401
from . import norm as _norm  # noqa: F401
from . import position_bias
from .packing import PackedRows
from .registry import Rule, UnsupportedLayerError, find_rule, overrides_forward
from .terms import STRATEGIES, UnitIndex, norm_sq_and_reducer

try:  # transformers' blocks that `gradient_checkpointing_enable()` checkpoints
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover - older transformers
    GradientCheckpointingLayer = None

_BATCH_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "labels", "pixel_values", "input_values")


@dataclass
class _Layer:
    """A hooked module: where it is, its rule, and its trainable direct parameters."""

    path: str
    module: nn.Module
    rule: Rule
    params: Dict[str, nn.Parameter]  # trainable direct parameters, by name
    functional: bool = False  # captured at its rule's torch function call (a subclass with its own forward)
    checkpoint_blocks: Tuple[nn.Module, ...] = ()  # enclosing blocks transformers may checkpoint


@dataclass
class _Capture:
    """One forward call of a hooked layer."""

    layer: _Layer
    activations: Optional[Tensor]  # the layer's first input, detached
    output_edge: object  # autograd GradientEdge of the output's node
    output_shape: torch.Size
    pending: bool = False  # activations still to come from the checkpoint recomputation
    fingerprint: Optional[Tensor] = None  # of a pending call's input, to tell calls of a shared layer apart
    grad_transform: Optional[Callable[[Tensor], Tensor]] = None  # edge gradient -> the layer output's layout


class GhostClipper:
    """Clips per-unit gradients of a model without materialising them where that is costly.

    Attaching hooks every module with trainable parameters and checks, before any step,
    that each one has a clipping rule (`nn.Linear` incl. peft LoRA and classifier heads,
    transformers `Conv1D`, `nn.Embedding`, `nn.LayerNorm`, RMSNorm variants). A parameter
    shared by several layers (GPT-2's tied input and output embeddings) gets its exact
    norm, cross terms included.

    Each step: run the forward pass after attaching, with gradients enabled, compute one
    loss per example, then call [`~GhostClipper.backward`] instead of `loss.backward()`.
    Forward passes under `torch.no_grad()` capture nothing. This is the sensitivity-bounding
    stage of DP-SGD: the clip norm `max_grad_norm` *affects accounting* (noise is scaled to
    it by the caller); the clipper adds no noise.

    Gradient checkpointing is supported in its non-reentrant form (transformers' default
    for `gradient_checkpointing_enable()`); the reentrant form cannot stop at the layers'
    outputs and is refused.

    Args:
        model (`torch.nn.Module`): the model, possibly wrapped (peft, `DistributedDataParallel`,
            accelerate). Hooks go on the underlying modules, found with `model.modules()`.
        strategy (`str`, *optional*, defaults to `"auto"`): how per-unit norms of linear
            layers are computed: `"auto"` picks per layer and batch the cheaper of ghost
            norms and materialised per-unit gradients (DESIGN §5); `"ghost"` and
            `"materialize"` force one (for tests and benchmarks). Results are identical
            up to rounding.
        check_coverage (`bool`, *optional*, defaults to `True`): on the first backward,
            also compute the ordinary gradient of the summed loss with autograd and check
            that it equals the sum of the per-unit gradients the rules produced. This
            catches a parameter used outside its layer's forward (e.g. through
            `F.linear(x, layer.weight)`), whose contribution hooks cannot see. Costs one
            extra weight-gradient computation, once. Also verifies, the first time each
            layer is seen with a given row layout, that its rows are attributed to the
            right examples (one extra backward pass, see the module docstring).

    Raises:
        UnsupportedLayerError: a trainable parameter is in a module without a rule, or is
            shared by layers whose rules cannot give the joint norm. Names every module.
            Also raised by a `backward` (before any `.grad` is written) when `check_coverage`
            finds a parameter whose gradient the rules do not fully account for, or a layer
            whose rows are not those of the examples.
            Also raised by `backward`, before any `.grad` is written, for layers whose tensors
            have no batch dimension (computed once and shared by every example), naming them all.
        ValueError: unknown `strategy`, or reentrant gradient checkpointing is enabled.

    Example:

    ```python
    >>> import torch
    >>> from hf_dp.clipping import GhostClipper
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> clipper = GhostClipper(model)
    >>> inputs, targets = torch.randn(6, 4), torch.randn(6, 1)
    >>> losses = ((model(inputs) - targets) ** 2).sum(dim=1)  # one loss per example
    >>> norms = clipper.backward(losses, unit_ids=torch.tensor([0, 0, 1, 1, 2, 2]), max_grad_norm=1.0)
    >>> norms.shape  # one pre-clip norm per unit
    torch.Size([3])
    >>> clipper.detach()

    ```
    """

    def __init__(self, model: nn.Module, *, strategy: str = "auto", check_coverage: bool = True):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.model = model
        self.strategy = strategy
        self.enabled = True
        self._layers, self._also_on_ruleless = self._find_layers(model)
        self._coverage_checked = not check_coverage
        self._check_attribution = check_coverage
        self._verified: Set[Tuple[str, str]] = set()  # (layer path, row layout) whose attribution was verified
        self._check_gradient_checkpointing()
        self._captures: List[_Capture] = []
        self._pending: Dict[nn.Module, Deque[_Capture]] = {}  # per layer, in call order
        self._modes: Dict[nn.Module, List[Optional[TorchFunctionMode]]] = {}
        self._batched_bias: Dict[nn.Module, bool] = {}  # T5-style attention -> bias supplied expanded
        self._batch_size: Optional[int] = None
        self._in_backward = False
        self._handles = []
        for layer in self._layers.values():
            module = layer.module
            if layer.functional:
                enter = functools.partial(self._enter_function_capture, layer)
                leave = functools.partial(self._exit_function_capture, layer)
                self._handles.append(module.register_forward_pre_hook(enter))
                self._handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True))
            else:
                self._handles.append(module.register_forward_hook(self._make_hook(layer), with_kwargs=True))
            if layer.checkpoint_blocks:
                self._handles.append(module.register_forward_pre_hook(self._on_recompute, with_kwargs=True))
        for module in model.modules():
            if position_bias.is_relative_bias_attention(module) and module.relative_attention_bias in self._layers:
                self._handles.append(module.register_forward_pre_hook(self._supply_batched_bias, with_kwargs=True))
        for root in _roots(model):
            self._handles.append(root.register_forward_pre_hook(self._on_model_forward, with_kwargs=True))

    # -- attach-time checks ------------------------------------------------------------

    @staticmethod
    def _find_layers(model: nn.Module) -> Tuple[Dict[nn.Module, _Layer], List[str]]:
        """Hooked layers, and the paths of parameters that also sit on modules without a rule."""
        layers: Dict[nn.Module, _Layer] = {}
        problems: List[str] = []
        users: Dict[int, List[Tuple[str, str, str]]] = {}  # id(param) -> [(path, param name, kind)]
        ruleless: List[Tuple[str, str, Dict[str, nn.Parameter]]] = []  # (path, where, trainable)
        for path, module in model.named_modules():
            trainable = {name: p for name, p in module.named_parameters(recurse=False) if p.requires_grad}
            if not trainable:
                continue
            where = f"{path or '<root>'} ({type(module).__module__}.{type(module).__qualname__})"
            rule = find_rule(module)
            if rule is None:
                ruleless.append((path, where, trainable))
                continue
            uncovered = sorted(set(trainable) - set(rule.params))
            if uncovered:
                problems.append(f"{where}: trainable {uncovered} not covered by the '{rule.name}' rule")
                continue
            reason = rule.validate(module) if rule.validate is not None else None
            if reason is not None:
                problems.append(f"{where}: the '{rule.name}' rule cannot clip this layer: {reason}")
                continue
            functional = rule.function is not None and overrides_forward(module)
            layers[module] = _Layer(path=path, module=module, rule=rule, params=trainable, functional=functional)
            for name, param in trainable.items():
                users.setdefault(id(param), []).append((path, name, rule.params[name]))
        # A parameter registered on a rule-less module too (BERT's LM head registers the
        # decoder's bias on itself) is covered by the layer with the rule; whether the
        # rule-less module also uses it is checked against autograd on the first backward.
        also_on_ruleless: List[str] = []
        for path, where, trainable in ruleless:
            missing = sorted(name for name, param in trainable.items() if id(param) not in users)
            if missing:
                problems.append(f"{where}: trainable {missing} and no clipping rule for this layer type")
            also_on_ruleless += [f"{path}.{name}" for name, p in trainable.items() if id(p) in users]
        for shared in users.values():
            if len(shared) > 1 and len({kind for _, _, kind in shared}) > 1:
                where = ", ".join(f"{path}.{name}" for path, name, _ in shared)
                problems.append(
                    f"parameter shared by {where}: its layers' rules cannot give the exact joint norm; "
                    "freeze it (requires_grad_(False)) or untie it"
                )
        if problems:
            raise UnsupportedLayerError(
                "GhostClipper cannot clip every trainable parameter of this model:\n  - "
                + "\n  - ".join(problems)
                + "\nFreeze these parameters, or register a rule with hf_dp.clipping.register_rule."
            )
        if GradientCheckpointingLayer is not None:
            modules = dict(model.named_modules())
            for layer in layers.values():
                parts = layer.path.split(".")
                ancestors = (modules.get(".".join(parts[:end])) for end in range(len(parts)))
                layer.checkpoint_blocks = tuple(m for m in ancestors if isinstance(m, GradientCheckpointingLayer))
        return layers, also_on_ruleless

    def _check_gradient_checkpointing(self) -> None:
        """Refuse reentrant checkpointing: it runs the forward without gradients and cannot stop at edges."""
        for module in self.model.modules():
            if getattr(module, "gradient_checkpointing", False) is not True:
                continue
            checkpoint = getattr(module, "_gradient_checkpointing_func", None)
            if getattr(checkpoint, "keywords", {}).get("use_reentrant", False):
                raise ValueError(
                    "GhostClipper supports non-reentrant gradient checkpointing only (the reentrant form runs the "
                    "forward pass without gradients and cannot stop the backward pass at each layer's output); call "
                    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
                    "(the default) or set gradient_checkpointing_kwargs={'use_reentrant': False} in the arguments"
                )

    # -- public API --------------------------------------------------------------------

    @property
    def layers(self) -> Dict[str, str]:
        """Hooked module paths and the rule clipping each."""
        return {layer.path: layer.rule.name for layer in self._layers.values()}

    @contextlib.contextmanager
    def disabled(self) -> Iterator["GhostClipper"]:
        """Within this context forward passes capture nothing (plain, non-private backward)."""
        previous, self.enabled = self.enabled, False
        self._forget_captures()
        try:
            yield self
        finally:
            self.enabled = previous

    def detach(self) -> None:
        """Remove all hooks and captured tensors. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._forget_captures()

    def __enter__(self) -> "GhostClipper":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def backward(
        self,
        losses: Tensor,
        *,
        unit_ids: Optional[Union[Tensor, Sequence[int], UnitIndex]] = None,
        max_grad_norm: Union[float, Tensor],
        example_ids: Optional[Tensor] = None,
        grad_scale: float = 1.0,
    ) -> Tensor:
        """Back-propagates `losses`, clips each unit's gradient, adds the clipped sum to `.grad`.

        Args:
            losses (`torch.Tensor`): `(B,)` one loss per example, from the forward pass made
                since the last backward (with the clipper attached and gradients enabled).
            unit_ids (`torch.LongTensor`, `Sequence[int]` or [`~hf_dp.clipping.terms.UnitIndex`], *optional*):
                `(B,)`; examples sharing an id form a unit (a user) whose gradient is that of the **sum** of its
                losses. Defaults to every example being its own unit. Read on the host: pass a CPU tensor, a
                list or a `UnitIndex` (a tensor on an accelerator is copied back once, a host sync).
            max_grad_norm (`float` or 0-dim `torch.Tensor`): clip norm C (affects accounting). A tensor stays
                on the device (adaptive clipping's running C): no host sync.
            example_ids (`torch.LongTensor`, *optional*): for packed rows (several examples per
                row, positions restarting at each, attention masked block by block): `(rows, T)`,
                the index in `losses` of the example each token belongs to, -1 for none (see
                [`~hf_dp.clipping.packing.examples_from_position_ids`]). `losses` and `unit_ids`
                then have one entry per example, not per row. Layers whose tensors have no token
                axis (a pooled classifier head, T5's relative bias) cannot be split and are refused.
            grad_scale (`float`, *optional*, defaults to 1): the clipped sum is multiplied by it before it is
                added to `.grad`, folded into the clip factors (the trainer passes 1 / expected batch size).

        Returns:
            `torch.Tensor`: `(U,)` float32 pre-clip L2 norms of the units' gradients over all
            trainable parameters jointly, ordered by sorted unique unit id.

        Afterwards every trainable parameter's `.grad` holds what it held before plus
        grad_scale · Σ_u min(1, C/‖g_u‖)·g_u (zeros where nothing was there). No noise is added. In the steady
        state (every layer seen before) nothing here reads a device value back to the host.
        """
        if not isinstance(max_grad_norm, Tensor) and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        if losses.dim() != 1:
            raise ValueError(f"losses must have shape (batch_size,), got {tuple(losses.shape)}")
        self._check_gradient_checkpointing()
        captures, self._captures = self._captures, []
        packing = PackedRows(example_ids, losses.shape[0]) if example_ids is not None else None
        batch_size = losses.shape[0] if packing is None else packing.rows  # rows of the captured tensors
        units = unit_ids if isinstance(unit_ids, UnitIndex) else UnitIndex(unit_ids, losses.shape[0])
        if units.batch_size != losses.shape[0]:
            raise ValueError(f"unit_ids cover {units.batch_size} examples, the losses {losses.shape[0]}")
        if losses.shape[0] == 0:
            self._forget_captures()
            self._ensure_grads()
            return losses.new_zeros(0, dtype=torch.float32)
        if not captures:
            raise RuntimeError(
                "GhostClipper.backward: no forward pass was captured; run the forward pass after "
                "attaching the clipper, with gradients enabled and the clipper enabled"
            )
        self._check_rows(captures, batch_size)
        edges = [capture.output_edge for capture in captures]
        checked_params = [] if self._coverage_checked else self._trainable_params()
        unverified = self._unverified(captures, batch_size, packing)
        self._in_backward = True
        try:
            # First sight of a layout: weighted backward passes (graph kept) reduce each layer's output gradient to
            # a few numbers per row, before the one pass that clipping uses frees the graph.
            expected = self._weighted_fingerprints(losses, captures, unverified, packing) if unverified else None
            all_grads = torch.autograd.grad(losses.sum(), edges + checked_params, allow_unused=True)
            output_grads = all_grads[: len(edges)]
            self._check_recomputed(captures, output_grads)
            if unverified:
                self._verify_attribution(captures, output_grads, unverified, packing, *expected)
        except RuntimeError as error:
            if "Checkpointing is not compatible with .grad()" in str(error):
                raise ValueError(
                    "GhostClipper supports non-reentrant gradient checkpointing only; pass "
                    "use_reentrant=False to torch.utils.checkpoint (transformers' default)"
                ) from error
            raise
        finally:
            self._in_backward = False
            self._forget_captures()
        # Handed over in a list that `_clip` empties, so that captured tensors can be freed
        # as soon as their layer is done.
        work = [captures, output_grads, all_grads[len(edges) :]]
        del captures, edges, all_grads, output_grads
        # Norms and sums in float32 (float64), also when the forward ran under autocast.
        with _autocast_disabled(losses.device):
            return self._clip(work, checked_params, units, max_grad_norm, grad_scale, batch_size, packing,
                              losses.device)

    def _clip(
        self, work: list, checked_params, units: UnitIndex, max_grad_norm, grad_scale: float, batch_size: int,
        packing: Optional[PackedRows], device: torch.device,
    ) -> Tensor:
        captures, output_grads, autograd_param_grads = work
        work.clear()
        terms_by_param: Dict[nn.Parameter, list] = {}
        precision_bits: Dict[nn.Parameter, int] = {}  # least precise dtype its gradient went through
        for capture, grads in zip(captures, output_grads):
            if grads is None:  # this call's output does not reach the loss
                continue
            layer = capture.layer
            activations, grads = self._batch_first(capture, grads, batch_size, packing)
            if packing is not None:  # (rows, T, ...) -> (examples, L, ...)
                activations = None if activations is None else packing.regroup(activations)
                grads = packing.regroup(grads)
            terms = layer.rule.fn(layer.module, activations, grads)
            bits = _precision_bits(grads, activations) if checked_params else None  # for the coverage check only
            for name, param in layer.params.items():
                terms_by_param.setdefault(param, []).append(terms[name])
                if checked_params:
                    precision_bits[param] = min(precision_bits.get(param, 64), bits, _precision_bits(param))
        del captures, output_grads

        norm_sq_parts, reducers, scales = [], {}, {}
        while terms_by_param:
            param, terms = terms_by_param.popitem()
            param_norm_sq, reducer = norm_sq_and_reducer(terms, units, self.strategy, param.shape)
            norm_sq_parts.append(param_norm_sq)
            reducers[param] = reducer
            if checked_params:
                scales[param] = float(param_norm_sq.clamp_min(0).sqrt().sum())  # Σ_u ‖g_u‖ for this param
            del terms
        if checked_params:
            self._check_coverage(
                checked_params, autograd_param_grads, reducers, scales, precision_bits, units.num_units
            )

        # Every layer's norms combined once, on the device (no per-layer accumulation, no host read).
        norm_sq = _stacked_sum(norm_sq_parts, units.num_units, device)
        norms = norm_sq.clamp_min(0).sqrt()
        # min(1, C/‖g_u‖)·s; a zero norm gives inf -> s.
        unit_weights = ((max_grad_norm * grad_scale) / norms).clamp(max=grad_scale)
        unit_weights = unit_weights.to(norm_sq_parts[0].dtype if norm_sq_parts else torch.float32)  # once
        for param, reducer in reducers.items():
            clipped_sum = reducer(unit_weights).to(param.dtype)
            if param.grad is None:
                param.grad = clipped_sum
            else:
                param.grad.add_(clipped_sum)
        self._ensure_grads()
        return norms.to(torch.float32)

    # -- hooks -------------------------------------------------------------------------

    def _capturing(self) -> bool:
        return self.enabled and not self._in_backward and torch.is_grad_enabled()

    def _forget_captures(self) -> None:
        self._captures = []
        self._pending = {}

    def _on_model_forward(self, module, args, kwargs):
        if not self._capturing():
            return None
        self._forget_captures()  # a new forward pass: captures of an abandoned one go
        self._batch_size = _batch_size(args, kwargs)
        return None

    def _make_hook(self, layer: _Layer):
        def hook(module, args, kwargs, output):
            return self._capture(layer, _first_input(args, kwargs), output, at_module=True)

        return hook

    def _capture(self, layer: _Layer, inputs: Optional[Tensor], output, at_module: bool = True) -> Optional[Tensor]:
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
        capture = _Capture(
            layer=layer,
            activations=None if pending else activations,
            output_edge=_output_edge(output),
            output_shape=output.shape,
            pending=pending,
            fingerprint=_fingerprint(activations) if pending else None,
        )
        self._captures.append(capture)
        if pending:
            self._pending.setdefault(layer.module, deque()).append(capture)
        return replaced

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

    def _enter_function_capture(self, layer: _Layer, module, args):
        mode = _FunctionCapture(self, layer) if self.enabled and torch.is_grad_enabled() else None
        if mode is not None:
            mode.__enter__()
        self._modes.setdefault(module, []).append(mode)
        return None

    def _exit_function_capture(self, layer: _Layer, module, args, kwargs, output):
        modes = self._modes.get(module)
        mode = modes.pop() if modes else None
        if mode is None:
            return None
        mode.__exit__(None, None, None)
        if mode.calls:
            return None
        # Its forward did not call the function with its weight (e.g. `x @ W.T + b`): capture
        # its input and output as for the base type; the coverage check vouches for that.
        return self._capture(layer, _first_input(args, kwargs), output, at_module=True)

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
        table = self._layers[module.relative_attention_bias]
        first = len(self._captures)
        bias = module.compute_bias(length, length, device=queries.device)  # (1, heads, T, T), captured below
        lookups = [capture for capture in self._captures[first:] if capture.layer is table]
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

    # -- row attribution ---------------------------------------------------------------

    @staticmethod
    def _layout(capture: _Capture, batch_size: int, packing: Optional[PackedRows] = None) -> str:
        leading = capture.output_shape[0] if len(capture.output_shape) else 0
        if leading == batch_size:
            layout = "batch"
        else:
            layout = "flattened" if leading and leading % batch_size == 0 else "shared"
        return layout if packing is None else f"packed {layout}"

    def _unverified(self, captures: List[_Capture], batch_size: int, packing: Optional[PackedRows]) -> List[int]:
        """Indices of captures whose (layer, layout) has not been verified yet (2+ examples only)."""
        if not self._check_attribution or (batch_size if packing is None else packing.num_examples) < 2:
            return []
        return [
            index
            for index, capture in enumerate(captures)
            if (capture.layer.path, self._layout(capture, batch_size, packing)) not in self._verified
        ]

    def _batch_first(
        self, capture: _Capture, grads: Tensor, batch_size: int, packing: Optional[PackedRows] = None
    ) -> Tuple[Optional[Tensor], Tensor]:
        """Activations and output gradients as `(B, ...)`; rows flattened over (batch, time) are read
        batch-major; for packed rows, `(B, T, ...)` with the rows' token axis."""
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

    @staticmethod
    def _check_rows(captures: List[_Capture], batch_size: int) -> None:
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

    def _check_recomputed(self, captures: List[_Capture], output_grads) -> None:
        missing = sorted({c.layer.path for c, g in zip(captures, output_grads) if c.pending and g is not None})
        if missing:
            raise RuntimeError(
                f"GhostClipper: layers inside a gradient-checkpointed block were not recomputed in the backward "
                f"pass, so their inputs are unknown: {missing}. Disable gradient checkpointing for this model."
            )

    def _weighted_fingerprints(self, losses: Tensor, captures: List[_Capture], indices: List[int],
                               packing: Optional[PackedRows]) -> Tuple[Tensor, Dict[int, Optional[Tensor]]]:
        """Row fingerprints ([`_row_fingerprints`]) of the output gradients of Σ_b c_b·L_b, with weights c_b drawn
        from the powers of two 1/8 ... 8 (exact in floating point).

        The backward passes keep the graph for the pass clipping uses; each captures a group of layers whose
        gradients take at most an eighth of all of them (or one layer), and keeps only their fingerprints, so
        this one-off check costs little more memory than the step itself.
        """
        generator = torch.Generator().manual_seed(0)
        exponents = torch.randperm(losses.shape[0], generator=generator) % 7 - 3
        weights = torch.pow(2.0, exponents.double()).to(device=losses.device, dtype=losses.dtype)
        row_weights = weights.double() if packing is None else packing.token_weights(weights.double())  # (B,) | (B, T)
        sizes = {index: math.prod(captures[index].output_shape) for index in indices}
        budget = max(max(sizes.values()), sum(sizes.values()) // 8)
        groups, group, filled = [], [], 0
        for index in indices:
            if group and filled + sizes[index] > budget:
                groups.append(group)
                group, filled = [], 0
            group.append(index)
            filled += sizes[index]
        groups.append(group)
        fingerprints: Dict[int, Optional[Tensor]] = {}
        weighted_loss = (losses * weights).sum()
        for group in groups:
            grads = torch.autograd.grad(weighted_loss, [captures[i].output_edge for i in group], allow_unused=True,
                                        retain_graph=True)
            for index, grad in zip(group, grads):
                fingerprints[index] = None if grad is None else self._row_fingerprints(
                    captures[index], grad, len(row_weights), packing)
            del grads
        return row_weights, fingerprints

    def _row_fingerprints(self, capture: _Capture, grads: Tensor, batch_size: int,
                          packing: Optional[PackedRows]) -> Tensor:
        """`(B, 4)` or, for packed rows, `(B, T, 4)`: each row's (token's) sum, L2 norm, largest and smallest entry,
        in float64 (without a float64 copy of the rows). Scaling a row by c > 0 scales all four by c; rows mixed
        across examples change them."""
        _, grads = self._batch_first(capture, grads, batch_size, packing)
        rows = grads.reshape(grads.shape[: 1 if packing is None else 2] + (-1,))
        norms = torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float64)
        return torch.stack([rows.sum(-1, dtype=torch.float64), norms, rows.amax(-1).double(), rows.amin(-1).double()],
                           dim=-1)

    def _verify_attribution(
        self, captures: List[_Capture], output_grads, indices: List[int], packing: Optional[PackedRows],
        row_weights: Tensor, weighted: Dict[int, Optional[Tensor]],
    ) -> None:
        """A backward of Σ_b c_b·L_b must scale example b's rows (for packed rows: tokens) of every
        output gradient by c_b: compared through the rows' fingerprints."""
        # A misattributed row is off by a factor c_b'/c_b of at least 2 (unless the weights collide).
        bits = min(_precision_bits(*(g for g in output_grads if g is not None)), 64)
        tolerance = 1e-3 if bits >= 32 else 1e-1
        batch_size = len(row_weights)
        wrong, selected = [], [index for index in indices if output_grads[index] is not None]
        for index in selected:
            capture = captures[index]
            fingerprints = self._row_fingerprints(capture, output_grads[index], batch_size, packing)
            expected = fingerprints * row_weights.reshape(row_weights.shape + (1,))
            actual = weighted[index] if weighted[index] is not None else torch.zeros_like(expected)
            if float((actual - expected).norm()) > tolerance * float(expected.norm()):
                wrong.append(f"{capture.layer.path} ({type(capture.layer.module).__name__})")
        if wrong:
            raise UnsupportedLayerError(
                "GhostClipper: the rows of these layers' tensors do not belong to the examples they were read as "
                f"(batch first, or flattened batch-major over (batch, time)): {sorted(set(wrong))}. Freeze them "
                "(requires_grad_(False)) or call the model with batch-first inputs."
                + (" With packed rows: do the examples of a row attend to each other (an attention mask or a cache "
                   "turns off transformers' per-example masking)?" if packing is not None else "")
            )
        self._verified.update(
            (captures[i].layer.path, self._layout(captures[i], batch_size, packing)) for i in selected
        )

    def _trainable_params(self) -> List[nn.Parameter]:
        unique: Dict[int, nn.Parameter] = {}
        for layer in self._layers.values():
            for param in layer.params.values():
                unique.setdefault(id(param), param)
        return list(unique.values())

    def _check_coverage(self, params, autograd_grads, reducers, scales, precision_bits, num_units: int) -> None:
        """Σ_u g_u from the rules must equal autograd's gradient of the summed loss."""
        names = {id(p): f"{layer.path}.{name}" for layer in self._layers.values() for name, p in layer.params.items()}
        mismatched = []
        # Parameters with (near) zero gradient (e.g. attention key biases) only show
        # rounding noise: compare them against a floor set by the whole model's gradient.
        floor = 1e-2 * sum(scales.values())
        for param, expected in zip(params, autograd_grads):
            expected = torch.zeros_like(param) if expected is None else expected
            reducer = reducers.get(param)
            ones = torch.ones(num_units, device=param.device)
            ours = reducer(ones) if reducer is not None else torch.zeros_like(param)
            error = float((ours.double() - expected.double()).norm())
            # Rounding is relative to the size of the summed terms, not of their sum.
            scale = scales.get(param, 0.0) + float(expected.double().norm())
            tolerance = 1e-4 if precision_bits.get(param, 32) >= 32 else 5e-2
            if error > tolerance * (scale + floor):
                mismatched.append(names[id(param)])
        if mismatched:
            also = f"; also registered on modules without a rule: {self._also_on_ruleless}"
            raise UnsupportedLayerError(
                "GhostClipper: the gradient of these parameters does not come only through the layers "
                f"hooked for them (are they used outside their module's forward?): {mismatched}"
                + (also if self._also_on_ruleless else "")
                + ". Freeze them, or register a rule for the layer that uses them."
            )
        self._coverage_checked = True

    def _ensure_grads(self) -> None:
        for layer in self._layers.values():
            for param in layer.params.values():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)


class _FunctionCapture(TorchFunctionMode):
    """Within one call of a layer whose class has its own `forward`: capture its rule's function call.

    Active only between the layer's forward pre-hook and forward hook; every other torch
    function passes through unchanged.
    """

    def __init__(self, clipper: "GhostClipper", layer: _Layer):
        super().__init__()
        self.clipper, self.layer = clipper, layer
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
        replaced = self.clipper._capture(self.layer, args[0] if args else kwargs.get("input"), output, at_module=False)
        return output if replaced is None else replaced


def _stacked_sum(parts: List[Tensor], num_units: int, device: torch.device) -> Tensor:
    """Σ over parameters of their `(U,)` squared norms, in float64: one stack and one sum."""
    if not parts:
        return torch.zeros(num_units, dtype=torch.float64, device=device)
    return torch.stack([part.to(parts[0].dtype) for part in parts]).sum(0, dtype=torch.float64)


def _unattributable(leading: List[Optional[int]], batch_size: int) -> bool:
    """Leading dimensions that are neither the batch nor (batch x something)."""
    return any(not size or size % batch_size for size in leading)


def _raise_shared(shared: List[Tuple[_Capture, List[Optional[int]]]], batch_size: int) -> None:
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


def _checkpointed(layer: _Layer) -> bool:
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


def _unflatten(tensor: Optional[Tensor], batch_size: int) -> Optional[Tensor]:
    """`(B·k, ...)` -> `(B, k, ...)` batch-major; `(B, ...)` unchanged."""
    if tensor is None or tensor.shape[0] == batch_size:
        return tensor
    return tensor.reshape((batch_size, tensor.shape[0] // batch_size) + tuple(tensor.shape[1:]))


@contextlib.contextmanager
def _autocast_disabled(device: torch.device):
    with contextlib.ExitStack() as stack:
        for device_type in {"cpu", device.type}:
            stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        yield


def _precision_bits(*tensors: Optional[Tensor]) -> int:
    """Bits of the least precise floating-point tensor among `tensors`."""
    return min((torch.finfo(t.dtype).bits for t in tensors if t is not None and t.is_floating_point()), default=64)


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
    base = output._base
    if (
        base is not None
        and base.grad_fn is not None
        and base.numel() == output.numel()
        and base.is_contiguous()
        and output.is_contiguous()
    ):
        return get_gradient_edge(base)
    return get_gradient_edge(output)
