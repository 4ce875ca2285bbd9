"""`hf_dp/noise.py`: the noise's law and reach, its keys (full width, one stream per step, parameter and element),
and one rounding of the noised sum."""
from __future__ import annotations

import math
import os
from unittest import mock

import numpy as np
import pytest
import torch
from scipy import stats

from hf_dp import noise
from hf_dp.accounting.floating_point import NOISE_REACH

# "host": the compiled kernel where it builds; "host-numpy": numpy and torch (HF_DP_HOST_KERNEL=0); "device": the CUDA
# engine's torch ops, run on the CPU
ENGINES = ["host", "host-numpy", "device", "secure"]


def _grads(*shapes):
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for param in params:
        param.grad = torch.zeros_like(param)
    return params


def _flat_noise(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def _draws(engine: str, seed: int, step: int, segments) -> torch.Tensor:
    if engine == "device":
        return noise._box_muller(noise._device_words(seed, step, 1, segments, torch.device("cpu")))
    if engine == "host-numpy":
        with mock.patch.dict(os.environ, {"HF_DP_HOST_KERNEL": "0"}):
            return noise.standard_normal(seed, step, segments)
    return noise.standard_normal(seed, step, segments, secure=engine == "secure")


def _first_coordinates(words: np.ndarray) -> np.ndarray:
    radius, angle = noise._radius_and_angle(words, np, np.float64)
    return radius * np.cos(angle)


@pytest.mark.parametrize("counter, key, expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_the_device_generator_is_philox4x32_10(counter, key, expected):
    """Random123's published known-answer vectors (Salmon et al. 2011)."""
    words = noise._philox4x32(torch.tensor(counter, dtype=torch.int64).reshape(4, 1), *key)
    assert tuple(int(word) for word in words) == expected


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_draws_standard_normals(engine):
    draws = _draws(engine, 7, 3, [(0, 0, 150_000), (1, 11, 50_000)]).numpy()
    assert abs(draws.mean()) < 5 / len(draws) ** 0.5 and abs(draws.std() - 1) < 0.01
    assert stats.kstest(draws, "norm").pvalue > 1e-4
    beyond = (np.abs(draws) > 3).sum()  # 540 expected
    assert 400 < beyond < 700


def test_the_sampler_reaches_twelve_standard_deviations():
    """The smallest u₁ (2⁻¹⁵⁹) gives the largest radius, sqrt(318 ln 2) ≈ 14.85; every draw lies within it."""
    top = 2**53 - 1
    elements = [(0, 0, 0, 0), (top, top, top, 0), (0, 2**20 - 1, top, 2**52)]  # (u₁'s three words, θ)
    words = np.array(elements, dtype=np.int64).T
    draws = _first_coordinates(words)
    assert draws[0] == pytest.approx(NOISE_REACH, rel=1e-12) and NOISE_REACH > 14.8  # u₁ = 2⁻¹⁵⁹, θ = 0
    assert draws[1] == 0.0  # u₁ = 1
    assert draws[2] == pytest.approx(-math.sqrt(2 * 86 * math.log(2)), rel=1e-9)  # u₁ = 2⁻⁸⁶, θ = π
    device_draws = noise._box_muller(torch.from_numpy(words)).numpy()
    np.testing.assert_allclose(device_draws, draws, rtol=1e-14, atol=1e-14)  # the host's formula and the device's


def test_the_radius_is_rayleigh_far_beyond_where_float32_samplers_stop():
    """P(R > r) = P(u₁ < e^(−r²/2)), checked at radii past 5.77 (torch's CPU float32 normals), 6.66 (curand's),
    8.57 (53-bit uniforms) and 12.12 (106-bit ones): u₁ is drawn uniformly from (0, H·2^(−53·j)] only (its first j
    words zero, the next below H), where P(R > r) = e^(−r²/2) / (H·2^(−53·j))."""
    rng = np.random.default_rng(0)
    n = 40_000
    for radius in (6.0, 9.0, 11.0, 13.0, 14.5):
        tail = math.exp(-radius**2 / 2)
        level = next(j for j in (1, 2, 3) if tail >= 2.0 ** (-53 * j))  # the word where e^(−r²/2) lies
        top = math.ceil(2 * tail * 2.0 ** (53 * level))
        words = [np.zeros(n, np.int64) for _ in range(level - 1)] + [rng.integers(0, top, n)]
        words += [rng.integers(0, 2**53, n) for _ in range(3 - level)] + [np.zeros(n, np.int64)]
        expected = tail / (top * 2.0 ** (-53 * level))
        beyond = (_first_coordinates(np.stack(words)) > radius).mean()
        assert 0.3 < expected < 0.7 and beyond == pytest.approx(expected, abs=5 * math.sqrt(expected / n)), radius


@pytest.mark.parametrize("engine", ENGINES)
def test_every_bit_of_the_secret_changes_the_draws(engine):
    """The key keeps the whole secret: seeds that differ in one bit (any of 256, high bits included) draw
    unrelated noise, unlike torch's CPU generator (which keeps 32 bits of a seed)."""
    secret = (1 << 255) | 0x1234567
    base = _draws(engine, secret, 0, [(0, 0, 8)])
    for bit in (0, 31, 32, 33, 63, 64, 127, 128, 200, 255):
        other = _draws(engine, secret ^ (1 << bit), 0, [(0, 0, 8)])
        assert not torch.isclose(other, base).any(), bit


@pytest.mark.parametrize("engine", ENGINES)
def test_distinct_steps_parameters_and_elements_never_share_a_stream(engine):
    draws = torch.cat([_draws(engine, 5, step, [(parameter, 0, 2000)]) for step in (0, 1, 2**32) for parameter
                       in (0, 1, 2**20)])
    assert torch.unique(draws).numel() == draws.numel()  # 18,000 float64 values: equal only if a stream repeats
    shifted = _draws(engine, 5, 0, [(0, 1, 2000)])  # the same stream from its second element
    torch.testing.assert_close(shifted[:-1], draws[1:2000], rtol=0, atol=0)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_shards_draws_are_those_of_its_elements(engine):
    whole = _draws(engine, 9, 4, [(3, 0, 70_000)])
    for first, count in ((0, 1), (12_345, 40_000), (65_530, 4470)):  # across the secure chunk boundary (65,536)
        torch.testing.assert_close(_draws(engine, 9, 4, [(3, first, count)]), whole[first: first + count],
                                   rtol=0, atol=0)


def test_noise_has_std_sigma_c_scale_per_element_and_mean_zero():
    params = _grads((300, 200), (1000,))
    noise.add_noise(params, noise_multiplier=0.7, max_grad_norm=2.0, seed=3, step=5, scale=0.25)
    flat = _flat_noise(params).double()
    assert flat.std().item() == pytest.approx(0.7 * 2.0 * 0.25, rel=0.01)
    assert abs(flat.mean().item()) < 4 * 0.35 / np.sqrt(flat.numel())


def test_a_device_tensor_clipping_norm_gives_the_same_noise_as_the_float():
    as_float, as_tensor = _grads((7, 3), (11,)), _grads((7, 3), (11,))
    noise.add_noise(as_float, noise_multiplier=1.3, max_grad_norm=0.5, seed=1, step=2, scale=0.1)
    noise.add_noise(as_tensor, noise_multiplier=1.3, max_grad_norm=torch.tensor(0.5, dtype=torch.float64), seed=1,
                    step=2, scale=0.1)
    torch.testing.assert_close(_flat_noise(as_tensor), _flat_noise(as_float), rtol=0, atol=0)


def test_each_elements_noise_depends_only_on_seed_step_parameter_and_index(monkeypatch):
    """Element k of a parameter gets draw k of its stream (its number in the names' sorted order): the other
    parameters, their order, the blocks they are drawn in and a shard's rows (as FSDP2 splits them) change
    nothing."""
    whole = _grads((7, 3), (5,))
    noise.add_noise(whole, names=["w", "b"], noise_multiplier=1.0, max_grad_norm=1.0, seed=9, step=4)
    reordered = _grads((5,), (7, 3))
    noise.add_noise(reordered, names=["b", "w"], noise_multiplier=1.0, max_grad_norm=1.0, seed=9, step=4)
    torch.testing.assert_close(reordered[1].grad, whole[0].grad, rtol=0, atol=0)
    expected = noise.standard_normal(9, 4, [(1, 0, 21)]).float()  # "w" is second in sorted order
    torch.testing.assert_close(whole[0].grad.reshape(-1), expected)
    monkeypatch.setattr(noise, "BLOCK", 4)  # every parameter in pieces, across blocks
    blocked = _grads((7, 3), (5,))
    noise.add_noise(blocked, names=["w", "b"], noise_multiplier=1.0, max_grad_norm=1.0, seed=9, step=4)
    torch.testing.assert_close(_flat_noise(blocked), _flat_noise(whole), rtol=0, atol=0)
    for rows in ([0, 3], [3, 6], [6, 7]):  # three ranks' shards of w, each noised alone
        shard = torch.zeros(rows[1] - rows[0], 3)
        monkeypatch.setattr(noise, "local_elements", lambda grad, r=rows: (grad.view(-1), r[0] * 3, 21))
        param = torch.nn.Parameter(shard.clone())
        param.grad = shard
        empty = torch.nn.Parameter(torch.zeros(0))  # b's shard on this rank: numbered as before, nothing drawn
        empty.grad = torch.zeros(0)
        noise.add_noise([param, empty], names=["w", "b"], noise_multiplier=1.0,
                        max_grad_norm=1.0, seed=9, step=4)
        torch.testing.assert_close(param.grad, whole[0].grad[rows[0] : rows[1]], rtol=0, atol=0)


def test_noise_differs_between_steps_and_seeds_and_adds_to_what_is_there():
    base = _grads((50,))
    noise.add_noise(base, noise_multiplier=1.0, max_grad_norm=1.0, seed=1, step=1)
    for seed, step in ((1, 2), (2, 1)):
        other = _grads((50,))
        noise.add_noise(other, noise_multiplier=1.0, max_grad_norm=1.0, seed=seed, step=step)
        assert not torch.allclose(_flat_noise(other), _flat_noise(base))
    shifted = _grads((50,))
    shifted[0].grad += 3.0
    noise.add_noise(shifted, noise_multiplier=1.0, max_grad_norm=1.0, seed=1, step=1)
    torch.testing.assert_close(_flat_noise(shifted), _flat_noise(base) + 3.0)


def test_the_noised_sum_is_rounded_once_to_a_grid_the_noise_reaches():
    """Adding float32 noise to a float32 sum leaves low bits that depend on the sum: an attacker who knows the
    other users' sum s can tell s from s + Δ (the user's clipped gradient) by whether the released value is
    reachable from it, for about one coordinate in ten here. hf_dp rounds s + noise once, in float64, to a
    multiple of 2⁻²⁴·std: every such multiple is reachable from any s, so the test finds no coordinate."""
    rng = np.random.default_rng(0)
    n, std = 200_000, 1.0
    others = (rng.standard_normal(n) * 0.3).astype(np.float32)
    with_user = (others + rng.standard_normal(n) * 1e-3).astype(np.float32)
    draws = rng.standard_normal(n)

    def reachable_float32(released, s):  # some float32 noise v with fl32(s + v) = released
        found = np.zeros(n, dtype=bool)
        guess = (released.astype(np.float64) - s).astype(np.float32)
        for step in range(-3, 4):
            v = guess
            for _ in range(abs(step)):
                v = np.nextafter(v, np.float32(np.inf if step > 0 else -np.inf))
            found |= (s + v).astype(np.float32) == released
        return found

    released = (others + (std * draws).astype(np.float32)).astype(np.float32)
    assert reachable_float32(released, others).all()
    assert (~reachable_float32(released, with_user)).mean() > 0.05  # float32 addition: distinguishable

    grads = [torch.nn.Parameter(torch.zeros(n))]
    grads[0].grad = torch.from_numpy(others.copy())
    noise.add_noise(grads, noise_multiplier=1.0, max_grad_norm=std, seed=0, step=0)
    ours = grads[0].grad.numpy().astype(np.float64)
    quantum = std * noise.QUANTUM
    small = np.abs(ours) < 2**23 * quantum  # where float32 is finer than the grid: the released value is on it
    assert small.any() and np.array_equal(np.round(ours[small] / quantum) * quantum, ours[small])

    def reachable_ours(released, s):  # some float64 noise x with fl32(round((s + x)/q)·q) = released
        x = released - s.astype(np.float64)
        return (np.round((s + x) / quantum) * quantum).astype(np.float32).astype(np.float64) == released

    assert reachable_ours(ours, others).all() and reachable_ours(ours, with_user).all()


def test_bf16_gradients_get_the_noised_sum_rounded_once():
    fp32, bf16 = _grads((64,)), [torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))]
    bf16[0].grad = torch.zeros(64, dtype=torch.bfloat16)
    noise.add_noise(fp32, noise_multiplier=1.0, max_grad_norm=1.0, seed=0, step=0)
    noise.add_noise(bf16, noise_multiplier=1.0, max_grad_norm=1.0, seed=0, step=0)
    assert bf16[0].grad.dtype == torch.bfloat16
    torch.testing.assert_close(bf16[0].grad.float(), fp32[0].grad, rtol=1e-2, atol=1e-2)


