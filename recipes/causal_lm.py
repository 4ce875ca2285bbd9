# Copyright the hf_dp authors. Licensed under the Apache License, Version 2.0.
"""
Next-token fine-tuning of a causal LM with user-level differential privacy, beside the public-only baseline.

Trains [`hf_dp.DPTrainer`] (or plain `transformers.Trainer` with `--non_private`) on user-partitioned text
(labels = the input tokens, padding masked with -100), reports test perplexity next to the perplexity of the
untouched pretrained model (the public-only baseline), and writes `<results_dir>/<run>.json`, the model (LoRA
merged), its tokenizer and its privacy card (`<output_dir>/README.md`). Any causal LM works: a local path, or
a Hub id when the machine can reach the Hub.

# ULS at ε = 8 with LoRA on one CPU (users = Shakespeare's speaking roles, texts = their speeches):
```
accelerate launch --config_file recipes/configs/cpu.yaml recipes/causal_lm.py \
    --model_name_or_path path/to/causal-lm --output_dir results/models/lm-uls-eps8 --results_dir results \
    --sampling uls --target_epsilon 8 --expected_batch_size 96 --contribution_bound 2 \
    --max_steps 40 --learning_rate 1e-3 --use_lora --max_length 64
```

# ELS on your own data, one GPU, bf16; then the same on 4 GPUs:
```
accelerate launch --config_file recipes/configs/gpu.yaml recipes/causal_lm.py \
    --model_name_or_path path/to/causal-lm --dataset chats.jsonl --user_column author --text_column message \
    --output_dir out/chats-els --sampling els --target_epsilon 3 --expected_batch_size 512 \
    --contribution_bound 8 --num_train_epochs 3 --learning_rate 5e-4 --use_lora --bf16
accelerate launch --config_file recipes/configs/multi_gpu.yaml --num_processes 4 recipes/causal_lm.py ...
```

# Non-private fine-tuning, for comparison:
```
accelerate launch --config_file recipes/configs/cpu.yaml recipes/causal_lm.py \
    --model_name_or_path path/to/causal-lm --output_dir results/models/lm-non-private --non_private \
    --per_device_train_batch_size 16 --max_steps 300 --learning_rate 2e-4 --use_lora
```

`--expected_batch_size` is the global logical batch (users per step for ULS, examples otherwise);
`--per_device_train_batch_size` is the physical micro-batch. Every DPTrainingArguments flag is available:
`python recipes/causal_lm.py --help`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser

from hf_dp import DPTrainingArguments
from hf_dp.language_modeling import LanguageModelingConfig, run_language_modeling
from hf_dp.runs import finish_processes, method_of, plain_training_arguments

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class ScriptArguments:
    """Data, model and reporting flags of the causal-LM recipe (training flags: DPTrainingArguments)."""

    model_name_or_path: str = field(
        default=None, metadata={"help": "Causal LM to fine-tune: a local path or a Hub id (required)."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer (default: the model's)."}
    )
    dataset: str = field(
        default="shakespeare",
        metadata={"help": "'shakespeare' (speeches by speaking role) or a JSONL/CSV/Parquet path or Hub dataset id."},
    )
    eval_dataset: str | None = field(
        default=None,
        metadata={"help": "Test data (other users than --dataset). Default: a seeded 20%% of the users, held out."},
    )
    user_column: str = field(default="user_id", metadata={"help": "Column with the user id (the privacy unit)."})
    text_column: str = field(default="text", metadata={"help": "Column with the text."})
    max_length: int = field(default=64, metadata={"help": "Tokens per text, EOS included (longer: truncated)."})
    use_lora: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt (default: peft's choice for the architecture)."}
    )
    non_private: bool = field(
        default=False,
        metadata={"help": "Train without DP (plain transformers.Trainer; privacy flags ignored), for comparison."},
    )
    results_dir: str = field(default="results", metadata={"help": "Where <run>.json is written."})
    max_train_users: int | None = field(default=None, metadata={"help": "Train on a seeded sample of users."})
    max_eval_examples: int | None = field(default=None, metadata={"help": "Evaluate on a seeded sample of rows."})


def main(script_args: ScriptArguments, training_args: DPTrainingArguments) -> dict:
    if script_args.model_name_or_path is None:
        raise SystemExit("--model_name_or_path is required (a local path or a Hub id of a causal LM).")
    if script_args.non_private:
        training_args = plain_training_arguments(training_args)
    config = LanguageModelingConfig(
        run=Path(training_args.run_name or training_args.output_dir).name,
        method=method_of(training_args),
        results_dir=script_args.results_dir,
        dataset=script_args.dataset,
        eval_dataset=script_args.eval_dataset,
        user_column=script_args.user_column,
        text_column=script_args.text_column,
        model_name_or_path=script_args.model_name_or_path,
        tokenizer_name_or_path=script_args.tokenizer_name_or_path,
        max_length=script_args.max_length,
        use_lora=script_args.use_lora,
        lora_r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        lora_target_modules=script_args.lora_target_modules,
        max_train_users=script_args.max_train_users,
        max_eval_examples=script_args.max_eval_examples,
        eval_batch_size=training_args.per_device_eval_batch_size,
        progress=not training_args.disable_tqdm,
        seed=training_args.seed,
    )
    result = run_language_modeling(config, training_args)
    epsilon = "no DP" if result["epsilon"] is None else f"ε = {result['epsilon']:.3g}, δ = {result['delta']:.3g}"
    print(f"{result['run']} ({result['method']}, {epsilon}): perplexity {result['metric']:.2f}; "
          f"public-only baseline {result['baseline_metric']:.2f}. Model and card: {training_args.output_dir}")
    return result


def make_parser() -> HfArgumentParser:
    return HfArgumentParser((ScriptArguments, DPTrainingArguments))


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args = parser.parse_args_into_dataclasses()
    main(script_args, training_args)
    finish_processes()
