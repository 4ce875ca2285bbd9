"""`hf_dp/clipping/attach.py`: which modules are hooked, checked before any step: trainable layers no
rule covers are refused with `UnsupportedLayerError`, naming each (nothing attached), frozen ones are
left alone, and reentrant gradient checkpointing is refused.

Rule lookup itself, and parameters shared by layers of different rules, are in `test_registry.py`.
"""
from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from hf_dp.clipping import GhostClipper, UnsupportedLayerError


# ---------------------------------------------------------------------------------------
# Trainable layers without a rule, before any step


class _RawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.gain


def test_unknown_trainable_layers_raise_naming_each():
    model = nn.Sequential(nn.Linear(4, 4), _RawParameter(), nn.Conv2d(1, 1, 1))
    with pytest.raises(UnsupportedLayerError) as raised:
        GhostClipper(model)
    message = str(raised.value)
    assert "1 (" in message and "_RawParameter" in message and "gain" in message
    assert "2 (" in message and "Conv2d" in message
    # Nothing was attached: a plain forward and backward still work.
    model[0](torch.randn(2, 4)).sum().backward()


def test_frozen_unknown_layers_are_fine_and_get_nothing():
    model = nn.Sequential(nn.Linear(4, 4), _RawParameter())
    model[1].requires_grad_(False)
    with GhostClipper(model) as clipper:
        losses = model(torch.randn(3, 4)).sum(dim=1)
        clipper.backward(losses, max_grad_norm=1.0)
    assert model[1].gain.grad is None
    assert model[0].weight.grad is not None


# ---------------------------------------------------------------------------------------
# Gradient checkpointing


def test_reentrant_checkpointing_is_refused():
    model = tiny_model("llama", "causal_lm")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="non-reentrant gradient checkpointing only"):
        GhostClipper(model)
