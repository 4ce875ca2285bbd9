"""hf_dp.contribution: the data secret, the contribution bound G (given, or chosen with ε-DP), its ε and how the card
states its choice."""

from __future__ import annotations

import pytest
from datasets import Dataset

from hf_dp import DPTrainingArguments
from hf_dp import mechanism_table
from hf_dp.contribution import bound_choice, bound_epsilon, contribution_bound, counts_of, data_secret, partition
from trainer_fixtures import make_args, user_dataset


# ---- the data secret ----------------------------------------------------------------------------------------------


def test_secret_comes_from_os_entropy_unless_a_test_seed_is_given():
    args = DPTrainingArguments(output_dir="x", use_cpu=True)
    assert data_secret(args) != data_secret(args)
    seeded = DPTrainingArguments(output_dir="x", noise_seed=5, use_cpu=True)
    assert data_secret(seeded) == data_secret(seeded)


def test_the_secret_is_128_bits_of_hex_and_differs_between_test_seeds(tmp_path):
    seeded = data_secret(make_args(tmp_path, noise_seed=1))
    assert len(seeded) == 32 and int(seeded, 16) >= 0
    assert seeded != data_secret(make_args(tmp_path, noise_seed=2))
    fresh = data_secret(make_args(tmp_path, noise_seed=None))
    assert len(fresh) == 32 and fresh != seeded


# ---- the bound G and its ε ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, spent", [
    ({"contribution_bound": "auto", "contribution_bound_epsilon": 0.3}, 0.3),
    ({"contribution_bound": "auto", "sampling": "els", "contribution_bound_epsilon": 0.2}, 0.2),
    ({"contribution_bound": 4}, 0.0),
    ({"contribution_bound": None}, 0.0),
    ({"contribution_bound": "auto", "privacy_unit": "example"}, 0.0),  # no bound at all: nothing read
])
def test_only_a_bound_chosen_from_the_data_spends_epsilon(tmp_path, overrides, spent):
    assert bound_epsilon(make_args(tmp_path, **overrides)) == spent


def test_a_given_bound_is_used_as_is_and_no_bound_keeps_every_row(tmp_path):
    data = user_dataset(num_users=30, max_rows=9)
    assert contribution_bound(data, make_args(tmp_path, contribution_bound=4), "s") == 4
    assert contribution_bound(data, make_args(tmp_path, contribution_bound=None), "s") is None
    assert contribution_bound(data, make_args(tmp_path, privacy_unit="example"), "s") is None
    kept = partition(data, make_args(tmp_path, contribution_bound=4), "s")
    assert kept.contribution_bound == 4 and kept.rows_per_user().max() == 4
    assert partition(data, make_args(tmp_path, contribution_bound=None), "s").num_examples == len(data)


@pytest.mark.parametrize("sampling", ["uls", "els"])
def test_an_auto_bound_is_a_grid_value_drawn_with_the_secret(tmp_path, sampling):
    data = user_dataset(num_users=60, max_rows=9, seed=2)
    args = make_args(tmp_path, sampling=sampling, contribution_bound="auto", max_steps=20)
    draws = {secret: contribution_bound(data, args, secret) for secret in (f"s{i}" for i in range(12))}
    assert set(draws.values()) <= set(mechanism_table.CONTRIBUTION_BOUND_GRID)
    assert len(set(draws.values())) > 1  # a random draw (ε = 0.1 on 60 users), not a function of the data alone
    assert all(contribution_bound(data, args, secret) == bound for secret, bound in draws.items())  # keyed
    assert partition(data, args, "s0").contribution_bound == draws["s0"]


def test_the_card_says_how_g_was_chosen(tmp_path):
    assert bound_choice(make_args(tmp_path, privacy_unit="example"), "example", 0.0) == "none: every row is kept"
    assert bound_choice(make_args(tmp_path, contribution_bound=None), "uls", 0.0) == "none: every row is kept"
    assert bound_choice(make_args(tmp_path, contribution_bound=4), "uls", 0.0).startswith("given (contribution_bound)")
    els = bound_choice(make_args(tmp_path, sampling="els"), "els", 0.1)
    assert els.startswith("auto: an ε-DP median") and "ε = 0.1, in the ledger" in els and els.endswith("ELS median")
    assert "1, 2, 3, 4, 6, 8" in els
    assert bound_choice(make_args(tmp_path), "uls", 0.1).endswith("the ULS noise-prediction heuristic on that median")


def test_audit_canaries_are_trained_on_but_not_counted(tmp_path):
    rows = {"user_id": ["a", "a", "__hf_dp_canary_0__", "__hf_dp_canary_0__", "__hf_dp_canary_0__",
                        "__hf_dp_canary_17__", "b"], "text": list("abcdefg")}
    data = Dataset.from_dict(rows)
    canaries = frozenset({"__hf_dp_canary_0__", "__hf_dp_canary_17__"})
    assert counts_of(data, "user_id", None, canaries) == (2, 4)
    assert counts_of(data, "user_id", 2, canaries) == (2, 3)  # the rows the bound keeps
    assert counts_of(Dataset.from_dict({"user_id": ["a"], "text": ["x"]}), "user_id", 2, canaries) == (0, 0)
    assert counts_of(data, "user_id", 2, frozenset()) == (0, 0)
    # Read through Arrow: a selection counts only its rows; a column Arrow does not read is walked row by row.
    assert counts_of(data.select([0, 2, 3, 6]), "user_id", None, canaries) == (1, 2)
    assert counts_of(data.shuffle(seed=1).filter(lambda row: row["text"] != "e"), "user_id", None, canaries) == (2, 3)
    assert counts_of(data.with_transform(lambda batch: batch), "user_id", 2, canaries) == (2, 3)
