"""Peak resident memory (RSS) of a DP fine-tuning step with hf_dp, against a non-private step.

Every (architecture, fine-tuning, mode) runs in its own fresh Python process with
`torch.set_num_threads(2)` (`--threads`) and measures that process' memory:

- architectures: GPT-2-like with tied input/output embeddings (`gpt2-tied`), the same
  untied (`gpt2-untied`), Llama-like (`llama`, untied); 4 blocks, hidden 256, 4 heads,
  vocabulary 8,192, Llama MLP width 688; random weights from configs, float32, eager CPU;
- fine-tuning: `full`, or `lora` (peft, r=8 on the attention projections);
- modes: `non-private` (mean of the per-example losses, `.backward()`, AdamW step) and
  `hf_dp` (per-example losses into `GhostClipper(model).backward(losses, max_grad_norm=1.0)`,
  Gaussian noise on every trainable gradient, AdamW step).

One fixed random batch (`--batch-size` 16 × `--seq-len` 128 tokens; rows of random
lengths, right-padded, labels -100 on padding), forward with `use_cache=False`; the
per-example loss is the token mean of the next-token cross-entropy. Once the model, the
optimizer (and the clipper) exist, before the first step, the process' current RSS is
taken (`before`); then `--steps` steps run, with `ru_maxrss` (the process' peak RSS so
far, monotone) read after each. Reported: peak RSS (MiB), `before`, and hf_dp /
non-private ratios of the peak and of the peak above `before`; with `--repeats N`, the
medians over N fresh processes per run (RSS varies by a few tens of MiB between
identical runs). RSS includes the Python/torch runtime (about 400 MiB here) and whatever
glibc's allocator keeps, not only live tensors.

`--no-check-coverage` builds the clipper with `check_coverage=False`, which skips the
first backward's one-off checks (autograd's own parameter gradients of the summed loss,
and the row-attribution verification, a second backward).

    python benchmarks/step_memory.py --repeats 3 --out step_memory.json
    python benchmarks/step_memory.py --repeats 3 --no-check-coverage --out step_memory_nocheck.json
    python benchmarks/step_memory.py --archs llama --finetune full --steps 3
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ARCHS = ("gpt2-tied", "gpt2-untied", "llama")
FINETUNES = ("full", "lora")
MODES = ("non-private", "hf_dp")
SIZES = dict(layers=4, hidden=256, heads=4, vocab=8192, llama_intermediate=688)
LORA_TARGETS = {"gpt2": ["c_attn", "c_proj"], "llama": ["q_proj", "k_proj", "v_proj", "o_proj"]}
NOISE_MULTIPLIER, MAX_GRAD_NORM = 1.0, 1.0


def current_rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------------------------
# One run, in a fresh process


def build_model(arch: str, finetune: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    s = SIZES
    if arch.startswith("gpt2"):
        config = GPT2Config(
            vocab_size=s["vocab"], n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=arch == "gpt2-tied",
        )
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["llama_intermediate"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    if finetune == "lora":
        from peft import LoraConfig, get_peft_model

        family = arch.split("-")[0]
        model = get_peft_model(model, LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS[family], task_type="CAUSAL_LM",
            fan_in_fan_out=family == "gpt2",
        ))
    return model.train()


def make_batch(batch_size: int, seq_len: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, SIZES["vocab"], (batch_size, seq_len), generator=generator)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=generator)
    lengths[0] = seq_len
    attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    return input_ids, attention_mask, input_ids.masked_fill(attention_mask == 0, -100)


def run_one(spec: dict) -> dict:
    """Build, measure `before`, run the steps; the peak RSS after each step."""
    import torch
    import torch.nn.functional as F

    import hf_dp
    from hf_dp.clipping import GhostClipper

    torch.set_num_threads(spec["threads"])
    input_ids, attention_mask, labels = make_batch(spec["batch_size"], spec["seq_len"])
    model = build_model(spec["arch"], spec["finetune"])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    private = spec["mode"] == "hf_dp"
    clipper = GhostClipper(model, check_coverage=spec["check_coverage"]) if private else None

    def step():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
        losses = token_loss.sum(1) / (labels[:, 1:] != -100).sum(1).clamp(min=1)
        del logits, token_loss
        if not private:
            losses.mean().backward()
        else:
            clipper.backward(losses, max_grad_norm=MAX_GRAD_NORM)
            with torch.no_grad():
                for param in params:
                    param.grad.add_(torch.randn_like(param), alpha=NOISE_MULTIPLIER * MAX_GRAD_NORM)
                    param.grad.div_(len(losses))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = {"before": current_rss_mib(), "peak_before": peak_rss_mib(), "steps": [], "hf_dp": hf_dp.__file__,
              "trainable": sum(p.numel() for p in params)}
    for _ in range(spec["steps"]):
        step()
        result["steps"].append(peak_rss_mib())
    result["peak"] = result["steps"][-1]
    return result


def run_in_subprocess(spec: dict) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_repeated(spec: dict, repeats: int) -> dict:
    """Medians over `repeats` fresh processes (RSS varies by a few tens of MiB from run to run)."""
    runs = [run_in_subprocess(spec) for _ in range(repeats)]
    if any("error" in run for run in runs):
        return next(run for run in runs if "error" in run)
    result = {key: statistics.median(run[key] for run in runs) for key in ("before", "peak")}
    result["steps"] = [statistics.median(peaks) for peaks in zip(*(run["steps"] for run in runs))]
    result["runs"] = runs
    return result


# ---------------------------------------------------------------------------------------
# Table


def ratios(runs: dict) -> dict:
    base, dp = runs["non-private"], runs["hf_dp"]
    if "error" in base or "error" in dp:
        return {}
    above = (dp["peak"] - dp["before"]) / (base["peak"] - base["before"])
    return {"peak": dp["peak"] / base["peak"], "above_before": above}


def format_table(rows: list) -> str:
    lines = [
        "| model | fine-tuning | non-private before / peak | hf_dp before / peak (after each step) "
        "| peak × | peak above before × |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        base, dp, ratio = row["runs"]["non-private"], row["runs"]["hf_dp"], row["ratio"]
        cells = [row["arch"], row["finetune"]]
        for run in (base, dp):
            if "error" in run:
                cells.append(f"fails: {run['error'][:80]}")
            else:
                steps = " / ".join(f"{peak:.0f}" for peak in run["steps"])
                cells.append(f"{run['before']:.0f} / {run['peak']:.0f}" + (f" ({steps})" if run is dp else ""))
        cells += [f"{ratio['peak']:.2f}", f"{ratio['above_before']:.2f}"] if ratio else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--finetune", nargs="+", default=list(FINETUNES), choices=FINETUNES)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per run; medians are reported")
    parser.add_argument("--check-coverage", action=argparse.BooleanOptionalAction, default=True,
                        help="GhostClipper(check_coverage=...): the first backward's one-off checks")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one run, JSON spec
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        result = run_one(json.loads(args.worker))
        print(json.dumps(result))
        return result
    settings = {key: getattr(args, key) for key in ("steps", "batch_size", "seq_len", "threads", "check_coverage")}
    print(f"# {settings}, sizes {SIZES}; RSS in MiB", flush=True)
    rows = []
    for arch in args.archs:
        for finetune in args.finetune:
            specs = {mode: dict(settings, arch=arch, finetune=finetune, mode=mode) for mode in MODES}
            runs = {mode: run_repeated(spec, args.repeats) for mode, spec in specs.items()}
            rows.append({"arch": arch, "finetune": finetune, "runs": runs, "ratio": ratios(runs)})
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    report = {"settings": dict(settings, repeats=args.repeats), "sizes": SIZES, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf_dp first
    main()
