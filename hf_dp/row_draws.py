"""Which of its rows each user keeps under the contribution bound, for a million users at once.

A user with `n > G` rows keeps the rows at the positions `numpy.random.default_rng(seed).choice(n, size=G,
replace=False)` (sorted), `seed` keyed by (secret, user id) ([`~hf_dp.data.keyed_seed`]). Calling numpy once per user
costs ~15 µs; [`choose_positions`] computes the same positions for all users together, as numpy arrays over users:
the seed's `SeedSequence`, the `PCG64` state it seeds, and the `G` bounded draws of Floyd's algorithm that
`Generator.choice` runs for populations up to 10,000 rows. The few users outside that path (a draw that numpy
rejects and redraws, more than 10,000 rows) and a sample of the others are drawn by numpy itself, and a sample that
disagrees (another numpy) sends every user to numpy: the positions are numpy's in every case.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

_M32 = np.uint64(0xFFFFFFFF)
# numpy's SeedSequence constants (bit_generator.pyx) and PCG64's default 128-bit multiplier.
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = np.uint32(0xCA01F9DD), np.uint32(0x4973F715)
_PCG_MULT = (np.uint64(2549297995355413924), np.uint64(4865540595714422341))
_FLOYD_MAX_POPULATION = 10_000  # above it, Generator.choice tail-shuffles when G > n // 50
_CHECKED_USERS = 16  # users also drawn by numpy itself, to confirm the vectorised draws
_CHUNK = 1 << 18  # users drawn together (bounds the temporaries)


def numpy_positions(seed: int, n: int, bound: int) -> np.ndarray:
    """The sorted positions (among `n`) that `default_rng(seed)` keeps: the reference of [`choose_positions`]."""
    return np.sort(np.random.default_rng(int(seed)).choice(n, size=bound, replace=False))


def choose_positions(seeds: np.ndarray, sizes: np.ndarray, bound: int) -> np.ndarray:
    """The sorted positions each user keeps, `numpy_positions(seed, n, bound)` for every (seed, n) pair.

    Args:
        seeds (`np.ndarray`): `(users,)` uint64 seeds, one per user.
        sizes (`np.ndarray`): `(users,)` the users' numbers of rows, each above `bound`.
        bound (`int`): G, the rows each user keeps.

    Returns:
        `np.ndarray`: `(users, bound)` int64 positions, each row sorted.
    """
    seeds, sizes = np.asarray(seeds, dtype=np.uint64), np.asarray(sizes, dtype=np.int64)
    chosen = np.empty((len(seeds), bound), dtype=np.int64)
    exact = np.zeros(len(seeds), dtype=bool)  # drawn by numpy itself
    for start in range(0, len(seeds), _CHUNK):
        part = slice(start, start + _CHUNK)
        chosen[part], exact[part] = _floyd(seeds[part], sizes[part], bound)
    checked = np.unique(np.linspace(0, len(seeds) - 1, min(len(seeds), _CHECKED_USERS)).astype(np.int64))
    checked = checked[~exact[checked]]
    if any(not np.array_equal(chosen[u], numpy_positions(seeds[u], sizes[u], bound)) for u in checked):
        logger.warning("numpy's Generator.choice draws differently from hf_dp's vectorised copy: drawing each user's "
                       "rows with numpy itself (the same rows, more slowly).")
        exact[:] = True
    for user in np.flatnonzero(exact):
        chosen[user] = numpy_positions(seeds[user], sizes[user], bound)
    return chosen


def _floyd(seeds: np.ndarray, sizes: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """Floyd's sampling as `Generator.choice` runs it, for every user at once: for j = n-G .. n-1 draw v uniform in
    [0, j] (Lemire's bounded integer on a 32-bit draw) and keep v, or j when v was kept already. Returns the sorted
    positions and which users numpy must draw itself (a rejected draw, or a population above 10,000)."""
    state = _pcg64_states(seeds)
    users = len(seeds)
    exact = (sizes > _FLOYD_MAX_POPULATION) & (bound > sizes // 50)  # where numpy tail-shuffles instead
    chosen = np.empty((users, bound), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # each user's place in `kept`, one flag per row
    kept = np.zeros(int(sizes.sum()), dtype=bool)
    word = np.zeros(users, dtype=np.uint64)
    for k in range(bound):
        if k % 2 == 0:  # a 64-bit output gives two 32-bit draws, its low half first
            state = _pcg64_step(state)
            word = _pcg64_output(state)
            draw = word & _M32
        else:
            draw = word >> np.uint64(32)
        top = (sizes - bound + k).astype(np.uint64)  # j: the draw is uniform in [0, j]
        span = top + np.uint64(1)
        scaled = draw * span
        leftover = scaled & _M32
        exact |= leftover < (np.uint64(1 << 32) - span) % span  # numpy would reject this draw and draw again
        value = (scaled >> np.uint64(32)).astype(np.int64)
        chosen[:, k] = np.where(kept[starts + value], top.astype(np.int64), value)
        kept[starts + chosen[:, k]] = True
    chosen.sort(axis=1)
    return chosen, exact


def _pcg64_states(seeds: np.ndarray) -> tuple:
    """`PCG64(SeedSequence(seed))`'s 128-bit (state, increment), as (state_hi, state_lo, inc_hi, inc_lo) uint64."""
    with np.errstate(over="ignore"):
        words = [(seeds & _M32).astype(np.uint32), (seeds >> np.uint64(32)).astype(np.uint32),
                 np.zeros(len(seeds), np.uint32), np.zeros(len(seeds), np.uint32)]
        constant = [_INIT_A]

        def hashmix(value):
            value = value ^ np.uint32(constant[0])
            constant[0] = (constant[0] * _MULT_A) & 0xFFFFFFFF
            value = value * np.uint32(constant[0])
            return value ^ (value >> np.uint32(16))

        def mix(x, y):
            result = _MIX_MULT_L * x - _MIX_MULT_R * y
            return result ^ (result >> np.uint32(16))

        pool = [hashmix(w) for w in words]
        for src in range(4):
            for dst in range(4):
                if src != dst:
                    pool[dst] = mix(pool[dst], hashmix(pool[src]))
        constant_b, state = _INIT_B, []
        for index in range(8):
            value = pool[index % 4] ^ np.uint32(constant_b)
            constant_b = (constant_b * _MULT_B) & 0xFFFFFFFF
            value = value * np.uint32(constant_b)
            state.append((value ^ (value >> np.uint32(16))).astype(np.uint64))
    seed_hi, seed_lo, inc_hi, inc_lo = (state[2 * i] | (state[2 * i + 1] << np.uint64(32)) for i in range(4))
    # pcg_setseq_128_srandom_r: inc = (initseq << 1) | 1; state = 0; step; state += initstate; step
    inc_hi = (inc_hi << np.uint64(1)) | (inc_lo >> np.uint64(63))
    inc_lo = (inc_lo << np.uint64(1)) | np.uint64(1)
    zero = np.zeros(len(seeds), dtype=np.uint64)
    hi, lo, _, _ = _pcg64_step((zero, zero, inc_hi, inc_lo))
    lo_sum = lo + seed_lo
    hi = hi + seed_hi + (lo_sum < lo).astype(np.uint64)
    return _pcg64_step((hi, lo_sum, inc_hi, inc_lo))


def _pcg64_step(state: tuple) -> tuple:
    """state = state · multiplier + increment (mod 2^128), in 64-bit halves."""
    hi, lo, inc_hi, inc_lo = state
    mult_hi, mult_lo = _PCG_MULT
    with np.errstate(over="ignore"):
        a0, a1, b0, b1 = lo & _M32, lo >> np.uint64(32), mult_lo & _M32, mult_lo >> np.uint64(32)
        p00, p01, p10 = a0 * b0, a0 * b1, a1 * b0
        middle = (p00 >> np.uint64(32)) + (p01 & _M32) + (p10 & _M32)
        low = (p00 & _M32) | (middle << np.uint64(32))
        high = a1 * b1 + (p01 >> np.uint64(32)) + (p10 >> np.uint64(32)) + (middle >> np.uint64(32))
        high = high + hi * mult_lo + lo * mult_hi
        new_lo = low + inc_lo
        new_hi = high + inc_hi + (new_lo < low).astype(np.uint64)
    return new_hi, new_lo, inc_hi, inc_lo


def _pcg64_output(state: tuple) -> np.ndarray:
    """PCG64's XSL-RR output of a 128-bit state: (hi ^ lo) rotated right by hi >> 58."""
    hi, lo = state[0], state[1]
    folded, rotation = hi ^ lo, hi >> np.uint64(58)
    return (folded >> rotation) | (folded << ((np.uint64(64) - rotation) & np.uint64(63)))
