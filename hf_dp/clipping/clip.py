"""Clipping one backward: per-unit norms, clip factors, and the clipped weighted gradient.

DP-SGD bounds each unit's influence on the update by clipping its gradient g_u to norm C. Here
the captured inputs and output gradients ([`ClippingStep`]) go through the layers' rules into
factored per-example gradients, [`~hf_dp.clipping.terms`] turns them into per-unit squared norms
and "reducers" (functions from per-unit weights to a weighted gradient sum), and the update
grad_scale · Σ_u min(1, C/‖g_u‖)·g_u is formed from those factors (book-keeping, Bu et al. 2023)
and added to the step's sums ([`~hf_dp.clipping.accumulate.ClippedGrads`], float32 whatever the
parameters' dtype): no per-unit gradient of the whole model is ever held. A unit whose loss or norm
is not finite contributes exactly zero.

In the steady state nothing here reads a device value back to the host: the units and packed rows
are host data, every layer's norms are combined once on the device, and C may be a device tensor
(adaptive clipping's running C). Norms and sums are computed in float32 (float64 for float64
models), also when the forward pass ran under autocast.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .accumulate import ClippedGrads
from .capture import Capture
from .packing import PackedRows
from .rows import batch_first
from .terms import ExampleGrad, GradTerm, OuterGrad, Reducer, compute_dtype, norm_sq_and_reducer
from .units import UnitIndex


@dataclass
class ClippingStep:
    """Everything one [`~hf_dp.clipping.GhostClipper.backward`] works on, in one place.

    Built from the backward's arguments and the forward pass's captures ([`ClippingStep.prepare`]),
    completed by the backward pass (`output_grads`, `coverage_grads`), then consumed by [`gradient_terms`],
    which takes the captured tensors out so that they are freed as soon as the rules are done with them.
    """

    captures: List[Capture]  # the hooked layers' forward calls, in call order
    units: UnitIndex  # which examples form which unit, and the order of the returned norms
    packing: Optional[PackedRows]  # several examples per row: which tokens are whose
    batch_size: int  # rows of the captured tensors (examples, or packed rows)
    max_grad_norm: Union[float, Tensor]  # C: a float, or a 0-dim tensor kept on the device
    grad_scale: float  # multiplies the clipped sum (the trainer's 1 / expected batch size)
    device: torch.device
    finite_units: Optional[Tensor] = None  # (U,) bool: every loss of the unit is finite (on the device)
    coverage_params: List[nn.Parameter] = field(default_factory=list)  # checked against autograd (first step)
    output_grads: Sequence[Optional[Tensor]] = ()  # per capture: the loss's gradient at the layer's output
    coverage_grads: Sequence[Optional[Tensor]] = ()  # autograd's gradient of each of `coverage_params`

    @classmethod
    def prepare(
        cls,
        losses: Tensor,
        captures: List[Capture],
        *,
        unit_ids: Optional[Union[Tensor, Sequence[int], UnitIndex]],
        max_grad_norm: Union[float, Tensor],
        example_ids: Optional[Tensor],
        grad_scale: float,
        coverage_params: List[nn.Parameter],
    ) -> "ClippingStep":
        """The step for `losses` (one per example) and the backward's arguments; host work only."""
        packing = PackedRows(example_ids, losses.shape[0]) if example_ids is not None else None
        units = unit_ids if isinstance(unit_ids, UnitIndex) else UnitIndex(unit_ids, losses.shape[0])
        if units.batch_size != losses.shape[0]:
            raise ValueError(f"unit_ids cover {units.batch_size} examples, the losses {losses.shape[0]}")
        non_finite = units.sum_examples((~torch.isfinite(losses.detach())).to(torch.float32))  # (U,) on the device
        return cls(
            captures=captures, units=units, packing=packing,
            batch_size=losses.shape[0] if packing is None else packing.rows,
            max_grad_norm=max_grad_norm, grad_scale=grad_scale, device=losses.device,
            finite_units=non_finite == 0, coverage_params=coverage_params,
        )


