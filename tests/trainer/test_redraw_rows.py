"""`redraw_rows` (ULS): each step trains a sampled user on at most G of their rows drawn afresh from all of them,
keyed by the run's secret, the user id and the step, so the accounting (one clipped gradient per sampled user per
step) is unchanged, no user's draw depends on another user, and a resumed run draws what the uninterrupted one did."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset

from hf_dp.batching import LogicalBatches
from hf_dp.data import partition_by_user
from hf_dp.hub import check_privacy_card
from hf_dp.sampling import SampledUnits
from trainer_fixtures import make_args, make_trainer, one_line, tiny_bert, user_dataset

ROWS_PER_USER = {"ann": 9, "bob": 1, "cy": 4, "dee": 2}


def _rows_dataset(users=ROWS_PER_USER) -> Dataset:
    rows = [(user, f"{user}-{i}") for user, n in users.items() for i in range(n)]
    return Dataset.from_dict({"user_id": [u for u, _ in rows], "row": [r for _, r in rows]})


def _rows_collator(examples: list[dict]) -> dict:
    return {"row": [example["row"] for example in examples]}


def _drawn(partition, step: int) -> list[list[str]]:
    """The rows (by content) every user trains on at `step`, all users sampled, in user order."""
    batches = LogicalBatches(partition.dataset, unit_rows=partition.user_rows, redraw=partition.redraw,
                             data_collator=_rows_collator, micro_batch_size=100)
    units = np.arange(partition.num_users)
    batch = batches[SampledUnits(step=step, units=units, total=len(units))]
    micro = batch.micro_batches[0]
    rows, counts = micro.features["row"], micro.units.counts.tolist()
    assert micro.loss_weights.tolist() == pytest.approx([1 / n for n in counts for _ in range(n)])  # mean loss
    return [rows[start:start + n] for start, n in zip(np.cumsum([0, *counts[:-1]]), counts)]


def test_each_step_draws_at_most_G_of_a_users_own_rows_and_covers_them_all_over_the_run():
    partition = partition_by_user(_rows_dataset(), "user_id", 2, secret="s", redraw_rows=True)
    assert partition.num_examples == sum(ROWS_PER_USER.values())  # every row kept: the steps draw among them
    seen = {user: set() for user in ROWS_PER_USER}
    for step in range(60):
        for user, rows in zip(ROWS_PER_USER, _drawn(partition, step)):
            assert len(rows) == min(2, ROWS_PER_USER[user]) == len(set(rows))
            assert all(row.startswith(f"{user}-") for row in rows)  # a user's own rows only
            seen[user].update(rows)
    assert {user: len(rows) for user, rows in seen.items()} == ROWS_PER_USER  # over the run: every row
    assert _drawn(partition, 7) != _drawn(partition, 8)
    again = partition_by_user(_rows_dataset(), "user_id", 2, secret="s", redraw_rows=True)
    assert _drawn(again, 7) == _drawn(partition, 7)  # the same secret and step: the same rows
    other = partition_by_user(_rows_dataset(), "user_id", 2, secret="t", redraw_rows=True)
    assert [_drawn(other, t) for t in range(5)] != [_drawn(partition, t) for t in range(5)]


def test_without_redraw_the_rows_are_drawn_once():
    partition = partition_by_user(_rows_dataset(), "user_id", 2, secret="s")
    assert partition.redraw is None and partition.num_examples == 2 + 1 + 2 + 2
    assert all(_drawn(partition, step) == _drawn(partition, 0) for step in range(1, 10))


def test_a_users_draws_do_not_depend_on_the_other_users():
    everyone = partition_by_user(_rows_dataset(), "user_id", 2, secret="s", redraw_rows=True)
    users = {user: n for user, n in ROWS_PER_USER.items() if user != "bob"}  # bob removed: ann, cy, dee re-indexed
    without_bob = partition_by_user(_rows_dataset(users), "user_id", 2, secret="s", redraw_rows=True)
    for step in range(20):
        ann, _, cy, dee = _drawn(everyone, step)
        assert _drawn(without_bob, step) == [ann, cy, dee]


@pytest.mark.parametrize("overrides, words", [
    (dict(sampling="els", contribution_bound=2), "ELS.*fixed before training.*sampling='uls'"),
    (dict(privacy_unit="example"), "fixed before training.*sampling='uls'"),
    (dict(sampling="uls", contribution_bound=None), "contribution_bound=None.*already used each step"),
], ids=["els", "example", "no-bound"])
def test_redraw_is_refused_where_the_accounting_needs_fixed_rows_or_nothing_is_drawn(tmp_path, overrides, words):
    with pytest.raises(ValueError, match=words) as error:
        make_args(tmp_path, redraw_rows=True, **overrides)
    one_line(error)


def test_a_redrawn_run_spends_the_same_epsilon_and_resumes_to_the_uninterrupted_weights(tmp_path):
    data = user_dataset(num_users=40, max_rows=9, seed=4)
    settings = dict(dataset=data, sampling="uls", contribution_bound=2, max_steps=6, noise_seed=11)
    fixed = make_trainer(tmp_path / "fixed", model=tiny_bert(seed=1), **settings)
    fixed.train()
    straight = make_trainer(tmp_path / "a", model=tiny_bert(seed=1), redraw_rows=True, **settings)
    straight.train()
    assert straight.privacy_plan.sample_rate == fixed.privacy_plan.sample_rate
    assert straight.privacy_plan.noise_multiplier == fixed.privacy_plan.noise_multiplier
    assert straight.privacy_report()["epsilon"] == pytest.approx(fixed.privacy_report()["epsilon"], rel=1e-12)
    assert straight.partition.num_examples == len(data) > fixed.partition.num_examples
    assert "afresh each step" in straight.privacy_report()["contribution_bound_choice"]
    moved = [not torch.equal(a, b) for a, b in zip(fixed.model.parameters(), straight.model.parameters())]
    assert any(moved)  # other rows were trained on

    first = make_trainer(tmp_path / "b", model=tiny_bert(seed=1), redraw_rows=True, save_strategy="steps",
                         save_steps=3, **settings)
    first.train()
    checkpoint = str(tmp_path / "b" / "out" / "checkpoint-3")
    refused = make_trainer(tmp_path / "c", model=tiny_bert(seed=1), **settings)
    with pytest.raises(ValueError, match="different privacy configuration.*redraw_rows: checkpoint True vs now False"):
        refused.train(resume_from_checkpoint=checkpoint)
    resumed = make_trainer(tmp_path / "d", model=tiny_bert(seed=99), redraw_rows=True, **settings)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.accountant.steps == 6
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, msg=f"{name} differs after resume")


def test_the_card_says_the_rows_are_redrawn_not_dropped(tmp_path):
    trainer = make_trainer(tmp_path, dataset=user_dataset(num_users=40, max_rows=9, seed=4), sampling="uls",
                           contribution_bound=2, redraw_rows=True, max_steps=2, noise_seed=None)
    trainer.train()
    assert trainer.privacy_report()["redraw_rows"] is True
    card = open(trainer.write_privacy_card()).read()
    assert "at most G = 2 of them, drawn afresh each step" in card and "dropped before" not in card
    assert check_privacy_card(tmp_path / "out")["redraw_rows"] is True  # the card a Hub upload checks
