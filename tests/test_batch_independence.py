"""hf_dp.batch_independence: layers that mix the examples of a batch are caught by type or by the probe; the probe
passes transformers models, with dropout, and leaves no trace."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_dp import batch_independence
from hf_dp.batch_independence import check_batch_independence
from tiny_models import ARCHITECTURES, HEADS, model_inputs, tiny_batch, tiny_model, with_dropout
from trainer_fixtures import ChannelFirst, MeanCentering, PooledClassifier, frozen


# ---- the probe passes per-example models and leaves no trace ------------------------------------------------------


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_probe_passes_with_dropout_and_leaves_no_trace(arch):
    model = with_dropout(arch).eval()
    features = model_inputs(tiny_batch(head="causal_lm" if arch == "gpt2" else "seq_cls", seed=3))
    rng = torch.get_rng_state()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    check_batch_independence(model, features)
    assert torch.equal(rng, torch.get_rng_state())  # the training RNG stream is untouched
    assert not model.training  # train/eval mode restored
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())


@pytest.mark.parametrize("arch, head, lora", [("gpt2", "causal_lm", False), ("llama", "causal_lm", True),
                                              ("bert", "seq_cls", False), ("qwen2", "seq_cls", True)])
def test_probe_passes_on_transformers(arch, head, lora):
    check_batch_independence(tiny_model(arch, head, lora=lora), model_inputs(tiny_batch(head=head)))


# ---- layers that mix the examples of a batch are refused ----------------------------------------------------------


@pytest.mark.parametrize("mixer, name", [
    (frozen(nn.BatchNorm1d(8)), "BatchNorm1d"),
    (nn.BatchNorm1d(8, affine=False), "BatchNorm1d"),
    (nn.SyncBatchNorm(8), "SyncBatchNorm"),
    (ChannelFirst(nn.InstanceNorm1d(1, track_running_stats=True)), "InstanceNorm1d"),
], ids=["frozen-batchnorm", "batchnorm-no-affine", "syncbatchnorm", "instancenorm-stats"])
def test_batch_statistics_layers_are_refused_by_type_without_running_the_model(mixer, name):
    with pytest.raises(ValueError, match=f"Module 'mixer.*' \\({name}\\) uses batch statistics"):
        check_batch_independence(PooledClassifier(mixer))  # no features: the type alone decides


def _features(rows: int = 4, width: int = 5) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, 40, (rows, width), generator=generator),
            "attention_mask": torch.ones(rows, width, dtype=torch.long), "labels": torch.zeros(rows, dtype=torch.long)}


def test_the_probe_catches_a_parameter_free_batch_mean_and_passes_per_example_layers():
    with pytest.raises(ValueError, match="moved the other examples' outputs"):
        check_batch_independence(PooledClassifier(MeanCentering()), _features())
    check_batch_independence(PooledClassifier(nn.LayerNorm(8)), _features())
    check_batch_independence(PooledClassifier(ChannelFirst(nn.InstanceNorm1d(1))), _features())  # no running stats
    check_batch_independence(PooledClassifier(MeanCentering()), _features(rows=1))  # one row: nothing to compare


# ---- a forward pass that depends on the batch's padded length is refused ------------------------------------------


def _neftune_like(model: nn.Module, alpha: float = 5.0):
    """NEFTune's embedding hook (transformers.integrations.neftune): in train mode, uniform noise of magnitude
    alpha / sqrt(L·d), L the batch's padded length."""
    def hook(module, args, output):
        if module.training:
            magnitude = alpha / (output.shape[1] * output.shape[2]) ** 0.5
            output = output + torch.zeros_like(output).uniform_(-magnitude, magnitude)
        return output

    return model.get_input_embeddings().register_forward_hook(hook)


@pytest.mark.parametrize("arch, head", [("llama", "causal_lm"), ("bert", "seq_cls")])
def test_the_padding_probe_catches_noise_scaled_by_the_padded_length(arch, head):
    model = tiny_model(arch, head)
    features = model_inputs(tiny_batch(head=head))
    check_batch_independence(model, features)
    handle = _neftune_like(model)
    with pytest.raises(ValueError, match="padded length"):
        check_batch_independence(model, features)
    handle.remove()


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("arch, head", [("gpt2", "causal_lm"), ("llama", "causal_lm"), ("bert", "seq_cls"),
                                        ("qwen2", "seq_cls")])
