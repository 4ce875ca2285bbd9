"""hf_dp.sft_truncation: a chat row longer than max_length keeps its labelled reply and loses its context's start.

Checked on the cut itself (every length, every reply position) and through DPSFTTrainer's preparation, whose rows
are compared with TRL's untruncated rows; `tokenize_prompt_completion` (the study's test rows) cuts the same way.
"""

from __future__ import annotations

import logging

import pytest
from datasets import Dataset
from test_sft import chat_tokenizer, config, conversations, tiny_chat_model

from hf_dp.sft import DPSFTConfig, DPSFTTrainer
from hf_dp.sft_truncation import keep_reply, reply_window

IGNORE = -100


def test_the_cut_keeps_the_reply_and_the_token_before_it_for_every_length():
    for prompt in range(0, 9):
        for reply in range(1, 9):
            ids = list(range(prompt + reply))
            labels = [IGNORE] * prompt + ids[prompt:]
            for max_length in range(2, prompt + reply + 2):
                kept_ids, kept_labels = keep_reply(ids, labels, max_length)
                assert len(kept_ids) == min(max_length, len(ids)) and kept_ids == ids[reply_window(labels, max_length)]
                assert kept_ids == list(range(kept_ids[0], kept_ids[0] + len(kept_ids)))  # one contiguous window
                learned = [label for label in kept_labels[1:] if label != IGNORE]
                # the reply's start is kept, with as much of the reply as fits after one token of context
                assert learned == (ids[prompt:][:max_length - 1] if prompt else ids[1:max_length])
                if len(ids) > max_length and prompt > 0:
                    assert kept_ids[0] == min(len(ids) - max_length, prompt - 1)  # context's start goes first


def long_prompt_conversations() -> Dataset:
    """12 users with 2 conversations each, prompts of 8 to 14 words, replies of 2 to 4: at max_length=12, TRL's
    keep_start cuts most replies."""
    return conversations(12, per_user=(2, 2), prompt_words=(8, 14), reply_words=(2, 4))


def _trainer(tmp_path, **overrides) -> DPSFTTrainer:
    return DPSFTTrainer(model=tiny_chat_model(), args=config(tmp_path, expected_batch_size=4, **overrides),
                        train_dataset=long_prompt_conversations(), processing_class=chat_tokenizer())


def test_dpsft_keeps_every_row_and_its_reply_and_says_how_many_were_cut_once(tmp_path, caplog):
    data = long_prompt_conversations()
    with caplog.at_level(logging.WARNING):
        sft = _trainer(tmp_path, max_length=12)
        full = _trainer(tmp_path / "full", max_length=None)
    assert DPSFTConfig("x", target_epsilon=8.0, expected_batch_size=4, use_cpu=True).truncation_mode == "keep_reply"
    assert sft.partition.num_examples == len(data) == full.partition.num_examples
    cut = [line for line in caplog.text.splitlines() if "lost the start of its context" in line]
    assert len(cut) == 1 and f"{len(data)} of the {len(data)} train rows were longer than max_length=12" in cut[0]
    for short, whole in zip(sft._user_dataset, full._user_dataset):
        assert len(short["input_ids"]) == 12
        reply = [token for token, label in zip(whole["input_ids"], whole["labels"]) if label != IGNORE]
        window = reply_window(whole["labels"], 12)
        assert short["input_ids"] == whole["input_ids"][window] and short["labels"] == whole["labels"][window]
        learned = [token for token, label in zip(short["input_ids"], short["labels"]) if label != IGNORE]
        assert learned == reply[:len(learned)] and len(learned) == min(len(reply), 11)


def test_trls_keep_start_still_drops_the_rows_it_cut_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_dp.sft"):
        sft = _trainer(tmp_path, max_length=16, truncation_mode="keep_start")
    assert 0 < sft.partition.num_examples < 24 and "truncation_mode='keep_start'" in caplog.text


def test_the_study_tokenizes_test_rows_as_dpsft_prepares_training_rows(tmp_path):
    from hf_dp.workflows.tasks.chat_sft import to_prompt_completion, tokenize_prompt_completion

    rows = to_prompt_completion(long_prompt_conversations(), messages_column="messages", keep_columns=["user_id"])
    sft = DPSFTTrainer(model=tiny_chat_model(), args=config(tmp_path, expected_batch_size=4, max_length=12,
                                                            assistant_only_loss=False),
                       train_dataset=rows, processing_class=chat_tokenizer())
    tokenized = tokenize_prompt_completion(rows, chat_tokenizer(), max_length=12)
    assert len(tokenized) == len(rows) == sft.partition.num_examples
    assert sorted(tokenized["input_ids"]) == sorted(sft._user_dataset["input_ids"])


def test_an_unknown_truncation_mode_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="truncation_mode='keep_middle': use one of 'keep_reply'") as error:
        config(tmp_path, truncation_mode="keep_middle")
    assert "\n" not in str(error.value)
