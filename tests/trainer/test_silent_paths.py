"""Paths that used to train or report without a word while the guarantee did not hold: each now refused in one line
(or, for a regression head with integer labels, given the loss the docs promise)."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch
from datasets import Value
from trainer_fixtures import make_args, make_trainer, one_line, pad_collator, tiny_bert, user_dataset
from transformers import Trainer

from hf_dp import DPTrainer
from hf_dp.arguments import PRIVACY_FIELDS
from hf_dp.trainer import DPTrainerMixin

# ---- a data collator that changes the order of the rows -----------------------------------------------------------


def reversed_rows(examples):
    return pad_collator(examples[::-1])


def sorted_by_length(examples):
    return pad_collator(sorted(examples, key=lambda example: len(example["input_ids"])))


def shuffled(examples):
    examples = list(examples)
    random.shuffle(examples)
    return pad_collator(examples)


@pytest.mark.parametrize("collator", [reversed_rows, sorted_by_length, shuffled])
def test_a_collator_that_reorders_rows_is_refused_at_construction(tmp_path, collator):
    """Rows are matched to their users by position: reordered, they would be clipped under other users."""
    with pytest.raises(ValueError, match=f"data collator \\({collator.__name__}\\) returned the row given at "
                                         "position \\d+ at position \\d+") as error:
        DPTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=user_dataset(), data_collator=collator)
    assert "keep the order" in one_line(error)


# ---- the mixin's place in the bases -------------------------------------------------------------------------------


def test_the_mixin_after_trainer_in_the_bases_is_refused_when_the_class_is_defined():
    with pytest.raises(TypeError, match=r"class Bad: Trainer comes before DPTrainerMixin in its bases.*put "
                                        r"DPTrainerMixin first, e.g. class Bad\(DPTrainerMixin, Trainer\)") as error:
        class Bad(Trainer, DPTrainerMixin):
            pass
    one_line(error)

    class Good(DPTrainerMixin, Trainer):  # and subclasses of a DP trainer stay allowed
        pass

    class Sub(DPTrainer):
        pass

    with pytest.raises(TypeError, match="class Worse: LoggingTrainer comes before DPTrainerMixin"):
        class LoggingTrainer(Trainer):
            pass

        class Worse(LoggingTrainer, Sub):
            pass


# ---- the privacy arguments, frozen once the plan is made ----------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("frozen"), max_steps=1)


@pytest.mark.parametrize("field", sorted(PRIVACY_FIELDS))
def test_every_privacy_field_set_after_construction_is_refused(built, field):
    before = getattr(built.args, field)
    with pytest.raises(ValueError, match=f"^{field}=.* set after the DP trainer was built") as error:
        setattr(built.args, field, 0.125 if before != 0.125 else 0.25)
    one_line(error)
    assert getattr(built.args, field) == before
    setattr(built.args, field, before)  # the same value: nothing changes, nothing refused


def test_the_card_keeps_the_planned_target_and_other_fields_and_copies_stay_free(tmp_path):
    args, other = make_args(tmp_path, max_steps=1), make_args(tmp_path, target_epsilon=1.0)  # (built first: a new
    # TrainingArguments resets accelerate's state)
    trainer = DPTrainer(model=tiny_bert(), args=args, train_dataset=user_dataset(), data_collator=pad_collator)
    with pytest.raises(ValueError, match="target_epsilon=1.0 set after the DP trainer was built .it planned with 8.0"):
        trainer.args.target_epsilon = 1.0
    with pytest.raises(ValueError, match="args replaced after construction") as error:
        trainer.args = other
    one_line(error)
    trainer.args.logging_steps = 5  # not a privacy field
    args.target_epsilon = 3.0  # the caller's own arguments were copied, not frozen
    copy.copy(trainer.args).target_epsilon = 2.0  # nor are copies and pickles of the trainer's
    pickle.loads(pickle.dumps(trainer.args)).noise_multiplier = 2.0
    trainer.train()
    assert trainer.privacy_report()["target_epsilon"] == 8.0


# ---- evaluation on training users, after construction -------------------------------------------------------------


def test_evaluate_and_predict_on_training_users_are_refused(tmp_path):
    train, held_out = user_dataset(), user_dataset(user_ids=[f"other-{i}" for i in range(5)])
    trainer = make_trainer(tmp_path, dataset=train, max_steps=1)
    for call, words in ((lambda: trainer.evaluate(eval_dataset=train), "eval_dataset shares 24 user"),
                        (lambda: trainer.evaluate(eval_dataset={"again": train}), "again shares 24 user"),
                        (lambda: trainer.predict(train), "test_dataset shares 24 user")):
        with pytest.raises(ValueError, match=words) as error:
            call()
        one_line(error)
    assert "eval_loss" in trainer.evaluate(eval_dataset=held_out)
    trainer.eval_dataset = train  # set after construction: checked when evaluate() falls back to it
    with pytest.raises(ValueError, match="eval_dataset shares 24 user"):
        trainer.evaluate()


# ---- unnoised metrics computed from the data ----------------------------------------------------------------------


def test_memory_metrics_are_refused(tmp_path):
    with pytest.raises(ValueError, match="skip_memory_metrics=False: transformers' memory metrics") as error:
        make_trainer(tmp_path, skip_memory_metrics=False)
    one_line(error)


# ---- a regression head with integer labels ------------------------------------------------------------------------


def test_a_regression_head_with_integer_labels_trains_on_squared_error(tmp_path):
    """num_labels=1 is regression whatever the labels' dtype (transformers' problem_type rule): integer targets
    train exactly as the same targets as floats."""
    integers = user_dataset().map(lambda row: {"labels": row["input_ids"][0] % 3})
    floats = integers.cast_column("labels", Value("float32"))
    assert isinstance(integers[0]["labels"], int) and isinstance(floats[0]["labels"], float)
    runs = []
    for name, dataset in (("int", integers), ("float", floats)):
        trainer = make_trainer(tmp_path / name, model=tiny_bert(num_labels=1), dataset=dataset, max_steps=2)
        before = trainer.model.classifier.weight.detach().clone()
        trainer.train()
        assert not torch.equal(before, trainer.model.classifier.weight)
        runs.append(trainer)
    for (name, a), (_, b) in zip(runs[0].model.named_parameters(), runs[1].model.named_parameters()):
        torch.testing.assert_close(a, b, msg=f"{name} differs between integer and float targets")
