"""GhostClipper against one oracle (`clipping_oracle.py`): per-example gradients from
`torch.func` (functional_call + vmap(grad)), summed per unit, clipped by brute force.

Every case compares the per-unit norms and the clipped gradient sums, in float64, to a
relative error of 1e-5. The transformers family table is in `test_clipping_families.py`.
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
    clip_by_oracle,
    oracle_unit_grads,
)
from tiny_models import (
    ARCHITECTURES,
    model_inputs,
    per_example_loss,
    tiny_batch,
    tiny_model,
    trainable_parameters,
)
from torch import nn

from hf_dp.clipping import EXAMPLE, ExampleGrad, GhostClipper, UnsupportedLayerError, register_rule


def hf_loss(head: str):
    return lambda output, labels: per_example_loss(output.logits, labels, head)


# ---------------------------------------------------------------------------------------
# The table: architecture x head x full/LoRA, with padding and several examples per unit

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


# ---------------------------------------------------------------------------------------
# Tied and shared parameters


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


class _Scale(nn.Module):
    """A custom elementwise layer for the registry tests: y = x * weight."""

    def __init__(self, *shape):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*shape))

    def forward(self, x):
        return x * self.weight


@register_rule(_Scale, name="test_scale", params={"weight": EXAMPLE})
def _scale_rule(layer, activations, output_grads):
    batch_size = output_grads.shape[0]
    per_token = (output_grads * activations).reshape((batch_size, -1) + layer.weight.shape)
    return {"weight": ExampleGrad(per_token.sum(1))}


def test_registered_custom_rule_is_used_and_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _Scale(4), nn.Tanh(), nn.Linear(4, 2)).double()
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    loss = lambda output, target: ((output - target) ** 2).sum(dim=(1, 2))  # noqa: E731
    check_against_oracle(model, inputs, labels, loss, UNIT_IDS)
    assert GhostClipper(model).layers == {"0": "linear", "1": "test_scale", "3": "linear"}


def test_parameter_shared_by_same_kind_rules_is_exact():
    """A Linear bias reused as a custom elementwise weight: both per-example terms, summed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _Scale(4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[1].weight = model[0].bias
    inputs = {"input": torch.randn(6, 5, 3, dtype=torch.float64)}
    labels = torch.randn(6, 5, 2, dtype=torch.float64)
    loss = lambda output, target: ((output - target) ** 2).sum(dim=(1, 2))  # noqa: E731
    check_against_oracle(model, inputs, labels, loss, UNIT_IDS)


def test_parameter_shared_by_incompatible_rules_raises():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), _Scale(4))
    model[1].weight = model[0].weight  # a linear weight also used elementwise: no joint rule
    with pytest.raises(UnsupportedLayerError, match=r"shared by 0\.weight, 1\.weight.*freeze"):
        GhostClipper(model)


# ---------------------------------------------------------------------------------------
# Coverage errors before any step


class _RawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.gain


def test_unknown_trainable_layers_raise_naming_each():
    model = nn.Sequential(nn.Linear(4, 4), _RawParameter(), nn.Conv2d(1, 1, 1))
    with pytest.raises(UnsupportedLayerError) as raised:
        GhostClipper(model)
    message = str(raised.value)
    assert "1 (" in message and "_RawParameter" in message and "gain" in message
    assert "2 (" in message and "Conv2d" in message
    # Nothing was attached: a plain forward and backward still work.
    model[0](torch.randn(2, 4)).sum().backward()


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


def test_frozen_unknown_layers_are_fine_and_get_nothing():
    model = nn.Sequential(nn.Linear(4, 4), _RawParameter())
    model[1].requires_grad_(False)
    with GhostClipper(model) as clipper:
        losses = model(torch.randn(3, 4)).sum(dim=1)
        clipper.backward(losses, max_grad_norm=1.0)
    assert model[1].gain.grad is None
    assert model[0].weight.grad is not None


def test_embedding_options_that_break_per_example_grads_raise():
    with pytest.raises(UnsupportedLayerError, match="max_norm"):
        GhostClipper(nn.Embedding(5, 3, max_norm=1.0))
    with pytest.raises(UnsupportedLayerError, match="scale_grad_by_freq"):
        GhostClipper(nn.Embedding(5, 3, scale_grad_by_freq=True))


def test_lora_base_weights_get_no_grad():
    model = tiny_model("llama", "causal_lm", lora=True, dtype=torch.float64)
    batch = tiny_batch(4, 6, head="causal_lm")
    clip_by_engine(model, model_inputs(batch), batch["labels"], hf_loss("causal_lm"), None, 1.0)
    for name, param in model.named_parameters():
        assert (param.grad is not None) == param.requires_grad, name


# ---------------------------------------------------------------------------------------
# Step mechanics


