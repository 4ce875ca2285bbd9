"""GhostClipper on whole tiny transformers models against the shared oracle (`clipping_oracle.py`).

The table: GPT-2, Llama, BERT and Qwen2 (`tiny_models.py`) x sequence classification / causal LM x
full fine-tuning / LoRA, with padding and several examples per unit, per-unit norms and clipped
sums compared in float64 to a relative error of 1e-5; then again with each norm strategy forced
(slow). Each clipping rule has its own file (`test_linear.py`, `test_embedding.py`, `test_norm.py`,
`test_position_bias.py`, ...); the 35 transformers families are in `test_clipping_families.py`.
"""
from __future__ import annotations

import pytest
import torch
from clipping_oracle import UNIT_IDS, check_against_oracle, hf_loss
from tiny_models import ARCHITECTURES, model_inputs, tiny_batch, tiny_model

CASES = [(arch, head, lora) for arch in ARCHITECTURES for head in ("seq_cls", "causal_lm") for lora in (False, True)]
# BERT as a causal LM (tied decoder with its own bias) is the least common pairing: slow tier.
_SLOW = {("bert", "causal_lm", False), ("bert", "causal_lm", True)}


def _case_params(cases, slow=frozenset()):
    return [
        pytest.param(*case, id="-".join([case[0], case[1], "lora" if case[2] else "full"]),
                     marks=[pytest.mark.slow] if case in slow else [])
        for case in cases
    ]


@pytest.mark.parametrize("arch,head,lora", _case_params(CASES, _SLOW))
def test_matches_oracle_with_padding_and_users(arch, head, lora):
    model = tiny_model(arch, head, lora=lora, dtype=torch.float64)
    batch = tiny_batch(len(UNIT_IDS), 8, head=head, padding=True)
    check_against_oracle(model, model_inputs(batch), batch["labels"], hf_loss(head), UNIT_IDS)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
@pytest.mark.parametrize("arch,head,lora", _case_params(CASES))
def test_forced_strategies_match_oracle(arch, head, lora, strategy):
    model = tiny_model(arch, head, lora=lora, dtype=torch.float64)
    batch = tiny_batch(len(UNIT_IDS), 8, head=head, padding=True, seed=1)
    check_against_oracle(model, model_inputs(batch), batch["labels"], hf_loss(head), UNIT_IDS, strategy=strategy)


def test_benchmark_runs_on_a_tiny_model(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "clipping_overhead.py"
    spec = importlib.util.spec_from_file_location("clipping_overhead", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    benchmark.main([
        "--archs", "gpt2", "llama", "--hidden", "16", "--layers", "1", "--heads", "2", "--vocab", "64",
        "--seq-len", "8", "--batch-size", "2", "--reps", "1", "--warmup", "1", "--no-memory",
    ])
    table = capsys.readouterr().out
    assert "| Llama-like | lora |" in table and "| GPT-2-like (tied emb.) | full |" in table
    assert "fails" not in table
