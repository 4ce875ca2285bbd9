"""What a new user gets wrong first: each mistake gets one line naming the field and what to change."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from hf_dp import DPTrainer
from trainer_fixtures import make_args, make_trainer, pad_collator, tiny_bert, user_dataset


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("noise_seed", "abc", r"noise_seed='abc': use a non-negative integer"),
        ("expected_batch_size", math.nan, r"expected_batch_size=nan: set an integer >= 1"),
        ("target_epsilon", math.inf, r"target_epsilon=inf: ε must be a finite number > 0"),
        ("num_train_epochs", 0, r"num_train_epochs=0 with max_steps=-1: nothing to train; set num_train_epochs > 0"),
    ],
)
def test_a_bad_privacy_field_is_one_line_at_the_arguments_and_at_the_trainer(tmp_path, field, value, message):
    overrides = {field: value, "max_steps": -1} if field == "num_train_epochs" else {field: value}
    with pytest.raises(ValueError, match=message) as error:
        make_args(tmp_path, **overrides)
    one_line(error)
    # Set after the arguments were built (no __post_init__): DPTrainer checks again, before numpy or the planner.
    args = make_args(tmp_path, max_steps=-1) if field == "num_train_epochs" else make_args(tmp_path)
    setattr(args, field, value)
    with pytest.raises(ValueError, match=message) as error:
        DPTrainer(model=tiny_bert(), args=args, train_dataset=user_dataset(), data_collator=pad_collator)
    one_line(error)


def test_several_bad_fields_are_listed_one_per_line(tmp_path):
    with pytest.raises(ValueError) as error:
        make_args(tmp_path, noise_seed="abc", target_epsilon=math.inf)
    lines = str(error.value).splitlines()
    assert lines[0] == "Invalid DPTrainingArguments:" and len(lines) == 3


def mixed_id_dataset() -> Dataset:
    rows = [dict(row) for row in user_dataset(num_users=6)]
    for row in rows:
        number = int(row["user_id"].split("-")[1])
        row["user_id"] = number if number % 2 else f"user-{number}"  # ints and strings in one column
    return Dataset.from_generator(lambda: iter(rows))  # datasets keeps such a column as Json


def test_user_ids_of_mixed_types_are_refused(tmp_path):
    dataset = mixed_id_dataset()
    assert {type(u) for u in dataset["user_id"]} == {int, str}
    with pytest.raises(ValueError, match=r"user_id_column 'user_id' mixes user ids of different types: "
                                         r"string \('user-0'\), number \(1\).*str\(user_id\)") as error:
        make_trainer(tmp_path, dataset=dataset)
    one_line(error)


def test_a_list_of_rows_is_refused_saying_how_to_build_a_dataset(tmp_path):
    with pytest.raises(TypeError, match=r"got list: build one, e\.g\. datasets\.Dataset\.from_list") as error:
        make_trainer(tmp_path, dataset=[dict(row) for row in user_dataset()])
    one_line(error)


@pytest.mark.parametrize("kind", ["datasets", "torch"])
def test_a_streamed_dataset_is_refused_saying_how_to_materialise_it(tmp_path, kind):
    if kind == "datasets":
        stream = user_dataset().to_iterable_dataset()
    else:
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(user_dataset())

        stream = Stream()
    with pytest.raises(TypeError, match=r"streamed .*IterableDataset.*Dataset\.from_generator") as error:
        make_trainer(tmp_path, dataset=stream)
    one_line(error)


def test_the_advised_materialisation_trains(tmp_path):
    stream = user_dataset().to_iterable_dataset()
    n = 60
    dataset = Dataset.from_generator(lambda: (yield from stream.take(n)), features=stream.features)
    trainer = make_trainer(tmp_path, dataset=dataset, max_steps=1)
    trainer.train()
    assert trainer.accountant.steps == 1


def test_a_compiled_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"torch\.compile wrapper.*model\._orig_mod") as error:
        make_trainer(tmp_path, model=torch.compile(tiny_bert()))
    one_line(error)


def test_uploading_checkpoints_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"hub_strategy='checkpoint'.*every_save") as error:
        make_args(tmp_path, push_to_hub=True, hub_strategy="checkpoint", hub_model_id="me/model")
    one_line(error)
