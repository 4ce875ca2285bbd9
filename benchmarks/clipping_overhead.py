"""Cost of a DP-SGD step with hf_dp's ghost clipping, against a non-private step (and Opacus).

Builds a GPT-2-small-like and a Llama-like causal LM from configs (random weights, no
download), full fine-tuning and LoRA (r=8 on the attention projections), and times,
in one run with the modes interleaved repetition by repetition:

- `non-private`: mean loss, `backward()`, AdamW step;
- `hf_dp`: per-example losses, `GhostClipper.backward` (norms + clipped sum, one
  backward pass), hf_dp's own noise on every trainable gradient (`hf_dp.noise.add_noise`,
  what `DPTrainer` adds: keyed, float64, rounded once), AdamW step;
- `opacus` (with `--vs-opacus`): Opacus' ghost clipping
  (`GradSampleModuleFastGradientClipping(use_ghost_clipping=True)` +
  `DPOptimizerFastGradientClipping`, two backward passes) on the same model and batch.

Time: median over `--reps` interleaved repetitions after `--warmup` steps per mode.
Peak memory: one extra, untimed step per mode under `torch.profiler` with
`profile_memory=True`; the peak is the largest total size of live tensors (touched or
created during the step: parameters, gradients, optimizer state, activations,
temporaries) along the profiler's memory timeline. It counts tensor bytes, not the
process RSS (no allocator caching or fragmentation).

Every mode gets the same batch, with position ids passed as a materialised `(B, T)`
tensor (Opacus 1.6 fails on the broadcast `(1, T)` and `expand()`ed forms).

Run (defaults are scaled down to take a few minutes on a CPU):

    python benchmarks/clipping_overhead.py
    python benchmarks/clipping_overhead.py --vs-opacus
    python benchmarks/clipping_overhead.py --vs-opacus --untie-gpt2 --archs gpt2 --finetune full
    python benchmarks/clipping_overhead.py --full-size --seq-len 256 --batch-size 8 --vs-opacus
    python benchmarks/clipping_overhead.py --device cuda --dtype bfloat16 --full-size --seq-len 256

On CUDA, times are taken between `torch.cuda.synchronize()` calls and the peak is
`torch.cuda.max_memory_allocated()` over one extra step (all live tensors, the model included).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_dp.clipping import GhostClipper  # noqa: E402
from hf_dp.noise import add_noise, fresh_seed  # noqa: E402

NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0
LORA_TARGETS = {"gpt2": ["c_attn", "c_proj"], "llama": ["q_proj", "k_proj", "v_proj", "o_proj"]}


# ---------------------------------------------------------------------------------------
# Models and batch


def build_model(arch: str, args) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        config = GPT2Config(
            vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
            n_positions=max(1024, args.seq_len), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        config.tie_word_embeddings = not args.untie_gpt2
        model = GPT2LMHeadModel(config)  # input and output embeddings tied, as in GPT-2
    else:
        config = LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.llama_intermediate,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
            max_position_embeddings=max(2048, args.seq_len), tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model.to(device=args.device, dtype=getattr(torch, args.dtype))


def with_lora(model: torch.nn.Module, arch: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS[arch], task_type="CAUSAL_LM",
        fan_in_fan_out=arch == "gpt2",
    )
    return get_peft_model(model, config)


def make_batch(args) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    batch, seq = args.batch_size, args.seq_len
    input_ids = torch.randint(3, args.vocab, (batch, seq), generator=generator)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=generator)
    lengths[0] = seq
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    position_ids = torch.arange(seq).repeat(batch, 1)  # materialised (B, T)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "labels": labels}
    return {key: value.to(args.device) for key, value in batch.items()}


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over each example's labelled tokens: (B,)."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    token_loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return token_loss.sum(1) / (labels != -100).sum(1).clamp(min=1)


def model_inputs(batch):
    return {key: value for key, value in batch.items() if key != "labels"}


# ---------------------------------------------------------------------------------------
# One step per mode


class Mode:
    """A model copy, its optimizer and a `step()`."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def step(self, batch) -> None:
        raise NotImplementedError

    def state_tensors(self) -> List[torch.Tensor]:
        return []


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


