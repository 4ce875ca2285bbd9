"""`hf_dp/host_kernel.py` and `hf_dp/host_noise.c`: the compiled host engine draws numpy's Philox4x64-10 words bit
for bit, the numpy path's normals within a few ulps and its rounded sums, on any layout of parameters, shards and
threads; where it cannot be built, the numpy path draws the same noise, with one message saying why."""
from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest
import torch

from hf_dp import host_kernel, noise

BUILDABLE = (platform.system() == "Linux" and platform.machine() == "x86_64"
             and host_kernel._CPU_FLAGS <= host_kernel._cpu_flags() and shutil.which("cc") is not None)
needs_kernel = pytest.mark.skipif(not BUILDABLE, reason="the host kernel is built on Linux x86-64-v3 with a C compiler")
LAYOUTS = [(0, 0, 1), (3, 10, 65_536), (7, 5, 1001), (1, 1, 2), (2, 2**40 + 1, 513), (2**20, 511, 514)]


@pytest.fixture
def kernel():
    built = host_kernel.library()
    assert built is not None, f"the host kernel did not build here: {host_kernel.failure()}"
    return built


def _numpy_path(monkeypatch):
    monkeypatch.setenv("HF_DP_HOST_KERNEL", "0")


@needs_kernel
def test_the_kernel_builds_where_it_is_meant_to(kernel):
    assert host_kernel.failure() is None


@pytest.fixture
def restored_engine(kernel):
    """Gives the kernel back with the words engine it kept (the faster on this CPU) after the test."""
    kept = kernel.words_engine != "scalar"
    yield kernel
    kernel.use_avx512(kept)


@pytest.fixture(params=["AVX-512 + scalar", "scalar"])
def engine(request, restored_engine):
    """The kernel with either words engine."""
    avx512 = request.param != "scalar"
    if restored_engine.use_avx512(avx512) != avx512:
        pytest.skip(reason="this CPU has no AVX-512F and DQ: the scalar engine is tested")
    return request.param


@needs_kernel
@pytest.mark.parametrize("parameter, first_pair, pairs", [(0, 0, 1), (3, 5, 255), (3, 5, 256), (1, 0, 257),
                                                         (9, 2**40, 1000), (2**20, 2**62, 3), (4, 7, 5_003)])
def test_the_words_are_numpys_philox4x64_10_bit_for_bit(kernel, engine, parameter, first_pair, pairs):
    key = noise._host_key(2**255 + 7, 11, 1)
    counter = ((parameter << 64) + first_pair - 1) % 2**256
    expected = np.random.Philox(key=key, counter=counter).random_raw(4 * pairs).reshape(pairs, 4) >> 11
    assert np.array_equal(kernel.words(key, parameter, first_pair, pairs), expected)


@pytest.fixture(params=["torch's", "libmvec"])
def functions(request, kernel):
    """The kernel with torch's own log, cos and sin (MKL VML, where torch calls it) or with glibc's libmvec."""
    kernel.use_torchs_functions(request.param == "torch's")
    yield kernel.functions
    kernel.use_torchs_functions(True)


@needs_kernel
@pytest.mark.parametrize("parameter, first, count", LAYOUTS)
def test_the_normals_are_the_numpy_paths(kernel, functions, monkeypatch, parameter, first, count):
    """With torch's MKL functions, bit for bit; with libmvec's, within a few ulps (equal in about 40 % of draws;
    at most 5 ulps apart in 10⁶ draws)."""
    drawn = kernel.normals(noise._host_key(5, 1, 1), parameter, first, count)
    _numpy_path(monkeypatch)
    expected = noise.standard_normal(5, 1, [(parameter, first, count)]).numpy()
    if functions == "MKL VML":
        assert np.array_equal(drawn, expected)
        return
    ulps = np.abs(drawn - expected) / np.spacing(np.maximum(np.abs(drawn), np.abs(expected)))
    assert ulps.max() <= 8, ulps.max()
    if count > 10_000:
        assert 0.2 < (drawn == expected).mean() < 0.9  # the two libraries do differ: this compares something


def test_torchs_mkl_functions_are_used_where_torch_uses_them():
    """On torch's x86 Linux wheels (built with MKL) the kernel calls the very log, cos and sin torch's CPU ops call."""
    if not (BUILDABLE and torch.backends.mkl.is_available()):
        pytest.skip(reason="torch without MKL: the kernel uses libmvec (tested above)")
    assert host_kernel.library().functions == "MKL VML"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_rounded_sums_are_the_numpy_paths(functions, monkeypatch, dtype):
    """add_noise over many parameters, odd first elements (shards) and chunks of 2¹⁶: the same released values (with
    libmvec's functions, a sum may differ by one quantum about once in 10⁸ elements; none does here)."""
    rng = np.random.default_rng(0)
    shapes = [(300, 700), (1,), (65_537,), (3, 5), (2**17 + 3,)]
    start = [torch.tensor(rng.standard_normal(shape) * 1e-3, dtype=dtype) for shape in shapes]

    def noised():
        params = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in start]
        for param, grad in zip(params, start):
            param.grad = grad.clone()
        noise.add_noise(params, names=[f"p{i}" for i in range(len(params))], noise_multiplier=0.6,
                        max_grad_norm=1.0, seed=2**200 + 3, step=17, scale=0.25)
        return [param.grad for param in params]

    compiled = noised()
    _numpy_path(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(compiled, noised()))
    assert not torch.equal(compiled[0], start[0])


