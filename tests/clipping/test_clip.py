"""`hf_dp/clipping/clip.py`: the clipped sums added to `.grad`: accumulated over micro-batches, unchanged by
padding tokens, zeros for a trainable layer that does not reach the loss; against the shared oracle
(`clipping_oracle.py`).

Per-unit norms of each term kind and strategy are in `test_terms.py`; the unit grouping in `test_units.py`
and `test_engine.py`.
"""
from __future__ import annotations

import torch
from clipping_oracle import UNIT_IDS, assert_rel_close, clip_by_engine, hf_loss, oracle_clip_micro_batches
from tiny_models import model_inputs, tiny_batch, tiny_model, trainable_parameters
from torch import nn

from hf_dp.clipping import GhostClipper


def test_accumulates_over_micro_batches():
    model = tiny_model("bert", "seq_cls", lora=True, dtype=torch.float64)
    loss = hf_loss("seq_cls")
    first, second = tiny_batch(4, 7, seed=7), tiny_batch(3, 5, seed=8)
    first_units, second_units = torch.tensor([0, 1, 0, 2]), torch.tensor([3, 3, 4])
    max_grad_norm = 0.05
    micro_batches = ((first, first_units), (second, second_units))
    expected = oracle_clip_micro_batches(
        model, [(model_inputs(batch), batch["labels"], units) for batch, units in micro_batches], loss, max_grad_norm
    )
    with GhostClipper(model) as clipper:
        for batch, units in micro_batches:
            losses = loss(model(**model_inputs(batch)), batch["labels"])
            clipper.backward(losses, unit_ids=units, max_grad_norm=max_grad_norm)
    for name, param in trainable_parameters(model).items():
        assert_rel_close(param.grad, expected[name], name)


def test_padding_tokens_contribute_nothing():
    """Appending padding to every example leaves norms and clipped sums unchanged."""
    model = tiny_model("gpt2", "causal_lm", dtype=torch.float64)
    batch = tiny_batch(4, 6, head="causal_lm", seed=4)
    padded = {key: torch.nn.functional.pad(value, (0, 3), value=-100 if key == "labels" else 0)
              for key, value in batch.items()}
    loss = hf_loss("causal_lm")
    norms, grads = clip_by_engine(model, model_inputs(batch), batch["labels"], loss, UNIT_IDS[:4], 0.5)
    model.zero_grad(set_to_none=True)
    norms_padded, grads_padded = clip_by_engine(model, model_inputs(padded), padded["labels"], loss, UNIT_IDS[:4], 0.5)
    assert torch.allclose(norms_padded, norms, rtol=1e-6)
    for name in grads:
        assert_rel_close(grads_padded[name], grads[name], name)


def test_unused_trainable_layer_gets_zero_grad():
    class Partial(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, input):
            self.unused(input)  # computed, never reaches the loss
            return self.used(input)

    model = Partial()
    with GhostClipper(model) as clipper:
        clipper.backward(model(torch.randn(4, 3)).sum(1), max_grad_norm=1.0)
    assert torch.count_nonzero(model.unused.weight.grad) == 0
    assert torch.count_nonzero(model.used.weight.grad) > 0
