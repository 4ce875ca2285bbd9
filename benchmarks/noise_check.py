"""The noise path's cost and law, beside the path it replaced: ms and aten ops per step, and draws on the device.

    python benchmarks/noise_check.py                  # on the CPU: old and new path per model shape
    python benchmarks/noise_check.py --device cuda    # on a GPU (benchmarks/device_check.py runs it too)

For each shape (the trainable parameters of: host_overhead.py's tiny 12-layer Llama, full fine-tuning; the device
check's llama-12x768, full and LoRA r = 8 on q/k/v/o; SmolLM2-135M's shape with the chat study's LoRA, r = 8 on the
q and v projections of the top 4 layers) it times one step's noise, float32 gradients already in place:

- `new`: `hf_dp.noise.add_noise` (numpy's Philox4x64 on the CPU, in the compiled host kernel where it builds;
  Philox4x32 in the fused Triton kernel on a CUDA device; float64 Box–Muller from 159-bit uniforms; the sum rounded
  once);
- `old`: the path it replaced: one `torch.randn` (float32) per parameter and chunk of 2²⁰ elements, each from a
  generator seeded by a 63-bit keyed hash, added in float32;
- `device_ops`: the aten ops of the reference device engine's draw and addition (torch integer ops, what a CUDA
  device runs where the fused kernel cannot; counted on whatever device runs the check).

On the CPU (`host_per_element`): ns per float32 element of one step's noise at 10⁶ and 10⁷ elements, on 1 and 2
torch threads, for the compiled host kernel, the numpy path (`HF_DP_HOST_KERNEL=0`) and `torch.randn` + add, taken in
turns; and where the kernel's time goes on one thread (`host_phases`): the Philox words, Box–Muller, the rounded sum,
and ns per value of the `log`, `cos`, `sin` and `sqrt` it calls.

Bytes per element of the device path (`traffic`, on any machine): the fused kernel's, counted at its loads and
stores by Triton's interpreter (`TRITON_INTERPRET=1`, in a subprocess) on a block of several float32 and bf16
gradients, and the accesses in its PTX compiled for sm_90 (per thread; no GPU needed); the reference engine's,
counted as the bytes each of its aten ops reads and writes (inputs and outputs; views free).

Each time is the median of `--repeats` calls after one warm-up, with a device synchronisation around each. On CUDA
it also checks the device engine against the CPU (the same integer words: Philox4x32 in torch ops is exact on both)
and draws `--draws` normals on the device: mean, std, largest |z| and the count beyond 5.8σ, where torch's CPU
float32 normals never go, against the Gaussian's expectation; and checks the fused kernel (`kernel_check`): its words
against the reference engine's on a few million elements (odd sizes, many parameters, shards, past 2³²), its
normals in float64 ulps, its rounded sums, host syncs and compiled variants over steps, and ms per step for 10⁸ and
10⁹ float32 elements beside `torch.randn` + add and the reference engine. Everything is printed and returned as a
dict.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_dp import noise  # noqa: E402

SHAPES = {
    "tiny-llama-12-full": dict(layers=12, hidden=64, intermediate=128, vocab=256, kv=64, lora=None, top=None),
    "llama-12x768-full": dict(layers=12, hidden=768, intermediate=2048, vocab=32000, kv=768, lora=None, top=None),
    "llama-12x768-lora": dict(layers=12, hidden=768, intermediate=2048, vocab=32000, kv=768,
                              lora=("q", "k", "v", "o"), top=None),
    "smollm2-135m-chat-lora": dict(layers=30, hidden=576, intermediate=1536, vocab=49152, kv=192, lora=("q", "v"),
                                   top=4),
}
QUICK_SHAPES = ("tiny-llama-12-full", "smollm2-135m-chat-lora")
VIEWS = {"view", "reshape", "_reshape_alias", "split", "split_with_sizes", "slice", "alias", "detach", "as_strided",
         "_unsafe_view", "select", "unsqueeze", "squeeze", "t", "transpose", "expand", "lift_fresh"}


def parameter_shapes(shape: dict) -> list[tuple]:
    """The trainable parameters' shapes: every Llama weight (full), or LoRA A and B on the named projections."""
    h, kv, inter, layers = shape["hidden"], shape["kv"], shape["intermediate"], shape["layers"]
    projections = {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h)}
    if shape["lora"] is None:
        per_layer = [*projections.values(), (inter, h), (inter, h), (h, inter), (h,), (h,)]
        return [(shape["vocab"], h)] + per_layer * layers + [(h,), (shape["vocab"], h)]
    shapes = []
    for _ in range(shape["top"] or layers):
        for name in shape["lora"]:
            out, inp = projections[name]
            shapes += [(8, inp), (out, 8)]
    return shapes