@needs_kernel
def test_a_shards_noise_is_that_of_its_elements(kernel, monkeypatch):
    whole = torch.zeros(70_001)
    key = noise._host_key(9, 4, 1)
    kernel.add(key, 3, 0, whole.numpy(), 0.5, 0.5 * noise.QUANTUM)
    for first, count in ((0, 1), (1, 1), (12_345, 40_000), (65_535, 4466)):
        shard = torch.zeros(count)
        kernel.add(key, 3, first, shard.numpy(), 0.5, 0.5 * noise.QUANTUM)
        assert torch.equal(shard, whole[first: first + count]), (first, count)


@needs_kernel
def test_both_words_engines_add_the_same_noise(restored_engine):
    """The AVX-512 engine and the scalar loop, on a parameter whose pairs end inside a block of 20 and a tile."""
    def noised(avx512):
        grad = np.zeros(2 * 5_003 + 1, dtype=np.float32)
        if restored_engine.use_avx512(avx512) != avx512:
            pytest.skip(reason="this CPU has no AVX-512F and DQ: only the scalar engine runs here")
        restored_engine.add(noise._host_key(3, 9, 1), 6, 11, grad, 0.7, 0.7 * noise.QUANTUM)
        return grad

    assert np.array_equal(noised(True), noised(False))


@needs_kernel
def test_two_threads_add_the_same_noise_as_one(kernel):
    def noised(threads):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            params = [torch.nn.Parameter(torch.zeros(n)) for n in (300_000, 7, 70_000)]
            for param in params:
                param.grad = torch.zeros_like(param)
            noise.add_noise(params, noise_multiplier=1.0, max_grad_norm=1.0, seed=8, step=2)
            return torch.cat([param.grad for param in params])
        finally:
            torch.set_num_threads(previous)

    assert torch.equal(noised(1), noised(2))


def test_without_a_compiler_the_numpy_path_draws_the_same_noise_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(host_kernel, "_library", None)
    monkeypatch.setattr(host_kernel, "_failure", None)
    monkeypatch.setattr(host_kernel, "_cpu_flags", lambda: set(host_kernel._CPU_FLAGS))
    monkeypatch.setattr(host_kernel.platform, "system", lambda: "Linux")
    monkeypatch.setattr(host_kernel.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level("INFO", logger="hf_dp.host_kernel"):
        assert host_kernel.library() is None and host_kernel.library() is None
        params = [torch.nn.Parameter(torch.zeros(5000))]
        params[0].grad = torch.zeros(5000)
        noise.add_noise(params, noise_multiplier=1.0, max_grad_norm=1.0, seed=1, step=1)
    messages = [record for record in caplog.records if "host noise kernel" in record.getMessage()]
    assert len(messages) == 1 and messages[0].levelname == "WARNING"
    assert "/nonexistent/cc" in host_kernel.failure() and "numpy" in messages[0].getMessage()
    monkeypatch.setenv("HF_DP_HOST_KERNEL", "0")
    expected = torch.zeros(5000)
    noise._add_rounded([expected], noise.standard_normal(1, 1, [(0, 0, 5000)]), 1.0)
    assert torch.equal(params[0].grad, expected) and params[0].grad.std() > 0.9


def test_on_a_cpu_without_avx2_it_is_not_built_and_says_so_quietly(monkeypatch, caplog):
    monkeypatch.setattr(host_kernel, "_library", None)
    monkeypatch.setattr(host_kernel, "_failure", None)
    monkeypatch.setattr(host_kernel, "_cpu_flags", lambda: {"sse2"})
    monkeypatch.setattr(host_kernel.platform, "system", lambda: "Linux")
    monkeypatch.setattr(host_kernel.platform, "machine", lambda: "x86_64")
    with caplog.at_level("INFO", logger="hf_dp.host_kernel"):
        assert host_kernel.library() is None
    assert "avx2" in host_kernel.failure() and "x86-64-v3" in host_kernel.failure()
    assert [record.levelname for record in caplog.records if "host noise kernel" in record.getMessage()] == ["INFO"]


def test_hf_dp_host_kernel_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("HF_DP_HOST_KERNEL", "0")
    assert host_kernel.library() is None and host_kernel.failure() == "HF_DP_HOST_KERNEL=0"


def test_the_c_source_ships_in_the_package():
    from pathlib import Path

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    package_data = pyproject.split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    assert host_kernel.SOURCE.is_file() and host_kernel.SOURCE.parent.name == "hf_dp"
    assert f'"{host_kernel.SOURCE.name}"' in package_data
