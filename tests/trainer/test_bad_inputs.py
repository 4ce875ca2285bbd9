"""Bad inputs, grouped by class: each is refused before the first step with one line naming what to change.

The tables are the pattern for new settings: a privacy field of `DPTrainingArguments` without a row in
`BAD_FIELD_VALUES` fails `test_every_privacy_field_has_bad_values_tested`.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from torch import nn
from trainer_fixtures import (
    VOCAB,
    PooledClassifier,
    frozen,
    make_args,
    make_trainer,
    one_line,
    pad_collator,
    tiny_bert,
    tiny_llama,
    user_dataset,
)
from transformers import TrainingArguments

from hf_dp import DPTrainer, DPTrainingArguments

# ---- arguments: every privacy field, its bad values, and the words of the refusal ----------------------------------

BAD_FIELD_VALUES = {
    "target_epsilon": [(0.0, "target_epsilon="), (-1.0, "target_epsilon="), (math.inf, "target_epsilon="),
                       (math.nan, "target_epsilon=")],
    "target_delta": [(0.0, "target_delta="), (1.0, "target_delta="), (math.nan, "target_delta=")],
    "privacy_unit": [("person", "privacy_unit=")],
    "user_id_column": [("", "user_id_column=")],
    "sampling": [("random", "sampling=")],
    "expected_batch_size": [(0, "expected_batch_size="), (2.5, "expected_batch_size="), (math.nan, "expected_batch")],
    "contribution_bound": [(0, "contribution_bound="), ("many", "contribution_bound="), (-3, "contribution_bound=")],
    "contribution_bound_epsilon": [(0.0, "contribution_bound_epsilon="), (math.inf, "contribution_bound_epsilon=")],
    "adaptive_clipping": [("yes", "adaptive_clipping="), (1, "adaptive_clipping=")],
    "target_unclipped_quantile": [(0.0, "target_unclipped_quantile="), (1.0, "target_unclipped_quantile=")],
    "clipping_learning_rate": [(0.0, "clipping_learning_rate="), (math.inf, "clipping_learning_rate=")],
    "clipping_count_noise": [(0.0, "clipping_count_noise="), (-1.0, "clipping_count_noise=")],
    "noise_multiplier": [(0.0, "noise_multiplier="), (math.nan, "noise_multiplier="), (1e9, "noise_multiplier=")],
    "noise_seed": [(-1, "noise_seed="), (1.5, "noise_seed="), ("abc", "noise_seed=")],
    "private_logging": [("no", "private_logging="), (0, "private_logging=")],
    "secure_noise": [("yes", "secure_noise="), (1, "secure_noise=")],
    "redraw_rows": [("yes", "redraw_rows="), (1, "redraw_rows=")],
    "logging_noise_ratio": [(0.0, "logging_noise_ratio="), (math.inf, "logging_noise_ratio=")],
    "max_loss": [(0.0, "max_loss="), (1e300, "max_loss="), (math.nan, "max_loss=")],
}
# Trainer fields DP training constrains, with what the refusal names.
BAD_TRAINER_VALUES = [
    ({"max_grad_norm": 1e300}, "max_grad_norm="), ({"max_grad_norm": 0.0}, "max_grad_norm="),
    ({"per_device_train_batch_size": -1}, "per_device_train_batch_size="),
    ({"per_device_train_batch_size": 0, "sampling": "els"}, "per_device_train_batch_size="),
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps="),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor="),
    ({"privacy_unit": "example", "contribution_bound": 1}, "contribution_bound=1 with privacy_unit='example'"),
    ({"sampling": "els", "contribution_bound": None}, "contribution_bound=None with sampling='els'"),
    ({"max_steps": 0, "num_train_epochs": 0}, "nothing to train"),
    ({"sampling": "els", "contribution_bound": 300},
     "contribution_bound=300 with sampling='els': .* tested up to G = 256; set contribution_bound <= 256"),
]


def privacy_fields() -> list[str]:
    base = {field.name for field in dataclasses.fields(TrainingArguments)}
    return [field.name for field in dataclasses.fields(DPTrainingArguments) if field.name not in base]


def test_every_privacy_field_has_bad_values_tested():
    missing = [name for name in privacy_fields() if name not in BAD_FIELD_VALUES]
    assert not missing, f"add bad values for {missing} to BAD_FIELD_VALUES (the refusal each must give)"


@pytest.mark.parametrize("field, value, words", [(field, value, words) for field, rows in BAD_FIELD_VALUES.items()
                                                  for value, words in rows])
def test_a_bad_privacy_field_is_refused_in_one_line(tmp_path, field, value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")) as error:
        make_args(tmp_path, **{field: value})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides, words", BAD_TRAINER_VALUES)
def test_a_trainer_field_dp_constrains_is_refused_in_one_line(tmp_path, overrides, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")) as error:
        make_args(tmp_path, **overrides)
    assert "\n" not in str(error.value)


def test_a_field_set_after_construction_is_checked_by_the_trainer(tmp_path):
    args = make_args(tmp_path)
    args.private_logging = "no"
    with pytest.raises(ValueError, match="private_logging='no'"):
        DPTrainer(model=tiny_bert(), args=args, train_dataset=user_dataset(), data_collator=pad_collator)


# ---- magnitudes the accountant or float32 cannot carry -------------------------------------------------------------


def test_a_noise_multiplier_too_small_for_the_accountant_is_refused_at_construction(tmp_path):
    for target in (None, 8.0):
        with pytest.raises(ValueError, match="noise_multiplier=1e-06 .*too small for the accountant|first step alone"):
            make_trainer(tmp_path, noise_multiplier=1e-6, target_epsilon=target)


# ---- data ------------------------------------------------------------------------------------------------------------


def test_dict_user_ids_are_refused(tmp_path):
    data = user_dataset(user_ids=[{"id": i} for i in range(24)])
    with pytest.raises(ValueError, match="holds dicts .* a user id must be one value"):
        make_trainer(tmp_path, dataset=data)


def test_rows_the_collator_cannot_batch_are_refused_in_one_line(tmp_path):
    """No processing_class, no data_collator: Trainer's default collator cannot stack rows of several lengths."""
    with pytest.raises(ValueError, match="cannot batch the first training rows .* need a padding collator") as error:
        DPTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=user_dataset())
    assert "\n" not in str(error.value)


