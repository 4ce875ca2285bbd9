"""`hf_dp/clipping/engine.py`: `GhostClipper.backward` as callers use it: units by id (ordered by sorted id,
left padding), an empty batch, the errors of a misuse (no captured forward pass, an unknown strategy);
against the shared oracle (`clipping_oracle.py`).

Each stage has its own file: `test_attach.py` (which layers, refused before any step), `test_capture.py`
(forward hooks, gradient checkpointing), `test_rows.py` and `test_attribution.py` (whose rows are whose,
first-backward checks), `test_clip.py` (the clipped sums in `.grad`), `test_units.py`, `test_terms.py`.
"""
from __future__ import annotations

import pytest
import torch
from clipping_oracle import check_against_oracle, clip_by_engine, hf_loss
from tiny_models import model_inputs, tiny_batch, tiny_model
from torch import nn

from hf_dp.clipping import GhostClipper

# ---------------------------------------------------------------------------------------
# Units: examples grouped by unit id, padding


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_example_level_units_left_padding(arch):
    """unit_ids=None: every example is its own unit; left padding; all units clipped.

    SDPA attention: transformers' eager attention turns fully masked (left-pad) query
    rows into NaN in float64.
    """
    model = tiny_model(arch, "causal_lm", dtype=torch.float64, attn_implementation="sdpa")
    batch = tiny_batch(5, 9, head="causal_lm", padding_side="left", seed=2)
    check_against_oracle(model, model_inputs(batch), batch["labels"], hf_loss("causal_lm"), None, clip_fraction=0.0)


def test_unit_ids_none_equals_one_unit_per_example():
    model = tiny_model("llama", "seq_cls", dtype=torch.float64)
    batch = tiny_batch(4, 6, seed=3)
    loss = hf_loss("seq_cls")
    norms_none, grads_none = clip_by_engine(model, model_inputs(batch), batch["labels"], loss, None, 0.1)
    model.zero_grad(set_to_none=True)
    ids = torch.tensor([3, 0, 2, 1])  # unsorted: norms come back ordered by id
    norms_ids, grads_ids = clip_by_engine(model, model_inputs(batch), batch["labels"], loss, ids, 0.1)
    assert torch.allclose(norms_ids, norms_none[torch.argsort(ids)], rtol=1e-6)
    for name in grads_none:
        assert torch.allclose(grads_ids[name], grads_none[name], rtol=1e-9, atol=1e-12)


def test_empty_batch_returns_no_norms_and_zero_grads():
    model = nn.Linear(3, 2)
    with GhostClipper(model) as clipper:
        losses = model(torch.randn(0, 3)).sum(1)
        norms = clipper.backward(losses, max_grad_norm=1.0)
    assert norms.shape == (0,)
    assert torch.count_nonzero(model.weight.grad) == 0


# ---------------------------------------------------------------------------------------
# Misuse


def test_backward_without_captured_forward_raises():
    model = nn.Linear(3, 2)
    with GhostClipper(model) as clipper:
        with torch.no_grad():
            model(torch.randn(2, 3))
        with pytest.raises(RuntimeError, match="no forward pass was captured"):
            clipper.backward(torch.zeros(2, requires_grad=True), max_grad_norm=1.0)


def test_unknown_strategy_raises():
    with pytest.raises(ValueError, match="strategy"):
        GhostClipper(nn.Linear(2, 2), strategy="fast")
