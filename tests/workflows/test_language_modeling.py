"""Causal-LM runs on tiny config-built models and a word-level tokenizer built in code (offline)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_dp.workflows.tasks.language_modeling import (
    CausalLMCollator,
    LanguageModelingConfig,
    TextData,
    load_text_data,
    perplexity,
    run_language_modeling,
    run_public_baseline,
    tokenize_causal_lm,
)
from hf_dp.workflows.run_results import RESULT_KEYS

WORDS = ("the king my lord love death night sweet fair speak good come war crown blood jest fool wed "
         "grave sword heaven").split()


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer made in code: never from the Hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


def tiny_lm(arch: str):
    torch.manual_seed(0)
    vocab = len(WORDS) + 3
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                          bos_token_id=2, eos_token_id=2, pad_token_id=0))
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                        pad_token_id=0, eos_token_id=2, bos_token_id=2))


def text_data(num_users: int = 30, seed: int = 0) -> TextData:
    """Users who repeat a favourite word pattern: learnable, so fine-tuning lowers perplexity."""
    import random

    rng = random.Random(seed)

    def rows(users):
        out = {"user_id": [], "text": []}
        for user in users:
            for _ in range(rng.randint(1, 5)):
                start = rng.randrange(len(WORDS) - 4)
                out["user_id"].append(user)
                out["text"].append(" ".join(WORDS[start:start + rng.randint(3, 6)]))
        return Dataset.from_dict(out)

    return TextData(train=rows([f"u{i}" for i in range(num_users)]),
                    test=rows([f"t{i}" for i in range(8)]), dataset_name="toy")


def test_tokenize_appends_eos_and_copies_labels():
    tokenizer = word_tokenizer()
    data = Dataset.from_dict({"user_id": ["a", "b"], "text": ["the king", "sweet fair speak good come war"]})
    tokenized = tokenize_causal_lm(data, tokenizer, max_length=4)
    assert tokenized.column_names == ["user_id", "input_ids", "labels"]
    first, second = tokenized["input_ids"]
    assert first[-1] == tokenizer.eos_token_id and len(first) == 3
    assert len(second) == 4 and second[-1] == tokenizer.eos_token_id  # truncated, EOS kept
    assert tokenized["labels"] == tokenized["input_ids"]


def test_collator_masks_padding_with_minus_100():
    batch = CausalLMCollator(pad_token_id=0)([{"input_ids": [5, 6, 2], "labels": [5, 6, 2]},
                                              {"input_ids": [7, 2], "labels": [7, 2]}])
    assert batch["input_ids"].tolist() == [[5, 6, 2], [7, 2, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[5, 6, 2], [7, 2, -100]]


def test_perplexity_of_uniform_model_is_vocab_size():
    class Uniform(torch.nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.vocab, self.dummy = vocab, torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask=None):
            from types import SimpleNamespace

            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab))

    data = Dataset.from_dict({"input_ids": [[3, 4, 2], [5, 2]], "labels": [[3, 4, 2], [5, 2]]})
    assert perplexity(Uniform(11), data, CausalLMCollator(0), batch_size=1) == pytest.approx(11.0)


@pytest.mark.parametrize("arch,mechanism,use_lora", [
    ("gpt2", "uls", True),
    ("llama", "els", False),
    ("llama", "example", True),
    ("gpt2", "non-private", False),
])
def test_run_language_modeling_end_to_end(tmp_path, arch, mechanism, use_lora):
    config = LanguageModelingConfig(
        run=f"{arch}-{mechanism}", results_dir=str(tmp_path), model_name_or_path=f"tiny-{arch}",
        use_lora=use_lora, lora_target_modules=["c_attn"] if arch == "gpt2" else ["q_proj", "v_proj"], progress=False,
    )
    if mechanism == "non-private":
        training_args = config.training_arguments(mechanism, max_steps=4, per_device_train_batch_size=8,
                                                  learning_rate=5e-2)
    else:
        bound = {} if mechanism == "example" else {"contribution_bound": 3}
        training_args = config.training_arguments(mechanism, expected_batch_size=8, max_steps=4, target_epsilon=8.0,
                                                  per_device_train_batch_size=8, learning_rate=5e-2, noise_seed=0,
                                                  **bound)
    result = run_language_modeling(config, training_args, model=tiny_lm(arch), tokenizer=word_tokenizer(),
                                   data=text_data())
    assert set(RESULT_KEYS) <= set(result)
    assert result["task"] == "causal-lm" and result["metric_name"] == "perplexity"
    assert result["mechanism"] == mechanism and result["steps"] == 4
    assert math.isfinite(result["eval_result"]) and math.isfinite(result["baseline_result"])
    if mechanism == "non-private":
        assert result["epsilon"] is None and result["privacy"] is None
        assert result["eval_result"] < result["baseline_result"]  # 4 plain steps at a high LR learn the toy data
    else:
        assert 0 < result["epsilon"] <= 8.0 == result["config"]["target_epsilon"]
        assert result["privacy"]["mechanism"] == mechanism
        assert result["config"]["expected_batch_size"] == 8
    on_disk = json.loads((tmp_path / f"{arch}-{mechanism}.json").read_text())
    assert on_disk["eval_result"] == pytest.approx(result["eval_result"])
    model_dir = tmp_path / result["model_dir"]
    assert (model_dir / "README.md").is_file() and (model_dir / "config.json").is_file()
    card = (model_dir / "README.md").read_text()
    assert "perplexity" in card
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(model_dir)  # LoRA merged: a plain model
    assert not any("lora" in name for name, _ in reloaded.named_parameters())


def test_public_baseline_is_the_untouched_models_perplexity(tmp_path):
    """The baseline run writes a result with the schema of the fine-tuning runs: ε = 0, no model of its own, and
    the same perplexity as a fine-tuning run's baseline on the same test rows."""
    config = LanguageModelingConfig(run="baseline", results_dir=str(tmp_path), model_name_or_path="tiny-llama",
                                    lora_target_modules=["q_proj", "v_proj"], progress=False)
    data = text_data()
    result = run_public_baseline(config, model=tiny_lm("llama"), tokenizer=word_tokenizer(), data=data)
    assert set(RESULT_KEYS) <= set(result)
    assert (result["mechanism"], result["epsilon"], result["delta"], result["model_dir"]) == ("public-only", 0.0,
                                                                                                0.0, None)
    assert result["eval_result"] == result["baseline_result"] and result["train_seconds"] == 0.0
    assert result["eval_nll"] == pytest.approx(math.log(result["eval_result"]))
    assert result["num_eval_tokens"] > result["num_eval_examples"] > 0
    assert json.loads((tmp_path / "baseline.json").read_text())["eval_result"] == pytest.approx(result["eval_result"])
    dp = LanguageModelingConfig(run="uls", results_dir=str(tmp_path), model_name_or_path="tiny-llama",
                                lora_target_modules=["q_proj", "v_proj"], progress=False)
    trained = run_language_modeling(dp, dp.training_arguments("uls", expected_batch_size=8, max_steps=1,
                                                              contribution_bound=1, noise_seed=0),
                                    model=tiny_lm("llama"), tokenizer=word_tokenizer(), data=data)
    assert trained["baseline_result"] == pytest.approx(result["eval_result"], rel=1e-5)  # LoRA starts as the model
    assert trained["baseline_nll"] == pytest.approx(result["eval_nll"], rel=1e-5)