class NonPrivate(Mode):
    name = "non-private"

    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.AdamW(_trainable(model), lr=1e-4)

    def step(self, batch):
        losses = per_example_loss(self.model(**model_inputs(batch)).logits, batch["labels"])
        losses.mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class HfDp(Mode):
    name = "hf_dp"

    def __init__(self, model, strategy="auto"):
        self.model = model
        self.optimizer = torch.optim.AdamW(_trainable(model), lr=1e-4)
        self.clipper = GhostClipper(model, strategy=strategy)
        self.seed, self.steps = fresh_seed(), 0
        self.noise_seconds = None  # the last step's `add_noise` alone, on the CPU (a GPU's launches return early)
        if strategy != "auto":
            self.name = f"hf_dp[{strategy}]"

    def step(self, batch):
        losses = per_example_loss(self.model(**model_inputs(batch)).logits, batch["labels"])
        self.clipper.backward(losses, max_grad_norm=MAX_GRAD_NORM)
        self.steps += 1
        with torch.no_grad():
            for param in _trainable(self.model):
                param.grad.div_(len(losses))
            began = time.perf_counter()
            add_noise(_trainable(self.model), noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
                      seed=self.seed, step=self.steps, scale=1 / len(losses))
            on_cpu = all(param.device.type == "cpu" for param in _trainable(self.model))
            self.noise_seconds = time.perf_counter() - began if on_cpu else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class Opacus(Mode):
    name = "opacus"

    def __init__(self, model, batch_size):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping

        self.model = GradSampleModuleFastGradientClipping(
            model, batch_first=True, loss_reduction="mean", max_grad_norm=MAX_GRAD_NORM, use_ghost_clipping=True
        )
        self.optimizer = DPOptimizerFastGradientClipping(
            torch.optim.AdamW(_trainable(model), lr=1e-4), noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM, expected_batch_size=batch_size, loss_reduction="mean",
        )

    def step(self, batch):
        from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

        losses = per_example_loss(self.model(**model_inputs(batch)).logits, batch["labels"])
        DPTensorFastGradientClipping(self.model, self.optimizer, losses, "mean").backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------
