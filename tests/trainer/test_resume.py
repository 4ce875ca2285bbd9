"""Every number hf_dp releases is covered by the ε it states (issue #10): refusals before any step."""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import shutil

import numpy as np
import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
from transformers.modeling_outputs import SequenceClassifierOutput

from hf_dp import DPTrainer
from hf_dp.batch_independence import check_batch_independence
from hf_dp.data import examples_per_user, partition_by_user
from hf_dp.checkpoint import LOCK_FILE, digest
from tiny_models import VOCAB as BATCH_VOCAB
from tiny_models import model_inputs, tiny_batch, tiny_model
from trainer_fixtures import VOCAB, make_args, make_trainer, pad_collator, tiny_bert, tiny_llama, user_dataset


# ---- 6. layers that mix the examples of a batch -------------------------------------------------------------


class MeanCentering(nn.Module):
    """Subtracts the batch mean: no parameter, no known type, caught only by the probe."""

    def forward(self, hidden):
        return hidden - hidden.mean(dim=0, keepdim=True)


class ChannelFirst(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, hidden):  # (B, d) -> (B, 1, d) for InstanceNorm1d
        return self.inner(hidden.unsqueeze(1)).squeeze(1)


class PooledClassifier(nn.Module):
    """Embedding -> masked mean -> `mixer` -> linear head."""

    def __init__(self, mixer: nn.Module, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, width)
        self.mixer = mixer
        self.head = nn.Linear(width, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        return SequenceClassifierOutput(logits=self.head(self.mixer(pooled)))


def frozen(module: nn.Module) -> nn.Module:
    for param in module.parameters():
        param.requires_grad_(False)
    return module


@pytest.mark.parametrize(
    "mixer, message",
    [
        (frozen(nn.BatchNorm1d(8)), "'mixer' \\(BatchNorm1d\\)"),
        (nn.BatchNorm1d(8, affine=False), "BatchNorm1d"),
        (nn.BatchNorm1d(8), "BatchNorm1d"),  # trainable: refused as batch-mixing, not only as unsupported
        (nn.SyncBatchNorm(8), "SyncBatchNorm"),
        (ChannelFirst(nn.InstanceNorm1d(1, track_running_stats=True)), "InstanceNorm1d"),
        (MeanCentering(), "moved the other examples' outputs"),
    ],
    ids=["frozen-batchnorm", "batchnorm-no-affine", "trainable-batchnorm", "syncbatchnorm", "instancenorm-stats",
         "batch-mean"],
)
def test_batch_mixing_models_are_refused_before_any_step(tmp_path, mixer, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, model=PooledClassifier(mixer))


def test_per_example_layers_pass(tmp_path):
    trainer = make_trainer(tmp_path, model=PooledClassifier(nn.LayerNorm(8)), max_steps=1)
    trainer.train()
    assert trainer.accountant.steps == 1


def _with_dropout(arch: str):
    torch.manual_seed(0)
    if arch == "bert":
        return BertForSequenceClassification(BertConfig(
            vocab_size=BATCH_VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=2))
    return GPT2LMHeadModel(GPT2Config(vocab_size=BATCH_VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_probe_passes_with_dropout_and_leaves_no_trace(arch):
    model = _with_dropout(arch).eval()
    features = model_inputs(tiny_batch(head="causal_lm" if arch == "gpt2" else "seq_cls", seed=3))
    rng = torch.get_rng_state()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    check_batch_independence(model, features)
    assert torch.equal(rng, torch.get_rng_state())  # the training RNG stream is untouched
    assert not model.training  # train/eval mode restored
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())


@pytest.mark.parametrize("arch, head, lora", [("gpt2", "causal_lm", False), ("llama", "causal_lm", True),
                                              ("bert", "seq_cls", False), ("qwen2", "seq_cls", True)])
def test_probe_passes_on_transformers(arch, head, lora):
    check_batch_independence(tiny_model(arch, head, lora=lora), model_inputs(tiny_batch(head=head)))


def test_trainer_with_dropout_and_causal_lm_trains(tmp_path):
    make_trainer(tmp_path, model=_with_dropout("bert"), max_steps=1).train()
    make_trainer(tmp_path / "lm", model=tiny_llama(), dataset=user_dataset(causal_lm=True), max_steps=1).train()


# ---- 7. NaN user ids ------------------------------------------------------------------------------------------


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


def test_numpy_and_pandas_missing_ids_are_dropped():
    from datasets import Dataset

    from hf_dp.data import _as_keys

    import pandas as pd
    assert _as_keys([np.float32("nan"), np.nan, pd.NA, None, 3, [1, 2]]) == [None, None, None, None, 3, (1, 2)]
    frame = pd.DataFrame({"user_id": pd.array([1, None, 2, None], dtype="Int64"), "text": list("abcd")})
    assert partition_by_user(Dataset.from_pandas(frame), "user_id", None, b"secret").num_users == 2


# ---- 8. the target ε is checked before every step -------------------------------------------------------------


def test_a_first_step_above_the_target_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="first step alone.*raise --target_epsilon or --noise_multiplier"):
        make_trainer(tmp_path, noise_multiplier=0.3, target_epsilon=1.0)


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


# ---- 9. the ledger is checked against its checkpoint ----------------------------------------------------------


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
    ledger["accountant"]["segments"][0]["noise_multiplier"] *= 2


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


# ---- 10. non-finite settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"max_grad_norm": math.inf}, "max_grad_norm"),
        ({"max_grad_norm": math.nan}, "max_grad_norm"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"target_epsilon": math.inf}, "target_epsilon"),
        ({"target_epsilon": math.nan}, "target_epsilon"),
        ({"target_delta": math.nan}, "target_delta"),
        ({"target_delta": math.inf}, "target_delta"),
        ({"noise_multiplier": math.inf}, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"expected_batch_size": math.nan}, "expected_batch_size"),
        ({"expected_batch_size": 2.5}, "expected_batch_size"),
        ({"noise_seed": "abc"}, "noise_seed"),
        ({"noise_seed": 1.5}, "noise_seed"),
        ({"noise_seed": True}, "noise_seed"),
        ({"noise_seed": -1}, "noise_seed"),
    ],
)
def test_non_finite_or_malformed_settings_are_refused(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=f"{field}="):
        make_args(tmp_path, **overrides)


def test_integral_float_batch_size_is_accepted(tmp_path):
    assert make_args(tmp_path, expected_batch_size=16.0).expected_batch_size == 16


# ---- 11. one live run per output_dir --------------------------------------------------------------------------


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


def test_the_lock_is_released_when_training_fails(tmp_path):
    model = tiny_bert()
    stale = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    trainer = DPTrainer(model=model, args=make_args(tmp_path), train_dataset=user_dataset(),
                        data_collator=pad_collator, optimizers=(torch.optim.SGD(stale, lr=0.1), None))
    with pytest.raises(RuntimeError, match="no gradient"):
        trainer.train()
    with open(tmp_path / "out" / LOCK_FILE) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again


# ---- 13. ELS needs a contribution bound -----------------------------------------------------------------------


def test_els_without_a_contribution_bound_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="contribution_bound=None with sampling='els'.*integer or 'auto'"):
        make_args(tmp_path, sampling="els", contribution_bound=None)
    make_args(tmp_path, sampling="uls", contribution_bound=None)  # ULS may keep every row
    make_args(tmp_path, privacy_unit="example", contribution_bound=None)
