"""One-off checks that gradients are attributed right: rows to examples, parameters to their layers.

Hooks see what a model does only through its modules' inputs and outputs, so two things are
checked against autograd instead of assumed, each once:

- **rows**: the first time a layer is seen with a given row layout ([`~hf_dp.clipping.rows`]) and a
  batch of two or more, a backward of Σ_b c_b·L_b, with weights c_b drawn from the powers of two
  1/8 ... 8 (exact in floating point), must scale each example's rows of the output gradient by its
  own c_b (compared through each row's sum, norm, largest and smallest entry). Rows of several
  examples (a time-major reshape, packed examples that attend to each other) fail this. That check
  keeps the graph for extra backward passes, so it raises the peak memory of that one backward
  (1.02-1.13x on small GPT-2 and Llama models, full fine-tuning, `benchmarks/step_memory.py`): run the
  first backward on a few rows (DPTrainer does, on its probe rows at construction) and every later
  step costs what a plain step costs.
- **coverage**: on the first backward, Σ_u g_u from the rules must equal autograd's gradient of the
  summed loss for every trainable parameter. This catches a parameter used outside its layer's forward
  (`F.linear(x, layer.weight)`), whose contribution no hook sees.

Both raise [`~hf_dp.clipping.UnsupportedLayerError`] before any `.grad` is written, naming the layers.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn

from .attach import AttachedLayers
from .capture import Capture
from .clip import ClippingStep, precision_bits
from .packing import PackedRows
from .registry import UnsupportedLayerError
from .rows import batch_first, row_layout
from .terms import Reducer


class AttributionChecks:
    """The one-off checks of a clipper, and which of them are done.

    Args:
        layers (`AttachedLayers`): the clipper's hooked layers.
        enabled (`bool`): run the checks (GhostClipper's `check_coverage`); `False` skips both.
    """

    def __init__(self, layers: AttachedLayers, enabled: bool):
        self.layers = layers
        self.rows_enabled = enabled
        self.coverage_pending = enabled
        self.verified: Set[Tuple[str, str]] = set()  # (layer path, row layout) whose attribution was verified

    # -- rows ----------------------------------------------------------------------------

    def unverified_rows(self, step: ClippingStep) -> Optional[List[int]]:
        """Indices of captures whose (layer, layout) has not been verified yet; `None` when none can be (the check
        off, or fewer than 2 examples)."""
        packing, batch_size = step.packing, step.batch_size
        if not self.rows_enabled or (batch_size if packing is None else packing.num_examples) < 2:
            return None
        return [
            index
            for index, capture in enumerate(step.captures)
            if (capture.layer.path, row_layout(capture, batch_size, packing)) not in self.verified
        ]

    def weighted_fingerprints(
        self, losses: Tensor, step: ClippingStep, indices: List[int]
    ) -> Tuple[Tensor, Dict[int, Optional[Tensor]]]:
        """Row fingerprints ([`_row_fingerprints`]) of the output gradients of Σ_b c_b·L_b, with weights c_b
        drawn from the powers of two 1/8 ... 8 (exact in floating point).

        The backward passes keep the graph for the pass clipping uses; each captures a group of layers whose
        gradients take at most an eighth of all of them (or one layer), and keeps only their fingerprints, so
        this one-off check costs little more memory than the step itself.
        """
        captures, packing = step.captures, step.packing
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
                fingerprints[index] = None if grad is None else _row_fingerprints(
                    captures[index], grad, len(row_weights), packing)
            del grads
        return row_weights, fingerprints

    def verify_rows(
        self, step: ClippingStep, indices: List[int], row_weights: Tensor, weighted: Dict[int, Optional[Tensor]]
    ) -> None:
        """A backward of Σ_b c_b·L_b must scale example b's rows (for packed rows: tokens) of every
        output gradient by c_b: compared through the rows' fingerprints."""
        captures, output_grads, packing = step.captures, step.output_grads, step.packing
        # A misattributed row is off by a factor c_b'/c_b of at least 2 (unless the weights collide).
        bits = min(precision_bits(*(g for g in output_grads if g is not None)), 64)
        tolerance = 1e-3 if bits >= 32 else 1e-1
        batch_size = len(row_weights)
        wrong, selected, deferred = [], [index for index in indices if output_grads[index] is not None], set()
        for index in selected:
            capture = captures[index]
            fingerprints = _row_fingerprints(capture, output_grads[index], batch_size, packing)
            expected = fingerprints * row_weights.reshape(row_weights.shape + (1,))
            actual = weighted[index] if weighted[index] is not None else torch.zeros_like(expected)
            error, size = float((actual - expected).norm()), float(expected.norm())
            if not math.isfinite(error) or not math.isfinite(size):  # a non-finite row: check on a later batch
                deferred.add(index)
            elif error > tolerance * size:
                wrong.append(f"{capture.layer.path} ({type(capture.layer.module).__name__})")
        if wrong:
            raise UnsupportedLayerError(
                "GhostClipper: the gradients reaching these layers' rows do not come from their own example alone: "
                f"{sorted(set(wrong))}, so one example's loss depends on another's. Likely causes, first to last: a "
                "loss that mixes the batch (a compute_loss_func using batch statistics or other rows); a layer that "
                "mixes examples (a batch statistic, attention across the batch, possibly only in larger batches); "
                "inputs that are not batch-first"
                + ("; packed rows whose examples attend to each other (an attention mask or a cache turns off "
                   "transformers' per-example masking)" if packing is not None else "")
                + ". Fix the cause, or freeze these layers (requires_grad_(False))."
            )
        self.verified.update(
            (captures[i].layer.path, row_layout(captures[i], batch_size, packing)) for i in selected
            if i not in deferred
        )

    # -- coverage ------------------------------------------------------------------------

    def coverage_params(self) -> List[nn.Parameter]:
        """The parameters whose autograd gradient the next backward must compute: all of them, until checked."""
        return self.layers.params if self.coverage_pending else []

    def verify_coverage(
        self, step: ClippingStep, reducers: Dict[nn.Parameter, Reducer], scales: Dict[nn.Parameter, float],
        bits_by_param: Dict[nn.Parameter, int],
    ) -> None:
        """Σ_u g_u from the rules must equal autograd's gradient of the summed loss.

        `scales`: Σ_u ‖g_u‖ per parameter; `bits_by_param`: the least precise dtype each gradient went through.
        """
        names = self.layers.param_paths()
        num_units = step.units.num_units
        mismatched = []
        # Parameters with (near) zero gradient (e.g. attention key biases) only show
        # rounding noise: compare them against a floor set by the whole model's gradient.
        floor = 1e-2 * sum(scales.values())
        if not math.isfinite(floor):  # a non-finite unit's gradient: no comparison means anything; a later batch
            return
        for param, expected in zip(step.coverage_params, step.coverage_grads):
            expected = torch.zeros_like(param) if expected is None else expected
            reducer = reducers.get(param)
            ones = torch.ones(num_units, device=param.device)
            ours = reducer(ones) if reducer is not None else torch.zeros_like(param)
            error = float((ours.double() - expected.double()).norm())
            # Rounding is relative to the size of the summed terms, not of their sum.
            scale = scales.get(param, 0.0) + float(expected.double().norm())
            tolerance = 1e-4 if bits_by_param.get(param, 32) >= 32 else 5e-2
            if not math.isfinite(error):  # autograd's gradient is not finite: check on a later batch
                return
            if error > tolerance * (scale + floor):
                mismatched.append(names[id(param)])
        if mismatched:
            also_on_ruleless = self.layers.also_on_ruleless
            also = f"; also registered on modules without a rule: {also_on_ruleless}"
            raise UnsupportedLayerError(
                "GhostClipper: the gradient of these parameters does not come only through the layers "
                f"hooked for them (are they used outside their module's forward?): {mismatched}"
                + (also if also_on_ruleless else "")
                + ". Freeze them, or register a rule for the layer that uses them."
            )
        self.coverage_pending = False


def _row_fingerprints(capture: Capture, grads: Tensor, batch_size: int, packing: Optional[PackedRows]) -> Tensor:
    """`(B, 4)` or, for packed rows, `(B, T, 4)`: each row's (token's) sum, L2 norm, largest and smallest entry,
    in float64 (without a float64 copy of the rows). Scaling a row by c > 0 scales all four by c; rows mixed
    across examples change them."""
    _, grads = batch_first(capture, grads, batch_size, packing)
    rows = grads.reshape(grads.shape[: 1 if packing is None else 2] + (-1,))
    norms = torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float64)
    return torch.stack([rows.sum(-1, dtype=torch.float64), norms, rows.amax(-1).double(), rows.amin(-1).double()],
                       dim=-1)
