"""What a DP step costs against Trainer's, on one GPU, plain and under FSDP2: one prepared run on an H200.

On the GPU machine, from the repository root:

    python benchmarks/device_check.py --out $OUT/device_check.json

(CI runs a CPU smoke version: `python benchmarks/device_check.py --quick --device cpu`; on the CPU every CUDA figure
is None.) Progress lines are printed as it goes; everything is also written as JSON to `--out`.

Models: two randomly initialised Llama shapes, weights in `--dtype` (bf16), `bf16=True` on CUDA:
"llama-12x768" (GPT-2-small-sized: 12 x 768, vocab 32000, untied) and "smollm2-360m-shaped" (SmolLM2-360M's shape:
32 x 960, 15 query / 5 key-value heads, vocab 49152, tied embeddings), each in full fine-tuning and in LoRA r=8 on
q/k/v/o_proj. Data: users of exactly 2 rows of 256 random tokens (labels = input_ids), the same rows for both trainers:

- `trainer`: `transformers.Trainer`, 16 rows a step, one forward/backward pass a step;
- `dp`: `hf_dp.DPTrainer`, user-level sampling (ULS), G = 2 rows a user, 8 users (16 rows) expected a step, ε = 8,
  C = 1, micro-batches of 64 rows, so that a step is one pass (checked: `passes_per_step`);
- `fsdp` (on CUDA; `--fsdp on` on the CPU, `off` to leave it out): `dp` under FSDP2 (`fully_shard` per decoder
  layer) in its own process, rank 0 of a one-rank process group, bf16 as `dp` (FSDP2's MixedPrecisionPolicy), and
  the time to save a sharded checkpoint after it (`checkpoint_save_s`, `checkpoint_bytes`). `fsdp_vs_dp` in
  `ratios` compares it with `dp` (step, memory, ε, weights). Each such process has `--worker-timeout` (150 s on
  CUDA); after one times out the others are skipped.

Time: 8 plain runs plus 4 FSDP2 processes (each some 10 s of start-up, then the same steps); estimated at 5 to 7
minutes on an H200, not measured yet.

Each run: 5 warm-up steps, `--steps` (20) timed steps, then, on CUDA only and outside the timing, 2 steps counting
syncs and 2 profiled steps. Figures of each run (`runs[config][finetune][trainer]` in the JSON):

- `median_step_s`, `p10_step_s`, `p90_step_s`: wall time from `on_step_begin` to `on_step_end`, with
  `torch.cuda.synchronize()` at both: forward, backward (with clipping and noise for DP), optimizer step;
- `median_interval_s`: from one step's end to the next one's: the step plus data loading and callbacks;
- `peak_step_memory_bytes`: the most the CUDA allocator held above the step's start (`max_memory_allocated()` after
  `reset_peak_memory_stats()`, minus `memory_allocated()` at the start: activations, gradients, clipping
  buffers; weights and optimizer state are in `step_start_memory_bytes`), max over the timed steps;
- `passes_per_step`, `rows_per_step`: forward/backward passes and rows per optimizer step, mean over the timed steps;
  1 pass and about 16 rows for both trainers, so the step times compare like for like;
- `syncs_per_step`: host-device synchronisations a step (`torch.cuda.set_sync_debug_mode("warn")`, warnings counted);
- `gpu_busy_fraction`: over the profiled steps, the time at least one kernel, memcpy or memset runs on the GPU (the
  union of the intervals `torch.profiler` records with CUDA activity only) over the wall time from the first profiled
  step's start to the last one's end, data loading between them included; well under 1 means the GPU waits for the
  host (launch overhead, Python, syncs). One short profiler session runs before any timed step, so that every
  timed step runs in the same state of the CUDA profiling interface;
- DP only: ε spent, δ, σ and steps.

Then one verdict line per (config, finetune) (`verdicts`): DP / Trainer median step time (target ≤ 1.25) and peak
step memory (target ≤ 1.15); `ratios[config][finetune]["dp"]` also has the interval, rows and total-memory (step
start plus peak) ratios. A run or probe that fails is reported in the JSON (`error`, `probe_errors`) and the rest goes
on; the JSON is rewritten after every (config, finetune).

The noise (`noise`, `noise_kernel`; benchmarks/noise_check.py): one step's noise per model shape, bytes per element
of the device path, the law of 2·10⁹ device draws, and the fused Triton kernel against the reference engine (words
bit for bit on 3·10⁶ elements, normals in ulps, rounded sums, host syncs, compiled variants) with its ms per step for
10⁸ and 10⁹ float32 elements beside `torch.randn` + add and the reference engine (about a minute).

First of all, exactness (`exactness[config]`): ghost-clipped per-example gradient norms of a 2-layer slice of each
config (4 padded examples x 64 tokens, full fine-tuning) computed on the device in `--dtype`, against per-example
norms from `torch.func.grad` in float32 on the CPU, same weights; the worst relative error (bf16: ~1e-2 expected).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_dp import DPTrainer, DPTrainingArguments, GhostClipper  # noqa: E402
from hf_dp.losses import per_example_loss  # noqa: E402

CONFIGS = {
    "llama-12x768": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False),
    "smollm2-360m-shaped": dict(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                num_attention_heads=15, num_key_value_heads=5, tie_word_embeddings=True,
                                rms_norm_eps=1e-5, rope_theta=100000, max_position_embeddings=2048),
}
FINETUNES = ("full", "lora")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # LlamaAttention's projections
TARGETS = {"step": 1.25, "memory": 1.15}  # DP / Trainer
ROWS_PER_USER = 2
SIZES = dict(rows=16, seq_len=256, users=1024, warmup=5, steps=20, probe_steps=2)
QUICK_SIZES = dict(rows=16, seq_len=32, users=64, warmup=3, steps=3, probe_steps=2)


def model_config(name: str, quick: bool, layers: int | None = None) -> dict:
    """The config's fields; `--quick` shrinks both the same way, keeping GQA and tied embeddings where they are."""
    config = dict(CONFIGS[name])
    if quick:
        gqa = config["num_key_value_heads"] < config["num_attention_heads"]
        config.update(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2 if gqa else 4)
    if layers is not None:
        config["num_hidden_layers"] = layers
    return config


