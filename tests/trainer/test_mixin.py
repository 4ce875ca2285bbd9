"""DPTrainerMixin on a Trainer subclass other than Trainer: the same DP run, the subclass's own behaviour kept."""

from __future__ import annotations

import pytest
import torch
from trainer_fixtures import make_args, make_trainer, pad_collator, tiny_bert, user_dataset
from transformers import Trainer

from hf_dp import DPTrainer
from hf_dp.trainer import DPTrainerMixin, trainer_base


class LoggingTrainer(Trainer):
    """A Trainer subclass with behaviour of its own (it records every log line)."""

    def __init__(self, *args, **kwargs):
        self.seen_logs = []
        super().__init__(*args, **kwargs)

    def log(self, logs, start_time=None):
        self.seen_logs.append(dict(logs))
        super().log(logs, start_time)


class DPLoggingTrainer(DPTrainerMixin, LoggingTrainer):
    pass


def test_the_mixin_on_a_subclass_trains_exactly_like_dptrainer(tmp_path):
    plain = make_trainer(tmp_path / "a", model=tiny_bert(seed=3))
    plain.train()
    mixed = DPLoggingTrainer(model=tiny_bert(seed=3), args=make_args(tmp_path / "b"), train_dataset=user_dataset(),
                             data_collator=pad_collator)
    mixed.train()
    assert trainer_base(DPLoggingTrainer) is LoggingTrainer and trainer_base(DPTrainer) is Trainer
    assert mixed.privacy_report()["epsilon"] == plain.privacy_report()["epsilon"]
    for (name, a), (_, b) in zip(plain.model.named_parameters(), mixed.model.named_parameters()):
        torch.testing.assert_close(a, b, msg=f"{name} differs between DPTrainer and the mixin")
    # the subclass's own log override ran, after the mixin added the privacy fields
    assert any("dp/epsilon" in logs for logs in mixed.seen_logs)
    assert (tmp_path / "b" / "out" / "README.md").is_file()  # the privacy card


def test_a_base_trainer_that_overrides_compute_loss_is_refused_unless_declared(tmp_path):
    class BatchLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class DPBatchLossTrainer(DPTrainerMixin, BatchLossTrainer):
        pass

    with pytest.raises(ValueError, match=r"DPBatchLossTrainer overrides compute_loss \(in BatchLossTrainer\)"):
        DPBatchLossTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=user_dataset(),
                           data_collator=pad_collator)

    class DeclaredTrainer(DPTrainerMixin, BatchLossTrainer):
        known_loss_overrides = (BatchLossTrainer,)  # this DP trainer computes the per-example losses itself

    DeclaredTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=user_dataset(),
                    data_collator=pad_collator)


def test_the_mixin_without_a_trainer_is_refused():
    class NotATrainer(DPTrainerMixin):
        pass

    with pytest.raises(TypeError, match="takes DPTrainerMixin but no transformers.Trainer"):
        trainer_base(NotATrainer)


def test_model_init_given_positionally_is_still_refused(tmp_path):
    with pytest.raises(ValueError, match="model_init"):
        DPLoggingTrainer(tiny_bert(), make_args(tmp_path), pad_collator, user_dataset(), None, None, tiny_bert)
