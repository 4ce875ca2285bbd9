"""Canary users: unmistakable rows, fair coins, a secret record kept apart, clean insert/remove."""

import datasets
import numpy as np
import pytest
from scipy import stats

from hf_dp.audit import Canaries, insert, is_canary_user, make_canaries, remove_canaries


def _real_dataset(n=200, labels=False):
    rng = np.random.default_rng(0)
    words = "the a user said order refund please thanks hello account password shipping late".split()
    data = {
        "user_id": [f"user{rng.integers(0, 40)}" for _ in range(n)],
        "text": [" ".join(rng.choice(words, size=8)) for _ in range(n)],
    }
    features = {"user_id": datasets.Value("string"), "text": datasets.Value("string")}
    if labels:
        data["label"] = [int(x) for x in rng.integers(0, 3, size=n)]
        features["label"] = datasets.ClassLabel(num_classes=3)
    return datasets.Dataset.from_dict(data, features=datasets.Features(features))


def test_shape_ids_and_unique_text():
    canaries = make_canaries(50, 3, seed=1)
    assert len(canaries) == 50 and canaries.user_ids[7] == "__hf_dp_canary_0007__"
    texts = [row["text"] for i in range(50) for row in canaries.rows_of(i)]
    assert len(texts) == 150 and len(set(texts)) == 150
    assert all(row["user_id"] == canaries.user_ids[i] for i in range(50) for row in canaries.rows_of(i))
    assert all(text.startswith("hf-dp-canary-") for text in texts)


def test_text_never_collides_with_real_data():
    real = _real_dataset()
    canaries = make_canaries(100, 2, seed=2)
    real_texts = set(real["text"])
    canary_texts = [row["text"] for i in range(100) for row in canaries.rows_of(i)]
    assert not real_texts & set(canary_texts)
    # Not even the marker appears in real data: every canary row carries a fresh 64-bit one.
    real_blob = "\n".join(real_texts)
    assert not any(text[:29] in real_blob for text in canary_texts)
    assert not any(is_canary_user(u) for u in real["user_id"])


def test_inclusion_is_fair_coin_and_seeded():
    canaries = make_canaries(2000, 1, seed=3, words_per_row=2)
    k = int(canaries.included.sum())
    assert stats.binomtest(k, 2000, 0.5).pvalue > 0.001
    assert canaries.included.dtype == bool
    again = make_canaries(2000, 4, seed=3)  # coins do not depend on the row settings
    np.testing.assert_array_equal(canaries.included, again.included)
    assert not np.array_equal(canaries.included, make_canaries(2000, 1, seed=4).included)


def test_training_rows_are_included_canaries_only():
    canaries = make_canaries(40, 2, seed=5)
    rows = canaries.training_rows()
    assert len(rows) == 2 * int(canaries.included.sum())
    included_ids = {canaries.user_ids[i] for i in np.flatnonzero(canaries.included)}
    assert {row["user_id"] for row in rows} == included_ids
    assert all(set(row) == {"user_id", "text"} for row in rows)


def test_labels_uniform_and_validated():
    canaries = make_canaries(300, 2, seed=6, label_column="label", num_labels=3)
    labels = [row["label"] for i in range(300) for row in canaries.rows_of(i)]
    assert set(labels) == {0, 1, 2}
    assert stats.chisquare(np.bincount(labels, minlength=3)).pvalue > 0.001
    with pytest.raises(ValueError, match="label_column and num_labels"):
        make_canaries(10, 1, seed=0, label_column="label")
    with pytest.raises(ValueError, match="num_canaries"):
        make_canaries(1, 1, seed=0)


def test_save_load_round_trip(tmp_path):
    canaries = make_canaries(30, 2, seed=7, user_id_column="author", text_column="body", label_column="y", num_labels=2)
    path = tmp_path / "canaries.json"
    canaries.save(path)
    loaded = Canaries.load(path)
    assert loaded.user_ids == canaries.user_ids
    np.testing.assert_array_equal(loaded.included, canaries.included)
    assert [loaded.rows_of(i) for i in range(30)] == [canaries.rows_of(i) for i in range(30)]
    settings = (loaded.user_id_column, loaded.text_column, loaded.label_column, loaded.num_labels)
    assert settings == ("author", "body", "y", 2)
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a canary record"):
        Canaries.load(tmp_path / "other.json")


def test_insert_then_remove():
    real = _real_dataset(labels=True)
    canaries = make_canaries(20, 3, seed=8, label_column="label", num_labels=3)
    mixed = insert(real, canaries)
    assert len(mixed) == len(real) + 3 * int(canaries.included.sum())
    assert mixed.features == real.features
    in_ids = {u for u in mixed["user_id"] if is_canary_user(u)}
    assert in_ids == {canaries.user_ids[i] for i in np.flatnonzero(canaries.included)}
    cleaned = remove_canaries(mixed)
    assert cleaned["text"] == real["text"] and cleaned["label"] == real["label"]
    with pytest.raises(ValueError, match="already holds canary users"):
        insert(mixed, canaries)