def gradient_terms(
    step: ClippingStep, record_precision: bool = False
) -> Tuple[Dict[nn.Parameter, List[GradTerm]], Dict[nn.Parameter, int]]:
    """Each parameter's per-example gradient terms from its layers' captured calls (the step's captured
    tensors are taken out of it); with `record_precision`, also the least precise dtype (in bits) its
    gradient went through, for the coverage check's tolerance."""
    captures, output_grads = step.captures, step.output_grads
    step.captures, step.output_grads = [], ()
    packing = step.packing
    terms_by_param: Dict[nn.Parameter, List[GradTerm]] = {}
    bits_by_param: Dict[nn.Parameter, int] = {}
    rule_grads: List[Tensor] = []
    held: List[Optional[Tensor]] = list(step.coverage_grads)  # tensors that are not this step's scratch
    for capture, grads in zip(captures, output_grads):
        if grads is None:  # this call's output does not reach the loss
            continue
        layer = capture.layer
        activations, grads = batch_first(capture, grads, step.batch_size, packing)
        if packing is not None:  # (rows, T, ...) -> (examples, L, ...)
            activations = None if activations is None else packing.regroup(activations)
            grads = packing.regroup(grads)
        rule_grads.append(grads)
        held.append(activations)
        terms = layer.rule.fn(layer.module, activations, grads)
        bits = precision_bits(grads, activations) if record_precision else None
        for name, param in layer.params.items():
            terms_by_param.setdefault(param, []).append(terms[name])
            if record_precision:
                bits_by_param[param] = min(bits_by_param.get(param, 64), bits, precision_bits(param))
    mark_scratch(terms_by_param, rule_grads, held)
    return terms_by_param, bits_by_param


def mark_scratch(terms_by_param: Dict[nn.Parameter, List[GradTerm]], output_grads: Sequence[Tensor],
                 held: Sequence[Optional[Tensor]]) -> None:
    """Flag each `OuterGrad` factor that is one of this backward's output gradients (or a view of one), contiguous,
    and whose memory no other term, layer input or gradient held here shares: the book-keeping sum may then zero
    its dropped units' rows in place instead of copying it (a layer output gradient is the step's own: autograd
    handed it over and nothing else keeps it). Host metadata only."""
    def storage(tensor: Tensor) -> int:
        return tensor.untyped_storage().data_ptr()

    factors = [(term, side) for terms in terms_by_param.values() for term in terms if isinstance(term, OuterGrad)
               for side in (0, 1)]
    uses = Counter(storage(term.grads) for terms in terms_by_param.values() for term in terms
                   if isinstance(term, ExampleGrad))
    uses.update(storage((term.left, term.right)[side]) for term, side in factors)
    uses.update(storage(tensor) for tensor in held if tensor is not None)
    own = {storage(grad) for grad in output_grads}
    for term, side in factors:
        factor = (term.left, term.right)[side]
        if factor.is_floating_point() and factor.is_contiguous() and storage(factor) in own \
                and uses[storage(factor)] == 1:
            term.scratch = (True, term.scratch[1]) if side == 0 else (term.scratch[0], True)


def unit_norms(
    terms_by_param: Dict[nn.Parameter, List[GradTerm]], units: UnitIndex, strategy: str, measure_scales: bool = False
) -> Tuple[List[Tensor], Dict[nn.Parameter, Reducer], Dict[nn.Parameter, float]]:
    """Per parameter: its `(U,)` squared per-unit norms and its reducer; `terms_by_param` is emptied as it goes.

    With `measure_scales`, also Σ_u ‖g_u‖ per parameter (a host read), the size the coverage check's rounding
    is relative to.
    """
    norm_sq_parts, reducers, scales = [], {}, {}
    while terms_by_param:
        param, terms = terms_by_param.popitem()
        param_norm_sq, reducer = norm_sq_and_reducer(terms, units, strategy, param.shape)
        norm_sq_parts.append(param_norm_sq)
        reducers[param] = reducer
        if measure_scales:
            scales[param] = float(param_norm_sq.clamp_min(0).sqrt().sum())  # Σ_u ‖g_u‖ for this param
        del terms
    return norm_sq_parts, reducers, scales


