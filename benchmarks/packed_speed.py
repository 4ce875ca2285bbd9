"""DP step time with padded vs packed (padding-free) micro-batches, on Shakespeare-like lengths.

Two [`~hf_dp.DPTrainer`]s on the same data, model initialisation and seeds (so the same Poisson samples and
the same noise), one with a right-padding collator (`hf_dp.workflows.tasks.language_modeling.CausalLMCollator`), one
with transformers' `DataCollatorWithFlattening` (each micro-batch packed into one row, `position_ids` restarting at
each example). Each timed step is `DPTrainer.training_step` (forward, per-example losses, ghost clipping,
noise) plus the optimizer step, with LoRA (the recipe's default) or full fine-tuning; the modes alternate step by
step, so machine load hits both alike. Batches are collated before the clock starts. The median step time of each
mode and their ratio are printed.

Data: the Shakespeare speeches (`hf_dp.workflows.corpora.load_shakespeare`, users = roles) tokenized with the SmolLM2
tokenizer when both are available offline (median 19 tokens, 90th percentile 85, EOS included, truncated to
`--max-length`); otherwise synthetic users whose lengths are log-normal with the same median and tail
(`--synthetic` forces that). The model is a small Llama built from a config (random weights, no download).

Run (a few minutes on 2 CPU cores):

    python benchmarks/packed_speed.py
    python benchmarks/packed_speed.py --max_length 256
    python benchmarks/packed_speed.py --finetune full --vocab 4096
    python benchmarks/packed_speed.py --synthetic --hidden-size 256 --layers 4
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402
from hf_dp.workflows.tasks.language_modeling import CausalLMCollator, tokenize_causal_lm  # noqa: E402

DEFAULT_TOKENIZER = Path.home() / ".cache" / "hf_dp" / "smollm2-135m-instruct"


def shakespeare_rows(tokenizer_path: Path, max_length: int, max_users: int, seed: int):
    """The Shakespeare training speeches of up to `max_users` roles, tokenized; None when not available offline."""
    try:
        from transformers import AutoTokenizer

        from hf_dp.workflows.corpora import load_shakespeare

        if not (tokenizer_path / "tokenizer.json").is_file():
            return None, None
        train = load_shakespeare()["train"]
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    except Exception as error:  # noqa: BLE001 - any failure: fall back to synthetic lengths
        print(f"(Shakespeare or tokenizer not available offline: {type(error).__name__}: {error})")
        return None, None
    users = sorted(set(train["user_id"]))
    rng = np.random.default_rng(seed)
    keep = set(rng.choice(users, size=min(max_users, len(users)), replace=False).tolist())
    train = train.filter(lambda user: user in keep, input_columns="user_id")
    return tokenize_causal_lm(train, tokenizer, max_length=max_length), len(tokenizer)


def synthetic_rows(max_length: int, num_users: int, vocab: int, seed: int):
    """Users with 1..40 rows (geometric), lengths log-normal: median 19, 90th percentile about 85."""
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    rows = {"user_id": [], "input_ids": [], "labels": []}
    for user in range(num_users):
        for _ in range(min(40, int(rng.geometric(0.15)))):
            length = int(np.clip(round(np.exp(rng.normal(np.log(19), 1.15))), 2, max_length))
            tokens = rng.integers(3, vocab, length).tolist()
            rows["user_id"].append(f"user-{user}")
            rows["input_ids"].append(tokens)
            rows["labels"].append(tokens)
    return Dataset.from_dict(rows)


def build_trainer(model, dataset, collator, args_kwargs, output_dir):
    args = DPTrainingArguments(output_dir=output_dir, **args_kwargs)
    trainer = DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.create_optimizer_and_scheduler(num_training_steps=trainer.privacy_plan.steps)
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max_length", "--max-length", type=int, default=64,
                        help="tokens per speech, EOS included (the recipe's 64)")
    parser.add_argument("--users", type=int, default=600, help="roles (users) to train on")
    parser.add_argument("--expected_batch_size", "--expected-batch-size", type=int, default=32,
                        help="users sampled per step (ULS)")
    parser.add_argument("--contribution_bound", "--contribution-bound", type=int, default=4,
                        help="G: speeches per user at most")
    parser.add_argument("--micro-batch", type=int, default=32, help="rows per physical micro-batch")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=None, help="default: the tokenizer's (49152 for SmolLM2)")
    parser.add_argument("--finetune", choices=["lora", "full"], default="lora",
                        help="lora: r=8 on q/k/v/o as in recipes/causal_lm.py (embeddings frozen); full: every weight")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--synthetic", action="store_true", help="synthetic lengths even if Shakespeare is there")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    if cli.threads:
        torch.set_num_threads(cli.threads)

    dataset, vocab = (None, None) if cli.synthetic else shakespeare_rows(cli.tokenizer, cli.max_length, cli.users,
                                                                          cli.seed)
    source = "Shakespeare speeches, SmolLM2 tokenizer"
    if dataset is None:
        vocab = cli.vocab or 49152
        dataset, source = synthetic_rows(cli.max_length, cli.users, vocab, cli.seed), "synthetic log-normal lengths"
    if cli.vocab and cli.vocab < vocab:  # a smaller embedding: fold the token ids into it (lengths unchanged)
        dataset = dataset.map(lambda row: {"input_ids": [t % cli.vocab for t in row["input_ids"]],
                                           "labels": [t % cli.vocab for t in row["labels"]]})
    vocab = cli.vocab or vocab
    lengths = np.array([len(ids) for ids in dataset["input_ids"]])
    print(f"data: {source}; {len(dataset)} rows, {len(set(dataset['user_id']))} users; tokens per row: median "
          f"{np.median(lengths):g}, p90 {np.percentile(lengths, 90):g}, max {lengths.max()} (max_length "
          f"{cli.max_length})")

    torch.manual_seed(cli.seed)
    heads = max(1, cli.hidden_size // 64)
    config = LlamaConfig(vocab_size=vocab, hidden_size=cli.hidden_size, intermediate_size=cli.hidden_size * 8 // 3,
                         num_hidden_layers=cli.layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max(2048, cli.max_length), tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    if cli.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model: Llama {cli.layers} layers, hidden {cli.hidden_size}, vocab {vocab}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {cli.finetune} fine-tuning "
          f"({trainable / 1e6:.2f}M trainable), {torch.get_num_threads()} CPU threads")
    steps = cli.warmup + cli.reps
    args_kwargs = dict(
        sampling="uls", contribution_bound=cli.contribution_bound, expected_batch_size=cli.expected_batch_size,
        per_device_train_batch_size=cli.micro_batch, max_steps=steps, target_epsilon=None, noise_multiplier=1.0,
        noise_seed=cli.seed, learning_rate=1e-4, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            "padded": build_trainer(copy.deepcopy(model), dataset, CausalLMCollator(pad_token_id=0), args_kwargs,
                                    os.path.join(tmp, "padded")),
            "packed": build_trainer(copy.deepcopy(model), dataset, DataCollatorWithFlattening(), args_kwargs,
                                    os.path.join(tmp, "packed")),
        }
        loaders = {name: iter(trainer.get_train_dataloader()) for name, trainer in trainers.items()}
        times = {name: [] for name in trainers}
        tokens = {name: 0 for name in trainers}
        for step in range(steps):
            batches = {name: next(loader) for name, loader in loaders.items()}
            sampled = {name: sum(mb.num_examples for mb in batch.micro_batches) for name, batch in batches.items()}
            assert sampled["padded"] == sampled["packed"], "the two runs sampled different rows"
            for name, trainer in trainers.items():
                batch = batches[name]
                start = time.perf_counter()
                trainer.training_step(trainer.model, batch)
                trainer.optimizer.step()
                trainer.model.zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - start
                if step >= cli.warmup:
                    times[name].append(elapsed)
                    tokens[name] += sum(mb.features["input_ids"].numel() for mb in batch.micro_batches)
    padded, packed = statistics.median(times["padded"]), statistics.median(times["packed"])
    print(f"{'mode':<8} {'median step (s)':>16} {'tokens/step':>12}")
    for name, median in (("padded", padded), ("packed", packed)):
        print(f"{name:<8} {median:>16.3f} {tokens[name] / cli.reps:>12.0f}")
    print(f"speed-up (padded / packed step time): {padded / packed:.2f}x; padded batches hold "
          f"{tokens['padded'] / tokens['packed']:.2f}x the real tokens")


if __name__ == "__main__":
    main()
