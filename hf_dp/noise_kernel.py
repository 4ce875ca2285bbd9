"""The noise of a block in one Triton kernel: Philox4x32-10, Box–Muller in float64 and the rounded sum in registers.

On a CUDA device [`~hf_dp.noise.add_noise`] launches [`noise_kernel`] once per block of gradients of one dtype.
Each program takes `TILE` consecutive elements of one gradient and, for each element, computes what the reference
engine in `hf_dp.noise` (`_device_words`, `_box_muller`, `_add_rounded`) computes with ~100 torch ops on `(4, 2n)`
tensors:

- two Philox4x32-10 blocks under the step's 64-bit key, at counters (e mod 2³², ⌊e/2³²⌋ + 2³¹·half, j, 0) for
  element e of parameter j (e counts in the whole tensor, so a shard draws its own elements), four 53-bit words
  from their eight 32-bit outputs: the same integers, bit for bit;
- u₁ = w₀·2⁻⁵³ + w₁·2⁻¹⁰⁶ + w₂·2⁻¹⁵⁹ + 2⁻¹⁵⁹ (capped at 1), R = sqrt(−2 ln u₁), θ = w₃·2π·2⁻⁵³, the normal R·cos θ,
  all in float64, as `_box_muller` sums them;
- the gradient plus std·normal in float64, rounded to a multiple of QUANTUM·std (half to even), then to the
  gradient's dtype (through float32 for bf16 and fp16, as torch's cast from float64 does; bf16 rounded with
  integer ops, `_to_bfloat16`, since the interpreter's cast to bf16 truncates).

Global memory: the gradient is read and written once; per program, a few words of a small table (the key, the
segment each tile belongs to, each segment's address, first element, parameter and size) and the std. The key and
the std are read from device memory, so nothing recompiles per step or per key and an adaptive std never leaves
the device. `fp_fusion` is off: a product and a sum are rounded separately, as torch's separate kernels round them.

Transcendentals: `tl.log`, `tl.cos` and `tl.sqrt` of float64, which the CUDA backend lowers to libdevice's
`__nv_log`, `__nv_cos` and IEEE sqrt (CUDA's math library, as torch's CUDA `log`/`cos` use), and Triton's
interpreter (`TRITON_INTERPRET=1`, CPU tensors) to numpy's; `triton.language.extra.libdevice` is not used because
the interpreter cannot run it. Rounding half to even is written out (`_round_half_even`) for the same reason.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from .transfer import to_device

TILE = 1024  # elements per program
QUANTUM = tl.constexpr(2.0**-24)  # hf_dp.noise.QUANTUM (tests/test_noise_kernel.py checks they agree)
_HEADER = tl.constexpr(3)  # the table starts with k0, k1 and the block's element count
_ROW = tl.constexpr(6)  # per segment: address, first element, parameter, first tile, count, first element in the block
_MODES = {"add": 0, "words": 1, "normals": 2}
_M0 = tl.constexpr(0xD2511F53)  # Philox4x32-10's multipliers and key increments (Salmon et al. 2011)
_M1 = tl.constexpr(0xCD9E8D57)
_W0 = tl.constexpr(0x9E3779B9)
_W1 = tl.constexpr(0xBB67AE85)
_ANGLE = tl.constexpr(2.0 * math.pi * 2.0**-53)
_OUT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
               torch.float64: tl.float64}


@triton.jit
def _philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of uint32 counters under the uint32 key (k0, k1)."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, _M0)
        hi1 = tl.umulhi(c2, _M1)
        lo0 = tl.mul(c0, _M0, sanitize_overflow=False)
        lo1 = tl.mul(c2, _M1, sanitize_overflow=False)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = tl.add(k0, _W0, sanitize_overflow=False)
        k1 = tl.add(k1, _W1, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _word(high, low):
    """53 bits of two 32-bit outputs, (high << 21) | (low >> 11), as uint64."""
    return (high.to(tl.uint64) << 21) | (low >> 11).to(tl.uint64)


@triton.jit
def _round_half_even(x):
    """x rounded to an integer, ties to even (torch.round), in float64."""
    down = tl.floor(x)
    rest = x - down  # exact
    up = (rest > 0.5) | ((rest == 0.5) & (down - 2.0 * tl.floor(down * 0.5) != 0.0))
    return tl.where(up, down + 1.0, down)


@triton.jit
def _to_bfloat16(x):
    """float32 to bfloat16, to nearest, ties to even (torch's cast; the interpreter's own cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def noise_kernel(table, std_ptr, out, MODE: tl.constexpr, OUT_DTYPE: tl.constexpr, TILE: tl.constexpr):
    """One tile of one segment. MODE 0: its gradient += std·normal, rounded; 1: its four words into `out`
    (int64, `(4, n)`); 2: its float64 normals into `out` (`(n,)`)."""
    tile = tl.program_id(0)
    k0 = tl.load(table).to(tl.uint32)
    k1 = tl.load(table + 1).to(tl.uint32)
    segment = tl.load(table + _HEADER + tile)
    row = table + _HEADER + tl.num_programs(0) + _ROW * segment
    offsets = (tile - tl.load(row + 3)) * TILE + tl.arange(0, TILE).to(tl.int64)  # within the segment
    inside = offsets < tl.load(row + 4)
    element = tl.load(row + 1) + offsets  # in the whole tensor
    c0 = (element & 0xFFFFFFFF).to(tl.uint32)
    c1 = (element >> 32).to(tl.uint32)
    c2 = c0 * 0 + tl.load(row + 2).to(tl.uint32)
    c3 = c0 * 0
    a0, a1, a2, a3 = _philox4x32(c0, c1, c2, c3, k0, k1)
    b0, b1, b2, b3 = _philox4x32(c0, c1 | 0x80000000, c2, c3, k0, k1)
    w0, w1, w2, w3 = _word(a0, a1), _word(a2, a3), _word(b0, b1), _word(b2, b3)
    if MODE == 1:
        n = tl.load(table + 2)
        at = out + tl.load(row + 5) + offsets
        tl.store(at, w0.to(tl.int64), mask=inside)
        tl.store(at + n, w1.to(tl.int64), mask=inside)
        tl.store(at + 2 * n, w2.to(tl.int64), mask=inside)
        tl.store(at + 3 * n, w3.to(tl.int64), mask=inside)
    else:
        uniform = w0.to(tl.float64) * 2.0**-53 + w1.to(tl.float64) * 2.0**-106 + w2.to(tl.float64) * 2.0**-159
        uniform = tl.minimum(uniform + 2.0**-159, 1.0)
        radius = tl.sqrt(tl.log(uniform) * -2.0)
        normal = radius * tl.cos(w3.to(tl.float64) * _ANGLE)
        if MODE == 2:
            tl.store(out + tl.load(row + 5) + offsets, normal, mask=inside)
        else:
            std = tl.load(std_ptr)
            quantum = std * QUANTUM
            grads = tl.load(row).to(tl.pointer_type(OUT_DTYPE)) + offsets
            total = normal * std + tl.load(grads, mask=inside).to(tl.float64)
            total = _round_half_even(total / quantum) * quantum
            if OUT_DTYPE == tl.float64:
                tl.store(grads, total, mask=inside)
            elif OUT_DTYPE == tl.float32:
                tl.store(grads, total.to(tl.float32), mask=inside)
            elif OUT_DTYPE == tl.bfloat16:
                tl.store(grads, _to_bfloat16(total.to(tl.float32)), mask=inside)
            else:
                tl.store(grads, total.to(tl.float32).to(OUT_DTYPE), mask=inside)


def _table(key: tuple[int, int], segments, addresses, device) -> tuple[torch.Tensor, int]:
    """(the kernel's int64 table on `device`, tiles): header, the segment of each tile, then a row per segment."""
    counts = np.array([count for _, _, count in segments], dtype=np.int64)
    tiles = -(-counts // TILE)
    first_tiles = np.cumsum(tiles) - tiles
    rows = np.stack([np.asarray(addresses, dtype=np.int64), [first for _, first, _ in segments],
                     [index for index, _, _ in segments], first_tiles, counts, np.cumsum(counts) - counts], axis=1)
    tile_segment = np.repeat(np.arange(len(segments), dtype=np.int64), tiles)
    header = np.array([key[0], key[1], counts.sum()], dtype=np.int64)
    table = np.concatenate([header, tile_segment, rows.reshape(-1)])
    return to_device(torch.from_numpy(table), device), int(tiles.sum())


def _check_device(device: torch.device) -> None:
    interpreted = not isinstance(noise_kernel, triton.runtime.JITFunction)
    if interpreted and device.type != "cpu":
        raise RuntimeError(f"TRITON_INTERPRET=1 runs the noise kernel on CPU tensors only, not on {device}")
    if not interpreted and device.type != "cuda":
        raise RuntimeError(f"the noise kernel runs on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1), "
                           f"not on {device}")


def add_noise_(grads: list, segments, key: tuple[int, int], std: torch.Tensor) -> None:
    """grads ← round(grads + std·normal) in one launch: `grads` flat contiguous tensors of one dtype on one device,
    `segments` their (parameter, first element, count), `key` the step's (k0, k1), `std` a float64 tensor."""
    device, dtype = grads[0].device, grads[0].dtype
    _check_device(device)
    if any(grad.dtype != dtype or grad.device != device or not grad.is_contiguous() for grad in grads):
        raise ValueError("add_noise_: one launch noises contiguous gradients of one dtype on one device")
    table, tiles = _table(key, segments, [grad.data_ptr() for grad in grads], device)
    noise_kernel[(tiles,)](table, std, table, MODE=0, OUT_DTYPE=_OUT_DTYPES[dtype], TILE=TILE,
                           enable_fp_fusion=False)


def draws(segments, key: tuple[int, int], device, what: str = "words") -> torch.Tensor:
    """The kernel's `(4, n)` int64 words (as `hf_dp.noise._device_words` returns them) or its `(n,)` float64 normals
    (`what="normals"`) for `segments`: the debug entry that tests compare with the reference engine."""
    device = torch.device(device)
    _check_device(device)
    n = sum(count for _, _, count in segments)
    out = torch.empty((4, n) if what == "words" else (n,), dtype=torch.int64 if what == "words" else torch.float64,
                      device=device)
    table, tiles = _table(key, segments, [0] * len(segments), device)
    noise_kernel[(tiles,)](table, table, out, MODE=_MODES[what], OUT_DTYPE=tl.float64, TILE=TILE,
                           enable_fp_fusion=False)
    return out


def count_traffic(call) -> dict:
    """Bytes that `call()`'s launches of the interpreted kernel (`TRITON_INTERPRET=1`) load and store, counted at
    each load and store: `gradient_bytes` by the tiles' vector accesses (elements inside the mask only),
    `table_bytes` by the scalar ones (the key, a tile's segment and row, the std), `elements` the values stored."""
    from triton.runtime.interpreter import interpreter_builder as builder

    counts = {"gradient_bytes": 0, "table_bytes": 0, "elements": 0}

    def count(ptrs, mask, stored: bool) -> None:
        active = int(mask.data.sum())
        vector = ptrs.data.size > 1
        counts["gradient_bytes" if vector else "table_bytes"] += active * ptrs.get_element_ty().primitive_bitwidth // 8
        counts["elements"] += active if stored and vector else 0

    load, store = builder.create_masked_load, builder.create_masked_store
    builder.create_masked_load = lambda ptrs, mask, *args: count(ptrs, mask, False) or load(ptrs, mask, *args)
    builder.create_masked_store = lambda ptrs, value, mask, *args: count(ptrs, mask, True) or store(
        ptrs, value, mask, *args)
    try:
        call()
    finally:
        del builder.create_masked_load, builder.create_masked_store
    return counts
