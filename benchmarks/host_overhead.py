"""Host overhead of a DPTrainer step against a plain Trainer step: host syncs, aten ops and host time per step.

On a GPU, reading a device value on the host (`.item()`, `.tolist()`, `bool(t)`, `nonzero`, a boolean mask, ...)
stalls the host until the device catches up, and each aten op costs host time to launch. This counts them on the
CPU with a `TorchDispatchMode` ([`HostSyncCounter`]), per optimizer step, from `on_step_begin` to `on_step_end`
(the batch is drawn and collated before, on the host in any case), steady state only (the first `SKIP` steps are
left out: the first DP step runs one-off checks):

- syncs: ops that block the host on CUDA ([`is_sync`]), plus `Tensor.tolist` and `Tensor.numpy` calls, which
  never reach the dispatcher (they are wrapped while counting); by op and by the source line that triggered them
  (`hf_dp/file.py:line function`, the innermost hf_dp frame, else transformers, then `> file:line function` of the
  innermost frame when it is another); the noise's host engine, which only CPU tensors take, is left out
  ([`host_engine_uncounted`]);
- aten ops: every op the dispatcher sees except views, aliases and no-ops (`func.is_view`, or a name in
  `NOT_OPS`), which are counted apart (`views`: ops + views is every op dispatched);
- host ms: median wall time of a step in a second run without the counter, on one thread (and that thread's CPU
  time, `cpu ms`, which other processes on a shared machine do not inflate).

The backward pass runs in the calling thread on the CPU, so its ops are counted too (`mm` counts three per linear
layer: forward, input grad, weight grad). On the CPU every tensor is a host tensor: a read of a tensor that would
stay on the host on a GPU counts as a sync, and device-to-host copies (`.cpu()` alone) are not seen.

Tiny Llama models (hidden 64, `--layers` decoder layers), 512 users × 2 rows of 16–32 random tokens, 16 rows per
step expected (ULS: 8 users); DP passes per step = micro-batches per logical batch:

    python benchmarks/host_overhead.py
    python benchmarks/host_overhead.py --layers 2 12 --steps 4 --adaptive
    python benchmarks/host_overhead.py --mechanism els --out results/host_overhead_els.json
    python -m pytest tests/test_host_overhead.py  # the counter's self-check, and the DP step's budget (slow)
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf_dp, imported where a trainer is built
sys.path.insert(0, str(Path(__file__).resolve().parent))  # noise_check, beside this script

SKIP = 2  # warm-up steps left out of the counts and times
USERS, ROWS_PER_USER, ROWS_PER_STEP, VOCAB = 512, 2, 16, 256
SYNC_OPS = {"_local_scalar_dense", "nonzero", "bincount", "masked_select", "equal", "is_nonzero"}
MASK_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}  # sync with a boolean index
NOT_OPS = {"detach", "alias", "t", "view", "reshape", "_reshape_alias", "expand", "transpose", "permute", "select",
           "slice", "unsqueeze", "squeeze", "as_strided", "_unsafe_view", "split", "split_with_sizes", "unbind",
           "chunk", "lift_fresh"}  # views and no-ops: no kernel launched
HOST_READS = ("tolist", "numpy")  # Tensor methods that read values without any aten op
OWNERS = ("/hf_dp/", "/transformers/")  # a sync's source: the innermost frame under the first of these found
INTERNAL = ("/torch/_", "/torch/utils/_")  # dispatch machinery (dynamo's wrappers, Tensor dunders): never a source


# ---------------------------------------------------------------------------------------
# The counter


def is_sync(func, args, kwargs) -> bool:
    """Whether the aten op makes the host wait for a CUDA device (its output size or value is data-dependent)."""
    name = func.overloadpacket.__name__
    if name in SYNC_OPS or name.lstrip("_").startswith("unique"):
        return True
    if name in MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None


def _path(frame) -> str:
    return frame.filename.replace(os.sep, "/")


def _where(frame) -> str:
    path = _path(frame)
    owner = next((marker for marker in OWNERS if marker in path), None)
    short = path[path.rfind(owner) + 1:] if owner else "/".join(path.split("/")[-2:])
    return f"{short}:{frame.lineno} {frame.name}"


def sync_source() -> str:
    """Where the running sync comes from: the innermost hf_dp frame (else transformers), then the innermost frame
    outside torch's dispatch machinery when that is another one (e.g. transformers' loop calling `bool(loss)`)."""
    frames = [frame for frame in traceback.extract_stack()
              if frame.filename != __file__ and not any(part in _path(frame) for part in INTERNAL)]
    if not frames:
        return "?"
    for owner in OWNERS:
        owned = [frame for frame in frames if owner in _path(frame)]
        if owned:
            return _where(owned[-1]) + ("" if owned[-1] is frames[-1] else f" > {_where(frames[-1])}")
    return _where(frames[-1])


class HostSyncCounter(TorchDispatchMode):
    """Counts aten ops (`ops`, views and aliases apart in `views`), host syncs (`syncs`) and the syncs' sources
    (`sources`, keyed (op, location)) while `counting` is true: entered once around the training loop, switched on
    and off per step."""

    def __init__(self, counting: bool = True):
        super().__init__()
        self.counting = counting
        self.ops, self.views, self.syncs, self.sources = Counter(), Counter(), Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting:
            name = func.overloadpacket.__name__
            (self.views if func.is_view or name in NOT_OPS else self.ops)[name] += 1
            if is_sync(func, args, kwargs):
                self._sync(name)
        return func(*args, **kwargs)

    def _sync(self, name: str) -> None:
        self.syncs[name] += 1
        self.sources[(name, sync_source())] += 1

    def _host_read(self, name: str, method):
        @functools.wraps(method)
        def read(tensor, *args, **kwargs):
            if self.counting:
                self._sync(f"Tensor.{name}")
            return method(tensor, *args, **kwargs)
        return read

    def __enter__(self):
        self._saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}
        for name in HOST_READS:
            setattr(torch.Tensor, name, self._host_read(name, getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, saved in self._saved.items():  # back to the inherited method, or the one defined before
                if saved is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, saved)


def step_window(counter: HostSyncCounter | None = None, skip: int = SKIP):
    """A TrainerCallback that switches `counter` on and times the step from `on_step_begin` to `on_step_end`, after
    `skip` steps: `.times` (wall, s) and `.cpu_times` (this thread's CPU time, s: what a busy machine does not
    inflate)."""
    from transformers import TrainerCallback  # here: the counter alone needs torch only

    class StepWindow(TrainerCallback):
        def __init__(self):
            self.times, self.cpu_times, self.active, self.start = [], [], False, (0.0, 0.0)

        def on_step_begin(self, args, state, control, **kwargs):
            self.active = state.global_step >= skip
            if self.active and counter is not None:
                counter.counting = True
            self.start = (time.perf_counter(), time.thread_time())

        def on_step_end(self, args, state, control, **kwargs):
            if self.active:
                self.times.append(time.perf_counter() - self.start[0])
                self.cpu_times.append(time.thread_time() - self.start[1])
                if counter is not None:
                    counter.counting = False
            self.active = False

    return StepWindow()


# ---------------------------------------------------------------------------------------
# Model, data, trainers


def tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False))


def user_rows(seed: int = 0):
    """USERS × ROWS_PER_USER rows of 16–32 random tokens (never the padding id 0), with a `user_id` column."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(16, 32))] for _ in range(USERS * ROWS_PER_USER)]
    return Dataset.from_dict({"input_ids": rows, "user_id": [i // ROWS_PER_USER for i in range(len(rows))]})


def collate(examples: list) -> dict:
    """Right-pads to the longest row; labels are the tokens, -100 on the padding."""
    ids = torch.zeros(len(examples), max(len(e["input_ids"]) for e in examples), dtype=torch.long)
    for row, example in enumerate(examples):
        ids[row, : len(example["input_ids"])] = torch.tensor(example["input_ids"])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build_trainer(kind: str, layers: int, steps: int, args, out_dir: str):
    """A Trainer (16 rows a step) or a DPTrainer (16 rows a step expected, one pass each) on the same rows; the
    DPTrainer records the micro-batches (backward passes) of each logical batch in `.passes`."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from hf_dp import DPTrainer, DPTrainingArguments

    class PassCountingDPTrainer(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.passes = getattr(self, "passes", []) + [len(inputs.micro_batches)]
            return super().training_step(model, inputs, num_items_in_batch)

    data, model = user_rows(), tiny_llama(layers)
    common = dict(output_dir=out_dir, max_steps=steps, report_to=[], save_strategy="no", disable_tqdm=True,
                  logging_steps=10**6, use_cpu=True, seed=0)
    if kind == "trainer":
        targs = TrainingArguments(per_device_train_batch_size=ROWS_PER_STEP, **common)
        trainer = Trainer(model=model, args=targs, train_dataset=data.remove_columns("user_id"), data_collator=collate)
    else:
        mechanism = {"uls": {}, "els": {"sampling": "els"}, "example": {"privacy_unit": "example"}}[args.mechanism]
        targs = DPTrainingArguments(
            target_epsilon=8.0, contribution_bound=ROWS_PER_USER if args.mechanism != "example" else None,
            max_grad_norm=1.0, adaptive_clipping=args.adaptive,
            expected_batch_size=ROWS_PER_STEP // ROWS_PER_USER if args.mechanism == "uls" else ROWS_PER_STEP,
            per_device_train_batch_size=64, noise_seed=0, **mechanism, **common)  # 64 rows: one pass per step
        trainer = PassCountingDPTrainer(model=model, args=targs, train_dataset=data, data_collator=collate)
    trainer.remove_callback(PrinterCallback)  # no closing metrics between the table's lines
    return trainer


@contextlib.contextmanager
def host_engine_uncounted(counter: HostSyncCounter):
    """Leave the noise's host engine (`hf_dp.noise._add_on_host`) out of the counts: it runs only for CPU tensors,
    numpy and CPU torch ops on numpy views that a GPU step never runs (there the CUDA engine draws on the device; its
    ops are counted apart, as `noise_device_engine_ops`)."""
    from hf_dp import noise

    original = noise._add_on_host

    def uncounted(*args, **kwargs):
        counting, counter.counting = counter.counting, False
        try:
            return original(*args, **kwargs)
        finally:
            counter.counting = counting

    noise._add_on_host = uncounted
    try:
        yield
    finally:
        noise._add_on_host = original


def measure(kind: str, layers: int, args) -> dict:
    """One counted run (`args.steps` steps after the warm-up) and one timed run (`args.time_steps`; none if 0)."""
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build_trainer(kind, layers, SKIP + args.steps, args, out_dir)
        counter = HostSyncCounter(counting=False)
        trainer.add_callback(window := step_window(counter))  # last: DP's own on_step_end is inside the window
        with counter, host_engine_uncounted(counter):
            trainer.train()
        steps = len(window.times)
        passes = getattr(trainer, "passes", [1] * (SKIP + steps))[SKIP:]
        timer = step_window()
        if args.time_steps:
            trainer = build_trainer(kind, layers, SKIP + args.time_steps, args, out_dir)
            trainer.add_callback(timer)
            trainer.train()
    per_step = {name: n / steps for name, n in counter.ops.most_common()}
    noise = {}
    if kind == "dp":  # the step's noise alone, beside the path it replaced and the CUDA engine's ops
        from noise_check import time_params

        cost = time_params([p for p in trainer.model.parameters() if p.requires_grad], torch.device("cpu"))
        noise = {"noise_ms": cost["new_ms"], "noise_old_ms": cost["old_ms"], "noise_ops": cost["new_ops"],
                 "noise_old_ops": cost["old_ops"], "noise_device_engine_ops": cost["device_engine_ops"]}
    return {**noise,
        "layers": layers, "trainer": kind, "steps": steps, "syncs": sum(counter.syncs.values()) / steps,
        "ops": sum(counter.ops.values()) / steps, "views": sum(counter.views.values()) / steps,
        "host_ms": 1e3 * statistics.median(timer.times) if timer.times else None,
        "host_cpu_ms": 1e3 * statistics.median(timer.cpu_times) if timer.times else None,
        "passes": sum(passes) / len(passes), "mm": per_step.get("mm", 0.0), "ops_by_name": per_step,
        "syncs_by_name": {name: n / steps for name, n in counter.syncs.most_common()},
        "sync_sources": [{"op": op, "source": where, "per_step": n / steps}
                         for (op, where), n in counter.sources.most_common()],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12, 24])
    parser.add_argument("--steps", type=int, default=5, help="counted steps, after the %d warm-up steps" % SKIP)
    parser.add_argument("--time_steps", "--time-steps", type=int, default=10, help="timed steps, after the warm-up")
    parser.add_argument("--mechanism", choices=["uls", "els", "example"], default="uls")
    parser.add_argument("--adaptive", action="store_true", help="DP with adaptive clipping")
    parser.add_argument("--top", type=int, default=12, help="sync sources printed")
    parser.add_argument("--out", default="results/host_overhead.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    rows = []
    for layers in sorted(args.layers):
        plain = measure("trainer", layers, args)
        dp = measure("dp", layers, args)
        dp["ops_ratio"] = dp["ops"] / plain["ops"]
        rows += [plain, dp]
    for kind in ("trainer", "dp"):  # syncs added per layer, from the previous layer count
        own = [r for r in rows if r["trainer"] == kind]
        for before, row in zip(own, own[1:]):
            row["syncs_per_layer"] = (row["syncs"] - before["syncs"]) / (row["layers"] - before["layers"])

    print(f"{'layers':>6} {'trainer':>7} {'syncs/step':>10} {'per layer':>9} {'ops/step':>9} {'ops ×':>6} "
          f"{'views':>7} {'mm/step':>7} {'host ms':>8} {'cpu ms':>7} {'passes':>6}")
    for r in rows:
        per_layer = f"{r['syncs_per_layer']:.2f}" if "syncs_per_layer" in r else "-"
        ratio = f"{r['ops_ratio']:.2f}" if "ops_ratio" in r else "-"
        host_ms, cpu_ms = ("-", "-") if r["host_ms"] is None else (f"{r['host_ms']:.1f}", f"{r['host_cpu_ms']:.1f}")
        print(f"{r['layers']:>6} {r['trainer']:>7} {r['syncs']:>10.1f} {per_layer:>9} {r['ops']:>9.0f} {ratio:>6} "
              f"{r['views']:>7.0f} {r['mm']:>7.0f} {host_ms:>8} {cpu_ms:>7} {r['passes']:>6.2f}")
    print("\nNoise alone, per DP step (CPU, one thread): new path (old path); aten ops (old; CUDA engine's)")
    for r in rows:
        if r["trainer"] == "dp":
            print(f"  {r['layers']:>3} layers: {r['noise_ms']:.2f} ms ({r['noise_old_ms']:.2f} ms); {r['noise_ops']} "
                  f"ops ({r['noise_old_ops']}; {r['noise_device_engine_ops']})")
    for row in rows[-2:]:
        print(f"\nTop sync sources, {row['trainer']}, {row['layers']} layers (per step):")
        for source in row["sync_sources"][: args.top]:
            print(f"  {source['per_step']:>7.1f}  {source['op']:<20} {source['source']}")

    report = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "skipped_steps": SKIP, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
