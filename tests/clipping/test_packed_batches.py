"""Packed (padding-free) batches: DPTrainer with transformers' DataCollatorWithFlattening.

The oracle is the padded run: the same sampled units, seeds and noise must give the same clipped, noised
update whether a micro-batch is padded (one example per row) or packed into one row.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening, TrainerCallback

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.losses import packed_per_example_loss, per_example_loss
from trainer_fixtures import pad_collator, tiny_bert, tiny_llama, user_dataset


class _Updates(TrainerCallback):
    """The gradient handed to the optimizer at each step (clipped sum + noise, over the expected batch size)."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


def _train(tmp_path, name, collator, **overrides):
    settings = dict(
        output_dir=str(tmp_path / name), max_steps=3, expected_batch_size=8, per_device_train_batch_size=4,
        learning_rate=1e-2, optim="sgd", target_epsilon=None, noise_multiplier=1.0, max_grad_norm=0.05,
        noise_seed=1234, report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True,
    )
    settings.update(overrides)
    updates = _Updates()
    trainer = DPTrainer(model=tiny_llama(), args=DPTrainingArguments(**settings),
                        train_dataset=user_dataset(causal_lm=True), data_collator=collator, callbacks=[updates])
    backward, norms = trainer.clipper.backward, []

    def recording_backward(*args, **kwargs):  # the pre-clip norm of every unit, micro-batch by micro-batch
        norms.append(backward(*args, **kwargs))
        return norms[-1]

    trainer.clipper.backward = recording_backward
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    updates.norms = torch.cat(norms)
    return updates, logs, dict(trainer.model.named_parameters())


@pytest.mark.parametrize(
    "overrides",
    [{"sampling": "uls", "contribution_bound": 4}, {"sampling": "els", "contribution_bound": 3},
     {"privacy_unit": "example"}],
    ids=["uls", "els", "example"],
)
def test_packed_update_matches_padded(tmp_path, overrides):
    padded, padded_logs, padded_params = _train(tmp_path, "padded", pad_collator, **overrides)
    packed, packed_logs, packed_params = _train(tmp_path, "packed", DataCollatorWithFlattening(), **overrides)
    assert len(packed.steps) == len(padded.steps) == 3
    torch.testing.assert_close(packed.norms, padded.norms, rtol=1e-4, atol=1e-7)  # the same units, the same norms
    for step_padded, step_packed in zip(padded.steps, packed.steps):
        for name, grad in step_padded.items():
            torch.testing.assert_close(step_packed[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # The noised losses are released from the same clipped per-unit losses and the same noise.
    for key in ("loss", "dp/clipped_fraction"):
        assert [e[key] for e in packed_logs] == pytest.approx([e[key] for e in padded_logs], rel=1e-5, abs=1e-6)
    for name, param in padded_params.items():
        torch.testing.assert_close(packed_params[name], param, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_losses_of_users_with_several_examples(tmp_path):
    """ULS: a user's examples in one packed row, mixed with other users' examples; clipping must be per user.

    The noise is small (σ = 0.2), so the update is mostly the clipped sum, and C is small, so every sampled user
    is clipped: a wrong grouping of tokens into examples or users would not give the padded run's norms or update."""
    overrides = dict(sampling="uls", contribution_bound=6, noise_multiplier=0.2, max_grad_norm=0.02,
                     per_device_train_batch_size=16, max_steps=2)
    padded, _, _ = _train(tmp_path, "padded", pad_collator, **overrides)
    packed, _, _ = _train(tmp_path, "packed", DataCollatorWithFlattening(), **overrides)
    assert len(padded.norms) >= 8 and bool((padded.norms > 0.02).all())  # every sampled user was clipped
    torch.testing.assert_close(packed.norms, padded.norms, rtol=1e-4, atol=1e-7)
    for step_padded, step_packed in zip(padded.steps, packed.steps):
        for name, grad in step_padded.items():
            torch.testing.assert_close(step_packed[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_packed_per_example_loss_matches_padded():
    torch.manual_seed(0)
    lengths = [4, 1, 6, 3]
    vocab = 11
    sequences = [torch.randint(0, vocab, (n,)) for n in lengths]
    collated = DataCollatorWithFlattening()([{"input_ids": s.tolist()} for s in sequences])
    logits = torch.randn(1, sum(lengths), vocab)
    from hf_dp.clipping.packing import examples_from_position_ids

    example_ids = examples_from_position_ids(collated["position_ids"])
    packed = packed_per_example_loss(logits, collated["labels"], example_ids, len(lengths), causal_lm=True)
    padded_logits = torch.zeros(len(lengths), max(lengths), vocab)
    padded_labels = torch.full((len(lengths), max(lengths)), -100)
    start = 0
    for row, (n, tokens) in enumerate(zip(lengths, sequences)):
        padded_logits[row, :n] = logits[0, start : start + n]
        padded_labels[row, :n] = tokens
        start += n
    expected = per_example_loss(padded_logits, padded_labels, causal_lm=True)
    torch.testing.assert_close(packed, expected)
    assert packed[1] == 0  # one token: nothing to predict
    # The shift stays inside each example even when the labels at example starts are not -100.
    unmasked = torch.cat([s for s in sequences])[None]
    again = packed_per_example_loss(logits, unmasked, example_ids, len(lengths), causal_lm=True)
    torch.testing.assert_close(again, expected)


def _args(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=1, expected_batch_size=8,
                    per_device_train_batch_size=4, target_epsilon=8.0, noise_seed=0, report_to=[],
                    save_strategy="no", use_cpu=True, disable_tqdm=True)
    settings.update(overrides)
    return DPTrainingArguments(**settings)


def test_sequence_classification_with_flattening_is_refused(tmp_path):
    with pytest.raises(ValueError, match="pools each row into one prediction"):
        DPTrainer(model=tiny_bert(), args=_args(tmp_path), train_dataset=user_dataset(),
                  data_collator=DataCollatorWithFlattening())


def test_packed_rows_with_an_attention_mask_are_refused(tmp_path):
    """With an attention mask transformers does not mask packed examples from each other."""
    flatten = DataCollatorWithFlattening()

    def with_mask(examples):
        batch = flatten(examples)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch

    with pytest.raises(ValueError, match="Drop the attention_mask"):
        DPTrainer(model=tiny_llama(), args=_args(tmp_path), train_dataset=user_dataset(causal_lm=True),
                  data_collator=with_mask)


def test_rows_the_collator_would_drop_are_refused(tmp_path):
    """DataCollatorWithFlattening drops empty rows, so the examples would no longer line up with their users: a row
    with no token is refused at construction, before any collator sees it."""
    dataset = user_dataset(num_users=12, causal_lm=True)
    rows = dataset.to_dict()
    rows["input_ids"][-1], rows["labels"][-1] = [], []
    dataset = dataset.from_dict(rows)
    with pytest.raises(ValueError, match="input_ids is empty in 1 of the"):
        DPTrainer(model=tiny_llama(), args=_args(tmp_path, expected_batch_size=12, sampling="uls",
                                                 contribution_bound=6, per_device_train_batch_size=64),
                  train_dataset=dataset, data_collator=DataCollatorWithFlattening())
