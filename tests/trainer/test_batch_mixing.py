"""A model whose layers mix the examples of a batch is refused before any step (its clipped sum would move by more
than C); per-example layers and dropout train."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import TrainerCallback

from tiny_models import with_dropout
from trainer_fixtures import ChannelFirst, MeanCentering, PooledClassifier, frozen, make_args, make_trainer, \
    one_line, tiny_bert, tiny_llama, user_dataset


# ---- batch-mixing layers are refused before any step --------------------------------------------------------------


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


# ---- per-example layers and dropout train -------------------------------------------------------------------------


def test_per_example_layers_pass(tmp_path):
    trainer = make_trainer(tmp_path, model=PooledClassifier(nn.LayerNorm(8)), max_steps=1)
    trainer.train()
    assert trainer.accountant.steps == 1


def test_trainer_with_dropout_and_causal_lm_trains(tmp_path):
    for trainer in (make_trainer(tmp_path, model=with_dropout("bert"), max_steps=1),
                    make_trainer(tmp_path / "lm", model=tiny_llama(), dataset=user_dataset(causal_lm=True),
                                 max_steps=1)):
        before = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
        trainer.train()
        assert trainer.accountant.steps == 1
        assert any(not torch.equal(before[name], param) for name, param in trainer.model.named_parameters())


# ---- NEFTune, and any hook the base trainer attaches in train() ---------------------------------------------------


def test_neftune_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="neftune_noise_alpha=5: NEFTune scales its embedding noise by the batch's "
                                         "padded length") as error:
        make_args(tmp_path, neftune_noise_alpha=5)
    assert "\n" not in str(error.value)


def test_a_hook_the_base_trainer_attaches_in_train_is_probed_before_step_one(tmp_path):
    """NEFTune set after construction (past the arguments' check): `Trainer.train` attaches its hook, and the probe
    of the model as it trains refuses it before any step is taken or any ε spent."""
    trainer = make_trainer(tmp_path, model=tiny_llama(), dataset=user_dataset(causal_lm=True), max_steps=2)
    trainer.neftune_noise_alpha = 5.0
    with pytest.raises(ValueError, match="depends on the batch's padded length"):
        trainer.train()
    assert trainer.accountant.steps == 0


# ---- a forward pass that depends on the batch's number of rows ----------------------------------------------------


def _add_sine_of_rows(model):
    """Adds 2·sin(B) to the logits, B the batch's rows: one user's presence moves every other user's output."""
    return model.classifier.register_forward_hook(lambda module, args, output: output + 2 * math.sin(output.shape[0]))


def test_a_row_count_hook_registered_before_construction_is_refused(tmp_path):
    model = tiny_bert()
    _add_sine_of_rows(model)
    with pytest.raises(ValueError, match="depends on the batch's number of rows") as error:
        make_trainer(tmp_path, model=model)
    one_line(error)


class _HookAtTrainBegin(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _add_sine_of_rows(model)


def test_a_row_count_hook_a_callback_registers_in_on_train_begin_is_refused_before_any_step(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.add_callback(_HookAtTrainBegin())
    before = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match="another output alone than in a batch of 3 rows") as error:
        trainer.train()
    one_line(error)
    assert trainer.accountant.steps == 0
    assert all(torch.equal(before[name], param) for name, param in trainer.model.named_parameters())
