"""Trains a tiny causal LM with DP under FSDP2 (or one plain process) and saves its weights and per-rank bytes.

Usage: accelerate launch --config_file recipes/configs/fsdp.yaml --num_processes 2 tests/trainer/fsdp_train.py
OUT.pt SAMPLING [full|lora|checkpointing]; or `python tests/trainer/fsdp_train.py OUT.pt SAMPLING VARIANT` for one
plain process. `checkpointing`: full fine-tuning with gradient_checkpointing=True (non-reentrant).
On CPU, accelerate 1.15 drops an FSDP config silently (it turns FSDP on for GPU-type devices only): `fsdp_on_cpu`
sets the distributed type as accelerate does on a GPU, and the run records that its parameters really were
sharded DTensors during training.
"""

import os
import sys

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


def main(out_path: str, sampling: str = "uls", variant: str = "full") -> None:
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        fsdp_on_cpu()
    model = tiny_llama(seed=3)
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    args = DPTrainingArguments(
        output_dir=out_path + ".run", max_steps=3, expected_batch_size=8, per_device_train_batch_size=3,
        learning_rate=5e-2, target_epsilon=8.0, noise_seed=4321,
        **(dict(privacy_unit="example") if sampling == "example" else dict(sampling=sampling, contribution_bound=3)),
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        **(dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
           if variant == "checkpointing" else {}),
    )
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = DPTrainer(model=model, args=args, train_dataset=user_dataset(seed=5, causal_lm=True),
                        data_collator=pad_collator)
    measure = Bytes(trainer)
    trainer.add_callback(measure)
    trainer.train()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()}
    if trainer.is_world_process_zero():
        torch.save({"state": {k: v.detach().cpu() for k, v in state.items()},
                    "world_size": trainer.accelerator.num_processes, "fsdp": trainer.is_fsdp_enabled,
                    "initial": initial, "sharded": measure.sharded, "bytes": measure.bytes,
                    "checkpointing": [getattr(layer, "gradient_checkpointing", False) for layer in
                                      trainer.model.modules() if isinstance(layer, LlamaDecoderLayer)],
                    "epsilon": trainer.privacy_report()["epsilon"]}, out_path)
    finish_processes()


def refusals(out_path: str) -> None:
    """One rank under FSDP2 (`fsdp=True` in the arguments): what building, then training, says for checkpoints,
    mixed precision and resuming, and for none of them (then it builds, sharded, and refuses only the resume)."""
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
    if sys.argv[2:3] == ["refusals"]:
        refusals(sys.argv[1])
    else:
        main(*sys.argv[1:])