def test_the_padding_probe_passes_per_example_models_with_dropout_either_padding_side(arch, head, padding_side):
    model = with_dropout(arch) if arch in ("bert", "gpt2") else tiny_model(arch, head)
    check_batch_independence(model, model_inputs(tiny_batch(head=head, padding_side=padding_side)))


# ---- a forward pass that depends on the batch's number of rows is refused -----------------------------------------


def _row_count_hook(model: nn.Module):
    """Adds 2·sin(B) to the logits, B the batch's number of rows: the same for every row, so swapping a row or
    padding the batch moves nothing."""
    head = model.classifier if hasattr(model, "classifier") else model.get_output_embeddings()
    return head.register_forward_hook(lambda module, args, output: output + 2 * math.sin(output.shape[0]))


@pytest.mark.parametrize("arch, head", [("bert", "seq_cls"), ("llama", "causal_lm")])
def test_the_row_count_probe_catches_an_output_that_follows_the_number_of_rows(arch, head):
    model = tiny_model(arch, head)
    features = model_inputs(tiny_batch(head=head, batch_size=4))
    handle = _row_count_hook(model)
    with pytest.raises(ValueError, match="another output alone than in a batch of 3 rows") as error:
        check_batch_independence(model, features)
    assert "\n" not in str(error.value)
    # Invisible to the other probes: with the row-count probe off, the same model passes.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_independence, "_row_count_probe", lambda *args, **kwargs: None)
        check_batch_independence(model, features)
    handle.remove()
    check_batch_independence(model, features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_tiny_model_family_passes_every_probe(arch, head, lora, dtype):
    check_batch_independence(tiny_model(arch, head, lora=lora, dtype=dtype),
                             model_inputs(tiny_batch(head=head, batch_size=4)))


def test_a_single_probe_row_is_still_compared_with_batches_of_other_sizes():
    model = tiny_model("bert")
    features = model_inputs(tiny_batch(batch_size=1))
    check_batch_independence(model, features)
    handle = _row_count_hook(model)
    with pytest.raises(ValueError, match="number of rows"):
        check_batch_independence(model, features)
    handle.remove()


def test_float32_matmuls_in_tf32_get_the_half_precision_tolerance():
    """TF32 rounding follows the batch's shape, as bf16's does: a shift of 10⁻³ with the row count is refused in
    full float32 and within tolerance once float32 matmuls may use TF32."""
    model = tiny_model("bert")
    features = model_inputs(tiny_batch(batch_size=4))
    model.classifier.register_forward_hook(lambda module, args, output: output + 1e-3 * math.sin(output.shape[0]))
    with pytest.raises(ValueError, match="number of rows"):
        check_batch_independence(model, features)
    try:
        torch.set_float32_matmul_precision("high")
        check_batch_independence(model, features)
    finally:
        torch.set_float32_matmul_precision("highest")


# ---- under mixed precision the probes compute in the parameters' own precision ------------------------------------


def _accelerate_bf16(model: nn.Module) -> nn.Module:
    """`model` with its forward wrapped as `Accelerator(mixed_precision="bf16").prepare_model` wraps it."""
    from accelerate import Accelerator

    return Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)


def test_mixed_precision_is_lifted_while_the_probes_run_and_put_back():
    """bf16 autocast rounds by the batch's shape (it moved SmolLM2's logits by 0.8 between two paddings of the same
    rows): the probes run with accelerate's autocast wrapper lifted and autocast off, so a float32 model is compared
    exactly; the wrapper is back afterwards, and a real padded-length dependence is still refused."""
    model = tiny_model("llama", "causal_lm")
    features = model_inputs(tiny_batch(head="causal_lm"))
    prepared = _accelerate_bf16(model)
    wrapper = vars(prepared)["forward"]
    seen = []
    handle = prepared.get_output_embeddings().register_forward_hook(
        lambda module, args, output: seen.append((torch.is_autocast_enabled("cpu"), output.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's own autocast context, too
        check_batch_independence(prepared, features, half_precision=True)
    handle.remove()
    assert seen and set(seen) == {(False, torch.float32)}
    assert vars(prepared)["forward"] is wrapper
    assert prepared(**features).logits.dtype == torch.float32  # accelerate's wrapper still converts outputs
    handle = _neftune_like(prepared)
    with pytest.raises(ValueError, match="padded length"):
        check_batch_independence(prepared, features, half_precision=True)
    handle.remove()
    assert vars(prepared)["forward"] is wrapper  # put back after a refusal too
