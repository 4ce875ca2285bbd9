"""DPTrainer keeps Trainer's contract: its signature, custom losses, model cards, the hooks it relies on, and the
report's vocabulary."""

from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from huggingface_hub.repocard import metadata_load
from packaging.specifiers import SpecifierSet
from transformers import (BertGenerationConfig, BertGenerationDecoder, DataCollatorWithFlattening, LlamaForCausalLM,
                          LlamaForSequenceClassification, Trainer)

from hf_dp import DPTrainer
from hf_dp.hub import check_privacy_card
from hf_dp.losses import is_causal_lm
from hf_dp.compatibility import SUPPORTED_TRANSFORMERS, check_trainer_hooks
from hf_dp.vocabulary import MECHANISMS
from trainer_fixtures import VOCAB, make_args, make_trainer, pad_collator, tiny_bert, tiny_llama, user_dataset

ROOT = Path(__file__).resolve().parents[2]


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# ---- signature ------------------------------------------------------------------------------


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
    trainer = DPTrainer(tiny_bert(), make_args(tmp_path), pad_collator, data, user_dataset(seed=3))
    assert trainer.data_collator is pad_collator
    assert trainer.eval_dataset is not None and trainer.partition.num_examples == len(data)


# ---- custom losses --------------------------------------------------------------------------


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


# ---- causal-LM detection --------------------------------------------------------------------


class TinyDecoder(LlamaForCausalLM):
    """A causal LM whose class name says nothing about its head."""


def tiny_bert_generation_decoder():
    torch.manual_seed(0)
    config = BertGenerationConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, is_decoder=True)
    return BertGenerationDecoder(config)


def test_causal_lms_are_found_by_their_head_not_their_name(tmp_path):
    llama = tiny_llama()
    assert is_causal_lm(TinyDecoder(llama.config))
    assert is_causal_lm(tiny_bert_generation_decoder())  # a transformers causal LM without "CausalLM"/"LMHead"
    assert not is_causal_lm(LlamaForSequenceClassification(llama.config))
    assert not is_causal_lm(tiny_bert())
    # Detected, the decoder gets the next-token shift and may be trained on packed rows (refused for other heads).
    trainer = DPTrainer(model=TinyDecoder(llama.config), args=make_args(tmp_path),
                        data_collator=DataCollatorWithFlattening(), train_dataset=user_dataset(causal_lm=True))
    assert trainer._causal_lm


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


# ---- model cards ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("card"), max_steps=1)
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


# ---- the Trainer hooks DPTrainer relies on --------------------------------------------------


def test_the_installed_trainer_has_every_hook():
    check_trainer_hooks(Trainer)


def test_a_trainer_without_a_hook_is_refused_naming_the_supported_range():
    class OldTrainer:  # what a transformers before the hooks looked like: global clipping inline in the loop
        def _get_grad_norm(self, model, grad_norm=None):
            return None

        def _get_num_items_in_batch(self, batch_samples, device):
            return None

        def _remove_unused_columns(self, dataset, description=None):
            return dataset

    with pytest.raises(RuntimeError, match=r"_clip_grad_norm is missing") as error:
        check_trainer_hooks(OldTrainer)
    message = one_line(error)
    assert f"transformers{SUPPORTED_TRANSFORMERS}" in message and transformers.__version__ in message


def test_a_trainer_that_no_longer_calls_a_hook_is_refused():
    class RenamedCallsTrainer:  # the hooks exist but the training loop does not go through them
        def _clip_grad_norm(self, model):
            return None

        def _get_grad_norm(self, model, grad_norm=None):
            return None

        def _get_num_items_in_batch(self, batch_samples, device):
            return None

        def _remove_unused_columns(self, dataset, description=None):
            return dataset

    with pytest.raises(RuntimeError, match="never calls _clip_grad_norm"):
        check_trainer_hooks(RenamedCallsTrainer)


def test_pyproject_declares_the_tested_transformers_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = [d for d in project["dependencies"] if d.startswith("transformers")]
    assert declared == [f"transformers{SUPPORTED_TRANSFORMERS}"]
    assert SpecifierSet(SUPPORTED_TRANSFORMERS).contains(transformers.__version__, prereleases=True), (
        f"transformers {transformers.__version__} is outside the declared transformers{SUPPORTED_TRANSFORMERS}")


# ---- Trainer features DP cannot account -----------------------------------------------------


def test_model_init_and_hyperparameter_search_are_refused(tmp_path):
    with pytest.raises(ValueError, match="model_init") as error:
        DPTrainer(args=make_args(tmp_path), train_dataset=user_dataset(), data_collator=pad_collator,
                  model_init=tiny_bert)
    one_line(error)
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match="hyperparameter_search.*spends ε that no ledger composes") as error:
        trainer.hyperparameter_search(n_trials=2)
    one_line(error)


# ---- the report's vocabulary ----------------------------------------------------------------


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


def test_a_checkpoint_of_the_older_single_file_format_is_refused_clearly(tmp_path):
    """Checkpoints of hf_dp before the ledger/resume-state split held one `dp_state.json`: refused in one line."""
    make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    (checkpoint / "dp_resume.json").rename(checkpoint / "dp_state.json")
    resumed = make_trainer(tmp_path, max_steps=4)
    with pytest.raises(ValueError, match="written by an older hf_dp .dp_state.json.") as error:
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert "\n" not in str(error.value) and resumed.accountant.steps == 0
