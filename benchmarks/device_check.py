"""One short, prepared check of hf_dp on an accelerator: ghost clipping and DPTrainer in bf16.

Run it as it is on a machine with a GPU (it also runs on the CPU, which is how CI keeps it working):

    python benchmarks/device_check.py                   # cuda when available, bf16
    python benchmarks/device_check.py --device cpu --quick

It prints, and writes as JSON to `--out`:

1. **exactness**: ghost-clipped per-example gradient norms of a small Llama (full fine-tuning) computed on the
   device in `--dtype`, against per-example gradients from `torch.func` in float32 on the
   same weights and batch (torch.func.grad per example); the worst relative error (bf16 activations: ~1e-2 is
   expected; float32: ~1e-6);
2. **DPTrainer vs Trainer**: the same model, data and micro-batch trained for `--steps` steps with
   `DPTrainer` (ULS, ε = 8; fixed C, then adaptive clipping) and with `transformers.Trainer`, in `--dtype` on the
   device: the median optimizer step time and the peak device memory (CUDA allocator), as ratios DP / non-private,
   the ε spent and, with adaptive clipping, where C went.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_dp import DPTrainer, DPTrainingArguments, GhostClipper  # noqa: E402
from hf_dp.losses import per_example_loss  # noqa: E402


def small_llama(args) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=max(256, args.seq_len), tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def token_batch(args, batch_size: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, args.vocab, (batch_size, args.seq_len), generator=generator)
    lengths = torch.randint(args.seq_len // 2, args.seq_len + 1, (batch_size,), generator=generator)
    attention_mask = (torch.arange(args.seq_len)[None] < lengths[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def check_exactness(args) -> dict:
    """Worst relative error of ghost norms (device, dtype) against torch.func per-example norms (float32)."""
    from torch.func import functional_call, grad

    dtype = getattr(torch, args.dtype)
    batch = token_batch(args, 8)
    reference_model = small_llama(args).float().eval()
    params = {name: p.detach() for name, p in reference_model.named_parameters()}

    def loss_of_one(p, input_ids, attention_mask, labels):
        logits = functional_call(reference_model, p, (input_ids[None],),
                                 {"attention_mask": attention_mask[None]}).logits
        return per_example_loss(logits, labels[None], causal_lm=True)[0]

    # One example at a time: the attention-mask code branches on values, which vmap cannot trace.
    reference = torch.stack([
        torch.sqrt(sum(g.pow(2).sum() for g in grad(loss_of_one)(
            params, batch["input_ids"][i], batch["attention_mask"][i], batch["labels"][i]).values()))
        for i in range(len(batch["input_ids"]))
    ])

    model = small_llama(args).to(device=args.device, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in reference_model.state_dict().items()})
    clipper = GhostClipper(model)
    on_device = {k: v.to(args.device) for k, v in batch.items()}
    logits = model(input_ids=on_device["input_ids"], attention_mask=on_device["attention_mask"]).logits
    losses = per_example_loss(logits, on_device["labels"], causal_lm=True)
    norms = clipper.backward(losses, max_grad_norm=1.0).float().cpu()
    clipper.detach()
    error = ((norms - reference).abs() / reference).max().item()
    return {"examples": len(norms), "max_relative_error": error,
            "ghost_norms": [round(x, 5) for x in norms.tolist()],
            "torch_func_norms_fp32": [round(x, 5) for x in reference.tolist()]}


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step (synchronised on CUDA)."""

    def __init__(self, device: str):
        self.device, self.times, self._start = device, [], None

    def _sync(self):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.times.append(time.perf_counter() - self._start)


def user_rows(args) -> Dataset:
    batch = token_batch(args, args.users * 2, seed=1)
    rows = {"user_id": [f"user-{i // 2}" for i in range(args.users * 2)], "input_ids": [], "labels": []}
    for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
        n = int(mask.sum())
        rows["input_ids"].append(ids[:n].tolist())
        rows["labels"].append(labels[:n].tolist())
    return Dataset.from_dict(rows)


