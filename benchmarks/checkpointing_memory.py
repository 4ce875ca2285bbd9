"""Peak memory of a DP-SGD step with and without gradient checkpointing.

Builds a Llama-like causal LM from a config (random weights, no download), full
fine-tuning and LoRA (r=8 on q/k/v/o), and measures the peak of one step (forward,
backward, optimizer) for four modes: a non-private step and an hf_dp step
(`GhostClipper.backward` + noise), each without and with
`model.activation_checkpointing_enable()` (non-reentrant, transformers' default).

Peak memory is measured as in `clipping_overhead.py`: on the CPU the largest total
size of live tensors along torch.profiler's memory timeline, on CUDA
`torch.cuda.max_memory_allocated()`. Each mode runs one untimed warm-up step first
(optimizer state exists in every measured step).

    python benchmarks/checkpointing_memory.py
    python benchmarks/checkpointing_memory.py --seq-len 1024 --attn eager
    python benchmarks/checkpointing_memory.py --device cuda --dtype bfloat16 --hidden 1024 --layers 8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from clipping_overhead import (  # noqa: E402
    MAX_GRAD_NORM,
    NOISE_MULTIPLIER,
    make_batch,
    model_inputs,
    peak_tensor_bytes,
    per_example_loss,
)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_dp.clipping import GhostClipper  # noqa: E402


def build(args, lora: bool, checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=max(2048, args.seq_len), tie_word_embeddings=False, use_cache=False,
    )
    config._attn_implementation = args.attn
    model = LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype))
    if lora:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora_config)
    if checkpointing:
        model.activation_checkpointing_enable()
    model.train()
    return model


def step_fn(model, private: bool, batch):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    clipper = GhostClipper(model) if private else None

    def step():
        losses = per_example_loss(model(**model_inputs(batch)).logits, batch["labels"])
        if clipper is None:
            losses.mean().backward()
        else:
            clipper.backward(losses, max_grad_norm=MAX_GRAD_NORM)
            with torch.no_grad():
                for param in params:
                    param.grad.add_(torch.randn_like(param), alpha=NOISE_MULTIPLIER * MAX_GRAD_NORM)
                    param.grad.div_(len(losses))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--finetune", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.llama_intermediate = None
    batch = make_batch(args)
    print(f"Llama-like, hidden {args.hidden}, {args.layers} layers, batch {args.batch_size} x {args.seq_len} "
          f"tokens, {args.attn} attention, {args.dtype} on {args.device}; peak tensor MiB of one step")
    print("| fine-tuning | mode | no checkpointing | checkpointing | saved |")
    print("|---|---|---|---|---|")
    for finetune in args.finetune:
        for private in (False, True):
            peaks = []
            for checkpointing in (False, True):
                model = build(args, finetune == "lora", checkpointing)
                step = step_fn(model, private, batch)
                step()  # warm-up: optimizer state
                peaks.append(peak_tensor_bytes(step, args.device) / 2**20)
                del model, step
            saved = 1 - peaks[1] / peaks[0]
            mode = "hf_dp" if private else "non-private"
            print(f"| {finetune} | {mode} | {peaks[0]:.1f} | {peaks[1]:.1f} | {saved:.0%} |", flush=True)


if __name__ == "__main__":
    main()
