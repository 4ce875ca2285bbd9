"""hf_dp.workflows.tasks.chat_sft and recipes/sft.py: chat SFT runs (DPSFTTrainer or TRL's SFTTrainer) and their
completion perplexity beside the untouched model's.

The fast tests use a tiny Llama and a word-level tokenizer with a chat template built in code (no `{% generation %}`
marks: the rows are prompt/completion); the slow one runs the recipe on the real SmolLM2-135M-Instruct and a few
Shakespeare conversations.
"""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_dp.hub import check_privacy_card
from hf_dp.sft import DPSFTConfig, DPSFTTrainer
from hf_dp.workflows.run_results import RESULT_KEYS
from hf_dp.workflows.tasks.chat_sft import (
    METRIC_NAME,
    ChatSFTConfig,
    completion_perplexity,
    run_chat_sft,
    to_prompt_completion,
    tokenize_prompt_completion,
)
from hf_dp.workflows.tasks.language_modeling import TextData

WORDS = [f"w{i}" for i in range(30)]
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (  # ChatML-like, without generation marks, like SmolLM2's
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_chat_model(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0)
    return LlamaForCausalLM(config)


def conversations(users, seed: int = 0) -> Dataset:
    """1..4 conversations per user; each user replies with a run of consecutive words (learnable)."""
    rng = random.Random(seed)
    rows = {"messages": [], "user_id": []}
    for user in users:
        for _ in range(rng.randint(1, 4)):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
            start = rng.randrange(len(WORDS) - 6)
            reply = " ".join(WORDS[start:start + rng.randint(2, 6)])
            rows["messages"].append([{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}])
            rows["user_id"].append(user)
    return Dataset.from_dict(rows)


def chat_data() -> TextData:
    keep = dict(keep_columns=("user_id",))
    return TextData(train=to_prompt_completion(conversations([f"u{i}" for i in range(24)]), **keep),
                    test=to_prompt_completion(conversations([f"t{i}" for i in range(6)], seed=1), **keep),
                    dataset_name="toy-chat")


# ---- data ----------------------------------------------------------------------------------------------------------


def test_prompt_completion_rows_end_on_the_last_assistant_turn():
    system = {"role": "system", "content": "w0"}
    rows = Dataset.from_dict({
        "author": ["a", "b", "c", "d"],
        "chat": [
            [system, {"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"},
             {"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}],
            [{"role": "user", "content": "w5"}],  # no reply: dropped
            [{"role": "assistant", "content": "w6"}],  # nothing to reply to: dropped
            [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"},
             {"role": "user", "content": "w9"}],  # a trailing user turn is not part of the row
        ],
        "extra": [1, 2, 3, 4],
    })
    converted = to_prompt_completion(rows, messages_column="chat", keep_columns=("author",))
    assert sorted(converted.column_names) == ["author", "completion", "prompt"]
    assert converted["author"] == ["a", "d"]
    assert converted[0]["completion"] == [{"role": "assistant", "content": "w4"}]
    assert [m["content"] for m in converted[0]["prompt"]] == ["w0", "w1", "w2", "w3"]
    assert converted[1]["prompt"] == [{"role": "user", "content": "w7"}]
    with pytest.raises(ValueError, match="No conversations column 'messages'"):
        to_prompt_completion(rows)
    with pytest.raises(ValueError, match="Conversation 0 .'messages'. is a string, not a conversation"):
        to_prompt_completion(Dataset.from_dict({"messages": ["plain text"], "user_id": ["a"]}))


@pytest.mark.parametrize("bad, words", [
    ([{"role": "user", "content": "w1"}, {"role": "assistant", "content": None, "tool_calls": [{"f": 1}]}],
     "message with no content .a tool call"),
    ([{"content": "w1"}, {"role": "assistant", "content": "w2"}], "message 0, has no role"),
], ids=["tool-call", "no-role"])
def test_malformed_conversations_are_refused_naming_the_row_even_past_the_first_hundred(bad, words):
    good = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]
    rows = [good] * 150 + [bad]
    with pytest.raises(ValueError, match="^Conversation 150 .*" + words) as error:
        to_prompt_completion(Dataset.from_list([{"messages": m, "user_id": "a"} for m in rows]))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("max_length", [None, 9])
def test_evaluation_rows_are_tokenized_as_sft_trainer_prepares_training_rows(tmp_path, max_length):
    """The test rows' input_ids and labels (prompt masked, truncated, fully masked rows dropped) equal the rows
    DPSFTTrainer trains on, for the same conversations."""
    rows = chat_data().train
    args = DPSFTConfig(str(tmp_path), max_steps=1, expected_batch_size=8, target_epsilon=8.0, bf16=False,
                       gradient_checkpointing=False, report_to="none", use_cpu=True, max_length=max_length,
                       contribution_bound=4)
    trainer = DPSFTTrainer(model=tiny_chat_model(), args=args, train_dataset=rows, processing_class=chat_tokenizer())
    prepared = trainer.partition.dataset
    ours = tokenize_prompt_completion(rows, chat_tokenizer(), max_length=max_length)
    assert len(ours) == len(prepared) == len(rows)
    assert ours["input_ids"] == prepared["input_ids"] and ours["labels"] == prepared["labels"]
    assistant = chat_tokenizer().convert_tokens_to_ids("<|assistant|>")
    first = ours[0]
    reply = first["input_ids"].index(assistant) + 1
    assert all(label == -100 for label in first["labels"][:reply]) and first["labels"][reply] != -100


# ---- runs ----------------------------------------------------------------------------------------------------------


def untouched_perplexity(data: TextData, max_length: int) -> float:
    tokenizer = chat_tokenizer()
    test = tokenize_prompt_completion(data.test, tokenizer, max_length=max_length)
    return completion_perplexity(tiny_chat_model(), test, pad_token_id=tokenizer.pad_token_id)


@pytest.mark.parametrize("mechanism, use_lora", [("uls", True), ("els", False), ("non-private", False)])
def test_run_chat_sft_end_to_end(tmp_path, capsys, mechanism, use_lora):
    config = ChatSFTConfig(run=f"chat-{mechanism}", results_dir=str(tmp_path), model_name_or_path="tiny-chat",
                           use_lora=use_lora, lora_target_modules=["q_proj", "v_proj"], max_length=32,
                           progress=False)
    common = dict(max_steps=2, learning_rate=5e-2, use_cpu=True, gradient_checkpointing=False)
    if mechanism == "non-private":
        training_args = config.training_arguments(mechanism, per_device_train_batch_size=8, **common)
    else:
        training_args = config.training_arguments(mechanism, expected_batch_size=8, target_epsilon=8.0,
                                                  contribution_bound=3, **common)
    data = chat_data()
    result = run_chat_sft(config, training_args, model=tiny_chat_model(), tokenizer=chat_tokenizer(), data=data)
    plans = [line for line in capsys.readouterr().out.splitlines() if line.startswith("DP plan")]
    if mechanism == "non-private":
        assert plans == []
    else:  # printed once, before training: G, σ, q, steps, δ
        assert len(plans) == 1 and all(word in plans[0] for word in ("G = 3", "σ = ", "q = ", "2 steps", "δ = "))

    assert set(RESULT_KEYS) <= set(result)
    assert (result["task"], result["metric_name"], result["mechanism"], result["steps"]) == (
        "chat-sft", METRIC_NAME, mechanism, 2)
    # the public-only baseline is the untouched model's completion perplexity on the same test rows
    assert result["baseline_result"] == pytest.approx(untouched_perplexity(data, 32), rel=1e-5)
    assert result["eval_result"] != pytest.approx(result["baseline_result"], rel=1e-6)  # training moved it
    assert result["eval_nll"] == pytest.approx(math.log(result["eval_result"]))
    assert result["baseline_nll"] == pytest.approx(math.log(result["baseline_result"]))
    assert result["num_eval_tokens"] > result["num_eval_examples"] == len(data.test)
    assert (result["num_train_users"], result["num_train_examples"]) == (24, len(data.train))
    assert result["config"]["max_length"] == 32
    on_disk = json.loads((tmp_path / f"chat-{mechanism}.json").read_text())
    assert on_disk["eval_result"] == pytest.approx(result["eval_result"])

    model_dir = tmp_path / result["model_dir"]
    card = (model_dir / "README.md").read_text()
    assert METRIC_NAME in card and f"{result['baseline_result']:.4g}"[:4] in card
    if mechanism == "non-private":
        assert result["epsilon"] is None and result["privacy"] is None
        assert "non-private" in card
    else:
        assert 0 < result["epsilon"] <= 8.0 == result["config"]["target_epsilon"]
        assert result["privacy"]["mechanism"] == mechanism and result["config"]["contribution_bound"] == 3
        assert "SFTTrainer's training metrics" in card  # DPSFTTrainer's card
        assert check_privacy_card(model_dir)["epsilon"] == pytest.approx(result["epsilon"], rel=1e-2)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(model_dir)  # LoRA merged: a plain model
    assert not any("lora" in name for name, _ in reloaded.named_parameters())


def test_mismatched_or_plain_arguments_are_refused(tmp_path):
    from transformers import TrainingArguments

    config = ChatSFTConfig(run="r", results_dir=str(tmp_path), model_name_or_path="tiny-chat", progress=False)
    kwargs = dict(model=tiny_chat_model(), tokenizer=chat_tokenizer(), data=chat_data())
    with pytest.raises(TypeError, match="DPSFTConfig or SFTConfig"):
        run_chat_sft(config, TrainingArguments(str(tmp_path), report_to="none", use_cpu=True), **kwargs)
    with pytest.raises(ValueError, match="max_length"):
        run_chat_sft(config, config.training_arguments("uls", max_length=64, use_cpu=True), **kwargs)


def test_training_arguments_are_sft_configs_with_the_run_length():
    from trl import SFTConfig

    config = ChatSFTConfig(run="r", max_length=128)
    dp, plain = config.training_arguments("els", use_cpu=True), config.training_arguments("non-private")
    assert type(dp) is DPSFTConfig and type(plain) is SFTConfig
    assert (dp.max_length, plain.max_length, dp.mechanism, dp.learning_rate) == (128, 128, "els", 1e-3)
    with pytest.raises(ValueError, match="non-private run has no privacy settings"):
        config.training_arguments("non-private", target_epsilon=3.0)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_cpu_trains_in_bf16_only_where_the_cpu_multiplies_bf16_natively(monkeypatch, native):
    from hf_dp.workflows.tasks import chat_sft

    monkeypatch.setattr(chat_sft, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr("transformers.utils.is_torch_bf16_gpu_available", lambda: False)
    args = ChatSFTConfig(run="r", bf16_on_cpu=True).training_arguments("uls", target_epsilon=8.0)
    assert (args.bf16, args.use_cpu) == (native, native)
    plain = ChatSFTConfig(run="r").training_arguments("non-private")  # off by default: float32 on a CPU
    assert plain.bf16 is False
    chosen = ChatSFTConfig(run="r", bf16_on_cpu=True).training_arguments("non-private", bf16=False)
    assert chosen.bf16 is False  # an explicit choice wins


def test_the_non_private_loss_is_trl_s_completion_nll_without_its_fused_head(tmp_path):
    """ModelLossSFTTrainer computes TRL's default loss (mean NLL over the completion tokens) from the model's
    logits: the same value and the same gradient as TRL's own fused path on the same batch."""
    from trl import SFTConfig, SFTTrainer

    from hf_dp.workflows.tasks.chat_sft import model_loss_sft_trainer

    data = chat_data().train.select_columns(["prompt", "completion"])
    args = SFTConfig(str(tmp_path), max_length=24, report_to=[], use_cpu=True, per_device_train_batch_size=8,
                     gradient_checkpointing=False, bf16=False)
    values = []
    for trainer_class in (SFTTrainer, model_loss_sft_trainer()):
        model = tiny_chat_model()
        trainer = trainer_class(model=model, args=args, train_dataset=data, processing_class=chat_tokenizer())
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        values.append((loss.detach(), model.lm_head.weight.grad.clone()))
    assert values[0][0] == pytest.approx(values[1][0].item(), rel=1e-5)
    torch.testing.assert_close(values[0][1], values[1][1], rtol=1e-4, atol=1e-7)


# ---- the recipe ----------------------------------------------------------------------------------------------------


def load_recipe():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "recipes" / "sft.py"
    spec = importlib.util.spec_from_file_location("recipe_sft", path)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # dataclasses look their module up there
    spec.loader.exec_module(recipe)
    return recipe


def test_sft_recipe_parser_accepts_its_flags(tmp_path):
    script_args, training_args = load_recipe().make_parser().parse_args_into_dataclasses([
        "--model_name_or_path", "some/chat-model", "--output_dir", str(tmp_path / "out"), "--dataset", "chats.jsonl",
        "--user_id_column", "author", "--text_column", "chat", "--use_lora", "--lora_target_modules", "q_proj",
        "--max_length", "128", "--sampling", "els", "--contribution_bound", "8", "--target_epsilon", "3",
        "--max_train_users", "40", "--max_eval_examples", "20", "--bf16", "false", "--non_private",
    ])
    assert isinstance(training_args, DPSFTConfig) and training_args.max_length == 128
    assert (script_args.model_name_or_path, training_args.user_id_column, script_args.text_column) == (
        "some/chat-model", "author", "chat")
    assert script_args.use_lora and script_args.non_private and script_args.max_train_users == 40
    assert (training_args.sampling, training_args.contribution_bound, training_args.target_epsilon) == ("els", 8, 3.0)


def test_sft_recipe_main_runs_non_private_with_plain_sft_arguments(tmp_path, monkeypatch, capsys):
    """`--non_private`: the run gets TRL's plain SFTConfig (SFT fields kept, privacy fields gone, the unset DP
    micro-batch back to the default) and a run config with the flags' data, user column and max_length."""
    from trl import SFTConfig

    recipe = load_recipe()
    seen = {}

    def fake_run(config, training_args, data=None):
        seen.update(config=config, training_args=training_args)
        return {"run": config.run, "mechanism": "non-private", "epsilon": None, "delta": None, "eval_result": 12.0,
                "baseline_result": 20.0}

    monkeypatch.setattr(recipe, "run_chat_sft", fake_run)
    monkeypatch.setattr(recipe, "load_chat_data", lambda config: None)
    recipe.main(*recipe.make_parser().parse_args_into_dataclasses([
        "--model_name_or_path", "some/chat-model", "--output_dir", str(tmp_path / "chat-np"), "--dataset",
        "chats.jsonl", "--user_id_column", "author", "--max_length", "128", "--bf16", "false", "--non_private",
        "--max_eval_examples", "20", "--learning_rate", "2e-4", "--completion_only_loss", "true",
    ]))
    config, args = seen["config"], seen["training_args"]
    assert type(args) is SFTConfig and not hasattr(args, "target_epsilon")
    assert (args.max_length, args.completion_only_loss, args.learning_rate, args.per_device_train_batch_size) == (
        128, True, 2e-4, 8)
    assert (config.run, config.dataset, config.user_id_column, config.max_length, config.max_eval_examples) == (
        "chat-np", "chats.jsonl", "author", 128, 20)
    assert "completion perplexity 12; public-only baseline 20" in capsys.readouterr().out


@pytest.mark.parametrize("flags, content, match", [
    (["--max_length", "0"], None, "max_length=0: a conversation needs a token and the next one"),
    (["--packing", "true"], None, "packing=True: packed rows hold several users' examples"),
    ([], "", "has no rows"),
    ([], '{"user_id": 1, "messages": []}\n{"user_id": "2", "messages": []}\n', "holds values of several kinds"),
    (["--user_id_column", "author"], '{"user_id": "a", "messages": []}\n', "User column 'author' not found"),
], ids=["max-length-0", "packing", "empty-file", "mixed-ids", "no-user-column"])
def test_sft_recipe_refusals_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, flags, content, match):
    """`recipes/sft.py` prints `prog: error: <one line>` and exits 2 like the other recipes, before the model is
    fetched (bad data is read first)."""
    import hf_dp.workflows.pretrained

    recipe = load_recipe()

    def never():
        raise AssertionError("the model was fetched before the data was checked")

    monkeypatch.setattr(recipe, "smollm2_path", never)
    monkeypatch.setattr(hf_dp.workflows.pretrained, "smollm2_path", never)
    data = tmp_path / "chats.jsonl"
    if content is not None:
        data.write_text(content)
        flags = flags + ["--dataset", str(data)]
    try:  # a refused flag exits in argparse; refused data returns the status
        status = recipe.run_recipe(recipe.make_parser(), recipe.main, flags + [
            "--output_dir", str(tmp_path / "models" / "chat"), "--results_dir", str(tmp_path / "r"), "--report_to",
            "none", "--use_cpu", "true", "--bf16", "false"])
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert status == 2 and len(errors) == 1 and match in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "models").exists()


@pytest.mark.slow
def test_sft_recipe_on_shakespeare_with_a_model_given_by_path(tmp_path):
    """`recipes/sft.py`'s main on the Shakespeare chat data with a chat model loaded by path (a tiny Llama and its
    word-level tokenizer: the real SmolLM2 runs in the README's DPSFTTrainer example and the quick demo): 2 ULS steps
    with LoRA on 40 roles, evaluated on 12 held-out conversations, beside the untouched model's completion
    perplexity; every role keeps its conversations (a long one keeps its reply)."""
    model_dir = tmp_path / "tiny-chat"
    tiny_chat_model().save_pretrained(model_dir)
    chat_tokenizer().save_pretrained(model_dir)
    recipe = load_recipe()
    script_args, training_args = recipe.make_parser().parse_args_into_dataclasses([
        "--model_name_or_path", str(model_dir),
        "--output_dir", str(tmp_path / "models" / "sft-uls"), "--results_dir", str(tmp_path),
        "--max_train_users", "40", "--max_eval_examples", "12", "--sampling", "uls", "--target_epsilon", "8",
        "--expected_batch_size", "4", "--contribution_bound", "2", "--max_steps", "2", "--learning_rate", "1e-3",
        "--use_lora", "--lora_target_modules", "q_proj", "v_proj", "--max_length", "48", "--bf16", "false",
        "--use_cpu", "true", "--gradient_checkpointing", "false", "--disable_tqdm", "true",
        "--report_to", "none", "--per_device_eval_batch_size", "12",
    ])
    result = recipe.main(script_args, training_args)
    assert (result["mechanism"], result["metric_name"], result["steps"]) == ("uls", METRIC_NAME, 2)
    assert result["base_model"] == str(model_dir) and result["num_train_users"] == 40
    assert result["privacy"]["num_users"] == 40  # truncation_mode="keep_reply": no role loses its conversations
    assert 0 < result["epsilon"] <= 8.0 and result["num_eval_examples"] == 12
    assert 1 < result["baseline_result"] < 1000 and math.isfinite(result["eval_result"])
    saved = json.loads((tmp_path / "sft-uls.json").read_text())
    assert saved["config"]["max_length"] == 48 and saved["config"]["dataset"] == "shakespeare"
    assert check_privacy_card(tmp_path / "models" / "sft-uls")["epsilon"] == pytest.approx(result["epsilon"], rel=1e-2)