def test_exclude_train_plays_keeps_those_roles_out_of_training(tmp_path):
    rows = [{"user_id": f"{play}::{who}", "text": "the king", "play": play}
            for play in ("Hamlet", "Macbeth", "Othello") for who in ("A", "B")]
    with open(tmp_path / "train.jsonl", "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    with open(tmp_path / "test.jsonl", "w") as handle:
        handle.write(json.dumps({"user_id": "Lear::C", "text": "good night", "play": "Lear"}) + "\n")
    files = dict(dataset=str(tmp_path / "train.jsonl"), eval_dataset=str(tmp_path / "test.jsonl"))
    data = load_text_data(LanguageModelingConfig(run="r", exclude_train_plays=["Macbeth"], **files))
    assert sorted(set(data.train["play"])) == ["Hamlet", "Othello"] and len(data.train) == 4
    assert len(load_text_data(LanguageModelingConfig(run="r", **files)).train) == 6
    with pytest.raises(ValueError, match="not training plays"):
        load_text_data(LanguageModelingConfig(run="r", exclude_train_plays=["Lear"], **files))
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"user_id": "a", "text": "the king"}) + "\n" + json.dumps({"user_id": "b", "text":
                                                                                          "fair"}) + "\n")
    with pytest.raises(ValueError, match="play"):
        load_text_data(LanguageModelingConfig(run="r", dataset=str(plain), exclude_train_plays=["Hamlet"]))


def test_language_modeling_defaults_are_optimisation_only():
    """The LM config changes learning-rate defaults, never a privacy default (those are DPTrainingArguments')."""
    from hf_dp import DPTrainingArguments

    config = LanguageModelingConfig(run="lm")
    dp, plain = config.training_arguments("uls"), config.training_arguments("non-private")
    assert (dp.learning_rate, plain.learning_rate) == (1e-3, 2e-4)
    defaults = DPTrainingArguments(output_dir="unused")
    for field in ("target_epsilon", "expected_batch_size", "contribution_bound", "max_grad_norm", "target_delta"):
        assert getattr(dp, field) == getattr(defaults, field), field


def test_causal_lm_recipe_parser_accepts_its_flags(tmp_path):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "recipes" / "causal_lm.py"
    spec = importlib.util.spec_from_file_location("recipe_causal_lm", path)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # dataclasses look their module up there
    spec.loader.exec_module(recipe)
    script_args, training_args = recipe.make_parser().parse_args_into_dataclasses([
        "--model_name_or_path", "some/lm", "--output_dir", str(tmp_path / "out"), "--dataset", "chats.jsonl",
        "--user_id_column", "author", "--text_column", "message", "--use_lora", "--lora_target_modules", "q_proj",
        "--max_length", "128", "--sampling", "els", "--contribution_bound", "8", "--target_epsilon", "3",
        "--non_private",
    ])
    assert (script_args.model_name_or_path, training_args.user_id_column, script_args.text_column) == (
        "some/lm", "author", "message")
    assert script_args.use_lora and script_args.non_private and script_args.max_length == 128
    assert (training_args.sampling, training_args.contribution_bound, training_args.target_epsilon) == ("els", 8, 3.0)


