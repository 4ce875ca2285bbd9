"""Canary users: unmistakable rows, fair coins, a secret record kept apart, clean insert/remove."""

import datasets
import numpy as np
import pytest
from scipy import stats

from hf_dp.audit import Canaries, insert, is_canary_user, make_canaries, remove_canaries


def _real_dataset(n=200, labels=False):
    rng = np.random.default_rng(0)
    words = "the a user said order refund please thanks hello account password shipping late".split()
    data = {
        "user_id": [f"user{rng.integers(0, 40)}" for _ in range(n)],
        "text": [" ".join(rng.choice(words, size=8)) for _ in range(n)],
    }
    features = {"user_id": datasets.Value("string"), "text": datasets.Value("string")}
    if labels:
        data["label"] = [int(x) for x in rng.integers(0, 3, size=n)]
        features["label"] = datasets.ClassLabel(num_classes=3)
    return datasets.Dataset.from_dict(data, features=datasets.Features(features))


def test_shape_ids_and_unique_text():
    canaries = make_canaries(50, 3, seed=1)
    assert len(canaries) == 50 and canaries.user_ids[7] == "__hf_dp_canary_0007__"
    texts = [row["text"] for i in range(50) for row in canaries.rows_of(i)]
    assert len(texts) == 150 and len(set(texts)) == 150
    assert all(row["user_id"] == canaries.user_ids[i] for i in range(50) for row in canaries.rows_of(i))
    assert all(text.startswith("hf-dp-canary-") for text in texts)


def test_text_never_collides_with_real_data():
    real = _real_dataset()
    canaries = make_canaries(100, 2, seed=2)
    real_texts = set(real["text"])
    canary_texts = [row["text"] for i in range(100) for row in canaries.rows_of(i)]
    assert not real_texts & set(canary_texts)
    # Not even the marker appears in real data: every canary row carries a fresh 64-bit one.
    real_blob = "\n".join(real_texts)
    assert not any(text[:29] in real_blob for text in canary_texts)
    assert not any(is_canary_user(u) for u in real["user_id"])


def test_inclusion_is_fair_coin_and_seeded():
    canaries = make_canaries(2000, 1, seed=3, words_per_row=2)
    k = int(canaries.included.sum())
    assert stats.binomtest(k, 2000, 0.5).pvalue > 0.001
    assert canaries.included.dtype == bool
    again = make_canaries(2000, 4, seed=3)  # coins do not depend on the row settings
    np.testing.assert_array_equal(canaries.included, again.included)
    assert not np.array_equal(canaries.included, make_canaries(2000, 1, seed=4).included)


def test_training_rows_are_included_canaries_only():
    canaries = make_canaries(40, 2, seed=5)
    rows = canaries.training_rows()
    assert len(rows) == 2 * int(canaries.included.sum())
    included_ids = {canaries.user_ids[i] for i in np.flatnonzero(canaries.included)}
    assert {row["user_id"] for row in rows} == included_ids
    assert all(set(row) == {"user_id", "text"} for row in rows)


def test_labels_uniform_and_validated():
    canaries = make_canaries(300, 2, seed=6, label_column="label", num_labels=3)
    labels = [row["label"] for i in range(300) for row in canaries.rows_of(i)]
    assert set(labels) == {0, 1, 2}
    assert stats.chisquare(np.bincount(labels, minlength=3)).pvalue > 0.001
    with pytest.raises(ValueError, match="label_column and num_labels"):
        make_canaries(10, 1, seed=0, label_column="label")
    with pytest.raises(ValueError, match="num_canaries"):
        make_canaries(1, 1, seed=0)


def test_save_load_round_trip(tmp_path):
    canaries = make_canaries(30, 2, seed=7, user_id_column="author", text_column="body", label_column="y", num_labels=2)
    path = tmp_path / "canaries.json"
    canaries.save(path)
    loaded = Canaries.load(path)
    assert loaded.user_ids == canaries.user_ids
    np.testing.assert_array_equal(loaded.included, canaries.included)
    assert [loaded.rows_of(i) for i in range(30)] == [canaries.rows_of(i) for i in range(30)]
    settings = (loaded.user_id_column, loaded.text_column, loaded.label_column, loaded.num_labels)
    assert settings == ("author", "body", "y", 2)
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a canary record"):
        Canaries.load(tmp_path / "other.json")


def test_insert_then_remove():
    real = _real_dataset(labels=True)
    canaries = make_canaries(20, 3, seed=8, label_column="label", num_labels=3)
    mixed = insert(real, canaries)
    assert len(mixed) == len(real) + 3 * int(canaries.included.sum())
    assert mixed.features == real.features
    in_ids = {u for u in mixed["user_id"] if is_canary_user(u)}
    assert in_ids == {canaries.user_ids[i] for i in np.flatnonzero(canaries.included)}
    cleaned = remove_canaries(mixed)
    assert cleaned["text"] == real["text"] and cleaned["label"] == real["label"]
    with pytest.raises(ValueError, match="already holds canary users"):
        insert(mixed, canaries)


def test_insert_names_the_mismatched_column():
    real = _real_dataset()
    with pytest.raises(ValueError, match="no column 'label'"):
        insert(real, make_canaries(5, 1, seed=0, label_column="label", num_labels=2))
    with pytest.raises(ValueError, match=r"\['extra'\]"):
        insert(real.add_column("extra", [0] * len(real)), make_canaries(5, 1, seed=0))
    numeric = datasets.Dataset.from_dict({"user_id": [1, 2], "text": ["a", "b"]})
    with pytest.raises(ValueError, match="must hold strings"):
        insert(numeric, make_canaries(5, 1, seed=0))
    with pytest.raises(ValueError, match="3 classes"):
        insert(_real_dataset(labels=True), make_canaries(5, 1, seed=0, label_column="label", num_labels=2))
    with pytest.raises(ValueError, match="no column 'uid'"):
        remove_canaries(real, user_id_column="uid")


def test_is_canary_user():
    assert is_canary_user("__hf_dp_canary_0012__")
    assert not is_canary_user("user12") and not is_canary_user(12) and not is_canary_user("__hf_dp_canary_x__")
