"""DPTrainer keeps Trainer's contract: its signature, per-example custom losses, model cards, the Trainer features that
keep working and those refused, and the report's vocabulary."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from huggingface_hub.repocard import metadata_load
from transformers import DataCollatorWithFlattening, Trainer

from hf_dp import DPTrainer
from hf_dp.trainer import DPTrainerMixin
from hf_dp.hub import check_privacy_card
from hf_dp.vocabulary import MECHANISMS
from trainer_fixtures import TinyDecoder, make_args, make_trainer, one_line, pad_collator, tiny_bert, tiny_llama, \
    user_dataset


# ---- Trainer's signature ------------------------------------------------------------------------------------------


def test_init_keeps_trainers_parameters_in_trainers_order():
    ours = list(inspect.signature(DPTrainer.__init__).parameters.values())
    theirs = list(inspect.signature(Trainer.__init__).parameters.values())
    shared = [p for p in ours if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert [(p.name, p.kind, p.default) for p in shared] == [(p.name, p.kind, p.default) for p in theirs]
    assert [p.name for p in ours if p.kind is inspect.Parameter.KEYWORD_ONLY] == ["privacy_card_kwargs"]


def test_create_model_card_takes_trainers_parameters():
    ours = inspect.signature(DPTrainer.create_model_card).parameters
    theirs = inspect.signature(Trainer.create_model_card).parameters
    assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in theirs.values()]


def test_positional_arguments_mean_what_they_mean_for_trainer(tmp_path):
    data = user_dataset()
    held_out = user_dataset(seed=3, user_ids=[f"held-out-{i}" for i in range(6)])
    trainer = DPTrainer(tiny_bert(), make_args(tmp_path), pad_collator, data, held_out)
    assert trainer.data_collator is pad_collator
    assert trainer.eval_dataset is not None and trainer.partition.num_examples == len(data)


# ---- a per-example compute_loss_func ------------------------------------------------------------------------------


def per_example_cross_entropy(outputs, labels, num_items_in_batch=None):
    return F.cross_entropy(outputs.logits.float(), labels, reduction="none")


def trained_parameters(tmp_path, **kwargs):
    trainer = DPTrainer(model=tiny_bert(), args=make_args(tmp_path, max_steps=2), train_dataset=user_dataset(),
                        data_collator=pad_collator, **kwargs)
    trainer.train()
    return trainer, [p.detach().clone() for p in trainer.model.parameters()]


def test_a_per_example_compute_loss_func_is_honoured(tmp_path):
    calls = []

    def counted(outputs, labels, num_items_in_batch=None):
        calls.append(labels.shape[0])
        return per_example_cross_entropy(outputs, labels)

    _, built_in = trained_parameters(tmp_path / "a")
    _, custom = trained_parameters(tmp_path / "b", compute_loss_func=counted)
    assert len(calls) > 1  # the probe at construction, then every micro-batch
    for a, b in zip(built_in, custom):
        torch.testing.assert_close(a, b)  # the same loss as the built-in one gives the same run

    def doubled(outputs, labels, num_items_in_batch=None):
        return 2 * per_example_cross_entropy(outputs, labels)

    _, other = trained_parameters(tmp_path / "c", compute_loss_func=doubled)
    assert any(not torch.equal(a, b) for a, b in zip(built_in, other))  # its loss is the one differentiated


@pytest.mark.parametrize(
    "loss_func, message",
    [
        (lambda outputs, labels, num_items_in_batch=None: per_example_cross_entropy(outputs, labels).mean(),
         r"compute_loss_func returned \(\) for a batch of 4 examples.*one loss per example, shape \(4,\)"),
        (lambda outputs, labels, num_items_in_batch=None: F.cross_entropy(outputs.logits, labels, reduction="sum")
         / num_items_in_batch, r"compute_loss_func failed on the first training rows \(TypeError"),
    ],
    ids=["batch-mean", "needs-num-items"],
)
def test_a_compute_loss_func_without_per_example_losses_is_refused(tmp_path, loss_func, message):
    with pytest.raises(ValueError, match=message) as error:
        DPTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=user_dataset(),
                  data_collator=pad_collator, compute_loss_func=loss_func)
    one_line(error)


def test_a_compute_loss_func_with_packed_rows_is_refused(tmp_path):
    with pytest.raises(ValueError, match="compute_loss_func with packed rows") as error:
        DPTrainer(model=tiny_llama(), args=make_args(tmp_path), train_dataset=user_dataset(causal_lm=True),
                  data_collator=DataCollatorWithFlattening(), compute_loss_func=per_example_cross_entropy)
    one_line(error)


def test_a_compute_loss_override_is_refused(tmp_path):
    class MyTrainer(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(ValueError, match="MyTrainer overrides compute_loss.*compute_loss_func") as error:
        MyTrainer(model=tiny_bert(), args=make_args(tmp_path), train_dataset=user_dataset(),
                  data_collator=pad_collator)
    one_line(error)


# ---- a causal LM by another name trains as one --------------------------------------------------------------------


def test_a_causal_lm_by_another_name_trains_with_the_shifted_loss(tmp_path):
    """Same weights, same seed: a renamed subclass of LlamaForCausalLM trains exactly as LlamaForCausalLM does."""
    def run(model, folder):
        trainer = DPTrainer(model=model, args=make_args(tmp_path / folder, max_steps=2),
                            train_dataset=user_dataset(causal_lm=True), data_collator=pad_collator)
        trainer.train()
        return [p.detach() for p in trainer.model.parameters()]

    reference = tiny_llama()
    renamed = TinyDecoder(reference.config)
    renamed.load_state_dict(reference.state_dict())
    for a, b in zip(run(reference, "llama"), run(renamed, "renamed")):
        torch.testing.assert_close(a, b)


# ---- create_model_card writes the privacy card --------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("card"), max_steps=1, noise_seed=None)  # secret noise: a guarantee
    trainer.train()
    return trainer


def test_create_model_card_puts_trainers_fields_into_the_privacy_card(trained):
    out = Path(trained.args.output_dir)
    trained.create_model_card(language="en", license="apache-2.0", tags=["my-tag"], model_name="my-model",
                              finetuned_from="org/base", tasks=["text-classification"], dataset_tags="org/reviews",
                              dataset="Reviews")
    meta = metadata_load(out / "README.md")
    assert (meta["language"], meta["license"], meta["base_model"], meta["datasets"]) == \
        ("en", "apache-2.0", "org/base", ["org/reviews"])
    assert meta["pipeline_tag"] == "text-classification" and meta["model_name"] == "my-model"
    assert "differential-privacy" in meta["tags"] and meta["tags"][-1] == "my-tag"
    assert meta["privacy"]["mechanism"] == "uls"
    assert check_privacy_card(out)["epsilon"] == pytest.approx(trained.privacy_report()["epsilon"])


def test_privacy_card_kwargs_win_over_what_push_to_hub_derives(trained):
    trained.privacy_card_kwargs = {"model_name": "chosen-name"}
    try:
        trained.create_model_card(model_name="out")  # push_to_hub passes the output folder's name
        assert metadata_load(Path(trained.args.output_dir) / "README.md")["model_name"] == "chosen-name"
    finally:
        trained.privacy_card_kwargs = {}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dataset_args": "en"}, r"dataset_args='en'.*leave dataset_args unset"),
        ({"tasks": ["text-classification", "fill-mask"]}, r"tasks=.*states one"),
        ({"dataset": ["a", "b"]}, r"dataset=.*states one"),
    ],
)
def test_card_fields_the_privacy_card_cannot_hold_are_refused(trained, kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        trained.create_model_card(**kwargs)
    one_line(error)


# ---- the mixin makes any Trainer subclass private ----------------------------------------------------------------


def test_the_mixin_trains_another_trainer_subclass_with_dp(tmp_path):
    class LoggingTrainer(Trainer):  # a subclass a user already has, with its own override
        def log(self, logs, start_time=None):
            self.seen = [*getattr(self, "seen", []), dict(logs)]
            super().log(logs, start_time)

    class DPLoggingTrainer(DPTrainerMixin, LoggingTrainer):
        pass

    trainer = DPLoggingTrainer(model=tiny_bert(), args=make_args(tmp_path, max_steps=2), train_dataset=user_dataset(),
                               data_collator=pad_collator)
    trainer.train()
    assert trainer.accountant.steps == 2 and 0 < trainer.privacy_report()["epsilon"] <= 8.0
    assert sum("dp/epsilon" in logs for logs in trainer.seen) == 2  # the base's override sees the DP logs
    assert check_privacy_card(tmp_path / "out", no_guarantee=True)["epsilon"] == pytest.approx(
        trainer.privacy_report()["epsilon"])  # a fixed seed: accepted only as carrying no guarantee


# ---- Trainer features that keep working ---------------------------------------------------------------------------


def test_evaluation_during_training_keeps_working(tmp_path):
    data = user_dataset()
    trainer = DPTrainer(model=tiny_bert(), args=make_args(tmp_path, eval_strategy="steps", eval_steps=2),
                        train_dataset=data, data_collator=pad_collator,
                        eval_dataset=user_dataset(seed=9, user_ids=[f"held-out-{i}" for i in range(8)]))
    trainer.train()
    evaluations = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evaluations) == 2 and all(math.isfinite(e["eval_loss"]) for e in evaluations)
    assert trainer.accountant.steps == 4  # evaluation spends no budget


def test_the_callers_arguments_are_left_untouched(tmp_path):
    """Planning sets max_steps on the trainer's own copy: the same arguments can start a second run."""
    args = make_args(tmp_path, max_steps=-1, num_train_epochs=1.0)
    trainer = DPTrainer(model=tiny_bert(), args=args, train_dataset=user_dataset(), data_collator=pad_collator)
    assert trainer.args.max_steps == trainer.privacy_plan.steps > 0
    assert (args.max_steps, args.ignore_data_skip) == (-1, False)


