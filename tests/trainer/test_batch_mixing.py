"""A model whose layers mix the examples of a batch is refused before any step (its clipped sum would move by more
than C); per-example layers and dropout train."""

from __future__ import annotations

import pytest
from torch import nn

from tiny_models import with_dropout
from trainer_fixtures import ChannelFirst, MeanCentering, PooledClassifier, frozen, make_trainer, tiny_llama, \
    user_dataset


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
    make_trainer(tmp_path, model=with_dropout("bert"), max_steps=1).train()
    make_trainer(tmp_path / "lm", model=tiny_llama(), dataset=user_dataset(causal_lm=True), max_steps=1).train()
