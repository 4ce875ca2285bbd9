"""`GhostClipper`: per-unit gradient norms and clipped gradient sums in one backward pass.

This module wires the stages of a clipping step together and holds what lasts across steps; each
stage lives in its own module:

- [`~hf_dp.clipping.attach`]: which modules are hooked, each with its rule, checked before any step;
- [`~hf_dp.clipping.capture`]: the forward hooks, keeping each hooked layer's input and a handle on the
  autograd node of its output;
- one backward pass that stops at those nodes: it yields every hooked layer's output gradient and
  computes no parameter gradient at all;
- [`~hf_dp.clipping.rows`] and [`~hf_dp.clipping.attribution`]: whose rows are whose, verified once per
  layer and layout, and (first step) that the rules account for every parameter's whole gradient;
- [`~hf_dp.clipping.clip`]: per-unit norms ([`~hf_dp.clipping.terms`], grouped by
  [`~hf_dp.clipping.units.UnitIndex`]) and Σ_u min(1, C/‖g_u‖)·g_u, added to `.grad`.

What one backward works on is one object, [`~hf_dp.clipping.clip.ClippingStep`]; what a forward pass
captured is held by [`~hf_dp.clipping.capture.ForwardCapture`] until that backward takes it.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .attach import check_gradient_checkpointing, find_layers
from .attribution import AttributionChecks
from .capture import ForwardCapture, check_recomputed
from .accumulate import ClippedGrads
from .clip import ClippingStep, add_clipped_sums, autocast_disabled, gradient_terms, unit_norms
from .rows import check_rows
from .terms import STRATEGIES
from .units import UnitIndex
from .registry import UnsupportedLayerError


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
            norms and materialised per-unit gradients, from shapes alone (FLOPs and bytes, see
            [`~hf_dp.clipping.terms.choose_strategy`]); `"ghost"` and
            `"materialize"` force one (for tests and benchmarks). Results are identical
            up to rounding.
        check_coverage (`bool`, *optional*, defaults to `True`): on the first backward,
            also compute the ordinary gradient of the summed loss with autograd and check
            that it equals the sum of the per-unit gradients the rules produced. This
            catches a parameter used outside its layer's forward (e.g. through
            `F.linear(x, layer.weight)`), whose contribution hooks cannot see. Costs one
            extra weight-gradient computation, once. Also verifies, the first time each
            layer is seen with a given row layout, that its rows are attributed to the
            right examples (one extra backward pass, see [`~hf_dp.clipping.attribution`]).

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
        self._attached = find_layers(model)
        self._checks = AttributionChecks(self._attached, enabled=check_coverage)
        self.check_model()
        self.forward_capture = ForwardCapture(model, self._attached.by_module)
        self._sink = None  # set by `shard`: where the clipped sums of sharded parameters go

    def check_model(self) -> None:
        """Refuse what may have changed on the model since attaching: reentrant gradient checkpointing (turned on
        later, e.g. by Trainer's `train`). [`backward`] calls it unless told its caller has, since the model last
        changed ([`~hf_dp.step.DPStep`] does, before the first step and after any change to the model's modules,
        hooks or checkpointing)."""
        check_gradient_checkpointing(self.model)

    def shard(self, sink) -> None:
        """Follow the parameters a sharding wrapper (FSDP2's `fully_shard`) put on the hooked modules in place of
        the originals, and hand each clipped sum (the shape of the whole parameter, float32) to
        `sink(param, clipped_sum)`, which returns this rank's rows of it summed over the ranks (a reduce-scatter)
        instead of adding it to `.grad`. The hooks, the rules and the checks already done are kept."""
        for layer in self._attached.by_module.values():
            for name in layer.params:
                layer.params[name] = getattr(layer.module, name)
        self._sink = sink

    @property
    def layers(self) -> Dict[str, str]:
        """Hooked module paths and the rule clipping each."""
        return self._attached.rules()

    @property
    def enabled(self) -> bool:
        """Whether forward passes are captured (see [`~GhostClipper.disabled`])."""
        return self.forward_capture.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.forward_capture.enabled = value

    @contextlib.contextmanager
    def disabled(self) -> Iterator["GhostClipper"]:
        """Within this context forward passes capture nothing (plain, non-private backward)."""
        previous, self.enabled = self.enabled, False
        self.forward_capture.forget()
        try:
            yield self
        finally:
            self.enabled = previous

    def detach(self) -> None:
        """Remove all hooks and captured tensors. Idempotent."""
        self.forward_capture.remove()

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
        into: Optional[ClippedGrads] = None,
        check_model: bool = True,
    ) -> Tensor:
        """Back-propagates `losses`, clips each unit's gradient, adds the clipped sum to `.grad`.

        Args:
            losses (`torch.Tensor`): `(B,)` one loss per example, from the forward pass made
                since the last backward (with the clipper attached and gradients enabled).
            unit_ids (`torch.LongTensor`, `Sequence[int]` or [`~hf_dp.clipping.units.UnitIndex`], *optional*):
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
            into ([`~hf_dp.clipping.accumulate.ClippedGrads`], *optional*): where the clipped sums accumulate
                across backward passes, in float32 whatever the parameters' dtype, until the caller adds the noise
                and rounds them into `.grad` ([`~hf_dp.clipping.accumulate.ClippedGrads.round_into_grads`]); the DP
                step passes one per logical batch. Unset: the sums are rounded into `.grad` at the end of this
                backward (for bf16/fp16 parameters that rounds before any noise: pass `into` for DP training).
            check_model (`bool`, *optional*, defaults to `True`): run [`check_model`] first; `False` only when the
                caller has run it since the model last changed (it walks every module, each pass otherwise).

        Returns:
            `torch.Tensor`: `(U,)` float32 pre-clip L2 norms of the units' gradients over all
            trainable parameters jointly, ordered by sorted unique unit id.

        Afterwards every trainable parameter's `.grad` (or its sum in `into`) holds what it held before plus
        grad_scale · Σ_u min(1, C/‖g_u‖)·g_u (zeros where nothing was there). A unit whose loss or gradient norm is
        not finite adds exactly zero, and its returned norm is inf. No noise is added. In the steady state (every
        layer seen before) nothing here reads a device value back to the host.
        """
        if not isinstance(max_grad_norm, Tensor) and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        if losses.dim() != 1:
            raise ValueError(f"losses must have shape (batch_size,), got {tuple(losses.shape)}")
        if check_model:
            self.check_model()
        checks = self._checks
        step = ClippingStep.prepare(
            losses, self.forward_capture.take(), unit_ids=unit_ids, max_grad_norm=max_grad_norm,
            example_ids=example_ids, grad_scale=grad_scale,
            coverage_params=checks.coverage_params() if checks.coverage_pending else [],
        )
        if losses.shape[0] == 0:
            self.forward_capture.forget()
            (into if into is not None else ClippedGrads()).ensure(self._attached.params)
            return losses.new_zeros(0, dtype=torch.float32)
        if not step.captures:
            raise RuntimeError(
                "GhostClipper.backward: no forward pass was captured; run the forward pass after "
                "attaching the clipper, with gradients enabled and the clipper enabled"
            )
        unverified = checks.unverified_rows(step)
        # A layout seen before passed this check then; `batch_first` checks each capture's rows again as the
        # rules read them.
        if unverified is None or unverified:
            check_rows(step.captures, step.batch_size)
        self._backpropagate(losses, step, unverified or [])
        sums = ClippedGrads() if into is None else into
        with autocast_disabled(losses.device):  # norms and sums in float32 (float64), also under autocast
            norms = self._clip(step, sums)
        if into is None:
            sums.round_into_grads()
        return norms

    def _backpropagate(self, losses: Tensor, step: ClippingStep, unverified: List[int]) -> None:
        """One backward pass of Σ_b L_b to the captured outputs (and, on the first step, the parameters whose
        coverage is checked), into `step`; the first sight of a row layout (`unverified`, indices into the
        captures) also checks its attribution."""
        edges = [capture.output_edge for capture in step.captures]
        if unverified and self._sink is not None:
            raise UnsupportedLayerError(
                f"GhostClipper: a row layout first seen after sharding ({step.captures[unverified[0]].layer.path}); "
                "its attribution check needs extra backward passes that sharded ranks cannot run out of step: "
                "train once unsharded with the same batch layout to find the cause.")
        with self.forward_capture.backward_pass():
            try:
                # Weighted backward passes (graph kept) reduce each new layout's output gradient to a few
                # numbers per row, before the one pass that clipping uses frees the graph.
                expected = self._checks.weighted_fingerprints(losses, step, unverified) if unverified else None
                all_grads = torch.autograd.grad(losses.sum(), edges + step.coverage_params, allow_unused=True)
                step.output_grads, step.coverage_grads = all_grads[: len(edges)], all_grads[len(edges) :]
                check_recomputed(step.captures, step.output_grads)
                if unverified:
                    self._checks.verify_rows(step, unverified, *expected)
            except RuntimeError as error:
                if "Checkpointing is not compatible with .grad()" in str(error):
                    raise ValueError(
                        "GhostClipper supports non-reentrant gradient checkpointing only; pass "
                        "use_reentrant=False to torch.utils.checkpoint (transformers' default)"
                    ) from error
                raise

    def _clip(self, step: ClippingStep, into: ClippedGrads) -> Tensor:
        """Rules -> per-unit norms -> (first step: coverage check) -> clipped sums in `.grad`; returns the norms."""
        checking = bool(step.coverage_params)
        terms_by_param, bits_by_param = gradient_terms(step, record_precision=checking)
        norm_sq_parts, reducers, scales = unit_norms(terms_by_param, step.units, self.strategy, measure_scales=checking)
        if checking:
            self._checks.verify_coverage(step, reducers, scales, bits_by_param)
        return add_clipped_sums(norm_sq_parts, reducers, step, self._attached.params, into, self._sink)
