"""The cases of `test_step_reference.py` and of its recorded reference (`reference/make_step_reference.py`)."""
from __future__ import annotations

from unittest import mock

import torch
from tiny_models import model_inputs, per_example_loss, tiny_batch, tiny_model, trainable_parameters
from trainer_fixtures import pad_collator, tiny_llama, user_dataset
from transformers import TrainerCallback

import hf_dp.step
from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.clipping import GhostClipper, examples_from_position_ids

SPREAD_UNITS = [5, 2, 5, 9, 2, 2]  # 3 units of 1-3 examples, not contiguous

CLIPPER_CASES = {
    # name: (arch, head, lora, unit ids or None, packed)
    "gpt2-tied-examples": ("gpt2", "causal_lm", False, None, False),
    "gpt2-tied-units": ("gpt2", "causal_lm", False, SPREAD_UNITS, False),
    "llama-units": ("llama", "causal_lm", False, SPREAD_UNITS, False),
    "llama-lora-units": ("llama", "causal_lm", True, SPREAD_UNITS, False),
    "bert-cls-examples": ("bert", "seq_cls", False, None, False),
    "llama-packed": ("llama", "causal_lm", False, None, True),
}

TRAINER_CASES = {
    "uls": dict(sampling="uls", contribution_bound=3),
    "els": dict(sampling="els", contribution_bound=3),
    "example": dict(privacy_unit="example"),
    "uls-adaptive": dict(sampling="uls", contribution_bound=3, adaptive_clipping=True),
}


def clipper_case(name: str) -> dict:
    """Per-unit norms and clipped sums of one `GhostClipper.backward` (float64, C small enough to clip some)."""
    arch, head, lora, unit_ids, packed = CLIPPER_CASES[name]
    model = tiny_model(arch, head, lora=lora, dtype=torch.float64, seed=3)
    batch = tiny_batch(6, 8, head=head, seed=4)
    inputs = model_inputs(batch)
    example_ids = None
    if packed:  # two rows of three examples each, positions restarting at each example
        tokens = inputs["input_ids"][:, :4].reshape(2, 12)
        position_ids = torch.arange(4).repeat(2, 3)
        example_ids = examples_from_position_ids(position_ids)
        inputs = {"input_ids": tokens, "position_ids": position_ids, "use_cache": False}
        labels = tokens.clone()
    else:
        labels = batch["labels"]
    clipper = GhostClipper(model)
    output = model(**inputs)
    if packed:
        logits, targets = output.logits[:, :-1], labels[:, 1:]
        owners = example_ids[:, 1:].masked_fill(example_ids[:, 1:] != example_ids[:, :-1], -1)
        token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        losses = torch.zeros(6, dtype=token_loss.dtype).index_add(0, owners[owners >= 0], token_loss[owners >= 0])
    else:
        losses = per_example_loss(output.logits, labels, head)
    units = None if unit_ids is None else torch.tensor(unit_ids)
    norms = clipper.backward(losses, unit_ids=units, max_grad_norm=0.5, example_ids=example_ids)
    clipper.detach()
    grads = {n: p.grad.detach().clone() for n, p in trainable_parameters(model).items()}
    return {"norms": norms.detach().clone(), "grads": grads}


class _GradsBeforeStep(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


def trainer_case(name: str, output_dir) -> dict:
    """Two DP steps with the gradient noise switched off: the gradients handed to the optimizer, and ε."""
    recorder = _GradsBeforeStep()
    args = DPTrainingArguments(
        str(output_dir), target_epsilon=8.0, expected_batch_size=6, max_grad_norm=0.05, max_steps=2,
        per_device_train_batch_size=64, learning_rate=1e-2, noise_seed=1, seed=0, report_to="none",
        save_strategy="no", disable_tqdm=True, use_cpu=True, **TRAINER_CASES[name],
    )
    trainer = DPTrainer(model=tiny_llama(seed=2), args=args, train_dataset=user_dataset(30, causal_lm=True, seed=5),
                        data_collator=pad_collator, callbacks=[recorder])
    with _no_gradient_noise():
        trainer.train()
    return {"grads": recorder.steps, "epsilon": trainer.privacy_report()["epsilon"],
            "max_grad_norm": float(trainer.clipping_norm)}


def _no_gradient_noise():
    """The gradient noise switched off (zero std), wherever the trainer draws it."""
    target = "add_noise" if hasattr(hf_dp.step, "add_noise") else None
    if target is None:
        raise RuntimeError("step_cases: update _no_gradient_noise for the trainer's noise function")
    def silent(*args, **kwargs):  # the gradients are left as the clipped sums made them
        return None

    return mock.patch.object(hf_dp.step, target, silent)
