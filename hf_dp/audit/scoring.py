"""Canary scores: higher means "looks trained on".

Black box (`loss_scores`, from `per_row_losses`): a canary user's mean loss under the base (pre-fine-tuning)
model minus its mean loss under the trained model. Subtracting the base loss removes how easy the text is a
priori, so what is left is mostly what training on the canary did. `trained_loss_scores` is the trained loss alone
(negated): better where canaries are drawn alike (their base losses carry no membership signal) but vary more a
priori than training moves them, as rare-token replies do.

White box (`gradient_alignment_scores`): how far the training update θ_T − θ_0 went down the canary's own loss
gradient at the start, −<θ_T − θ_0, ∇L_i(θ_0)> / ‖∇L_i(θ_0)‖ over the trainable parameters. DP-SGD adds each
sampled unit's clipped gradient to the update, so an included canary pushes it along (roughly) ∇L_i(θ_0); the
noise's projection on a unit vector has the same spread for every canary, which is why the gradient is
normalised. It needs the initial trainable parameters and one backward pass per canary: cheap for LoRA and
small models.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = ["SCORES", "gradient_alignment_scores", "loss_scores", "per_row_losses", "row_losses", "trainable_parameters",
           "trained_loss_scores"]

SCORES = ("auto", "white-box", "black-box", "trained-loss")  # what an audit may score canaries with ("auto": black box)


def loss_scores(trained_losses: Sequence[Sequence[float]], base_losses: Sequence[Sequence[float]]) -> np.ndarray:
    """Per-canary score: mean base loss minus mean trained loss over the canary's rows.

    Args:
        trained_losses: trained_losses[i] holds the per-row losses of canary i under the trained
            model (canaries may have different numbers of rows).
        base_losses: The same rows' losses under the base model.

    Returns:
        Array of m scores.

    Raises:
        ValueError: If the two disagree in canaries or rows, a canary has no rows, or a loss is
            not finite.
    """
    if len(trained_losses) != len(base_losses):
        raise ValueError(
            f"trained_losses and base_losses must have one entry per canary (got {len(trained_losses)} and "
            f"{len(base_losses)}); score the same canaries under both models."
        )
    for i, (trained, base) in enumerate(zip(trained_losses, base_losses)):
        rows, base_rows = np.size(trained), np.size(base)
        if rows != base_rows or rows == 0:
            raise ValueError(
                f"canary {i} has {rows} trained and {base_rows} base losses; pass the same, non-empty rows.")
    return _mean_losses(base_losses) - _mean_losses(trained_losses)


def trained_loss_scores(trained_losses: Sequence[Sequence[float]]) -> np.ndarray:
    """Per-canary score: minus the mean trained loss over the canary's rows (lower loss = "looks trained on").

    Args:
        trained_losses: trained_losses[i] holds the per-row losses of canary i under the trained model.

    Returns:
        Array of m scores.

    Raises:
        ValueError: If a canary has no rows or a loss is not finite.
    """
    return -_mean_losses(trained_losses)


def _mean_losses(losses: Sequence[Sequence[float]]) -> np.ndarray:
    """Each canary's mean loss over its rows; a canary with no rows or a non-finite loss is an error."""
    means = np.empty(len(losses))
    for i, rows in enumerate(losses):
        rows = np.asarray(rows, dtype=float).reshape(-1)
        if len(rows) == 0:
            raise ValueError(f"canary {i} has no rows; every canary needs at least one.")
        if not np.all(np.isfinite(rows)):
            raise ValueError(f"canary {i} has a non-finite loss; check the model and the rows' labels.")
        means[i] = rows.mean()
    return means


