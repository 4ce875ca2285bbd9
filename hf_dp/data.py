"""User grouping: check the user column, map users to rows, apply the contribution bound.

The user ids are taken out of the dataset here, so they never reach the model or the data
collator, and survive Trainer's `remove_unused_columns`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import numbers
from dataclasses import dataclass

import numpy as np

from .row_draws import choose_positions
from .user_column import arrow_user_codes

logger = logging.getLogger(__name__)
# keyed_seed's encoding of a user id: json.dumps(user_id, ensure_ascii=False, separators=(",", ":"), sort_keys=True,
# default=str), built once.
_ID_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str)

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
    """Rows per user (ignoring rows without a user id), sorted: what the contribution-bound heuristics read."""
    check_user_column(dataset, user_id_column)
    return np.sort(index_users(dataset, user_id_column).counts())


@dataclass
class UserIndex:
    """The user column read once: every row's user, the users in order of first appearance.

    Attributes:
        users (`list`): the user ids (lists as tuples), in the order their first row comes.
        codes (`np.ndarray`): `(num_rows,)` int64, each row's index into `users`; -1 for a row without a user id.
    """

    users: list
    codes: np.ndarray

    @property
    def missing(self) -> int:
        """Rows without a user id."""
        return int(np.count_nonzero(self.codes < 0))

    def counts(self) -> np.ndarray:
        """`(num_users,)` rows of each user."""
        return np.bincount(self.codes[self.codes >= 0], minlength=len(self.users))

    def grouped(self) -> np.ndarray:
        """Every row with a user id, grouped by user (users in order, each user's rows ascending)."""
        return np.argsort(self.codes, kind="stable")[self.missing:]


def index_users(dataset, user_id_column: str) -> UserIndex:
    """Read the user column once: the users in order of first appearance and each row's user, the same users and rows
    as walking the rows (missing ids dropped, lists as tuples, ids of mixed types refused).

    Strings and numbers of a `datasets.Dataset` are read through Arrow ([`~hf_dp.user_column.arrow_user_codes`]) and
    checked once per distinct id; other columns are walked row by row.

    Raises:
        ValueError: ids that mix types (3 and "3") or dicts.
    """
    read = arrow_user_codes(dataset, user_id_column)
    if read is None:
        keys = _as_keys(dataset[user_id_column])
        _check_one_id_type(keys, user_id_column)
        positions: dict = {}
        codes = np.fromiter((-1 if key is None else positions.setdefault(key, len(positions)) for key in keys),
                            dtype=np.int64, count=len(keys))
        return UserIndex(users=list(positions), codes=codes)
    codes, values = read
    lookup = np.array([-1 if _is_missing(value) else i for i, value in enumerate(values)] + [-1], dtype=np.int64)
    codes = lookup[codes]  # a missing id (NaN, a blank string) is no user; -1 stays -1
    rows = np.flatnonzero(codes >= 0)
    first = np.full(len(values), len(codes), dtype=np.int64)
    np.minimum.at(first, codes[rows], rows)
    present = np.flatnonzero(first < len(codes))
    order = present[np.argsort(first[present], kind="stable")]  # by first row
    renumber = np.full(len(values) + 1, -1, dtype=np.int64)
    renumber[order] = np.arange(len(order))
    return UserIndex(users=[values[i] for i in order], codes=renumber[codes])


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
    index = index_users(dataset, user_id_column)
    if index.missing:
        logger.warning("Dropping %d training rows without a %r value (None, NaN or an empty string): they are not "
                       "trained on, and not counted as users.", index.missing, user_id_column)
    if not index.users and len(index.codes) == 0:
        raise ValueError("The training dataset has no rows: DP training needs at least one user's rows.")
    if not index.users:
        raise ValueError(
            f"No training row has a {user_id_column!r} value: DP training needs at least one user. "
            "Fill the user column or point --user_id_column at the right one."
        )
    rows, counts = index.grouped(), index.counts()
    redraw = None
    if redraw_rows and contribution_bound is not None:
        redraw = RowRedraw(keys=keyed_seeds(secret, index.users, "redrawn rows"), bound=int(contribution_bound))
    else:
        rows, counts = _bounded(rows, counts, contribution_bound, secret, index.users, "rows")
    kept = np.zeros(len(index.codes), dtype=bool)
    kept[rows] = True
    keep = np.flatnonzero(kept)  # the kept rows, in the dataset's order
    position = np.cumsum(kept) - 1  # a kept row's position in the partition's dataset
    grouped, ends = position[rows], np.cumsum(counts).tolist()
    user_rows = [grouped[start:end] for start, end in zip([0] + ends[:-1], ends)]  # views of one array
    dataset = dataset.remove_columns(user_id_column)
    if len(keep) < len(index.codes):
        dataset = dataset.select(keep)
    return UserPartition(dataset=dataset, row_user=index.codes[keep], user_rows=user_rows,
                         contribution_bound=contribution_bound, redraw=redraw)


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
    message = _ID_ENCODER.encode(user_id).encode()
    digest = hashlib.blake2b(message, key=key, person=purpose.encode()[:16], digest_size=8).digest()
    return int.from_bytes(digest, "big")


def keyed_seeds(secret, user_ids, purpose: str) -> np.ndarray:
    """`(len(user_ids),)` uint64: [`keyed_seed`] of every user id (the key and purpose set up once)."""
    key = secret if isinstance(secret, bytes) else str(secret).encode()
    if len(key) > 64:
        key = hashlib.blake2b(key).digest()
    person, encode, blake2b = purpose.encode()[:16], _ID_ENCODER.encode, hashlib.blake2b
    seeds = np.empty(len(user_ids), dtype=np.uint64)
    for index, user_id in enumerate(user_ids):
        if isinstance(user_id, np.generic):
            user_id = user_id.item()
        digest = blake2b(encode(user_id).encode(), key=key, person=person, digest_size=8).digest()
        seeds[index] = int.from_bytes(digest, "big")
    return seeds


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
    index = index_users(dataset, user_id_column)
    counts = index.counts()
    if not len(counts) or counts.max() <= contribution_bound:
        return dataset
    rows, _ = _bounded(index.grouped(), counts, contribution_bound, secret, index.users, purpose)
    kept = index.codes < 0  # rows without a user id stay
    kept[rows] = True
    return dataset.select(np.flatnonzero(kept))


def _bounded(rows: np.ndarray, counts: np.ndarray, contribution_bound: int | None, secret, users: list,
             purpose: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows grouped by user (`counts` each) cut to at most `contribution_bound` per user: for a user with more, the
    rows at numpy's `default_rng(keyed_seed(secret, user, purpose)).choice(n, size=G, replace=False)`, drawn for all
    such users at once ([`~hf_dp.row_draws.choose_positions`]). Returns the kept rows, grouped, and their counts."""
    if contribution_bound is None or not len(counts) or counts.max() <= contribution_bound:
        return rows, counts
    over = np.flatnonzero(counts > contribution_bound)
    positions = choose_positions(keyed_seeds(secret, [users[u] for u in over], purpose), counts[over],
                                 contribution_bound)  # (over users, G)
    starts = np.cumsum(counts) - counts
    kept = np.repeat(counts <= contribution_bound, counts)
    kept[(starts[over, None] + positions).ravel()] = True
    return rows[kept], np.minimum(counts, contribution_bound)


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


def distinct_user_ids(dataset, user_id_column: str):
    """The ids of `dataset`'s user column, each distinct id once where the column is read through Arrow
    ([`~hf_dp.user_column.arrow_user_codes`]), else every row's (`dataset[user_id_column]`): what [`user_keys`] and
    [`user_id_kinds`] read, in a second for 10⁷ rows."""
    read = arrow_user_codes(dataset, user_id_column)
    if read is None:
        return dataset[user_id_column]
    codes, values = read
    return [values[i] for i in np.flatnonzero(np.bincount(codes[codes >= 0], minlength=len(values)))]


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
