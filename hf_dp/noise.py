"""Gaussian noise that matches the proof: keyed by the full secret, reaching 14σ, added once per logical batch.

Three choices make the floating-point noise the Gaussian mechanism the accountant assumes (docs/guarantee.md,
"Noise in floating point", derives what is left):

- **Keys.** Every draw is a pure function of (secret, step, stream, parameter, element): a keyed BLAKE2b of the
  run's secret (256 bits from OS entropy, or `noise_seed`) and (step, stream) keys a counter-based generator whose
  counter is (element, parameter). Nothing truncates the key on the way, distinct (step, parameter, element)
  never share a draw, and a rank holding a shard (FSDP2) draws its own elements only: 1, 2 or N processes add
  the same noise. On the host (CPU) the generator is numpy's Philox4x64-10 (128-bit key), computed with the rest
  of the step's noise in one compiled pass where that kernel builds ([`~hf_dp.host_kernel`]; the same noise); on a
  CUDA device, Philox4x32-10 (64-bit key per step) in one fused Triton kernel per block ([`~hf_dp.noise_kernel`]),
  or, where that cannot run (no triton), in torch integer ops, the reference engine, which draws the same integers;
  with `secure_noise`, the cryptographic SHAKE-256 keyed by the whole secret.
- **Tails.** A Box–Muller pair (R·cos θ, R·sin θ) has R = sqrt(−2 ln u₁) from a 159-bit uniform u₁ ≥ 2⁻¹⁵⁹ and θ
  from a 53-bit one, in float64: its law is the Gaussian pair conditioned on R ≤ 14.85, each pair leaving out
  2⁻¹⁵⁹ of the Gaussian's mass, which [`~hf_dp.accounting.floating_point.sampler_delta`] adds to δ. On the host both
  coordinates are used (elements 2k and 2k + 1 of a parameter); on a CUDA device each element takes the first
  coordinate of a pair of its own.
- **One rounding.** The noise is scaled in float64, added to the gradient in float64, and the sum is rounded once:
  to a multiple of 2⁻²⁴·std, then to the gradient's dtype. Released values are never on a grid finer than the
  noise can reach, so no value is reachable with a user and unreachable without them (what adding float32 noise
  to a float32 sum allows: the sum's low bits then depend on the other summand's).

The noise of a step is drawn in blocks of at most `BLOCK` elements spanning all parameters, so a step launches a
few ops for the noise whatever the number of parameters.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import host_kernel
from .accounting.floating_point import NOISE_REACH, TAIL_BITS
from .sharding import local_elements
from .transfer import to_device

logger = logging.getLogger(__name__)
__all__ = ["fresh_seed", "noise_source", "standard_normal", "add_noise", "add_scalar_noise", "SECRET_BITS",
           "BLOCK", "DEVICE_BLOCK", "QUANTUM"]

SECRET_BITS = 256  # a fresh secret's width
BLOCK = 1 << 20  # elements drawn at a time on the host (their float64 noise and generator words: about 40 MiB)
HOST_CHUNK = 1 << 16  # elements a host thread draws and adds at once (their words and float64 noise stay in cache)
DEVICE_BLOCK = 1 << 23  # on a CUDA device: one kernel launch (the reference engine: 2 GiB of temporaries, ~100 ops)
QUANTUM = 2.0**-24  # released values are multiples of QUANTUM·std before the cast to the gradient's dtype
_NOISE_STREAM, _LOGGING_STREAM = 1, 2
_SECURE_CHUNK = 1 << 16  # elements per SHAKE-256 output stream (a shard reads only the chunks it holds)
_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # Philox4x32-10's multipliers and key increments (Salmon et al. 2011)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def fresh_seed() -> int:
    """A 256-bit secret from OS entropy: the default, so nobody can reconstruct (and subtract) the noise."""
    return secrets.randbits(SECRET_BITS)


def noise_source(secure: bool, device_type: str = "cpu") -> str:
    """What the noise is drawn from, precisely (for the report and the card)."""
    sampler = (f"Box-Muller in float64 from a 159-bit and a 53-bit uniform (draws reach {NOISE_REACH:.2f} standard "
               "deviations), added in float64 and rounded once")
    if secure:
        return f"cryptographic: SHAKE-256 keyed by the run's secret (OS entropy), {sampler}"
    generator = (f"Philox4x32-10 {_device_engine()} on the CUDA device, keyed per step (64 bits) by BLAKE2b of the "
                 "run's secret" if device_type == "cuda" else
                 "numpy's Philox4x64-10, keyed per step (128 bits) by BLAKE2b of the run's secret")
    return (f"{generator} (256 bits from OS entropy), counter = (element, parameter); {sampler}: statistically, "
            "not cryptographically, strong")


def _device_engine() -> str:
    """Which engine draws on a CUDA device: the fused kernel, or the reference engine once it could not run."""
    if _kernel_failure is None:
        try:
            import triton  # noqa: F401 - CUDA builds of torch ship it
        except ImportError:
            return "in torch integer ops (triton is not installed)"
        return "in one fused Triton kernel per block (hf_dp.noise_kernel)"
    return f"in torch integer ops (the fused kernel could not run: {_kernel_failure})"


def _secret_bytes(seed: int) -> bytes:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**512:
        raise ValueError(f"noise seed {seed!r}: the secret must be an integer in [0, 2**512).")
    return seed.to_bytes(64, "little")


def _stream_key(seed: int, step: int, stream: int, size: int, purpose: bytes) -> bytes:
    """`size` bytes of key for one (step, stream): BLAKE2b keyed by the whole secret."""
    return hashlib.blake2b(struct.pack("<QQ", step, stream) + purpose, key=_secret_bytes(seed),
                           digest_size=size, person=b"hf_dp noise").digest()


# ---- uniform words: four 53-bit integers per draw, (u₁'s three words, high first; θ) -------------------------
# On the host a block of words gives a Box–Muller pair, both coordinates used: element e of a parameter is
# coordinate e mod 2 of pair ⌊e/2⌋. On a CUDA device each element has its own two Philox4x32 blocks.

def _pairs(segments):
    """Per segment (parameter, first element, count): (parameter, first pair, pairs), covering its elements."""
    return [(index, first // 2, (first + count - 1) // 2 - first // 2 + 1) for index, first, count in segments]


def _host_key(seed: int, step: int, stream: int) -> np.ndarray:
    """The 128-bit Philox4x64 key of (step, stream) on the host, as two 64-bit words."""
    return np.frombuffer(_stream_key(seed, step, stream, 16, b"philox4x64"), dtype="<u8")


def _host_words(seed: int, step: int, stream: int, segments) -> list[np.ndarray]:
    """Per segment, `(pairs, 4)` words from numpy's Philox4x64-10: pair k of parameter j is the block at counter
    k + j·2⁶⁴ (numpy generates from counter + 1)."""
    key = _host_key(seed, step, stream)
    words = []
    for index, first, count in _pairs(segments):
        counter = ((index << 64) + first - 1) % 2**256
        words.append(np.random.Philox(key=key, counter=counter).random_raw(4 * count).reshape(count, 4) >> 11)
    return words


def _secure_words(seed: int, step: int, stream: int, segments) -> list[np.ndarray]:
    """Per segment, `(pairs, 4)` words from SHAKE-256 keyed by the whole secret, one output stream per (parameter,
    chunk of `_SECURE_CHUNK` pairs); a prefix of a stream is the same whatever length is read, so shards agree."""
    secret = _secret_bytes(seed)
    words = []
    for index, first, count in _pairs(segments):
        pieces = []
        for chunk in range(first // _SECURE_CHUNK, (first + count - 1) // _SECURE_CHUNK + 1):
            start = chunk * _SECURE_CHUNK
            lo, hi = max(first, start), min(first + count, start + _SECURE_CHUNK)
            message = b"hf_dp secure noise" + secret + struct.pack("<QQQQ", step, stream, index, chunk)
            raw = np.frombuffer(hashlib.shake_256(message).digest(32 * (hi - start)), dtype="<u8").reshape(-1, 4)
            pieces.append(raw[lo - start:] >> np.uint64(11))
        words.append(np.concatenate(pieces))
    return words


def _host_normals(words: list[np.ndarray], segments) -> np.ndarray:
    """The segments' elements, in order, from their pairs' words: both coordinates of each pair (element e of a
    segment is coordinate e mod 2 of its pair ⌊e/2⌋). All segments' pairs in one pass of torch's vectorised float64
    log, cos and sin (numpy's scalar ones cost 3× more), in `_radius_and_angle`'s operations."""
    all_words = words[0] if len(words) == 1 else np.concatenate(words)
    columns = torch.from_numpy(np.ascontiguousarray(all_words).view(np.int64))  # 53-bit words: non-negative
    high, middle, low, angle = (columns[:, column].to(torch.float64) for column in range(4))
    radius = high.mul_(2.0**106).add_(middle.mul_(2.0**53)).add_(low.add_(1.0)).mul_(2.0**-(3 * 53))
    radius.log_().mul_(-2.0).sqrt_()
    angle.mul_(2.0 * math.pi * 2.0**-53)
    flat = np.empty(2 * len(radius))  # numpy's memory, written by torch: (R cos θ, R sin θ) pair by pair
    pairs = torch.from_numpy(flat).view(-1, 2)
    torch.mul(radius, torch.cos(angle), out=pairs[:, 0])
    torch.mul(radius, angle.sin_(), out=pairs[:, 1])
    counts = np.array([count for _, _, count in segments], dtype=np.int64)
    skips = np.array([first % 2 for _, first, _ in segments], dtype=np.int64)
    if len(segments) == 1:
        return flat[skips[0]: skips[0] + counts[0]]
    pair_starts = 2 * np.concatenate([[0], np.cumsum([len(w) for w in words])[:-1]])  # each segment's first value
    out_starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return flat[np.arange(counts.sum()) + np.repeat(pair_starts + skips - out_starts, counts)]


def _device_words(seed: int, step: int, stream: int, segments, device) -> torch.Tensor:
    """`(4, n)` int64 words computed on `device` by Philox4x32-10 in torch integer ops: element e of parameter j
    takes two blocks, at counters (e mod 2³², ⌊e/2³²⌋ + 2³¹·half, j, 0), half ∈ {0, 1}; each word is 53 bits of
    two 32-bit outputs."""
    k0, k1 = _device_key(seed, step, stream)
    counts = [count for _, _, count in segments]
    n = sum(counts)
    offsets = np.cumsum([0] + counts[:-1])
    table = to_device(torch.tensor([[first - offset for (_, first, _), offset in zip(segments, offsets)],
                                    [index for index, _, _ in segments]], dtype=torch.int64), device)
    counts_on_device = to_device(torch.tensor(counts, dtype=torch.int64), device)
    element = torch.arange(n, device=device) + table[0].repeat_interleave(counts_on_device, output_size=n)
    parameter = table[1].repeat_interleave(counts_on_device, output_size=n)
    high = element >> 32
    counter = torch.stack([
        (element & _MASK32).repeat(2), torch.cat([high, high | (1 << 31)]), parameter.repeat(2),
        torch.zeros(2 * n, dtype=torch.int64, device=device)])
    c0, c1, c2, c3 = _philox4x32(counter, k0, k1)
    high, low = torch.stack([c0, c2]).reshape(2, 2, n), torch.stack([c1, c3]).reshape(2, 2, n)  # (word, half, n)
    return ((high << 21) | (low >> 11)).transpose(0, 1).reshape(4, n)


def _device_key(seed: int, step: int, stream: int) -> tuple[int, int]:
    """The 64-bit Philox4x32 key of (step, stream) on a CUDA device, as two 32-bit words."""
    return struct.unpack("<II", _stream_key(seed, step, stream, 8, b"philox4x32"))


def _philox4x32(counter: torch.Tensor, k0: int, k1: int, rounds: int = 10):
    """Philox4x32-`rounds` of a `(4, n)` int64 tensor of 32-bit counters under key (k0, k1): the four output
    words (each `(n,)`, values in [0, 2³²)). Products of two 32-bit words fit in int64's 64 bits (wrapping)."""
    round_keys = [[(k0 + r * _PHILOX_W[0]) & _MASK32, (k1 + r * _PHILOX_W[1]) & _MASK32] for r in range(rounds)]
    constants = to_device(torch.tensor([list(_PHILOX_M), *round_keys], dtype=torch.int64), counter.device)
    constants = constants.unsqueeze(-1)  # (1 + rounds, 2, 1): the multipliers, then each round's key
    left, right = counter[[0, 2]], counter[[1, 3]]  # (c0, c2) are multiplied; (c1, c3) are mixed in
    for r in range(rounds):
        product = left * constants[0]
        high, low = (product >> 32) & _MASK32, product & _MASK32
        left, right = high.flip(0) ^ right ^ constants[1 + r], low.flip(0)
    return left[0], right[0], left[1], right[1]


def _radius_and_angle(words, xp, float64):
    """(R, θ) from `(4, n)` 53-bit words: u₁ = (w₀·2¹⁰⁶ + w₁·2⁵³ + w₂ + 1)·2⁻¹⁵⁹ ∈ [2⁻¹⁵⁹, 1] gives
    R = sqrt(−2 ln u₁) ≤ sqrt(318 ln 2), and θ = 2π·w₃·2⁻⁵³, in float64 (`xp` is numpy or torch)."""
    high, middle, low, angle = (xp.asarray(word, dtype=float64) for word in words)
    radius = xp.sqrt(-2.0 * xp.log((high * 2.0**106 + middle * 2.0**53 + (low + 1.0)) * 2.0**-(3 * 53)))
    return radius, angle * (2.0 * math.pi * 2.0**-53)


def _box_muller(words: torch.Tensor) -> torch.Tensor:
    """One standard normal per column of `(4, n)` words on a device, R·cos θ (the pair's first coordinate), as
    `_radius_and_angle` computes R and θ, in 10 ops: u₁ as one product of the words with their scales."""
    words = words.to(torch.float64)
    scales = torch.tensor([[2.0**-53, 2.0**-106, 2.0**-159]], dtype=torch.float64, device=words.device)
    uniform = torch.mm(scales, words[:3]).add_(2.0**-159).clamp_(max=1.0)  # (1, n) in [2⁻¹⁵⁹, 1] after rounding
    radius = uniform.log_().mul_(-2.0).sqrt_()
    return radius.mul_(words[3:].mul_(2.0 * math.pi * 2.0**-53).cos_()).reshape(-1)


assert 3 * 53 == TAIL_BITS  # the reach the accountant's δ_fp assumes


def standard_normal(seed: int, step: int, segments, *, device="cpu", secure: bool = False,
                    stream: int = _NOISE_STREAM) -> torch.Tensor:
    """Float64 standard normals on `device` for `segments` [(parameter index, first element, count)], concatenated:
    the draws of those elements whatever else is drawn with them."""
    device = torch.device(device)
    if secure or device.type != "cuda":
        return to_device(torch.from_numpy(_drawn_on_host(seed, step, stream, segments, secure)), device)
    return _box_muller(_device_words(seed, step, stream, segments, device))


def _drawn_on_host(seed: int, step: int, stream: int, segments, secure: bool) -> np.ndarray:
    """The segments' float64 normals drawn on the host: by the compiled kernel where it runs
    ([`~hf_dp.host_kernel`]), else by numpy and torch; SHAKE-256's with `secure`."""
    kernel = None if secure else host_kernel.library()
    if kernel is None:
        words = (_secure_words if secure else _host_words)(seed, step, stream, segments)
        return _host_normals(words, segments)
    key = _host_key(seed, step, stream)
    drawn = [kernel.normals(key, index, first, count) for index, first, count in segments]
    return drawn[0] if len(drawn) == 1 else np.concatenate(drawn)


def add_noise(params, *, noise_multiplier: float, max_grad_norm, seed: int, step: int, scale: float = 1.0,
              secure: bool = False, names=None, grads=None) -> None:
    """Add N(0, (σ·C·scale)²) to every `p.grad`, summed in float64 and rounded once (see the module docstring).

    `grads`, when given, are the tensors noised in place instead of the `.grad`s, one per parameter (the step's
    float32 sums of bf16/fp16 parameters, [`~hf_dp.clipping.accumulate.ClippedGrads`]); the noise is the same.

    `names`, the parameters' names (the same on every rank and under every wrapper), number the parameters in their
    sorted order, so the noise of a parameter does not depend on the order of `params`; without them a parameter is
    numbered by its position. A sharded gradient (an FSDP2 DTensor) gets the noise of its own elements only.
    `max_grad_norm` C may be a 0-dim tensor on the device (adaptive clipping): the standard deviation then never
    leaves the device. `scale` is the normalisation the clipped sums already carry (1 / expected batch size).
    `secure` draws from SHAKE-256 on the host (slower: about a second per 10⁷ elements on one CPU core).
    """
    params = list(params)
    names = [str(index) for index in range(len(params))] if names is None else list(names)
    number = {name: index for index, name in enumerate(sorted(names))}
    if len(number) != len(params):
        raise ValueError("add_noise: two parameters share a name, so their noise would be the same.")
    std = noise_multiplier * scale * max_grad_norm
    if isinstance(std, torch.Tensor):
        std = std.to(torch.float64)
    elif not std > 0:
        raise ValueError(f"add_noise: the noise's standard deviation σ·C·scale = {std!r} must be positive.")
    pieces = []  # (parameter number, first element, this rank's flat elements)
    grads = [_contiguous_grad(param) for param in params] if grads is None else list(grads)
    if len(grads) != len(params):
        raise ValueError("add_noise: one tensor to noise per parameter.")
    for grad, name in zip(grads, names):
        flat, first, _ = local_elements(grad)
        size = _block_size(flat.device, secure)
        pieces += [(number[name], first + start, flat[start : start + size])
                   for start in range(0, flat.numel(), size)]
    for block in _blocks(pieces, secure):
        if not secure and all(_on_host(flat) for _, _, flat in block):
            _add_on_host(block, seed, step, std)
            continue
        segments = [(index, first, flat.numel()) for index, first, flat in block]
        grads = [flat for _, _, flat in block]
        if grads[0].device.type == "cuda" and not secure:
            _add_device_noise(seed, step, segments, grads, std)
        else:
            _add_rounded(grads, standard_normal(seed, step, segments, device=grads[0].device, secure=secure), std)


_kernel_failure = None  # why the fused kernel could not run, once it could not (then the reference engine draws)


def _add_device_noise(seed: int, step: int, segments, grads: list, std) -> None:
    """A block's noise on a CUDA device: one fused kernel launch per gradient dtype; where the kernel cannot run
    (no triton, or it fails to compile or launch), the reference engine, with a warning the first time."""
    global _kernel_failure
    device = grads[0].device
    std = std if isinstance(std, torch.Tensor) else torch.tensor(std, dtype=torch.float64)
    std = to_device(std.reshape(1), device) if std.device != device else std.reshape(1)
    for dtype in dict.fromkeys(grad.dtype for grad in grads):
        group = [index for index, grad in enumerate(grads) if grad.dtype == dtype]
        group_segments, group_grads = [segments[i] for i in group], [grads[i] for i in group]
        if _kernel_failure is None:
            try:
                from . import noise_kernel

                noise_kernel.add_noise_(group_grads, group_segments, _device_key(seed, step, _NOISE_STREAM), std)
                continue
            except Exception as error:  # noqa: BLE001 - raised before the launch: nothing was added
                _kernel_failure = f"{type(error).__name__}: {error}".splitlines()[0]
                logger.warning("The fused noise kernel cannot run (%s); the noise is drawn by the reference engine "
                               "(torch integer ops: the same noise, ~6.7 kB of memory traffic per element).",
                               _kernel_failure)
        words = _device_words(seed, step, _NOISE_STREAM, group_segments, device)
        _add_rounded(group_grads, _box_muller(words), std)


def _block_size(device, secure: bool) -> int:
    return DEVICE_BLOCK if device.type == "cuda" and not secure else BLOCK


def _blocks(pieces, secure: bool):
    """Consecutive pieces on one device, at most a block's elements together."""
    block, size = [], 0
    for piece in pieces:
        count, device = piece[2].numel(), piece[2].device
        if block and (size + count > _block_size(device, secure) or device != block[0][2].device):
            yield block
            block, size = [], 0
        block.append(piece)
        size += count
    if block:
        yield block


def _add_rounded(grads: list, noise: torch.Tensor, std) -> None:
    """grads ← round(grads + std·noise) (float64 `noise`, one flat tensor over `grads`): a multiple of QUANTUM·std,
    then the gradients' dtype. Six ops whatever the number of gradients."""
    quantum = std * QUANTUM
    noise.mul_(std)
    sums = noise.split([grad.numel() for grad in grads])
    torch._foreach_add_(sums, grads)
    noise.div_(quantum).round_().mul_(quantum)
    torch._foreach_copy_(grads, sums)


def _on_host(flat: torch.Tensor) -> bool:
    """A CPU float32/float64 gradient numpy can write in place (bf16 and devices take `_add_rounded`)."""
    return flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64) and flat.is_contiguous()


