"""Per-example gradient terms, their per-unit norms and clipped sums.

Rules describe each trainable parameter's per-example gradient in one of two forms:

- [`OuterGrad`]: a sum of outer products over the example's tokens,
  ``grad_i = Σ_n left_{i,n} ⊗ right_{i,n}`` for a 2-D parameter (rows × cols). `left`
  is dense (`(B, N, rows)`), or holds row indices (`(B, N)`, a one-hot left factor, as
  for embeddings). Linear weights, transformers' `Conv1D` and embeddings are of this form.
- [`ExampleGrad`]: the per-example gradient itself, `(B, *param_shape)`: biases and
  normalisation weights, whose per-example gradients are as small as the parameter.

A *unit* (a user, or an example) is a set of examples; its gradient is the sum of its
examples' gradients, so a unit's tokens are all tokens of all its examples.
[`~hf_dp.clipping.units.UnitIndex`] holds that grouping. For an `OuterGrad` with unit tokens ``t, s``:

- ghost norm: ``‖Σ_t l_t r_tᵀ‖² = Σ_{t,s} (l_t·l_s)(r_t·r_s)``, cost O(M²(rows+cols))
  per unit of M tokens, no rows × cols matrix (Li et al. 2021);
- materialised norm: form ``G_u = Σ_t l_t r_tᵀ``, cost O(M·rows·cols) per unit;
- indexed left (embeddings): ``Σ_v ‖Σ_{t: id_t = v} r_t‖²``, cost O(M·cols);
- two terms X, Y of the same parameter (tied weights, a layer called twice):
  ``‖X + Y‖² = ‖X‖² + ‖Y‖² + 2⟨X, Y⟩`` with ``⟨X, Y⟩ = Σ_{t,s} (lx_t·ly_s)(rx_t·ry_s)``.

The clipped sum is formed by *book-keeping* (Bu et al. 2023): from the captured factors
directly, ``Σ_u w_u Σ_{t∈u} l_t r_tᵀ = Σ_t (w_{u(t)} l_t) r_tᵀ``, one matrix product,
or from the materialised ``G_u`` when those are smaller than the factors.

Norms are computed in float32 (float64 for float64 models) whatever the training dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from .units import UnitIndex

OUTER = "outer"
EXAMPLE = "example"

STRATEGIES = ("auto", "ghost", "materialize")

# Largest number of elements of one temporary (a Gram matrix block or a block of
# materialised per-unit gradients); larger work is split into chunks of units.
_CHUNK_ELEMENTS = 1 << 24


@dataclass
class OuterGrad:
    """Per-example gradient ``Σ_n left_n ⊗ right_n`` of a 2-D parameter.

    Args:
        left (`torch.Tensor`): `(B, N, rows)` floating point, or `(B, N)` integer row
            indices (the left factor is then one-hot: row `left[i, n]`).
        right (`torch.Tensor`): `(B, N, cols)`.
    """

    left: Tensor
    right: Tensor
    scratch: Tuple[bool, bool] = (False, False)  # (left, right) is a tensor of this step alone (see `mark_scratch`)
    kind = OUTER

    @property
    def indexed(self) -> bool:
        return not torch.is_floating_point(self.left)


@dataclass
class ExampleGrad:
    """Materialised per-example gradient.

    Args:
        grads (`torch.Tensor`): `(B, *param_shape)`.
    """

    grads: Tensor
    kind = EXAMPLE


GradTerm = Union[OuterGrad, ExampleGrad]
Reducer = Callable[[Tensor], Tensor]
"""Maps per-unit clip weights `(U,)` to the clipped gradient sum (parameter-shaped). A unit of weight 0 adds exactly
zero, whatever its factors hold (inf or NaN included: they never meet another unit's terms in a product). Its rows
of a scratch factor may be zeroed in place: call it once with the step's clip weights (before that, all-ones weights
are fine: they zero nothing)."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms are computed in: float32, or float64 for float64 tensors."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------
# Strategy choice ("mixed ghost clipping", Bu et al.): from shapes and dtypes, never from data


