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
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

# Importing the rule modules registers their rules.
from . import embedding as _embedding  # noqa: F401
from . import linear as _linear  # noqa: F401
from . import norm as _norm  # noqa: F401
from .registry import Rule, UnsupportedLayerError, find_rule
from .terms import STRATEGIES, UnitIndex, norm_sq_and_reducer

_BATCH_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "labels", "pixel_values", "input_values")


@dataclass
class _Layer:
    """A hooked module: where it is, its rule, and its trainable direct parameters."""

    path: str
    module: nn.Module
    rule: Rule
    params: Dict[str, nn.Parameter]  # trainable direct parameters, by name


@dataclass
class _Capture:
    """One forward call of a hooked layer."""

    layer: _Layer
    activations: Optional[Tensor]  # the layer's first input, detached
    output_edge: object  # autograd GradientEdge of the output's node
    output_shape: torch.Size


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
            extra weight-gradient computation, once.

    Raises:
        UnsupportedLayerError: a trainable parameter is in a module without a rule, or is
            shared by layers whose rules cannot give the joint norm. Names every module.
            Also raised by the first `backward` when `check_coverage` finds a parameter
            whose gradient the rules do not fully account for (before any `.grad` is written).
        ValueError: unknown `strategy`, or gradient checkpointing is enabled.

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
        self._check_gradient_checkpointing()
        self._captures: List[_Capture] = []
        self._batch_size: Optional[int] = None
        self._in_backward = False
        self._handles = []
        for layer in self._layers.values():
            self._handles.append(layer.module.register_forward_hook(self._make_hook(layer), with_kwargs=True))
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
            layers[module] = _Layer(path=path, module=module, rule=rule, params=trainable)
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
        return layers, also_on_ruleless

    def _check_gradient_checkpointing(self) -> None:
        for module in self.model.modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                raise ValueError(
                    "GhostClipper does not support gradient checkpointing (activations are recomputed "
                    "outside its hooks); call model.gradient_checkpointing_disable()"
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
        self._captures = []
        try:
            yield self
        finally:
            self.enabled = previous

    def detach(self) -> None:
        """Remove all hooks and captured tensors. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._captures = []

    def __enter__(self) -> "GhostClipper":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def backward(self, losses: Tensor, *, unit_ids: Optional[Tensor] = None, max_grad_norm: float) -> Tensor:
        """Back-propagates `losses`, clips each unit's gradient, adds the clipped sum to `.grad`.

        Args:
            losses (`torch.Tensor`): `(B,)` one loss per example, from the forward pass made
                since the last backward (with the clipper attached and gradients enabled).
            unit_ids (`torch.LongTensor`, *optional*): `(B,)`; examples sharing an id form a
                unit (a user) whose gradient is that of the **sum** of its losses. Defaults
                to every example being its own unit.
            max_grad_norm (`float`): clip norm C (affects accounting).

        Returns:
            `torch.Tensor`: `(U,)` float32 pre-clip L2 norms of the units' gradients over all
            trainable parameters jointly, ordered by sorted unique unit id.

        Afterwards every trainable parameter's `.grad` holds what it held before plus
        Σ_u min(1, C/‖g_u‖)·g_u (zeros where nothing was there). No noise is added.
        """
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        if losses.dim() != 1:
            raise ValueError(f"losses must have shape (batch_size,), got {tuple(losses.shape)}")
        self._check_gradient_checkpointing()
        captures, self._captures = self._captures, []
        batch_size = losses.shape[0]
        units = UnitIndex(unit_ids, batch_size, losses.device)
        if batch_size == 0:
            self._ensure_grads()
            return losses.new_zeros(0, dtype=torch.float32)
        if not captures:
            raise RuntimeError(
                "GhostClipper.backward: no forward pass was captured; run the forward pass after "
                "attaching the clipper, with gradients enabled and the clipper enabled"
            )
        edges = [capture.output_edge for capture in captures]
        checked_params = [] if self._coverage_checked else self._trainable_params()
        self._in_backward = True
        try:
            all_grads = torch.autograd.grad(losses.sum(), edges + checked_params, allow_unused=True)
        finally:
            self._in_backward = False
        # Handed over in a list that `_clip` empties, so that captured tensors can be freed
        # as soon as their layer is done.
        work = [captures, all_grads[: len(edges)], all_grads[len(edges) :]]
        del captures, edges, all_grads
        # Norms and sums in float32 (float64), also when the forward ran under autocast.
        with _autocast_disabled(losses.device):
            return self._clip(work, checked_params, units, max_grad_norm)

    def _clip(self, work: list, checked_params, units: UnitIndex, max_grad_norm: float) -> Tensor:
        captures, output_grads, autograd_param_grads = work
        work.clear()
        batch_size = units.batch_size
        terms_by_param: Dict[nn.Parameter, list] = {}
        precision_bits: Dict[nn.Parameter, int] = {}  # least precise dtype its gradient went through
        for capture, grads in zip(captures, output_grads):
            if grads is None:  # this call's output does not reach the loss
                continue
            grads = grads.reshape(capture.output_shape)
            layer = capture.layer
            self._check_batch(layer, capture.activations, grads, batch_size)
            terms = layer.rule.fn(layer.module, capture.activations, grads)
            bits = _precision_bits(grads, capture.activations)
            for name, param in layer.params.items():
                terms_by_param.setdefault(param, []).append(terms[name])
                precision_bits[param] = min(precision_bits.get(param, 64), bits, _precision_bits(param))
        del captures, output_grads

        norm_sq = torch.zeros(units.num_units, dtype=torch.float64, device=units.inverse.device)
        reducers, scales = {}, {}
        while terms_by_param:
            param, terms = terms_by_param.popitem()
            param_norm_sq, reducer = norm_sq_and_reducer(terms, units, self.strategy, param.shape)
            norm_sq += param_norm_sq.to(norm_sq.dtype)
            reducers[param] = reducer
            if checked_params:
                scales[param] = float(param_norm_sq.clamp_min(0).sqrt().sum())  # Σ_u ‖g_u‖ for this param
            del terms
        if checked_params:
            self._check_coverage(
                checked_params, autograd_param_grads, reducers, scales, precision_bits, units.num_units
            )

        norms = norm_sq.clamp_min(0).sqrt()
        unit_weights = (max_grad_norm / norms).clamp(max=1.0)  # a zero norm gives inf -> 1
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

    def _on_model_forward(self, module, args, kwargs):
        if not self._capturing():
            return None
        self._captures = []  # a new forward pass: captures of an abandoned one go
        self._batch_size = _batch_size(args, kwargs)
        return None

    def _make_hook(self, layer: _Layer):
        def hook(module, args, kwargs, output):
            if not self._capturing() or not isinstance(output, Tensor) or not output.requires_grad:
                return None
            inputs = args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
            activations = inputs.detach() if (layer.rule.capture_input and inputs is not None) else None
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
                # that its gradient keeps one row per example.
                replaced = output.expand((batch_size,) + output.shape[1:])
                activations = activations.expand((batch_size,) + activations.shape[1:])
                output = replaced
            capture = _Capture(
                layer=layer, activations=activations, output_edge=_output_edge(output), output_shape=output.shape
            )
            self._captures.append(capture)
            return replaced

        return hook

    # -- helpers -----------------------------------------------------------------------

    @staticmethod
    def _check_batch(layer: _Layer, activations: Optional[Tensor], grads: Tensor, batch_size: int) -> None:
        leading = [grads.shape[0] if grads.dim() else None]
        if activations is not None:
            leading.append(activations.shape[0] if activations.dim() else None)
        if any(size != batch_size for size in leading):
            raise RuntimeError(
                f"GhostClipper: layer {layer.path} ({type(layer.module).__name__}) saw tensors with leading "
                f"dimension {leading} for a batch of {batch_size} examples; it cannot attribute its rows to "
                "examples. Call the model with input_ids / inputs_embeds of shape (batch_size, ...)."
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
