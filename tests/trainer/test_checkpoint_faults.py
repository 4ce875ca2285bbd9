"""Checkpoints under faults: interrupted saves, a full disk, just-in-time saves on SIGTERM. Every resume either
continues the uninterrupted run exactly or refuses in one line that names the checkpoint and why."""

from __future__ import annotations

import errno
import logging
import shutil

import pytest
import torch
from trainer_fixtures import make_trainer, tiny_bert
from transformers import TrainerCallback

from hf_dp import checkpoint


def _same_weights(a, b):
    for (name, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(x, y, msg=f"{name} differs")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("straight"), model=tiny_bert(seed=1), max_steps=4)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved")
    make_trainer(out, model=tiny_bert(seed=1), max_steps=4, save_strategy="steps", save_steps=2).train()
    return out / "out"


def test_resume_true_skips_an_incomplete_newest_checkpoint_and_says_so(tmp_path, saved, straight, caplog):
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    (out / "checkpoint-4" / "dp_ledger.json").unlink()  # a save killed before the ledger was written
    resumed = make_trainer(tmp_path, model=tiny_bert(seed=99), max_steps=4)
    with caplog.at_level(logging.WARNING, logger="hf_dp.trainer"):
        resumed.train(resume_from_checkpoint=True)
    assert "checkpoint-4: " in caplog.text and "incomplete" in caplog.text
    assert "Resuming from" in caplog.text and "checkpoint-2" in caplog.text
    assert resumed.accountant.steps == 4
    assert resumed.privacy_report()["epsilon"] == pytest.approx(straight.privacy_report()["epsilon"], rel=1e-9)
    _same_weights(straight, resumed)


@pytest.mark.parametrize("damage, message", [
    (lambda folder: (folder / "dp_ledger.json").unlink(), "is incomplete or was not written by a DP trainer: it has "
                                                          "no dp_ledger.json"),
    (lambda folder: (folder / "trainer_state.json").unlink(), "it has no trainer_state.json"),
    (lambda folder: (folder / "checkpoint-is-incomplete.txt").write_text("x"), "is incomplete .Trainer's"),
    (lambda folder: shutil.rmtree(folder), "does not exist"),
    (lambda folder: _truncate(folder / "model.safetensors"), "its weights model.safetensors are truncated or corrupt"),
], ids=["no-ledger", "no-trainer-state", "jit-marker", "missing-folder", "truncated-weights"])
def test_an_explicit_incomplete_checkpoint_is_named_as_such(tmp_path, saved, damage, message):
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    damage(out / "checkpoint-4")
    trainer = make_trainer(tmp_path, max_steps=4)
    with pytest.raises(ValueError, match=message) as error:
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert "\n" not in str(error.value) and trainer.accountant.steps == 0


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a save killed mid-file: the header promises more than is there


def test_resume_true_skips_a_checkpoint_with_truncated_weights(tmp_path, saved, straight, caplog):
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    _truncate(out / "checkpoint-4" / "model.safetensors")
    resumed = make_trainer(tmp_path, model=tiny_bert(seed=99), max_steps=4)
    with caplog.at_level(logging.WARNING, logger="hf_dp.trainer"):
        resumed.train(resume_from_checkpoint=True)
    assert "checkpoint-4: " in caplog.text and "model.safetensors are truncated" in caplog.text
    assert "checkpoint-2" in caplog.text and resumed.accountant.steps == 4
    _same_weights(straight, resumed)


@pytest.mark.parametrize("missing, state", [("optimizer.pt", "optimizer"), ("scheduler.pt", "scheduler")])
def test_a_checkpoint_without_its_optimizer_or_scheduler_state_is_refused(tmp_path, saved, missing, state):
    """Trainer resumes silently without `scheduler.pt` (the learning rate restarts): refused, as without the
    optimizer's state."""
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    (out / "checkpoint-2" / missing).unlink()
    trainer = make_trainer(tmp_path, model=tiny_bert(seed=1), max_steps=4)
    with pytest.raises(ValueError, match=f"checkpoint-2 holds no {state} state") as error:
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert "\n" not in str(error.value) and trainer.accountant.steps == 0


