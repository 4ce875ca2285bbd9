"""User grouping: check the user column, map users to rows, apply the contribution bound.

The user ids are taken out of the dataset here, so they never reach the model or the data
collator, and survive Trainer's `remove_unused_columns`.
"""

from __future__ import annotations

import logging
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
    """

    dataset: object
    row_user: np.ndarray
    user_rows: list
    contribution_bound: int | None

    @property
    def num_users(self) -> int:
        return len(self.user_rows)

    @property
    def num_examples(self) -> int:
        return len(self.row_user)

    def rows_per_user(self) -> np.ndarray:
        return np.array([len(rows) for rows in self.user_rows])


def examples_per_user(dataset, user_id_column: str) -> np.ndarray:
    """Rows per user (ignoring rows without a user id): what the contribution-bound heuristics read."""
    _check_user_column(dataset, user_id_column)
    counts = Counter(u for u in _as_keys(dataset[user_id_column]) if u is not None)
    return np.array(sorted(counts.values()), dtype=np.int64)


def partition_by_user(dataset, user_id_column: str, contribution_bound: int | None, seed: int) -> UserPartition:
    """Group rows by user and keep at most `contribution_bound` seeded-random rows per user.

    Raises:
        ValueError: the column is missing, or no row with a user id remains.
    """
    _check_user_column(dataset, user_id_column)
    ids = dataset[user_id_column]
    missing = sum(u is None for u in ids)
    if missing:
        logger.warning("Dropping %d training rows without a %r value.", missing, user_id_column)
    rows_by_user: dict = {}
    for row, user in enumerate(_as_keys(ids)):
        if user is not None:
            rows_by_user.setdefault(user, []).append(row)
    if not rows_by_user:
        raise ValueError(
            f"No training row has a {user_id_column!r} value: DP training needs at least one user. "
            "Fill the user column or point --user_id_column at the right one."
        )
    rng = np.random.default_rng(seed)
    kept = []
    for rows in rows_by_user.values():
        if contribution_bound is not None and len(rows) > contribution_bound:
            rows = sorted(rng.choice(rows, size=contribution_bound, replace=False).tolist())
        kept.append(rows)
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
    return UserPartition(dataset=dataset, row_user=row_user, user_rows=user_rows, contribution_bound=contribution_bound)


def _check_user_column(dataset, user_id_column: str) -> None:
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        raise TypeError(f"DP training needs a datasets.Dataset with a user column, got {type(dataset).__name__}.")
    if user_id_column not in columns:
        raise ValueError(
            f"The training dataset has no user column {user_id_column!r} (columns: {columns}). "
            "Add one, or set user_id_column to the column that identifies users."
        )


def _as_keys(ids):
    """Hashable keys for any user id (lists from JSON become tuples)."""
    return [tuple(u) if isinstance(u, list) else u for u in ids]
