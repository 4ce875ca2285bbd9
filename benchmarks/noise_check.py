"""The noise path's cost and law, beside the path it replaced: ms and aten ops per step, and draws on the device.

    python benchmarks/noise_check.py                  # on the CPU: old and new path per model shape
    python benchmarks/noise_check.py --device cuda    # on a GPU (benchmarks/device_check.py runs it too)

For each shape (the trainable parameters of: host_overhead.py's tiny 12-layer Llama, full fine-tuning; the device
check's llama-12x768, full and LoRA r = 8 on q/k/v/o; SmolLM2-135M's shape with the chat study's LoRA, r = 8 on the
q and v projections of the top 4 layers) it times one step's noise, float32 gradients already in place:

- `new`: `hf_dp.noise.add_noise` (numpy's Philox4x64 on the CPU, Philox4x32 in torch ops on a CUDA device; float64
  Box–Muller from 159-bit uniforms; the sum rounded once);
- `old`: the path it replaced: one `torch.randn` (float32) per parameter and chunk of 2²⁰ elements, each from a
  generator seeded by a 63-bit keyed hash, added in float32;
- `device_ops`: the aten ops of the device engine's draw and addition (counted on whatever device runs the check).

Each time is the median of `--repeats` calls after one warm-up, with a device synchronisation around each. On CUDA
it also checks the device engine against the CPU (the same integer words: Philox4x32 in torch ops is exact on both)
and draws `--draws` normals on the device: mean, std, largest |z| and the count beyond 5.8σ, where torch's CPU
float32 normals never go, against the Gaussian's expectation. Everything is printed and returned as a dict.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

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


def run(device: str = "cpu", repeats: int = 5, draws: int = 2 * 10**9, quick: bool = False) -> dict:
    device = torch.device(device)
    names = QUICK_SHAPES if quick else tuple(SHAPES)
    report = {"device": str(device), "shapes": {}}
    for name in names:
        report["shapes"][name] = row = time_shape(name, device, repeats)
        print(f"noise {name} ({row['parameters']:,} parameters in {row['tensors']} tensors): new "
              f"{row['new_ms']:.2f} ms ({row['new_ops']} ops), old {row['old_ms']:.2f} ms ({row['old_ops']} ops), "
              f"device engine {row['device_engine_ops']} ops", flush=True)
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