def test_training_data_with_no_labelled_token_is_refused(tmp_path):
    data = user_dataset(causal_lm=True).map(lambda row: {"labels": [-100] * len(row["labels"])})
    with pytest.raises(ValueError, match="No label in the training data is a target"):
        make_trainer(tmp_path, model=tiny_llama(), dataset=data)


def test_causal_lm_labels_on_the_first_token_only_are_refused(tmp_path):
    """A causal LM never predicts a row's first token: labels there alone (e.g. max_length=1) train on noise."""
    data = user_dataset(causal_lm=True).map(
        lambda row: {"labels": row["labels"][:1] + [-100] * (len(row["labels"]) - 1)})
    with pytest.raises(ValueError, match="only the first token of a row, which a causal LM never predicts"):
        make_trainer(tmp_path, model=tiny_llama(), dataset=data)
    make_trainer(tmp_path, dataset=user_dataset().map(lambda row: {"labels": row["labels"]}))  # class labels: fine


@pytest.mark.parametrize("kind, words", [
    ("float32", "class labels are floats .* cast the label column to int"),
    ("string", "labels are strings .* map each class to an integer id"),
])
def test_class_labels_of_the_wrong_type_are_refused_in_one_line(tmp_path, kind, words):
    from datasets import Value

    data = user_dataset().cast_column("labels", Value(kind))  # 0.0 / 1.0, or "0" / "1"
    with pytest.raises(ValueError, match=words) as error:
        make_trainer(tmp_path, dataset=data)
    assert "\n" not in str(error.value)


def test_class_labels_outside_the_head_are_refused(tmp_path):
    data = user_dataset().map(lambda row, i: {"labels": 5 if i == 3 else row["labels"]}, with_indices=True)
    with pytest.raises(ValueError, match=r"class label\(s\) outside 0..1 \(e.g. 5\): the model's head has 2 outputs"):
        make_trainer(tmp_path, dataset=data)


def test_evaluation_on_training_users_is_refused(tmp_path):
    train = user_dataset(num_users=24)
    held_out = user_dataset(num_users=4, seed=1, user_ids=[f"other-{i}" for i in range(4)])
    make_trainer(tmp_path, dataset=train)  # no eval set: fine
    for eval_dataset in (train.select(range(5)), {"val": held_out, "train": train.select(range(5))}):
        with pytest.raises(ValueError, match="shares .* user\\(s\\) with the training data"):
            DPTrainer(model=tiny_bert(), args=make_args(tmp_path, eval_strategy="steps", eval_steps=2),
                      train_dataset=train, eval_dataset=eval_dataset, data_collator=pad_collator)
    DPTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=train, eval_dataset=held_out,
              data_collator=pad_collator)


