"""Checkpoints carry the privacy ledger and the resume state: a resumed run continues the uninterrupted one with its G,
rows and ε, a checkpoint that does not match is refused, and one live run at a time holds output_dir."""

from __future__ import annotations

import fcntl
import json
import os
import shutil

import pytest
import torch

from hf_dp import DPTrainer
from hf_dp.checkpoint import LOCK_FILE, digest
from trainer_fixtures import make_args, make_trainer, pad_collator, tiny_bert, user_dataset


# ---- a resumed run continues the uninterrupted one ----------------------------------------------------------------


def test_resume_reproduces_an_uninterrupted_run_and_keeps_the_ledger(tmp_path):
    straight = make_trainer(tmp_path / "a", model=tiny_bert(seed=1), max_steps=4)
    straight.train()
    first = make_trainer(tmp_path / "b", model=tiny_bert(seed=1), max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = tmp_path / "b" / "out" / "checkpoint-2"
    ledger = json.loads((checkpoint / "dp_ledger.json").read_text())
    assert ledger["accountant"]  # the ledger is saved with the checkpoint
    assert "data_secret" not in ledger and "data_secret" in json.loads((checkpoint / "dp_resume.json").read_text())
    resumed = make_trainer(tmp_path / "c", model=tiny_bert(seed=99), max_steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.accountant.steps == 4
    assert resumed.privacy_report()["epsilon"] == pytest.approx(straight.privacy_report()["epsilon"], rel=1e-9)
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, msg=f"{name} differs after resume")


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
    if bound == 2:  # G given: nothing was read from the data
        assert resumed.accountant.pure_dp == first.accountant.pure_dp == []
        assert resumed.privacy_report()["epsilon"] == pytest.approx(first.privacy_report()["epsilon"], rel=1e-9)
    else:  # the draw made at construction read the data too: its ε stays in the ledger
        assert resumed.accountant.pure_dp == first.accountant.pure_dp + [
            {"label": "contribution_bound (drawn at construction, replaced on resume)", "epsilon": 0.1}]
        # the plan left no room for it, so training stops before the target is exceeded
        assert resumed.privacy_report()["epsilon"] <= 8.0 and resumed.accountant.steps < first.accountant.steps


def test_resume_named_in_the_arguments_draws_the_bound_once(tmp_path):
    """With `resume_from_checkpoint` in the arguments, G is drawn once, with the checkpoint's secret."""
    data = user_dataset(num_users=40, max_rows=9, seed=4)
    first = make_trainer(tmp_path / "a", dataset=data, contribution_bound="auto", save_strategy="steps",
                         save_steps=2, noise_seed=11)
    first.train()
    checkpoint = str(tmp_path / "a" / "out" / "checkpoint-2")
    resumed = make_trainer(tmp_path / "b", dataset=data, contribution_bound="auto", noise_seed=12,
                           resume_from_checkpoint=checkpoint)
    assert resumed._data_secret == first._data_secret  # before any draw
    assert resumed.partition.contribution_bound == first.partition.contribution_bound
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.accountant.pure_dp == first.accountant.pure_dp  # ε_G counted once
    assert resumed.privacy_report()["epsilon"] == pytest.approx(first.privacy_report()["epsilon"], rel=1e-9)
    with pytest.raises(ValueError, match="does not exist"):  # a wrong path is refused before any draw
        make_trainer(tmp_path / "c", dataset=data, resume_from_checkpoint=str(tmp_path / "nowhere"))


def test_resuming_a_run_stopped_by_its_budget_takes_no_step(tmp_path):
    first = make_trainer(tmp_path, max_steps=200, noise_multiplier=1.0, target_epsilon=1.5,
                         save_strategy="steps", save_steps=1, save_total_limit=1)
    first.train()
    steps = first.accountant.steps
    assert 0 < steps < 200 and first.privacy_report()["epsilon"] <= 1.5
    checkpoint = str(tmp_path / "out" / f"checkpoint-{steps}")
    for _ in range(2):  # each resume used to take one more step
        resumed = make_trainer(tmp_path / "again", model=tiny_bert(seed=7), max_steps=200, noise_multiplier=1.0,
                               target_epsilon=1.5)
        resumed.train(resume_from_checkpoint=checkpoint)
        assert resumed.accountant.steps == resumed.state.global_step == steps
        assert resumed.privacy_report()["epsilon"] <= 1.5
        assert os.path.isfile(tmp_path / "again" / "out" / "README.md")  # the card is still written
    for (name, a), (_, b) in zip(first.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, msg=f"{name} was updated after the budget was spent")


# ---- a checkpoint of another configuration or version is refused --------------------------------------------------


def test_resume_with_other_privacy_arguments_is_refused(tmp_path):
    first = make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    other = make_trainer(tmp_path, max_steps=4, max_grad_norm=0.5)
    with pytest.raises(ValueError, match="different privacy configuration.*max_grad_norm"):
        other.train(resume_from_checkpoint=checkpoint)
    longer = make_trainer(tmp_path, max_steps=4)  # at a target ε, σ follows the steps: the refusal names the steps
    with pytest.raises(ValueError, match=r"trained for max_steps=2, this run plans max_steps=4: .*noise_multiplier.* "
                                         r"resume with max_steps=2") as error:
        longer.train(resume_from_checkpoint=checkpoint)
    assert "\n" not in str(error.value)
    os.remove(os.path.join(checkpoint, "dp_ledger.json"))
    same = make_trainer(tmp_path, max_steps=4)
    with pytest.raises(ValueError, match="incomplete or was not written by a DP trainer: it has no dp_ledger.json"):
        same.train(resume_from_checkpoint=checkpoint)


def test_a_checkpoint_of_the_older_single_file_format_is_refused_clearly(tmp_path):
    """Checkpoints of hf_dp before the ledger/resume-state split held one `dp_state.json`: refused in one line."""
    make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    (checkpoint / "dp_resume.json").rename(checkpoint / "dp_state.json")
    resumed = make_trainer(tmp_path, max_steps=4)
    with pytest.raises(ValueError, match="written by an older hf_dp .dp_state.json.") as error:
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert "\n" not in str(error.value) and resumed.accountant.steps == 0


# ---- the ledger is checked against its checkpoint -----------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_4(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ledger")
    make_trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=2).train()
    return tmp_path / "out" / "checkpoint-4"


