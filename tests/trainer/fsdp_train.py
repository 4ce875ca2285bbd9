"""Trains a tiny causal LM with DP under FSDP2 (or one plain process) and saves its weights and per-rank bytes.

Usage: accelerate launch --config_file recipes/configs/fsdp.yaml --num_processes 2 tests/trainer/fsdp_train.py
OUT.pt SAMPLING [full|lora|checkpointing]; or `python tests/trainer/fsdp_train.py OUT.pt SAMPLING VARIANT` for one
plain process. `checkpointing`: full fine-tuning with gradient_checkpointing=True (non-reentrant).
`fsdp_train.py RUNS.json` trains each run of the JSON list (each the keyword arguments of `main`) in turn, in one
launch: starting the ranks costs far more than a 4-step run, so the tests launch each group of runs once.
On CPU, accelerate 1.15 drops an FSDP config silently (it turns FSDP on for GPU-type devices only): `fsdp_on_cpu`
sets the distributed type as accelerate does on a GPU, and the run records that its parameters really were
sharded DTensors during training.
"""

import json
import os
import signal
import sys
import time

import torch
from transformers import TrainerCallback
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.workflows.runs import finish_processes
from trainer_fixtures import pad_collator, tiny_llama, user_dataset


def fsdp_on_cpu() -> None:
    """What accelerate's AcceleratorState does for an FSDP plugin on a GPU, done for gloo CPU processes."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if self._mixed_precision != "no":  # the MixedPrecisionPolicy accelerate sets on a GPU (bf16 params/reduce)
                fsdp_plugin.set_mixed_precision(self._mixed_precision)

    AcceleratorState.__init__ = init


class Bytes(TrainerCallback):
    """Per-rank bytes of parameters, gradients and optimizer state at each optimizer step (local shards only)."""

    def __init__(self, trainer):
        self.trainer, self.bytes, self.sharded = trainer, [], []

    def on_optimizer_step(self, args, state, control, **kwargs):
        params = list(self.trainer.model.parameters())  # frozen ones too (LoRA's base weights)
        local = [getattr(p, "_local_tensor", p) for p in params]
        grads = [getattr(p.grad, "_local_tensor", p.grad) for p in params if p.grad is not None]
        states = [getattr(v, "_local_tensor", v) for s in self.trainer.optimizer.state.values() for v in s.values()
                  if torch.is_tensor(v)]
        self.bytes.append(sum(t.numel() * t.element_size() for t in local + grads + states))
        self.sharded.append(all(type(p).__name__ == "DTensor" for p in params))


class StopAt(TrainerCallback):
    """Stop after optimizer step `step` (its checkpoint saved first): a run cut short, to be resumed."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save, control.should_training_stop = True, True


class SignalAt(TrainerCallback):
    """At the end of optimizer step `step`: "jit", every rank sends itself SIGTERM (a preemption, each rank told on
    its own); "kill", rank 1 is killed (SIGKILL); "stall", rank 1 sleeps far beyond `ddp_timeout` (a hung rank)."""

    def __init__(self, step: int, kind: str):
        self.step, self.kind = step, kind

    def on_step_end(self, args, state, control, **kwargs):
        if self.kind == "jit" and state.global_step > self.step:
            time.sleep(0.5)  # a preempted machine's later steps: slower than transformers' 3 s wait to save
        if state.global_step != self.step:
            return
        if self.kind == "jit":
            os.kill(os.getpid(), signal.SIGTERM)
        elif args.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL) if self.kind == "kill" else time.sleep(300)


