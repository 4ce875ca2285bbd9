"""`hf_dp/clipping/rules/linear.py`: the `nn.Linear` rule (heads, peft LoRA `lora_A`/`lora_B`) and the
transformers `Conv1D` rule (GPT-2), against the shared oracle (`clipping_oracle.py`): any number of
token axes (none for a pooled head), with and without bias, subclasses with their own forward, LoRA.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from clipping_oracle import UNIT_IDS, check_against_oracle, clip_by_engine, hf_loss, squared_error
from tiny_models import model_inputs, tiny_batch, tiny_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_dp.clipping import GhostClipper


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("token_shape", [(), (5,), (2, 3)], ids=["pooled", "tokens", "two-token-axes"])
def test_linear_matches_oracle(token_shape, bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, bias=bias), nn.Tanh(), nn.Linear(4, 2, bias=bias)).double()
    inputs = {"input": torch.randn((6,) + token_shape + (3,), dtype=torch.float64)}
    labels = torch.randn((6,) + token_shape + (2,), dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS)
    assert GhostClipper(model).layers == {"0": "linear", "2": "linear"}


def test_conv1d_matches_oracle():
    """transformers' `Conv1D` (GPT-2): y = x W + b with W `(in, out)`, the transpose of `nn.Linear`."""
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(4, 3), nn.Tanh(), Conv1D(2, 4)).double()
    with torch.no_grad():
        for module in (model[0], model[2]):
            module.bias.normal_()  # Conv1D starts its bias at zero
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS)
    assert GhostClipper(model).layers == {"0": "conv1d", "2": "conv1d"}


class _HalvedInputLinear(nn.Linear):
    """Overrides forward (as Falcon's linear layers do): the rule must see what `F.linear` saw."""

    def forward(self, input):
        return F.linear(input / 2, self.weight, self.bias)


def test_linear_subclass_with_own_forward_matches_oracle():
    torch.manual_seed(0)
    model = nn.Sequential(_HalvedInputLinear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS)


def test_lora_base_weights_get_no_grad():
    model = tiny_model("llama", "causal_lm", lora=True, dtype=torch.float64)
    batch = tiny_batch(4, 6, head="causal_lm")
    clip_by_engine(model, model_inputs(batch), batch["labels"], hf_loss("causal_lm"), None, 1.0)
    for name, param in model.named_parameters():
        assert (param.grad is not None) == param.requires_grad, name