def test_insert_names_the_mismatched_column():
    real = _real_dataset()
    with pytest.raises(ValueError, match="no column 'label'"):
        insert(real, make_canaries(5, 1, seed=0, label_column="label", num_labels=2))
    with pytest.raises(ValueError, match=r"\['extra'\]"):
        insert(real.add_column("extra", [0] * len(real)), make_canaries(5, 1, seed=0))
    numeric = datasets.Dataset.from_dict({"user_id": [1, 2], "text": ["a", "b"]})
    with pytest.raises(ValueError, match="must hold strings"):
        insert(numeric, make_canaries(5, 1, seed=0))
    with pytest.raises(ValueError, match="3 classes"):
        insert(_real_dataset(labels=True), make_canaries(5, 1, seed=0, label_column="label", num_labels=2))
    with pytest.raises(ValueError, match="no column 'uid'"):
        remove_canaries(real, user_id_column="uid")


def test_is_canary_user():
    assert is_canary_user("__hf_dp_canary_0012__")
    assert not is_canary_user("user12") and not is_canary_user(12) and not is_canary_user("__hf_dp_canary_x__")


# ---- conversation canaries (chat SFT: TRL's prompt/completion rows) ----------------------------------------


SYSTEM = "You are a character in a play by Shakespeare."


def _chat_rows(n=200):
    """Real prompt/completion rows as `to_prompt_completion` makes them (system prompt first)."""
    rng = np.random.default_rng(0)
    words = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()
    users, prompts, completions = [], [], []
    for _ in range(n):
        users.append(f"PLAY::ROLE{rng.integers(0, 40)}")
        prompts.append([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": " ".join(rng.choice(words, size=6))}])
        completions.append([{"role": "assistant", "content": " ".join(rng.choice(words, size=10))}])
    return datasets.Dataset.from_dict({"user_id": users, "prompt": prompts, "completion": completions})


def _conversation_canaries(m=100, k=1, seed=2):
    return make_canaries(m, k, seed=seed, text_column="completion", prompt_column="prompt", system_prompt=SYSTEM)


def test_conversation_canaries_are_prompt_completion_rows_like_the_real_ones():
    canaries = _conversation_canaries(m=50, k=2)
    assert canaries.columns == ["user_id", "completion", "prompt"]
    assert len(set(canaries.user_ids)) == 50 and all(is_canary_user(u) for u in canaries.user_ids)
    for i in range(50):
        for row in canaries.rows_of(i):
            assert row["user_id"] == canaries.user_ids[i]
            system, user = row["prompt"]
            assert system == {"role": "system", "content": SYSTEM} and user["role"] == "user"
            assert len(user["content"].split()) == 4
            (reply,) = row["completion"]
            assert reply["role"] == "assistant" and len(reply["content"].split()) == 12
    replies = [row["completion"][0]["content"] for i in range(50) for row in canaries.rows_of(i)]
    assert len(set(replies)) == 100  # 12 of 64 words: 72 bits per reply
    # The coins are the same as text canaries' of the same seed: the row format draws after them.
    np.testing.assert_array_equal(canaries.included, make_canaries(50, 2, seed=2).included)
    assert make_canaries(3, 1, seed=0, prompt_column="prompt").rows_of(0)[0]["prompt"][0]["role"] == "user"


def test_conversation_canaries_never_collide_with_real_rows_and_insert_cleanly():
    real = _chat_rows()
    canaries = _conversation_canaries()
    real_texts = {m["content"] for column in ("prompt", "completion") for row in real[column] for m in row
                  if m["role"] != "system"}
    canary_texts = {m["content"] for i in range(100) for row in canaries.rows_of(i)
                    for m in row["prompt"][1:] + row["completion"]}
    assert not real_texts & canary_texts
    assert not any(is_canary_user(u) for u in real["user_id"])
    mixed = insert(real, canaries)
    assert mixed.features == real.features and len(mixed) == len(real) + int(canaries.included.sum())
    inserted = mixed.select(range(len(real), len(mixed)))
    assert inserted["completion"] == [row["completion"] for row in canaries.training_rows()]
    assert len(remove_canaries(mixed)) == len(real)


def test_conversation_canaries_save_and_load_with_their_coins(tmp_path):
    canaries = _conversation_canaries(m=20, k=1, seed=7)
    canaries.save(tmp_path / "c.json")
    again = Canaries.load(tmp_path / "c.json")
    assert again.prompt_column == "prompt" and again.text_column == "completion"
    np.testing.assert_array_equal(again.included, canaries.included)
    assert again.rows_of(3) == canaries.rows_of(3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(system_prompt="x"), "system_prompt is for conversation rows"),
    (dict(prompt_column="prompt", prompt_words=0), "prompt_words must be an int >= 1"),
    (dict(prompt_column="text"), "prompt_column='text' must differ"),
])
def test_conversation_canary_settings_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_canaries(4, 1, seed=0, **kwargs)