def main(out_path: str, sampling: str = "uls", variant: str = "full", mode: str = "straight", steps: int | None = None,
         run_dir: str | None = None) -> None:
    """`variant`: full, lora or checkpointing, `bf16-` in front for bf16 (FSDP2's MixedPrecisionPolicy, or autocast
    on one plain process), `bf16weights-` for a model loaded in bf16 (bf16 shards and gradients, no policy).
    `mode`: "straight" (`steps` steps, 4 unless given, a checkpoint every 2), "cut" (stops after step 2), "resume"
    (from the newest checkpoint of the run folder `run_dir`, else `FSDP_TRAIN_RUN_DIR`, else OUT.run), "jit"
    (`enable_jit_checkpoint`, each rank sent SIGTERM at step 2), "kill" (rank 1 killed at step 3) or "stall" (rank 1
    hangs at step 3, `ddp_timeout=10`). Each run builds its own model, arguments and trainer from fixed seeds, so
    what ran before it in the process changes nothing."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        fsdp_on_cpu()
    model = tiny_llama(seed=3)
    if variant.startswith("bf16weights-"):  # the weights themselves in bf16, no mixed precision: float32 sums
        model, variant = model.to(torch.bfloat16), variant.removeprefix("bf16weights-")
    bf16 = variant.startswith("bf16")
    variant = variant.removeprefix("bf16-")
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    args = DPTrainingArguments(
        output_dir=run_dir or os.environ.get("FSDP_TRAIN_RUN_DIR", out_path + ".run"),
        max_steps=int(steps or 4), expected_batch_size=8, per_device_train_batch_size=3,
        learning_rate=5e-2, target_epsilon=8.0, noise_seed=4321,
        **(dict(privacy_unit="example") if sampling == "example" else dict(sampling=sampling, contribution_bound=3)),
        report_to=[], save_strategy="no" if mode == "jit" else "steps", save_steps=2, use_cpu=True,
        disable_tqdm=True, seed=0, bf16=bf16, enable_jit_checkpoint=mode == "jit",
        **(dict(ddp_timeout=10) if mode == "stall" else {}),
        **(dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
           if variant == "checkpointing" else {}),
    )
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = DPTrainer(model=model, args=args, train_dataset=user_dataset(seed=5, causal_lm=True),
                        data_collator=pad_collator)
    measure = Bytes(trainer)
    trainer.add_callback(measure)
    if mode == "cut":
        trainer.add_callback(StopAt(2))
    elif mode in ("jit", "kill", "stall"):
        trainer.add_callback(SignalAt(2 if mode == "jit" else 3, mode))
    trainer.train(resume_from_checkpoint=mode == "resume" or None)
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()}
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if trainer.is_world_process_zero():
        torch.save({"state": {k: v.detach().cpu() for k, v in state.items()},
                    "world_size": trainer.accelerator.num_processes, "fsdp": trainer.is_fsdp_enabled,
                    "initial": initial, "sharded": measure.sharded, "bytes": measure.bytes,
                    "checkpointing": [getattr(layer, "gradient_checkpointing", False) for layer in
                                      trainer.model.modules() if isinstance(layer, LlamaDecoderLayer)],
                    "epsilon": trainer.privacy_report()["epsilon"], "steps": trainer.state.global_step,
                    "mixed_precision": str(trainer.accelerator.mixed_precision),
                    "param_dtype": str(getattr(getattr(plugin, "mixed_precision_policy", None), "param_dtype", None))},
                   out_path)


def building(out_path: str) -> None:
    """One rank under FSDP2 (`fsdp=True` in the arguments): bf16, sharded checkpoints and just-in-time saves build
    (sharded); a checkpoint that does not exist is refused in one line."""
    fsdp_on_cpu()
    cases = {"save_strategy": dict(save_strategy="steps"), "jit": dict(enable_jit_checkpoint=True),
             "bf16": dict(bf16=True), "none": {}}
    outcome = {}
    for case, extra in cases.items():
        args = DPTrainingArguments(
            output_dir=out_path + ".run", max_steps=1, expected_batch_size=8, per_device_train_batch_size=3,
            target_epsilon=8.0, sampling="uls", contribution_bound=3, report_to=[], use_cpu=True, disable_tqdm=True,
            fsdp=True, fsdp_config={"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
            **{"save_strategy": "no", **extra})
        try:
            trainer = DPTrainer(model=tiny_llama(seed=3), args=args, train_dataset=user_dataset(seed=5, causal_lm=True),
                                data_collator=pad_collator)
            outcome[case] = f"built, fsdp {trainer.is_fsdp_enabled}"
            trainer.train(resume_from_checkpoint=out_path + ".nowhere")
        except ValueError as error:
            outcome[case] = outcome.get(case, "") + f" | {error}"
    torch.save(outcome, out_path)
    finish_processes()


if __name__ == "__main__":
    if sys.argv[2:3] == ["building"]:
        building(sys.argv[1])
    elif sys.argv[1].endswith(".json"):
        with open(sys.argv[1]) as runs:
            for run in json.load(runs):
                main(**run)
        finish_processes()
    else:
        main(*sys.argv[1:])
        finish_processes()