def add_clipped_sums(
    norm_sq_parts: List[Tensor], reducers: Dict[nn.Parameter, Reducer], step: ClippingStep,
    params: Sequence[nn.Parameter], into: ClippedGrads, sink: Optional[Callable[[nn.Parameter, Tensor], Tensor]] = None,
) -> Tensor:
    """Adds grad_scale · Σ_u min(1, C/‖g_u‖)·g_u, in the compute dtype, to each parameter's sum in `into` (zeros for
    `params` that got nothing); returns the `(U,)` float32 pre-clip norms over all parameters jointly.

    A unit whose loss or norm is not finite (inf or NaN anywhere in its terms) gets weight 0 and adds exactly zero:
    otherwise one unit's inf would reach every parameter as 0·inf = NaN, an event that exists only with that unit.
    Its returned norm is inf (it counts as clipped in the released statistics, which bound each unit's share).
    Decided on the device: no host read.

    With `sink` (sharded parameters), `sink(param, clipped_sum)` reduce-scatters each parameter's clipped sum and
    returns this rank's rows, for every one of `params` in their order (zeros where nothing reached it), so that
    every rank calls it alike."""
    units = step.units
    # Every layer's norms combined once, on the device (no per-layer accumulation, no host read).
    norm_sq = _stacked_sum(norm_sq_parts, units.num_units, step.device)
    keep = torch.isfinite(norm_sq)
    if step.finite_units is not None:
        keep &= step.finite_units
    norms = torch.where(keep, norm_sq.clamp_min(0).sqrt(), torch.inf)
    # min(1, C/‖g_u‖)·s; a zero norm gives inf -> s; a non-finite unit 0.
    unit_weights = torch.where(keep, ((step.max_grad_norm * step.grad_scale) / norms).clamp(max=step.grad_scale), 0)
    unit_weights = unit_weights.to(norm_sq_parts[0].dtype if norm_sq_parts else torch.float32)  # once
    if sink is not None:
        for param in params:
            reducer = reducers.pop(param, None)
            clipped_sum = reducer(unit_weights) if reducer is not None else torch.zeros(
                param.shape, dtype=compute_dtype(param.dtype), device=step.device)
            into.add(param, sink(param, clipped_sum))
        return norms.to(torch.float32)
    while reducers:  # each parameter's factors are freed once its sum is formed: the next sums reuse that memory
        param, reducer = reducers.popitem()
        into.add(param, reducer(unit_weights))
    into.ensure(params)
    return norms.to(torch.float32)


def precision_bits(*tensors: Optional[Tensor]) -> int:
    """Bits of the least precise floating-point tensor among `tensors`."""
    return min((torch.finfo(t.dtype).bits for t in tensors if t is not None and t.is_floating_point()), default=64)


@contextlib.contextmanager
def autocast_disabled(device: torch.device) -> Iterator[None]:
    """Norms and sums in float32 (float64) even when the forward pass ran under autocast."""
    with contextlib.ExitStack() as stack:
        for device_type in {"cpu", device.type}:
            stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        yield


def _stacked_sum(parts: List[Tensor], num_units: int, device: torch.device) -> Tensor:
    """Σ over parameters of their `(U,)` squared norms, in float64: one stack and one sum."""
    if not parts:
        return torch.zeros(num_units, dtype=torch.float64, device=device)
    return torch.stack([part.to(parts[0].dtype) for part in parts]).sum(0, dtype=torch.float64)
