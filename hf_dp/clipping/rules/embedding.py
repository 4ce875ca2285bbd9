"""Rule for `nn.Embedding` (token, position and token-type embeddings).

For one example with token ids ``id_t`` and output gradients ``g_t``:
``∇W = Σ_t e_{id_t} g_tᵀ`` (row ``id_t`` receives ``g_t``), so per unit
``‖∇W‖² = Σ_v ‖Σ_{t: id_t = v} g_t‖²``, computed from the rows the unit touches
(``= Σ_{t,s: id_t = id_s} g_t·g_s``), never a vocabulary-sized matrix per unit.
Rows at `padding_idx` get no gradient, as in `nn.Embedding`'s own backward.

Position ids built as a broadcast `(1, T)` tensor are expanded to the batch by the
engine at capture time, so each row's gradient stays attributed to its own example.
Subclasses that override `forward` (Gemma's token embedding scaled by sqrt(d), BART's
and OPT's learned positions, which compute their own ids) are captured at their
`F.embedding(ids, self.weight)` call: the rule sees the ids actually looked up and the
gradient of the lookup itself, before any scaling.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from ..registry import register_rule
from ..terms import OUTER, GradTerm, OuterGrad


def _check_embedding(layer: nn.Embedding) -> Optional[str]:
    if layer.max_norm is not None:
        return "max_norm renormalises rows in the forward pass"
    if layer.scale_grad_by_freq:
        return "scale_grad_by_freq couples the examples of a batch"
    if layer.sparse:
        return "sparse gradients are not supported"
    return None


@register_rule(
    nn.Embedding, name="embedding", params={"weight": OUTER}, validate=_check_embedding, function=F.embedding
)
def embedding_rule(layer: nn.Embedding, token_ids: Tensor, output_grads: Tensor) -> Dict[str, GradTerm]:
    """`nn.Embedding`: ∇W = Σ_t e_{id_t} g_tᵀ, an indexed outer product."""
    batch_size = output_grads.shape[0]
    token_ids = token_ids.expand((batch_size,) + token_ids.shape[1:]).reshape(batch_size, -1)  # (B, N)
    output_grads = output_grads.reshape(batch_size, -1, output_grads.shape[-1])  # (B, N, dim)
    if layer.padding_idx is not None:
        output_grads = output_grads * (token_ids != layer.padding_idx).unsqueeze(-1).to(output_grads.dtype)
    return {"weight": OuterGrad(left=token_ids, right=output_grads)}