@pytest.mark.slow
def test_causal_lm_recipe_runs_on_a_saved_tiny_model(tmp_path):
    """The recipe end to end (`python recipes/causal_lm.py ...`) on a tiny Llama saved to disk with its tokenizer."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    model_dir = tmp_path / "tiny-llama"
    tiny_lm("llama").save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    data = text_data()
    data.train.to_json(str(tmp_path / "train.jsonl"))
    data.test.to_json(str(tmp_path / "test.jsonl"))
    root = Path(__file__).resolve().parents[2]
    command = [
        sys.executable, str(root / "recipes" / "causal_lm.py"), "--model_name_or_path", str(model_dir),
        "--dataset", str(tmp_path / "train.jsonl"), "--eval_dataset", str(tmp_path / "test.jsonl"),
        "--output_dir", str(tmp_path / "models" / "lm-uls"), "--results_dir", str(tmp_path),
        "--sampling", "uls", "--target_epsilon", "8", "--expected_batch_size", "8", "--contribution_bound", "2",
        "--max_steps", "3", "--learning_rate", "1e-2", "--use_lora", "--lora_target_modules", "q_proj", "v_proj",
        "--max_length", "16", "--noise_seed", "0", "--disable_tqdm", "true", "--report_to", "none",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    result = json.loads((tmp_path / "lm-uls.json").read_text())
    assert result["mechanism"] == "uls" and result["metric_name"] == "perplexity" and result["steps"] == 3
    assert math.isfinite(result["eval_result"]) and result["privacy"]["num_users"] == 30
    assert (result["config"]["target_epsilon"], result["config"]["contribution_bound"]) == (8.0, 2)
    assert "perplexity" in completed.stdout


# ---- bad inputs ------------------------------------------------------------------------------------------


def _causal_recipe():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "recipes" / "causal_lm.py"
    spec = importlib.util.spec_from_file_location("recipe_causal_lm", path)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # dataclasses look their module up there
    spec.loader.exec_module(recipe)
    return recipe


def test_max_length_below_two_is_refused():
    """A text needs a token and its successor: max_length 1 would leave no next-token target."""
    with pytest.raises(ValueError, match="^max_length=1: use a whole number >= 2"):
        LanguageModelingConfig(run="x", max_length=1)
    with pytest.raises(ValueError, match="--max_length 1: use a whole number >= 2"):
        _causal_recipe().make_parser().parse_args_into_dataclasses(["--output_dir", "unused", "--max_length", "1"])


@pytest.mark.parametrize("content, match", [
    ("", "has no rows"),
    ('{"user_id": "a", "text": null}\n{"user_id": "b", "text": "war"}\n', "1 of 2 rows have no text"),
])
def test_causal_lm_recipe_refuses_bad_data_before_fetching_the_model(tmp_path, capsys, monkeypatch, content, match):
    import hf_dp.workflows.pretrained

    recipe = _causal_recipe()

    def never():
        raise AssertionError("the model was fetched before the data was checked")

    monkeypatch.setattr(recipe, "smollm2_path", never)
    monkeypatch.setattr(hf_dp.workflows.pretrained, "smollm2_path", never)
    data = tmp_path / "chats.jsonl"
    data.write_text(content)
    status = recipe.run_recipe(recipe.make_parser(), recipe.main, [
        "--dataset", str(data), "--output_dir", str(tmp_path / "models" / "lm"), "--results_dir", str(tmp_path / "r"),
        "--report_to", "none", "--use_cpu", "true"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert status == 2 and len(errors) == 1 and match in errors[0] and "dataset=" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]  # nothing trained, nothing written


def test_a_sample_of_the_users_is_stated_by_a_causal_lm_run(tmp_path):
    from hf_dp.workflows.run_data import user_sample_statement

    data = text_data()
    path = tmp_path / "train.jsonl"
    data.train.to_json(str(path))
    config = LanguageModelingConfig(run="lm-sampled", results_dir=str(tmp_path), dataset=str(path),
                                    eval_dataset=None, max_train_users=10, max_length=16, use_lora=False,
                                    progress=False, baseline_result=10.0)
    loaded = load_text_data(config)
    assert loaded.not_covered == [user_sample_statement(10)] and len(set(loaded.train["user_id"])) == 10
    training = config.training_arguments("uls", target_epsilon=8.0, expected_batch_size=4, contribution_bound=2,
                                         max_steps=1, per_device_train_batch_size=8, noise_seed=0)
    result = run_language_modeling(config, training, model=tiny_lm("gpt2"), tokenizer=word_tokenizer(), data=loaded)
    assert result["not_covered"] == [user_sample_statement(10)]
    card = (tmp_path / result["model_dir"] / "README.md").read_text()
    assert "fixed-size sample of 10 of the available users" in card
