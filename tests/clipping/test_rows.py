"""`hf_dp/clipping/rows.py`: which rows of a captured tensor are whose. Rows flattened over (batch, time) are
read batch-major (checked against the shared oracle, `clipping_oracle.py`); a tensor shared by every example
is refused before any gradient is written, naming the layer.

Packed rows are in `test_packing.py`; the check that batch-major was the right reading in `test_attribution.py`.
"""
from __future__ import annotations

import pytest
import torch
from clipping_oracle import UNIT_IDS, check_against_oracle, squared_error
from tiny_models import FlattenedRowsModel
from torch import nn

from hf_dp.clipping import GhostClipper, UnsupportedLayerError


def test_rows_flattened_over_batch_and_time_are_attributed_batch_major():
    torch.manual_seed(0)
    model = FlattenedRowsModel(time_major=False).double()
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS)


def test_rows_shared_by_all_examples_are_refused_naming_the_layer():
    class SharedTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, input):  # the same (1, 5, 3) table output added to every example
            return self.head(input + self.table(torch.ones(1, 5, 3, dtype=input.dtype)))

    model = SharedTable().double()
    clipper = GhostClipper(model)
    losses = model(torch.randn(4, 5, 3, dtype=torch.float64)).pow(2).sum(dim=(1, 2))
    with pytest.raises(UnsupportedLayerError, match=r"table \(Linear, leading dimensions \[1, 1\]\).*freeze"):
        clipper.backward(losses, max_grad_norm=1.0)
    assert all(param.grad is None for param in model.parameters())
