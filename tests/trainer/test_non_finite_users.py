"""One user's non-finite value must not reach the released weights: the run equals the one where that user's gradient
is zero. And a bf16 model's clipped sums stay in float32 until the noise (the weights still train in bf16)."""
from __future__ import annotations

import math

import pytest
import torch

from trainer_fixtures import make_trainer, tiny_bert, user_dataset

POISONED, SENTINEL = "user-0", 12345.0  # user-0's rows are among the first (the probe rows of the checks, too)


def regression_data(poison: float):
    data = user_dataset(num_users=24, max_rows=3, seed=1)
    labels = [poison if user == POISONED else float(label) for user, label in zip(data["user_id"], data["labels"])]
    return data.remove_columns("labels").add_column("labels", labels)


def zero_for_sentinel(outputs, labels, num_items_in_batch=None):
    """Squared error, and exactly zero gradient for the rows labelled SENTINEL."""
    errors = (outputs.logits.squeeze(-1).float() - labels.float()) ** 2
    return torch.where(labels == SENTINEL, errors * 0, errors)


def trained(tmp_path, poison, loss_func=None):
    trainer = make_trainer(tmp_path / str(poison), model=tiny_bert(num_labels=1), dataset=regression_data(poison),
                           max_steps=3, expected_batch_size=16, per_device_train_batch_size=64)
    trainer.compute_loss_func = loss_func
    trainer.dp_step.settings = type(trainer.dp_step.settings)(
        **{**trainer.dp_step.settings.__dict__, "loss_func": loss_func})
    trainer.train()
    return torch.cat([param.detach().flatten() for param in trainer.model.parameters()])


@pytest.mark.parametrize("poison", [1e30, math.inf, -math.inf, math.nan])
def test_a_user_with_a_non_finite_loss_changes_nothing(tmp_path, poison):
    weights = trained(tmp_path, poison)
    assert torch.isfinite(weights).all()
    reference = trained(tmp_path, SENTINEL, zero_for_sentinel)
    torch.testing.assert_close(weights, reference, rtol=1e-5, atol=1e-6)


def test_a_bf16_model_trains_with_float32_sums(tmp_path, monkeypatch):
    """The step's sums of a bf16 model are float32 when the noise is added, and `.grad` is bf16 after."""
    from hf_dp import noise

    seen = []
    real_add_noise = noise.add_noise

    def recording(params, **kwargs):
        seen.append({tensor.dtype for tensor in kwargs["grads"]})
        return real_add_noise(params, **kwargs)

    monkeypatch.setattr("hf_dp.step.add_noise", recording)
    model = tiny_bert().to(torch.bfloat16)
    trainer = make_trainer(tmp_path, model=model, max_steps=2)
    trainer.train()
    assert seen == [{torch.float32}, {torch.float32}]
    assert all(param.dtype == torch.bfloat16 and torch.isfinite(param.float()).all() for param in model.parameters())
