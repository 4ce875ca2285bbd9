"""`hf_dp/clipping/packing.py`: packed rows (several examples per row, positions restarting at each, no
attention mask), regrouped into examples before the rules see them; against the shared oracle
(`clipping_oracle.py`) run on the same examples unpacked, one per row. DPTrainer with
`DataCollatorWithFlattening` is in `test_packed_batches.py`.
"""
from __future__ import annotations

import pytest
import torch
from clipping_oracle import REL_TOL, UNIT_IDS, assert_rel_close, hf_loss, oracle_clip
from tiny_models import model_inputs, tiny_batch, tiny_model, trainable_parameters

from hf_dp.clipping import GhostClipper, UnsupportedLayerError

# Packed rows: six examples in three rows of ten tokens (the last row ends in padding),
# positions restarting at each example, no attention mask.
_PACKED_LAYOUT = [[4, 6], [3, 3, 4], [5]]


def _packed_and_unpacked(seq_len: int = 10):
    """The same six examples packed into rows, and one per row right-padded (the oracle's batch)."""
    from tiny_models import VOCAB

    generator = torch.Generator().manual_seed(14)
    examples = [torch.randint(3, VOCAB, (n,), generator=generator) for row in _PACKED_LAYOUT for n in row]
    unpacked = tiny_batch(len(examples), seq_len, head="causal_lm", padding=False)
    unpacked["input_ids"].zero_()
    unpacked["attention_mask"].zero_()
    for index, tokens in enumerate(examples):
        unpacked["input_ids"][index, : len(tokens)] = tokens
        unpacked["attention_mask"][index, : len(tokens)] = 1
    unpacked["labels"] = unpacked["input_ids"].masked_fill(unpacked["attention_mask"] == 0, -100)
    rows = len(_PACKED_LAYOUT)
    input_ids = torch.zeros(rows, seq_len, dtype=torch.long)
    labels = torch.full((rows, seq_len), -100)
    position_ids = torch.zeros(rows, seq_len, dtype=torch.long)
    real = torch.zeros(rows, seq_len, dtype=torch.long)
    tokens_iter = iter(examples)
    for row, lengths in enumerate(_PACKED_LAYOUT):
        start = 0
        for length in lengths:
            tokens = next(tokens_iter)
            input_ids[row, start : start + length] = tokens
            labels[row, start + 1 : start + length] = tokens[1:]  # no label across an example boundary
            position_ids[row, start : start + length] = torch.arange(length)
            start += length
        position_ids[row, start:] = torch.arange(seq_len - start)  # the padding tail is a block of its own
        real[row, :start] = 1
    packed = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels, "real": real}
    return packed, unpacked


def _packed_losses(logits, packed, example_ids, num_examples):
    """Each example's mean next-token cross-entropy, from the packed rows."""
    labels = packed["labels"][:, 1:]
    token_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), labels, ignore_index=-100, reduction="none"
    )
    owners = example_ids[:, 1:].masked_fill(labels == -100, -1)
    kept = owners >= 0
    sums = token_loss.new_zeros(num_examples).index_add(0, owners[kept], token_loss[kept])
    return sums / torch.bincount(owners[kept], minlength=num_examples)


@pytest.mark.parametrize("arch,lora", [("llama", False), ("llama", True), ("gpt2", False)],
                         ids=["llama-full", "llama-lora", "gpt2-full"])
def test_packed_rows_match_the_examples_unpacked(arch, lora):
    from hf_dp.clipping.packing import examples_from_position_ids

    model = tiny_model(arch, "causal_lm", lora=lora, dtype=torch.float64, attn_implementation="sdpa")
    packed, unpacked = _packed_and_unpacked()
    norms_oracle, clipped_oracle = oracle_clip(
        model, model_inputs(unpacked), unpacked["labels"], hf_loss("causal_lm"), UNIT_IDS, 0.3
    )
    example_ids = examples_from_position_ids(packed["position_ids"], packed["real"])
    assert example_ids.tolist()[1] == [2, 2, 2, 3, 3, 3, 4, 4, 4, 4] and example_ids.tolist()[2][5:] == [-1] * 5
    with GhostClipper(model) as clipper:
        # No attention mask and no cache: transformers masks attention example by example.
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        losses = _packed_losses(logits, packed, example_ids, len(UNIT_IDS))
        norms = clipper.backward(losses, unit_ids=UNIT_IDS, max_grad_norm=0.3, example_ids=example_ids)
    assert torch.allclose(norms.double(), norms_oracle, rtol=REL_TOL, atol=0)
    for name, param in trainable_parameters(model).items():
        assert_rel_close(param.grad, clipped_oracle[name], name)


def test_packed_examples_that_attend_to_each_other_are_refused():
    """With a cache, transformers 5 does not mask packed examples from each other: gradients mix."""
    from hf_dp.clipping.packing import examples_from_position_ids

    model = tiny_model("llama", "causal_lm", dtype=torch.float64, attn_implementation="sdpa")
    packed, _ = _packed_and_unpacked()
    example_ids = examples_from_position_ids(packed["position_ids"], packed["real"])
    clipper = GhostClipper(model)
    logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=True).logits
    losses = _packed_losses(logits, packed, example_ids, len(UNIT_IDS))
    with pytest.raises(UnsupportedLayerError, match="do not come from their own example alone"):
        clipper.backward(losses, unit_ids=UNIT_IDS, max_grad_norm=0.3, example_ids=example_ids)
    assert all(param.grad is None for param in model.parameters())