def test_a_step_draws_its_noise_in_a_few_ops_whatever_the_number_of_parameters():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket.__name__ not in ("split_with_sizes", "split"):
                Count.ops += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for shapes in ([(3,)] * 2, [(3,)] * 200):
        params = _grads(*shapes)
        Count.ops = 0
        with Count():
            noise.add_noise(params, noise_multiplier=1.0, max_grad_norm=1.0, seed=0, step=0)
        counts[len(shapes)] = Count.ops
    # The host engine: one chunk's Box–Muller in torch ops (small parameters share a chunk); the add and its
    # rounding in numpy, in place
    assert counts[2] == counts[200] <= 20, counts


def test_scalar_noise_is_the_same_on_the_device_and_on_the_host():
    values = [3.0, -1.5]
    host = noise.add_scalar_noise(values, [0.5, 2.0], seed=4, step=7)
    device = noise.add_scalar_noise(torch.tensor(values, dtype=torch.float64), [0.5, 2.0], seed=4, step=7)
    assert device.dtype == torch.float64 and device.tolist() == pytest.approx(host, abs=0)


def test_scalar_noise_has_the_stated_stds_and_a_stream_of_its_own():
    draws = np.array([noise.add_scalar_noise([0.0, 10.0], [0.5, 2.0], seed=6, step=step) for step in range(4000)])
    for column, (value, std) in enumerate([(0.0, 0.5), (10.0, 2.0)]):
        assert draws[:, column].std() == pytest.approx(std, rel=0.05)
        assert abs(draws[:, column].mean() - value) < 4 * std / np.sqrt(len(draws))
    assert abs(np.corrcoef(draws[:, 0], draws[:, 1])[0, 1]) < 0.1
    # The logged sums' stream is not the gradient's: the same (seed, step) gives unrelated draws.
    grad = _grads((2,))
    noise.add_noise(grad, noise_multiplier=1.0, max_grad_norm=1.0, seed=6, step=0)
    assert not np.allclose(noise.add_scalar_noise([0.0, 0.0], [1.0, 1.0], seed=6, step=0), _flat_noise(grad).numpy())


