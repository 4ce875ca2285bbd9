"""Step time of DP-SGD (hf_dp ghost clipping) against non-private training on a real pretrained LM.

SmolLM2-135M-Instruct (Llama, 134.5M parameters, tied embeddings; [`hf_dp.workflows.pretrained.smollm2_path`]) on a
batch of real text (Shakespeare speeches, padded/truncated to `--seq-len` tokens), LoRA (r=8 on q/k/v/o) and
full fine-tuning. The step of each mode is the one of `benchmarks/clipping_overhead.py`:

- `non-private`: mean loss, `backward()`, AdamW step;
- `hf_dp`: per-example losses, `GhostClipper.backward` (norms + clipped sum, one backward pass), hf_dp's
  own noise on every trainable gradient (`hf_dp.noise.add_noise`, as `DPTrainer` adds it), AdamW step.

The noise's own time inside the DP step is printed beside it (`noise s`, and its share of the DP step).

Time: median over `--reps` repetitions, the modes interleaved, after one warm-up step each.

    python benchmarks/smollm2_step_time.py                      # 8 x 64 tokens, 1 CPU thread
    python benchmarks/smollm2_step_time.py --threads 2 --finetune lora
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("clipping_overhead", ROOT / "benchmarks" / "clipping_overhead.py")
clipping_overhead = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clipping_overhead)

from hf_dp.workflows.pretrained import smollm2_path  # noqa: E402


def real_batch(tokenizer, batch_size: int, seq_len: int) -> dict:
    """`batch_size` Shakespeare speeches of at least `seq_len // 2` tokens, right-padded to `seq_len`."""
    from hf_dp.workflows.corpora import load_shakespeare

    texts = [t for t in load_shakespeare()["train"]["text"] if len(t) > 6 * seq_len][:batch_size]
    encoded = tokenizer(texts, truncation=True, max_length=seq_len, padding="max_length", return_tensors="pt")
    labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "labels": labels}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--finetune", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base.config._attn_implementation = "sdpa"
    batch = real_batch(tokenizer, args.batch_size, args.seq_len)
    print(f"SmolLM2-135M-Instruct, batch {args.batch_size} x {args.seq_len} tokens "
          f"({int(batch['attention_mask'].sum())} real), {args.threads} CPU thread(s), median of {args.reps}")
    print(f"{'finetune':<8} {'trainable':>12} {'non-private s':>14} {'hf_dp s':>9} {'ratio':>6} {'noise s':>8} "
          f"{'noise %':>8}")
    for finetune in args.finetune:
        models = [copy.deepcopy(base) for _ in range(2)]
        if finetune == "lora":
            models = [clipping_overhead.with_lora(model, "llama") for model in models]
        modes = [clipping_overhead.NonPrivate(models[0]), clipping_overhead.HfDp(models[1])]
        times, noise = {mode.name: [] for mode in modes}, []
        for rep in range(args.reps + 1):
            for mode in modes:
                start = time.perf_counter()
                mode.step(batch)
                if rep:  # the first step of each mode is a warm-up
                    times[mode.name].append(time.perf_counter() - start)
            if rep:
                noise.append(modes[1].noise_seconds)  # hf_dp's noise alone, inside the step just timed
        trainable = sum(p.numel() for p in models[0].parameters() if p.requires_grad)
        private, public = statistics.median(times["hf_dp"]), statistics.median(times["non-private"])
        noised = statistics.median(noise)
        print(f"{finetune:<8} {trainable:>12,} {public:>14.2f} {private:>9.2f} {private / public:>6.2f} "
              f"{noised:>8.2f} {100 * noised / private:>7.1f}%", flush=True)
        del models, modes


if __name__ == "__main__":
    main()
