"""`hf_dp/clipping/rules/embedding.py`: the `nn.Embedding` rule (token, position and token-type lookups),
against the shared oracle (`clipping_oracle.py`): padding rows, subclasses with their own forward,
position ids broadcast or expanded, tied and repeated uses of one table (the cross terms), and the
options that make per-example gradients impossible.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from clipping_oracle import (
    REL_TOL,
    UNIT_IDS,
    assert_rel_close,
    check_against_oracle,
    clip_by_engine,
    clip_by_oracle,
    hf_loss,
    oracle_clip,
    oracle_unit_grads,
    squared_error,
)
from tiny_models import model_inputs, tiny_batch, tiny_model
from torch import nn

from hf_dp.clipping import GhostClipper, UnsupportedLayerError

# ---------------------------------------------------------------------------------------
# The rule on a bare table


class _ScaledEmbedding(nn.Embedding):
    """Overrides forward and scales the lookup (as Gemma's token embedding does by sqrt(d))."""

    def forward(self, input):
        return F.embedding(input, self.weight, self.padding_idx) * 3.0


@pytest.mark.parametrize("embedding", [nn.Embedding, _ScaledEmbedding], ids=["plain", "own-forward"])
def test_embedding_with_padding_idx_matches_oracle(embedding):
    """Repeated ids within an example, padding ids whose row gets no gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(embedding(10, 4, padding_idx=0), nn.Tanh(), nn.Linear(4, 2)).double()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 10, (6, 7), generator=generator)
    ids[:, -2:] = 0  # padding at the end of every example
    inputs = {"input": ids}
    labels = torch.randn(6, 7, 2, dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS)
    assert GhostClipper(model).layers == {"0": "embedding", "2": "linear"}
    assert torch.count_nonzero(model[0].weight.grad[0]) == 0


def test_embedding_options_that_break_per_example_grads_raise():
    with pytest.raises(UnsupportedLayerError, match="max_norm"):
        GhostClipper(nn.Embedding(5, 3, max_norm=1.0))
    with pytest.raises(UnsupportedLayerError, match="scale_grad_by_freq"):
        GhostClipper(nn.Embedding(5, 3, scale_grad_by_freq=True))


# ---------------------------------------------------------------------------------------
# Position ids


@pytest.mark.parametrize("form", ["broadcast", "expanded"])
def test_position_ids_broadcast_or_expanded(form):
    model = tiny_model("gpt2", "seq_cls", dtype=torch.float64)
    batch = tiny_batch(len(UNIT_IDS), 8, seed=9)
    inputs = model_inputs(batch)
    positions = torch.arange(8)[None, :]
    if form == "expanded":
        inputs["position_ids"] = positions.expand(len(UNIT_IDS), -1)
        check_against_oracle(model, inputs, batch["labels"], hf_loss("seq_cls"), UNIT_IDS)
    else:
        # A (1, T) tensor cannot be vmapped over examples; its per-example slice is the same row.
        norms_oracle, clipped_oracle = oracle_clip(model, inputs, batch["labels"], hf_loss("seq_cls"), UNIT_IDS, 0.2)
        inputs["position_ids"] = positions
        norms, clipped = clip_by_engine(model, inputs, batch["labels"], hf_loss("seq_cls"), UNIT_IDS, 0.2)
        assert torch.allclose(norms.double(), norms_oracle, rtol=REL_TOL)
        for name in clipped_oracle:
            assert_rel_close(clipped[name], clipped_oracle[name], name)


# ---------------------------------------------------------------------------------------
# One table, several uses: tied weights and repeated lookups


def test_tied_embeddings_get_the_exact_joint_norm():
    model = tiny_model("gpt2", "causal_lm", dtype=torch.float64)
    assert model.lm_head.weight is model.transformer.wte.weight
    batch = tiny_batch(len(UNIT_IDS), 8, head="causal_lm", seed=5)
    joint_norms, _ = check_against_oracle(model, model_inputs(batch), batch["labels"], hf_loss("causal_lm"), UNIT_IDS)
    # The cross term matters here: counting the two uses as separate parameters (an
    # untied copy with the same values) gives norms far outside the tolerance.
    model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    untied = oracle_unit_grads(model, model_inputs(batch), batch["labels"], hf_loss("causal_lm"), UNIT_IDS)
    separate_norms, _ = clip_by_oracle(untied, 1.0)
    assert ((separate_norms - joint_norms).abs() / joint_norms).max() > 100 * REL_TOL


def test_layer_called_twice_gets_cross_terms():
    """GPT-2 looks token_type_ids up in wte as well: three uses of one weight."""
    model = tiny_model("gpt2", "causal_lm", dtype=torch.float64)
    batch = tiny_batch(len(UNIT_IDS), 8, head="causal_lm", seed=6)
    inputs = model_inputs(batch)
    generator = torch.Generator().manual_seed(0)
    inputs["token_type_ids"] = torch.randint(3, 10, batch["input_ids"].shape, generator=generator)
    check_against_oracle(model, inputs, batch["labels"], hf_loss("causal_lm"), UNIT_IDS)
