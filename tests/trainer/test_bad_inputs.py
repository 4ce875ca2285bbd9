"""Bad inputs, grouped by class: each is refused before the first step with one line naming what to change.

The tables are the pattern for new settings: a privacy field of `DPTrainingArguments` without a row in
`BAD_FIELD_VALUES` fails `test_every_privacy_field_has_bad_values_tested`.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from trainer_fixtures import make_args, make_trainer, pad_collator, tiny_bert, tiny_llama, user_dataset
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