def _add_on_host(block, seed: int, step: int, std) -> None:
    """`_add_rounded` of the host engine's draws, chunk by chunk (at most `HOST_CHUNK` elements, small parameters
    together) on torch's intra-op threads: each chunk's words, Box–Muller pairs, noised sum and its one rounding stay
    in cache, and no block-sized float64 noise is held. The compiled kernel ([`~hf_dp.host_kernel`]) does a piece in
    one pass; without it, numpy and torch in about fifteen. Both release the GIL, so chunks run in parallel. The
    values are those of `standard_normal` + `_add_rounded`: the same words and float64 operations, in the same order
    (numpy's round is half-to-even, as torch's and the kernel's)."""
    std = float(std)
    quantum = std * QUANTUM
    kernel = host_kernel.library()
    key = _host_key(seed, step, _NOISE_STREAM)

    def noise_chunk(pieces) -> None:
        if kernel is not None:  # each piece's words, normals and rounded sum in one compiled pass
            for index, first, grad in pieces:
                kernel.add(key, index, first, grad, std, quantum)
            return
        segments = [(index, first, grad.size) for index, first, grad in pieces]
        noised = _host_normals(_host_words(seed, step, _NOISE_STREAM, segments), segments)
        np.multiply(noised, std, out=noised)
        np.add(noised, pieces[0][2] if len(pieces) == 1 else np.concatenate([grad for _, _, grad in pieces]),
               out=noised)
        np.divide(noised, quantum, out=noised)
        np.round(noised, out=noised)
        np.multiply(noised, quantum, out=noised)
        offset = 0
        for _, _, grad in pieces:
            grad[...] = noised[offset: offset + grad.size]
            offset += grad.size

    chunks = _host_chunks(block)
    threads = min(torch.get_num_threads(), len(chunks))
    if threads <= 1:
        for chunk in chunks:
            noise_chunk(chunk)
        return
    list(_host_pool(threads).map(noise_chunk, chunks))


