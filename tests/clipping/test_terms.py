"""`hf_dp/clipping/terms.py`: per-unit norms and clipped sums from the rules' terms, ghost or
materialised (each strategy forced), tied parameters' cross terms, and the float32 compute dtype
under bf16 weights or autocast; against the shared oracle (`clipping_oracle.py`).

The whole-model table with each strategy forced is `test_forced_strategies_match_oracle` in
`test_architectures.py`; the embedding cross terms (GPT-2's tied and repeated uses) are in
`test_embedding.py`.
"""
from __future__ import annotations

import pytest
import torch
from clipping_oracle import UNIT_IDS, check_against_oracle, clip_by_engine, squared_error
from tiny_models import model_inputs, per_example_loss, tiny_batch, tiny_model, trainable_parameters
from torch import nn


class _TiedTokens(nn.Module):
    """Embedding -> linear -> output projection tied to the embedding: indexed, dense and cross terms."""

    def __init__(self):
        super().__init__()
        self.embed, self.inner, self.outer = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10)
        self.outer.weight = self.embed.weight

    def forward(self, input):
        return self.outer(torch.tanh(self.inner(self.embed(input))))


@pytest.mark.parametrize("strategy", ["auto", "ghost", "materialize"])
def test_each_strategy_matches_oracle(strategy):
    torch.manual_seed(0)
    model = _TiedTokens().double()
    generator = torch.Generator().manual_seed(2)
    inputs = {"input": torch.randint(0, 10, (6, 5), generator=generator)}
    labels = torch.randn(6, 5, 10, dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS, strategy=strategy)


# ---------------------------------------------------------------------------------------
# Low precision: norms in float32


def test_bf16_norms_close_to_fp32():
    for arch, head in (("gpt2", "causal_lm"), ("llama", "seq_cls")):
        batch = tiny_batch(len(UNIT_IDS), 8, head=head, seed=10)
        results = {}
        def loss(output, labels, head=head):
            return per_example_loss(output.logits.float(), labels, head)

        for dtype in (torch.float32, torch.bfloat16):
            model = tiny_model(arch, head, dtype=dtype)
            results[dtype] = clip_by_engine(model, model_inputs(batch), batch["labels"], loss, UNIT_IDS, 1.0)
            for param in trainable_parameters(model).values():
                assert param.grad.dtype == dtype and torch.isfinite(param.grad).all()
        norms32, norms16 = results[torch.float32][0], results[torch.bfloat16][0]
        assert norms16.dtype == torch.float32
        assert torch.allclose(norms16, norms32, rtol=5e-2), (arch, norms16, norms32)


def test_autocast_bf16_forward_with_fp32_weights():
    """Mixed precision (accelerate's autocast): fp32 parameters, bf16 activations."""
    batch = tiny_batch(len(UNIT_IDS), 8, head="causal_lm", seed=12)
    loss = lambda output, labels: per_example_loss(output.logits.float(), labels, "causal_lm")  # noqa: E731
    model = tiny_model("llama", "causal_lm")
    norms32, _ = clip_by_engine(model, model_inputs(batch), batch["labels"], loss, UNIT_IDS, 1.0)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norms16, grads16 = clip_by_engine(model, model_inputs(batch), batch["labels"], loss, UNIT_IDS, 1.0)
    assert all(grad.dtype == torch.float32 for grad in grads16.values())
    assert torch.allclose(norms16, norms32, rtol=5e-2)
