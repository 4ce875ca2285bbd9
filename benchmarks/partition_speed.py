"""Speed and memory of grouping the training rows by user: the partition, the bound, and `DPTrainer(...)`.

Builds a synthetic dataset in code (string user ids, Zipf rows per user, the users' rows interleaved, 8 tokens and a
class label a row), then times, each in a fresh process (so each peak RSS is its own):

- `examples_per_user` (what G = "auto" reads), `partition_by_user` at G = 8 (ULS, ELS), with `redraw_rows`, and
  without a bound (example level); `bound_rows` (what `DPSFTTrainer` keeps before tokenizing, 4·G per user);
- `DPTrainer(...)` with a tiny BERT built from its config, for ULS, ELS and `redraw_rows` (construction only).

The dataset is saved once and memory-mapped in each process, as `datasets` loads its cache. Rows/s is rows of the
dataset per second; "peak RSS" is the process's peak resident memory during the stage above its resident memory
before it (the kernel's high-water mark, reset at the start). Target on the 2-core machine: ≤ 10 s for 10⁶ users and
10⁷ rows.

    python benchmarks/partition_speed.py [--users 100000 1000000] [--repeats 3] [--shape zipf|uniform]
        [--stages partition trainer]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
from datasets import Dataset

BOUND = 8
TOKENS = 8


def synthetic_users(users: int, shape: str = "zipf", seed: int = 0) -> Dataset:
    """`users` users with Zipf(1.9) rows each (at most 10,000: 10.3 on average, 1 for half the users, more than G = 8
    for 9 %), interleaved; 8 tokens a row. `shape="uniform"`: 10 rows each (every user over G)."""
    rng = np.random.default_rng(seed)
    counts = np.minimum(rng.zipf(1.9, size=users), 10_000) if shape == "zipf" else np.full(users, 10)
    owner = rng.permutation(np.repeat(np.arange(users), counts))
    rows = len(owner)
    ids = pa.compute.binary_join_element_wise("user-", pa.array(owner).cast(pa.string()), "")
    tokens = pa.ListArray.from_arrays(np.arange(0, rows * TOKENS + 1, TOKENS, dtype=np.int32),
                                      pa.array(rng.integers(1, 64, rows * TOKENS, dtype=np.int32)))
    labels = pa.array(rng.integers(0, 2, rows))
    return Dataset(pa.table({"user_id": ids, "input_ids": tokens, "labels": labels}))


def _rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field))
    return int(line.split()[1]) / 1024


def _reset_peak() -> bool:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; False where /proc does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _collate(examples):
    import torch

    return {"input_ids": torch.tensor([e["input_ids"] for e in examples]),
            "labels": torch.tensor([e["labels"] for e in examples])}


def _trainer(dataset, **overrides):
    from transformers import BertConfig, BertForSequenceClassification

    from hf_dp import DPTrainer, DPTrainingArguments

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2)
    with tempfile.TemporaryDirectory() as out:
        args = DPTrainingArguments(output_dir=out, max_steps=10, expected_batch_size=64, target_epsilon=8.0,
                                   noise_seed=0, report_to=[], use_cpu=True, disable_tqdm=True, **overrides)
        return DPTrainer(model=BertForSequenceClassification(config), args=args, train_dataset=dataset,
                         data_collator=_collate)


def _stages():
    from hf_dp.data import bound_rows, examples_per_user, partition_by_user

    return {
        "examples_per_user": lambda d: examples_per_user(d, "user_id"),
        f"partition, G = {BOUND}": lambda d: partition_by_user(d, "user_id", BOUND, "secret"),
        f"partition, G = {BOUND}, redraw_rows": lambda d: partition_by_user(d, "user_id", BOUND, "secret", True),
        "partition, no bound": lambda d: partition_by_user(d, "user_id", None, "secret"),
        f"bound_rows, 4·G = {4 * BOUND} (SFT)": lambda d: bound_rows(d, "user_id", 4 * BOUND, "secret", "rows"),
        "DPTrainer(...), ULS": lambda d: _trainer(d, contribution_bound=BOUND),
        "DPTrainer(...), ELS": lambda d: _trainer(d, contribution_bound=BOUND, sampling="els"),
        "DPTrainer(...), ULS redraw_rows": lambda d: _trainer(d, contribution_bound=BOUND, redraw_rows=True),
    }


def _run(path: str, stage: str, queue) -> None:
    """One stage in this (fresh) process, on the dataset saved at `path` (memory-mapped, as datasets loads its
    cache): (seconds, peak RSS above the start in MiB, or None)."""
    from datasets import load_from_disk

    dataset = load_from_disk(path)
    run = _stages()[stage]
    run(synthetic_users(500))  # imports and first-call costs, on a tiny dataset
    start_rss = _rss_mib()
    exact_peak = _reset_peak()
    start = time.perf_counter()
    run(dataset)
    seconds = time.perf_counter() - start
    queue.put((seconds, max(0.0, _rss_mib("VmHWM") - start_rss) if exact_peak else None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=["zipf", "uniform"], default="zipf",
                        help="rows per user: Zipf(1.9) (default), or 10 each (every user over G, all drawn)")
    parser.add_argument("--stages", nargs="+", default=["partition", "trainer"],
                        help="'partition' (the data functions), 'trainer' (DPTrainer construction), or both")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    print(f"{os.cpu_count()} CPUs; seconds: median of {args.repeats} (min in brackets), each in a fresh process\n",
          flush=True)
    print("| users | rows | stage | seconds | rows/s | peak RSS above start (MiB) |")
    print("|---|---|---|---|---|---|")
    for users in args.users:
        folder = tempfile.TemporaryDirectory()
        path = os.path.join(folder.name, "rows")
        dataset = synthetic_users(users, args.shape)
        dataset.save_to_disk(path)
        rows = len(dataset)
        del dataset
        for stage in _stages():
            if ("trainer" if "DPTrainer" in stage else "partition") not in args.stages:
                continue
            results = []
            for _ in range(args.repeats):
                queue = context.Queue()
                process = context.Process(target=_run, args=(path, stage, queue))
                process.start()
                process.join()
                if process.exitcode:
                    raise RuntimeError(f"{stage} at {users} users failed (exit code {process.exitcode}).")
                results.append(queue.get())
            seconds = [s for s, _ in results]
            peak = max((p for _, p in results if p is not None), default=None)
            median = statistics.median(seconds)
            print(f"| {users:,} | {rows:,} | {stage} | {median:.2f} ({min(seconds):.2f}) | {rows / median:,.0f} | "
                  f"{'n/a' if peak is None else f'{peak:,.0f}'} |", flush=True)
        folder.cleanup()


if __name__ == "__main__":
    main()
