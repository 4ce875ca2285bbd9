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
[`UnitIndex`] holds that grouping. For an `OuterGrad` with unit tokens ``t, s``:

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

import torch
from torch import Tensor

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
"""Maps per-unit clip weights `(U,)` to the clipped gradient sum (parameter-shaped)."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms are computed in: float32, or float64 for float64 tensors."""
    return torch.promote_types(dtype, torch.float32)


class UnitIndex:
    """Which examples form which unit.

    Args:
        unit_ids (`torch.Tensor`, *optional*): `(B,)` integer ids; examples sharing an id
            form one unit. `None`: every example is its own unit.
        batch_size (`int`): B.
        device (`torch.device`): where index tensors live.

    Units are ordered by sorted unique id; `inverse[i]` is example i's unit. Work on
    several examples of one unit goes through *pairs* of its examples, so units of
    uneven sizes cost Σ_u n_u² example pairs, never a padded U × max n_u layout.
    """

    def __init__(self, unit_ids: Optional[Tensor], batch_size: int, device: torch.device):
        self.batch_size = batch_size
        examples = torch.arange(batch_size, device=device)
        if unit_ids is None:
            inverse = examples
        else:
            unit_ids = torch.as_tensor(unit_ids, device=device).reshape(-1)
            if unit_ids.numel() != batch_size:
                raise ValueError(f"unit_ids has {unit_ids.numel()} entries for a batch of {batch_size} examples")
            if torch.is_floating_point(unit_ids):
                raise TypeError("unit_ids must be an integer tensor")
            _, inverse = torch.unique(unit_ids, sorted=True, return_inverse=True)
        self.inverse = inverse  # (B,)
        self.num_units = int(inverse.max()) + 1 if batch_size else 0
        self.identity = unit_ids is None or bool((inverse == examples).all())
        self.order = torch.argsort(inverse, stable=True)  # examples grouped by unit
        self.counts = torch.bincount(inverse, minlength=self.num_units)  # (U,) examples per unit
        self._same_unit = None  # (B, B) bool, built on first use

    def pairs(self, ordered: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        """Example pairs (i, j) of the same unit: `(first, second, unit)`.

        `ordered=False`: only i <= j (a symmetric sum then counts i < j twice);
        `ordered=True`: every (i, j).
        """
        if self._same_unit is None:
            self._same_unit = self.inverse[:, None] == self.inverse[None, :]  # (B, B)
        same_unit = self._same_unit if ordered else torch.triu(self._same_unit)
        first, second = same_unit.nonzero(as_tuple=True)
        return first, second, self.inverse[first]

    def sum_examples(self, per_example: Tensor) -> Tensor:
        """`(B, *shape)` -> `(U, *shape)`: sum over each unit's examples."""
        if self.identity:
            return per_example
        out = per_example.new_zeros((self.num_units,) + per_example.shape[1:])
        return out.index_add_(0, self.inverse, per_example)

    def example_weights(self, unit_weights: Tensor) -> Tensor:
        """`(U,)` -> `(B,)`: each example gets its unit's weight."""
        return unit_weights[self.inverse]

    def example_pairs_per_unit(self) -> float:
        """Σ_u n_u (n_u + 1) / 2: the number of i <= j example pairs the ghost norm visits."""
        return float((self.counts * (self.counts + 1)).sum()) / 2


# ---------------------------------------------------------------------------------------
# Strategy choice (DESIGN §5, "mixed ghost clipping", Bu et al.)


def choose_strategy(strategy: str, term: OuterGrad, units: UnitIndex) -> Tuple[str, bool]:
    """Pick how to get the norms of one dense `OuterGrad`, and whether to keep per-unit grads.

    Returns `(method, keep)`: method is `"ghost"` or `"materialize"`; `keep` means the
    materialised per-unit gradients are kept (and the factors released) because they
    take no more memory than the factors, which also makes the clipped sum cheapest.
    With T tokens per example: ghost norms cost Σ_{i<=j in a unit} T²(rows + cols),
    materialising costs B·T·rows·cols (for one example per unit: T > d·p/(d+p)).
    """
    batch, tokens, rows = term.left.shape
    cols = term.right.shape[-1]
    keep = units.num_units * rows * cols <= batch * tokens * (rows + cols)
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


def _pair_inner(left_x, right_x, left_y, right_y, first, second, dtype) -> Tensor:
    """⟨G_x,i, G_y,j⟩ = Σ_{t,s} (lx_it·ly_js)(rx_it·ry_js) for example pairs (first, second).

    `first = second = None` means the diagonal pairs (i, i) of all examples, without copies.
    """
    out = []
    tokens_x, tokens_y = right_x.shape[1], right_y.shape[1]
    count = right_x.shape[0] if first is None else len(first)
    for chunk in _chunks(count, 2 * tokens_x * tokens_y):
        i, j = (chunk, chunk) if first is None else (first[chunk], second[chunk])
        right_gram = torch.bmm(right_x[i], right_y[j].transpose(1, 2))  # (pairs, Nx, Ny)
        left_gram = _left_gram(left_x[i], left_y[j], dtype)  # (pairs, Nx, Ny)
        out.append((left_gram * right_gram).sum(dim=(1, 2)))
    return torch.cat(out) if out else right_x.new_zeros(0)


def _ghost_norm_sq(left: Tensor, right: Tensor, units: UnitIndex) -> Tensor:
    """Σ_{t,s∈u} (l_t·l_s)(r_t·r_s) per unit from per-example factors `(B, N, ·)`."""
    if units.identity:  # one example per unit: each unit is a diagonal pair
        return _pair_inner(left, right, left, right, None, None, left.dtype)
    first, second, pair_units = units.pairs()
    inner = _pair_inner(left, right, left, right, first, second, left.dtype)
    inner = torch.where(first == second, inner, 2 * inner)  # i < j stands for (i, j) and (j, i)
    return inner.new_zeros(units.num_units).index_add_(0, pair_units, inner)


def _materialized(left: Tensor, right: Tensor, units: UnitIndex, keep: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-unit gradients Σ_{t∈u} l_t r_tᵀ: their squared norms, and themselves if `keep`."""
    rows, cols = left.shape[-1], right.shape[-1]
    norms, kept = [], []
    ends = torch.cumsum(units.counts, 0).tolist()
    starts = [0] + ends[:-1]
    most_examples = int(units.counts.max()) if units.num_units else 1
    for chunk in _chunks(units.num_units, rows * cols * most_examples):
        if units.identity:  # unit u is example u: slice, no copy
            examples = chunk
        else:  # this chunk's units' examples, contiguous in `order`
            examples = units.order[starts[chunk.start] : ends[chunk.stop - 1]]
        example_grads = torch.bmm(left[examples].transpose(1, 2), right[examples])  # (b, rows, cols)
        if units.identity:
            unit_grads = example_grads
        else:
            unit_grads = example_grads.new_zeros((chunk.stop - chunk.start, rows, cols))
            unit_grads.index_add_(0, units.inverse[examples] - chunk.start, example_grads)
        norms.append(unit_grads.pow(2).sum(dim=(1, 2)))
        if keep:
            kept.append(unit_grads)
    norm_sq = torch.cat(norms) if norms else left.new_zeros(0)
    return norm_sq, (torch.cat(kept) if keep else None)


def _indexed_norm_sq(term: OuterGrad, units: UnitIndex, rows: int, dtype: torch.dtype) -> Tensor:
    """Σ_v ‖Σ_{t∈u: id_t=v} r_t‖² per unit (embedding rows touched by the unit)."""
    token_ids = term.left  # (B, N)
    right = term.right.to(dtype)  # (B, N, cols)
    token_units = units.inverse[:, None].expand_as(token_ids)  # (B, N)
    keys = (token_units * rows + token_ids).reshape(-1)
    unique_keys, key_index = torch.unique(keys, return_inverse=True)
    row_sums = right.new_zeros(unique_keys.numel(), right.shape[-1])
    row_sums.index_add_(0, key_index, right.reshape(-1, right.shape[-1]))  # (K, cols)
    norm_sq = right.new_zeros(units.num_units)
    return norm_sq.index_add_(0, torch.div(unique_keys, rows, rounding_mode="floor"), row_sums.pow(2).sum(1))


def _left_gram(left_x: Tensor, left_y: Tensor, dtype: torch.dtype) -> Tensor:
    """(l_x,t · l_y,s) for every token pair: `(n, Nx, My)`; dense or row-index factors."""
    x_indexed, y_indexed = not torch.is_floating_point(left_x), not torch.is_floating_point(left_y)
    if not x_indexed and not y_indexed:
        return torch.bmm(left_x, left_y.transpose(1, 2))
    if x_indexed and y_indexed:
        return (left_x[:, :, None] == left_y[:, None, :]).to(dtype)
    if x_indexed:  # one-hot row id_t against dense l_s: l_s[id_t]
        pairs, tokens_x = left_x.shape
        picked = torch.gather(left_y, 2, left_x[:, None, :].expand(pairs, left_y.shape[1], tokens_x))
        return picked.transpose(1, 2)  # (n, Nx, Ny)
    return _left_gram(left_y, left_x, dtype).transpose(1, 2)


def _cross_inner(x: OuterGrad, y: OuterGrad, units: UnitIndex, dtype: torch.dtype) -> Tensor:
    """⟨G_x,u, G_y,u⟩ per unit for two terms of one parameter (ghost form)."""
    left_x = x.left if x.indexed else x.left.to(dtype)
    left_y = y.left if y.indexed else y.left.to(dtype)
    if units.identity:
        return _pair_inner(left_x, x.right.to(dtype), left_y, y.right.to(dtype), None, None, dtype)
    first, second, pair_units = units.pairs(ordered=True)
    inner = _pair_inner(left_x, x.right.to(dtype), left_y, y.right.to(dtype), first, second, dtype)
    return inner.new_zeros(units.num_units).index_add_(0, pair_units, inner)


# ---------------------------------------------------------------------------------------
# Clipped sums by book-keeping


def _bookkeeping_sum(term: OuterGrad, example_weights: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Σ_i w_i Σ_n left_{i,n} ⊗ right_{i,n}, one product over all tokens."""
    cols = term.right.shape[-1]
    weights = example_weights.to(dtype)[:, None, None]
    if term.indexed:
        out = torch.zeros(shape, dtype=dtype, device=term.right.device)
        weighted = (term.right.to(dtype) * weights).reshape(-1, cols)
        return out.index_add_(0, term.left.reshape(-1), weighted)
    rows = term.left.shape[-1]
    left, right = term.left.to(dtype), term.right.to(dtype)
    if rows <= cols:
        left = left * weights
    else:
        right = right * weights
    return left.reshape(-1, rows).t() @ right.reshape(-1, cols)


def _weighted_unit_sum(unit_grads: Tensor) -> Reducer:
    def reduce(unit_weights: Tensor) -> Tensor:
        return torch.tensordot(unit_weights.to(unit_grads.dtype), unit_grads, dims=1)

    return reduce


# ---------------------------------------------------------------------------------------
# One parameter: all its terms -> per-unit squared norm + reducer


def _outer_self_norm_sq(
    term: OuterGrad, units: UnitIndex, strategy: str, shape, dtype, allow_keep: bool = True
) -> Tuple[Tensor, Reducer]:
    if term.indexed:
        norm_sq = _indexed_norm_sq(term, units, shape[0], dtype)
        return norm_sq, lambda w: _bookkeeping_sum(term, units.example_weights(w), shape, dtype)
    method, keep = choose_strategy(strategy, term, units)
    keep = keep and allow_keep
    left, right = term.left.to(dtype), term.right.to(dtype)
    if method == "ghost":
        norm_sq = _ghost_norm_sq(left, right, units)
    else:
        norm_sq, unit_grads = _materialized(left, right, units, keep)
        if keep:
            return norm_sq, _weighted_unit_sum(unit_grads)
    return norm_sq, lambda w: _bookkeeping_sum(term, units.example_weights(w), shape, dtype)


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
        unit_grads = sum(units.sum_examples(term.grads.to(dtype)) for term in terms)  # (U, *shape)
        return unit_grads.pow(2).reshape(units.num_units, -1).sum(1), _weighted_unit_sum(unit_grads)
    if len(terms) == 1:
        return _outer_self_norm_sq(terms[0], units, strategy, shape, dtype)
    # Shared parameter: exact norm with every cross term, sums by book-keeping.
    norm_sq = sum(_outer_self_norm_sq(term, units, strategy, shape, dtype, allow_keep=False)[0] for term in terms)
    for first in range(len(terms)):
        for second in range(first + 1, len(terms)):
            norm_sq = norm_sq + 2 * _cross_inner(terms[first], terms[second], units, dtype)

    def reduce(unit_weights: Tensor) -> Tensor:
        example_weights = units.example_weights(unit_weights)
        return sum(_bookkeeping_sum(term, example_weights, shape, dtype) for term in terms)

    return norm_sq, reduce


def _term_dtype(term: GradTerm) -> torch.dtype:
    return term.grads.dtype if isinstance(term, ExampleGrad) else term.right.dtype


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
