"""`hf_dp/noise_kernel.py`, the fused noise kernel of a CUDA device, run by Triton's interpreter on CPU tensors:
the reference engine's integer words bit for bit, its normals within a few float64 ulps, its rounded sums.

`TRITON_INTERPRET=1` is read when `@triton.jit` decorates a kernel (and by triton modules imported later), so it is
set before `hf_dp.noise_kernel` is imported, for the rest of the process (the module is reloaded if something
imported it without); skipped only where triton is not installed.
"""
from __future__ import annotations

import importlib
import logging
import os

import pytest
import torch

from hf_dp import noise

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'hf_dp[test]')")
from hf_dp import noise_kernel  # noqa: E402

if isinstance(noise_kernel.noise_kernel, triton.runtime.JITFunction):  # imported earlier, compiled for a GPU
    noise_kernel = importlib.reload(noise_kernel)

CPU = torch.device("cpu")
TILE = noise_kernel.TILE
SEED, STEP = 2**255 + 12345, 7
# Odd sizes around a tile, several parameters in one block, shards of a tensor (first element > 0, past 2³² too)
# and a parameter split where a block ends (parameter 3's elements [0, 2·TILE + 3) and on).
SEGMENTS = [(0, 0, 1), (1, 0, TILE - 1), (2, 0, TILE + 1), (3, 0, 2 * TILE + 3), (3, 2 * TILE + 3, 517),
            (9, 12_345, 777), (4, 2**32 - 300, 600), (2**31 + 5, 3 * 2**32 + 1, 33)]


def _key(stream: int = 1):
    return noise._device_key(SEED, STEP, stream)


