"""Per-example losses: the clipping engine needs one loss per example, not the batch mean."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

_CAUSAL_LM_CLASSES = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def is_causal_lm(model) -> bool:
    """Whether the model's labels are shifted next-token targets (peft wrappers unwrapped)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__ in _CAUSAL_LM_CLASSES or type(base).__name__.endswith("ForCausalLM")


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor, *, causal_lm: bool) -> torch.Tensor:
    """Loss of each example, shape (B,), in float32.

    Sequence classification: cross-entropy (regression: squared error when one output).
    Token-level heads: mean cross-entropy over the example's labelled tokens (-100 ignored), after the
    next-token shift for causal LMs. An example with no labelled token has loss 0.
    """
    if logits.dim() == 2:
        if logits.shape[-1] == 1 and labels.is_floating_point():
            return (logits.squeeze(-1).float() - labels.float()) ** 2
        return F.cross_entropy(logits.float(), labels, reduction="none")
    if causal_lm:
        logits, labels = logits[:, :-1], labels[:, 1:]
    token_loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view(labels.shape)  # (B, T)
    counts = (labels != -100).sum(dim=1)
    return token_loss.sum(dim=1) / counts.clamp(min=1)
