"""Gaussian noise, drawn once per logical batch.

Every rank derives the same generators from (seed, step) and adds the same noise *after* the clipped sums are
all-reduced, so the model sees noise of variance σ²C² whatever the world size.

The gradient noise is one flat draw over all trainable parameters, in chunks of `NOISE_CHUNK` elements: element
k of the flattened parameters (in the optimizer's parameter order) gets the (k mod NOISE_CHUNK)-th value of
chunk k // NOISE_CHUNK, whose generator is seeded from (seed, step, chunk) alone. So each element's noise
depends only on the seed, the step and its position, a rank holding a shard of the parameters can draw just the
chunks it needs, and a step launches one draw per chunk (a few, not one per parameter) plus one fused add.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import torch

from .transfer import to_device

_NOISE_STREAM = 1
_LOGGING_STREAM = 2
NOISE_CHUNK = 1 << 22  # elements per generator: 16 MiB of float32 noise at a time


def fresh_seed() -> int:
    """A seed from OS entropy: the default, so nobody can reconstruct (and subtract) the noise."""
    return secrets.randbits(63)


def chunk_seed(seed: int, step: int, chunk: int) -> int:
    """The generator seed of one chunk of step `step`'s gradient noise."""
    state = np.random.SeedSequence([seed, step, _NOISE_STREAM, chunk]).generate_state(1, dtype=np.uint64)[0]
    return int(state >> 1)


def noise_source(secure: bool) -> str:
    """What the noise is drawn from, precisely (for the report and the card)."""
    if secure:
        return ("cryptographic: SHAKE-256 keyed by a 63-bit seed from OS entropy, 53-bit uniforms, Box-Muller in "
                "float64, rounded to float32")
    return ("torch's generator (Philox on CUDA, Mersenne Twister on CPU), seeded per chunk from a 63-bit seed drawn "
            "from OS entropy: statistically, not cryptographically, strong")


def secure_normal(seed: int, step: int, stream: int, chunk: int, size: int) -> np.ndarray:
    """`size` standard normals from a cryptographic generator keyed by (seed, step, stream, chunk): SHAKE-256's
    output read as 53-bit uniforms, Box-Muller in float64 (tails to ~8.6σ). Deterministic, so every rank (or
    shard) draws the same values for the same key."""
    key = f"hf_dp noise {seed} {step} {stream} {chunk}".encode()
    words = np.frombuffer(hashlib.shake_256(key).digest(16 * size), dtype="<u8").reshape(2, size)
    u1 = ((words[0] >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0**53  # (0, 1]: log is finite
    u2 = (words[1] >> np.uint64(11)).astype(np.float64) / 2.0**53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def add_noise(params, *, noise_multiplier: float, max_grad_norm, seed: int, step: int, scale: float = 1.0,
              secure: bool = False) -> None:
    """Add N(0, (σ·C·scale)²) to every `p.grad`, drawn in float32 on the gradients' device.

    `max_grad_norm` C may be a 0-dim tensor on the device (adaptive clipping): the standard deviation then never
    leaves the device. `scale` is the normalisation the clipped sums already carry (1 / expected batch size).
    `secure` draws each chunk from [`secure_normal`] on the host instead of torch's generator (slower: about a
    second per 10⁸ elements on one CPU core).
    """
    grads = [_contiguous_grad(param) for param in params]
    total = sum(grad.numel() for grad in grads)
    std = noise_multiplier * scale * max_grad_norm
    position = [0, 0]  # (parameter, element within it) where the next chunk starts
    for chunk, start in enumerate(range(0, total, NOISE_CHUNK)):
        size = min(NOISE_CHUNK, total - start)
        device = grads[position[0]].device
        if secure:
            draws = secure_normal(seed, step, _NOISE_STREAM, chunk, size).astype(np.float32)
            noise = to_device(torch.from_numpy(draws), device)
        else:
            generator = torch.Generator(device=device).manual_seed(chunk_seed(seed, step, chunk))
            noise = torch.randn(size, generator=generator, device=device, dtype=torch.float32)
        if isinstance(std, torch.Tensor):
            noise.mul_(std)
            alpha = 1.0
        else:
            alpha = float(std)
        targets, pieces = _split(grads, noise, position)
        torch._foreach_add_(targets, pieces, alpha=alpha)


def _contiguous_grad(param) -> torch.Tensor:
    if not param.grad.is_contiguous():
        param.grad = param.grad.contiguous()
    return param.grad


def _split(grads, noise, position):
    """The gradient slices one chunk of noise covers, and the matching noise slices (views only)."""
    targets, pieces, used = [], [], 0
    while used < noise.numel():
        index, offset = position
        grad = grads[index]
        take = min(grad.numel() - offset, noise.numel() - used)
        piece = noise[used : used + take]
        if offset == 0 and take == grad.numel():
            targets.append(grad)
            pieces.append(piece.view(grad.shape))
        else:
            targets.append(grad.view(-1)[offset : offset + take])
            pieces.append(piece)
        used += take
        position[:] = [index + 1, 0] if offset + take == grad.numel() else [index, offset + take]
    return targets, pieces


def add_scalar_noise(values, stds, *, seed: int, step: int, secure: bool = False):
    """Each of `values` plus N(0, std²), drawn in float64 from (seed, step): the same on every rank.

    Used for the logged sums (loss, clipped units), on a stream of their own: the gradient noise is unchanged.
    `values` a 1-D tensor: the noise (drawn on the host) is added on its device, without reading it back, and a
    float64 tensor is returned; a list of numbers gives a list of floats.
    """
    if secure:
        noise = [float(z) * std for z, std in zip(secure_normal(seed, step, _LOGGING_STREAM, 0, len(stds)), stds)]
    else:
        rng = np.random.default_rng(np.random.SeedSequence([seed, step, _LOGGING_STREAM]))
        noise = [float(rng.normal(0.0, std)) for std in stds]
    if isinstance(values, torch.Tensor):
        draws = to_device(torch.tensor(noise, dtype=torch.float64), values.device)
        return values[: len(noise)].to(torch.float64) + draws
    return [float(value) + draw for value, draw in zip(values, noise)]
