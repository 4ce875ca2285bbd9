"""What a new user gets wrong first is refused before step 1, in one line naming the field or object and what to
change."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from hf_dp import DPTrainer, UnsupportedLayerError
from trainer_fixtures import make_args, make_trainer, one_line, pad_collator, tiny_bert, user_dataset


# ---- privacy fields, at the arguments and again at the trainer ----------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("noise_seed", "abc", r"noise_seed='abc': use an integer in \[0, 2\*\*512\)"),
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
    # Set after the arguments were built (no __post_init__): DPTrainer checks again, before numpy or `compare`.
    args = make_args(tmp_path, max_steps=-1) if field == "num_train_epochs" else make_args(tmp_path)
    setattr(args, field, value)
    with pytest.raises(ValueError, match=message) as error:
        DPTrainer(model=tiny_bert(), args=args, train_dataset=user_dataset(), data_collator=pad_collator)
    one_line(error)


def test_torch_compile_set_after_construction_is_refused_by_the_trainer(tmp_path):
    args = make_args(tmp_path)
    args.torch_compile = True
    with pytest.raises(ValueError, match="torch_compile=True") as error:
        DPTrainer(model=tiny_bert(), args=args, train_dataset=user_dataset(), data_collator=pad_collator)
    assert "\n" not in str(error.value)


# ---- settings the data cannot support -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dataset_kwargs, arg_overrides, message",
    [
        ({}, {"user_id_column": "author"}, "no user column 'author'"),
        ({"user_ids": ["only-one"]}, {"expected_batch_size": 1}, "1 user"),
        ({}, {"target_epsilon": 1e-6, "target_delta": 1e-6, "max_steps": 500, "contribution_bound": 4},
         "Raise --target_epsilon"),
        ({}, {"expected_batch_size": 1000}, "lower --expected_batch_size"),
        ({}, {"target_delta": 0.5}, "(?i)lower.*delta"),
    ],
    ids=["no-user-column", "one-user", "unreachable-epsilon", "sample-rate-above-1", "delta-too-large"],
)
def test_bad_inputs_give_clear_errors(tmp_path, dataset_kwargs, arg_overrides, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, dataset=user_dataset(**dataset_kwargs), **arg_overrides)


# ---- the training data --------------------------------------------------------------------------------------------


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


# ---- the model and the optimizer ----------------------------------------------------------------------------------


def test_a_compiled_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"torch\.compile wrapper.*model\._orig_mod") as error:
        make_trainer(tmp_path, model=torch.compile(tiny_bert()))
    one_line(error)


def test_unsupported_trainable_layer_is_refused_before_training(tmp_path):
    model = tiny_bert()
    model.classifier.scale = torch.nn.Parameter(torch.ones(2))  # a raw parameter no rule covers
    original_forward = model.classifier.forward
    model.classifier.forward = lambda x: original_forward(x) * model.classifier.scale
    with pytest.raises(UnsupportedLayerError, match="classifier"):
        make_trainer(tmp_path, model=model)


def test_no_gradient_reaching_the_optimizer_stops_training(tmp_path):
    model = tiny_bert()
    stale = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    trainer = DPTrainer(model=model, args=make_args(tmp_path), train_dataset=user_dataset(),
                        data_collator=pad_collator, optimizers=(torch.optim.SGD(stale, lr=0.1), None))
    with pytest.raises(RuntimeError, match="no gradient"):
        trainer.train()
