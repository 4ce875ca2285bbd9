"""T5-style relative attention bias: one table lookup shared by every example of the batch.

T5's first self-attention layer (and its copies in mT5, ...) looks up
``bias = E[bucket(k - q)]`` (`(Tq, Tk, heads)`, no batch dimension), turns it into a
`(1, heads, Tq, Tk)` tensor, and every layer adds it to its attention scores by
broadcasting. Autograd sums the gradient over the batch at that broadcast, so the
embedding `E`'s per-example gradients would be lost. The clipper therefore computes the
bias itself, expands it to `(B, heads, Tq, Tk)` (same values) and hands it to the
attention as its `position_bias` argument, which T5 then passes on to the later layers.
The gradient of the expanded tensor holds each example's own gradient; moved back to
the lookup's `(Tq, Tk, heads)` layout it is what the embedding rule needs:
``∇E = Σ_{q,k} e_{bucket(q,k)} ⊗ G[:, q, k]`` per example.

Before using the expanded bias the clipper checks that it equals the embedding rows of
the captured buckets in that layout; when it does not (another model's variant), or the
layer is attending over cached tokens, nothing is changed and the shared lookup is
refused on the first backward, naming the module.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor, nn


def is_relative_bias_attention(module: nn.Module) -> bool:
    """A T5-style attention layer that owns a relative position bias table."""
    if getattr(module, "has_relative_attention_bias", False) is not True:
        return False
    if not isinstance(getattr(module, "relative_attention_bias", None), nn.Embedding):
        return False
    if not callable(getattr(module, "compute_bias", None)):
        return False
    try:
        return "position_bias" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def self_attention_queries(args: tuple, kwargs: dict) -> Optional[Tensor]:
    """The query input `(B, T, d)` of a self-attention call with no bias given and no cached tokens, else `None`."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, Tensor) or hidden.dim() != 3 or len(args) > 2:
        return None  # key_value_states or position_bias passed positionally: leave the call alone
    if kwargs.get("key_value_states") is not None or kwargs.get("position_bias") is not None:
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None:
        get_length = getattr(cache, "get_seq_length", None)
        if not callable(get_length) or int(get_length()) > 0:
            return None
    return hidden


def matches_lookup(bias: Tensor, table: Tensor, buckets: Tensor) -> bool:
    """Whether `bias` `(1, heads, Tq, Tk)` is `table[buckets]` `(Tq, Tk, heads)` moved to that layout."""
    if bias.dim() != 4 or bias.shape[0] != 1 or buckets.dim() != 2:
        return False
    with torch.no_grad():
        expected = table[buckets].permute(2, 0, 1)  # (heads, Tq, Tk)
        return bias.shape[1:] == expected.shape and torch.equal(bias[0], expected.to(bias.dtype))


def bias_to_lookup_layout(output_grads: Tensor) -> Tensor:
    """`(B, heads, Tq, Tk)` gradient of the expanded bias -> `(B, Tq, Tk, heads)`, the lookup's layout."""
    return output_grads.permute(0, 2, 3, 1)


def expand_to_batch(bias: Tensor, batch_size: int) -> Tensor:
    """`(1, heads, Tq, Tk)` -> `(B, heads, Tq, Tk)`: a view with the same values, one gradient row per example."""
    return bias.expand((batch_size,) + tuple(bias.shape[1:]))
