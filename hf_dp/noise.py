"""Gaussian noise, drawn once per logical batch, the same whatever the number of processes or the sharding.

Every rank adds the noise *after* the clipped sums are summed over ranks, so the model sees noise of variance
σ²C² whatever the world size. Each parameter's gradient is noised in chunks of `NOISE_CHUNK` elements: element k
of the parameter named `name` gets the (k mod NOISE_CHUNK)-th value of chunk k // NOISE_CHUNK, whose generator
is seeded by a keyed hash of (seed, step, name, chunk) alone. So an element's noise depends only on the run's
secret seed, the step, its parameter and its index: a rank holding a shard (FSDP2) draws only the chunks its rows
touch, and 1, 2 or N processes, DDP or FSDP, add the same noise. A step launches one draw per chunk.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import torch

from .sharding import local_elements
from .transfer import to_device

_NOISE_STREAM = 1
_LOGGING_STREAM = 2
NOISE_CHUNK = 1 << 20  # elements per generator: 4 MiB of float32 noise at a time


def fresh_seed() -> int:
    """A seed from OS entropy: the default, so nobody can reconstruct (and subtract) the noise."""
    return secrets.randbits(63)


def chunk_seed(seed: int, step: int, name: str, chunk: int) -> int:
    """The generator seed of chunk `chunk` of parameter `name`'s noise at step `step`: BLAKE2b keyed by the seed."""
    message = f"{step} {_NOISE_STREAM} {name} {chunk}".encode()
    digest = hashlib.blake2b(message, key=str(seed).encode()[:64], digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def noise_source(secure: bool) -> str:
    """What the noise is drawn from, precisely (for the report and the card)."""
    if secure:
        return ("cryptographic: SHAKE-256 keyed by a 63-bit seed from OS entropy, 53-bit uniforms, Box-Muller in "
                "float64, rounded to float32")
    return ("torch's generator (Philox on CUDA, Mersenne Twister on CPU), seeded per chunk from a 63-bit seed drawn "
            "from OS entropy: statistically, not cryptographically, strong")


def secure_normal(seed: int, step: int, stream: int, chunk, size: int) -> np.ndarray:
    """`size` standard normals from a cryptographic generator keyed by (seed, step, stream, chunk): SHAKE-256's
    output read as 53-bit uniforms, Box-Muller in float64 (tails to ~8.6σ). Deterministic, so every rank (or
    shard) draws the same values for the same key."""
    key = f"hf_dp noise {seed} {step} {stream} {chunk}".encode()
    words = np.frombuffer(hashlib.shake_256(key).digest(16 * size), dtype="<u8").reshape(2, size)
    u1 = ((words[0] >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0**53  # (0, 1]: log is finite
    u2 = (words[1] >> np.uint64(11)).astype(np.float64) / 2.0**53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def add_noise(params, *, noise_multiplier: float, max_grad_norm, seed: int, step: int, scale: float = 1.0,
              secure: bool = False, names=None) -> None:
    """Add N(0, (σ·C·scale)²) to every `p.grad`, drawn in float32 on the gradients' device. `names`, the
    parameters' names (the same on every rank and under every wrapper), key their noise; without them a
    parameter is named by its position in `params`.

    A sharded gradient (an FSDP2 DTensor) gets the noise of its own elements only, drawn chunk by chunk (memory
    of one chunk beyond the shard). `max_grad_norm` C may be a 0-dim tensor on the device (adaptive clipping): the
    standard deviation then never leaves the device. `scale` is the normalisation the clipped sums already carry
    (1 / expected batch size). `secure` draws each chunk from [`secure_normal`] on the host instead of torch's
    generator (slower: about a second per 10⁸ elements on one CPU core).
    """
    std = noise_multiplier * scale * max_grad_norm
    params = list(params)
    names = [str(index) for index in range(len(params))] if names is None else list(names)
    for param, name in zip(params, names, strict=True):
        flat, first, total = local_elements(_contiguous_grad(param))
        last = first + flat.numel()
        for chunk in range(first // NOISE_CHUNK, -(-last // NOISE_CHUNK)):
            start = chunk * NOISE_CHUNK
            size = min(NOISE_CHUNK, total - start)  # fixed by the parameter: the same draws on every rank
            noise = _draw(seed, step, name, chunk, size, flat.device, secure)
            lo, hi = max(first, start), min(last, start + size)
            piece = noise[lo - start : hi - start]
            if isinstance(std, torch.Tensor):
                flat[lo - first : hi - first].add_(piece.mul_(std))
            else:
                flat[lo - first : hi - first].add_(piece, alpha=float(std))


def _draw(seed: int, step: int, name: str, chunk: int, size: int, device, secure: bool) -> torch.Tensor:
    if secure:
        draws = secure_normal(seed, step, _NOISE_STREAM, f"{name} {chunk}", size).astype(np.float32)
        return to_device(torch.from_numpy(draws), device)
    generator = torch.Generator(device=device).manual_seed(chunk_seed(seed, step, name, chunk))
    return torch.randn(size, generator=generator, device=device, dtype=torch.float32)


def _contiguous_grad(param) -> torch.Tensor:
    if not param.grad.is_contiguous():
        param.grad = param.grad.contiguous()
    return param.grad


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
