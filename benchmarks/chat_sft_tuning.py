"""Tune the chat-SFT study's hyper-parameters on a public proxy, never on its training roles or test plays.

The chat study (`hf-dp demo`, [`hf_dp.workflows.study`] with `task="sft"`) trains on the Shakespeare chat data
([`hf_dp.workflows.chat_data.load_shakespeare_chat`]) minus the six tuning plays
([`~hf_dp.workflows.study_settings.TUNING_PLAYS`]). Every probe here trains on the conversations of the roles of
three of them ([`~hf_dp.workflows.study_settings.TUNING_TRAIN_PLAYS`]) and measures the completion NLL on a fixed
sample of the conversations of the other three ([`~hf_dp.workflows.study_settings.TUNING_EVAL_PLAYS`]), exactly as
`benchmarks/causal_lm_tuning.py` does for next-token prediction.

The proxy has far fewer roles than the study, so a DP probe does not calibrate to its own ε: it adds the noise the
*study* run will add (σ for the study's q = users per step / N, steps, ε and δ = 1/(10 N), N the study's training
roles), so each step's signal-to-noise ratio is the study's. The probe's own ε is meaningless and not reported.

Examples (SmolLM2-135M-Instruct, LoRA r = 8 on q/v of the top 4 layers, 16 users per step, 60 steps):

    python benchmarks/chat_sft_tuning.py --baseline
    python benchmarks/chat_sft_tuning.py --learning_rate 1e-2 --max_grad_norm 0.1 --adaptive_clipping
    python benchmarks/chat_sft_tuning.py --non_private --learning_rate 1e-2
    python benchmarks/chat_sft_tuning.py --adaptive_clipping --contribution_bound 4   # G = 4 rows per role
    python benchmarks/chat_sft_tuning.py --no_noise --max_grad_norm 1e6   # a measurement only: no privacy at all
    python benchmarks/chat_sft_tuning.py --adaptive_clipping --redraw_rows   # G = 1, a fresh conversation each step
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_LAYERS = 30  # SmolLM2-135M


def proxy_data(eval_examples: int, seed: int = 0, system_prompt: str | None = None):
    """TextData of the proxy: train = conversations of TUNING_TRAIN_PLAYS' roles, test = a fixed sample of
    TUNING_EVAL_PLAYS' conversations, both as prompt/completion rows."""
    from hf_dp.workflows.chat_data import load_shakespeare_chat
    from hf_dp.workflows.run_data import subsample_rows
    from hf_dp.workflows.study_settings import TUNING_EVAL_PLAYS, TUNING_TRAIN_PLAYS
    from hf_dp.workflows.tasks.chat_sft import to_prompt_completion
    from hf_dp.workflows.tasks.language_modeling import TextData

    train = load_shakespeare_chat()["train"]
    proxy_train = train.filter(lambda p: [x in TUNING_TRAIN_PLAYS for x in p], input_columns="play", batched=True)
    proxy_test = train.filter(lambda p: [x in TUNING_EVAL_PLAYS for x in p], input_columns="play", batched=True)
    proxy_test = subsample_rows(proxy_test, eval_examples, seed)
    return TextData(train=to_prompt_completion(proxy_train, system_prompt=system_prompt),
                    test=to_prompt_completion(proxy_test, system_prompt=system_prompt),
                    dataset_name="proxy")


def study_users() -> int:
    """Training roles of the chat study (chat training plays minus TUNING_PLAYS): the N of its sample rate."""
    from hf_dp.workflows.chat_data import load_shakespeare_chat
    from hf_dp.workflows.study_settings import TUNING_PLAYS

    train = load_shakespeare_chat()["train"]
    return len({u for u, p in zip(train["user_id"], train["play"]) if p not in TUNING_PLAYS})


