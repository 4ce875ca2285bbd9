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


def conversations(num_users: int = 24, seed: int = 0, *, per_user=(1, 4), prompt_words=(2, 6),
                  reply_words=(2, 6)) -> Dataset:
    """Users with 1..4 conversations each (`per_user`): a user turn and the user's (assistant) reply, of 2..6 words
    each (`prompt_words`, `reply_words`)."""
    rng = random.Random(seed)
    rows = {"messages": [], "user_id": []}
    for user in range(num_users):
        for _ in range(rng.randint(*per_user)):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt_words)))
            reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*reply_words)))
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
    assert "pipeline_tag: text-generation" in card
    # a fixed noise_seed (the test's): the card is checked, and accepted only as carrying no guarantee
    checked = check_privacy_card(tmp_path / "out", no_guarantee=True)
    assert checked["epsilon"] == pytest.approx(report["epsilon"], rel=1e-2)


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


# ---- bad inputs: refused before TRL prepares anything, in one line -------------------------------------------------

GOOD = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]


def chats(bad, good=GOOD, users: int = 12) -> Dataset:
    """Two conversations per user, the second of user 0 replaced by `bad`."""
    rows = [good] * (2 * users)
    rows[1] = bad
    return Dataset.from_dict({"messages": rows, "user_id": [f"u{i // 2}" for i in range(2 * users)]})


@pytest.mark.parametrize("dataset, words", [
    (lambda: chats([{"role": "user", "content": "w1"}, {"role": "assistant", "content": None}]),
     r"row 1: 'messages', message 1 \(assistant\), has no content"),
    (lambda: chats([{"role": None, "content": "w1"}, {"role": "assistant", "content": "w2"}]),
     "row 1: 'messages', message 0, has no role"),
    (lambda: chats([]), "row 1: 'messages' is an empty list, not a conversation"),
    (lambda: Dataset.from_dict({"messages": [[{"role": "user", "content": 5}, {"role": "assistant", "content": 6}]]
                                * 4, "user_id": ["a", "a", "b", "c"]}), "has content of type int, not a string"),
    (lambda: Dataset.from_dict({"messages": ["w1 w2"] * 4, "user_id": list("abcd")}),
     "row 0: 'messages' is a string, not a conversation"),
    (lambda: Dataset.from_dict({"prompt": [[GOOD[0]]] * 4, "completion": [[GOOD[1]], [], [GOOD[1]], [GOOD[1]]],
                                "user_id": list("abcd")}), "row 1: 'completion' is an empty list"),
    (lambda: Dataset.from_dict({"prompt": ["w1"] * 4, "user_id": list("abcd")}), "no 'completion' column"),
    (lambda: Dataset.from_dict({"body": ["w1 w2"] * 4, "user_id": list("abcd")}), "no 'text' column, nor 'messages'"),
    (lambda: Dataset.from_dict({"text": ["w1 w2", None, "w3", "w4"], "user_id": list("abcd")}),
     "row 1: 'text' is None, not a string"),
    (lambda: conversations().to_iterable_dataset(), "streamed dataset .* materialise it"),
], ids=["content-none", "no-role", "empty-messages", "int-content", "messages-of-strings", "empty-completion",
        "prompt-alone", "no-text-field", "text-none", "iterable"])
def test_malformed_rows_are_refused_before_trl_reads_them(tmp_path, dataset, words):
    text = dataset().column_names is not None and "messages" not in dataset().column_names
    with pytest.raises((ValueError, TypeError), match=words) as error:
        trainer(tmp_path, dataset=dataset(), assistant_only_loss=not text)
    assert "\n" not in str(error.value)


def test_a_malformed_evaluation_row_is_refused_too(tmp_path):
    with pytest.raises(ValueError, match="^eval_dataset row 1: 'messages' is an empty list"):
        DPSFTTrainer(model=tiny_chat_model(), args=config(tmp_path), train_dataset=conversations(),
                     eval_dataset=chats([], users=2).map(lambda row: {"user_id": "held-out-" + row["user_id"]}),
                     processing_class=chat_tokenizer())