def test_evaluation_ids_of_another_type_than_the_training_ids_are_refused(tmp_path):
    """Integer training ids against string evaluation ids: 3 and '3' never match, so the shared-users check would
    pass on the very users it should catch."""
    train = user_dataset(num_users=24, user_ids=list(range(24)))
    same_people = user_dataset(num_users=4, seed=1, user_ids=[str(i) for i in range(4)])
    with pytest.raises(ValueError, match="not of the training data's type .* give both one type") as error:
        DPTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=train, eval_dataset=same_people,
                  data_collator=pad_collator)
    assert "\n" not in str(error.value)
    others = user_dataset(num_users=4, seed=1, user_ids=list(range(100, 104)))
    DPTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=train, eval_dataset=others,
              data_collator=pad_collator)


# ---- models --------------------------------------------------------------------------------------------------------


def test_prompt_learning_is_refused(tmp_path):
    from peft import PromptTuningConfig, get_peft_model

    model = get_peft_model(tiny_llama(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match="peft prompt learning"):
        make_trainer(tmp_path, model=model, dataset=user_dataset(causal_lm=True))


def test_a_model_on_the_meta_device_is_refused(tmp_path):
    with torch.device("meta"):
        model = tiny_bert()
    with pytest.raises(ValueError, match="on the 'meta' device"):
        make_trainer(tmp_path, model=model)


def test_tuple_outputs_are_refused(tmp_path):
    model = tiny_bert()
    model.config.return_dict = False
    with pytest.raises(ValueError, match="return_dict=False"):
        make_trainer(tmp_path, model=model)


class BareTensorForward(PooledClassifier):
    def forward(self, input_ids, attention_mask=None, labels=None):
        return super().forward(input_ids, attention_mask).logits


class TupleForward(PooledClassifier):
    def forward(self, input_ids, attention_mask=None, labels=None):
        return (super().forward(input_ids, attention_mask).logits,)


@pytest.mark.parametrize("model_class, returned", [(BareTensorForward, "Tensor"), (TupleForward, "tuple")])
def test_a_forward_without_logits_is_refused_in_one_line(tmp_path, model_class, returned):
    with pytest.raises(ValueError, match=f"forward returned {returned}, with no logits: .* return a ModelOutput") as e:
        make_trainer(tmp_path, model=model_class(nn.Identity()))
    one_line(e)


def test_a_fully_frozen_model_is_refused_as_nothing_to_train(tmp_path):
    with pytest.raises(ValueError, match="Every parameter of the model is frozen .* nothing to train") as error:
        make_trainer(tmp_path, model=frozen(tiny_bert()))
    one_line(error)


def test_float16_on_the_cpu_is_named_as_the_cause(tmp_path):
    """tiny_bert in float16 on the CPU fails the per-example check; the refusal says fp16 on the CPU, not mixing."""
    from hf_dp import UnsupportedLayerError

    with pytest.raises(UnsupportedLayerError, match="^The model is in float16 on the CPU.* train in float32") as error:
        make_trainer(tmp_path, model=tiny_bert().half())
    one_line(error)


def test_the_batch_norm_refusal_advises_what_trains(tmp_path):
    """GroupNorm is refused while trainable (no clipping rule), so the advice is LayerNorm or a frozen GroupNorm,
    and that advice trains."""
    with pytest.raises(ValueError, match="replace it with LayerNorm \\(trainable or frozen\\) or a frozen GroupNorm"):
        make_trainer(tmp_path, model=PooledClassifier(nn.BatchNorm1d(8)))
    make_trainer(tmp_path, model=PooledClassifier(nn.LayerNorm(8)))
    make_trainer(tmp_path, model=PooledClassifier(frozen(nn.GroupNorm(2, 8))))


# ---- the token ids, read from the Arrow column before step 1 ------------------------------------------------------


def test_empty_input_ids_are_refused_before_the_probe(tmp_path):
    data = user_dataset().map(lambda row: {"input_ids": []})
    with pytest.raises(ValueError, match="input_ids is empty in every row of the training data") as error:
        make_trainer(tmp_path, dataset=data)
    one_line(error)


def test_a_token_id_beyond_the_vocabulary_is_refused_before_step_1(tmp_path):
    """One id = VOCAB in the last row: an IndexError at whichever step samples it, refused at construction."""
    last = len(user_dataset()) - 1
    data = user_dataset().map(lambda row, i: {"input_ids": row["input_ids"] + [VOCAB] * (i == last)},
                              with_indices=True)
    with pytest.raises(ValueError, match=f"token id {VOCAB}, beyond the model's vocabulary of {VOCAB} embeddings "
                                         ".*resize_token_embeddings") as error:
        make_trainer(tmp_path, dataset=data)
    one_line(error)
    negative = user_dataset().map(lambda row, i: {"input_ids": [-1] * (i == last) + row["input_ids"]},
                                  with_indices=True)
    with pytest.raises(ValueError, match="negative token id"):
        make_trainer(tmp_path, dataset=negative)
    make_trainer(tmp_path, dataset=user_dataset().map(lambda row: {"input_ids": row["input_ids"] + [VOCAB - 1]}))


# ---- the trainer's own inputs: the class, output_dir, the user column, the card -----------------------------------


@pytest.mark.parametrize("column", ["labels", "input_ids"])
def test_a_user_column_the_model_reads_is_named_not_the_collator(tmp_path, column):
    with pytest.raises(ValueError, match=f"user_id_column='{column}' names a column the model reads") as error:
        make_trainer(tmp_path, user_id_column=column)
    assert "collator" not in one_line(error)


def test_unknown_privacy_card_kwargs_are_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="privacy_card_kwargs has no field 'datset_name' \\(did you mean "
                                         "'dataset_name'\\?\\)") as error:
        DPTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=user_dataset(),
                  data_collator=pad_collator, privacy_card_kwargs={"datset_name": "tickets"})
    one_line(error)
    trainer = DPTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=user_dataset(),
                        data_collator=pad_collator, privacy_card_kwargs={"dataset_name": "tickets"})
    assert trainer.privacy_card_kwargs == {"dataset_name": "tickets"}