def test_accumulates_over_micro_batches():
    model = tiny_model("bert", "seq_cls", lora=True, dtype=torch.float64)
    loss = hf_loss("seq_cls")
    first, second = tiny_batch(4, 7, seed=7), tiny_batch(3, 5, seed=8)
    first_units, second_units = torch.tensor([0, 1, 0, 2]), torch.tensor([3, 3, 4])
    max_grad_norm = 0.05
    expected = {}
    for batch, units in ((first, first_units), (second, second_units)):
        unit_grads = oracle_unit_grads(model, model_inputs(batch), batch["labels"], loss, units)
        for name, clipped in clip_by_oracle(unit_grads, max_grad_norm)[1].items():
            expected[name] = expected.get(name, 0) + clipped
    with GhostClipper(model) as clipper:
        for batch, units in ((first, first_units), (second, second_units)):
            losses = loss(model(**model_inputs(batch)), batch["labels"])
            clipper.backward(losses, unit_ids=units, max_grad_norm=max_grad_norm)
    for name, param in trainable_parameters(model).items():
        assert_rel_close(param.grad, expected[name], name)


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
        unit_grads = oracle_unit_grads(model, inputs, batch["labels"], hf_loss("seq_cls"), UNIT_IDS)
        norms_oracle, clipped_oracle = clip_by_oracle(unit_grads, 0.2)
        inputs["position_ids"] = positions
        norms, clipped = clip_by_engine(model, inputs, batch["labels"], hf_loss("seq_cls"), UNIT_IDS, 0.2)
        assert torch.allclose(norms.double(), norms_oracle, rtol=REL_TOL)
        for name in clipped_oracle:
            assert_rel_close(clipped[name], clipped_oracle[name], name)


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
    loss = lambda output, target: ((output - target) ** 2).sum(dim=(1, 2))  # noqa: E731
    check_against_oracle(model, inputs, labels, loss, UNIT_IDS)


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


@pytest.mark.parametrize("arch,lora", [("llama", False), ("llama", True), ("gpt2", False), ("bert", True)],
                         ids=["llama-full", "llama-lora", "gpt2-full", "bert-lora"])
def test_gradient_checkpointing_matches_oracle(arch, lora):
    """Non-reentrant checkpointing (transformers' default): inputs of layers in checkpointed blocks
    are not held from the forward pass; they come from the recomputation, captured once."""
    head = "causal_lm" if arch != "bert" else "seq_cls"
    model = tiny_model(arch, head, lora=lora, dtype=torch.float64)
    batch = tiny_batch(len(UNIT_IDS), 8, head=head, seed=13)
    unit_grads = oracle_unit_grads(model, model_inputs(batch), batch["labels"], hf_loss(head), UNIT_IDS)
    norms_oracle, clipped_oracle = clip_by_oracle(unit_grads, 0.3)
    model.activation_checkpointing_enable()
    with GhostClipper(model) as clipper:
        losses = hf_loss(head)(model(**model_inputs(batch)), batch["labels"])
        deferred = [capture for capture in clipper._captures if capture.pending]
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
    loss = lambda output, target: ((output - target) ** 2).sum(dim=(1, 2))  # noqa: E731
    unit_grads = oracle_unit_grads(model, inputs, labels, loss, UNIT_IDS)
    norms_oracle, clipped_oracle = clip_by_oracle(unit_grads, 0.5)
    model.block.gradient_checkpointing = True
    model.block._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    with GhostClipper(model) as clipper:
        losses = loss(model(**inputs), labels)
        assert sum(capture.pending for capture in clipper._captures) == 6
        norms = clipper.backward(losses, unit_ids=UNIT_IDS, max_grad_norm=0.5)
    assert torch.allclose(norms.double(), norms_oracle, rtol=REL_TOL, atol=0)
    for name, param in model.named_parameters():
        assert_rel_close(param.grad, clipped_oracle[name], name)


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
    unit_grads = oracle_unit_grads(model, model_inputs(unpacked), unpacked["labels"], hf_loss("causal_lm"), UNIT_IDS)
    norms_oracle, clipped_oracle = clip_by_oracle(unit_grads, 0.3)
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
    with pytest.raises(UnsupportedLayerError, match="do not belong to the examples"):
        clipper.backward(losses, unit_ids=UNIT_IDS, max_grad_norm=0.3, example_ids=example_ids)
    assert all(param.grad is None for param in model.parameters())


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
    loss = lambda output, target: ((output - target) ** 2).sum(dim=(1, 2))  # noqa: E731
    check_against_oracle(model, inputs, labels, loss, UNIT_IDS)


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
    assert clipper._captures == []
    with clipper.disabled():
        model(**model_inputs(batch)).logits.sum().backward()
    assert clipper._captures == []
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    clipper.detach()
    model(**model_inputs(batch)).logits.sum().backward()
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, reference[name]), name


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


@pytest.mark.slow
def test_through_distributed_data_parallel(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = tiny_model("gpt2", "causal_lm", lora=True, dtype=torch.float64)
        batch = tiny_batch(len(UNIT_IDS), 8, head="causal_lm", seed=11)
        unit_grads = oracle_unit_grads(model, model_inputs(batch), batch["labels"], hf_loss("causal_lm"), UNIT_IDS)
        norms_oracle, clipped_oracle = clip_by_oracle(unit_grads, 0.3)
        wrapped = DistributedDataParallel(model)
        with GhostClipper(wrapped) as clipper, wrapped.no_sync():
            losses = per_example_loss(wrapped(**model_inputs(batch)).logits, batch["labels"], "causal_lm")
            norms = clipper.backward(losses, unit_ids=UNIT_IDS, max_grad_norm=0.3)
        assert torch.allclose(norms.double(), norms_oracle, rtol=REL_TOL)
        for name, param in trainable_parameters(model).items():
            assert_rel_close(param.grad, clipped_oracle[name], name)
    finally:
        dist.destroy_process_group()


def test_empty_batch_returns_no_norms_and_zero_grads():
    model = nn.Linear(3, 2)
    with GhostClipper(model) as clipper:
        losses = model(torch.randn(0, 3)).sum(1)
        norms = clipper.backward(losses, max_grad_norm=1.0)
    assert norms.shape == (0,)
    assert torch.count_nonzero(model.weight.grad) == 0
