"""`hf_dp/clipping/position_bias.py`: T5's relative attention bias, one `(Tq, Tk, heads)` table lookup
shared by the whole batch, which the clipper supplies expanded to `(B, heads, Tq, Tk)` so that the
embedding rule sees each example's own gradient; against the shared oracle (`clipping_oracle.py`).
Encoder-decoders (T5, mT5, with LoRA and checkpointing) are rows of `test_clipping_families.py`.
"""
from __future__ import annotations

import pytest
import torch
from clipping_oracle import UNIT_IDS, check_against_oracle, squared_error
from tiny_models import PAD, VOCAB, tiny_batch
from torch import nn
from transformers import T5Config, T5EncoderModel

from hf_dp.clipping import GhostClipper
from hf_dp.clipping.position_bias import (
    bias_to_lookup_layout,
    expand_to_batch,
    is_relative_bias_attention,
    matches_lookup,
)

HIDDEN = 16


def _t5_encoder() -> T5EncoderModel:
    config = T5Config(
        vocab_size=VOCAB, pad_token_id=PAD, d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return T5EncoderModel(config).to(torch.float64).train()


def test_layout_helpers():
    table = torch.randn(8, 2)  # (buckets, heads)
    buckets = torch.randint(0, 8, (3, 4))  # (Tq, Tk)
    bias = table[buckets].permute(2, 0, 1).unsqueeze(0)  # (1, heads, Tq, Tk), as T5's compute_bias
    assert matches_lookup(bias, table, buckets)
    assert not matches_lookup(bias + 1, table, buckets)
    assert not matches_lookup(bias.expand(2, -1, -1, -1), table, buckets)  # already batched
    expanded = expand_to_batch(bias, 5)
    assert expanded.shape == (5, 2, 3, 4) and torch.equal(expanded[4], bias[0])
    assert bias_to_lookup_layout(expanded).shape == (5, 3, 4, 2)
    assert torch.equal(bias_to_lookup_layout(expanded)[0], table[buckets])


def test_only_the_first_attention_layer_owns_the_table():
    model = _t5_encoder()
    owners = [name for name, module in model.named_modules() if is_relative_bias_attention(module)]
    assert owners == ["encoder.block.0.layer.0.SelfAttention"]
    assert not is_relative_bias_attention(nn.Linear(2, 2))
    path = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias"
    assert GhostClipper(model).layers[path] == "embedding"


@pytest.mark.parametrize("units", ["users", "examples"])
def test_relative_bias_matches_oracle(units):
    """Padded examples of different lengths; the bias table's gradient differs example by example."""
    model = _t5_encoder()
    batch = tiny_batch(len(UNIT_IDS), 8, head="causal_lm", seed=15)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    targets = torch.randn(len(UNIT_IDS), 8, HIDDEN, dtype=torch.float64)

    def loss(output, labels):
        return squared_error(output.last_hidden_state, labels)

    check_against_oracle(model, inputs, targets, loss, UNIT_IDS if units == "users" else None)