# ---- Trainer features DP cannot account are refused ---------------------------------------------------------------


def test_model_init_and_hyperparameter_search_are_refused(tmp_path):
    with pytest.raises(ValueError, match="model_init") as error:
        DPTrainer(args=make_args(tmp_path), train_dataset=user_dataset(), data_collator=pad_collator,
                  model_init=tiny_bert)
    one_line(error)
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match="hyperparameter_search.*spends ε that no ledger records") as error:
        trainer.hyperparameter_search(n_trials=2)
    one_line(error)


# ---- the report's vocabulary --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, mechanism, sampling",
    [({"sampling": "uls"}, "uls", "uls"), ({"sampling": "els", "contribution_bound": 3}, "els", "els"),
     ({"privacy_unit": "example", "sampling": "els"}, "example", None)],
    ids=["uls", "els", "example"],
)
def test_report_and_ledger_name_the_mechanism_by_its_key(tmp_path, overrides, mechanism, sampling):
    trainer = make_trainer(tmp_path, **overrides)
    report = trainer.privacy_report()
    assert trainer.privacy_plan.mechanism == mechanism
    assert (report["mechanism"], report["sampling"]) == (mechanism, sampling)
    assert report["mechanism_description"] == MECHANISMS[mechanism].description
    ledger = trainer.privacy_ledger()
    assert (ledger["mechanism"], ledger["sampling"], ledger["privacy_unit"]) == \
        (mechanism, sampling, report["privacy_unit"])
    assert trainer.privacy_plan.fingerprint(trainer.args)["mechanism"] == mechanism