def _old_add_noise(params, *, std: float, seed: int, step: int) -> None:
    """The replaced path (hf_dp before this change): float32 randn per (parameter, chunk), added in float32."""
    for index, param in enumerate(params):
        flat = param.grad.view(-1)
        for chunk, start in enumerate(range(0, flat.numel(), 1 << 20)):
            key = hashlib.blake2b(f"{step} 1 {index} {chunk}".encode(), key=str(seed).encode()[:64], digest_size=8)
            generator = torch.Generator(device=flat.device).manual_seed(int.from_bytes(key.digest(), "little") >> 1)
            size = min(1 << 20, flat.numel() - start)
            flat[start:start + size].add_(torch.randn(size, generator=generator, device=flat.device), alpha=std)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in VIEWS:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(call, device: torch.device, repeats: int) -> tuple[float, int]:
    """(median ms, aten ops) of `call()`, after one warm-up call."""
    call()
    counter = _Ops()
    with counter:
        call()
    times = []
    for _ in range(repeats):
        _sync(device)
        began = time.perf_counter()
        call()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times), counter.ops


def _device_engine(grads: list, seed: int, step: int) -> None:
    """The CUDA engine's draw and addition, on whatever device the gradients are (to count its ops anywhere)."""
    segments = [(index, 0, grad.numel()) for index, grad in enumerate(grads)]
    words = noise._device_words(seed, step, 1, segments, grads[0].device)
    noise._add_rounded(grads, noise._box_muller(words), 0.01)


def time_shape(name: str, device: torch.device, repeats: int) -> dict:
    shapes = parameter_shapes(SHAPES[name])
    return time_params([torch.zeros(s, device=device) for s in shapes], device, repeats)


def time_params(tensors: list, device: torch.device, repeats: int = 5) -> dict:
    """One step's noise on parameters shaped like `tensors` (float32 gradients of zeros), new path and old."""
    params = [torch.nn.Parameter(torch.zeros(t.shape, device=device)) for t in tensors]
    for param in params:
        param.grad = torch.zeros_like(param)
    shapes = [tuple(t.shape) for t in tensors]
    names = [f"p{i}" for i in range(len(params))]
    new_ms, new_ops = _time(lambda: noise.add_noise(params, names=names, noise_multiplier=1.0, max_grad_norm=1.0,
                                                    seed=2**255 + 1, step=3, scale=0.01), device, repeats)
    old_ms, old_ops = _time(lambda: _old_add_noise(params, std=0.01, seed=2**62, step=3), device, repeats)
    flats = [param.grad.view(-1) for param in params]
    device_ms, device_ops = _time(lambda: _device_engine(flats, 2**255 + 1, 3), device, 1)
    return {"parameters": sum(math.prod(s) for s in shapes), "tensors": len(shapes), "new_ms": new_ms,
            "new_ops": new_ops, "old_ms": old_ms, "old_ops": old_ops, "device_engine_ms": device_ms,
            "device_engine_ops": device_ops}