def test_no_complete_checkpoint_lists_each_reason(tmp_path, saved):
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    for step in (2, 4):
        (out / f"checkpoint-{step}" / "dp_resume.json").unlink()
    with pytest.raises(ValueError, match="No complete checkpoint.*checkpoint-4: .*checkpoint-2: "):
        make_trainer(tmp_path, max_steps=4).train(resume_from_checkpoint=True)


def test_a_full_disk_during_a_save_says_so_and_keeps_the_previous_checkpoint(tmp_path, straight, monkeypatch):
    real_replace, calls = checkpoint.os.replace, []

    def full_disk_at_second_save(source, target):
        calls.append(target)
        if "checkpoint-4" in str(target):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(source, target)

    monkeypatch.setattr(checkpoint.os, "replace", full_disk_at_second_save)
    trainer = make_trainer(tmp_path, model=tiny_bert(seed=1), max_steps=4, save_strategy="steps", save_steps=2)
    with pytest.raises(RuntimeError, match="checkpoint-4 failed .OSError.*No space left.*earlier checkpoints are "
                                           "intact"):
        trainer.train()
    monkeypatch.undo()
    resumed = make_trainer(tmp_path, model=tiny_bert(seed=99), max_steps=4)
    resumed.train(resume_from_checkpoint=True)  # checkpoint-4 is incomplete: checkpoint-2 is taken
    assert resumed.accountant.steps == 4
    _same_weights(straight, resumed)


def test_a_full_disk_inside_safetensors_is_one_line_too(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (not an OSError)."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                              'left on device" })')

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    trainer = make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    with pytest.raises(RuntimeError, match="checkpoint-2 failed .SafetensorError.*No space left.*earlier "
                                           "checkpoints are intact") as error:
        trainer.train()
    assert "\n" not in str(error.value) and isinstance(error.value, OSError)  # recipes print it as one line


class _SigtermDuringStep(TrainerCallback):
    """What Trainer's just-in-time checkpointing does after SIGTERM: a save requested while a step is running is
    made before that step's optimizer update (`on_pre_optimizer_step`), then training stops."""

    def __init__(self, at_step: int):
        self.at_step, self.trainer = at_step, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            callbacks = self.trainer.callback_handler.callbacks
            jit = next(cb for cb in callbacks if type(cb).__name__ == "JITCheckpointCallback")
            jit.jit_manager.is_checkpoint_requested = True


def test_a_just_in_time_checkpoint_mid_step_carries_the_ledger_of_its_weights(tmp_path, straight):
    trainer = make_trainer(tmp_path, model=tiny_bert(seed=1), max_steps=4, enable_jit_checkpoint=True)
    sigterm = _SigtermDuringStep(at_step=2)
    sigterm.trainer = trainer
    trainer.add_callback(sigterm)
    trainer.train()
    folder = tmp_path / "out" / "checkpoint-2"
    saved = checkpoint.read_checkpoint(str(folder))  # complete, and its ledger matches its global step
    assert saved.accountant.steps == 2 and trainer.accountant.steps == 3  # the step in flight is not in it
    resumed = make_trainer(tmp_path / "again", model=tiny_bert(seed=99), max_steps=4)
    resumed.train(resume_from_checkpoint=str(folder))
    assert resumed.accountant.steps == 4
    assert resumed.privacy_report()["epsilon"] == pytest.approx(straight.privacy_report()["epsilon"], rel=1e-9)
    _same_weights(straight, resumed)


def test_resuming_from_an_older_checkpoint_says_what_the_new_ledger_does_not_cover(tmp_path, saved, caplog):
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    trainer = make_trainer(tmp_path, max_steps=4)
    with caplog.at_level(logging.WARNING, logger="hf_dp.checkpoint"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert "Resuming from checkpoint-2 although checkpoint-4 exist" in caplog.text
    assert "not in the resumed ledger" in caplog.text
