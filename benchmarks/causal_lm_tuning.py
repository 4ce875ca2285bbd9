"""Tune the causal-LM study's hyper-parameters on a public proxy, never on its training roles or test plays.

Hyper-parameters tuned on the private training data are themselves a release the ledger does not count. The
study ([`hf_dp.workflows.study`], `hf-dp demo --task causal_lm`) therefore leaves six training plays out of
training ([`~hf_dp.workflows.study_settings.TUNING_PLAYS`], two per Folio genre) and every probe here trains on the
roles of three of them ([`~hf_dp.workflows.study_settings.TUNING_TRAIN_PLAYS`], 142 roles, 2,414 speeches) and
measures the next-token NLL on a fixed sample of speeches of the other three
([`~hf_dp.workflows.study_settings.TUNING_EVAL_PLAYS`]).

The proxy has far fewer roles than the study (142 against 820), so a probe would spend a much larger ε at the
same noise. It does not calibrate: each DP probe adds the noise the *study* run will add, σ calibrated for the
study's own sample rate (users per step / 820), steps, ε and δ = 1/(10·820) (`--epsilon`), so the signal-to-
noise ratio of every step is the study's. The probe's own ε is meaningless and not reported.

Modes (one JSON line per probe appended to `--log`, printed too):

- `--baseline`: the untouched model's NLL on the proxy test speeches;
- `--norms`: quantiles of the per-speech gradient norms of the LoRA weights at initialisation (exact, one
  backward per speech on the proxy training roles), to place the clipping norm C;
- default: one fine-tuning probe, DP (ULS, G = 1 unless `--contribution_bound`) or `--non_private`.

Examples (SmolLM2-135M-Instruct, 40-token speeches, 16 users per step, 60 steps, LoRA r = 8 on q/v of the top
2 layers; about 4 minutes a probe on 2 CPU cores):

    python benchmarks/causal_lm_tuning.py --baseline
    python benchmarks/causal_lm_tuning.py --norms --lora_layers 2
    python benchmarks/causal_lm_tuning.py --lora_layers 2 --learning_rate 3e-3 --max_grad_norm 0.02
    python benchmarks/causal_lm_tuning.py --non_private --lora_layers 2 --learning_rate 1e-3
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_LAYERS = 30  # SmolLM2-135M


def proxy_data(eval_examples: int, seed: int = 0):
    """TextData of the tuning proxy: train = roles of TUNING_TRAIN_PLAYS, test = a fixed sample of speeches of
    TUNING_EVAL_PLAYS."""
    from hf_dp.workflows.corpora import load_shakespeare
    from hf_dp.workflows.run_data import subsample_rows
    from hf_dp.workflows.study_settings import TUNING_EVAL_PLAYS, TUNING_TRAIN_PLAYS
    from hf_dp.workflows.tasks.language_modeling import TextData

    train = load_shakespeare()["train"]
    proxy_train = train.filter(lambda p: [x in TUNING_TRAIN_PLAYS for x in p], input_columns="play", batched=True)
    proxy_test = train.filter(lambda p: [x in TUNING_EVAL_PLAYS for x in p], input_columns="play", batched=True)
    return TextData(train=proxy_train, test=subsample_rows(proxy_test, eval_examples, seed), dataset_name="proxy")


def study_users() -> int:
    """Training roles of the causal-LM study (the training plays minus TUNING_PLAYS): the N of its sample rate."""
    from hf_dp.workflows.corpora import load_shakespeare
    from hf_dp.workflows.study_settings import TUNING_PLAYS

    train = load_shakespeare()["train"]
    return len({u for u, p in zip(train["user_id"], train["play"]) if p not in TUNING_PLAYS})


def study_noise_multiplier(epsilon: float, users_per_step: int, steps: int, logging_noise_ratio: float = 10.0,
                           group_size: int = 1, count_noise: float | None = None) -> tuple[float, float]:
    """(σ, σ_eff) of a study run: σ_eff calibrated to (ε, δ = 1/(10 N)) at q = users_per_step / N over `steps`, σ
    the gradient noise the trainer adds with private logging at `logging_noise_ratio` (as DPTrainer does), and,
    when `count_noise` (σ_b of adaptive clipping) is given, with the adaptive count composed in."""
    from hf_dp import accounting
    from hf_dp.clipping.adaptive import gradient_noise_multiplier

    users = study_users()
    effective = accounting.noise_multiplier(target_epsilon=epsilon, delta=1.0 / (10 * users),
                                            sample_rate=users_per_step / users, steps=steps, group_size=group_size)
    if count_noise is not None:
        return gradient_noise_multiplier(effective, count_noise, logging_noise_ratio=logging_noise_ratio), effective
    return effective * math.sqrt(1.0 + 2.0 / logging_noise_ratio**2), effective


def lm_config(args, results_dir: str, run: str, baseline: float | None = None):
    from hf_dp.workflows.pretrained import smollm2_path
    from hf_dp.workflows.tasks.language_modeling import LanguageModelingConfig

    layers = list(range(NUM_LAYERS - args.lora_layers, NUM_LAYERS)) if args.lora_layers else None
    return LanguageModelingConfig(
        run=run, results_dir=results_dir, model_name_or_path=str(smollm2_path()), max_length=args.max_length,
        lora_r=args.lora_r, lora_alpha=2 * args.lora_r, lora_target_modules=args.modules, lora_layers=layers,
        eval_batch_size=64, baseline_result=baseline, progress=not args.no_progress,
    )


def gradient_norms(args, data) -> dict:
    """Exact per-speech gradient norms of the LoRA weights at initialisation on `args.norm_examples` proxy
    training speeches (one backward each)."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from hf_dp.workflows.tasks.language_modeling import build_model, tokenize_causal_lm

    config = lm_config(args, tempfile.mkdtemp(), "norms")
    tokenizer = AutoTokenizer.from_pretrained(config.model_name_or_path)
    torch.manual_seed(0)
    model = build_model(config)
    rows = tokenize_causal_lm(data.train.shuffle(seed=0).select(range(args.norm_examples)), tokenizer,
                              max_length=args.max_length, keep_columns=())
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for ids in rows["input_ids"]:
        model.zero_grad()
        ids = torch.tensor([ids])
        model(input_ids=ids, labels=ids).loss.backward()
        norms.append(float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params))))
    norms = np.array(norms)
    quantiles = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9)
    return {"trainable": sum(p.numel() for p in params),
            "norm_quantiles": {str(q): float(np.quantile(norms, q)) for q in quantiles}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", action="store_true", help="Only the untouched model's proxy NLL.")
    parser.add_argument("--norms", action="store_true", help="Per-speech gradient norm quantiles at init.")
    parser.add_argument("--non_private", action="store_true")
    parser.add_argument("--mechanism", default="uls", choices=["uls", "els"])
    parser.add_argument("--epsilon", type=float, default=8.0, help="ε of the study run whose σ the probe adds.")
    parser.add_argument("--users_per_step", type=int, default=16)
    parser.add_argument("--contribution_bound", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--study_steps", type=int, default=None, help="Steps σ is calibrated for (default: "
                        "--max_steps).")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--max_grad_norm", type=float, default=0.02)
    parser.add_argument("--adaptive_clipping", action="store_true")
    parser.add_argument("--target_unclipped_quantile", type=float, default=None)
    parser.add_argument("--clipping_learning_rate", type=float, default=None)
    parser.add_argument("--clipping_count_noise", type=float, default=None)
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--lora_layers", type=int, default=4, help="LoRA on the top k layers (0: all).")
    parser.add_argument("--modules", nargs="+", default=["q_proj", "v_proj"])
    parser.add_argument("--max_length", type=int, default=40)
    parser.add_argument("--eval_examples", type=int, default=256)
    parser.add_argument("--norm_examples", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--log", default="results-tuning/probes.jsonl")
    parser.add_argument("--no_progress", action="store_true")
    args = parser.parse_args(argv)

    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from hf_dp.workflows.tasks.language_modeling import run_language_modeling, run_public_baseline

    data = proxy_data(args.eval_examples)
    record = {"adapter": {"lora_r": args.lora_r, "lora_layers": args.lora_layers, "modules": args.modules},
              "max_length": args.max_length, "eval_examples": len(data.test), "proxy_train_users":
              len(set(data.train["user_id"]))}
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="lm-probe-")
    try:
        if args.norms:
            record.update(mode="norms", **gradient_norms(args, data))
        elif args.baseline:
            result = run_public_baseline(lm_config(args, workdir, "baseline"), data=data)
            record.update(mode="baseline", nll=result["eval_nll"])
        else:
            config = lm_config(args, workdir, "probe", baseline=1.0)  # baseline: --baseline, not recomputed here
            optimisation = dict(max_steps=args.max_steps, learning_rate=args.learning_rate,
                                lr_scheduler_type=args.lr_scheduler_type, seed=args.seed)
            if args.non_private:
                training_args = config.training_arguments(
                    "non-private", per_device_train_batch_size=args.users_per_step, **optimisation)
                record.update(mode="non-private")
            else:
                count_noise = None
                if args.adaptive_clipping:
                    count_noise = args.clipping_count_noise or args.users_per_step / 20  # the trainer's default
                sigma, effective = study_noise_multiplier(args.epsilon, args.users_per_step,
                                                          args.study_steps or args.max_steps, count_noise=count_noise)
                fields = dict(target_epsilon=None, noise_multiplier=sigma, expected_batch_size=args.users_per_step,
                              contribution_bound=args.contribution_bound, max_grad_norm=args.max_grad_norm,
                              per_device_train_batch_size=32, max_loss=10.0)
                if args.adaptive_clipping:
                    fields["adaptive_clipping"] = True
                    for key in ("target_unclipped_quantile", "clipping_learning_rate", "clipping_count_noise"):
                        if getattr(args, key) is not None:
                            fields[key] = getattr(args, key)
                training_args = config.training_arguments(args.mechanism, **fields, **optimisation)
                record.update(mode=args.mechanism, epsilon_of_study=args.epsilon, noise_multiplier=sigma,
                              effective_noise_multiplier=effective, max_grad_norm=args.max_grad_norm,
                              adaptive_clipping=args.adaptive_clipping,
                              target_unclipped_quantile=args.target_unclipped_quantile,
                              clipping_learning_rate=args.clipping_learning_rate,
                              clipping_count_noise=args.clipping_count_noise)
            result = run_language_modeling(config, training_args, data=data)
            record.update(nll=result["eval_nll"], learning_rate=args.learning_rate, steps=result["steps"],
                          users_per_step=args.users_per_step, contribution_bound=args.contribution_bound,
                          train_seconds=round(result["train_seconds"], 1),
                          seconds_per_step=round(result["train_seconds"] / max(1, result["steps"]), 2),
                          seed=args.seed)
            if result.get("privacy"):
                record["final_max_grad_norm"] = result["privacy"].get("final_max_grad_norm")
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