def build_model(config: dict, finetune: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Seeded random init on the device itself (no slow CPU init of 360M parameters), then cast, then LoRA."""
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config))
    model.to(dtype)
    if finetune == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    return model


# ---- exactness ----------------------------------------------------------------------------------------------------

def padded_batch(vocab: int, examples: int, seq_len: int) -> dict:
    """Random tokens, right-padded to random lengths (the first row full), so masking is exercised too."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, vocab, (examples, seq_len), generator=generator)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (examples,), generator=generator)
    lengths[0] = seq_len
    attention_mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


def check_exactness(config: dict, args) -> dict:
    """Worst relative error of ghost norms (device, dtype) against torch.func per-example norms (CPU, float32)."""
    from torch.func import functional_call, grad

    batch = padded_batch(config["vocab_size"], examples=4, seq_len=min(64, args.seq_len))
    reference_model = build_model(config, "full", "cpu", torch.float32).eval()
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

    model = build_model(config, "full", args.device, args.torch_dtype)
    model.load_state_dict({k: v.to(args.torch_dtype) for k, v in reference_model.state_dict().items()})
    clipper = GhostClipper(model)
    on_device = {k: v.to(args.device) for k, v in batch.items()}
    logits = model(input_ids=on_device["input_ids"], attention_mask=on_device["attention_mask"]).logits
    norms = clipper.backward(per_example_loss(logits, on_device["labels"], causal_lm=True), max_grad_norm=1.0)
    norms = norms.float().cpu()
    clipper.detach()
    return {"layers": config["num_hidden_layers"], "examples": len(norms), "tokens": batch["input_ids"].shape[1],
            "max_relative_error": ((norms - reference).abs() / reference).max().item(),
            "ghost_norms": [round(x, 5) for x in norms.tolist()],
            "torch_func_norms_fp32": [round(x, 5) for x in reference.tolist()]}


# ---- training runs ------------------------------------------------------------------------------------------------

def user_rows(vocab: int, users: int, seq_len: int) -> Dataset:
    """`users` users of exactly 2 rows of random tokens (fixed seed), the same rows for both trainers."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (users * ROWS_PER_USER, seq_len), generator=generator)
    return Dataset.from_dict({"user_id": [i // ROWS_PER_USER for i in range(len(input_ids))],
                              "input_ids": input_ids.tolist()})


def collate(rows: list) -> dict:
    input_ids = torch.tensor([row["input_ids"] for row in rows])
    return {"input_ids": input_ids, "labels": input_ids.clone()}


class CountingTrainer(Trainer):
    """Trainer recording (passes, rows) of every optimizer step: one pass of the batch's rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.passes.append((1, len(inputs["input_ids"])))
        return super().training_step(model, inputs, num_items_in_batch)


class CountingDPTrainer(DPTrainer):
    """DPTrainer recording (passes, rows) of every optimizer step: one pass per physical micro-batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        rows = sum(mb.num_examples if mb.num_examples is not None else len(mb.features["labels"])
                   for mb in inputs.micro_batches)
        self.passes.append((len(inputs.micro_batches), rows))
        return super().training_step(model, inputs, num_items_in_batch)


def make_trainer(model, dataset, common: dict, probe, args) -> Trainer:
    """The baseline: Trainer on the expected rows of a DP step, in one pass."""
    return CountingTrainer(model=model, args=TrainingArguments(**common, per_device_train_batch_size=args.rows),
                           train_dataset=dataset.remove_columns("user_id"), data_collator=collate, callbacks=[probe])


def make_dp_trainer(model, dataset, common: dict, probe, args) -> Trainer:
    """DPTrainer, ULS: micro-batches four times the expected rows, so a step is one pass."""
    dp_args = DPTrainingArguments(**common, per_device_train_batch_size=4 * args.rows, sampling="uls",
                                  contribution_bound=ROWS_PER_USER, expected_batch_size=args.rows // ROWS_PER_USER,
                                  target_epsilon=8.0, max_grad_norm=1.0, noise_seed=0)
    return CountingDPTrainer(model=model, args=dp_args, train_dataset=dataset, data_collator=collate,
                             callbacks=[probe])


FSDP2 = {"fsdp": True, "fsdp_config": {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                       "reshard_after_forward": True}}  # recipes/configs/fsdp.yaml's settings


def make_fsdp_trainer(model, dataset, common: dict, probe, args) -> Trainer:
    """The "dp" trainer under FSDP2 (fully_shard through accelerate, a unit per decoder layer) in one process,
    in bf16 as `dp` is (accelerate's MixedPrecisionPolicy: float32 master shards, bf16 gathered for the passes)."""
    return make_dp_trainer(model, dataset, {**common, **FSDP2}, probe, args)


# Trainer kinds, the baseline first; each gets a verdict against the baseline. "fsdp" runs in its own process
# (`in_own_process`), where accelerate starts a one-rank process group and shards the model.
MODES = {"trainer": make_trainer, "dp": make_dp_trainer, "fsdp": make_fsdp_trainer}
BASELINE = "trainer"
IN_OWN_PROCESS = {"fsdp"}


def covered_seconds(intervals_us: list) -> float:
    """Length of the union of (start, end) intervals in µs, in seconds: overlapping kernels count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals_us):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


class StepProbe(TrainerCallback):
    """Per step index, one phase: warm-up, timed (time and memory), sync count, or profiled (GPU-busy fraction).

    The sync count and the profiler slow a step down, so their steps come after the timed ones.
    """

    def __init__(self, cuda: bool, warmup: int, timed: int, probe_steps: int):
        self.cuda = cuda
        self.timed = range(warmup, warmup + timed)
        self.counted = range(self.timed.stop, self.timed.stop + (probe_steps if cuda else 0))
        self.profiled = range(self.counted.stop, self.counted.stop + (probe_steps if cuda else 0))
        self.step_s, self.interval_s, self.start_bytes, self.peak_bytes, self.syncs = [], [], [], [], []
        self.busy_fraction, self.errors = None, {}
        self._start = self._last_end = self._catcher = self._caught = self._profiler = self._profile_start = None

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def _guarded(self, what: str, action) -> None:
        """A probe that fails is reported, not fatal: the timing of the run still comes back."""
        try:
            action()
        except Exception as error:  # noqa: BLE001
            self.errors.setdefault(what, f"{type(error).__name__}: {error}")

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step  # steps completed so far
        self._sync()
        if self.cuda and step in self.timed:
            torch.cuda.reset_peak_memory_stats()
            self.start_bytes.append(torch.cuda.memory_allocated())
        if step in self.counted:  # after our synchronize, so that it is not counted
            self._guarded("syncs", self._start_sync_count)
        if step == self.profiled.start and self.profiled:
            self._guarded("gpu_busy", self._start_profiler)
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step - 1  # Trainer counts the step before calling on_step_end
        if step in self.counted:  # before our synchronize
            self._guarded("syncs", self._stop_sync_count)
        self._sync()
        now = time.perf_counter()
        if step in self.timed:
            self.step_s.append(now - self._start)
            if self._last_end is not None:
                self.interval_s.append(now - self._last_end)
            if self.cuda:
                self.peak_bytes.append(torch.cuda.max_memory_allocated() - self.start_bytes[-1])
        if self.profiled and step == self.profiled[-1]:
            self._guarded("gpu_busy", lambda: self._stop_profiler(now))
        self._last_end = now

    def on_train_end(self, args, state, control, **kwargs):
        """Leave nothing switched on if training stopped inside a probe."""
        self._guarded("syncs", self._stop_sync_count)
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            self._guarded("gpu_busy", profiler.stop)

    def _start_sync_count(self):
        # torch warns "called a synchronizing CUDA operation" at every .item(), nonzero(), unique(), ... (not at
        # torch.cuda.synchronize(), so ours are not counted either way).
        torch.cuda.set_sync_debug_mode("warn")
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")  # every sync, not once per code location

    def _stop_sync_count(self):
        if self._catcher is None:
            return
        try:
            torch.cuda.set_sync_debug_mode("default")
        finally:
            self._catcher.__exit__(None, None, None)
            self._catcher = None
        self.syncs.append(sum("synchroniz" in str(w.message) for w in self._caught))

    def _start_profiler(self):
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self._profiler.start()
        self._profile_start = time.perf_counter()

    def _stop_profiler(self, now: float):
        if self._profiler is None:
            return
        self._profiler.stop()
        events, self._profiler = self._profiler.events(), None
        kernels = [(e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        if not kernels:
            raise RuntimeError("the profiler recorded no GPU activity")
        self.busy_fraction = covered_seconds(kernels) / (now - self._profile_start)


def summarise(probe: StepProbe, passes: list) -> dict:
    """The figures of one run (CUDA-only ones None on the CPU)."""
    deciles = statistics.quantiles(probe.step_s, n=10, method="inclusive")
    timed = passes[probe.timed.start:probe.timed.stop]
    return {
        "median_step_s": statistics.median(probe.step_s), "p10_step_s": deciles[0], "p90_step_s": deciles[-1],
        "median_interval_s": statistics.median(probe.interval_s) if probe.interval_s else None,
        "peak_step_memory_bytes": max(probe.peak_bytes) if probe.peak_bytes else None,
        "step_start_memory_bytes": max(probe.start_bytes) if probe.start_bytes else None,
        "passes_per_step": statistics.mean(p for p, _ in timed),
        "rows_per_step": statistics.mean(r for _, r in timed),
        "syncs_per_step": statistics.mean(probe.syncs) if probe.syncs else None,
        "gpu_busy_fraction": probe.busy_fraction,
        "probe_errors": probe.errors or None,
    }


def free_memory(cuda: bool) -> None:
    """Between runs on CUDA, so that a run's memory is not the previous one's (on the CPU: skipped, ~0.5 s each)."""
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()


def train_once(mode: str, config: dict, finetune: str, dataset: Dataset, args, output_dir: str) -> dict:
    """One run of `mode`: warm-up, timed and probe steps; its figures, and ε for DP."""
    cuda = args.device.startswith("cuda")
    free_memory(cuda)
    allocated_before = torch.cuda.memory_allocated() if cuda else None
    model = build_model(config, finetune, args.device, args.torch_dtype)
    probe = StepProbe(cuda, args.warmup, args.steps, args.probe_steps)
    total_steps = probe.profiled.stop
    common = dict(output_dir=output_dir, max_steps=total_steps, learning_rate=1e-4, report_to=[], save_strategy="no",
                  disable_tqdm=True, logging_steps=10**6, seed=0, dataloader_num_workers=0,
                  bf16=args.torch_dtype == torch.bfloat16, use_cpu=not cuda)
    trainer = MODES[mode](model, dataset, common, probe, args)
    trainer.remove_callback(PrinterCallback)  # its end-of-training metrics dict would interleave with our lines
    started = time.perf_counter()
    trainer.train()
    result = summarise(probe, trainer.passes)
    result.update(steps=total_steps, train_s=time.perf_counter() - started, allocated_before_run_bytes=allocated_before,
                  trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad))
    if trainer.is_fsdp_enabled:  # a sharded checkpoint: model and optimizer shards, the ledger once
        save_started = time.perf_counter()
        trainer._save_checkpoint(trainer.model, trial=None)
        folder = Path(output_dir) / f"checkpoint-{trainer.state.global_step}"
        result.update(checkpoint_save_s=time.perf_counter() - save_started,
                      checkpoint_bytes=sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()))
    if isinstance(trainer, DPTrainer):
        report = trainer.privacy_report()
        result.update(epsilon=report["epsilon"], delta=report["delta"], noise_multiplier=report["noise_multiplier"],
                      dp_steps=report["steps"])
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in trained]  # FSDP2: gathered
    result.update(fsdp=trainer.is_fsdp_enabled, world_size=trainer.accelerator.num_processes,
                  sharded=all(hasattr(p, "full_tensor") for p in trained),  # DTensors: really sharded
                  weights_sum=sum(float(p.detach().double().sum()) for p in whole),  # the runs compare by these
                  weights_sum_of_squares=sum(float(p.detach().double().square().sum()) for p in whole))
    return result  # the trainer and model go with this frame; the next run's free_memory collects them


def fsdp_on_cpu() -> None:
    """The CPU smoke run only: accelerate 1.15 turns an FSDP plugin into FSDP on GPU-type devices only, so set the
    distributed type as it does on a GPU (as tests/trainer/fsdp_train.py does for its gloo processes)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *init_args, fsdp_plugin=None, **kwargs):
        original(self, *init_args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


def in_own_process(mode: str, config_name: str, finetune: str, args) -> dict:
    """`train_once(mode, ...)` in a fresh process, rank 0 of a one-rank process group (the variables torchrun sets):
    accelerate shards the model there (FSDP2), and this process's runs stay plain. Its figures come back as JSON."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    sizes = [item for key in SIZES for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, config_name, finetune,
                   "--device", args.device, "--dtype", args.dtype, *sizes, "--out", str(out)]
        try:
            done = subprocess.run(command + (["--quick"] if args.quick else []), env=env, capture_output=True,
                                  text=True, timeout=args.worker_timeout)
        except subprocess.TimeoutExpired:
            args.worker_timed_out = True  # the later ones are skipped: a hang must not eat the device budget
            raise
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the {mode} process exited with {done.returncode}: {done.stderr[-3000:]}")
        return json.loads(out.read_text())


def worker(args) -> None:
    """The body of `in_own_process`: one run, its figures written to `--out`."""
    mode, config_name, finetune = args.worker
    if not args.device.startswith("cuda"):
        fsdp_on_cpu()
    config = model_config(config_name, args.quick)
    with tempfile.TemporaryDirectory() as output_dir:
        result = train_once(mode, config, finetune, user_rows(config["vocab_size"], args.users, args.seq_len), args,
                            output_dir)
    Path(args.out).write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def compare_sharded(plain: dict, sharded: dict) -> tuple[dict, str]:
    """The FSDP2 run against the plain DP run: step time and memory ratios, and whether it did the same steps."""
    if "error" in plain or "error" in sharded:
        return {}, "ERROR (see the run's error)"
    ratios = {"step": sharded["median_step_s"] / plain["median_step_s"], "memory": None,
              "epsilon_equal": sharded["epsilon"] == plain["epsilon"],
              "weights_relative_difference": abs(sharded["weights_sum_of_squares"] - plain["weights_sum_of_squares"])
              / plain["weights_sum_of_squares"]}
    if plain["peak_step_memory_bytes"] and sharded["peak_step_memory_bytes"] is not None:
        ratios["memory"] = sharded["peak_step_memory_bytes"] / plain["peak_step_memory_bytes"]
        ratios["step_start_memory"] = sharded["step_start_memory_bytes"] / plain["step_start_memory_bytes"]
    memory = "n/a" if ratios["memory"] is None else f"x{ratios['memory']:.2f}"
    return ratios, (f"step x{ratios['step']:.2f}, peak step memory {memory}, ε "
                    f"{'equal' if ratios['epsilon_equal'] else 'DIFFERS'}, weights (sum of squares) differ by "
                    f"{ratios['weights_relative_difference']:.1e} relative"
                    + (f"; sharded checkpoint saved in {sharded['checkpoint_save_s']:.1f} s "
                       f"({sharded['checkpoint_bytes'] / 2**20:.0f} MiB)" if "checkpoint_save_s" in sharded else ""))


def describe(result: dict) -> str:
    line = (f"step {result['median_step_s'] * 1e3:.1f} ms (p10 {result['p10_step_s'] * 1e3:.1f}, "
            f"p90 {result['p90_step_s'] * 1e3:.1f}), {result['passes_per_step']:.2f} passes/step, "
            f"{result['rows_per_step']:.1f} rows/step")
    if result["median_interval_s"] is not None:
        line += f", interval {result['median_interval_s'] * 1e3:.1f} ms"
    if result["peak_step_memory_bytes"] is not None:
        line += f", peak +{result['peak_step_memory_bytes'] / 2**30:.2f} GiB"
    if result["syncs_per_step"] is not None:
        line += f", {result['syncs_per_step']:.1f} syncs/step"
    if result["gpu_busy_fraction"] is not None:
        line += f", GPU busy {100 * result['gpu_busy_fraction']:.0f}%"
    if "epsilon" in result:
        line += f"; ε = {result['epsilon']:.2f} (σ = {result['noise_multiplier']:.3f})"
    line += f"; {result['steps']} steps in {result['train_s']:.1f} s"
    return line + (f"; probe errors {result['probe_errors']}" if result["probe_errors"] else "")


def verdict(label: str, base: dict, other: dict) -> tuple[dict, str]:
    """Ratios against the baseline and the one-line verdict (a figure not measured, e.g. memory on CPU: n/a)."""
    if "error" in base or "error" in other:
        return {}, f"{label}: ERROR (see the run's error)"
    ratios = {"step": other["median_step_s"] / base["median_step_s"], "memory": None,
              "rows": other["rows_per_step"] / base["rows_per_step"]}
    if base["median_interval_s"] and other["median_interval_s"] is not None:
        ratios["interval"] = other["median_interval_s"] / base["median_interval_s"]
    if base["peak_step_memory_bytes"] and other["peak_step_memory_bytes"] is not None:
        ratios["memory"] = other["peak_step_memory_bytes"] / base["peak_step_memory_bytes"]
        ratios["total_memory"] = ((other["step_start_memory_bytes"] + other["peak_step_memory_bytes"])
                                  / (base["step_start_memory_bytes"] + base["peak_step_memory_bytes"]))
    passed = all(ratios[key] <= target for key, target in TARGETS.items() if ratios[key] is not None)
    memory = "n/a" if ratios["memory"] is None else f"x{ratios['memory']:.2f}"
    return ratios, (f"{label}: step x{ratios['step']:.2f} (target ≤ {TARGETS['step']}) memory {memory} "
                    f"(target ≤ {TARGETS['memory']}) {'PASS' if passed else 'FAIL'}")


def prime_profiler(cuda: bool) -> str | None:
    """One tiny profiler session first: every timed step then runs after the CUDA profiling interface has started.

    Returns the error, if the profiler cannot run here (the GPU-busy probes then report it too).
    """
    if not cuda:
        return None
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.ones(8, device="cuda").mul_(2)
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return None


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps: a CPU smoke run")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--finetune", nargs="+", default=list(FINETUNES), choices=list(FINETUNES))
    for name, value in SIZES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {value} ({QUICK_SIZES[name]} with --quick)")
    parser.add_argument("--fsdp", default="auto", choices=["auto", "on", "off"],
                        help="the one-process FSDP2 runs: auto = on CUDA only (on the CPU they need a shim)")
    parser.add_argument("--worker-timeout", type=int, default=None, help="seconds (default 150 on CUDA, 1800 on CPU)")
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "CONFIG", "FINETUNE"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default="device_check.json")
    args = parser.parse_args(argv)
    args.fsdp = args.fsdp == "on" or (args.fsdp == "auto" and args.device.startswith("cuda"))
    if args.worker_timeout is None:
        args.worker_timeout = 150 if args.device.startswith("cuda") else 1800
    for name, value in (QUICK_SIZES if args.quick else SIZES).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.rows % ROWS_PER_USER or args.steps < 2 or args.warmup < 1:
        parser.error(f"--rows must be a multiple of {ROWS_PER_USER}, --steps at least 2, --warmup at least 1")
    args.torch_dtype = getattr(torch, args.dtype)
    if args.quick and args.device == "cpu":
        torch.set_num_threads(1)  # tiny models run fastest on one thread, and do not fight over a small machine
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    modes = [mode for mode in MODES if mode != "fsdp" or args.fsdp]
    began = time.perf_counter()
    cuda = args.device.startswith("cuda")
    name = torch.cuda.get_device_name() if cuda else "cpu"
    import transformers

    print(f"# {name}, torch {torch.__version__}, transformers {transformers.__version__}, {args.dtype}; "
          f"{args.rows} rows x {args.seq_len} tokens, {args.warmup} warm-up + {args.steps} timed steps", flush=True)
    sizes = {key: getattr(args, key) for key in SIZES}
    report = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
              "dtype": args.dtype, "quick": args.quick, "sizes": sizes, "targets": TARGETS,
              "configs": {c: model_config(c, args.quick) for c in args.configs}, "exactness": {}, "runs": {},
              "ratios": {}, "verdicts": []}
    for config_name in args.configs:
        try:
            exactness = check_exactness(model_config(config_name, args.quick, layers=2), args)
            print(f"{config_name} (2 layers): ghost norms vs torch.func (fp32), {exactness['examples']} x "
                  f"{exactness['tokens']} tokens: max relative error {exactness['max_relative_error']:.2e}", flush=True)
        except Exception as error:  # noqa: BLE001 - the timing below is still worth having
            traceback.print_exc()
            exactness = {"error": f"{type(error).__name__}: {error}"}
        report["exactness"][config_name] = exactness
    try:  # the noise path's cost and, on CUDA, its law over 2e9 device draws (benchmarks/noise_check.py)
        sys.path.insert(0, str(Path(__file__).parent))
        import noise_check

        report["noise"] = noise_check.run(args.device, quick=args.quick, draws=10**7 if args.quick else 2 * 10**9)
    except Exception as error:  # noqa: BLE001 - the timing below is still worth having
        traceback.print_exc()
        report["noise"] = {"error": f"{type(error).__name__}: {error}"}
    try:  # the fused noise kernel: its words against the reference engine's, ms per step for 1e8 and 1e9 elements
        import noise_check

        report["noise_kernel"] = noise_check.kernel_check(args.device, sizes=(10**7,) if args.quick else (10**8, 10**9))
        print(f"noise kernel: {report['noise_kernel']}", flush=True)
    except Exception as error:  # noqa: BLE001 - the timing below is still worth having
        traceback.print_exc()
        report["noise_kernel"] = {"error": f"{type(error).__name__}: {error}"}
    report["profiler_priming_error"] = prime_profiler(cuda)
    with tempfile.TemporaryDirectory() as output_dir:
        for config_name in args.configs:
            config = model_config(config_name, args.quick)
            dataset = user_rows(config["vocab_size"], args.users, args.seq_len)
            for finetune in args.finetune:
                runs = report["runs"].setdefault(config_name, {}).setdefault(finetune, {})
                for mode in modes:
                    label = f"{config_name} {finetune} {mode}"
                    print(f"{label}: training", flush=True)
                    try:
                        if mode in IN_OWN_PROCESS and getattr(args, "worker_timed_out", False):
                            raise RuntimeError(f"skipped: an earlier {mode} process ran out of time")
                        if mode in IN_OWN_PROCESS:
                            free_memory(cuda)  # the plain runs' cached blocks, before the other process allocates
                            runs[mode] = in_own_process(mode, config_name, finetune, args)
                        else:
                            runs[mode] = train_once(mode, config, finetune, dataset, args, output_dir)
                        print(f"{label}: {describe(runs[mode])}", flush=True)
                    except Exception as error:  # noqa: BLE001 - one failing run must not lose the others
                        traceback.print_exc()
                        runs[mode] = {"error": f"{type(error).__name__}: {error}"}
                ratios_of = report["ratios"].setdefault(config_name, {}).setdefault(finetune, {})
                for mode in modes:
                    if mode != BASELINE:
                        label = f"{config_name} {finetune}" + ("" if mode == "dp" else f" {mode}")
                        ratios_of[mode], line = verdict(label, runs[BASELINE], runs[mode])
                        report["verdicts"].append(line)
                        print(line, flush=True)
                if "fsdp" in runs:
                    ratios_of["fsdp_vs_dp"], line = compare_sharded(runs["dp"], runs["fsdp"])
                    print(f"{config_name} {finetune} FSDP2 (1 process) vs plain DP: {line}", flush=True)
                Path(args.out).write_text(json.dumps(report, indent=2))  # partial results survive a later failure
    report["elapsed_s"] = time.perf_counter() - began
    print(f"# verdicts ({report['elapsed_s']:.0f} s in all):", *report["verdicts"], sep="\n", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