@pytest.mark.parametrize("overrides, words", [
    ({"max_length": 1}, "max_length=1: a conversation needs a token and the next one"),
    ({"max_length": 0}, "max_length=0"),
    ({"max_length": -5}, "max_length=-5"),
    ({"padding_free": True, "max_length": 64}, "padding_free=True with max_length=64: TRL does not truncate"),
], ids=["one", "zero", "negative", "padding-free-with-length"])
def test_lengths_that_leave_nothing_to_learn_are_refused(tmp_path, overrides, words):
    with pytest.raises(ValueError, match=words) as error:
        config(tmp_path, **overrides)
    assert "\n" not in str(error.value) and "packing=True" not in str(error.value)


def test_a_length_that_cuts_every_reply_names_max_length_not_the_user_column(tmp_path):
    """TRL's keep_start cut (keep_reply keeps every reply: tests/test_sft_truncation.py)."""
    with pytest.raises(ValueError, match="left none of the .* training rows: .* max_length=3") as error:
        trainer(tmp_path, max_length=3, truncation_mode="keep_start")
    assert "user_id" not in str(error.value)


def test_conversations_without_an_assistant_turn_are_dropped_under_assistant_only_loss(tmp_path, caplog):
    import logging

    data = chats([{"role": "user", "content": "w1"}], users=12)
    with caplog.at_level(logging.WARNING, logger="hf_dp.sft"):
        sft = trainer(tmp_path, dataset=data, expected_batch_size=4)
    assert sft.partition.num_examples == len(data) - 1 and "Dropping 1 of the 24 conversations" in caplog.text


def test_conversations_none_of_which_has_an_assistant_turn_are_refused_in_one_line(tmp_path):
    """Every row dropped under assistant_only_loss: one line naming why, not TRL's StopIteration on no rows."""
    system_only = Dataset.from_dict({"messages": [[{"role": "system", "content": "w1 w2"}]] * 24,
                                     "user_id": [f"u{i // 2}" for i in range(24)]})
    with pytest.raises(ValueError, match=r"No conversation of train_dataset has an assistant turn \(e.g. row 0: "
                                         r"\['system'\]\).*set assistant_only_loss=False") as error:
        trainer(tmp_path, dataset=system_only, expected_batch_size=4)
    assert "\n" not in str(error.value)


def test_assistant_only_loss_without_generation_marks_is_refused_up_front(tmp_path):
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    with pytest.raises(ValueError, match="no {% generation %} marks"):
        DPSFTTrainer(model=tiny_chat_model(), args=config(tmp_path), train_dataset=conversations(),
                     processing_class=tokenizer)


def test_a_chat_template_error_is_one_line(tmp_path):
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                               "{% endif %}{% endfor %}" + CHAT_TEMPLATE)
    data = chats([{"role": "tool", "content": "w1"}, {"role": "assistant", "content": "w2"}])
    with pytest.raises(ValueError, match="chat template failed on a training or evaluation row .*no tools") as error:
        DPSFTTrainer(model=tiny_chat_model(), args=config(tmp_path), train_dataset=data, processing_class=tokenizer)
    assert "\n" not in str(error.value)


def test_no_processing_class_for_a_model_without_a_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="processing_class=None, and the model has no name or path"):
        DPSFTTrainer(model=tiny_chat_model(), args=config(tmp_path), train_dataset=conversations())


