"""hf_dp.trainer: the mixin finds its Trainer base, takes a checked copy of the arguments, and turns off the Trainer
hooks that would undo the DP step (end to end: tests/trainer)."""
from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_dp import DPTrainer
from hf_dp.trainer import DPTrainerMixin, trainer_base
from trainer_fixtures import make_args, pad_collator, tiny_bert, user_dataset


class LoggingTrainer(Trainer):
    """Some Trainer subclass a user already has."""


class DPLoggingTrainer(DPTrainerMixin, LoggingTrainer):
    pass


def test_the_base_is_the_first_trainer_after_the_mixin():
    assert trainer_base(DPTrainer) is Trainer
    assert trainer_base(DPLoggingTrainer) is LoggingTrainer

    class NoTrainer(DPTrainerMixin):
        pass

    with pytest.raises(TypeError, match=r"NoTrainer takes DPTrainerMixin but no transformers.Trainer: declare it as "
                                        r"class NoTrainer\(DPTrainerMixin, <a Trainer subclass>\)"):
        trainer_base(NoTrainer)


def test_the_trainer_takes_a_checked_copy_of_the_arguments(tmp_path):
    args = make_args(tmp_path)
    copied = args.checked_copy()
    assert copied is not args and copied.ignore_data_skip is True and args.ignore_data_skip is False
    args.max_grad_norm = -1.0  # set after construction: checked again
    with pytest.raises(ValueError, match="max_grad_norm=-1.0"):
        args.checked_copy()
    tokens = make_args(tmp_path)
    tokens.include_num_input_tokens_seen = True
    with pytest.raises(ValueError, match="include_num_input_tokens_seen: the exact number of tokens"):
        tokens.checked_copy()


def test_plain_training_arguments_and_a_missing_dataset_are_refused(tmp_path):
    with pytest.raises(TypeError, match="DPTrainer needs DPTrainingArguments"):
        DPTrainer(model=tiny_bert(), args=TrainingArguments(str(tmp_path), use_cpu=True),
                  train_dataset=user_dataset(), data_collator=pad_collator)
    with pytest.raises(ValueError, match="needs a train_dataset with a user column"):
        DPTrainer(model=tiny_bert(), args=make_args(tmp_path), data_collator=pad_collator)


def test_trainer_hooks_that_would_undo_the_dp_step_are_off():
    model = torch.nn.Linear(2, 2)
    assert DPTrainerMixin._clip_grad_norm(None, model) is None  # global clipping would rescale the noised sum
    assert DPTrainerMixin._get_grad_norm(None, model) is None  # the noised gradient's norm: not logged
    assert DPTrainerMixin._get_num_items_in_batch(None, [{"labels": torch.ones(3)}], "cpu") is None
    assert DPTrainerMixin.floating_point_ops(None, {"input_ids": torch.ones(4, 9)}) == 0  # data-dependent: 0
    with pytest.raises(ValueError, match="hyperparameter_search: every trial trains on the private data"):
        DPTrainerMixin.hyperparameter_search(None, n_trials=3)
