"""Refuse models in which one example's output depends on the other examples of its batch.

DP-SGD bounds each unit's influence by clipping that unit's own gradient. A layer that mixes the
examples of a batch (BatchNorm in train mode, a layer subtracting the batch mean) lets one user move
every other example's loss, so the clipped sum moves by more than C and the noise no longer covers it.
So does a forward pass that depends on the batch's padded length (NEFTune scales its embedding noise by
it): the longest row of a micro-batch, someone else's, then changes every row's output; and one that depends on the
batch's number of rows (a hook reading the batch's shape): whether one more user is sampled then moves every other
example's output.

The trainer probes the model at construction, and the DP step on the model as it trains (after the base
trainer has attached its own hooks, in its `train`, and the callbacks' `on_train_begin` has run), so that a hook
attached late is probed too; again before any later step whose modules, forward hooks (torch's global ones
included) or an instance's `forward` changed ([`~hf_dp.step.DPStep.prepare`]).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

# In train mode these use, or record in their running statistics, statistics of the whole batch.
_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)  # BatchNorm1d/2d/3d, SyncBatchNorm, lazy variants


def check_batch_independence(model: nn.Module, features: dict | None = None, *, half_precision: bool = False) -> None:
    """Raise `ValueError` when one example's output can depend on another's (call before any step).

    Two checks: known batch-mixing layers by type, trainable or frozen (BatchNorm*, SyncBatchNorm, and
    InstanceNorm with `track_running_stats`, whose running statistics are released with the model); then,
    when `features` (a collated micro-batch, on the model's device) holds two distinct rows, a probe: two
    forward passes under `no_grad` in train mode from the same RNG state (same dropout masks), the second
    with row 0 replaced by another row: every other row's output must be unchanged. Then, with dropout off: the rows
    padded to a longer width must give the same outputs where their mask is 1, and row 0 alone must give the same
    output as row 0 inside batches of 3 and 8 rows (the other rows repeated as needed): nothing may depend on the
    batch's padded length or number of rows.

    The probes run with autocast off and accelerate's mixed-precision wrapper of `forward` lifted, so a float32
    model computes in float32 (bf16 autocast rounds by the batch's shape: it moved SmolLM2's logits by 0.8 between
    two paddings of the same rows). Outputs are compared to 10⁻⁴ of their scale, or 2·10⁻² where the forward pass
    still computes in half precision (`half_precision` under FSDP2, whose bf16 policy casts inside the forward;
    half-precision weights; float32 matmuls in TF32).

    The probe trains nothing and releases nothing (its only outcome is refusing to train), so it spends
    no privacy budget; RNG state, buffers and train/eval mode are restored afterwards.
    """
    for name, module in model.named_modules():
        mixes = isinstance(module, _BATCH_NORMS) or (
            isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats
        )
        if mixes:
            raise ValueError(
                f"Module {name!r} ({type(module).__name__}) uses batch statistics in train mode, so one example "
                "changes every other example's output and the per-unit clip no longer bounds a user's influence: "
                "replace it with GroupNorm or LayerNorm (frozen or not) before DP training."
            )
    if features:
        inputs = {k: v for k, v in features.items() if k != "labels"}
        with _without_autocast(model) as lifted:
            # autocast lifted, a float32 model computes exactly: only half-precision weights (FSDP2's bf16 policy,
            # bf16/fp16 parameters) or TF32 matmuls keep the half-precision tolerance
            half = (half_precision and not lifted) or _reduced_float32_matmul() \
                or any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
            _probe(model, inputs, half)
            _padding_probe(model, inputs, half)
            _row_count_probe(model, inputs, half)


@contextlib.contextmanager
def _without_autocast(model: nn.Module):
    """The probes' forward passes in the parameters' own precision: autocast off, and accelerate's mixed-precision
    wrapper of `forward` lifted (its `_original_forward` put back, hooks kept) until they end. Yields whether
    mixed precision (if any) was lifted: bf16 autocast rounds by the batch's shape (oneDNN's and cuBLAS' blocking),
    which moved SmolLM2's logits by 0.8 between two paddings of the same rows, so under autocast a padded-length
    or row-count dependence could only be told from rounding at a tolerance that would hide one."""
    patched = model
    while patched is not None and "_original_forward" not in vars(patched):
        inner = getattr(patched, "module", None)  # DDP: accelerate patched the module it wraps
        patched = inner if isinstance(inner, nn.Module) else None
    sharded = any(isinstance(module, FSDPModule) for module in model.modules())  # its policy casts inside forward
    wrapper = vars(patched).get("forward") if patched is not None else None
    if wrapper is not None:
        patched.forward = patched._original_forward
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    try:
        with contextlib.ExitStack() as stack:
            for device in devices:
                stack.enter_context(torch.autocast(device, enabled=False))
            yield not sharded
    finally:
        if wrapper is not None:
            patched.forward = wrapper


def _reduced_float32_matmul() -> bool:
    """float32 matmuls computed with fewer mantissa bits (TF32, `tf32=True`, or a float32 matmul precision below
    "highest"), whose rounding follows the batch's shape as half precision's does."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def _tolerance(output: torch.Tensor, half: bool) -> float:
    return 2e-2 if half or output.dtype not in (torch.float32, torch.float64) else 1e-4


def _probe(model: nn.Module, features: dict, half: bool = False) -> None:
    rows = {k: v for k, v in features.items() if torch.is_tensor(v) and v.dim() > 0}
    sizes = {v.shape[0] for v in rows.values()}
    size = sizes.pop() if len(sizes) == 1 else 0
    if size < 2:
        return
    other = next((j for j in range(1, size) if any(not torch.equal(v[0], v[j]) for v in rows.values())), None)
    if other is None:
        return  # all rows identical: nothing to perturb
    altered = dict(features)
    for key, value in rows.items():
        altered[key] = value.clone()
        altered[key][0] = value[other]
    was_training = model.training
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            cpu_state = torch.get_rng_state()
            cuda_state = torch.cuda.get_rng_state_all() if cuda else None
            original = _output(model(**features))
            torch.set_rng_state(cpu_state)
            if cuda:
                torch.cuda.set_rng_state_all(cuda_state)
            changed = _output(model(**altered))
    finally:
        model.train(was_training)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    if original is None or changed is None or original.shape != changed.shape:
        return
    tolerance = _tolerance(original, half)
    original, changed = original[1:].float(), changed[1:].float()
    moved = (original - changed).abs().max().item()
    if moved > tolerance * (1.0 + original.abs().max().item()):
        raise ValueError(
            f"Changing one example of a batch moved the other examples' outputs (by up to {moved:.3g}): a layer of "
            f"this {type(model).__name__} mixes examples (e.g. batch statistics), which breaks DP-SGD's per-unit "
            "sensitivity bound. Replace such layers with per-example ones (GroupNorm, LayerNorm) before DP training."
        )


# Dropout draws a mask the size of the batch, so a wider batch draws other masks: off for the padding probe.
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout}