@pytest.mark.slow
def test_conversation_canaries_fit_the_chat_study_rows_whole():
    """With SmolLM2's chat template and the study's system prompt, a canary's reply is never cut by max_length 64:
    the audit scores the whole reply, as training saw it."""
    from transformers import AutoTokenizer

    from hf_dp.workflows.pretrained import smollm2_path
    from hf_dp.workflows.study_settings import SFT_SETTINGS
    from hf_dp.workflows.tasks.chat_sft import tokenize_prompt_completion

    canaries = _conversation_canaries(m=200)
    rows = datasets.Dataset.from_list([row for i in range(200) for row in canaries.rows_of(i)])
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    max_length = SFT_SETTINGS["config"]["max_length"]
    whole = tokenize_prompt_completion(rows, tokenizer, max_length=None)
    assert max(len(ids) for ids in whole["input_ids"]) <= max_length
    assert tokenize_prompt_completion(rows, tokenizer, max_length=max_length)["labels"] == whole["labels"]


# ---- canaries built to be memorised: each reply token belongs to one canary ---------------------------------


def test_reply_vocabulary_gives_every_canary_its_own_reply_words():
    pool = [f"w{i:04d}" for i in range(1000)]
    canaries = make_canaries(40, 2, seed=3, text_column="completion", prompt_column="prompt", system_prompt=SYSTEM,
                             words_per_row=12, reply_vocabulary=pool)
    words_of = [{w for row in canaries.rows_of(i) for w in row["completion"][0]["content"].split()}
                for i in range(40)]
    assert all(len(words) == 24 for words in words_of)  # 2 rows x 12 words, none repeated within a canary
    assert len(set().union(*words_of)) == 40 * 24  # nor across canaries: every word is one canary's
    assert set().union(*words_of) <= set(pool)
    # The prompt keeps its format (system prompt, a user message of shared words); the coins do not move.
    assert canaries.rows_of(0)[0]["prompt"][0] == {"role": "system", "content": SYSTEM}
    np.testing.assert_array_equal(canaries.included, make_canaries(40, 2, seed=3).included)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_column="prompt", reply_vocabulary=["a", "b", "c"]), "reply_vocabulary has 3 distinct words"),
    (dict(prompt_column="prompt", reply_vocabulary=["a"] * 100), "reply_vocabulary has 1 distinct words"),
    (dict(reply_vocabulary=[str(i) for i in range(100)]), "reply_vocabulary is for conversation replies"),
])
def test_reply_vocabulary_is_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_canaries(4, 1, seed=0, words_per_row=2, **kwargs)


@pytest.mark.slow
def test_rare_word_replies_tokenize_into_their_own_rare_tokens_like_real_rows():
    """SmolLM2's tokenizer: each rare word is one token after a space, so a canary's reply labels (tokenized as
    DPSFTTrainer tokenizes real rows) are its own words' tokens, shared with no other canary, and fit max_length."""
    from transformers import AutoTokenizer

    from hf_dp.audit import rare_words
    from hf_dp.workflows.pretrained import smollm2_path
    from hf_dp.workflows.tasks.chat_sft import tokenize_prompt_completion

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    pool = rare_words(tokenizer, 50 * 12)
    assert len(set(pool)) == 600 and all(w.isalpha() and len(w) >= 4 for w in pool)
    assert all(tokenizer.encode(" " + w, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids("Ġ" + w)]
               for w in pool)
    canaries = make_canaries(50, 1, seed=1, text_column="completion", prompt_column="prompt", system_prompt=SYSTEM,
                             reply_vocabulary=pool)
    rows = datasets.Dataset.from_list([row for i in range(50) for row in canaries.rows_of(i)])
    tokens = tokenize_prompt_completion(rows, tokenizer, max_length=64)
    assert max(len(ids) for ids in tokens["input_ids"]) <= 64  # never cut: the whole reply is trained and scored
    seen: set = set()
    for row, labels in zip(rows, tokens["labels"]):
        words = row["completion"][0]["content"].split()
        own = [tokenizer.convert_tokens_to_ids("Ġ" + w) for w in words[1:]]  # the first word has no space before
        labelled = [t for t in labels if t != -100]
        assert all(t in labelled for t in own) and len(set(own)) == 11
        assert not seen & set(own)  # no other canary's reply holds these tokens
        seen |= set(own)