def choose_strategy(strategy: str, term: OuterGrad, units: UnitIndex) -> Tuple[str, bool]:
    """Pick how to get the norms of one dense `OuterGrad`, and whether to keep per-unit grads.

    Returns `(method, keep)`: method is `"ghost"` or `"materialize"`; `keep` means the materialised per-unit
    gradients are kept (and the factors released) because their bytes, in the compute dtype, are no more than the
    factors' bytes, in theirs; that also makes the clipped sum cheapest. Otherwise the cheaper in FLOPs: with N
    tokens per example, ghost norms cost Σ_{i<=j in a unit} N²(rows + cols), materialising costs B·N·rows·cols
    (for one example per unit: N > rows·cols/(rows + cols)).
    """
    batch, tokens, rows = term.left.shape
    cols = term.right.shape[-1]
    factor_bytes = batch * tokens * (rows * term.left.element_size() + cols * term.right.element_size())
    unit_grad_bytes = units.num_units * rows * cols * (torch.finfo(compute_dtype(term.right.dtype)).bits // 8)
    keep = unit_grad_bytes <= factor_bytes
    if strategy == "ghost":
        return "ghost", False
    if strategy == "materialize":
        return "materialize", keep
    if keep:
        return "materialize", True
    ghost_cost = units.example_pairs_per_unit() * tokens * tokens * (rows + cols)
    materialize_cost = batch * tokens * rows * cols
    return ("materialize", False) if materialize_cost <= ghost_cost else ("ghost", False)


# ---------------------------------------------------------------------------------------
# Norm kernels on per-example factors (B, N, k)


def _chunks(count: int, elements_each: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, elements_each))
    for start in range(0, count, step):
        yield slice(start, min(count, start + step))


def _pair_inner(left_x, right_x, left_y, right_y, pairs: Optional[Tensor], dtype) -> Tensor:
    """⟨G_x,i, G_y,j⟩ = Σ_{t,s} (lx_it·ly_js)(rx_it·ry_js) for example pairs `pairs` (`(3, P)`: first, second, unit).

    `pairs=None` means the diagonal pairs (i, i) of all rows, without copies. Factors are cast to `dtype` one
    chunk at a time, so a low-precision factor never gets a full-size float32 copy.
    """
    out = []
    tokens_x, tokens_y = right_x.shape[1], right_y.shape[1]
    count = right_x.shape[0] if pairs is None else pairs.shape[1]
    for chunk in _chunks(count, 2 * tokens_x * tokens_y):
        i, j = (chunk, chunk) if pairs is None else (pairs[0, chunk], pairs[1, chunk])
        right_gram = torch.bmm(right_x[i].to(dtype), right_y[j].to(dtype).transpose(1, 2))  # (pairs, Nx, Ny)
        left_gram = _left_gram(left_x[i], left_y[j], dtype)  # (pairs, Nx, Ny)
        out.append(_row_dots(left_gram, right_gram))
    if not out:
        return right_x.new_zeros(0, dtype=dtype)
    return out[0] if len(out) == 1 else torch.cat(out)


def _row_dots(x: Tensor, y: Tensor) -> Tensor:
    """`(n, ...)`, `(n, ...)` -> `(n,)`: the dot product of each row pair, as one batched product (one kernel)."""
    rows = x.shape[0]
    return torch.bmm(x.reshape(rows, 1, -1), y.reshape(rows, -1, 1)).reshape(rows)


def _ghost_norm_sq(left: Tensor, right: Tensor, units: UnitIndex, dtype) -> Tensor:
    """Σ_{t,s∈u} (l_t·l_s)(r_t·r_s) per unit from per-example factors `(B, N, ·)`."""
    left_units, right_units = units.grouped(left), units.grouped(right)
    if left_units is not None:  # each unit's tokens together: one diagonal pair per unit
        return _pair_inner(left_units, right_units, left_units, right_units, None, dtype)
    pairs = units.on("pairs", right.device)
    inner = _pair_inner(left, right, left, right, pairs, dtype)
    inner = torch.where(pairs[0] == pairs[1], inner, 2 * inner)  # i < j stands for (i, j) and (j, i)
    return inner.new_zeros(units.num_units).index_add_(0, pairs[2], inner)