def _reference_words(segments, stream: int = 1) -> torch.Tensor:
    return noise._device_words(SEED, STEP, stream, segments, CPU)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float64 ulps (same-sign values: the difference of their bit patterns)."""
    assert bool(((a >= 0) == (b >= 0)).all())
    return (a.view(torch.int64) - b.view(torch.int64)).abs()


def test_the_kernel_draws_the_reference_engines_words_bit_for_bit():
    words = noise_kernel.draws(SEGMENTS, _key(), CPU)
    assert words.dtype == torch.int64 and words.shape == (4, sum(count for _, _, count in SEGMENTS))
    assert torch.equal(words, _reference_words(SEGMENTS))
    assert not torch.equal(words, noise_kernel.draws(SEGMENTS, _key(stream=2), CPU))  # the key is an input


def test_a_shard_or_a_piece_draws_the_elements_of_the_whole():
    """Elements [a, b) of a parameter drawn alone (an FSDP2 shard, a piece cut where a block ends) are those
    elements of the whole parameter drawn at once, whatever is drawn beside them."""
    whole = noise_kernel.draws([(5, 0, 3 * TILE + 11)], _key(), CPU)
    pieces = noise_kernel.draws([(8, 40, 3), (5, 1500, 3 * TILE + 11 - 1500), (5, 0, 1500)], _key(), CPU)
    assert torch.equal(pieces[:, 3:], torch.cat([whole[:, 1500:], whole[:, :1500]], dim=1))


def test_the_kernels_normals_are_within_two_ulps_of_the_reference_engines():
    """log and cos differ by an ulp or so between libm implementations (here numpy's against torch's CPU ones):
    measured over these 5,743 draws, at most 2 ulps, in under 2 % of them."""
    normals = noise_kernel.draws(SEGMENTS, _key(), CPU, what="normals")
    reference = noise._box_muller(_reference_words(SEGMENTS))
    ulps = _ulps(normals, reference)
    assert int(ulps.max()) <= 2 and float((ulps > 0).double().mean()) < 0.02
    assert abs(float(normals.mean())) < 0.1 and abs(float(normals.std()) - 1) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("std", [0.01, 3.7e-3, 1.0])
def test_the_kernel_adds_what_the_reference_engine_adds(dtype, std):
    """grad + std·normal rounded once to the QUANTUM·std grid and then to the dtype: the same values as the
    reference (a ≤ 2-ulp difference in a normal moves a rounded sum with probability ~2⁻²⁷ per element)."""
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(count, generator=generator).mul(0.05).to(dtype) for _, _, count in SEGMENTS]
    before, expected = torch.cat(grads), [grad.clone() for grad in grads]
    std_on_device = torch.tensor([std], dtype=torch.float64)  # as adaptive clipping passes it: never read back
    noise_kernel.add_noise_(grads, SEGMENTS, _key(), std_on_device)
    noise._add_rounded(expected, noise._box_muller(_reference_words(SEGMENTS)), std)
    assert torch.equal(torch.cat(grads), torch.cat(expected))
    assert (torch.cat(grads) != before).double().mean() > 0.9  # the noise was added


def test_the_kernel_rounds_to_the_grid_the_reference_rounds_to():
    assert noise_kernel.QUANTUM.value == noise.QUANTUM


def test_two_ranks_add_identical_noise():
    """DDP: every rank adds the noise of the same elements; the kernel is a pure function of (key, element)."""
    grads = [[torch.full((count,), 0.25) for _, _, count in SEGMENTS] for _ in range(2)]
    for rank_grads in grads:
        noise_kernel.add_noise_(rank_grads, SEGMENTS, _key(), torch.tensor([0.5], dtype=torch.float64))
    assert torch.equal(torch.cat(grads[0]), torch.cat(grads[1]))


def test_a_block_of_mixed_dtypes_gets_one_launch_per_dtype_and_the_reference_noise(monkeypatch):
    launches = []
    add = noise_kernel.add_noise_
    monkeypatch.setattr(noise_kernel, "add_noise_", lambda grads, *args: launches.append(len(grads)) or add(
        grads, *args))
    monkeypatch.setattr(noise, "_kernel_failure", None)
    dtypes = [torch.float32, torch.bfloat16, torch.float32]
    segments = [(0, 0, 1000), (1, 0, 77), (2, 5, 1030)]
    grads = [torch.zeros(count, dtype=dtype) for (_, _, count), dtype in zip(segments, dtypes)]
    expected = [grad.clone() for grad in grads]
    noise._add_device_noise(SEED, STEP, segments, grads, 0.1)
    assert launches == [2, 1]
    words = _reference_words(segments)
    noise._add_rounded(expected[0::2], noise._box_muller(words[:, [*range(1000), *range(1077, 2107)]]), 0.1)
    noise._add_rounded(expected[1:2], noise._box_muller(words[:, 1000:1077]), 0.1)
    for grad, reference in zip(grads, expected):
        assert torch.equal(grad, reference)


def test_where_the_kernel_cannot_run_the_reference_engine_draws_and_says_so_once(monkeypatch, caplog):
    def fails(*args):
        raise RuntimeError("out of resources: shared memory\nsecond line")

    monkeypatch.setattr(noise_kernel, "add_noise_", fails)
    monkeypatch.setattr(noise, "_kernel_failure", None)
    assert "fused Triton kernel" in noise.noise_source(False, "cuda")
    segments = [(0, 3, 500), (1, 0, 9)]
    grads = [torch.zeros(count) for _, _, count in segments]
    expected = [grad.clone() for grad in grads]
    with caplog.at_level(logging.WARNING, logger="hf_dp.noise"):
        for _ in range(2):
            noise._add_device_noise(SEED, STEP, segments, grads, 0.1)
    noise._add_rounded(expected, noise._box_muller(_reference_words(segments)), 0.1)
    noise._add_rounded(expected, noise._box_muller(_reference_words(segments)), 0.1)
    assert all(torch.equal(grad, reference) for grad, reference in zip(grads, expected))
    warnings = [record.getMessage() for record in caplog.records if "fused noise kernel" in record.getMessage()]
    assert len(warnings) == 1 and "RuntimeError: out of resources: shared memory" in warnings[0]
    assert noise.noise_source(False, "cuda").startswith(
        "Philox4x32-10 in torch integer ops (the fused kernel could not run: RuntimeError: out of resources: shared "
        "memory) on the CUDA device, keyed per step (64 bits) by BLAKE2b of the run's secret (256 bits from OS ")


def test_the_kernel_refuses_a_device_it_cannot_run_on():
    """Interpreted, the kernel reads CPU memory only: a CUDA (or meta) tensor is refused before anything runs."""
    with pytest.raises(RuntimeError, match="CPU tensors only, not on meta"):
        noise_kernel.draws([(0, 0, 4)], _key(), "meta")


def test_the_kernel_traffic_is_the_gradient_read_and_written():
    """Counted from the kernel's loads and stores in the interpreter: per element, the gradient's bytes twice; per
    tile, 9 scalar words (the key, the tile's segment, its segment's row, the std)."""
    counted = noise_kernel.count_traffic(lambda: noise_kernel.add_noise_(
        [torch.zeros(count) for _, _, count in SEGMENTS], SEGMENTS, _key(), torch.tensor([1.0], dtype=torch.float64)))
    elements = sum(count for _, _, count in SEGMENTS)
    tiles = sum(-(-count // TILE) for _, _, count in SEGMENTS)
    assert counted == {"gradient_bytes": 2 * 4 * elements, "table_bytes": 9 * 8 * tiles, "elements": elements}
