"""`hf_dp/clipping/capture.py`: what the forward hooks capture, when, and through which wrappers; with
activation (gradient) checkpointing, layers inside checkpointed blocks take their inputs from the
recomputation, captured once, in backward order; against the shared oracle (`clipping_oracle.py`).

The families with checkpointing (OPT, BART, T5, Gemma, Falcon) are in `test_clipping_families.py`; the
refusal of reentrant checkpointing in `test_attach.py`; broadcast position ids in `test_embedding.py`, T5's
relative bias in `test_position_bias.py`, subclasses with their own forward in `test_linear.py`.
"""
from __future__ import annotations

import pytest
import torch
from clipping_oracle import (
    REL_TOL,
    UNIT_IDS,
    assert_rel_close,
    check_against_oracle,
    hf_loss,
    oracle_clip,
    squared_error,
)
from tiny_models import model_inputs, per_example_loss, tiny_batch, tiny_model, trainable_parameters
from torch import nn

from hf_dp.clipping import GhostClipper

# ---------------------------------------------------------------------------------------
# Hooks: what is captured, when, and through which wrappers


def test_in_place_op_on_layer_output_is_handled():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, input):
            hidden = self.first(input)
            hidden.mul_(2.0)  # in place on the (view) output of a hooked layer
            return self.second(torch.tanh(hidden))

    torch.manual_seed(0)
    model = InPlace().double()
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS)


def test_no_grad_forward_captures_nothing_and_plain_backward_still_works():
    model = tiny_model("llama", "seq_cls")
    batch = tiny_batch(4, 6)
    clipper = GhostClipper(model)
    with torch.no_grad():
        for _ in range(3):
            model(**model_inputs(batch))
    assert clipper.forward_capture.captures == []
    with clipper.disabled():
        model(**model_inputs(batch)).logits.sum().backward()
    assert clipper.forward_capture.captures == []
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    clipper.detach()
    model(**model_inputs(batch)).logits.sum().backward()
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, reference[name]), name


@pytest.mark.slow
def test_through_distributed_data_parallel(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = tiny_model("gpt2", "causal_lm", lora=True, dtype=torch.float64)
        batch = tiny_batch(len(UNIT_IDS), 8, head="causal_lm", seed=11)
        norms_oracle, clipped_oracle = oracle_clip(
            model, model_inputs(batch), batch["labels"], hf_loss("causal_lm"), UNIT_IDS, 0.3
        )
        wrapped = DistributedDataParallel(model)
        with GhostClipper(wrapped) as clipper, wrapped.no_sync():
            losses = per_example_loss(wrapped(**model_inputs(batch)).logits, batch["labels"], "causal_lm")
            norms = clipper.backward(losses, unit_ids=UNIT_IDS, max_grad_norm=0.3)
        assert torch.allclose(norms.double(), norms_oracle, rtol=REL_TOL)
        for name, param in trainable_parameters(model).items():
            assert_rel_close(param.grad, clipped_oracle[name], name)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# Gradient checkpointing: inputs from the recomputation


@pytest.mark.parametrize("arch,lora", [("llama", False), ("llama", True), ("gpt2", False), ("bert", True)],
                         ids=["llama-full", "llama-lora", "gpt2-full", "bert-lora"])
def test_gradient_checkpointing_matches_oracle(arch, lora):
    """Non-reentrant checkpointing (transformers' default): inputs of layers in checkpointed blocks
    are not held from the forward pass; they come from the recomputation, captured once."""
    head = "causal_lm" if arch != "bert" else "seq_cls"
    model = tiny_model(arch, head, lora=lora, dtype=torch.float64)
    batch = tiny_batch(len(UNIT_IDS), 8, head=head, seed=13)
    inputs = model_inputs(batch)
    norms_oracle, clipped_oracle = oracle_clip(model, inputs, batch["labels"], hf_loss(head), UNIT_IDS, 0.3)
    model.activation_checkpointing_enable()
    with GhostClipper(model) as clipper:
        losses = hf_loss(head)(model(**inputs), batch["labels"])
        deferred = [capture for capture in clipper.forward_capture.captures if capture.pending]
        assert deferred and all(capture.activations is None for capture in deferred)
        assert all(capture.layer.checkpoint_blocks for capture in deferred)  # only inside checkpointed blocks
        norms = clipper.backward(losses, unit_ids=UNIT_IDS, max_grad_norm=0.3)
        assert all(capture.activations is not None and not capture.pending for capture in deferred)
    assert torch.allclose(norms.double(), norms_oracle, rtol=REL_TOL, atol=0)
    for name, param in trainable_parameters(model).items():
        assert_rel_close(param.grad, clipped_oracle[name], name)


def test_gradient_checkpointing_of_a_block_shared_across_depths():
    """One checkpointed block called three times: recomputed in backward order, each input goes to its call."""
    import functools

    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Block(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.norm, self.linear = nn.LayerNorm(4), nn.Linear(4, 4)

        def forward(self, hidden):
            return hidden + torch.tanh(self.linear(self.norm(hidden)))

    class SharedDepth(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.block, self.head = nn.Linear(3, 4), Block(), nn.Linear(4, 2)

        def forward(self, input):
            hidden = self.embed(input)
            for _ in range(3):
                hidden = self.block(hidden)
            return self.head(hidden)

    torch.manual_seed(0)
    model = SharedDepth().double()
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    loss = squared_error
    norms_oracle, clipped_oracle = oracle_clip(model, inputs, labels, loss, UNIT_IDS, 0.5)
    model.block.gradient_checkpointing = True
    model.block._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    with GhostClipper(model) as clipper:
        losses = loss(model(**inputs), labels)
        assert sum(capture.pending for capture in clipper.forward_capture.captures) == 6
        norms = clipper.backward(losses, unit_ids=UNIT_IDS, max_grad_norm=0.5)
    assert torch.allclose(norms.double(), norms_oracle, rtol=REL_TOL, atol=0)
    for name, param in model.named_parameters():
        assert_rel_close(param.grad, clipped_oracle[name], name)