def _materialized(left: Tensor, right: Tensor, units: UnitIndex, keep: bool, dtype) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-unit gradients Σ_{t∈u} l_t r_tᵀ: their squared norms, and themselves if `keep`."""
    rows, cols = left.shape[-1], right.shape[-1]
    left_units, right_units = units.grouped(left), units.grouped(right)
    norms, kept = [], []
    if left_units is None:  # per-example gradients, summed into their units, a chunk of units at a time
        order, sorted_units = units.on("order", left.device), units.on("sorted_inverse", left.device)
        starts = np.concatenate([[0], np.cumsum(units.counts)])
        for chunk in _chunks(units.num_units, rows * cols * int(units.counts.max())):
            first, last = int(starts[chunk.start]), int(starts[chunk.stop])
            examples = slice(first, last) if units.consecutive else order[first:last]
            example_grads = torch.bmm(left[examples].to(dtype).transpose(1, 2), right[examples].to(dtype))
            unit_grads = example_grads.new_zeros((chunk.stop - chunk.start, rows, cols))
            unit_grads.index_add_(0, sorted_units[first:last] - chunk.start, example_grads)
            norms.append(_row_dots(unit_grads, unit_grads))
            if keep:
                kept.append(unit_grads)
        return _joined(norms, lambda: left.new_zeros(0, dtype=dtype)), _joined(kept, None) if keep else None
    for chunk in _chunks(units.num_units, rows * cols):  # one product per unit over all its tokens
        unit_grads = torch.bmm(left_units[chunk].to(dtype).transpose(1, 2), right_units[chunk].to(dtype))
        norms.append(_row_dots(unit_grads, unit_grads))
        if keep:
            kept.append(unit_grads)
    norm_sq = _joined(norms, lambda: left.new_zeros(0, dtype=dtype))
    return norm_sq, _joined(kept, lambda: left.new_zeros((0, rows, cols), dtype=dtype)) if keep else None


def _joined(parts: List[Tensor], empty: Optional[Callable[[], Tensor]]) -> Optional[Tensor]:
    """Chunk results in one tensor (no copy for one chunk); `empty()` when there is no chunk."""
    if not parts:
        return empty() if empty is not None else None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _indexed_norm_sq(term: OuterGrad, units: UnitIndex, rows: int, dtype: torch.dtype) -> Tensor:
    """Σ_v ‖Σ_{t∈u: id_t=v} r_t‖² per unit (embedding rows touched by the unit).

    Fixed shapes, no host sync: the (unit, row) keys of all tokens are sorted, the tokens of equal keys are summed
    into one slot (slots past the distinct keys stay zero), and each slot's squared norm goes to its unit.
    """
    token_ids = term.left  # (B, N)
    right = term.right.reshape(-1, term.right.shape[-1])  # (B·N, cols)
    token_units = units.on("inverse", token_ids.device)[:, None].expand_as(token_ids)  # (B, N)
    keys, order = (token_units * rows + token_ids).reshape(-1).sort()
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    slots = first.cumsum(0) - 1  # (B·N,) slot of each sorted token
    slot_sums = right.new_zeros(right.shape, dtype=dtype).index_add_(0, slots, right[order].to(dtype))
    slot_units = torch.zeros_like(keys).scatter_(0, slots, torch.div(keys, rows, rounding_mode="floor"))
    return slot_sums.new_zeros(units.num_units).index_add_(0, slot_units, slot_sums.pow(2).sum(1))


def _left_gram(left_x: Tensor, left_y: Tensor, dtype: torch.dtype) -> Tensor:
    """(l_x,t · l_y,s) for every token pair: `(n, Nx, My)`; dense or row-index factors."""
    x_indexed, y_indexed = not torch.is_floating_point(left_x), not torch.is_floating_point(left_y)
    if not x_indexed and not y_indexed:
        return torch.bmm(left_x.to(dtype), left_y.to(dtype).transpose(1, 2))
    if x_indexed and y_indexed:
        return (left_x[:, :, None] == left_y[:, None, :]).to(dtype)
    if x_indexed:  # one-hot row id_t against dense l_s: l_s[id_t]
        pairs, tokens_x = left_x.shape
        picked = torch.gather(left_y.to(dtype), 2, left_x[:, None, :].expand(pairs, left_y.shape[1], tokens_x))
        return picked.transpose(1, 2)  # (n, Nx, Ny)
    return _left_gram(left_y, left_x, dtype).transpose(1, 2)


def _cross_inner(x: OuterGrad, y: OuterGrad, units: UnitIndex, dtype: torch.dtype) -> Tensor:
    """⟨G_x,u, G_y,u⟩ per unit for two terms of one parameter (ghost form)."""
    grouped = [units.grouped(t) for t in (x.left, x.right, y.left, y.right)]
    if grouped[0] is not None:
        return _pair_inner(*grouped, None, dtype)
    pairs = units.on("ordered_pairs", x.right.device)
    inner = _pair_inner(x.left, x.right, y.left, y.right, pairs, dtype)
    return inner.new_zeros(units.num_units).index_add_(0, pairs[2], inner)


# ---------------------------------------------------------------------------------------
# Clipped sums by book-keeping


def _bookkeeping_sum(term: OuterGrad, units: UnitIndex, unit_weights: Tensor, shape: torch.Size,
                     dtype: torch.dtype, out: Optional[Tensor] = None) -> Tensor:
    """`out` (zeros when None) + Σ_u w_u Σ_{i∈u} Σ_n left_{i,n} ⊗ right_{i,n}: one product over all tokens, added
    into `out` in place. A unit of weight 0 is masked out of both factors (0·inf would be NaN in the product): in
    place in a copy made here or a scratch factor, else in a new tensor. Chunked over examples only as far as new
    tensors are made (a low-precision factor is never copied to float32 whole); none: one product."""
    cols = term.right.shape[-1]
    if term.indexed:
        weights, drop = _row_weights(units, unit_weights, dtype, grouped=False)
        weighted = _masked(term.right, dtype, drop, weights, term.scratch[1]).reshape(-1, cols)
        out = torch.zeros(shape, dtype=dtype, device=term.right.device) if out is None else out
        return out.index_add_(0, term.left.reshape(-1), weighted)
    left, right = units.grouped(term.left), units.grouped(term.right)
    grouped = left is not None
    if not grouped:
        left, right = term.left, term.right
    weights, drop = _row_weights(units, unit_weights, dtype, grouped)
    rows = left.shape[-1]
    weight_left, made = _weight_left(left, right, term.scratch, dtype)
    for chunk in _chunks(left.shape[0], left.shape[1] * made):
        chunk_weights, chunk_drop = weights[chunk], drop[chunk]
        left_chunk = _masked(left[chunk], dtype, chunk_drop, chunk_weights if weight_left else None, term.scratch[0])
        right_chunk = _masked(right[chunk], dtype, chunk_drop, None if weight_left else chunk_weights, term.scratch[1])
        left_chunk, right_chunk = left_chunk.reshape(-1, rows).t(), right_chunk.reshape(-1, cols)
        out = left_chunk @ right_chunk if out is None else out.addmm_(left_chunk, right_chunk)
    return torch.zeros(shape, dtype=dtype, device=term.right.device) if out is None else out


def _weight_left(left: Tensor, right: Tensor, scratch: Tuple[bool, bool], dtype: torch.dtype) -> Tuple[bool, int]:
    """Which factor the clip weights multiply, and the elements per token of the new tensors that makes: the choice
    that makes fewer (a factor copied to `dtype` is weighted and masked in place, a scratch one masked in place),
    else the smaller factor is weighted (fewer multiplies)."""
    sizes = (left.shape[-1], right.shape[-1])
    copied = (left.dtype != dtype, right.dtype != dtype)

    def made(weighted: int) -> int:
        return sum(size for side, size in enumerate(sizes)
                   if copied[side] or side == weighted or not scratch[side])

    left_first = (made(0), sizes[0] > sizes[1]) <= (made(1), sizes[1] > sizes[0])
    return left_first, made(0 if left_first else 1)


def _masked(factor: Tensor, dtype: torch.dtype, drop: Tensor, weights: Optional[Tensor], scratch: bool) -> Tensor:
    """`factor` in `dtype`, times `weights` if given, with the rows in `drop` zeroed. Weighted in place only in a copy
    made here (a scratch factor keeps its values: a reducer may be called again); zeroed in place there or in a
    scratch factor (a dropped unit's rows are never read again)."""
    converted = factor.to(dtype)
    copied = converted.untyped_storage().data_ptr() != factor.untyped_storage().data_ptr()
    if weights is not None:
        converted = converted.mul_(weights) if copied else converted * weights
        return converted.masked_fill_(drop, 0)
    return converted.masked_fill_(drop, 0) if copied or scratch else converted.masked_fill(drop, 0)


def _row_weights(units: UnitIndex, unit_weights: Tensor, dtype: torch.dtype, grouped: bool) -> Tuple[Tensor, Tensor]:
    """`(rows, 1, 1)` weights and drop-mask (weight 0) for the rows of a factor: one per unit (`grouped`), else one
    per example. Built once per clip-weight tensor and shared by every parameter (a few ops a backward, not a few
    per layer): cached on `units`, keyed by the weights tensor itself (held, so its identity cannot be reused)."""
    cache = units.__dict__.setdefault("_row_weights", {})
    hit = cache.get((dtype, grouped))
    if hit is not None and hit[0] is unit_weights:
        return hit[1], hit[2]
    weights = unit_weights.to(dtype)
    if not grouped:
        weights = units.example_weights(weights)
    weights = weights[:, None, None]
    drop = weights == 0
    cache[(dtype, grouped)] = (unit_weights, weights, drop)
    return weights, drop


def _weighted_unit_sum(unit_grads: Tensor, units: UnitIndex) -> Reducer:
    def reduce(unit_weights: Tensor) -> Tensor:  # Σ_u w_u G_u as one product, weight-0 units masked out
        flat = unit_grads.reshape(unit_grads.shape[0], -1)
        weights, drop = _row_weights(units, unit_weights, unit_grads.dtype, grouped=True)
        return torch.mm(weights.reshape(1, -1), flat.masked_fill(drop.reshape(-1, 1), 0)).reshape(unit_grads.shape[1:])

    return reduce


# ---------------------------------------------------------------------------------------
# One parameter: all its terms -> per-unit squared norm + reducer


def _outer_self_norm_sq(
    term: OuterGrad, units: UnitIndex, strategy: str, shape, dtype, allow_keep: bool = True
) -> Tuple[Tensor, Reducer]:
    if term.indexed:
        norm_sq = _indexed_norm_sq(term, units, shape[0], dtype)
        return norm_sq, lambda w: _bookkeeping_sum(term, units, w, shape, dtype)
    method, keep = choose_strategy(strategy, term, units)
    keep = keep and allow_keep
    if method == "ghost":
        norm_sq = _ghost_norm_sq(term.left, term.right, units, dtype)
    else:
        norm_sq, unit_grads = _materialized(term.left, term.right, units, keep, dtype)
        if keep:
            return norm_sq, _weighted_unit_sum(unit_grads, units)
    return norm_sq, lambda w: _bookkeeping_sum(term, units, w, shape, dtype)


def norm_sq_and_reducer(
    terms: Sequence[GradTerm], units: UnitIndex, strategy: str, shape: torch.Size
) -> Tuple[Tensor, Reducer]:
    """Per-unit squared norms of one parameter's gradient, and how to form its clipped sum.

    Args:
        terms (`Sequence[GradTerm]`): every per-example term of the parameter (several when
            it is shared by layers or its layer ran more than once), all of one kind.
        units (`UnitIndex`): the example -> unit grouping.
        strategy (`str`): `"auto"`, `"ghost"` or `"materialize"`.
        shape (`torch.Size`): the parameter's shape.

    Returns:
        `(norm_sq, reducer)`: `(U,)` squared norms in float32 (float64 for float64
        terms) and a function mapping clip weights `(U,)` to Σ_u w_u g_u.
    """
    kinds = {term.kind for term in terms}
    if len(kinds) != 1:
        raise TypeError(f"a parameter got gradient terms of different kinds {sorted(kinds)}")
    dtype = compute_dtype(_term_dtype(terms[0]))
    if EXAMPLE in kinds:
        unit_grads = units.sum_examples(terms[0].grads.to(dtype))  # (U, *shape)
        for term in terms[1:]:
            unit_grads = unit_grads + units.sum_examples(term.grads.to(dtype))
        return _row_dots(unit_grads, unit_grads), _weighted_unit_sum(unit_grads, units)
    if len(terms) == 1:
        return _outer_self_norm_sq(terms[0], units, strategy, shape, dtype)
    # Shared parameter: exact norm with every cross term, sums by book-keeping.
    norm_sq = sum(_outer_self_norm_sq(term, units, strategy, shape, dtype, allow_keep=False)[0] for term in terms)
    for first in range(len(terms)):
        for second in range(first + 1, len(terms)):
            norm_sq = norm_sq + 2 * _cross_inner(terms[first], terms[second], units, dtype)

    def reduce(unit_weights: Tensor) -> Tensor:  # one output: each term's product added into it in place
        out = None
        for term in sorted(terms, key=lambda term: term.indexed):  # a dense product makes the output, no zeros
            out = _bookkeeping_sum(term, units, unit_weights, shape, dtype, out)
        return out

    return norm_sq, reduce


def _term_dtype(term: GradTerm) -> torch.dtype:
    return term.grads.dtype if isinstance(term, ExampleGrad) else term.right.dtype


# `UnitIndex` lives in `units.py`; it stays importable from here for code written before the move.
__all__: List[str] = [
    "OuterGrad",
    "ExampleGrad",
    "GradTerm",
    "UnitIndex",
    "OUTER",
    "EXAMPLE",
    "STRATEGIES",
    "choose_strategy",
    "norm_sq_and_reducer",
]
