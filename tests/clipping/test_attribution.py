"""`hf_dp/clipping/attribution.py`: the first backward's checks, which raise `UnsupportedLayerError` before any
gradient is written: rows read as one example's that hold several examples' (the weighted backward), and a
parameter whose gradient does not come only through its hooked layer (the coverage check against autograd).

Packed examples that attend to each other are in `test_packing.py`.
"""
from __future__ import annotations

import pytest
import torch
from tiny_models import FlattenedRowsModel
from torch import nn

from hf_dp.clipping import GhostClipper, UnsupportedLayerError


def test_rows_of_other_examples_are_refused_before_any_grad():
    """Time-major rows read batch-major would mix examples: the first backward checks attribution."""
    torch.manual_seed(0)
    model = FlattenedRowsModel(time_major=True).double()
    clipper = GhostClipper(model)
    losses = model(torch.randn(4, 6, 3, dtype=torch.float64)).pow(2).sum(dim=(1, 2))
    with pytest.raises(UnsupportedLayerError, match=r"rows.*\['inner \(Linear\)'\]"):
        clipper.backward(losses, max_grad_norm=1.0)
    assert all(param.grad is None for param in model.parameters())


def test_parameter_used_outside_its_layer_is_caught_on_first_backward():
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, input):
            hidden = self.layer(input)
            return torch.nn.functional.linear(hidden, self.layer.weight)  # a use no hook sees

    model = Reuse()
    clipper = GhostClipper(model)
    losses = model(torch.randn(4, 3)).pow(2).sum(1)
    with pytest.raises(UnsupportedLayerError, match=r"layer\.weight"):
        clipper.backward(losses, max_grad_norm=1.0)
    assert model.layer.weight.grad is None  # nothing written