# Measurement


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_tensor_bytes(step: Callable[[], None], device: str = "cpu") -> int:
    """Largest total size of live tensors during `step`: the CUDA allocator's peak, or on the CPU
    torch.profiler's memory timeline."""
    if device.startswith("cuda"):
        synchronize(device)
        torch.cuda.reset_peak_memory_stats()
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated()
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def run_case(arch: str, lora: bool, args, batch) -> Dict[str, Dict[str, float]]:
    base = build_model(arch, args)
    builders = {
        "non-private": lambda m: NonPrivate(m),
        "hf_dp": lambda m: HfDp(m),
    }
    if args.strategies:
        for strategy in ("ghost", "materialize"):
            builders[f"hf_dp[{strategy}]"] = lambda m, s=strategy: HfDp(m, s)
    if args.vs_opacus:
        builders["opacus"] = lambda m: Opacus(m, args.batch_size)
    modes: Dict[str, Mode] = {}
    failures: Dict[str, str] = {}
    for name, build in builders.items():
        model = copy.deepcopy(base)
        model = with_lora(model, arch) if lora else model
        model.train()
        try:
            mode = build(model)
            for _ in range(args.warmup):
                mode.step(batch)
            modes[name] = mode
        except Exception as error:  # report, don't hide: the table says why a mode is missing
            failures[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            if args.verbose:
                traceback.print_exc()
    times: Dict[str, List[float]] = {name: [] for name in modes}
    for _ in range(args.reps):
        for name, mode in modes.items():
            synchronize(args.device)
            start = time.perf_counter()
            mode.step(batch)
            synchronize(args.device)
            times[name].append(time.perf_counter() - start)
    results = {name: {"time": statistics.median(values)} for name, values in times.items()}
    if not args.no_memory:
        for name, mode in modes.items():
            results[name]["peak"] = peak_tensor_bytes(lambda mode=mode: mode.step(batch), args.device)
    for name, reason in failures.items():
        results[name] = {"error": reason}
    return results


def format_table(rows, args) -> str:
    dp_modes = ["hf_dp"] + (["hf_dp[ghost]", "hf_dp[materialize]"] if args.strategies else [])
    lines = [
        "| model | fine-tuning | trainable params | non-private step | "
        + " | ".join(f"{m} time ×" for m in dp_modes)
        + (" | opacus time × | hf_dp vs opacus" if args.vs_opacus else "")
        + " | hf_dp peak mem × | non-private peak"
        + (" | opacus peak mem ×" if args.vs_opacus else "")
        + " |",
    ]
    lines.append("|" + "---|" * (lines[0].count("|") - 1))
    for (arch, finetune, trainable), result in rows:
        base = result["non-private"]

        def ratio(mode, key="time", result=result, base=base):
            entry = result.get(mode, {})
            if "error" in entry:
                return f"fails ({entry['error']})"
            if key not in entry:
                return "-"
            return f"{entry[key] / base[key]:.2f}"

        cells = [arch, finetune, f"{trainable / 1e6:.2f}M", f"{base['time'] * 1e3:.0f} ms"]
        cells += [ratio(m) for m in dp_modes]
        if args.vs_opacus:
            cells.append(ratio("opacus"))
            ours, theirs = result.get("hf_dp", {}), result.get("opacus", {})
            cells.append(f"{theirs['time'] / ours['time']:.2f}× faster" if "time" in theirs and "time" in ours else "-")
        cells.append(ratio("hf_dp", "peak"))
        cells.append(f"{base['peak'] / 2**20:.0f} MiB" if "peak" in base else "-")
        if args.vs_opacus:
            cells.append(ratio("opacus", "peak"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--finetune", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--hidden", type=int, default=256, help="model width (GPT-2 small: 768)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (GPT-2 small: 12)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (GPT-2 small: 12)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (GPT-2: 50257)")
    parser.add_argument("--llama-intermediate", type=int, default=None, help="Llama MLP width (default 8/3·hidden)")
    parser.add_argument(
        "--full-size", action="store_true", help="GPT-2-small dimensions: 768 wide, 12 blocks, 50257 tokens"
    )
    parser.add_argument("--untie-gpt2", action="store_true",
                        help="untie GPT-2's input and output embeddings (Opacus' ghost clipping rejects tied ones)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per mode (interleaved)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="parameter and activation dtype (ghost norms are always computed in float32)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--vs-opacus", action="store_true", help="also time Opacus ghost clipping (pip install opacus)")
    parser.add_argument("--strategies", action="store_true", help="also time hf_dp with forced ghost / materialize")
    parser.add_argument("--no-memory", action="store_true", help="skip the profiled peak-memory steps")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failing modes")
    args = parser.parse_args(argv)
    if args.full_size:
        args.hidden, args.layers, args.heads, args.vocab = 768, 12, 12, 50257
    if args.llama_intermediate is None:
        args.llama_intermediate = int(8 * args.hidden / 3 / 64 + 0.5) * 64 or 2 * args.hidden
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch = make_batch(args)
    print(
        f"# torch {torch.__version__}, {args.device} {args.dtype}, {torch.get_num_threads()} threads; "
        f"hidden {args.hidden}, {args.layers} blocks, "
        f"{args.heads} heads, vocab {args.vocab}, batch {args.batch_size} x {args.seq_len} tokens (ragged, padded); "
        f"median of {args.reps} interleaved reps after {args.warmup} warm-up steps; "
        "peak = largest live tensor bytes in a profiled step (torch.profiler memory timeline)",
        flush=True,
    )
    rows = []
    for arch in args.archs:
        for finetune in args.finetune:
            model = build_model(arch, args)
            model = with_lora(model, arch) if finetune == "lora" else model
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            del model
            label = {"gpt2": "GPT-2-like (untied emb.)" if args.untie_gpt2 else "GPT-2-like (tied emb.)",
                     "llama": "Llama-like"}[arch]
            result = run_case(arch, finetune == "lora", args, batch)
            rows.append(((label, finetune, trainable), result))
            print(format_table(rows[-1:], args).splitlines()[-1], flush=True)
    print()
    print(format_table(rows, args))


if __name__ == "__main__":
    main()
