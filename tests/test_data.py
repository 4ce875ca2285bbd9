"""hf_dp.data: rows grouped by user under the contribution bound, missing ids dropped, and every per-user choice keyed
by (secret, user id) alone, so one user more or less changes nothing for the others."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from datasets import Dataset
from scipy import stats

from hf_dp.data import examples_per_user, keyed_seed, keyed_uniform, partition_by_user
from hf_dp.workflows.run_data import split_by_user, subsample_users
from trainer_fixtures import user_dataset


# ---- rows without a user id are dropped ---------------------------------------------------------------------------


def test_nan_user_ids_are_dropped_like_none(caplog):
    data = user_dataset(user_ids=[float(i) for i in range(16)])
    for _ in range(20):  # one person's 20 rows, their id lost as NaN
        data = data.add_item({"user_id": float("nan"), "input_ids": [1, 2, 3], "labels": 1})
    with caplog.at_level(logging.WARNING, logger="hf_dp.data"):
        partition = partition_by_user(data, "user_id", None, b"secret")
    assert partition.num_users == 16
    assert partition.num_examples == len(data) - 20
    assert "Dropping 20 training rows" in caplog.text
    assert len(examples_per_user(data, "user_id")) == 16


@pytest.mark.parametrize("blank", ["", "  ", "\t"])
def test_empty_string_ids_are_dropped_not_merged_into_one_user(caplog, blank):
    """20 people whose id was lost as an empty string would be one user cut to G rows: dropped like None."""
    data = user_dataset(user_ids=[f"u{i}" for i in range(16)])
    for _ in range(20):
        data = data.add_item({"user_id": blank, "input_ids": [1, 2, 3], "labels": 1})
    with caplog.at_level(logging.WARNING, logger="hf_dp.data"):
        partition = partition_by_user(data, "user_id", 2, b"secret")
    assert partition.num_users == 16 and "Dropping 20 training rows" in caplog.text
    assert len(examples_per_user(data, "user_id")) == 16


def test_an_empty_dataset_is_said_to_have_no_rows():
    with pytest.raises(ValueError, match="has no rows"):
        partition_by_user(Dataset.from_dict({"user_id": [], "row": []}), "user_id", None, b"secret")


def test_numpy_and_pandas_missing_ids_are_dropped():
    from datasets import Dataset

    from hf_dp.data import _as_keys

    import pandas as pd
    assert _as_keys([np.float32("nan"), np.nan, pd.NA, None, 3, [1, 2]]) == [None, None, None, None, 3, (1, 2)]
    frame = pd.DataFrame({"user_id": pd.array([1, None, 2, None], dtype="Int64"), "text": list("abcd")})
    assert partition_by_user(Dataset.from_pandas(frame), "user_id", None, b"secret").num_users == 2


# ---- per-user randomness: one user more or less changes nothing for the others ------------------------------------


def _users_dataset(counts: dict, first: dict | None = None) -> Dataset:
    """One row per (user, i), the row's content naming both; `first` users come before the others."""
    rows = {"user_id": [], "row": []}
    for user, n in {**(first or {}), **counts}.items():
        for i in range(n):
            rows["user_id"].append(user)
            rows["row"].append(f"{user}/{i}")
    return Dataset.from_dict(rows)


def _kept_rows(dataset: Dataset, bound: int, secret) -> dict:
    part = partition_by_user(dataset, "user_id", bound, secret)
    users = list(dict.fromkeys(dataset["user_id"]))
    content = part.dataset["row"]
    return {user: sorted(content[i] for i in rows) for user, rows in zip(users, part.user_rows)}


def test_adding_one_user_changes_no_other_users_rows():
    rng = np.random.default_rng(3)
    counts = {f"u{i}": int(n) for i, n in enumerate(rng.integers(1, 13, size=200))}
    before = _kept_rows(_users_dataset(counts), 4, "secret")
    for added in (_users_dataset({**counts, "new": 9}), _users_dataset(counts, first={"new": 9})):
        after = _kept_rows(added, 4, "secret")
        assert len(after["new"]) == 4
        assert {u: r for u, r in after.items() if u != "new"} == before
    assert sum(len(r) for r in before.values()) < sum(counts.values())  # the bound did bind
    assert _kept_rows(_users_dataset(counts), 4, "another secret") != before  # and the secret matters


def test_split_and_subsample_are_per_user():
    counts = {f"user-{i}": 1 + i % 5 for i in range(300)}
    data = _users_dataset(counts)
    train, test = split_by_user(data, "user_id", 0.2, seed=7)
    sides = {u: "test" for u in test["user_id"]} | {u: "train" for u in train["user_id"]}
    assert 30 < list(sides.values()).count("test") < 90
    for changed in (_users_dataset({**counts, "new": 9}), _users_dataset({k: counts[k] for k in list(counts)[1:]})):
        train2, test2 = split_by_user(changed, "user_id", 0.2, seed=7)
        sides2 = {u: "test" for u in test2["user_id"]} | {u: "train" for u in train2["user_id"]}
        assert all(sides[u] == side for u, side in sides2.items() if u in sides)
    # a user's side is its keyed hash alone
    assert all((side == "test") == (keyed_uniform(7, u, "split") < 0.2) for u, side in sides.items())
    # the fixed-size sample: one user more moves at most one other user out
    chosen = set(subsample_users(data, "user_id", 50, seed=7)["user_id"])
    assert len(chosen) == 50
    for user in ("new", "another", "third"):
        again = set(subsample_users(_users_dataset({**counts, user: 3}), "user_id", 50, seed=7)["user_id"])
        assert len(chosen - again) <= 1 and again - chosen <= {user}
    outside = next(u for u in counts if u not in chosen)
    fewer = set(subsample_users(_users_dataset({k: v for k, v in counts.items() if k != outside}), "user_id", 50,
                                seed=7)["user_id"])
    assert fewer == chosen


