"""`hf_dp/clipping/registry.py`: rule lookup by layer type (MRO) and class name, custom rules
registered with `register_rule` (checked against the shared oracle, `clipping_oracle.py`), and a
parameter shared by layers whose rules cannot give its joint norm. Trainable layers no rule covers are
refused when the clipper attaches: `test_attach.py`.
"""
from __future__ import annotations

import sys

import pytest
import torch
from clipping_oracle import UNIT_IDS, check_against_oracle, squared_error
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm
from transformers.pytorch_utils import Conv1D

from hf_dp.clipping import (
    EXAMPLE,
    ExampleGrad,
    GhostClipper,
    UnsupportedLayerError,
    find_rule,
    register_rule,
    registered_rules,
)

# ---------------------------------------------------------------------------------------
# Lookup


class _LinearSubclass(nn.Linear):
    """Inherits `nn.Linear`'s rule through the MRO (as peft's LoRA `lora_A`/`lora_B` do)."""


@pytest.mark.parametrize(
    "layer,name",
    [
        (nn.Linear(3, 2), "linear"),
        (_LinearSubclass(3, 2), "linear"),
        (Conv1D(2, 3), "conv1d"),
        (nn.Embedding(5, 3), "embedding"),
        (nn.LayerNorm(4), "layer_norm"),
        (nn.RMSNorm(4), "rms_norm"),
        (LlamaRMSNorm(4), "rms_norm"),  # matched by class name
        (T5LayerNorm(4), "rms_norm"),  # an RMSNorm named *LayerNorm, not an nn.LayerNorm
        (nn.Conv2d(1, 1, 1), None),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, nn.Module) else str(value),
)
def test_find_rule_by_type_mro_and_class_name(layer, name):
    rule = find_rule(layer)
    assert (rule.name if rule is not None else None) == name
    if name is not None:
        assert registered_rules()[name] is rule


# ---------------------------------------------------------------------------------------
# A registered custom rule, alone and sharing a parameter with a built-in rule


class _Scale(nn.Module):
    """A custom elementwise layer for the registry tests: y = x * weight."""

    def __init__(self, *shape):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*shape))

    def forward(self, x):
        return x * self.weight


@register_rule(_Scale, name="test_scale", params={"weight": EXAMPLE})
def _scale_rule(layer, activations, output_grads):
    batch_size = output_grads.shape[0]
    per_token = (output_grads * activations).reshape((batch_size, -1) + layer.weight.shape)
    return {"weight": ExampleGrad(per_token.sum(1))}


def test_registered_custom_rule_is_used_and_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _Scale(4), nn.Tanh(), nn.Linear(4, 2)).double()
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS)
    assert GhostClipper(model).layers == {"0": "linear", "1": "test_scale", "3": "linear"}


def test_parameter_shared_by_same_kind_rules_is_exact():
    """A Linear bias reused as a custom elementwise weight: both per-example terms, summed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _Scale(4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[1].weight = model[0].bias
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS)


def test_parameter_shared_by_incompatible_rules_raises():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), _Scale(4))
    model[1].weight = model[0].weight  # a linear weight also used elementwise: no joint rule
    with pytest.raises(UnsupportedLayerError, match=r"shared by 0\.weight, 1\.weight.*freeze"):
        GhostClipper(model)


# ---------------------------------------------------------------------------------------
# A rule module is found by the package `hf_dp.clipping.rules`, with no import line naming it

TOY_RULE_MODULE = '''"""A toy layer family: y = x * weight, for every layer class named `ToyScale`."""
from hf_dp.clipping import EXAMPLE, ExampleGrad, register_rule


@register_rule(name="toy_scale", params={"weight": EXAMPLE}, class_name_predicate=lambda c: c.__name__ == "ToyScale")
def toy_scale(layer, activations, output_grads):
    """The per-example weight gradient is the token sum of output_grads * activations."""
    batch_size = output_grads.shape[0]
    return {"weight": ExampleGrad((output_grads * activations).reshape((batch_size, -1) + layer.weight.shape).sum(1))}
'''


class ToyScale(nn.Module):
    """y = x * weight, as `_Scale`, but a type of its own that only the toy rule module (written by the test below)
    matches."""

    def __init__(self, size):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size))

    def forward(self, x):
        return x * self.weight


def test_a_rule_module_added_to_the_rules_package_is_found(tmp_path, monkeypatch):
    """The module is written to a folder of the package's path (as a new file in `hf_dp/clipping/rules/` is):
    the clipper refuses the layer before, and clips it exactly after, with no other file edited."""
    from hf_dp.clipping import registry, rules

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), ToyScale(4), nn.Tanh(), nn.Linear(4, 2)).double()
    with pytest.raises(UnsupportedLayerError, match=r"1 \(.*ToyScale\): trainable \['weight'\] and no clipping rule"):
        GhostClipper(model)
    name = f"{rules.__name__}.toy_scale"
    (tmp_path / "toy_scale.py").write_text(TOY_RULE_MODULE)
    monkeypatch.setattr(rules, "__path__", [*rules.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_RULES_BY_NAME", list(registry._RULES_BY_NAME))  # the rule leaves with the test
    monkeypatch.setitem(sys.modules, name, None)  # so that the module leaves sys.modules with the test too
    monkeypatch.delitem(sys.modules, name)
    assert GhostClipper(model).layers == {"0": "linear", "1": "toy_scale", "3": "linear"}
    assert name in rules.load_rules() and "toy_scale" in registered_rules()
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    check_against_oracle(model, inputs, torch.randn(6, 5, 2, dtype=torch.float64), squared_error, UNIT_IDS)


def test_the_rules_package_finds_the_built_in_rule_modules():
    from hf_dp.clipping import rules

    assert {f"{rules.__name__}.{family}" for family in ("linear", "embedding", "norm")} <= set(rules.load_rules())
