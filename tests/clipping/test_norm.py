"""`hf_dp/clipping/rules/norm.py`: the `nn.LayerNorm` rule and the RMSNorm rule (`nn.RMSNorm`, transformers'
`*RMSNorm` classes, Gemma's `(1 + w)` form, T5's `T5LayerNorm`), against the shared oracle
(`clipping_oracle.py`), and the probe that refuses a `*LayerNorm`-named layer of another kind.
"""
from __future__ import annotations

import pytest
import torch
from clipping_oracle import UNIT_IDS, check_against_oracle, squared_error
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from hf_dp.clipping import GhostClipper, UnsupportedLayerError

WIDTH = 8


class _Normed(nn.Module):
    """Linear -> norm -> Linear on `(B, T, 3)` tokens: the norm's inputs and output gradients vary by token."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.inner, self.norm, self.outer = nn.Linear(3, WIDTH), norm, nn.Linear(WIDTH, 2)

    def forward(self, input):
        return self.outer(self.norm(self.inner(input)))


_NORMS = {
    "layer_norm": (lambda: nn.LayerNorm(WIDTH), "layer_norm"),
    "layer_norm-no-bias": (lambda: nn.LayerNorm(WIDTH, bias=False), "layer_norm"),
    "rms_norm": (lambda: nn.RMSNorm(WIDTH, eps=1e-6), "rms_norm"),
    "rms_norm-default-eps": (lambda: nn.RMSNorm(WIDTH), "rms_norm"),
    "llama": (lambda: LlamaRMSNorm(WIDTH), "rms_norm"),
    "gemma-one-plus-w": (lambda: GemmaRMSNorm(WIDTH), "rms_norm"),
    "t5": (lambda: T5LayerNorm(WIDTH), "rms_norm"),
}


@pytest.mark.parametrize("kind", list(_NORMS))
def test_norm_matches_oracle(kind):
    make_norm, rule = _NORMS[kind]
    torch.manual_seed(0)
    model = _Normed(make_norm()).double()
    with torch.no_grad():
        for param in model.norm.parameters():  # away from the ones/zeros they start at
            param.normal_()
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS)
    assert GhostClipper(model).layers == {"inner": "linear", "norm": rule, "outer": "linear"}


class CenteredLayerNorm(nn.Module):
    """Named `*LayerNorm` but not an `nn.LayerNorm` (so taken for a T5-style RMSNorm): it subtracts the mean."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, hidden):
        centered = hidden - hidden.mean(-1, keepdim=True)
        return self.weight * centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_layer_norm_named_layer_of_another_kind_is_refused():
    model = _Normed(CenteredLayerNorm(WIDTH))
    with pytest.raises(UnsupportedLayerError, match=r"norm \(.*CenteredLayerNorm\).*'rms_norm' rule cannot clip"):
        GhostClipper(model)
    model.norm.requires_grad_(False)  # frozen, it needs no rule
    assert GhostClipper(model).layers == {"inner": "linear", "outer": "linear"}
