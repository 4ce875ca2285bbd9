"""Data-dependent choices are releases too: G chosen with ε-DP and accounted, per-user keyed randomness."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datasets import Dataset

from hf_dp import DPTrainer, DPTrainingArguments, accounting
from hf_dp.accounting import planner
from hf_dp.data import keyed_uniform, partition_by_user
from hf_dp.workflows.runs import split_by_user, subsample_users
from hf_dp.contribution import data_secret
from trainer_fixtures import pad_collator, tiny_bert, user_dataset

GRID = planner.CONTRIBUTION_BOUND_GRID
# The example: 500 users with 1-29 rows, and one more user with 77 rows.
USERS = np.random.default_rng(0).integers(1, 30, size=500).tolist()
OUTLIER = 77


def _max_log_ratio(p, q) -> float:
    return float(np.max(np.abs(np.log(p) - np.log(q))))


# ---- the exponential mechanism --------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0.1, 1.0])
@pytest.mark.parametrize("quantile", [0.1, 0.5, 0.9])
def test_quantile_release_is_epsilon_dp_for_neighbouring_counts(epsilon, quantile):
    """Exact probabilities of every released G: removing/adding one user changes each by at most e^ε."""
    rng = np.random.default_rng(1)
    cases = [(USERS, USERS + [OUTLIER]), (USERS, USERS + [1]), ([5] * 40, [5] * 40 + [300])]
    for _ in range(20):
        counts = rng.integers(1, 400, size=int(rng.integers(2, 60))).tolist()
        cases.append((counts, counts + [int(rng.integers(1, 600))]))
    for smaller, larger in cases:
        p = planner.quantile_probabilities(smaller, epsilon=epsilon, quantile=quantile)
        q = planner.quantile_probabilities(larger, epsilon=epsilon, quantile=quantile)
        assert p.sum() == pytest.approx(1) and q.sum() == pytest.approx(1)
        assert _max_log_ratio(p, q) <= epsilon * (1 + 1e-9)


def test_the_outlier_does_not_set_g():
    """Old behaviour: G = 77 with the outlier, 29 without. Now G comes from the public grid, whatever the draw."""
    for sampling in ("uls", "els"):
        for seed in range(30):
            bound = planner.private_contribution_bound(
                USERS + [OUTLIER], sampling=sampling, epsilon=0.1, expected_batch_size=64, steps=100,
                target_epsilon=7.9, rng=np.random.default_rng(seed))
            assert bound in GRID and bound != OUTLIER
    # A quantile that no grid value equals (every user has 5 rows) is never released as such.
    draws = {planner.private_quantile([5] * 2000, epsilon=0.1, rng=np.random.default_rng(s)) for s in range(50)}
    assert draws <= set(GRID) and 5 not in draws and 6 in draws
    # With many users the DP median is accurate: the median of 1..29 rounds up to the grid value 16.
    p = planner.quantile_probabilities(USERS * 20, epsilon=0.1)
    assert GRID[int(p.argmax())] == 16 and p.max() > 0.9


def test_uls_bound_reads_only_the_dp_median_and_the_number_of_users(monkeypatch):
    monkeypatch.setattr(planner, "private_quantile", lambda counts, **kwargs: 12)
    choose = dict(sampling="uls", epsilon=0.1, expected_batch_size=64, steps=100, target_epsilon=7.9)
    other = [200] * 250 + [1] * 251  # as many users, very different counts
    assert planner.private_contribution_bound(USERS + [OUTLIER], **choose) == \
        planner.private_contribution_bound(other, **choose)


def test_quantile_rejects_bad_input():
    for kwargs, match in [(dict(epsilon=0.0), "epsilon"), (dict(epsilon=0.1, quantile=1.5), "quantile"),
                          (dict(epsilon=0.1, grid=[4, 2]), "grid")]:
        with pytest.raises(ValueError, match=match):
            planner.quantile_probabilities([1, 2, 3], **kwargs)


# ---- the trainer: ε_G in the ledger, total within the target --------------------------------------------


def make_trainer(tmp_path, dataset=None, **overrides) -> DPTrainer:
    settings = dict(
        output_dir=str(tmp_path / "out"), max_steps=4, expected_batch_size=8, per_device_train_batch_size=4,
        learning_rate=1e-2, target_epsilon=3.0, noise_seed=1234, report_to=[], logging_steps=1, save_strategy="no",
        use_cpu=True, disable_tqdm=True,
    )
    settings.update(overrides)
    return DPTrainer(model=tiny_bert(), args=DPTrainingArguments(**settings),
                     train_dataset=dataset if dataset is not None else user_dataset(), data_collator=pad_collator)


@pytest.mark.parametrize("sampling", ["uls", "els"])
def test_auto_bound_is_accounted_and_the_total_meets_the_target(tmp_path, sampling):
    trainer = make_trainer(tmp_path, sampling=sampling)
    assert trainer.accountant.pure_dp == [{"label": "contribution_bound", "epsilon": 0.1}]
    assert trainer.partition.contribution_bound in GRID
    plan = trainer.privacy_plan
    # DP-SGD is calibrated to what is left of the target after the choice of G.
    sgd = accounting.epsilon(sample_rate=plan.sample_rate, noise_multiplier=plan.effective_noise_multiplier,
                             steps=plan.steps, delta=plan.delta, group_size=plan.group_size)
    assert 2.8 < sgd <= 3.0 - 0.1
    trainer.train()
    report = trainer.privacy_report()
    assert report["contribution_bound_epsilon"] == 0.1
    assert report["epsilon"] == pytest.approx(report["epsilon_training"] + 0.1)
    assert report["epsilon_training"] == pytest.approx(sgd, rel=1e-6)
    assert report["epsilon"] <= 3.0
    assert "ε-DP median" in report["contribution_bound_choice"]
    # The secret that keyed G and the rows is in no released artifact.
    secret = trainer._data_secret
    card = (tmp_path / "out" / "README.md").read_text()
    assert secret not in card and secret not in json.dumps(report, default=str)
    assert secret not in json.dumps(trainer.state.log_history)


def test_given_bound_costs_nothing(tmp_path):
    trainer = make_trainer(tmp_path, contribution_bound=3)
    assert trainer.accountant.pure_dp == []
    report = trainer.privacy_report()
    assert report["contribution_bound_epsilon"] == 0 and report["epsilon"] == 0
    assert report["contribution_bound_choice"].startswith("given")
    example = make_trainer(tmp_path, privacy_unit="example")  # "auto": no bound at all, nothing read
    assert example.accountant.pure_dp == [] and example.partition.contribution_bound is None


def test_bound_epsilon_arguments():
    with pytest.raises(ValueError, match="contribution_bound_epsilon"):
        DPTrainingArguments(output_dir="x", contribution_bound_epsilon=0.0, use_cpu=True)
    with pytest.raises(ValueError, match="leaves nothing"):
        DPTrainingArguments(output_dir="x", target_epsilon=0.1, contribution_bound_epsilon=0.1, use_cpu=True)
    DPTrainingArguments(output_dir="x", target_epsilon=0.1, contribution_bound=2, use_cpu=True)  # not spent


def test_secret_comes_from_os_entropy_unless_a_test_seed_is_given():
    args = DPTrainingArguments(output_dir="x", use_cpu=True)
    assert data_secret(args) != data_secret(args)
    seeded = DPTrainingArguments(output_dir="x", noise_seed=5, use_cpu=True)
    assert data_secret(seeded) == data_secret(seeded)


# ---- per-user randomness: one user more or less changes nothing for the others --------------------------


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


# ---- resume keeps the checkpoint's G and rows -----------------------------------------------------------


def _rows(trainer) -> list:
    """The contents of the rows kept, user by user."""
    tokens = trainer.partition.dataset["input_ids"]
    return [[tokens[i] for i in rows] for rows in trainer.partition.user_rows]


@pytest.mark.parametrize("bound", [2, "auto"])
def test_resume_keeps_the_bound_and_the_rows(tmp_path, bound):
    data = user_dataset(num_users=40, max_rows=9, seed=4)
    first = make_trainer(tmp_path / "a", dataset=data, contribution_bound=bound, target_epsilon=8.0,
                         save_strategy="steps", save_steps=2, noise_seed=11)
    first.train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-2"
    assert json.loads((checkpoint / "dp_resume.json").read_text())["data_secret"] == first._data_secret
    # Another secret (here another test seed; by default fresh OS entropy) would choose other rows ...
    resumed = make_trainer(tmp_path / "b", dataset=data, contribution_bound=bound, target_epsilon=8.0,
                           noise_seed=12)
    assert resumed._data_secret != first._data_secret
    if bound == 2:
        assert _rows(resumed) != _rows(first)
    else:  # (with these two seeds the DP draws differ: G = 16 and 8)
        assert resumed.partition.contribution_bound != first.partition.contribution_bound
    # ... but resuming takes the checkpoint's, so G, the rows and the plan match the checkpoint.
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed._data_secret == first._data_secret
    assert resumed.partition.contribution_bound == first.partition.contribution_bound
    assert _rows(resumed) == _rows(first)
    assert resumed.privacy_plan == first.privacy_plan
    assert resumed.accountant.pure_dp == first.accountant.pure_dp  # ε_G counted once
    assert resumed.privacy_report()["epsilon"] == pytest.approx(first.privacy_report()["epsilon"], rel=1e-9)
