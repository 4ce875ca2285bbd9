"""`hf_dp/clipping/engine.py`: GhostClipper's unit grouping, hooks, step mechanics, attach-time and
first-backward errors (`UnsupportedLayerError`), and row attribution, against the shared oracle
(`clipping_oracle.py`).

Rule lookup and custom rules are in `test_registry.py`, gradient checkpointing in
`test_checkpointing.py`, packed rows in `test_packing.py`.
"""
from __future__ import annotations

import pytest
import torch
from clipping_oracle import (
    REL_TOL,
    UNIT_IDS,
    assert_rel_close,
    check_against_oracle,
    clip_by_engine,
    hf_loss,
    oracle_clip,
    oracle_clip_micro_batches,
    squared_error,
)
from tiny_models import model_inputs, per_example_loss, tiny_batch, tiny_model, trainable_parameters
from torch import nn

from hf_dp.clipping import GhostClipper, UnsupportedLayerError

# ---------------------------------------------------------------------------------------
# Units: examples grouped by unit id, padding, micro-batches


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


def test_empty_batch_returns_no_norms_and_zero_grads():
    model = nn.Linear(3, 2)
    with GhostClipper(model) as clipper:
        losses = model(torch.randn(0, 3)).sum(1)
        norms = clipper.backward(losses, max_grad_norm=1.0)
    assert norms.shape == (0,)
    assert torch.count_nonzero(model.weight.grad) == 0


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
# Errors: before any step, or on the first backward with nothing written


def test_parameter_used_outside_its_layer_is_caught_on_first_backward():
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, input):
            hidden = self.layer(input)
            return torch.nn.functional.linear(hidden, self.layer.weight)  # a use no hook sees

    model = Reuse()
    clipper = GhostClipper(model)
    losses = model(torch.randn(4, 3)).pow(2).sum(1)
    with pytest.raises(UnsupportedLayerError, match=r"layer\.weight"):
        clipper.backward(losses, max_grad_norm=1.0)
    assert model.layer.weight.grad is None  # nothing written


def test_backward_without_captured_forward_raises():
    model = nn.Linear(3, 2)
    with GhostClipper(model) as clipper:
        with torch.no_grad():
            model(torch.randn(2, 3))
        with pytest.raises(RuntimeError, match="no forward pass was captured"):
            clipper.backward(torch.zeros(2, requires_grad=True), max_grad_norm=1.0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="strategy"):
        GhostClipper(nn.Linear(2, 2), strategy="fast")
    model = tiny_model("llama", "causal_lm")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="non-reentrant gradient checkpointing only"):
        GhostClipper(model)


# ---------------------------------------------------------------------------------------
# Row attribution: each captured row must belong to one example


class _Flattening(nn.Module):
    """Runs its linear layer on the tokens flattened to (B·T, d), batch-major (as OPT) or time-major."""

    def __init__(self, time_major: bool):
        super().__init__()
        self.time_major = time_major
        self.inner, self.outer = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, input):  # (B, T, 3)
        batch, tokens = input.shape[:2]
        if self.time_major:
            flat = self.inner(input.transpose(0, 1).reshape(batch * tokens, 3))  # rows: t * B + b
            hidden = flat.reshape(tokens, batch, 4).transpose(0, 1)
        else:
            hidden = self.inner(input.reshape(batch * tokens, 3)).reshape(batch, tokens, 4)  # rows: b * T + t
        return self.outer(torch.tanh(hidden))


def test_rows_flattened_over_batch_and_time_are_attributed_batch_major():
    torch.manual_seed(0)
    model = _Flattening(time_major=False).double()
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    check_against_oracle(model, inputs, labels, squared_error, UNIT_IDS)


def test_rows_of_other_examples_are_refused_before_any_grad():
    """Time-major rows read batch-major would mix examples: the first backward checks attribution."""
    torch.manual_seed(0)
    model = _Flattening(time_major=True).double()
    clipper = GhostClipper(model)
    losses = model(torch.randn(4, 6, 3, dtype=torch.float64)).pow(2).sum(dim=(1, 2))
    with pytest.raises(UnsupportedLayerError, match=r"rows.*\['inner \(Linear\)'\]"):
        clipper.backward(losses, max_grad_norm=1.0)
    assert all(param.grad is None for param in model.parameters())


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