class _WithoutDropout(TorchFunctionMode):
    """Dropout (functional, modules and attention's `dropout_p`) as the identity; everything else unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            if len(args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


def _padding_probe(model: nn.Module, features: dict, half: bool = False, extra: int = 8) -> None:
    """The rows again with `extra` more padding positions (attention mask 0) must give the same outputs where
    the mask is 1, in train mode with dropout off: nothing may depend on the batch's padded length."""
    mask = features.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2 or "position_ids" in features:
        return  # without a mask (or with packed positions) padding is not neutral: nothing to compare
    rows, width = mask.shape
    pad_id = _pad_id(model, features.get("input_ids"), mask)
    padded = {}
    for key, value in features.items():
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (rows, width):
            fill = pad_id if key == "input_ids" else 0
            value = torch.cat([value, value.new_full((rows, extra, *value.shape[2:]), fill)], dim=1)
        padded[key] = value
    was_training = model.training
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), _WithoutDropout():
            state = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None)
            original = _output(model(**features))
            torch.set_rng_state(state[0])
            if cuda:
                torch.cuda.set_rng_state_all(state[1])
            wider = _output(model(**padded))
    finally:
        model.train(was_training)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    if original is None or wider is None:
        return
    if original.dim() >= 2 and original.shape[1] == width and wider.shape[1] == width + extra:
        wider = wider[:, :width]
        keep = mask.bool().reshape(rows, width, *([1] * (original.dim() - 2)))
        original, wider = original * keep, wider * keep
    if original.shape != wider.shape:
        return
    tolerance = _tolerance(original, half)
    moved = (original.float() - wider.float()).abs().max().item()
    if moved > tolerance * (1.0 + original.float().abs().max().item()):
        raise ValueError(
            f"Padding the same rows to a longer batch moved their outputs (by up to {moved:.3g}): this "
            f"{type(model).__name__}'s forward pass depends on the batch's padded length or draws noise other than "
            "dropout (e.g. NEFTune's embedding noise, neftune_noise_alpha), so one user's rows change every other "
            "user's; DP-SGD's per-unit sensitivity bound no longer holds. Remove that hook or setting."
        )


