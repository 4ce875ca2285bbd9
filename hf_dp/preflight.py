"""What the user hands a DP trainer, checked before step 1: each refusal is one line naming what to change.

The trainer class (a `training_step` override that would bypass the DP step), `output_dir` (writable), the user
column (not a column the model reads), the token ids (none empty, none beyond the model's vocabulary: read from the
Arrow column, not row by row) and `privacy_card_kwargs` (fields the card has). Each only decides whether to train:
nothing is released.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import tempfile

import numpy as np

from .user_column import table_column

# Columns the model or its loss read: a user id there would be removed before the model sees the rows.
MODEL_COLUMNS = ("input_ids", "labels", "label", "label_ids", "attention_mask", "token_type_ids", "position_ids")
_CALLS_SUPER_STEP = re.compile(r"super\([^)]*\)\s*\.\s*training_step\s*\(")


def check_given(trainer_class: type, mixin: type, args, model, card_kwargs: dict | None) -> dict:
    """The checks that need no data and no built trainer (the class, the user column's name, `output_dir`, the card
    fields); returns `card_kwargs` as a dict."""
    check_step_override(trainer_class, mixin)
    check_user_column_not_read_by_model(args.user_id_column, model)
    if args.should_save:  # Trainer makes it at construction, and writes there at every save
        check_output_dir(args.output_dir)
    return check_card_kwargs(card_kwargs)


def check_step_override(trainer_class: type, mixin: type) -> None:
    """Refuse a `training_step` override that does not hand the step's batch to `super().training_step`.

    The DP step receives a [`~hf_dp.batching.LogicalBatch`] (the step's Poisson sample, in micro-batches), not a
    dict of tensors, and clips, noises and records it as one: an override may wrap `super().training_step(model,
    inputs, num_items_in_batch)` (to time or log around it) but must pass the batch on unchanged.

    Raises:
        ValueError: an override whose source does not call `super().training_step(...)`, or cannot be read.
    """
    for cls in trainer_class.__mro__:
        if cls is mixin:
            return
        step = vars(cls).get("training_step")
        if step is None:
            continue
        try:
            calls_super = bool(_CALLS_SUPER_STEP.search(inspect.getsource(step)))
        except (OSError, TypeError):
            calls_super = False
        if not calls_super:
            raise ValueError(
                f"{cls.__name__} overrides training_step without calling super().training_step(model, inputs, "
                "num_items_in_batch): in DP training each step receives a LogicalBatch (the step's Poisson sample, "
                "in micro-batches) that DPTrainer clips, noises and records as one; call super().training_step "
                "with it unchanged, or change the loss with compute_loss_func and the rows with data_collator.")


def check_output_dir(output_dir: str) -> None:
    """Refuse an `output_dir` that is a file, or inside which (or, not yet made, beside which) nothing can be
    written: Trainer would fail on it at construction or at the first save, after ε was spent."""
    path = os.path.abspath(output_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"output_dir={output_dir!r} is a file, not a folder: checkpoints, the ledger and the "
                         "privacy card are written into it; choose another --output_dir.")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"output_dir={output_dir!r} lies under {existing!r}, which is a file: choose another "
                         "--output_dir.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ValueError(f"output_dir={output_dir!r}: nothing can be written in {existing!r} ({reason}): "
                         "checkpoints, the ledger and the privacy card go there; choose a writable --output_dir.") \
            from None


def check_user_column_not_read_by_model(user_id_column: str, model) -> None:
    """Refuse a user column the model reads (`labels`, `input_ids`, a `forward` argument): DP training removes the
    user column from the rows before they reach the model."""
    forward = getattr(model, "forward", None)
    try:
        arguments = set(inspect.signature(forward).parameters) if forward is not None else set()
    except (TypeError, ValueError):
        arguments = set()
    if user_id_column in MODEL_COLUMNS or user_id_column in arguments - {"kwargs", "args"}:
        raise ValueError(f"user_id_column={user_id_column!r} names a column the model reads: DP training removes the "
                         "user column before the rows reach the model; keep the user ids in a column of their own "
                         "(e.g. 'user_id') and set user_id_column to it.")


def check_mixed_precision(accelerator) -> None:
    """fp16 reached through accelerate (`mixed_precision: fp16` in an `accelerate launch` config, or
    `ACCELERATE_MIXED_PRECISION=fp16`) rather than `fp16=True`, which the arguments refuse: the same refusal."""
    if str(getattr(accelerator, "mixed_precision", "no")) == "fp16":
        raise ValueError("mixed_precision is fp16 (from the accelerate config or ACCELERATE_MIXED_PRECISION): fp16 "
                         "training scales the loss (GradScaler), which the per-unit clipping and noise do not go "
                         "through; set mixed_precision: bf16 (or no) in the accelerate config, or pass --bf16.")


def check_input_ids(dataset, model) -> None:
    """Refuse training rows with no token, and token ids outside the model's input embedding (an `IndexError` at
    some later step otherwise). Reads the `input_ids` column through Arrow: the lengths and the extreme ids only."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if "input_ids" not in (getattr(dataset, "column_names", None) or []) or len(dataset) == 0:
        return
    read = table_column(dataset, "input_ids")  # a selection's rows taken in Arrow, not gathered row by row
    if read is None:
        column = dataset.with_format("arrow")[:]["input_ids"]
    else:
        column = read[0] if read[1] is None else read[0].take(read[1])
    if not pa.types.is_list(column.type) and not pa.types.is_large_list(column.type):
        return
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        every = "every row" if empty.size == len(lengths) else f"{empty.size} of the {len(lengths)} rows"
        raise ValueError(f"input_ids is empty in {every} of the training data (e.g. row {empty[0]}): a row needs at "
                         "least one token; check the tokenization (the text column it read), or drop such rows "
                         "(dataset.filter(lambda row: len(row['input_ids']) > 0)).")
    tokens = pc.list_flatten(column)
    while pa.types.is_list(tokens.type) or pa.types.is_large_list(tokens.type):
        tokens = pc.list_flatten(tokens)
    if not pa.types.is_integer(tokens.type):
        return
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    vocabulary = getattr(embeddings, "num_embeddings", None)
    extremes = pc.min_max(tokens)
    low, high = extremes["min"].as_py(), extremes["max"].as_py()
    if low is not None and low < 0:
        raise ValueError(f"input_ids holds a negative token id ({low}): token ids index the model's vocabulary; "
                         "check the tokenization (pad with the tokenizer's pad_token_id, mask with attention_mask).")
    if vocabulary is not None and high is not None and high >= vocabulary:
        raise ValueError(f"input_ids holds token id {high}, beyond the model's vocabulary of {vocabulary} embeddings "
                         f"(ids 0..{vocabulary - 1}): tokenize with the model's own tokenizer, or, after adding "
                         "tokens, call model.resize_token_embeddings(len(tokenizer)).")


def check_card_kwargs(card_kwargs: dict | None) -> dict:
    """`privacy_card_kwargs` as a dict, each key a field of the privacy card (checked now, not after ε is spent
    when the card is written)."""
    from .card import render_privacy_card

    card_kwargs = dict(card_kwargs or {})
    accepted = [name for name, parameter in inspect.signature(render_privacy_card).parameters.items()
                if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = [key for key in card_kwargs if key not in accepted]
    if unknown:
        close = difflib.get_close_matches(unknown[0], accepted, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"privacy_card_kwargs has no field {unknown[0]!r}{hint}: the privacy card takes "
                         f"{', '.join(accepted)}.")
    return card_kwargs
