"""`hf_dp/noise.py`: the gradient noise's law, and each element's noise a function of (seed, step, parameter, index)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_dp import noise


def _grads(*shapes):
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for param in params:
        param.grad = torch.zeros_like(param)
    return params


def _flat_noise(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


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
    torch.testing.assert_close(_flat_noise(as_tensor), _flat_noise(as_float))


@pytest.mark.parametrize("chunk", [5, 8, 1 << 20])
def test_each_elements_noise_depends_only_on_seed_step_parameter_and_index(monkeypatch, chunk):
    """Element k of parameter `name` gets the (k mod chunk)-th value of the draw seeded by (seed, step, name,
    k // chunk) alone: the other parameters, their order and a shard's rows (as FSDP2 splits them) change nothing."""
    monkeypatch.setattr(noise, "NOISE_CHUNK", chunk)
    whole = _grads((7, 3), (5,))
    noise.add_noise(whole, names=["w", "b"], noise_multiplier=1.0, max_grad_norm=1.0, seed=9, step=4)
    reordered = _grads((5,), (7, 3))
    noise.add_noise(reordered, names=["b", "w"], noise_multiplier=1.0, max_grad_norm=1.0, seed=9, step=4)
    torch.testing.assert_close(reordered[1].grad, whole[0].grad)
    expected = torch.cat([
        torch.randn(min(chunk, 21 - start), generator=torch.Generator().manual_seed(noise.chunk_seed(9, 4, "w", j)))
        for j, start in enumerate(range(0, 21, chunk))
    ])
    torch.testing.assert_close(whole[0].grad.reshape(-1), expected)
    for rows in ([0, 3], [3, 6], [6, 7]):  # three ranks' shards of w, each noised alone
        shard = torch.zeros(rows[1] - rows[0], 3)
        monkeypatch.setattr(noise, "local_elements", lambda grad, r=rows: (grad.view(-1), r[0] * 3, 21))
        param = torch.nn.Parameter(shard.clone())
        param.grad = shard
        noise.add_noise([param], names=["w"], noise_multiplier=1.0, max_grad_norm=1.0, seed=9, step=4)
        torch.testing.assert_close(param.grad, whole[0].grad[rows[0] : rows[1]])


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


def test_bf16_gradients_get_the_float32_draw_rounded():
    fp32, bf16 = _grads((64,)), [torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))]
    bf16[0].grad = torch.zeros(64, dtype=torch.bfloat16)
    noise.add_noise(fp32, noise_multiplier=1.0, max_grad_norm=1.0, seed=0, step=0)
    noise.add_noise(bf16, noise_multiplier=1.0, max_grad_norm=1.0, seed=0, step=0)
    assert bf16[0].grad.dtype == torch.bfloat16
    torch.testing.assert_close(bf16[0].grad.float(), fp32[0].grad, rtol=1e-2, atol=1e-2)


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


def test_fresh_seeds_are_63_bit_and_never_repeat():
    seeds = {noise.fresh_seed() for _ in range(100)}
    assert len(seeds) == 100 and all(0 <= seed < 2**63 for seed in seeds)


def test_secure_noise_is_standard_normal_and_keyed():
    from scipy import stats

    from hf_dp.noise import secure_normal

    draws = secure_normal(seed=7, step=3, stream=1, chunk=0, size=200_000)
    assert abs(draws.mean()) < 5 / 200_000**0.5 and abs(draws.std() - 1) < 0.01
    assert stats.kstest(draws, "norm").pvalue > 1e-4
    assert np.array_equal(draws, secure_normal(seed=7, step=3, stream=1, chunk=0, size=200_000))  # every rank agrees
    assert not np.array_equal(draws[:100], secure_normal(seed=7, step=4, stream=1, chunk=0, size=100))


def test_secure_gradient_noise_has_the_planned_std():
    params = [torch.nn.Parameter(torch.zeros(300, 200)), torch.nn.Parameter(torch.zeros(5))]
    for param in params:
        param.grad = torch.zeros_like(param)
    noise.add_noise(params, noise_multiplier=1.5, max_grad_norm=0.2, seed=11, step=0, scale=0.5, secure=True)
    drawn = torch.cat([param.grad.flatten() for param in params])
    assert abs(drawn.std().item() - 1.5 * 0.2 * 0.5) < 0.003
    again = [torch.nn.Parameter(torch.zeros(300, 200)), torch.nn.Parameter(torch.zeros(5))]
    for param in again:
        param.grad = torch.zeros_like(param)
    noise.add_noise(again, noise_multiplier=1.5, max_grad_norm=0.2, seed=11, step=0, scale=0.5, secure=True)
    assert torch.equal(drawn, torch.cat([param.grad.flatten() for param in again]))