def host_per_element(sizes=(10**6, 10**7), threads=(1, 2), repeats: int = 7) -> list[dict]:
    """ns per float32 element of one step's noise on the CPU: the compiled kernel (`hf_dp.host_kernel`), the numpy
    path (`HF_DP_HOST_KERNEL=0`) and `torch.randn` + add, each the median of `repeats` calls taken in turns (so a
    busy moment of the machine hits all three), at each size and number of torch threads."""
    from hf_dp import host_kernel

    kernel = host_kernel.library() is not None
    rows, previous, param = [], torch.get_num_threads(), None

    def noised() -> None:
        noise.add_noise([param], noise_multiplier=1.0, max_grad_norm=1.0, seed=2**255 + 1, step=3, scale=0.01)

    def numpy_path() -> None:
        os.environ["HF_DP_HOST_KERNEL"] = "0"
        try:
            noised()
        finally:
            del os.environ["HF_DP_HOST_KERNEL"]

    try:
        for size in sizes:
            param = torch.nn.Parameter(torch.zeros(size))
            param.grad = torch.zeros(size)
            for count in threads:
                torch.set_num_threads(count)
                calls = {"randn_add": lambda: param.grad.add_(torch.randn(size), alpha=0.01), "numpy": numpy_path}
                if kernel:
                    calls["kernel"] = noised
                times = {name: [] for name in calls}
                for call in calls.values():
                    call()
                for _ in range(repeats):
                    for name, call in calls.items():
                        began = time.perf_counter()
                        call()
                        times[name].append(time.perf_counter() - began)
                row = {"elements": size, "threads": count}
                row.update({f"{name}_ns": 1e9 * statistics.median(values) / size for name, values in times.items()})
                for name in ("kernel", "numpy"):
                    if f"{name}_ns" in row:
                        row[f"{name}_vs_randn_add"] = row[f"{name}_ns"] / row["randn_add_ns"]
                rows.append(row)
                print(f"host noise, {size:.0e} float32 elements, {count} thread(s): kernel "
                      f"{row.get('kernel_ns', float('nan')):.1f} ns an element "
                      f"({row.get('kernel_vs_randn_add', float('nan')):.2f}x randn + add), numpy path "
                      f"{row['numpy_ns']:.1f} ns ({row['numpy_vs_randn_add']:.2f}x), torch.randn + add "
                      f"{row['randn_add_ns']:.1f} ns", flush=True)
    finally:
        torch.set_num_threads(previous)
    return rows


