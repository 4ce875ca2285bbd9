"""Tune the classification study's hyper-parameters on a public proxy, never on its training roles or test plays.

The same proxy as [`causal_lm_tuning`](causal_lm_tuning.py): the study ([`hf_dp.workflows.study`], `hf-dp demo`)
leaves the six [`~hf_dp.workflows.study_settings.TUNING_PLAYS`] out of training; every probe here fine-tunes the
embedded MiniLM (the study's similarity head and LoRA) on the roles of three of them
([`~hf_dp.workflows.study_settings.TUNING_TRAIN_PLAYS`], 142 roles, 2,414 speeches, one play per Folio genre) and
measures the genre accuracy on every speech of the other three ([`~hf_dp.workflows.study_settings.TUNING_EVAL_PLAYS`],
2,349 speeches, one play per genre; one standard error ≈ 1 point).

Each DP probe (ULS) adds the noise the *study* run will add: σ calibrated for the study's own sample rate (users
per step / 820 roles), steps, ε (`--epsilon`) and δ = 1/(10·820), with the adaptive count composed in when
`--adaptive_clipping`, so the signal-to-noise ratio of every step is the study's. The probe's own ε is
meaningless and not reported. One JSON line per probe is appended to `--log` and printed.

Examples (about 2-5 minutes a probe on 2 CPU cores):

    python benchmarks/classification_tuning.py --baseline
    python benchmarks/classification_tuning.py --contribution_bound 8 --users_per_step 32 --learning_rate 5e-3 \
        --adaptive_clipping
    python benchmarks/classification_tuning.py --non_private --learning_rate 2e-3
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def proxy_data(config):
    """ClassificationData of the tuning proxy: train = roles of TUNING_TRAIN_PLAYS, test = every speech of
    TUNING_EVAL_PLAYS (both from the corpus's training plays; the study trains on neither)."""
    from hf_dp.workflows.study_settings import TUNING_EVAL_PLAYS, TUNING_TRAIN_PLAYS
    from hf_dp.workflows.tasks.classification import ClassificationData, load_classification_data

    data = load_classification_data(config)
    train = data.train.filter(lambda p: [x in TUNING_TRAIN_PLAYS for x in p], input_columns="play", batched=True)
    test = data.train.filter(lambda p: [x in TUNING_EVAL_PLAYS for x in p], input_columns="play", batched=True)
    return ClassificationData(train=train, test=test, label_names=data.label_names, dataset_name="proxy",
                              not_covered=data.not_covered)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", action="store_true", help="Only the zero-shot baseline's proxy accuracy.")
    parser.add_argument("--non_private", action="store_true")
    parser.add_argument("--epsilon", type=float, default=8.0, help="ε of the study run whose σ the probe adds.")
    parser.add_argument("--users_per_step", type=int, default=32)
    parser.add_argument("--contribution_bound", type=int, default=8)
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=32, help="Non-private: speeches per step.")
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--adaptive_clipping", action="store_true")
    parser.add_argument("--clipping_count_noise", type=float, default=None)
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--modules", nargs="+", default=["query", "value"])
    parser.add_argument("--max_length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--log", default="results-tuning/classification_probes.jsonl")
    parser.add_argument("--no_progress", action="store_true")
    args = parser.parse_args(argv)

    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from causal_lm_tuning import study_noise_multiplier

    from hf_dp.workflows.tasks.classification import (
        ClassificationConfig,
        run_classification,
        run_zero_shot_baseline,
    )

    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="cls-probe-")
    record = {"lora_r": args.lora_r, "modules": args.modules, "max_length": args.max_length}
    try:
        config = ClassificationConfig(
            run="probe", results_dir=workdir, max_length=args.max_length, head="similarity", use_lora=True,
            lora_r=args.lora_r, lora_alpha=2 * args.lora_r, lora_target_modules=args.modules, eval_batch_size=128,
            baseline_result=None if args.baseline else 0.0, progress=not args.no_progress)
        data = proxy_data(config)
        record.update(proxy_train_users=len(set(data.train["user_id"])), proxy_train_rows=len(data.train),
                      eval_examples=len(data.test))
        if args.baseline:
            result = run_zero_shot_baseline(dataclasses.replace(config, run="baseline"), data)
            record.update(mode="baseline", accuracy=result["eval_result"])
        else:
            optimisation = dict(max_steps=args.max_steps, learning_rate=args.learning_rate, seed=args.seed)
            if args.non_private:
                training_args = config.training_arguments("non-private", per_device_train_batch_size=args.batch_size,
                                                          **optimisation)
                record.update(mode="non-private", batch_size=args.batch_size)
            else:
                count_noise = None
                if args.adaptive_clipping:
                    count_noise = args.clipping_count_noise or args.users_per_step / 20  # the trainer's default
                sigma, effective = study_noise_multiplier(args.epsilon, args.users_per_step, args.max_steps,
                                                          count_noise=count_noise)
                fields = dict(target_epsilon=None, noise_multiplier=sigma, expected_batch_size=args.users_per_step,
                              contribution_bound=args.contribution_bound, max_grad_norm=args.max_grad_norm,
                              per_device_train_batch_size=64)
                if args.adaptive_clipping:
                    fields.update(adaptive_clipping=True, clipping_count_noise=count_noise)
                training_args = config.training_arguments("uls", **fields, **optimisation)
                record.update(mode="uls", epsilon_of_study=args.epsilon, noise_multiplier=sigma,
                              effective_noise_multiplier=effective, max_grad_norm=args.max_grad_norm,
                              adaptive_clipping=args.adaptive_clipping, users_per_step=args.users_per_step,
                              contribution_bound=args.contribution_bound)
            result = run_classification(config, training_args, data=data)
            record.update(accuracy=result["eval_result"], learning_rate=args.learning_rate, steps=args.max_steps,
                          train_seconds=round(result["train_seconds"], 1), seed=args.seed)
            if result.get("privacy"):
                record["final_max_grad_norm"] = result["privacy"].get("max_grad_norm")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    record["seconds"] = round(time.perf_counter() - start, 1)
    line = json.dumps(record)
    print(line)
    log = Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as handle:
        handle.write(line + "\n")
    return record


if __name__ == "__main__":
    main()