def collate(examples):
    width = max(len(e["input_ids"]) for e in examples)
    out = {"input_ids": torch.zeros(len(examples), width, dtype=torch.long),
           "attention_mask": torch.zeros(len(examples), width, dtype=torch.long),
           "labels": torch.full((len(examples), width), -100)}
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        out["input_ids"][i, :n] = torch.tensor(e["input_ids"])
        out["attention_mask"][i, :n] = 1
        out["labels"][i, :n] = torch.tensor(e["labels"])
    return out


def train_once(args, private: bool, output_dir: str, adaptive: bool = False) -> dict:
    common = dict(output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
                  learning_rate=1e-4, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=10**6,
                  bf16=args.dtype == "bfloat16", use_cpu=args.device == "cpu", seed=0)
    dataset = user_rows(args)
    timer = StepTimer(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if private:
        training_args = DPTrainingArguments(**common, target_epsilon=8.0, sampling="uls", contribution_bound=2,
                                            expected_batch_size=args.micro_batch // 2, max_grad_norm=1.0,
                                            adaptive_clipping=adaptive)
        trainer = DPTrainer(model=small_llama(args), args=training_args, train_dataset=dataset,
                            data_collator=collate, callbacks=[timer])
    else:
        trainer = Trainer(model=small_llama(args), args=TrainingArguments(**common),
                          train_dataset=dataset.remove_columns("user_id"), data_collator=collate, callbacks=[timer])
    trainer.train()
    result = {"median_step_s": statistics.median(timer.times[len(timer.times) // 4:])}
    if args.device.startswith("cuda"):
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    if private:
        report = trainer.privacy_report()
        result.update(epsilon=report["epsilon"], noise_multiplier=report["noise_multiplier"], steps=report["steps"],
                      max_grad_norm=report["max_grad_norm"])
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    parser.add_argument("--out", default="device_check.json")
    args = parser.parse_args(argv)
    sizes = dict(hidden=64, layers=2, vocab=256, seq_len=32, steps=6, micro_batch=8, users=64) if args.quick else \
        dict(hidden=768, layers=12, vocab=32000, seq_len=256, steps=30, micro_batch=16, users=4096)
    for key, value in sizes.items():
        setattr(args, key, value)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# {name}, torch {torch.__version__}, {args.dtype}; Llama {args.layers}x{args.hidden}, vocab {args.vocab}, "
          f"{args.seq_len} tokens", flush=True)
    report = {"device": name, "dtype": args.dtype, "sizes": sizes}
    report["exactness"] = check_exactness(args)
    print(f"ghost norms vs torch.func (fp32): max relative error {report['exactness']['max_relative_error']:.2e}",
          flush=True)
    out_dir = Path(args.out).with_suffix("")
    nonprivate = train_once(args, False, str(out_dir / "non-private"))
    private = train_once(args, True, str(out_dir / "dp"))
    adaptive = train_once(args, True, str(out_dir / "dp-adaptive"), adaptive=True)
    report["non_private"], report["dp"], report["dp_adaptive"] = nonprivate, private, adaptive
    report["step_time_ratio"] = private["median_step_s"] / nonprivate["median_step_s"]
    report["adaptive_step_time_ratio"] = adaptive["median_step_s"] / nonprivate["median_step_s"]
    line = (f"DPTrainer vs Trainer: step time {private['median_step_s'] * 1e3:.1f} ms vs "
            f"{nonprivate['median_step_s'] * 1e3:.1f} ms (x{report['step_time_ratio']:.2f})")
    if "peak_memory_bytes" in private:
        report["peak_memory_ratio"] = private["peak_memory_bytes"] / nonprivate["peak_memory_bytes"]
        line += f", peak memory x{report['peak_memory_ratio']:.2f}"
    print(line + f"; ε = {private['epsilon']:.3f} after {private['steps']} steps "
          f"(σ = {private['noise_multiplier']:.3f})")
    print(f"with adaptive clipping: step time x{report['adaptive_step_time_ratio']:.2f}"
          + (f", peak memory x{adaptive['peak_memory_bytes'] / nonprivate['peak_memory_bytes']:.2f}"
             if "peak_memory_bytes" in adaptive else "")
          + f"; C 1.0 -> {adaptive['max_grad_norm']:.3g} after {adaptive['steps']} steps, "
            f"ε = {adaptive['epsilon']:.3f}")
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