def _tampered(tmp_path, checkpoint, name, edit, redigest=True):
    """A copy of the checkpoint with `name` (the ledger or the resume state) edited; `redigest` re-signs the edit
    as a forger would (then only the consistency checks can catch it)."""
    copy = tmp_path / "checkpoint-4"
    shutil.copytree(checkpoint, copy)
    path = copy / name
    if callable(edit):
        content = json.loads(path.read_text())
        edit(content)
        path.write_text(json.dumps(content))
        if redigest:
            resume = json.loads((copy / "dp_resume.json").read_text())
            resume["ledger_digest"] = digest(json.loads((copy / "dp_ledger.json").read_text()))
            resume["digest"] = digest({key: value for key, value in resume.items() if key != "digest"})
            (copy / "dp_resume.json").write_text(json.dumps(resume))
    else:
        path.write_text(edit)
    return str(copy)


def _set_steps(ledger, steps):
    ledger["accountant"]["segments"][0]["steps"] = steps


def _set_sigma(ledger):
    ledger["accountant"]["segments"][0]["effective_noise_multiplier"] *= 2


@pytest.mark.parametrize(
    "name, edit, redigest, message",
    [
        ("dp_ledger.json", lambda ledger: ledger["accountant"].update(segments=[]), True,
         "records 0 steps but .* global step 4"),
        ("dp_ledger.json", lambda ledger: _set_steps(ledger, 2), True, "records 2 steps but .* global step 4"),
        ("dp_ledger.json", _set_sigma, True, "segment 0 has .* not this run's"),
        ("dp_ledger.json", lambda ledger: _set_steps(ledger, 3), False, "does not match the digest"),
        ("dp_ledger.json", lambda ledger: ledger["accountant"]["pure_dp"].append({"label": "x", "epsilon": 1.0}),
         False, "does not match the digest"),
        ("dp_ledger.json", '{"format": 1, "delta": 0.0', None, "cannot read the privacy ledger"),
        ("dp_resume.json", lambda resume: resume.pop("digest"), False, "not a DPTrainer resume state"),
        ("dp_resume.json", lambda resume: resume.update(data_secret="0" * 32), False, "integrity digest"),
        ("dp_resume.json", '{"format": 1, "config": {"privacy_un', None, "cannot read the resume state"),
        ("dp_resume.json", "[]", None, "not a DPTrainer resume state"),
    ],
    ids=["emptied-segments", "edited-steps", "edited-sigma", "edited-no-digest", "edited-pure-dp", "truncated-ledger",
         "no-digest", "edited-secret", "truncated-resume", "empty-list"],
)
def test_a_ledger_that_does_not_match_its_checkpoint_is_refused(tmp_path, checkpoint_4, name, edit, redigest,
                                                                message):
    checkpoint = _tampered(tmp_path, checkpoint_4, name, edit, redigest)
    trainer = make_trainer(tmp_path, max_steps=4)
    with pytest.raises(ValueError, match=f"{name}.*{message}") as error:
        trainer._resume_privacy_state(checkpoint)
    assert "\n" not in str(error.value)
    assert trainer.accountant.steps == 0


