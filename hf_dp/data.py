"""User grouping: check the user column, map users to rows, apply the contribution bound.

The user ids are taken out of the dataset here, so they never reach the model or the data
collator, and survive Trainer's `remove_unused_columns`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import numbers
from collections import Counter
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

@dataclass
class UserPartition:
    """Training rows grouped by user, after the contribution bound.

    Attributes:
        dataset: the training dataset without the user column (rows kept, in original order).
        row_user: `(num_rows,)` int array, the user index (0..num_users-1) of every kept row.
        user_rows: for each user index, the array of its row positions in `dataset`.
        contribution_bound: G applied (`None` if no bound was applied).
        redraw: with `redraw_rows`, each step's draw of G among a user's rows (`user_rows` then holds them all);
            `None` when the rows were drawn once, here.
    """

    dataset: object
    row_user: np.ndarray
    user_rows: list
    contribution_bound: int | None
    redraw: RowRedraw | None = None

    @property
    def num_users(self) -> int:
        return len(self.user_rows)

    @property
    def num_examples(self) -> int:
        return len(self.row_user)

    def rows_per_user(self) -> np.ndarray:
        return np.array([len(rows) for rows in self.user_rows])


@dataclass(frozen=True)
class RowRedraw:
    """A step's draw of at most `bound` of a user's rows, from (the user's key, the step) alone.

    The keys come from (secret, user id) like the rows drawn once ([`keyed_seed`]): a user's draws depend on no
    other user, and a resumed run redraws the same rows at the same step.
    """

    keys: np.ndarray  # (num_users,) uint64
    bound: int

    def rows(self, user: int, rows, step: int):
        """`rows` of user index `user` trained on at `step`: all of them if at most `bound`, else `bound` drawn."""
        if len(rows) <= self.bound:
            return rows
        rng = np.random.default_rng([int(self.keys[user]), int(step)])
        return np.sort(rng.choice(rows, size=self.bound, replace=False))

    def size(self, rows) -> int:
        """How many rows a step trains on of a user with `rows` (known without drawing)."""
        return min(len(rows), self.bound)


def examples_per_user(dataset, user_id_column: str) -> np.ndarray:
    """Rows per user (ignoring rows without a user id): what the contribution-bound heuristics read."""
    check_user_column(dataset, user_id_column)
    keys = _as_keys(dataset[user_id_column])
    _check_one_id_type(keys, user_id_column)
    counts = Counter(u for u in keys if u is not None)
    return np.array(sorted(counts.values()), dtype=np.int64)


def partition_by_user(dataset, user_id_column: str, contribution_bound: int | None, secret,
                      redraw_rows: bool = False) -> UserPartition:
    """Group rows by user and keep at most `contribution_bound` random rows per user, or with `redraw_rows` keep
    every row and draw the bound's rows afresh each step ([`RowRedraw`]).

    A user's rows are drawn from (`secret`, user id) alone ([`keyed_seed`]): adding or removing a user
    changes no other user's rows. Keep `secret` out of anything released (it picks the rows).

    Raises:
        TypeError: not a `datasets.Dataset` (a streamed `IterableDataset` included: materialise it first).
        ValueError: the column is missing, its ids mix types (3 and "3" would be two users), or no row with a user
            id remains.
    """
    check_user_column(dataset, user_id_column)
    ids = dataset[user_id_column]
    missing = sum(_is_missing(u) for u in ids)
    if missing:
        logger.warning("Dropping %d training rows without a %r value (None, NaN or an empty string): they are not "
                       "trained on, and not counted as users.", missing, user_id_column)
    keys = _as_keys(ids)
    _check_one_id_type(keys, user_id_column)
    rows_by_user: dict = {}
    for row, user in enumerate(keys):
        if user is not None:
            rows_by_user.setdefault(user, []).append(row)
    if not rows_by_user and len(keys) == 0:
        raise ValueError("The training dataset has no rows: DP training needs at least one user's rows.")
    if not rows_by_user:
        raise ValueError(
            f"No training row has a {user_id_column!r} value: DP training needs at least one user. "
            "Fill the user column or point --user_id_column at the right one."
        )
    redraw = None
    if redraw_rows and contribution_bound is not None:
        keys = np.array([keyed_seed(secret, user, "redrawn rows") for user in rows_by_user], dtype=np.uint64)
        redraw = RowRedraw(keys=keys, bound=int(contribution_bound))
    kept = [rows if redraw else _draw_rows(rows, contribution_bound, secret, user, "rows")
            for user, rows in rows_by_user.items()]
    keep = np.sort(np.concatenate([np.asarray(r, dtype=np.int64) for r in kept]))
    position = np.full(len(ids), -1, dtype=np.int64)
    position[keep] = np.arange(len(keep))
    row_user = np.empty(len(keep), dtype=np.int64)
    user_rows = []
    for user_index, rows in enumerate(kept):
        positions = position[np.asarray(rows, dtype=np.int64)]
        row_user[positions] = user_index
        user_rows.append(positions)
    dataset = dataset.remove_columns(user_id_column)
    if len(keep) < len(ids):
        dataset = dataset.select(keep.tolist())
    return UserPartition(dataset=dataset, row_user=row_user, user_rows=user_rows, contribution_bound=contribution_bound,
                         redraw=redraw)


def keyed_seed(secret, user_id, purpose: str) -> int:
    """A 64-bit number from (`secret`, `user_id`) alone: keyed BLAKE2b of the id's canonical JSON encoding.

    Per-user choices drawn from it (the rows a contribution bound keeps, a user's side of a split) do not
    depend on the other users, so neighbouring datasets treat every other user identically.

    Args:
        secret (`str`, `int` or `bytes`): the key (a run's secret, or a seed).
        user_id: the user id (str, int, tuple, ...); `3` and `"3"` are different users.
        purpose (`str`): separates the streams drawn from one key (at most 16 bytes used).

    Example:
        >>> keyed_seed("key", "alice", "rows") == keyed_seed("key", "alice", "rows") != keyed_seed("key", "bob", "rows")
        True
    """
    key = secret if isinstance(secret, bytes) else str(secret).encode()
    if len(key) > 64:  # BLAKE2b's key limit
        key = hashlib.blake2b(key).digest()
    if isinstance(user_id, np.generic):
        user_id = user_id.item()
    message = json.dumps(user_id, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str).encode()
    digest = hashlib.blake2b(message, key=key, person=purpose.encode()[:16], digest_size=8).digest()
    return int.from_bytes(digest, "big")


def keyed_uniform(secret, user_id, purpose: str) -> float:
    """A number uniform in [0, 1) from (`secret`, `user_id`) alone (see [`keyed_seed`])."""
    return keyed_seed(secret, user_id, purpose) / 2.0**64


def bound_rows(dataset, user_id_column: str, contribution_bound: int, secret, purpose: str):
    """`dataset` with at most `contribution_bound` rows per user, drawn from (`secret`, user id, `purpose`) alone like
    [`partition_by_user`]'s; the user column, the order and the rows without a user id are kept (for a base trainer
    that prepares, e.g. tokenizes, the rows: it then prepares only rows that can be trained on).

    Raises:
        TypeError, ValueError: as [`partition_by_user`] (no user column, ids of several types).
    """
    check_user_column(dataset, user_id_column)
    keys = _as_keys(dataset[user_id_column])
    _check_one_id_type(keys, user_id_column)
    rows_by_user: dict = {}
    for row, user in enumerate(keys):
        rows_by_user.setdefault(user, []).append(row)
    if all(len(rows) <= contribution_bound for user, rows in rows_by_user.items() if user is not None):
        return dataset
    keep = [row for user, rows in rows_by_user.items()
            for row in (rows if user is None else _draw_rows(rows, contribution_bound, secret, user, purpose))]
    return dataset.select(sorted(keep))


def _draw_rows(rows: list, contribution_bound: int | None, secret, user, purpose: str) -> list:
    """At most `contribution_bound` of one user's `rows`, drawn from (`secret`, user, `purpose`) alone."""
    if contribution_bound is None or len(rows) <= contribution_bound:
        return rows
    rng = np.random.default_rng(keyed_seed(secret, user, purpose))
    return sorted(rng.choice(rows, size=contribution_bound, replace=False).tolist())


def check_user_column(dataset, user_id_column: str) -> None:
    """Refuse a training dataset DP training cannot partition by user: a streamed one (`TypeError`: materialise it), not
    a `datasets.Dataset` (`TypeError`), or without the user column (`ValueError`); one line each."""
    if _is_iterable_dataset(dataset):
        raise TypeError(
            f"train_dataset is a streamed dataset ({type(dataset).__name__}, an IterableDataset): Poisson sampling "
            "draws every user's rows at random each step; materialise it as a datasets.Dataset first, e.g. "
            "Dataset.from_generator(lambda: (yield from stream)) (a datasets stream: stream.take(n) bounds it)."
        )
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        raise TypeError(f"DP training needs a datasets.Dataset with a user column, got {type(dataset).__name__}: "
                        "build one, e.g. datasets.Dataset.from_list(rows), with user ids of one type (e.g. all str).")
    if user_id_column not in columns:
        raise ValueError(
            f"The training dataset has no user column {user_id_column!r} (columns: {columns}). "
            "Add one, or set user_id_column to the column that identifies users."
        )


def _is_iterable_dataset(dataset) -> bool:
    """A streamed dataset (datasets' or torch's IterableDataset): no random access to rows."""
    import torch.utils.data

    try:
        from datasets import IterableDataset
    except ImportError:  # pragma: no cover - datasets is a dependency
        IterableDataset = ()
    return isinstance(dataset, (IterableDataset, torch.utils.data.IterableDataset))


def _check_one_id_type(keys, user_id_column: str) -> None:
    """Refuse ids that mix numbers and strings (or other kinds): one user written as 3 and as "3" would count as two
    users, each kept to the contribution bound, so that user could contribute twice as much as the guarantee says."""
    examples: dict = {}
    for key in keys:
        if isinstance(key, dict):
            raise ValueError(f"user_id_column {user_id_column!r} holds dicts (e.g. {key!r}): a user id must be one "
                             "value (a string or a number); use one field of it, e.g. str(row['author']['id']).")
        if key is not None:
            examples.setdefault(_id_kind(key), key)
            if len(examples) > 1:
                shown = ", ".join(f"{kind} ({value!r})" for kind, value in examples.items())
                raise ValueError(
                    f"user_id_column {user_id_column!r} mixes user ids of different types: {shown}; one user written "
                    "both ways (3 and '3') would count as two users. Give every id one type where the rows are built, "
                    "e.g. str(user_id)."
                )


def user_id_kinds(ids) -> dict:
    """The kinds of the present user ids ("string", "number", "list", ...), each with one example id (missing ids
    skipped): ids of two kinds cannot be compared (3 and "3" may be one person)."""
    kinds: dict = {}
    for key in _as_keys(ids):
        if key is not None:
            kinds.setdefault(_id_kind(key), key)
    return kinds


def user_keys(ids) -> set:
    """The present user ids as a set of hashable keys (lists as tuples, dicts by their repr; missing ids skipped)."""
    return {repr(key) if isinstance(key, dict) else key for key in _as_keys(ids) if key is not None}


def _id_kind(user) -> str:
    if isinstance(user, (str, bytes)):
        return "string"
    if isinstance(user, (numbers.Number, np.number)):
        return "number"
    if isinstance(user, tuple):
        return "list"
    return type(user).__name__


def _as_keys(ids):
    """Hashable keys for any user id (lists from JSON become tuples); a missing id (NaN, NA) becomes `None`."""
    return [None if _is_missing(u) else tuple(u) if isinstance(u, list) else u for u in ids]


def _is_missing(user) -> bool:
    """`None`, a float or numpy NaN, pandas' NA / NaT, or an empty (or blank) string: no user (each NaN would otherwise
    be a user of its own, and every row with an empty id one user shared by many people)."""
    if user is None:
        return True
    if isinstance(user, str):
        return not user.strip()
    if isinstance(user, (float, np.floating)):
        return bool(np.isnan(user))
    return type(user).__name__ in ("NAType", "NaTType")
