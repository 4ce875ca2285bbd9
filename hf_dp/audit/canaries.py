"""Canary users for a one-run audit: rows nobody else could have written, included by a coin.

Each canary is a *user* (the privacy unit) with k rows. A text row is a fresh random marker
("hf-dp-canary-<16 hex digits>") followed by random words from a fixed list, so it cannot collide
with real data, and the only way a model can tell an included canary from an excluded one is by
having trained on it. A conversation row (`prompt_column` set: chat SFT data in TRL's prompt/completion
format) is a user message of a few random words, after the data's system prompt if any, and an
assistant reply of random words: 16 words drawn from 64 (96 bits) make every row unique without the
marker, whose 23 tokens would not fit the short conversations chat runs train on; the reply is what
SFT learns, so membership shows in its loss. With `reply_vocabulary` (the chat audit passes [`rare_words`]) each
reply is instead made of rare in-vocabulary tokens drawn *without replacement* across all canaries: every reply
token belongs to one canary only, so what the model learns from an included canary (its own tokens' logits going
up) does not lower an excluded canary's loss, and its high starting loss leaves room to fall. Shared words do not
have that property: training on half the canaries teaches the word list, and every canary's loss drops alike.
Each canary's inclusion is an independent fair coin, as the estimators
assume. The coins are the audit's secret: `training_rows()` hands out rows without them, and
`Canaries.save` writes them to a file of their own, apart from the training data.
"""

from __future__ import annotations

import re

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np


if TYPE_CHECKING:
    import datasets

__all__ = ["Canaries", "insert", "is_canary_user", "make_canaries", "rare_words", "remove_canaries"]

# Canary users train like any other user (they count in q and δ); the trainer leaves them out of the stated
# numbers of users and examples because the audit names them (`DPTrainerMixin.uncounted_user_ids`).
CANARY_USER_ID_FORMAT = "__hf_dp_canary_{index:0{width}d}__"
_CANARY_USER_ID = re.compile(r"__hf_dp_canary_\d+__")


def canary_user_id(index: int, width: int = 4) -> str:
    """The id of canary user `index` ("__hf_dp_canary_0007__"), zero-padded to `width` digits."""
    return CANARY_USER_ID_FORMAT.format(index=index, width=width)


def is_canary_user(user_id) -> bool:
    """Whether a user id is an audit canary's (so evaluation, counts and baselines can skip it)."""
    return isinstance(user_id, str) and _CANARY_USER_ID.fullmatch(user_id) is not None

_FORMAT = "hf_dp.audit.canaries/1"
_MARKER = "hf-dp-canary-"
# Fixed word list: random sequences of ordinary words tokenize like text (so a model can learn them)
# while the 64-bit marker makes every row unique.
_WORDS = (
    "amber anchor arrow basil beacon birch bishop blossom bramble breeze canyon cedar cipher cobalt "
    "comet copper coral crescent dune ember falcon fern fjord galaxy garnet glacier granite harbor "
    "hazel heron indigo iris ivory jasper juniper kestrel lagoon lantern lichen linen lotus magnet "
    "maple marble meadow meteor mist nectar nimbus oasis onyx orchid otter pebble pepper pine quartz "
    "quill raven reef saffron sage sierra spruce tundra velvet violet walnut willow zephyr zinc"
).split()


