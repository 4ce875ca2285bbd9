"""hf_dp.sft: DPSFTTrainer (TRL's SFTTrainer with user-level DP) on chat data, one user per conversation's author.

A tiny Llama and a word-level tokenizer with a chat template that marks assistant turns ({% generation %}), built in
code: TRL's own data preparation (chat template, assistant masks) runs unchanged.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from clipping_oracle import check_against_oracle
from datasets import Dataset
from tiny_models import per_example_loss
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_dp.hub import check_privacy_card
from hf_dp.sft import SFT_TRAINING_METRICS, DPSFTConfig, DPSFTTrainer

WORDS = [f"w{i}" for i in range(30)]
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} <|end|> "
    "{% else %}<|assistant|> {% generation %}{{ m['content'] }} <|end|>{% endgeneration %} {% endif %}{% endfor %}"
)


def chat_tokenizer():
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_chat_model(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0)
    return LlamaForCausalLM(config).to(dtype)


def conversations(num_users: int = 24, seed: int = 0) -> Dataset:
    """Users with 1..4 conversations each: a user turn and the user's (assistant) reply."""
    rng = random.Random(seed)
    rows = {"messages": [], "user_id": []}
    for user in range(num_users):
        for _ in range(rng.randint(1, 4)):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
            reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
            rows["messages"].append([{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}])
            rows["user_id"].append(f"user-{user}")
    return Dataset.from_dict(rows)


def config(tmp_path, **overrides) -> DPSFTConfig:
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=2, expected_batch_size=8, target_epsilon=8.0,
                    noise_seed=7, assistant_only_loss=True, bf16=False, gradient_checkpointing=False,
                    learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
                    save_strategy="no")
    settings.update(overrides)
    return DPSFTConfig(**settings)


def trainer(tmp_path, model=None, dataset=None, **overrides) -> DPSFTTrainer:
    return DPSFTTrainer(model=model if model is not None else tiny_chat_model(), args=config(tmp_path, **overrides),
                        train_dataset=dataset if dataset is not None else conversations(),
                        processing_class=chat_tokenizer())


# ---- training ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", ["uls", "els"])
def test_dp_sft_trains_with_the_ledger_card_and_no_batch_metrics(tmp_path, sampling):
    sft = trainer(tmp_path, sampling=sampling, contribution_bound=3)
    before = {name: p.detach().clone() for name, p in sft.model.named_parameters()}
    sft.train()
    report = sft.privacy_report()
    assert sft.accountant.steps == 2 and 0 < report["epsilon"] <= 8.0
    assert (report["mechanism"], report["privacy_unit"]) == (sampling, "user")
    assert any(not torch.equal(before[name], p) for name, p in sft.model.named_parameters())
    keys = set().union(*(entry.keys() for entry in sft.state.log_history))
    assert "dp/epsilon" in keys and not keys & set(SFT_TRAINING_METRICS)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "user-level" in card and "SFTTrainer's training metrics" in card  # the privacy card, not TRL's
    assert check_privacy_card(tmp_path / "out")["epsilon"] == pytest.approx(report["epsilon"], rel=1e-2)


def test_example_level_and_padding_free_train(tmp_path):
    sft = trainer(tmp_path, privacy_unit="example", contribution_bound=None, padding_free=True, max_length=None)
    sft.train()
    assert sft.privacy_report()["mechanism"] == "example" and sft.accountant.steps == 2


def test_lora_through_peft_config(tmp_path):
    from peft import LoraConfig

    sft = DPSFTTrainer(model=tiny_chat_model(), args=config(tmp_path), train_dataset=conversations(),
                       processing_class=chat_tokenizer(),
                       peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainable = [name for name, p in sft.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    sft.train()
    assert sft.accountant.steps == 2


# ---- per-example losses under SFT's masks ---------------------------------------------------------------------------


def test_assistant_only_labels_and_exact_unit_norms(tmp_path):
    """TRL's prepared rows keep only assistant tokens in the labels; the clipped per-user gradients of a micro-batch
    equal torch.func's per-example gradients of the masked losses, summed per user, clipped."""
    sft = trainer(tmp_path, model=tiny_chat_model(dtype=torch.float64))
    rows = sft.partition.dataset
    tokenizer = chat_tokenizer()
    assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")
    for row in rows.select(range(5)):
        start = row["input_ids"].index(assistant) + 1
        assert all(label == -100 for label in row["labels"][:start])  # the user turn is masked
        assert all(label != -100 for label in row["labels"][start:])  # the reply is learned
    picked = [int(r) for user_rows in sft.partition.user_rows[:4] for r in user_rows]
    batch = sft.data_collator([rows[i] for i in picked])
    unit_ids = torch.tensor([int(sft.partition.row_user[i]) for i in picked])
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    sft.clipper.detach()  # the oracle check attaches its own clipper
    check_against_oracle(sft.model, inputs, batch["labels"],
                         lambda output, labels: per_example_loss(output.logits, labels, "causal_lm"), unit_ids)


# ---- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, words", [
    ({"packing": True}, "packing=True: packed rows hold several users' examples"),
    ({"loss_type": "dft"}, "loss_type='dft'"),
    ({"use_liger_kernel": True}, "use_liger_kernel=True"),
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, "use_reentrant"),
    ({"activation_offloading": True}, "activation_offloading=True"),
], ids=["packing", "dft-loss", "liger", "accumulation", "reentrant", "offloading"])
def test_settings_that_break_dp_are_refused_in_one_line(tmp_path, overrides, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")) as error:
        config(tmp_path, **overrides)
    assert "\n" not in str(error.value)


def test_plain_sft_arguments_and_missing_or_dropped_user_columns_are_refused(tmp_path):
    from trl import SFTConfig

    with pytest.raises(TypeError, match="DPSFTConfig"):
        DPSFTTrainer(model=tiny_chat_model(), args=SFTConfig(str(tmp_path), report_to="none", use_cpu=True),
                     train_dataset=conversations(), processing_class=chat_tokenizer())
    with pytest.raises(ValueError, match="no user column 'user_id'"):
        trainer(tmp_path, dataset=conversations().remove_columns("user_id"))
    prepared = conversations().map(lambda row: {"input_ids": [4, 8, 9], "labels": [-100, 8, 9]},
                                   remove_columns=["messages", "user_id"])
    with pytest.raises(ValueError, match="no user column"):
        trainer(tmp_path, dataset=prepared)


def test_the_config_round_trips_through_json(tmp_path):
    args = config(tmp_path, sampling="els", contribution_bound=4)
    state = json.loads(args.to_json_string())
    assert (state["sampling"], state["contribution_bound"], state["assistant_only_loss"]) == ("els", 4, True)
