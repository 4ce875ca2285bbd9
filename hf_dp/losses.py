"""Per-example losses: the clipping engine needs one loss per example, not the batch mean."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .clipping.packing import examples_from_position_ids

def per_example_loss(logits: torch.Tensor, labels: torch.Tensor, *, causal_lm: bool) -> torch.Tensor:
    """Loss of each example, shape (B,), in float32.

    Sequence classification: cross-entropy; a one-output head is a regression head (transformers' `problem_type`
    rule for `num_labels=1`): squared error, whatever the labels' dtype (integer targets included).
    Token-level heads: mean cross-entropy over the example's labelled tokens (-100 ignored), after the
    next-token shift for causal LMs. An example with no labelled token has loss 0.
    """
    if logits.dim() == 2:
        if logits.shape[-1] == 1:
            return (logits.squeeze(-1).float() - labels.float().reshape(logits.shape[0])) ** 2
        return F.cross_entropy(logits.float(), labels, reduction="none")
    if causal_lm:
        logits, labels = logits[:, :-1], labels[:, 1:]
    token_loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view(labels.shape)  # (B, T)
    counts = (labels != -100).sum(dim=1)
    return token_loss.sum(dim=1) / counts.clamp(min=1)


def packed_per_example_loss(logits: torch.Tensor, labels: torch.Tensor, example_ids: torch.Tensor, num_examples: int,
                            *, causal_lm: bool) -> torch.Tensor:
    """Loss of each example of packed rows (several examples concatenated in a row), shape (S,), in float32.

    `example_ids` `(rows, T)` gives the example of each token (-1: none), as from
    [`~hf_dp.clipping.packing.examples_from_position_ids`]. As [`per_example_loss`] for token-level heads: the mean
    cross-entropy over the example's labelled tokens; for causal LMs the next-token shift stays inside each example
    (a token never predicts the first token of the next one, whatever its label). An example with no labelled token
    has loss 0.
    """
    if logits.dim() != 3:
        raise ValueError(f"packed rows need token-level logits (rows, T, vocab), got shape {tuple(logits.shape)}: a "
                         "head that pools each row into one prediction cannot be split into the packed examples.")
    owners = example_ids
    if causal_lm:
        logits, labels = logits[:, :-1], labels[:, 1:]
        owners = example_ids[:, 1:].masked_fill(example_ids[:, 1:] != example_ids[:, :-1], -1)
    owners = owners.masked_fill(labels == -100, -1)
    # Fixed shapes (no boolean indexing, nothing read back): tokens of no example go to an extra slot, dropped.
    owners = torch.where(owners >= 0, owners, num_examples).reshape(-1)
    token_loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                 ignore_index=-100, reduction="none")  # (rows·T,), 0 where ignored
    sums = token_loss.new_zeros(num_examples + 1).index_add_(0, owners, token_loss)[:num_examples]
    counts = token_loss.new_zeros(num_examples + 1).index_add_(0, owners, torch.ones_like(token_loss))[:num_examples]
    return sums / counts.clamp(min=1)


def packed_example_ids(features: dict) -> torch.Tensor | None:
    """For packed rows, the example of each token (`(rows, T)`, see
    [`~hf_dp.clipping.packing.examples_from_position_ids`]); `None` for one example per row.

    Rows are packed when `position_ids` restart inside a row (DataCollatorWithFlattening: one row, no
    attention mask). With an attention mask transformers would let a row's examples attend to each other: refused.
    Reads the collator's host tensors: no device sync.
    """
    position_ids = features.get("position_ids")
    if not torch.is_tensor(position_ids) or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return None
    mask = features.get("attention_mask")
    real = mask.bool() if torch.is_tensor(mask) and mask.shape == position_ids.shape else \
        torch.ones_like(position_ids, dtype=torch.bool)
    # Padding (left or right) may carry any position: only restarts between two real tokens count.
    restarts = (torch.diff(position_ids, dim=-1) != 1) & real[:, 1:] & real[:, :-1]
    if not restarts.cpu().numpy().any():
        return None
    if mask is not None:
        raise ValueError(
            "Packed rows (position_ids restart inside a row) with an attention_mask: transformers then lets the "
            "examples of a row attend to each other, so one example's gradient would depend on the others. Drop the "
            "attention_mask (DataCollatorWithFlattening returns none) or pad one example per row."
        )
    return examples_from_position_ids(position_ids)


def examples_lost(found: int, sampled: int) -> str:
    return (f"The data collator returned {found} examples for {sampled} sampled rows: a unit's rows must stay "
            "distinct examples to be clipped as sampled. DataCollatorWithFlattening drops rows with no tokens: "
            "filter them out of the training data.")


PACKED_NEEDS_TOKEN_HEAD = (
    "Packed (padding-free) batches, e.g. from DataCollatorWithFlattening, put several examples in one row and are "
    "supported for causal language models; {model} is not one: a sequence-classification head pools each row into "
    "one prediction, which cannot be split into the row's examples (DP needs per-example losses and gradients). "
    "Use a padding collator (DataCollatorWithPadding) for this model."
)

LOSS_FUNC_PACKED = (
    "compute_loss_func with packed rows (DataCollatorWithFlattening): its losses would be one per packed row, not one "
    "per example; use a padding collator with compute_loss_func, or drop compute_loss_func (the built-in loss "
    "splits packed rows into their examples)."
)