@dataclasses.dataclass(frozen=True, eq=False)
class Canaries:
    """m canary users, their rows, and the secret record of which were included.

    Attributes:
        user_ids: Canary user ids, "__hf_dp_canary_0007__" style.
        rows: rows[i] is the list of row dicts of canary i (user id, text and, if any, label).
        included: Boolean array; included[i] says whether canary i goes into training.
        seed: Seed the canaries were drawn from.
        user_id_column: Column holding the user id.
        text_column: Column holding the text.
        label_column: Column holding the label, or None.
        num_labels: Number of label classes, or None.
        prompt_column: Column holding the prompt messages of conversation rows (the text column then holds the
            reply, `[{"role": "assistant", "content": ...}]`), or None for text rows.
    """

    user_ids: tuple[str, ...]
    rows: tuple[tuple[dict, ...], ...]
    included: np.ndarray
    seed: int
    user_id_column: str = "user_id"
    text_column: str = "text"
    label_column: str | None = None
    num_labels: int | None = None
    prompt_column: str | None = None

    def __len__(self) -> int:
        return len(self.user_ids)

    @property
    def columns(self) -> list[str]:
        """The columns of a canary row."""
        optional = [c for c in (self.prompt_column, self.label_column) if c]
        return [self.user_id_column, self.text_column] + optional

    def rows_of(self, i: int) -> list[dict]:
        """Rows of canary i, included or not (scoring needs every canary).

        Args:
            i: Canary index in [0, m).

        Returns:
            Copies of the row dicts.
        """
        return [dict(row) for row in self.rows[i]]

    def training_rows(self) -> list[dict]:
        """Rows of the included canaries only, without any inclusion flag."""
        return [dict(row) for i in np.flatnonzero(self.included) for row in self.rows[i]]

    def save(self, path: str | Path) -> None:
        """Write the canaries and their inclusion record to a JSON file (keep it from the trainer).

        Args:
            path: Destination file.
        """
        record = {
            "format": _FORMAT,
            "seed": self.seed,
            "user_id_column": self.user_id_column,
            "text_column": self.text_column,
            "label_column": self.label_column,
            "num_labels": self.num_labels,
            "prompt_column": self.prompt_column,
            "user_ids": list(self.user_ids),
            "rows": [list(rows) for rows in self.rows],
            "included": [bool(b) for b in self.included],
        }
        Path(path).write_text(json.dumps(record, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Canaries:
        """Read canaries written by `save`.

        Args:
            path: File written by `Canaries.save`.

        Returns:
            The same canaries.

        Raises:
            ValueError: If the file is not a canary record or is inconsistent.
        """
        record: dict[str, Any] = json.loads(Path(path).read_text())
        if record.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a canary record ({_FORMAT}); pass a file written by Canaries.save.")
        if not len(record["user_ids"]) == len(record["rows"]) == len(record["included"]):
            raise ValueError(f"{path} is inconsistent (user_ids, rows and included differ in length); regenerate it.")
        return cls(
            user_ids=tuple(record["user_ids"]),
            rows=tuple(tuple(rows) for rows in record["rows"]),
            included=np.array(record["included"], dtype=bool),
            seed=record["seed"],
            user_id_column=record["user_id_column"],
            text_column=record["text_column"],
            label_column=record["label_column"],
            num_labels=record["num_labels"],
            prompt_column=record.get("prompt_column"),
        )


def make_canaries(
    num_canaries: int,
    rows_per_canary: int,
    *,
    seed: int,
    user_id_column: str = "user_id",
    text_column: str = "text",
    label_column: str | None = None,
    num_labels: int | None = None,
    words_per_row: int = 12,
    prompt_column: str | None = None,
    system_prompt: str | None = None,
    prompt_words: int = 4,
    reply_vocabulary: Sequence[str] | None = None,
) -> Canaries:
    """Draw m canary users with k rows each, and an independent fair coin for each.

    The coins come first from `numpy.random.default_rng(seed)`, so the inclusion record does not
    depend on the row settings. Labels, if any, are uniform over the classes: a canary's label
    carries no signal a model could have learned from real data.

    Args:
        num_canaries: Number of canary users m (at least 2).
        rows_per_canary: Rows per canary user k (at least 1; match the contribution bound to audit
            the user-level guarantee at its worst case).
        seed: Seed for coins, markers, words and labels.
        user_id_column: Name of the user id column.
        text_column: Name of the text column.
        label_column: Name of the label column, or None for unlabeled (language modeling) data.
        num_labels: Number of classes; required with `label_column`.
        words_per_row: Random words after the marker in each row (in the reply of a conversation row).
        prompt_column: Name of the prompt column for conversation rows (TRL's prompt/completion format: the
            text column holds the reply message); None for text rows.
        system_prompt: A system message put first in each conversation row's prompt, as the real rows have.
        prompt_words: Random words of a conversation row's user message.
        reply_vocabulary: Words for the conversation replies, each used by one reply only (drawn without
            replacement; e.g. [`rare_words`]); needs at least m·k·`words_per_row` distinct words. None: replies
            of words from the shared list.

    Returns:
        The `Canaries`.

    Raises:
        ValueError: If a count is out of range or label settings are incomplete.
    """
    if not isinstance(num_canaries, int) or num_canaries < 2:
        raise ValueError(f"num_canaries must be an int >= 2 (got {num_canaries!r}); use hundreds for a useful audit.")
    if not isinstance(rows_per_canary, int) or rows_per_canary < 1:
        raise ValueError(f"rows_per_canary must be an int >= 1 (got {rows_per_canary!r}).")
    if not isinstance(words_per_row, int) or words_per_row < 1:
        raise ValueError(f"words_per_row must be an int >= 1 (got {words_per_row!r}).")
    if prompt_column is not None and (not isinstance(prompt_words, int) or prompt_words < 1):
        raise ValueError(f"prompt_words must be an int >= 1 (got {prompt_words!r}).")
    if system_prompt is not None and prompt_column is None:
        raise ValueError("system_prompt is for conversation rows: pass prompt_column too (or no system_prompt).")
    if prompt_column is not None and prompt_column in (user_id_column, text_column, label_column):
        raise ValueError(f"prompt_column={prompt_column!r} must differ from the user, text and label columns.")
    if reply_vocabulary is not None:
        if prompt_column is None:
            raise ValueError("reply_vocabulary is for conversation replies: pass prompt_column too.")
        reply_vocabulary = list(dict.fromkeys(reply_vocabulary))
        needed = num_canaries * rows_per_canary * words_per_row
        if len(reply_vocabulary) < needed:
            raise ValueError(f"reply_vocabulary has {len(reply_vocabulary)} distinct words; {num_canaries} canaries x "
                             f"{rows_per_canary} rows x {words_per_row} words need {needed}: pass more words or "
                             "fewer canaries.")
    if (label_column is None) != (num_labels is None):
        raise ValueError("label_column and num_labels go together; pass both (classification) or neither.")
    if num_labels is not None and (not isinstance(num_labels, int) or num_labels < 2):
        raise ValueError(f"num_labels must be an int >= 2 (got {num_labels!r}).")

    rng = np.random.default_rng(seed)
    included = rng.integers(0, 2, size=num_canaries).astype(bool)
    width = max(4, len(str(num_canaries - 1)))
    user_ids = tuple(canary_user_id(i, width) for i in range(num_canaries))
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]

    def words(n: int) -> str:
        return " ".join(_WORDS[j] for j in rng.integers(0, len(_WORDS), size=n))

    # Each reply word used once: a fixed permutation of the pool, handed out in order.
    unique = None if reply_vocabulary is None else iter([reply_vocabulary[j] for j in
                                                         rng.permutation(len(reply_vocabulary))])

    def reply(n: int) -> str:
        return words(n) if unique is None else " ".join(next(unique) for _ in range(n))

    rows = []
    for user_id in user_ids:
        user_rows = []
        for _ in range(rows_per_canary):
            if prompt_column is None:
                marker = rng.bytes(8).hex()
                row = {user_id_column: user_id, text_column: f"{_MARKER}{marker} {words(words_per_row)}"}
            else:
                prompt = [dict(m) for m in system] + [{"role": "user", "content": words(prompt_words)}]
                row = {user_id_column: user_id, prompt_column: prompt,
                       text_column: [{"role": "assistant", "content": reply(words_per_row)}]}
            if label_column is not None:
                row[label_column] = int(rng.integers(0, num_labels))
            user_rows.append(row)
        rows.append(tuple(user_rows))
    return Canaries(
        user_ids=user_ids,
        rows=tuple(rows),
        included=included,
        seed=seed,
        user_id_column=user_id_column,
        text_column=text_column,
        label_column=label_column,
        num_labels=num_labels,
        prompt_column=prompt_column,
    )


def rare_words(tokenizer, count: int) -> list[str]:
    """`count` rare words of the tokenizer's vocabulary, each one token after a space: alphabetic BPE tokens of 4+
    letters from the end of the vocabulary (the last merges, the rarest).

    Why: a reply of such words has a high loss under the base model (room to fall when trained on) and, joined by
    spaces, tokenizes into exactly those tokens (the first may split in two), so every canary's reply tokens are its
    own. Truly new tokens would be stronger still, but a run that trains LoRA adapters with frozen (tied) embeddings
    cannot learn a new token.

    Raises:
        ValueError: If the vocabulary has fewer such words.
    """
    vocabulary = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_ids", ()))
    words = []
    for token, token_id in sorted(vocabulary.items(), key=lambda item: -item[1]):
        if token_id in special:
            continue
        word = tokenizer.convert_tokens_to_string([token]).strip()
        if len(word) < 4 or not word.isascii() or not word.isalpha():
            continue
        if tokenizer.encode(" " + word, add_special_tokens=False) == [token_id]:
            words.append(word)
            if len(words) == count:
                return words
    raise ValueError(f"the tokenizer has only {len(words)} rare one-token words; ask for at most that many.")


def insert(dataset: datasets.Dataset, canaries: Canaries) -> datasets.Dataset:
    """Append the rows of the included canaries to a training set.

    Args:
        dataset: The real training rows; must have exactly the canaries' columns, with a string
            user id column.
        canaries: The canaries.

    Returns:
        A new dataset: the real rows followed by the included canaries' rows (shuffle or sample as
        usual afterwards; Poisson sampling of users does not care about order).

    Raises:
        ValueError: If columns differ, the user id column is not a string, or the dataset
            already holds canary users.
    """
    import datasets as hf_datasets

    for column in canaries.columns:
        if column not in dataset.column_names:
            raise ValueError(
                f"the dataset has no column {column!r}, which the canaries have; make the canaries with the "
                "dataset's column names (make_canaries(..., user_id_column=..., text_column=..., label_column=...))."
            )
    extra = [c for c in dataset.column_names if c not in canaries.columns]
    if extra:
        raise ValueError(
            f"the dataset has column(s) {extra} that canaries lack; insert canaries before adding derived "
            f"columns, or drop them with dataset.remove_columns({extra})."
        )
    feature = dataset.features[canaries.user_id_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ValueError(
            f"column {canaries.user_id_column!r} must hold strings to take canary ids (it holds {feature}); "
            f"cast it first: dataset.cast_column({canaries.user_id_column!r}, datasets.Value('string'))."
        )
    if any(is_canary_user(u) for u in dataset[canaries.user_id_column]):
        raise ValueError("the dataset already holds canary users; insert into the dataset without canaries.")
    label = canaries.label_column
    if label is not None and isinstance(dataset.features[label], hf_datasets.ClassLabel):
        if dataset.features[label].num_classes != canaries.num_labels:
            raise ValueError(
                f"column {label!r} has {dataset.features[label].num_classes} classes but the canaries have "
                f"{canaries.num_labels}; make the canaries with num_labels={dataset.features[label].num_classes}."
            )
    rows = canaries.training_rows()
    if not rows:
        return dataset
    extra_rows = hf_datasets.Dataset.from_list(rows, features=dataset.features)
    return hf_datasets.concatenate_datasets([dataset, extra_rows])


def remove_canaries(dataset: datasets.Dataset, user_id_column: str = "user_id") -> datasets.Dataset:
    """Drop canary users' rows (for evaluation, user counts and public-only baselines).

    Args:
        dataset: Any dataset with a user id column.
        user_id_column: Name of that column.

    Returns:
        The dataset without canary rows.

    Raises:
        ValueError: If the column is missing.
    """
    if user_id_column not in dataset.column_names:
        raise ValueError(
            f"the dataset has no column {user_id_column!r}; pass user_id_column= the column holding user ids."
        )
    keep = [i for i, u in enumerate(dataset[user_id_column]) if not is_canary_user(u)]
    if len(keep) == len(dataset):
        return dataset
    return dataset.select(keep)