def per_row_losses(
    model: Any,
    rows_as_features: Sequence[dict],
    collator: Callable[[list[dict]], dict],
    batch_size: int = 16,
) -> np.ndarray:
    """Loss of each row under a sequence-classification or causal-LM model.

    Computed from the logits, not `outputs.loss` (which averages over the batch): cross-entropy
    against the row's label for 2-D logits; for 3-D logits (causal LM), the mean cross-entropy of
    next-token predictions over the row's label positions that are not -100.

    Args:
        model: A transformers model (or any module returning an object with `.logits`).
        rows_as_features: Tokenized rows (dicts the collator accepts), each with labels.
        collator: Turns a list of rows into a batch of tensors including "labels" (e.g.
            `DataCollatorWithPadding` or `DataCollatorForLanguageModeling(mlm=False)`).
        batch_size: Rows per forward pass.

    Returns:
        float64 array, one loss per row.

    Raises:
        ValueError: If a batch has no labels, a row has no label tokens, or logits have an
            unexpected shape.
    """
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (got {batch_size}).")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    losses: list[np.ndarray] = []
    try:
        with torch.no_grad():
            for start in range(0, len(rows_as_features), batch_size):
                batch = collator(list(rows_as_features[start : start + batch_size]))
                if "labels" not in batch:
                    raise ValueError("the collator's batch has no 'labels'; use a collator that sets them.")
                batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
                labels = batch.pop("labels")
                row_loss = row_losses(model(**batch).logits, labels)
                losses.append(row_loss.double().cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(losses) if losses else np.empty(0)


def row_losses(logits, labels):
    """Loss of each row from a batch's logits, differentiable, in float32 or wider (see `per_row_losses`).

    Args:
        logits: `(B, K)` classification logits, or `(B, T, V)` causal-LM logits.
        labels: `(B,)` class indices, or `(B, T)` token labels (-100 ignored; shifted by one for the next token).

    Returns:
        `(B,)` tensor of losses.

    Raises:
        ValueError: If a row has no label tokens or the logits have an unexpected shape.
    """
    import torch
    import torch.nn.functional as F

    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if logits.dim() == 2:
        return F.cross_entropy(logits, labels.view(-1), reduction="none")
    if logits.dim() == 3:
        shifted, targets = logits[:, :-1], labels[:, 1:]
        token_loss = F.cross_entropy(
            shifted.reshape(-1, shifted.size(-1)), targets.reshape(-1), ignore_index=-100, reduction="none"
        ).view(targets.shape)
        counts = (targets != -100).sum(dim=1)
        if bool((counts == 0).any()):
            raise ValueError("a row has no label tokens (all -100 after the shift); drop empty rows.")
        return token_loss.sum(dim=1) / counts
    raise ValueError(f"logits of shape {tuple(logits.shape)} are neither classification nor causal LM.")


def trainable_parameters(model: Any) -> dict:
    """The parameters training updates, by name (`requires_grad`)."""
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


def gradient_alignment_scores(
    model: Any,
    initial_parameters: Mapping[str, Any],
    canary_rows: Sequence[Sequence[dict]],
    collator: Callable[[list[dict]], dict],
    *,
    progress: bool = False,
) -> np.ndarray:
    """White-box score of each canary: −<θ_T − θ_0, ∇L_i(θ_0)> / ‖∇L_i(θ_0)‖ over the trainable parameters.

    θ_T is the model's current (trained) trainable parameters, θ_0 `initial_parameters`, L_i the mean loss of
    canary i's rows (the user's loss, as ULS trains on). The model is set to θ_0 for the gradients (eval mode,
    no dropout) and restored to θ_T afterwards, also on error. A canary whose gradient vanishes scores 0.

    Args:
        model: The trained model (a transformers model or any module returning `.logits`).
        initial_parameters: name -> tensor, the trainable parameters before training (`snapshot` them with
            `{n: p.detach().clone() for n, p in trainable_parameters(model).items()}`).
        canary_rows: canary_rows[i] holds the tokenized rows of canary i (dicts the collator accepts, with labels).
        collator: Turns a list of rows into a batch of tensors including "labels".
        progress: Show a progress bar.

    Returns:
        float64 array, one score per canary.

    Raises:
        ValueError: If the trainable parameters are not those of `initial_parameters`, a canary has no rows,
            or a batch has no labels.
    """
    import torch

    params = trainable_parameters(model)
    if set(params) != set(initial_parameters):
        missing = sorted(set(params) ^ set(initial_parameters))[:3]
        raise ValueError(
            f"the model's trainable parameters differ from initial_parameters (e.g. {missing}); snapshot them "
            "from the same model before training."
        )
    names = list(params)
    device = next(model.parameters()).device
    was_training = model.training
    with torch.no_grad():
        trained = {name: params[name].detach().clone() for name in names}
        update = {name: (trained[name] - initial_parameters[name].to(trained[name])).float() for name in names}
        for name in names:
            params[name].copy_(initial_parameters[name])
    scores = np.empty(len(canary_rows))
    iterator = range(len(canary_rows))
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc="Canary gradients", unit="canary", leave=False)
    model.eval()
    try:
        for i in iterator:
            rows = list(canary_rows[i])
            if not rows:
                raise ValueError(f"canary {i} has no rows; every canary needs at least one.")
            batch = collator(rows)
            if "labels" not in batch:
                raise ValueError("the collator's batch has no 'labels'; use a collator that sets them.")
            batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
            labels = batch.pop("labels")
            loss = row_losses(model(**batch).logits, labels).mean()
            grads = torch.autograd.grad(loss, [params[name] for name in names], allow_unused=True)
            dot = torch.zeros((), dtype=torch.float64, device=device)
            norm_sq = torch.zeros((), dtype=torch.float64, device=device)
            for name, grad in zip(names, grads):
                if grad is not None:
                    grad = grad.float()
                    dot += (grad * update[name]).sum().double()
                    norm_sq += grad.pow(2).sum().double()
            scores[i] = 0.0 if float(norm_sq) == 0.0 else float(-dot / norm_sq.sqrt())
    finally:
        with torch.no_grad():
            for name in names:
                params[name].copy_(trained[name])
        model.train(was_training)
    return scores