class TimedStep(DPTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen = type(inputs).__name__
        return super().training_step(model, inputs, num_items_in_batch)


class PlainStep(DPTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return torch.zeros(())  # never hands the batch to the DP step


def test_a_training_step_override_must_hand_the_batch_to_the_dp_step(tmp_path):
    with pytest.raises(ValueError, match="PlainStep overrides training_step without calling super\\(\\).training_step"
                                         ".* receives a LogicalBatch") as error:
        PlainStep(model=tiny_bert(), args=make_args(tmp_path), train_dataset=user_dataset(), data_collator=pad_collator)
    one_line(error)
    trainer = TimedStep(model=tiny_bert(), args=make_args(tmp_path, max_steps=1), train_dataset=user_dataset(),
                        data_collator=pad_collator)
    trainer.train()
    assert trainer.seen == "LogicalBatch" and trainer.budget.steps == 1


def _unwritable(tmp_path) -> str:
    """A folder nothing can be created in: a read-only one, or (root ignores modes) one under /proc."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        return str(folder / "out")
    return "/proc/hf_dp_out"


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_an_output_dir_that_cannot_hold_the_run_is_refused_before_trainer_makes_it(tmp_path, kind):
    if kind == "file":
        (tmp_path / "taken").write_text("x")
        output_dir, words = str(tmp_path / "taken"), "is a file, not a folder"
    else:
        output_dir, words = _unwritable(tmp_path), "nothing can be written in"
    with pytest.raises(ValueError, match=f"output_dir=.*{words}.*choose a.* --output_dir") as error:
        make_trainer(tmp_path, output_dir=output_dir)
    one_line(error)


def test_fp16_from_the_accelerate_config_is_refused_as_fp16_true_is():
    """`mixed_precision: fp16` in an `accelerate launch` config reaches the trainer's accelerator, not `args.fp16`."""
    from types import SimpleNamespace

    from hf_dp import preflight

    with pytest.raises(ValueError, match="mixed_precision is fp16 .* set mixed_precision: bf16"):
        preflight.check_mixed_precision(SimpleNamespace(mixed_precision="fp16"))
    for fine in ("no", "bf16"):
        preflight.check_mixed_precision(SimpleNamespace(mixed_precision=fine))