def test_fresh_secrets_are_256_bit_and_never_repeat():
    seeds = {noise.fresh_seed() for _ in range(100)}
    assert len(seeds) == 100 and all(0 <= seed < 2**256 for seed in seeds)
    assert max(seeds).bit_length() > 250


def test_a_secret_outside_the_key_width_is_refused():
    for seed in (-1, 2**512, 1.5):
        with pytest.raises(ValueError, match="secret"):
            noise.standard_normal(seed, 0, [(0, 0, 2)])


def test_secure_gradient_noise_has_the_planned_std_and_is_reproducible():
    def noised():
        params = _grads((300, 200), (5,))
        noise.add_noise(params, noise_multiplier=1.5, max_grad_norm=0.2, seed=11, step=0, scale=0.5, secure=True)
        return _flat_noise(params)

    drawn = noised()
    assert abs(drawn.std().item() - 1.5 * 0.2 * 0.5) < 0.003
    assert torch.equal(drawn, noised())


def test_without_triton_a_cuda_block_is_noised_by_the_reference_engine_with_one_warning(monkeypatch, caplog):
    """Where triton is missing (a CPU build of torch), the CUDA path's fused kernel cannot be imported: the
    reference engine draws the same noise, one warning says so, and the noise source names the engine."""
    import sys

    import hf_dp

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "hf_dp.noise_kernel", raising=False)
    monkeypatch.delattr(hf_dp, "noise_kernel", raising=False)
    monkeypatch.setattr(noise, "_kernel_failure", None)
    assert "in torch integer ops (triton is not installed)" in noise.noise_source(False, "cuda")
    segments = [(0, 5, 300), (2, 0, 41)]
    grads = [torch.zeros(count) for _, _, count in segments]
    expected = [grad.clone() for grad in grads]
    with caplog.at_level("WARNING", logger="hf_dp.noise"):
        noise._add_device_noise(3, 1, segments, grads, 0.5)
        noise._add_device_noise(3, 1, segments, [grad.clone() for grad in grads], 0.5)
    noise._add_rounded(expected, noise._box_muller(noise._device_words(3, 1, 1, segments, torch.device("cpu"))), 0.5)
    assert all(torch.equal(grad, reference) for grad, reference in zip(grads, expected))
    warnings = [record.getMessage() for record in caplog.records if "fused noise kernel" in record.getMessage()]
    assert len(warnings) == 1 and "triton" in warnings[0] and "reference engine" in warnings[0]
    assert "the fused kernel could not run: " in noise.noise_source(False, "cuda")