def test_the_default_config_uses_the_new_checkpointing_names(tmp_path):
    import warnings

    from hf_dp.sft import ACTIVATION_CHECKPOINTING

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = DPSFTConfig(str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    assert args.gradient_checkpointing is True  # SFTConfig's default, kept
    if ACTIVATION_CHECKPOINTING:
        assert args.activation_checkpointing is True
        assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
    off = config(tmp_path, gradient_checkpointing=False)  # the deprecated name still works
    assert off.gradient_checkpointing is False


# ---- the bound before TRL's preparation ------------------------------------------------------------------------------


def heavy_user_conversations() -> Dataset:
    """24 users, one of them with 40 conversations."""
    data = conversations()
    heavy = Dataset.from_dict({"messages": [GOOD] * 40, "user_id": ["heavy"] * 40})
    from datasets import concatenate_datasets

    return concatenate_datasets([data, heavy])


def test_rows_beyond_the_bound_are_not_prepared(tmp_path, monkeypatch):
    from trl import SFTTrainer

    prepared = []
    original = SFTTrainer._prepare_dataset

    def spy(self, dataset, *rest):
        prepared.append((rest[-1], len(dataset)))
        return original(self, dataset, *rest)

    monkeypatch.setattr(SFTTrainer, "_prepare_dataset", spy)
    data = heavy_user_conversations()
    counts = {user: data["user_id"].count(user) for user in set(data["user_id"])}
    sft = trainer(tmp_path, dataset=data, contribution_bound=2)
    assert max(counts.values()) > 8  # a heavy user: 4·G = 8 rows prepared (spares for rows TRL drops), not all
    assert prepared == [("train", sum(min(n, 4 * 2) for n in counts.values()))]
    assert sft.partition.num_examples == sum(min(n, 2) for n in counts.values())
    assert max(len(r) for r in sft.partition.user_rows) == 2
    prepared.clear()
    trainer(tmp_path, dataset=data, contribution_bound="auto")  # capped at G's largest value: nothing cut here
    assert prepared == [("train", len(data))]
    prepared.clear()
    trainer(tmp_path, dataset=data, privacy_unit="example", contribution_bound=None)
    assert prepared == [("train", len(data))]
    prepared.clear()
    redrawn = trainer(tmp_path, dataset=data, contribution_bound=2, redraw_rows=True)  # each step draws among all
    assert prepared == [("train", len(data))] and redrawn.partition.num_examples == len(data)
    assert redrawn.partition.redraw.bound == 2


def test_a_resume_with_another_data_secret_prepares_the_checkpoints_rows(tmp_path):
    """Each construction draws a fresh data secret; resuming from a checkpoint trains on the rows its secret chose."""
    data = heavy_user_conversations()
    first = trainer(tmp_path, dataset=data, contribution_bound=2, noise_seed=None, max_steps=2, save_strategy="steps",
                    save_steps=1)
    first.train()
    resumed = trainer(tmp_path, dataset=data, contribution_bound=2, noise_seed=None, max_steps=2)
    assert resumed._data_secret != first._data_secret
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert resumed._data_secret == first._data_secret
    assert resumed.partition.dataset["input_ids"] == first.partition.dataset["input_ids"]
    assert resumed.accountant.steps == 2


def test_dict_user_ids_are_refused_before_trl_prepares_the_rows(tmp_path):
    data = conversations().map(lambda row: {"user_id": {"id": row["user_id"]}})
    with pytest.raises(ValueError, match="user_id_column 'user_id' holds dicts .* a user id must be one value"):
        trainer(tmp_path, dataset=data, contribution_bound=2)


def test_text_and_prompt_completion_rows_are_checked_in_arrow_as_row_by_row(tmp_path, monkeypatch):
    """Good string columns pass without the row walk (it is made to fail here); a missing text or an empty
    completion goes to the row walk, which names the row; a selection that leaves the bad row out passes."""
    from hf_dp import sft

    args = config(tmp_path)
    text = Dataset.from_dict({"text": ["w1 w2", None, "w3"] * 2, "user_id": list("abcabc")})
    pairs = Dataset.from_dict({"prompt": ["w1"] * 4, "completion": ["w2", "", "w3", "w4"], "user_id": list("abcd")})
    with pytest.raises(ValueError, match="row 1: 'text' is None, not a string"):
        sft.prepare_rows(text, args, None, "train_dataset")
    with pytest.raises(ValueError, match="row 1: the completion is an empty string"):
        sft.prepare_rows(pairs, args, None, "train_dataset")
    assert not sft._strings_pass(text.select([2, 1]), ["text"])
    monkeypatch.setattr(Dataset, "select_columns", lambda *a, **k: pytest.fail("the rows were walked"))
    for good, fields in ((text.select([0, 2, 5]), ["text"]), (pairs.select([3, 0, 2]), ["prompt", "completion"])):
        assert sft._strings_pass(good, fields)
        assert sft.prepare_rows(good, args, None, "train_dataset") is good