def main(argv=None) -> dict:
    from hf_dp.workflows.study_settings import SFT_SYSTEM_PROMPT

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", action="store_true", help="Only the untouched model's proxy NLL.")
    parser.add_argument("--non_private", action="store_true")
    parser.add_argument("--epsilon", type=float, default=8.0, help="ε of the study run whose σ the probe adds.")
    parser.add_argument("--users_per_step", type=int, default=16)
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--max_grad_norm", type=float, default=0.1)
    parser.add_argument("--adaptive_clipping", action="store_true")
    parser.add_argument("--clipping_count_noise", type=float, default=None)
    parser.add_argument("--target_unclipped_quantile", type=float, default=0.5, help="Adaptive clipping's target.")
    parser.add_argument("--contribution_bound", type=int, default=1, help="G: conversations per sampled role.")
    parser.add_argument("--redraw_rows", action="store_true",
                        help="Draw each sampled role's G conversations afresh every step (ULS's redraw_rows).")
    parser.add_argument("--no_noise", action="store_true",
                        help="Decomposition only: the DP step with its gradient noise off (sampling and clipping "
                             "kept), to measure what the noise costs. Its result has no privacy at all.")
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--lora_layers", type=int, default=4, help="LoRA on the top k layers (0: all).")
    parser.add_argument("--modules", nargs="+", default=["q_proj", "v_proj"])
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--truncation_mode", default="keep_start", choices=["keep_start", "keep_end"])
    parser.add_argument("--system_prompt", default=SFT_SYSTEM_PROMPT)
    parser.add_argument("--fp32", action="store_true", help="float32 on a CPU (default: the study's bf16 autocast "
                                                            "where the CPU has native bf16).")
    parser.add_argument("--eval_examples", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--log", default="results-tuning/chat_probes.jsonl")
    parser.add_argument("--no_progress", action="store_true")
    args = parser.parse_args(argv)

    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.causal_lm_tuning import study_noise_multiplier  # same σ formula, the chat study's N below
    import benchmarks.causal_lm_tuning as lm_tuning
    from hf_dp.workflows.pretrained import smollm2_path
    from hf_dp.workflows.tasks.chat_sft import ChatSFTConfig, run_chat_sft

    lm_tuning.study_users = study_users
    data = proxy_data(args.eval_examples, system_prompt=args.system_prompt)
    layers = list(range(NUM_LAYERS - args.lora_layers, NUM_LAYERS)) if args.lora_layers else None
    record = {"system_prompt": args.system_prompt, "lora_layers": args.lora_layers, "max_length": args.max_length,
              "users_per_step": args.users_per_step, "lora_r": args.lora_r, "bf16_on_cpu": not args.fp32,
              "truncation_mode": args.truncation_mode,
              "eval_examples": len(data.test), "proxy_train_users": len(set(data.train["user_id"])),
              "proxy_train_rows": len(data.train)}
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="chat-probe-")
    try:
        config = ChatSFTConfig(run="probe", results_dir=workdir, model_name_or_path=str(smollm2_path()),
                               max_length=args.max_length, lora_r=args.lora_r, lora_alpha=2 * args.lora_r,
                               lora_target_modules=args.modules, lora_layers=layers, eval_batch_size=32,
                               progress=not args.no_progress, bf16_on_cpu=not args.fp32)
        common = dict(max_steps=0 if args.baseline else args.max_steps, learning_rate=args.learning_rate,
                      seed=args.seed, truncation_mode=args.truncation_mode, output_dir=workdir + "/model",
                      report_to=[], gradient_checkpointing=False, use_cpu=not torch.cuda.is_available())
        if args.non_private or args.baseline:
            training_args = config.training_arguments("non-private", per_device_train_batch_size=args.users_per_step,
                                                      **common)
            record["mode"] = "baseline" if args.baseline else "non-private"
        else:
            count_noise = (args.clipping_count_noise or args.users_per_step / 10) if args.adaptive_clipping else None
            sigma, effective = study_noise_multiplier(args.epsilon, args.users_per_step, args.max_steps,
                                                      count_noise=count_noise)
            fields = dict(target_epsilon=None, noise_multiplier=sigma, expected_batch_size=args.users_per_step,
                          contribution_bound=args.contribution_bound, max_grad_norm=args.max_grad_norm,
                          per_device_train_batch_size=16, max_loss=10.0, redraw_rows=args.redraw_rows)
            if args.adaptive_clipping:
                fields.update(adaptive_clipping=True, clipping_count_noise=count_noise,
                              target_unclipped_quantile=args.target_unclipped_quantile)
                record["target_unclipped_quantile"] = args.target_unclipped_quantile
            training_args = config.training_arguments("uls", **fields, **common)
            record.update(mode="uls-no-noise" if args.no_noise else "uls", epsilon_of_study=args.epsilon,
                          noise_multiplier=0.0 if args.no_noise else sigma, contribution_bound=args.contribution_bound,
                          adaptive_clipping=args.adaptive_clipping, max_grad_norm=args.max_grad_norm,
                          redraw_rows=args.redraw_rows)
        from hf_dp.workflows.audit_demo import sabotage

        with sabotage("no-noise" if args.no_noise else None):
            result = run_chat_sft(config, training_args, data=data)
        record.update(baseline_nll=result["baseline_nll"], nll=result["eval_nll"], learning_rate=args.learning_rate,
                      steps=result["steps"], train_seconds=round(result["train_seconds"], 1),
                      eval_seconds=round(result["eval_seconds"], 1), seed=args.seed)
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
