"""A unit whose loss, norm or gradient is not finite contributes exactly zero, on every clipping path.

Oracle: the same backward with that unit's loss multiplied by 0 (its gradient is then exactly zero, and it adds
nothing): the clipped sums must be equal, bit for bit up to float32 summation order, and finite.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import DataCollatorWithFlattening

from hf_dp.clipping import GhostClipper
from hf_dp.clipping.accumulate import ClippedGrads
from hf_dp.clipping.packing import examples_from_position_ids
from hf_dp.clipping.units import UnitIndex
from hf_dp.losses import packed_per_example_loss
from trainer_fixtures import tiny_llama

C = 0.5


class Regressor(nn.Module):
    """Embedding -> LayerNorm -> Linear -> ReLU -> Linear(1): every rule kind (indexed, example, outer)."""

    def __init__(self, vocab=12, width=6):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, input_ids):  # (B, T) -> (B,)
        hidden = torch.relu(self.hidden(self.norm(self.embed(input_ids))))
        return self.head(hidden).mean(dim=(1, 2))


def clipped_sums(model, losses_of, unit_ids, strategy, into=None):
    """Σ_u clip(g_u) for the model's per-example `losses_of(outputs)`, as one flat float64 vector."""
    clipper = GhostClipper(model, strategy=strategy)
    model.zero_grad(set_to_none=True)
    input_ids = torch.arange(24).reshape(6, 4) % 12
    norms = clipper.backward(losses_of(model(input_ids)), unit_ids=unit_ids, max_grad_norm=C, into=into)
    clipper.detach()
    if into is not None:
        into.round_into_grads()
    return torch.cat([p.grad.double().flatten() for p in model.parameters()]), norms


TARGETS = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5])
POISONS = {
    "label 1e30 (squared error overflows)": lambda out: (out - TARGETS.index_put((torch.tensor([2]),),
                                                                                  torch.tensor(1e30))) ** 2,
    "label inf": lambda out: (out - TARGETS.index_put((torch.tensor([2]),), torch.tensor(math.inf))) ** 2,
    "log 0 in a custom loss": lambda out: (out - TARGETS) ** 2 - torch.log(
        torch.tensor([1.0, 1, 0, 1, 1, 1])) * out,
    "NaN loss": lambda out: (out - TARGETS) ** 2 * torch.tensor([1.0, 1, math.nan, 1, 1, 1]),
}
UNITS = {"one example per unit": None, "users of 3, 2 and 1 examples": [7, 7, 3, 3, 3, 9],
         "equal consecutive users": [0, 0, 1, 1, 2, 2]}


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
@pytest.mark.parametrize("units", UNITS.values(), ids=UNITS.keys())
@pytest.mark.parametrize("poison", POISONS.values(), ids=POISONS.keys())
def test_a_non_finite_unit_adds_exactly_zero(poison, units, strategy):
    poisoned, poisoned_norms = clipped_sums(Regressor(), poison, units, strategy)
    index = UnitIndex(units, 6)
    unit = int(index.inverse[2])  # example 2 is poisoned: its whole unit must add nothing
    silenced = torch.from_numpy(index.inverse != unit).float()  # that unit's losses times 0: a zero gradient
    reference, _ = clipped_sums(Regressor(), lambda out: (out - TARGETS) ** 2 * silenced, units, strategy)
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, reference, rtol=1e-6, atol=1e-9)
    assert math.isinf(poisoned_norms[unit]) and torch.isfinite(poisoned_norms[torch.arange(len(poisoned_norms))
                                                                              != unit]).all()


def test_without_a_non_finite_unit_nothing_changes():
    """The mask is inert on finite units: the sum equals Σ_u min(1, C/‖g_u‖)·g_u from per-unit autograd."""
    model = Regressor()
    ours, _ = clipped_sums(model, lambda out: (out - TARGETS) ** 2, None, "ghost")
    reference = torch.zeros_like(ours)
    for row in range(6):
        model.zero_grad(set_to_none=True)
        ((model(torch.arange(24).reshape(6, 4)[row: row + 1] % 12) - TARGETS[row]) ** 2).sum().backward()
        grad = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        reference += grad * min(1.0, C / grad.norm().item())
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-8)


def test_an_fp16_overflow_in_one_unit_adds_exactly_zero():
    """A half-precision model whose activations overflow to inf for one example only."""
    def sums(scale_of_row_1):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)).half()
        model.load_state_dict({"0.weight": torch.full((3, 4), 0.25).half(), "0.bias": torch.zeros(3).half(),
                               "1.weight": torch.ones(1, 3).half(), "1.bias": torch.zeros(1).half()})
        inputs = torch.ones(4, 4).half()
        inputs[1] *= scale_of_row_1
        clipper = GhostClipper(model)
        into = ClippedGrads()
        outputs = model(inputs).squeeze(-1)
        losses = outputs.float() ** 2 if scale_of_row_1 else (outputs.float() ** 2) * torch.tensor([1.0, 0, 1, 1])
        clipper.backward(losses, max_grad_norm=C, into=into)
        grads = [t.clone() for t in into.grads(list(model.parameters()))]
        clipper.detach()
        return grads

    overflowed = sums(60000.0)  # row 1's output, 3·60000, passes fp16's 65504: inf for that row only
    reference = sums(0)
    for ours, theirs in zip(overflowed, reference):
        assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)


def test_a_non_finite_example_of_packed_rows_adds_exactly_zero():
    """Packed rows (several examples in one row): example 1's loss is inf (its gradient finite); the DP step's sums
    equal those of the run where example 1's loss is multiplied by 0."""
    collated = DataCollatorWithFlattening()([{"input_ids": ids} for ids in ([3, 5, 7, 9], [4, 6, 8], [2, 3, 4, 5, 6])])
    example_ids = examples_from_position_ids(collated["position_ids"])

    def sums(poison):
        model = tiny_llama(seed=1)
        clipper = GhostClipper(model)
        logits = model(**collated, use_cache=False).logits
        losses = packed_per_example_loss(logits, collated["labels"], example_ids, 3, causal_lm=True)
        losses = losses + torch.tensor([0, math.inf, 0]) if poison else losses * torch.tensor([1.0, 0, 1])
        norms = clipper.backward(losses, max_grad_norm=C, example_ids=example_ids)
        clipper.detach()
        return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None]), norms

    (poisoned, norms), (reference, _) = sums(poison=True), sums(poison=False)
    assert torch.isfinite(poisoned).all() and math.isinf(norms[1]) and torch.isfinite(norms[[0, 2]]).all()
    torch.testing.assert_close(poisoned, reference, rtol=1e-6, atol=1e-9)
