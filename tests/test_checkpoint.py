"""hf_dp.checkpoint: the ledger and resume state a checkpoint holds, read back only when intact and matching, and the
lock that keeps one live run per output_dir."""
from __future__ import annotations

import fcntl
import json
import os

import pytest

from hf_dp import accounting
from hf_dp.card import LEDGER_FILE
from hf_dp.checkpoint import (LOCK_FILE, RESUME_FILE, check_saved_run, digest, ledger_record, output_dir_lock,
                              read_checkpoint, same, write_checkpoint)
from hf_dp.clipping.adaptive import QuantileTracker
from hf_dp.accounting.floating_point import NOISE_REACH
from hf_dp.privacy_plan import plan_privacy
from trainer_fixtures import make_args, user_partition

PARTITION = user_partition([1, 2, 3] * 10, contribution_bound=3)


def saved_run(folder, args, steps=3, global_step=None, tracker=None):
    """A checkpoint folder as DPTrainer leaves it: Trainer's state, then the ledger and the resume state."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": steps if global_step is None else global_step}, f)
    for name in ("optimizer.pt", "scheduler.pt"):  # Trainer's optimizer and scheduler states (their content unread)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"")
    plan = plan_privacy(args, PARTITION, noised_elements=1000)
    accountant = accounting.PrivacyAccountant()
    accountant.step(sample_rate=plan.sample_rate, noise_multiplier=plan.effective_noise_multiplier, steps=steps)
    write_checkpoint(str(folder), ledger=ledger_record(plan, args, accountant), fingerprint=plan.fingerprint(args),
                     data_secret="0123abcd", quantile_tracker=tracker)
    return plan, accountant


@pytest.fixture
def args(tmp_path):
    return make_args(tmp_path, max_steps=10, contribution_bound=3)


def edit(path, change):
    content = json.loads(path.read_text())
    change(content)
    path.write_text(json.dumps(content))


# ---- a checkpoint round trip ----------------------------------------------------------------------------------------


def test_what_is_written_is_read_back_and_matches_the_run(tmp_path, args):
    folder = tmp_path / "checkpoint-3"
    plan, accountant = saved_run(folder, args)
    ledger = json.loads((folder / LEDGER_FILE).read_text())
    assert ledger == {"format": 1, "delta": plan.delta, "privacy_unit": "user", "mechanism": "uls",
                      "sampling": "uls", "accountant": accountant.state_dict(),
                      "noise": {"draws_per_step": 1000 + 2, "tail_per_draw": 2.0**-159, "reach": NOISE_REACH}}
    assert "data_secret" not in ledger  # the ledger is published beside the card; the secret never is
    saved = read_checkpoint(str(folder))
    assert saved.accountant.history == accountant.history and saved.data_secret == "0123abcd"
    assert saved.config == plan.fingerprint(args) and saved.quantile_tracker is None
    assert check_saved_run(saved, plan, args) is None  # fixed C: no tracker to restore


def test_an_adaptive_run_gets_its_tracker_back(tmp_path):
    args = make_args(tmp_path, max_steps=10, contribution_bound=3, adaptive_clipping=True)
    tracker = QuantileTracker(target_quantile=0.5, learning_rate=0.2, count_noise=0.4, norm=0.37, steps=3)
    plan, _ = saved_run(tmp_path / "checkpoint-3", args, tracker=tracker)
    restored = check_saved_run(read_checkpoint(str(tmp_path / "checkpoint-3")), plan, args)
    assert restored.to_dict() == tracker.to_dict()
    off_by_one = QuantileTracker(target_quantile=0.5, learning_rate=0.2, count_noise=0.4, norm=0.37, steps=2)
    saved_run(tmp_path / "checkpoint-b", args, tracker=off_by_one)
    with pytest.raises(ValueError, match="its adaptive clipping state has .* not this run's"):
        check_saved_run(read_checkpoint(str(tmp_path / "checkpoint-b")), plan, args)


def test_a_save_that_cannot_write_says_so(tmp_path):
    (tmp_path / "checkpoint-3").write_text("a file where the folder should be")
    with pytest.raises(RuntimeError, match="checkpoint-3 failed .*earlier checkpoints are intact"):
        write_checkpoint(str(tmp_path / "checkpoint-3"), ledger={}, fingerprint={}, data_secret="s",
                         quantile_tracker=None)


# ---- an edited, truncated or mismatched checkpoint is refused -------------------------------------------------------


@pytest.mark.parametrize("name, change, message", [
    (LEDGER_FILE, lambda ledger: ledger["accountant"]["segments"][0].update(steps=30), "does not match the digest"),
    (RESUME_FILE, lambda resume: resume.update(data_secret="f" * 8), "integrity digest does not match"),
    (RESUME_FILE, lambda resume: resume["config"].update(max_grad_norm=9.0), "integrity digest does not match"),
    (RESUME_FILE, lambda resume: resume.pop("digest"), "not a DPTrainer resume state"),
], ids=["ledger-steps", "secret", "config", "no-digest"])
def test_an_edited_file_is_refused(tmp_path, args, name, change, message):
    folder = tmp_path / "checkpoint-3"
    saved_run(folder, args)
    edit(folder / name, change)
    with pytest.raises(ValueError, match=f"{name}.*{message}"):
        read_checkpoint(str(folder))


def test_missing_truncated_and_older_files_are_refused(tmp_path, args):
    folder = tmp_path / "checkpoint-3"
    saved_run(folder, args)
    (folder / LEDGER_FILE).write_text('{"format": 1, "acc')
    with pytest.raises(ValueError, match=f"{LEDGER_FILE}: cannot read the privacy ledger .*JSONDecodeError"):
        read_checkpoint(str(folder))
    (folder / LEDGER_FILE).unlink()
    with pytest.raises(ValueError, match=r"is incomplete or was not written by a DP trainer: it has no dp_ledger"):
        read_checkpoint(str(folder))
    (folder / RESUME_FILE).rename(folder / "dp_state.json")
    with pytest.raises(ValueError, match=r"written by an older hf_dp \(dp_state.json\)"):
        read_checkpoint(str(folder))
    (folder / "dp_state.json").unlink()
    with pytest.raises(ValueError, match=r"it has no dp_ledger.json or dp_resume.json"):
        read_checkpoint(str(folder))


def test_a_ledger_that_does_not_match_trainers_step_is_refused(tmp_path, args):
    saved_run(tmp_path / "checkpoint-4", args, steps=3, global_step=4)
    with pytest.raises(ValueError, match="records 3 steps but its checkpoint is at global step 4"):
        read_checkpoint(str(tmp_path / "checkpoint-4"))


def test_a_checkpoint_of_another_configuration_or_plan_is_refused(tmp_path, args):
    folder = tmp_path / "checkpoint-3"
    plan, _ = saved_run(folder, args)
    saved = read_checkpoint(str(folder))
    other = make_args(tmp_path, max_steps=10, contribution_bound=3, max_grad_norm=0.5)
    message = r"different privacy configuration \(max_grad_norm: checkpoint 1.0 vs now 0.5\)"
    with pytest.raises(ValueError, match=message):
        check_saved_run(saved, plan_privacy(other, PARTITION, noised_elements=1000), other)
    saved.accountant.step(sample_rate=plan.sample_rate, noise_multiplier=2 * plan.effective_noise_multiplier)
    with pytest.raises(ValueError, match="segment 1 has .* not this run's"):
        check_saved_run(saved, plan, args)


def test_values_that_went_through_json_compare_to_a_relative_1e_9():
    assert same(0.1 + 0.2, 0.3) and same(3, 3) and same(None, None) and same("uls", "uls")
    assert not same(1.0, 1.0 + 1e-6) and not same(None, 1.0) and not same(1.0, None)
    assert digest({"a": 1, "b": [1, 2]}) == digest({"b": [1, 2], "a": 1})  # canonical: key order is irrelevant
    assert digest({"a": 1, "b": [1, 2]}) != digest({"a": 1, "b": [2, 1]})


# ---- one live run per output_dir --------------------------------------------------------------------------------


def test_the_output_dir_lock_refuses_a_second_live_run_and_is_released_after(tmp_path):
    output_dir = tmp_path / "out"
    with output_dir_lock(str(output_dir)):
        assert (output_dir / LOCK_FILE).exists()
        with open(output_dir / LOCK_FILE) as other:  # another run trying the same lock
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not (output_dir / LOCK_FILE).exists()  # released and removed on exit: no stray file in the model folder
    with open(output_dir / LOCK_FILE, "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another live run
        with pytest.raises(RuntimeError, match="in use by another live training run"):
            with output_dir_lock(str(output_dir)):
                pass
        fcntl.flock(other, fcntl.LOCK_UN)
    with pytest.raises(KeyError):  # released when the run fails too
        with output_dir_lock(str(output_dir)):
            raise KeyError("training failed")
    assert not (output_dir / LOCK_FILE).exists()
    (output_dir / LOCK_FILE).write_text("")  # a leftover lock file (a crashed run's) does not block
    with output_dir_lock(str(output_dir)):
        pass
    assert not (output_dir / LOCK_FILE).exists()
    with output_dir_lock(str(tmp_path / "other"), enabled=False):  # ranks other than 0 take no lock
        assert not (tmp_path / "other").exists()
