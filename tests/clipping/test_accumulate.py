"""Clipped sums stay in float32 until the noise is added, whatever the parameters' dtype.

The case an outside review measured: K users holding the same row, a bf16 (or fp16) model, the sum accumulated over
many micro-batches. Adding one user must move the pre-noise sum by one clipped gradient, C/(q·N) (here at most
(1 + 10⁻³)·C·s); summed in bf16 it moved by 2-52 times that.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_dp.batching import MicroBatch
from hf_dp.clipping import GhostClipper
from hf_dp.clipping.accumulate import ClippedGrads
from hf_dp.noise import add_noise
from hf_dp.step import DPStep, StepSettings

C, SCALE, ROWS_PER_PASS = 0.1, 1.0 / 64, 100  # C below every user's norm (0.42): all are clipped


def model_in(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 1)).to(dtype)


def summed(model, users: int, into=None) -> list[torch.Tensor]:
    """K identical one-row users, clipped to C, `ROWS_PER_PASS` users a backward; the float32 sums per parameter."""
    clipper = GhostClipper(model)
    model.zero_grad(set_to_none=True)
    row = torch.linspace(-1, 1, 8)
    for start in range(0, users, ROWS_PER_PASS):
        count = min(ROWS_PER_PASS, users - start)
        losses = model(row.expand(count, 8).to(next(model.parameters()).dtype)).float().squeeze(-1) ** 2
        clipper.backward(losses, max_grad_norm=C, grad_scale=SCALE, into=into)
    clipper.detach()
    if into is not None:
        return [tensor.double() for tensor in into.grads(list(model.parameters()))]
    return [param.grad.double() for param in model.parameters()]


def flat(tensors):
    return torch.cat([tensor.flatten() for tensor in tensors])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("users", [400, 1600])
def test_one_more_user_moves_the_sum_by_one_clipped_gradient(dtype, users):
    model = model_in(dtype)
    moved = (flat(summed(model, users + 1, ClippedGrads())) - flat(summed(model, users, ClippedGrads()))).norm()
    assert moved <= (1 + 1e-3) * C * SCALE, f"{float(moved / (C * SCALE)):.4f} C/(qN)"
    assert moved >= (1 - 1e-3) * C * SCALE  # each user is clipped to exactly C


def test_summed_in_the_parameters_dtype_it_would_not_hold():
    """The check above can fail: rounding each pass into bf16 `.grad` (no `into`) puts the sum of 1,600 users off
    the exact K·g by more than one user's C (in float32 by less than 1 % of it)."""
    model = model_in(torch.bfloat16)
    one_user = flat(summed(model, 1, ClippedGrads()))
    assert (flat(summed(model, 1600)) - 1600 * one_user).norm() > C * SCALE
    assert (flat(summed(model, 1600, ClippedGrads())) - 1600 * one_user).norm() < 1e-2 * C * SCALE


def test_float32_parameters_sum_in_grad_itself():
    model = model_in(torch.float32)
    into = ClippedGrads()
    summed(model, 3, into)
    assert not into.buffers and all(param.grad is not None for param in model.parameters())


def test_the_noise_is_added_in_float32_and_rounded_once_into_the_bf16_grad():
    model = model_in(torch.bfloat16)
    params, names = list(model.parameters()), [name for name, _ in model.named_parameters()]

    def loss_func(outputs, labels, num_items_in_batch=None):  # one squared error per example
        return (outputs.float().squeeze(-1) - labels) ** 2

    settings = StepSettings(device=torch.device("cpu"), causal_lm=False, max_loss=5.0, loss_func=loss_func,
                            forward_context=contextlib.nullcontext)
    plan = SimpleNamespace(expected_batch_size=64.0, noise_multiplier=0.7, max_grad_norm=C, private_logging=False)
    step = DPStep(SimpleNamespace(plan=plan), GhostClipper(model), 5, settings)
    batch = MicroBatch({"input": torch.linspace(-1, 1, 48).reshape(6, 8).to(torch.bfloat16),
                        "labels": torch.zeros(6)}, num_examples=6)
    clipped = ClippedGrads()
    sums = step.clip(Wrapped(model), [batch], C, into=clipped)
    assert set(clipped.buffers) == set(params) and all(b.dtype == torch.float32 for b in clipped.buffers.values())
    expected = [buffer.clone() for buffer in clipped.grads(params)]
    add_noise(params, names=names, noise_multiplier=0.7, max_grad_norm=C, seed=5, step=3, scale=1 / 64.0,
              grads=expected)
    step.aggregate(params, names, sums, max_grad_norm=C, step=3, clipped=clipped)
    assert not clipped.buffers
    for param, noised in zip(params, expected):
        assert param.grad.dtype == torch.bfloat16
        assert torch.equal(param.grad, noised.to(torch.bfloat16))


class Wrapped(nn.Module):
    """The model called with the step's keyword features (`input=`)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input):
        return self.inner(input)
