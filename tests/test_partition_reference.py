"""The partition read through Arrow gives the same users, rows and keys as the row-by-row grouping it replaced.

`_reference_*` below is that grouping as it was (each row's id read in Python, a dict of rows per user, one
`default_rng(keyed seed)` per user over the bound); the package's partition, bound and counts must equal it on
heavy-tailed data (Zipf rows per user, rows of users interleaved) with every kind of id the partition accepts:
strings, ints, floats, lists, pandas' nullable ints, missing ids (None, NaN, blank strings), and datasets with a
selection (select, shuffle, filter) over their table.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pandas as pd
import pytest
from datasets import Dataset

from hf_dp.contribution import contribution_bound, partition
from hf_dp.data import (RowRedraw, UserPartition, _as_keys, _check_one_id_type, bound_rows, examples_per_user,
                        partition_by_user)
from hf_dp.user_column import arrow_user_codes
from trainer_fixtures import VOCAB, make_args, make_trainer, tiny_bert

SECRET = "3f1c0ffee"


# ---- the row-by-row grouping, as it was -----------------------------------------------------------------------------


def _reference_seed(secret, user_id, purpose: str) -> int:
    key = secret if isinstance(secret, bytes) else str(secret).encode()
    if isinstance(user_id, np.generic):
        user_id = user_id.item()
    message = json.dumps(user_id, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str).encode()
    digest = hashlib.blake2b(message, key=key, person=purpose.encode()[:16], digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _reference_draw(rows: list, bound, secret, user, purpose: str) -> list:
    if bound is None or len(rows) <= bound:
        return rows
    rng = np.random.default_rng(_reference_seed(secret, user, purpose))
    return sorted(rng.choice(rows, size=bound, replace=False).tolist())


def _reference_rows_by_user(keys: list, keep_missing: bool = False) -> dict:
    rows_by_user: dict = {}
    for row, user in enumerate(keys):
        if user is not None or keep_missing:
            rows_by_user.setdefault(user, []).append(row)
    return rows_by_user


def _reference_partition(dataset, column: str, bound, secret, redraw_rows: bool = False) -> UserPartition:
    ids = dataset[column]
    keys = _as_keys(ids)
    _check_one_id_type(keys, column)
    rows_by_user = _reference_rows_by_user(keys)
    redraw = None
    if redraw_rows and bound is not None:
        redraw = RowRedraw(keys=np.array([_reference_seed(secret, u, "redrawn rows") for u in rows_by_user],
                                         dtype=np.uint64), bound=int(bound))
    kept = [rows if redraw else _reference_draw(rows, bound, secret, user, "rows")
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
    dataset = dataset.remove_columns(column)
    if len(keep) < len(ids):
        dataset = dataset.select(keep.tolist())
    return UserPartition(dataset=dataset, row_user=row_user, user_rows=user_rows, contribution_bound=bound,
                         redraw=redraw)


def _reference_bound_rows(dataset, column: str, bound: int, secret, purpose: str):
    keys = _as_keys(dataset[column])
    rows_by_user = _reference_rows_by_user(keys, keep_missing=True)
    if all(len(rows) <= bound for user, rows in rows_by_user.items() if user is not None):
        return dataset
    keep = [row for user, rows in rows_by_user.items()
            for row in (rows if user is None else _reference_draw(rows, bound, secret, user, purpose))]
    return dataset.select(sorted(keep))


def _reference_counts(dataset, column: str) -> list:
    rows_by_user = _reference_rows_by_user(_as_keys(dataset[column]))
    return sorted(len(rows) for rows in rows_by_user.values())


def _assert_same(got: UserPartition, expected: UserPartition) -> None:
    assert got.dataset.column_names == expected.dataset.column_names
    assert got.dataset["row"] == expected.dataset["row"]  # the same rows, in the same order
    assert got.row_user.tolist() == expected.row_user.tolist()
    assert [r.tolist() for r in got.user_rows] == [r.tolist() for r in expected.user_rows]
    assert got.contribution_bound == expected.contribution_bound
    assert (got.redraw is None) == (expected.redraw is None)
    if got.redraw is not None:
        assert got.redraw.bound == expected.redraw.bound
        assert got.redraw.keys.dtype == np.uint64 and got.redraw.keys.tolist() == expected.redraw.keys.tolist()


# ---- heavy-tailed data with every kind of id ------------------------------------------------------------------------


def _zipf_ids(users: list, seed: int = 0) -> list:
    """Zipf rows per user (a few users hold hundreds of rows, most one or two), the rows of all users interleaved."""
    rng = np.random.default_rng(seed)
    counts = np.minimum(rng.zipf(1.6, size=len(users)), 600)
    counts[0] = 700  # one user far above any bound
    rows = [user for user, n in zip(users, counts) for _ in range(n)]
    return [rows[i] for i in rng.permutation(len(rows))]


def _with_missing(ids: list, missing: list, seed: int = 1) -> list:
    rng = np.random.default_rng(seed)
    ids = list(ids)
    for value in missing:
        for _ in range(5):
            ids.insert(int(rng.integers(0, len(ids) + 1)), value)
    return ids


def _dataset(ids: list) -> Dataset:
    return Dataset.from_dict({"user_id": ids, "row": [f"row-{i}" for i in range(len(ids))]})


def _datasets() -> dict:
    strings = _with_missing(_zipf_ids([f"user-{i}" for i in range(250)] + ["ünï \"q\"", "😀"]), [None, "", "  ", "\t"])
    ints = _with_missing(_zipf_ids(list(range(-3, 200)) + [2**62, 10**15], seed=2), [None])
    floats = _with_missing(_zipf_ids([i / 4 for i in range(150)] + [1e300], seed=3), [None, float("nan")])
    lists = _with_missing(_zipf_ids([[i, i % 7] for i in range(120)] + [[10**12, -1, 5]], seed=4), [None])
    nullable = Dataset.from_pandas(pd.DataFrame({
        "user_id": pd.array(_with_missing(_zipf_ids(list(range(100)), seed=5), [None]), dtype="Int64"),
    }).assign(row=lambda frame: [f"row-{i}" for i in range(len(frame))]))
    base = _dataset(strings)
    return {
        "strings": base, "ints": _dataset(ints), "floats": _dataset(floats), "lists": _dataset(lists),
        "pandas Int64": nullable,
        "selected": base.select(np.random.default_rng(6).permutation(len(base))[: len(base) // 2]),
        "shuffled": base.shuffle(seed=7),
        "filtered": base.filter(lambda row: not row["row"].endswith("3")),
    }


DATASETS = _datasets()


def test_the_data_spans_what_the_comparison_needs():
    """Strings, ints and floats (also under a selection) are read through Arrow; lists take the row walk."""
    for name, dataset in DATASETS.items():
        assert (arrow_user_codes(dataset, "user_id") is None) == (name == "lists"), name
    counts = examples_per_user(DATASETS["strings"], "user_id")
    assert counts.max() >= 700 and (counts == 1).sum() > 50  # heavy-tailed: a bound binds for some users only


@pytest.mark.parametrize("name", list(DATASETS))
@pytest.mark.parametrize("bound, redraw", [(None, False), (1, False), (3, False), (3, True), (None, True)])
def test_the_partition_is_the_row_by_row_partition(name, bound, redraw):
    dataset = DATASETS[name]
    got = partition_by_user(dataset, "user_id", bound, SECRET, redraw_rows=redraw)
    _assert_same(got, _reference_partition(dataset, "user_id", bound, SECRET, redraw_rows=redraw))


@pytest.mark.parametrize("name", list(DATASETS))
def test_the_bound_before_preparation_and_the_counts_are_the_row_by_row_ones(name):
    dataset = DATASETS[name]
    assert examples_per_user(dataset, "user_id").tolist() == _reference_counts(dataset, "user_id")
    for bound in (2, 40):
        got = bound_rows(dataset, "user_id", bound, b"key", "rows before preparation")
        expected = _reference_bound_rows(dataset, "user_id", bound, b"key", "rows before preparation")
        assert list(got["row"]) == list(expected["row"])  # the same rows (each named once), in the same order
    assert bound_rows(dataset, "user_id", 10**6, b"key", "x") is dataset  # no user over the bound: untouched


@pytest.mark.parametrize("overrides", [
    dict(sampling="uls", contribution_bound=3),
    dict(sampling="els", contribution_bound=3),
    dict(sampling="uls", contribution_bound=3, redraw_rows=True),
    dict(privacy_unit="example", contribution_bound=None),
    dict(sampling="els", contribution_bound="auto"),
])
def test_each_mechanisms_partition_is_the_row_by_row_one(tmp_path, overrides):
    """ULS, ELS, redrawn rows and example level (G from the arguments, or chosen from the counts)."""
    args = make_args(tmp_path, **overrides)
    dataset = DATASETS["strings"]
    bound = contribution_bound(dataset, args, SECRET)
    expected = _reference_partition(dataset, "user_id", bound, SECRET, redraw_rows=args.redraw_rows)
    _assert_same(partition(dataset, args, SECRET), expected)


@pytest.mark.parametrize("overrides", [dict(contribution_bound=2), dict(contribution_bound=2, redraw_rows=True),
                                       dict(sampling="els", contribution_bound=2)])
def test_a_trainer_partitions_like_the_row_by_row_grouping(tmp_path, overrides):
    rng = np.random.default_rng(8)
    ids = _with_missing(_zipf_ids([f"u{i}" for i in range(40)], seed=9)[:300], [None, ""])
    data = Dataset.from_dict({"user_id": ids, "input_ids": [[int(t) for t in rng.integers(1, VOCAB, 4)] for _ in ids],
                              "labels": [int(t) for t in rng.integers(0, 2, len(ids))]})
    trainer = make_trainer(tmp_path, model=tiny_bert(), dataset=data, **overrides)
    expected = _reference_partition(data, "user_id", 2, trainer._data_secret,
                                    redraw_rows=overrides.get("redraw_rows", False))
    assert trainer.partition.row_user.tolist() == expected.row_user.tolist()
    assert [r.tolist() for r in trainer.partition.user_rows] == [r.tolist() for r in expected.user_rows]
    assert trainer.partition.dataset["input_ids"] == expected.dataset["input_ids"]


@pytest.mark.parametrize("name", list(DATASETS))
def test_the_eval_check_reads_the_same_users_once_each(name):
    """check_eval_users compares sets of users and their kinds: read through Arrow, each id once, they are the
    row walk's."""
    from hf_dp.data import distinct_user_ids, user_id_kinds, user_keys

    dataset = DATASETS[name]
    ids = distinct_user_ids(dataset, "user_id")
    assert user_keys(ids) == user_keys(dataset["user_id"])
    assert set(user_id_kinds(ids)) == set(user_id_kinds(dataset["user_id"]))
    assert (len(ids) < len(dataset)) == (name != "lists")  # each id once, where Arrow reads the column