def _host_chunks(block) -> list:
    """The block's pieces as numpy views, regrouped into chunks of at most `HOST_CHUNK` elements each."""
    chunks, chunk, size = [], [], 0
    for index, first, flat in block:
        grad = flat.numpy()
        for start in range(0, grad.size, HOST_CHUNK):
            piece = grad[start: start + HOST_CHUNK]
            if chunk and size + piece.size > HOST_CHUNK:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append((index, first + start, piece))
            size += piece.size
    return chunks + [chunk] if chunk else chunks


_POOLS: dict = {}


def _host_pool(threads: int) -> ThreadPoolExecutor:
    """One pool per thread count, kept for the process (the noise of every step runs on it)."""
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hf_dp-noise")
    return _POOLS[threads]


def _contiguous_grad(param) -> torch.Tensor:
    if not param.grad.is_contiguous():
        param.grad = param.grad.contiguous()
    return param.grad


def add_scalar_noise(values, stds, *, seed: int, step: int, secure: bool = False):
    """Each of `values` plus N(0, std²), rounded to a multiple of QUANTUM·std, in float64: the same on every rank.

    Used for the logged sums (loss, clipped units), on a stream of their own: the gradient noise is unchanged.
    `values` a 1-D tensor: the noise (drawn on the host) is added on its device, without reading it back, and a
    float64 tensor is returned; a list of numbers gives a list of floats.
    """
    stds = np.asarray(stds, dtype=np.float64)
    noise = _drawn_on_host(seed, step, _LOGGING_STREAM, [(0, 0, len(stds))], secure) * stds
    quantum = stds * QUANTUM
    if isinstance(values, torch.Tensor):
        noise, quantum = to_device(torch.from_numpy(np.stack([noise, quantum])), values.device)  # one copy
        return ((values[: len(stds)].to(torch.float64) + noise) / quantum).round_().mul_(quantum)
    return [float(value) for value in np.round((np.asarray(values, dtype=np.float64) + noise) / quantum) * quantum]