def test_an_emptied_ledger_does_not_restart_epsilon(tmp_path, checkpoint_4):
    checkpoint = _tampered(tmp_path, checkpoint_4, "dp_ledger.json",
                            lambda ledger: ledger["accountant"].update(segments=[]))
    trainer = make_trainer(tmp_path, max_steps=4)
    with pytest.raises(ValueError, match="records 0 steps"):
        trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.accountant.steps == 0


def test_an_intact_ledger_is_restored(tmp_path, checkpoint_4):
    trainer = make_trainer(tmp_path, max_steps=4)
    trainer._resume_privacy_state(str(checkpoint_4))
    assert trainer.accountant.steps == 4


# ---- one live run per output_dir ----------------------------------------------------------------------------------


def test_a_second_live_run_in_the_same_output_dir_is_refused(tmp_path):
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    lock_path = output_dir / LOCK_FILE
    with open(lock_path, "a+") as other_run:  # another live run holds the lock
        fcntl.flock(other_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
        trainer = make_trainer(tmp_path, max_steps=1)
        with pytest.raises(RuntimeError, match="output_dir=.* in use by another live training run"):
            trainer.train()
        assert trainer.accountant.steps == 0 and not (output_dir / "README.md").exists()
        fcntl.flock(other_run, fcntl.LOCK_UN)
    assert lock_path.exists()  # a stale lock file (lock not held) does not block
    make_trainer(tmp_path, max_steps=1).train()
    make_trainer(tmp_path, max_steps=1).train()  # nor does a finished run
    assert not lock_path.exists()  # a finished run leaves no lock file in its model folder


def test_the_lock_is_released_when_training_fails(tmp_path):
    model = tiny_bert()
    stale = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    trainer = DPTrainer(model=model, args=make_args(tmp_path), train_dataset=user_dataset(),
                        data_collator=pad_collator, optimizers=(torch.optim.SGD(stale, lr=0.1), None))
    with pytest.raises(RuntimeError, match="no gradient"):
        trainer.train()
    assert not (tmp_path / "out" / LOCK_FILE).exists()  # released and removed
    with open(tmp_path / "out" / LOCK_FILE, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
