"""The contribution bound G and the user partition it shapes, both keyed by the run's data secret.

G is the most rows one user contributes; each user keeps a random subset of at most G rows. G is given, or chosen
from the data with ε-DP ("auto"), a release the ledger records. Both draws are keyed by a secret (fresh OS entropy,
shared by all ranks, saved in checkpoints so a resumed run redraws the same G and rows; never released).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections import Counter

import numpy as np

from .arguments import DPTrainingArguments
from .data import UserPartition, examples_per_user, keyed_seed, partition_by_user
from .mechanisms import get_mechanism
from .user_column import arrow_user_codes
from .user_counts import CONTRIBUTION_BOUND_GRID, DEFAULT_TARGET_EPSILON


def data_secret(args: DPTrainingArguments) -> str:
    """The key of G's private draw and of every user's row choice: fresh OS entropy, shared by all ranks, or
    derived from `noise_seed` for tests."""
    if args.noise_seed is not None:
        return hashlib.sha256(f"hf_dp data secret {args.noise_seed}".encode()).hexdigest()[:32]
    secret = secrets.token_hex(16)
    if args.world_size > 1:
        from accelerate.utils import broadcast_object_list

        secret = broadcast_object_list([secret], from_process=0)[0]
    return secret


def partition(dataset, args: DPTrainingArguments, secret: str) -> UserPartition:
    """Rows grouped by user under the bound G, G and every user's rows (once, or each step) drawn with `secret`."""
    return partition_by_user(dataset, args.user_id_column, contribution_bound(dataset, args, secret), secret,
                             redraw_rows=args.redraw_rows)


def bound_epsilon(args: DPTrainingArguments) -> float:
    """ε spent choosing G from the data: `contribution_bound_epsilon` for "auto" at user level, else 0."""
    auto = args.contribution_bound == "auto" and get_mechanism(args.mechanism).protects_users
    return float(args.contribution_bound_epsilon) if auto else 0.0


def contribution_bound(dataset, args: DPTrainingArguments, secret: str) -> int | None:
    """G from the arguments; "auto" is chosen with ε-DP by the mechanism
    ([`~hf_dp.mechanisms.DPMechanism.choose_contribution_bound`]): ELS takes a DP median of the rows per user, from
    the public grid; ULS runs the noise-prediction heuristic of Charles et al. 2024 on that DP median (compute budget
    of `expected_batch_size` users × the median rows), for the run's steps and the ε left to DP-SGD. The draw is
    keyed by `secret`.
    """
    mechanism = get_mechanism(args.mechanism)
    if args.contribution_bound is None or (not mechanism.protects_users and args.contribution_bound == "auto"):
        return None  # no bound: every row is kept
    if args.contribution_bound != "auto":
        return int(args.contribution_bound)
    counts = examples_per_user(dataset, args.user_id_column)
    if len(counts) == 0:
        return None  # partition_by_user raises the clear error
    sample_rate = min(1.0, args.expected_batch_size / len(counts))  # above 1: the plan raises the clear error
    steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs / sample_rate)
    return mechanism.choose_contribution_bound(
        counts, epsilon=args.contribution_bound_epsilon, expected_batch_size=args.expected_batch_size, steps=steps,
        target_epsilon=(args.target_epsilon or DEFAULT_TARGET_EPSILON) - bound_epsilon(args),
        delta=args.target_delta, rng=np.random.default_rng(keyed_seed(secret, "contribution_bound", "bound")),
    )


def bound_choice(args: DPTrainingArguments, mechanism: str, spent: float) -> str:
    """How G was chosen, for the report and the card (`spent`: the ε of its choice)."""
    if not get_mechanism(mechanism).protects_users or args.contribution_bound is None:
        return "none: every row is kept"
    redrawn = "; a sampled user's G rows are drawn afresh each step, from all their rows" if args.redraw_rows else ""
    if not spent:
        return "given (contribution_bound): not read from the data" + redrawn
    rule = get_mechanism(mechanism).bound_rule()
    return (f"auto: an ε-DP median of the rows per user (exponential mechanism over the public grid "
            f"{', '.join(map(str, CONTRIBUTION_BOUND_GRID))}; ε = {spent:g}, in the ledger), "
            f"then {rule}{redrawn}")


def counts_of(dataset, user_id_column: str, bound: int | None, user_ids) -> tuple[int, int]:
    """(users, kept rows) of the users `user_ids` in `dataset`: trained on like any user (they count in q and δ),
    never counted in the report's or the card's number of users and examples (an audit's canaries)."""
    if not user_ids:
        return 0, 0
    read = arrow_user_codes(dataset, user_id_column)  # the column once through Arrow, not row by row
    if read is None:
        rows = list(Counter(user for user in dataset[user_id_column] if user in user_ids).values())
    else:
        codes, values = read
        wanted = [code for code, value in enumerate(values) if value in user_ids]
        counts = np.bincount(codes[codes >= 0], minlength=len(values))[wanted]
        rows = [int(n) for n in counts if n > 0]
    return len(rows), sum(n if bound is None else min(n, bound) for n in rows)
