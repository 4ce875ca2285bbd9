"""Truncation that keeps the reply: a chat row longer than `max_length` loses the start of its context, not its reply.

TRL's `SFTTrainer` keeps the start of a long row (`truncation_mode="keep_start"`), which cuts the reply a long
prompt was there for and then drops the row for having no labelled token left; its `"keep_end"` is deprecated and
cuts the reply's start when the reply alone is too long. `truncation_mode="keep_reply"` (DPSFTConfig's default)
cuts from the start only as far as the first labelled token allows, keeping one token of context before it to
predict that token from, and cuts the reply's end only when the reply alone is longer than `max_length`.

Each row is cut from its own tokens alone: no row's cut depends on another row or user.
"""

from __future__ import annotations

import logging

__all__ = ["KEEP_REPLY", "TRUNCATION_MODES", "ReplyKeepingMixin", "keep_reply", "reply_window"]

KEEP_REPLY = "keep_reply"
TRUNCATION_MODES = (KEEP_REPLY, "keep_start", "keep_end")
IGNORE_INDEX = -100

logger = logging.getLogger(__name__)


def reply_window(labels: list, max_length: int) -> slice:
    """The tokens a row keeps: its context's start goes first (up to one token before the first labelled one), then,
    if the row is still too long, its end."""
    excess = len(labels) - max_length
    if excess <= 0:
        return slice(0, len(labels))
    first = next((index for index, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    start = min(excess, max(first - 1, 0))
    return slice(start, start + max_length)


def keep_reply(input_ids: list, labels: list, max_length: int) -> tuple[list, list]:
    """(`input_ids`, `labels`) cut to `max_length` by [`reply_window`].

    >>> keep_reply([1, 2, 3, 4, 5, 6], [-100, -100, -100, -100, 5, 6], 4)
    ([3, 4, 5, 6], [-100, -100, 5, 6])
    >>> keep_reply([1, 2, 3, 4, 5, 6], [-100, -100, 3, 4, 5, 6], 3)  # the reply alone is too long: its end goes
    ([2, 3, 4], [-100, 3, 4])
    """
    window = reply_window(labels, max_length)
    return input_ids[window], labels[window]


def _cut_row(row: dict, max_length: int) -> dict:
    """[`reply_window`] on a prepared row's token columns (`input_ids`, `labels` and any other of their length)."""
    window, length = reply_window(row["labels"], max_length), len(row["input_ids"])
    return {name: value[window] for name, value in row.items() if isinstance(value, list) and len(value) == length}


class ReplyKeepingMixin:
    """For an `SFTTrainer` subclass: with `truncation_mode="keep_reply"`, TRL prepares the rows untruncated and each
    row is then cut by [`keep_reply`]; the number of rows cut is said once per dataset on the console (a local
    message to whoever holds the data: it is written to no log, model or card)."""

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        max_length = args.max_length
        if (getattr(args, "truncation_mode", None) != KEEP_REPLY or max_length is None or packing
                or getattr(args, "dataset_kwargs", None) and args.dataset_kwargs.get("skip_prepare_dataset")):
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        args.max_length = None  # TRL's own truncation is skipped; the rows are cut below instead
        try:
            prepared = super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func,
                                                dataset_name)
        finally:
            args.max_length = max_length
        if not hasattr(prepared, "column_names") or "labels" not in (prepared.column_names or ()):
            return prepared  # an iterable dataset or rows without labels: left to the collator, as TRL leaves them
        longer = sum(length > max_length for length in map(len, prepared["input_ids"]))
        if longer:
            logger.warning("%d of the %d %s rows were longer than max_length=%d: each kept its reply and lost the "
                           "start of its context (truncation_mode='keep_reply').", longer, len(prepared),
                           dataset_name, max_length)
            prepared = prepared.map(_cut_row, fn_kwargs={"max_length": max_length},
                                    desc=f"Keeping the replies of {dataset_name} rows")
            prepared = prepared.filter(lambda labels: any(label != IGNORE_INDEX for label in labels[1:]),
                                       input_columns="labels")
        return prepared
