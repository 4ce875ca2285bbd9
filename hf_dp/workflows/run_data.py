"""The rows a run trains and evaluates on: its data loaded and split by user, and seeded subsets of it.

Preprocessing only: these functions choose the rows, and the guarantee is about the rows trained on. They are
shared by the task modules ([`hf_dp.workflows.tasks.classification`], [`hf_dp.workflows.tasks.language_modeling`])
and keep the rule every run follows: no test user is ever trained on. A user's side of a split depends only on a
keyed hash of (`seed`, user id), so one user more or less moves no other user. A fixed-size sample of users
(`max_train_users`) is the exception: a sampled user can displace another, so the run states it
([`user_sample_statement`]: the result JSON's `not_covered` and the privacy card say so).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "check_disjoint_users",
    "distinct",
    "load_splits",
    "split_by_user",
    "subsample_rows",
    "subsample_training_users",
    "subsample_users",
    "user_sample_statement",
    "without_plays",
]


def distinct(dataset, column: str) -> list:
    """`dataset.unique(column)` (first-appearance order), reading that column only: a filtered or selected dataset
    is not copied whole first (seconds instead of a quarter of a minute for the chat data's conversations)."""
    return dataset.select_columns([column]).unique(column)


def split_by_user(dataset, user_id_column: str, fraction: float = 0.2, seed: int = 0):
    """(train, test): each user goes to test, with all their rows, when its keyed hash is below `fraction`.

    A user's side depends only on (`seed`, user id) ([`~hf_dp.data.keyed_uniform`]): adding or removing one
    user moves no other user, so neighbouring datasets give neighbouring training sets. The test set thus holds
    about `fraction` of the users (at least one, never all: for a split that would be empty on one side, the
    user with the lowest, or highest, hash is moved).

    Raises:
        ValueError: fewer than two users.
    """
    from hf_dp.data import keyed_uniform

    users = distinct(dataset, user_id_column)
    if len(users) < 2:
        raise ValueError(f"Need at least two users to split by user; found {len(users)}.")
    draws = {user: keyed_uniform(seed, user, "split") for user in users}
    test_users = {user for user, draw in draws.items() if draw < fraction}
    if not test_users or len(test_users) == len(users):  # only with very few users
        ranked = sorted(users, key=draws.get)
        test_users = {ranked[0]} if not test_users else set(ranked[:-1])
    is_test = [u in test_users for u in dataset[user_id_column]]
    return (dataset.select([i for i, t in enumerate(is_test) if not t]),
            dataset.select([i for i, t in enumerate(is_test) if t]))


def subsample_users(dataset, user_id_column: str, max_users: int | None, seed: int = 0):
    """The rows of the `max_users` users with the lowest keyed hash of (`seed`, user id) (all rows when `None` or
    not fewer users).

    Each user's hash depends on nothing else, so adding or removing an unselected user changes nothing, and a
    selected one displaces at most one other user (a fixed-size sample must): when the sample drops users, the
    run must state [`user_sample_statement`].
    """
    from hf_dp.data import keyed_uniform

    if max_users is None:
        return dataset
    users = distinct(dataset, user_id_column)
    if max_users >= len(users):
        return dataset
    chosen = set(sorted(users, key=lambda user: keyed_uniform(seed, user, "subsample"))[:max_users])
    keep = [i for i, u in enumerate(dataset[user_id_column]) if u in chosen]
    return dataset.select(keep)


def subsample_training_users(train, config) -> tuple:
    """`train` cut to `config.max_train_users` users by [`subsample_users`], and the list of what the run must state:
    [`user_sample_statement`] when the sample dropped users, nothing when it kept them all."""
    sampled = subsample_users(train, config.user_id_column, config.max_train_users, config.seed)
    return sampled, [user_sample_statement(config.max_train_users)] if len(sampled) < len(train) else []


def user_sample_statement(max_users: int) -> str:
    """What a run whose training users are a fixed-size sample of `max_users` ([`subsample_users`]) must state: the
    item the result JSON (`not_covered`) and the privacy card ("What the guarantee covers") carry."""
    return (f"**A sample of the users.** The training users are a fixed-size sample of {max_users} of the available "
            "users, drawn by a keyed hash of the user id (the key is the run's seed, recorded in the result, not a "
            "secret): the guarantee is for adding or removing a user among the sampled ones; whether a user was "
            "sampled depends on the others (replace-one adjacency, about twice the stated ε for membership in the "
            "source data).")


def subsample_rows(dataset, max_rows: int | None, seed: int = 0):
    """A seeded sample of `max_rows` rows, in their original order (all rows when `None` or not fewer)."""
    if max_rows is None or max_rows >= len(dataset):
        return dataset
    rows = np.random.default_rng(seed).choice(len(dataset), size=max_rows, replace=False)
    return dataset.select(np.sort(rows).tolist())


def load_splits(config, **columns):
    """Train and test rows of `config.dataset`, users disjoint: Shakespeare split by play, or the caller's data
    with `config.eval_dataset` (or a seeded split by user) as the test set.

    `columns`: extra required columns of [`~hf_dp.workflows.corpora.load_user_dataset`] (e.g. `label_column`).

    Raises:
        ValueError: a missing column, a test split sharing users with train, or `exclude_train_plays` with data
            that has no `play` column or naming a play that is not among the training plays.
    """
    from hf_dp.workflows import corpora

    if config.dataset == "shakespeare":
        corpus = corpora.load_shakespeare()
        train, test = corpus["train"], corpus["test"]
    else:
        load = dict(user_id_column=config.user_id_column, text_column=config.text_column, **columns)
        train = corpora.load_user_dataset(config.dataset, argument="dataset", **load)
        if config.eval_dataset is not None:
            test = corpora.load_user_dataset(config.eval_dataset, argument="eval_dataset", **load)
        else:
            train, test = split_by_user(train, config.user_id_column, config.eval_fraction, config.seed)
    if getattr(config, "exclude_train_plays", None):
        train = without_plays(train, config.exclude_train_plays)
    check_disjoint_users(train, test, config.user_id_column)
    return train, test


def without_plays(train, plays):
    """`train` without the rows of `plays` (its `play` column).

    Raises:
        ValueError: no `play` column, or a play that is not in `train`.
    """
    if "play" not in train.column_names:
        raise ValueError("exclude_train_plays needs a 'play' column (dataset='shakespeare'); unset it for other data.")
    present = set(distinct(train, "play"))
    unknown = sorted(set(plays) - present)
    if unknown:
        raise ValueError(f"exclude_train_plays: {unknown} are not training plays (they are: {sorted(present)}).")
    excluded = set(plays)
    return train.filter(lambda play: [p not in excluded for p in play], input_columns="play", batched=True)


def check_disjoint_users(train, test, user_id_column: str) -> None:
    """Raise `ValueError` when a user has rows in both splits (the test set must hold other users)."""
    if user_id_column not in test.column_names:
        return
    overlap = set(distinct(train, user_id_column)) & set(distinct(test, user_id_column))
    if overlap:
        raise ValueError(
            f"{len(overlap)} users are in both the training and the test data (e.g. {sorted(overlap, key=str)[:3]}): "
            "the test set must hold other users. Drop --eval_dataset to split by user."
        )