def host_phases(elements: int = 1 << 16, calls: int = 64, repeats: int = 9) -> dict | None:
    """Where the host kernel's time goes, ns per element on one thread: its Philox4x64-10 words alone
    (`hf_dp_words`, which also stores them), Box–Muller on top of them (`hf_dp_normals` less the words), and the
    noised sum, its rounding and store (`hf_dp_add_f32` less the normals), each `calls` times over the same
    `elements` (outputs kept in cache, so the differences are the phases), median of `repeats`; and ns per value of
    each of the `log`, `cos`, `sin` and `sqrt` it calls (MKL VML's, on 2¹⁶ values; None where it uses glibc's). None
    without the kernel."""
    import ctypes

    from hf_dp import host_kernel

    kernel = host_kernel.library()
    if kernel is None:
        return None
    handle, previous = kernel._handle, torch.get_num_threads()
    k0, k1 = 0x0123456789ABCDEF, 0xFEDCBA9876543210
    words, normals = np.empty((elements // 2, 4), dtype=np.uint64), np.empty(elements)
    grad = np.zeros(elements, dtype=np.float32)
    phases = {"words": lambda: handle.hf_dp_words(k0, k1, 5, 0, elements // 2, words.ctypes.data),
              "normals": lambda: handle.hf_dp_normals(k0, k1, 5, 0, elements, normals.ctypes.data),
              "add": lambda: handle.hf_dp_add_f32(k0, k1, 5, 0, elements, grad.ctypes.data, 0.01, 0.01 * 2.0**-24)}
    torch.set_num_threads(1)
    try:
        times = {name: [] for name in phases}
        for _ in range(repeats + 1):
            for name, phase in phases.items():
                began = time.perf_counter()
                for _ in range(calls):
                    phase()
                times[name].append(time.perf_counter() - began)
        ns = {name: 1e9 * statistics.median(values[1:]) / (calls * elements) for name, values in times.items()}
        row = {"elements": elements, "words_ns": ns["words"], "box_muller_ns": ns["normals"] - ns["words"],
               "sum_round_store_ns": ns["add"] - ns["normals"], "kernel_ns": ns["add"], "functions": kernel.functions,
               "words_engine": kernel.words_engine,
               "function_ns_per_value": None}
        if kernel._mkl is not None:
            values, out = np.random.default_rng(0).random(1 << 16), np.empty(1 << 16)
            row["function_ns_per_value"] = {}
            for name, address in zip(("log", "cos", "sin", "sqrt"), kernel._mkl[:4]):
                function = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)(address)
                spent = []
                for _ in range(repeats):
                    began = time.perf_counter()
                    function(len(values), values.ctypes.data, out.ctypes.data)
                    spent.append(time.perf_counter() - began)
                row["function_ns_per_value"][name] = 1e9 * statistics.median(spent) / len(values)
    finally:
        torch.set_num_threads(previous)
    functions = row["function_ns_per_value"]
    print(f"host kernel, one thread, {elements} elements in cache: {row['kernel_ns']:.1f} ns an element = Philox "
          f"words {row['words_ns']:.1f} ({row['words_engine']}) + Box-Muller {row['box_muller_ns']:.1f} + sum, "
          f"rounding and store {row['sum_round_store_ns']:.1f}; {row['functions']}"
          + ("" if functions is None else " ns a value: " + ", ".join(f"{name} {value:.2f}"
                                                                        for name, value in functions.items())),
          flush=True)
    return row


def device_against_cpu(device: torch.device, draws: int) -> dict:
    """On CUDA: the device engine's words equal the CPU's, and the law of `draws` normals drawn on the device."""
    segments = [(0, 0, 4096), (7, 2**33 + 5, 1000)]
    on_device = noise._device_words(11, 2, 1, segments, device).cpu()
    on_cpu = noise._device_words(11, 2, 1, segments, torch.device("cpu"))
    total, moments, beyond, largest = 0, [0.0, 0.0], 0, 0.0
    block = 1 << 24
    for start in range(0, draws, block):
        z = noise.standard_normal(13, 0, [(0, start, min(block, draws - start))], device=device)
        moments[0] += z.sum().item()
        moments[1] += z.square().sum().item()
        beyond += int((z.abs() > 5.8).sum().item())
        largest = max(largest, z.abs().max().item())
        total += z.numel()
    mean = moments[0] / total
    return {"words_equal_cpu": bool(torch.equal(on_device, on_cpu)), "draws": total, "mean": mean,
            "std": math.sqrt(moments[1] / total - mean**2), "largest_abs": largest, "beyond_5_8": beyond,
            "beyond_5_8_expected": total * 2 * stats.norm.sf(5.8)}


# ---- the fused kernel: bytes per element, and on a GPU its agreement with the reference engine and its speed ----

_COUNT_SCRIPT = """
import json, torch
from hf_dp import noise_kernel
segments = [(0, 0, 40_000), (1, 3, 777), (2, 2**32 - 5, 90_001)]
report = {}
for dtype in (torch.float32, torch.bfloat16):
    grads = [torch.zeros(count, dtype=dtype) for _, _, count in segments]
    std = torch.tensor([0.01], dtype=torch.float64)
    report[str(dtype).split(".")[1]] = noise_kernel.count_traffic(
        lambda: noise_kernel.add_noise_(grads, segments, (1, 2), std))
print(json.dumps(report))
"""


class _Bytes(TorchDispatchMode):
    """Bytes each non-view aten op reads and writes: its tensor inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.overloadpacket.__name__ not in VIEWS:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def reference_traffic(elements: int = 1 << 16) -> float:
    """Bytes per element the reference engine's aten ops move (float32 gradients, one parameter), on the CPU."""
    grads = [torch.zeros(elements)]
    counter = _Bytes()
    with counter:
        _device_engine(grads, 2**255 + 1, 3)
    return counter.bytes / elements


def ptx_accesses(dtype: str = "float32") -> dict:
    """The global loads and stores in the kernel's PTX for sm_90 (compiled here, no GPU needed), per thread, and the
    elements a thread handles."""
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_dp import noise_kernel

    signature = {"table": "*i64", "std_ptr": "*fp64", "out": "*i64", "MODE": "constexpr", "OUT_DTYPE": "constexpr",
                 "TILE": "constexpr"}
    source = ASTSource(noise_kernel.noise_kernel, signature,
                       constexprs={"MODE": 0, "OUT_DTYPE": getattr(tl, dtype), "TILE": noise_kernel.TILE})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    accesses = {}
    for access in re.findall(r"\b(?:ld|st)\.global[.\w]*", compiled.asm["ptx"]):
        accesses[access] = accesses.get(access, 0) + 1
    threads = 32 * compiled.metadata.num_warps
    return {"accesses_per_thread": accesses, "elements_per_thread": noise_kernel.TILE // threads}


def traffic() -> dict:
    """Bytes per element of the device path: the fused kernel's (interpreter count, PTX) and the reference's."""
    report = {"reference_bytes_per_element": reference_traffic()}
    try:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        done = subprocess.run([sys.executable, "-c", _COUNT_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=300, check=True)
        counts = json.loads(done.stdout.strip().splitlines()[-1])
        report["kernel_counted"] = counts
        report["kernel_bytes_per_element"] = {
            dtype: (c["gradient_bytes"] + c["table_bytes"]) / c["elements"] for dtype, c in counts.items()}
    except Exception as error:  # noqa: BLE001 - e.g. no triton here
        report["kernel_counted"] = {"error": f"{type(error).__name__}: {str(error)[-300:]}"}
    try:
        report["kernel_ptx"] = {dtype: ptx_accesses(dtype) for dtype in ("float32", "bfloat16")}
    except Exception as error:  # noqa: BLE001 - e.g. no triton, or no NVIDIA backend in it
        report["kernel_ptx"] = {"error": f"{type(error).__name__}: {str(error)[-300:]}"}
    return report


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    same_sign = (a >= 0) == (b >= 0)
    return torch.where(same_sign, (a.view(torch.int64) - b.view(torch.int64)).abs(), torch.iinfo(torch.int64).max)


def _time_cuda(call, repeats: int) -> float:
    """Median ms of `call()` after one warm-up, with CUDA events."""
    call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _reference_add(flat: torch.Tensor, seed: int, step: int, std) -> None:
    """What add_noise did on CUDA before the kernel: the reference engine, block by block (one parameter)."""
    for first in range(0, flat.numel(), noise.DEVICE_BLOCK):
        size = min(noise.DEVICE_BLOCK, flat.numel() - first)
        words = noise._device_words(seed, step, 1, [(0, first, size)], flat.device)
        noise._add_rounded([flat[first:first + size]], noise._box_muller(words), std)


def _time_step(size: int, device: torch.device, norm: torch.Tensor, seed: int, step: int, repeats: int) -> dict:
    """ms for one step's noise on `size` float32 elements: add_noise (the kernel, a launch per block of 2²³),
    torch.randn + add, and the reference engine."""
    param = torch.nn.Parameter(torch.zeros(size, device=device))
    param.grad = grad = torch.zeros_like(param)
    std = (norm * 3e-3).to(torch.float64)
    row = {"kernel": _time_cuda(lambda: noise.add_noise([param], noise_multiplier=1.0, max_grad_norm=norm, seed=seed,
                                                        step=step, scale=3e-3), repeats),
           "randn_add": _time_cuda(lambda: grad.add_(torch.randn_like(grad), alpha=3e-3), repeats),
           "reference": _time_cuda(lambda: _reference_add(grad, seed, step, std), 1 if size > 10**8 else repeats)}
    row["kernel_vs_randn_add"] = row["kernel"] / row["randn_add"]
    row["reference_vs_kernel"] = row["reference"] / row["kernel"]
    print(f"noise kernel, {size:.0e} float32 elements: {row['kernel']:.2f} ms a step; torch.randn + add "
          f"{row['randn_add']:.2f} ms; reference engine {row['reference']:.1f} ms", flush=True)
    return row


def kernel_check(device: str = "cuda", sizes=(10**8, 10**9), elements: int = 3 * 10**6, repeats: int = 3) -> dict:
    """On CUDA: the fused kernel against the reference engine, and its speed (see the module docstring)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"skipped": f"needs a CUDA device, not {device}"}
    from hf_dp import noise_kernel

    seed, step = 2**255 + 77, 5
    key = noise._device_key(seed, step, 1)
    segments = [(0, 0, elements // 2 + 1), (3, 12_345, 1023), (7, 2**32 - 1000, elements // 2 - 3), (2, 5, 1)]
    words = noise_kernel.draws(segments, key, device)
    reference = noise._device_words(seed, step, 1, segments, device)
    normals = noise_kernel.draws(segments, key, device, what="normals")
    ulps = _ulps(normals, noise._box_muller(reference))
    report = {"elements": words.shape[1], "words_equal": bool(torch.equal(words, reference)),
              "normals_max_ulps": int(ulps.max()), "normals_differing_fraction": float((ulps > 0).double().mean())}
    std = torch.tensor([3e-3], dtype=torch.float64, device=device)
    for dtype in (torch.float32, torch.bfloat16):
        generator = torch.Generator(device=device).manual_seed(0)
        grads = [torch.randn(count, generator=generator, device=device).mul_(1e-2).to(dtype)
                 for _, _, count in segments]
        expected = [grad.clone() for grad in grads]
        noise_kernel.add_noise_(grads, segments, key, std)
        noise._add_rounded(expected, noise._box_muller(reference), std)
        report[f"{str(dtype).split('.')[1]}_sums_differing"] = int((torch.cat(grads) != torch.cat(expected)).sum())
    params = [torch.nn.Parameter(torch.zeros(count, device=device)) for count in (4_000_001, 1023, 77)]
    for param in params:
        param.grad = torch.zeros_like(param)
    norm = torch.tensor(1.0, device=device)  # adaptive clipping's C: a device tensor, never read back
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for step_index in range(3):
                noise.add_noise(params, noise_multiplier=1.0, max_grad_norm=norm, seed=seed + step_index,
                                step=step_index, scale=0.01)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    report["syncs_in_3_steps"] = sum("synchroniz" in str(w.message) for w in caught)
    report["kernel_failure"] = noise._kernel_failure
    try:  # one compiled variant per (mode, dtype): neither the key nor the step recompiles
        report["compiled_variants"] = sum(len(cache[0]) for cache in noise_kernel.noise_kernel.device_caches.values())
    except Exception as error:  # noqa: BLE001 - an internal attribute of triton's JITFunction
        report["compiled_variants"] = f"unknown ({type(error).__name__})"
    report["ms_per_step"] = {}
    for size in sizes:
        free = torch.cuda.mem_get_info(device)[0]
        if 16 * size > free:  # the reference's blocks add 2 GiB; randn its float32 draws
            report["ms_per_step"][str(size)] = f"skipped: {free / 2**30:.1f} GiB free"
            continue
        report["ms_per_step"][f"{size:.0e}"] = _time_step(size, device, norm, seed, step, repeats)
        torch.cuda.empty_cache()
    return report


def run(device: str = "cpu", repeats: int = 5, draws: int = 2 * 10**9, quick: bool = False) -> dict:
    device = torch.device(device)
    names = QUICK_SHAPES if quick else tuple(SHAPES)
    report = {"device": str(device), "shapes": {}}
    for name in names:
        report["shapes"][name] = row = time_shape(name, device, repeats)
        print(f"noise {name} ({row['parameters']:,} parameters in {row['tensors']} tensors): new "
              f"{row['new_ms']:.2f} ms ({row['new_ops']} ops), old {row['old_ms']:.2f} ms ({row['old_ops']} ops), "
              f"device engine {row['device_engine_ops']} ops", flush=True)
    if device.type == "cpu":
        report["host_per_element"] = host_per_element(sizes=(10**6,) if quick else (10**6, 10**7))
        report["host_phases"] = host_phases()
    report["traffic"] = bytes_ = traffic()
    print(f"noise bytes per element, device path: fused kernel {bytes_.get('kernel_bytes_per_element')} (counted at "
          f"its loads and stores), reference engine {bytes_['reference_bytes_per_element']:,.0f} (its ops' inputs and "
          "outputs)", flush=True)
    if device.type == "cuda":
        report["device_law"] = law = device_against_cpu(device, draws)
        print(f"noise on the device: words equal the CPU's: {law['words_equal_cpu']}; {law['draws']:.3g} draws, mean "
              f"{law['mean']:.2e}, std {law['std']:.6f}, max |z| {law['largest_abs']:.2f}, beyond 5.8σ "
              f"{law['beyond_5_8']} (Gaussian: {law['beyond_5_8_expected']:.1f})", flush=True)
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--draws", type=int, default=2 * 10**9, help="normals drawn on a CUDA device")
    parser.add_argument("--quick", action="store_true", help="the two smallest shapes only")
    parser.add_argument("--out", default="results/noise_check.json")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    report = run(args.device, args.repeats, args.draws, args.quick)
    if args.device.startswith("cuda"):
        report["kernel"] = kernel_check(args.device, sizes=(10**8,) if args.quick else (10**8, 10**9))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
