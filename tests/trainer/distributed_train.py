"""Trains a tiny DP model with fixed seeds and saves its weights: run under `accelerate launch`.

Usage: accelerate launch --multi_gpu --num_processes 2 tests/trainer/distributed_train.py OUT_DIR SAMPLING...
(on a CPU-only machine this runs 2 processes with the gloo backend): one run per `sampling`, in turn, each saved
as OUT_DIR/SAMPLING.pt (starting the ranks costs more than a run, so the test launches once for all of them).
`sampling` "uls-adaptive" is ULS with adaptive clipping (the count of unclipped units is all-reduced, noised once,
and every rank tracks the same C); "uls-bf16" trains a bf16 model (its clipped sums all-reduced and noised in
float32, then rounded once).
"""

import os
import sys

import torch

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.workflows.runs import finish_processes
from trainer_fixtures import pad_collator, tiny_bert, user_dataset


def main(out_path: str, sampling: str = "uls") -> None:
    """One run of `sampling`, from the same seeds whatever ran before it in the process."""
    sampling, _, variant = sampling.partition("-")
    adaptive = (dict(adaptive_clipping=True, max_grad_norm=0.05, clipping_count_noise=5.0) if variant == "adaptive"
                else {})
    args = DPTrainingArguments(
        output_dir=out_path + ".run", max_steps=3, expected_batch_size=8, per_device_train_batch_size=3,
        learning_rate=5e-2, target_epsilon=8.0, noise_seed=4321, sampling=sampling, contribution_bound=3,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, **adaptive,
    )
    model = tiny_bert(seed=3).to(torch.bfloat16 if variant == "bf16" else torch.float32)
    trainer = DPTrainer(model=model, args=args, train_dataset=user_dataset(seed=5),
                        data_collator=pad_collator)
    trainer.train()
    if trainer.is_world_process_zero():
        state = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
        torch.save({"state": state, "world_size": trainer.accelerator.num_processes,
                    "epsilon": trainer.privacy_report()["epsilon"],
                    "max_grad_norm": trainer.clipping_norm}, out_path)


if __name__ == "__main__":
    for name in sys.argv[2:]:
        main(os.path.join(sys.argv[1], f"{name}.pt"), name)
    finish_processes()