def _row_count_probe(model: nn.Module, features: dict, half: bool = False, sizes: tuple = (3, 8)) -> None:
    """Row 0 alone, then first in batches of `sizes` rows (the rows cycled), must give the same output, in train mode
    with dropout off: nothing may depend on how many rows (how many sampled users) a batch holds."""
    rows = {k: v for k, v in features.items() if torch.is_tensor(v) and v.dim() > 0}
    counts = {v.shape[0] for v in rows.values()}
    if len(counts) != 1 or min(counts) < 1:
        return
    count = counts.pop()
    outputs = {size: _forward_without_dropout(model, _cycled(features, rows, size, count)) for size in (1, *sizes)}
    alone = outputs.pop(1)
    if alone is None or alone.shape[0] != 1:
        return
    tolerance = _tolerance(alone, half)
    scale = alone.float().abs().max().item()
    for size, output in outputs.items():
        if output is None or output.shape[0] != size or output.shape[1:] != alone.shape[1:]:
            continue
        moved = (output[:1].float() - alone.float()).abs().max().item()
        if moved > tolerance * (1.0 + scale):
            raise ValueError(
                f"The same example gave another output alone than in a batch of {size} rows (by up to {moved:.3g}): "
                f"this {type(model).__name__}'s forward pass depends on the batch's number of rows (e.g. a hook or "
                "layer reading the batch's shape), so whether one more user is sampled changes every other user's "
                "output and DP-SGD's per-unit sensitivity bound no longer holds. Remove that hook or layer."
            )


def _cycled(features: dict, rows: dict, size: int, count: int) -> dict:
    """`features` with `size` rows: row 0 first, then the others in order, cycled."""
    index = torch.arange(size) % count
    return {k: (v.index_select(0, index.to(v.device)) if k in rows else v) for k, v in features.items()}


def _forward_without_dropout(model: nn.Module, features: dict) -> torch.Tensor | None:
    """The output of one forward pass under `no_grad` in train mode with dropout off; RNG state, buffers and the
    train/eval mode restored."""
    was_training = model.training
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), _WithoutDropout():
            return _output(model(**features))
    finally:
        model.train(was_training)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _pad_id(model: nn.Module, input_ids, mask) -> int:
    """The token the batch pads with (read off its padding), else the model's `pad_token_id`, else 0."""
    if torch.is_tensor(input_ids) and input_ids.shape == mask.shape and not bool(mask.all()):
        return int(input_ids[mask == 0][0])
    config = getattr(getattr(model, "base_model", model), "config", None) or getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else 0


def _output(output) -> torch.Tensor | None:
    """The logits (or first output) of a forward pass."""
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        output = output[0] if output else None
    return output if torch.is_tensor(output) else None