# ---- rows grouped by user under the bound -------------------------------------------------------------------------


def test_partition_groups_rows_by_user_and_drops_the_user_column():
    data = _users_dataset({"a": 3, "b": 1, "c": 5})
    part = partition_by_user(data, "user_id", None, "secret")
    assert (part.num_users, part.num_examples, part.contribution_bound) == (3, 9, None)
    assert part.dataset.column_names == ["row"]  # the ids never reach the model or the collator
    assert part.dataset["row"] == data["row"]  # every row kept, in order
    assert part.rows_per_user().tolist() == [3, 1, 5]
    for user_index, rows in enumerate(part.user_rows):
        assert part.row_user[rows].tolist() == [user_index] * len(rows)
        assert {part.dataset["row"][i].split("/")[0] for i in rows} == {"abc"[user_index]}


def test_the_bound_keeps_at_most_g_rows_of_each_user_and_the_index_follows_them():
    data = _users_dataset({"a": 3, "b": 1, "c": 5, "d": 2})
    part = partition_by_user(data, "user_id", 2, "secret")
    assert part.contribution_bound == 2 and part.rows_per_user().tolist() == [2, 1, 2, 2]
    content = part.dataset["row"]
    assert content == sorted(content, key=data["row"].index)  # kept rows stay in the original order
    assert sorted(part.row_user.tolist()) == sorted(u for u, rows in enumerate(part.user_rows) for _ in rows)
    for user_index, rows in enumerate(part.user_rows):
        assert {content[i].split("/")[0] for i in rows} == {"abcd"[user_index]}


def test_the_rows_kept_are_a_uniform_subset():
    """A user with 10 rows under G = 3: over many secrets each row is kept with probability 3/10."""
    data = _users_dataset({"u": 10, "v": 1})
    secrets = 400
    kept = np.zeros(10)
    for secret in range(secrets):
        rows = partition_by_user(data, "user_id", 3, secret).dataset["row"]
        for row in rows:
            if row.startswith("u/"):
                kept[int(row.split("/")[1])] += 1
    assert kept.sum() == 3 * secrets
    p = 0.3
    assert np.abs(kept - secrets * p).max() < 5 * np.sqrt(secrets * p * (1 - p))


def test_examples_per_user_counts_the_rows_of_each_user():
    data = _users_dataset({"a": 3, "b": 1, "c": 5}).add_item({"user_id": None, "row": "nobody"})
    assert examples_per_user(data, "user_id").tolist() == [1, 3, 5]


def test_user_columns_that_cannot_be_partitioned_are_refused():
    data = _users_dataset({"a": 2, "b": 1})
    with pytest.raises(ValueError, match="no user column 'author'"):
        partition_by_user(data, "author", None, "s")
    nobody = Dataset.from_dict({"user_id": [None, None], "row": ["x", "y"]})
    with pytest.raises(ValueError, match="No training row has a 'user_id' value"):
        partition_by_user(nobody, "user_id", None, "s")

    class MixedIds:  # what a Json column of datasets can hold: 3 and "3", which would count as two users
        column_names = ["user_id"]

        def __getitem__(self, column):
            return [3, "3", None]

    with pytest.raises(ValueError, match=r"mixes user ids of different types: number \(3\), string \('3'\)"):
        partition_by_user(MixedIds(), "user_id", None, "s")
    with pytest.raises(ValueError, match="mixes user ids"):
        examples_per_user(MixedIds(), "user_id")
    with pytest.raises(TypeError, match="got list"):
        partition_by_user([{"user_id": "a"}], "user_id", None, "s")
    with pytest.raises(TypeError, match="streamed"):
        partition_by_user(data.to_iterable_dataset(), "user_id", None, "s")


# ---- keyed per-user randomness ------------------------------------------------------------------------------------


def test_keyed_uniform_is_uniform_over_users_and_keyed_by_secret_user_and_purpose():
    draws = [keyed_uniform("secret", f"user-{i}", "rows") for i in range(4000)]
    assert stats.kstest(draws, "uniform").pvalue > 1e-3
    assert keyed_uniform("secret", "alice", "rows") == keyed_uniform("secret", "alice", "rows")
    others = {keyed_uniform("other", "alice", "rows"), keyed_uniform("secret", "alice", "split"),
              keyed_uniform("secret", "bob", "rows"), keyed_uniform("secret", "alice", "rows")}
    assert len(others) == 4
    assert keyed_seed("k", 3, "rows") != keyed_seed("k", "3", "rows")  # 3 and "3" are different users
    assert keyed_seed("k", np.int64(3), "rows") == keyed_seed("k", 3, "rows")  # numpy ids are their values
    assert keyed_seed(b"k" * 100, "a", "rows") == keyed_seed(b"k" * 100, "a", "rows")  # long keys are hashed
