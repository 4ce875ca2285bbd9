"""`recipes/sft.py --load_in_4bit`: QLoRA from the recipe, as a user runs it, on the CPU.

A tiny chat Llama and its word-level tokenizer are saved to a folder and a JSONL file of conversations written, so
the recipe loads both by path as it would a Hub model: the base in 4-bit NF4 (bitsandbytes), LoRA adapters trained
with DP, the adapter saved (not merged into the 4-bit base) with a privacy card that says how the base was quantized
and passes `hf-dp publish`'s checks. The same run under DDP (2 gloo processes, `accelerate launch`) spends the
same ε and saves the same kind of adapter.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_chat_sft import SPECIALS, WORDS, conversations, load_recipe
from test_chat_sft import chat_tokenizer as word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from hf_dp.hub import check_privacy_card

pytest.importorskip("bitsandbytes")  # in the test extra (hf_dp[qlora]): CI runs these
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    """(the base model's folder, with its tokenizer; a JSONL file of 40 users' conversations)."""
    folder = tmp_path_factory.mktemp("qlora")
    torch.manual_seed(0)  # widths bitsandbytes' CPU 4-bit matmul takes (multiples of its 64-wide blocks)
    config = LlamaConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder / "base")
    word_tokenizer().save_pretrained(folder / "base")
    rows = conversations([f"u{i}" for i in range(40)])
    with open(folder / "chats.jsonl", "w") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
    return folder / "base", folder / "chats.jsonl"


def flags(chat_files, out: Path) -> list[str]:
    base, data = chat_files
    return ["--model_name_or_path", str(base), "--dataset", str(data), "--output_dir", str(out / "model"),
            "--results_dir", str(out), "--load_in_4bit", "--use_lora", "--lora_target_modules", "q_proj", "v_proj",
            "--target_epsilon", "8", "--expected_batch_size", "8", "--contribution_bound", "2", "--max_steps", "2",
            "--learning_rate", "5e-2", "--max_length", "32", "--bf16", "false", "--gradient_checkpointing", "false",
            "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]


def check_adapter_and_card(model_dir: Path) -> dict:
    """The adapter alone, its card naming the 4-bit base and passing the publish checks; it loads onto that base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_dp.workflows.tasks.chat_sft import nf4_config

    assert (model_dir / "adapter_config.json").is_file() and (model_dir / "adapter_model.safetensors").is_file()
    assert not (model_dir / "model.safetensors").exists()  # no merge into the 4-bit base
    card = (model_dir / "README.md").read_text()
    assert "quantized to 4-bit NF4 (bitsandbytes, double quantization)" in card and "PeftModel.from_pretrained" in card
    assert "library_name: peft" in card
    privacy = check_privacy_card(model_dir)
    base = json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, quantization_config=nf4_config()),
                                      model_dir)
    assert torch.isfinite(model(input_ids=torch.tensor([[5, 9, 12]])).logits).all()
    return privacy


@pytest.mark.slow
def test_the_recipe_trains_a_4bit_base_and_saves_the_adapter_with_its_card(chat_files, tmp_path, capsys):
    recipe = load_recipe()
    script_args, training_args = recipe.make_parser().parse_args_into_dataclasses(flags(chat_files, tmp_path))
    result = recipe.main(script_args, training_args)
    assert result["steps"] == 2 and 0 < result["epsilon"] <= 8.0 and result["config"]["load_in_4bit"] is True
    privacy = check_adapter_and_card(tmp_path / "model")
    assert privacy["epsilon"] == pytest.approx(result["epsilon"], rel=1e-2)


def test_load_in_4bit_without_lora_is_refused_in_one_line(chat_files, tmp_path, capsys):
    recipe = load_recipe()
    argv = [flag for flag in flags(chat_files, tmp_path) if flag != "--use_lora"]
    assert recipe.run_recipe(recipe.make_parser(), recipe.main, argv) == 2
    error = capsys.readouterr().err.strip()
    assert "load_in_4bit=True freezes the base in 4-bit NF4" in error and "--use_lora" in error
    assert len(error.splitlines()) == 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_the_recipe_runs_qlora_under_ddp_with_two_gloo_processes(chat_files, tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
               "--dynamo_backend", "no", str(ROOT / "recipes" / "sft.py"), *flags(chat_files, tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    run = json.loads((tmp_path / "model.json").read_text())
    assert run["steps"] == 2 and 0 < run["epsilon"] <= 8.0 and run["config"]["load_in_4bit"] is True
    privacy = check_adapter_and_card(tmp_path / "model")
    assert privacy["epsilon"] == pytest.approx(run["epsilon"], rel=1e-2)
