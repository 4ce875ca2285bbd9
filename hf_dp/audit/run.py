"""Audit a training run: canary users in, one training run, a measured lower bound on ε out.

[`audit_training`] runs the one-run audit of Steinke, Nasr & Jagielski (2023) around a trainer you build:

1. it draws m canary users with k rows each and a fair coin per canary ([`make_canaries`]) and adds the
   included ones to the training rows ([`insert`]). They are users like any other: the contribution bound,
   the Poisson sampler, clipping and noise treat them as they treat real users;
2. before training it saves the canaries and their coins to `output_dir/_audit/canaries.json`, apart from the
   training data (the trainer never sees the coins) and out of every upload (`_*` is skipped by `hf-dp publish`
   and by `Trainer.push_to_hub`);
3. it records the start: each canary row's loss under the initial, public-only model (black-box score, the
   default) or the trainable parameters θ_0 (white-box score). For chat SFT (`prompt_column`) canaries are
   prompt/completion conversations like the real rows and the loss is their reply's; a trainer that tokenizes its
   own data (`DPSFTTrainer`) gets raw rows, and `score_tokenize` tokenizes the canaries for scoring as it does;
4. it trains once, scores every canary ([`loss_scores`] or [`gradient_alignment_scores`]), and turns the
   guesses into a lower bound on ε at the run's δ: Steinke et al.'s, which assumes nothing about the algorithm
   (Mahloujifar et al.'s f-DP number, which assumes a Gaussian trade-off curve, is kept in the JSON as a
   diagnostic only: subsampled DP-SGD does not have one);
5. it returns an [`AuditReport`] (also saved as `output_dir/_audit/report.json`) whose `card_section()` is the
   model card's "Empirical audit" section; `write_to_card(model_dir)` puts it into the card with the report beside
   it (`dp_audit.json`), which `hf-dp publish` renders the section from again ([`hf_dp.audit.record`]).

What the audit is and is not: a check of the implementation. An ε lower bound above the accountant's ε means a
bug (in sampling, clipping, noise or accounting); one well below it is expected, since the canaries and the
guesser are far weaker than the worst case the proof covers. It never tightens the guarantee. The audited run
trains on the canaries, so it is usually a separate run from the released model, with the same configuration.

Example:

```python
>>> from hf_dp.audit import audit_training
>>> def make_trainer(train_dataset):
...     return DPTrainer(model=build_model(), args=DPTrainingArguments("out", target_epsilon=8.0),
...                      train_dataset=train_dataset, data_collator=collator)
>>> report = audit_training(make_trainer, raw_train, tokenize=tokenize, canaries=256)  # doctest: +SKIP
>>> report.epsilon_lower_bound, report.epsilon_upper_bound  # doctest: +SKIP
>>> print(report.card_section())  # doctest: +SKIP
```
"""

from __future__ import annotations

import contextlib
import json
import secrets
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hf_dp.audit.canaries import Canaries, insert, make_canaries
from hf_dp.audit.report import AuditReport
from hf_dp.audit.estimator import audit_guesses, epsilon_lower_bound, fdp_epsilon_lower_bound
from hf_dp.audit.scoring import (SCORES, gradient_alignment_scores, loss_scores, per_row_losses, trainable_parameters,
                                 trained_loss_scores)

__all__ = ["AUDIT_DIR", "CANARIES_FILE", "REPORT_FILE", "AuditReport",
           "SCORES", "audit_guesses", "audit_report", "audit_training", "choose_score"]

AUDIT_DIR = "_audit"  # under output_dir; `_*` is never uploaded
CANARIES_FILE = "canaries.json"
REPORT_FILE = "report.json"


def choose_score(score: str) -> str:
    """`"white-box"`, `"black-box"` or `"trained-loss"`: `score` itself, or for `"auto"` the black-box score.

    Why black box by default, even where the white-box score is cheap: on our measurements it was the stronger
    attack with text canaries, and the cheaper one. A tiny causal LM with negligible noise (full fine-tuning, 256
    canaries): AUC 0.92 against 0.71, ε lower bounds 2.2 against 0.7; the same with LoRA: 0.86 against 0.66
    (1.3 against 0.6). The loss drop integrates the canary's gradient along the whole training path, while the
    white-box score takes it at θ_0 only, and fine-tuning moves far from θ_0. On the embedded MiniLM with LoRA the
    black-box score needs two batched forward passes over the canaries, the white-box one a backward pass per
    canary (10x the time). White box stays available (`score="white-box"`) for settings where the update is
    closer to linear, e.g. few steps at a small learning rate; `"trained-loss"` (the trained loss alone) for
    canaries drawn alike whose base losses vary more than training moves them (rare-token replies).

    Args:
        score: One of [`SCORES`].

    Raises:
        ValueError: If `score` is not one of [`SCORES`].
    """
    if score not in SCORES:
        raise ValueError(f"score={score!r}: use one of {SCORES}.")
    return "black-box" if score == "auto" else score


def audit_report(
    scores: Sequence[float],
    included: Sequence[bool],
    *,
    delta: float,
    confidence: float = 0.95,
    rows_per_canary: int = 1,
    score: str = "black-box",
    epsilon_upper_bound: float | None = None,
    privacy_unit: str | None = None,
    mechanism: str | None = None,
    guesses: Sequence[tuple[int, int]] | None = None,
) -> AuditReport:
    """Both lower bounds from canary scores (for your own training loop; [`audit_training`] calls it).

    Args:
        scores: One score per canary, higher = more likely trained on.
        included: The canaries' coins (`Canaries.included`).
        delta: δ of the audited guarantee (the run's δ).
        confidence: Probability that each bound holds, in (0, 1).
        rows_per_canary, score, epsilon_upper_bound, privacy_unit, mechanism: Recorded in the report.
        guesses: The (k_plus, k_minus) pairs to try; default [`audit_guesses`]. Fix them before seeing scores.

    Returns:
        [`AuditReport`]; its f-DP bound is None when `delta` is 0.

    Raises:
        ValueError: See [`epsilon_lower_bound`].
    """
    pairs = audit_guesses(len(scores)) if guesses is None else list(guesses)
    steinke = epsilon_lower_bound(scores, included, delta=delta, confidence=confidence, guesses=pairs)
    fdp = fdp_epsilon_lower_bound(scores, included, delta=delta, confidence=confidence, guesses=pairs) \
        if delta > 0 else None
    perfect = np.asarray(included, dtype=bool)
    ceiling = epsilon_lower_bound(perfect.astype(float), perfect, delta=delta, confidence=confidence, guesses=pairs)
    return AuditReport(steinke=steinke, fdp=fdp, rows_per_canary=rows_per_canary, score=score,
                       epsilon_upper_bound=None if epsilon_upper_bound is None else float(epsilon_upper_bound),
                       epsilon_ceiling=ceiling.epsilon_lower_bound, privacy_unit=privacy_unit, mechanism=mechanism)


def audit_training(
    make_trainer: Callable[[Any], Any],
    train_dataset,
    *,
    canaries: int = 256,
    rows_per_canary: int = 1,
    confidence: float = 0.95,
    delta: float | None = None,
    seed: int | None = None,
    user_id_column: str = "user_id",
    text_column: str = "text",
    tokenize: Callable[[Any], Any] | None = None,
    score: str = "auto",
    record_dir: str | Path | None = None,
    progress: bool = False,
    prompt_column: str | None = None,
    system_prompt: str | None = None,
    score_tokenize: Callable[[Any], Any] | None = None,
    score_collator: Callable[[list[dict]], dict] | None = None,
    reply_vocabulary: Sequence[str] | None = None,
) -> AuditReport:
    """Insert canary users, train once, score them, and bound ε from below (Steinke, Nasr & Jagielski 2023).

    Affects the run: the included canaries are training data, users of the run like any other (they enter the
    sample rate and the default δ, which count units). Scoring and the bounds are post-processing of the trained
    model. Audit a separate run of the configuration you release, or say in the card that the released model is
    the audited run (`card_section(audited_model=True)`).

    Args:
        make_trainer: Builds the trainer from the training rows with the canaries in, e.g.
            `lambda rows: DPTrainer(model=..., args=..., train_dataset=rows, data_collator=...)`. Any
            [`~transformers.Trainer`] works; one without `privacy_report` (not DP) needs `delta`.
        train_dataset: The real training rows as a `datasets.Dataset` with exactly the columns `user_id_column`
            (strings), `text_column` and optionally one label column (class indices; its `ClassLabel` or largest
            value gives the classes), or, for chat SFT, `prompt_column` (then `text_column` is the completion),
            before tokenization.
        canaries: Number of canary users m (hundreds give a useful audit).
        rows_per_canary: Rows per canary k: 1 for example-level runs (which audit single rows); at most the
            contribution bound G for user-level runs (G audits the bound's worst case).
        confidence: Probability that each reported bound holds.
        delta: δ of the audited guarantee. Default: the run's δ (`trainer.privacy_report()["delta"]`).
        seed: Seed of the canaries and coins. Default: OS entropy (saved in the record, never in the report).
        user_id_column: The user column (the trainer's `args.user_id_column`).
        text_column: The text column canary text goes into.
        tokenize: Maps a `datasets.Dataset` of raw rows to the trainer's features, row for row, keeping the user
            column (e.g. `lambda d: d.map(tokenizer_fn, batched=True, remove_columns=["text"])`). Default: none
            (the data collator takes raw rows).
        score: `"black-box"`, `"white-box"`, `"trained-loss"` or `"auto"` (black box, [`choose_score`] says why).
        record_dir: Where the canary record and the report go. Default: `trainer.args.output_dir/_audit`.
        progress: Progress bars for the scoring.
        prompt_column: For prompt/completion conversations (TRL's conversational format, e.g. `"prompt"`, with
            `text_column="completion"`): canaries are conversations too, a random user message and a random reply
            ([`make_canaries`]), and are scored on the reply's tokens only.
        system_prompt: The system message the real conversations start with, put first in each canary's prompt.
        score_tokenize: Maps the canaries' raw rows to the scored features (`input_ids` and `labels`, -100 where
            no loss is taken), row for row, when they differ from `tokenize`'s: a trainer that prepares its own
            dataset (`DPSFTTrainer`: `tokenize=None`) needs the rows tokenized as it tokenizes them. Default:
            `tokenize`.
        score_collator: Batches the scored features. Default: `trainer.data_collator`.
        reply_vocabulary: For conversation canaries: words each used by one canary's reply only (e.g.
            [`~hf_dp.audit.canaries.rare_words`] of the tokenizer), so that what a model learns from one canary
            does not show on another ([`make_canaries`]). Default: replies of shared random words.

    Returns:
        [`AuditReport`], also written to `record_dir/report.json`; the canaries and coins are in
        `record_dir/canaries.json`.

    Raises:
        ValueError: Bad settings (canary count, rows per canary beyond G or above 1 at the example level, unknown
            score), columns the canaries cannot match, a trainer on another user column, a `tokenize` that
            drops or adds rows, or no δ for a non-DP trainer; all before training.
    """
    import datasets

    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r}: must be in (0, 1), e.g. 0.95.")
    if delta is not None and not 0 <= delta < 1:
        raise ValueError(f"delta={delta!r}: must be in [0, 1); leave it unset for the run's δ.")
    if score not in SCORES:
        raise ValueError(f"score={score!r}: use one of {SCORES}.")
    label_column, num_labels = _label_column(train_dataset, user_id_column, text_column, prompt_column)
    canary_set = make_canaries(
        canaries, rows_per_canary, seed=secrets.randbits(63) if seed is None else int(seed),
        user_id_column=user_id_column, text_column=text_column, label_column=label_column, num_labels=num_labels,
        prompt_column=prompt_column, system_prompt=system_prompt, reply_vocabulary=reply_vocabulary,
    )
    prepare = tokenize or (lambda dataset: dataset)
    training_rows = prepare(insert(train_dataset, canary_set))
    every_canary = datasets.Dataset.from_list(
        [row for i in range(len(canary_set)) for row in canary_set.rows_of(i)], features=train_dataset.features
    )
    canary_rows = _scoring_rows((score_tokenize or prepare)(every_canary), canary_set)

    trainer = make_trainer(training_rows)
    if hasattr(trainer, "uncounted_user_ids"):  # trained on, left out of the card's numbers of users and rows
        trainer.uncounted_user_ids = frozenset(canary_set.user_ids)
    trainer_column = getattr(trainer.args, "user_id_column", user_id_column)
    if trainer_column != user_id_column:
        raise ValueError(f"the trainer groups users by {trainer_column!r} but the canaries are in {user_id_column!r}: "
                         f"pass user_id_column={trainer_column!r}.")
    privacy = trainer.privacy_report() if hasattr(trainer, "privacy_report") else None
    _check_rows_per_canary(rows_per_canary, privacy)
    if privacy is None and delta is None:
        raise ValueError("the trainer has no privacy_report (not a DPTrainer), so there is no δ to audit at: pass "
                         "delta= (e.g. 1e-5).")
    audit_delta = float(privacy["delta"] if delta is None else delta)
    kind = choose_score(score)

    writes = trainer.is_world_process_zero() if hasattr(trainer, "is_world_process_zero") else True
    folder = Path(record_dir) if record_dir is not None else Path(trainer.args.output_dir) / AUDIT_DIR
    if writes:
        folder.mkdir(parents=True, exist_ok=True)
        canary_set.save(folder / CANARIES_FILE)

    model, collator = trainer.model, score_collator or trainer.data_collator
    flat_rows = [row for rows in canary_rows for row in rows]
    if kind == "black-box":
        base_losses = per_row_losses(model, flat_rows, collator)
    elif kind == "white-box":
        initial = {name: p.detach().clone() for name, p in trainable_parameters(model).items()}
    trainer.train()
    model = trainer.model
    clipper = getattr(trainer, "clipper", None)  # DPTrainer's hooks: nothing to capture while scoring
    with clipper.disabled() if hasattr(clipper, "disabled") else contextlib.nullcontext():
        if kind == "black-box":
            trained_losses = per_row_losses(model, flat_rows, collator)
            scores = loss_scores(_per_canary(trained_losses, canary_rows), _per_canary(base_losses, canary_rows))
        elif kind == "trained-loss":
            scores = trained_loss_scores(_per_canary(per_row_losses(model, flat_rows, collator), canary_rows))
        else:
            scores = gradient_alignment_scores(model, initial, canary_rows, collator, progress=progress)

    privacy = trainer.privacy_report() if hasattr(trainer, "privacy_report") else None
    report = audit_report(
        scores, canary_set.included, delta=audit_delta, confidence=confidence, rows_per_canary=rows_per_canary,
        score=kind, epsilon_upper_bound=None if privacy is None else privacy["epsilon"],
        privacy_unit=None if privacy is None else privacy.get("privacy_unit"),
        mechanism="non-private" if privacy is None else privacy.get("mechanism"),
    )
    if writes:
        (folder / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


# ---- helpers ---------------------------------------------------------------------------------------------


def _label_column(dataset, user_id_column: str, text_column: str,
                  prompt_column: str | None = None) -> tuple[str | None, int | None]:
    """The label column (the one column besides user, text and prompt) and its number of classes, or (None, None)."""
    import datasets

    columns = getattr(dataset, "column_names", None)
    if columns is None:
        raise TypeError(f"train_dataset must be a datasets.Dataset, got {type(dataset).__name__}.")
    for column in (user_id_column, text_column, prompt_column):
        if column is not None and column not in columns:
            raise ValueError(f"train_dataset has no column {column!r} (columns: {columns}); pass user_id_column=, "
                             "text_column= (and prompt_column= for conversations) naming the columns of the raw rows.")
    extra = [c for c in columns if c not in (user_id_column, text_column, prompt_column)]
    if extra and prompt_column is not None:
        raise ValueError(f"train_dataset has columns {extra} besides user, prompt and completion: select those three "
                         "for a chat audit.")
    if not extra:
        return None, None
    if len(extra) > 1:
        raise ValueError(f"train_dataset has columns {extra} besides user and text; canaries can fill one label "
                         f"column: pass dataset.select_columns([{user_id_column!r}, {text_column!r}, <label column>]) "
                         "and tokenize after.")
    label = extra[0]
    feature = dataset.features[label]
    if isinstance(feature, datasets.ClassLabel):
        return label, feature.num_classes
    if getattr(feature, "dtype", "").startswith(("int", "uint")):
        return label, max(2, int(max(dataset[label])) + 1)
    raise ValueError(f"column {label!r} holds {feature}, not class indices: canaries draw integer labels; encode the "
                     "labels as class indices (or a ClassLabel) first.")


def _check_rows_per_canary(rows_per_canary: int, privacy: Mapping | None) -> None:
    if privacy is None:
        return
    if privacy.get("privacy_unit") == "example" and rows_per_canary != 1:
        raise ValueError(f"rows_per_canary={rows_per_canary} with privacy_unit='example': an example-level run "
                         "protects single rows, so its audit uses single-row canaries; pass rows_per_canary=1.")
    bound = privacy.get("contribution_bound")
    if privacy.get("privacy_unit") == "user" and bound is not None and rows_per_canary > bound:
        raise ValueError(f"rows_per_canary={rows_per_canary} exceeds the contribution bound G = {bound}: the bound "
                         f"would drop canary rows that the audit scores; pass rows_per_canary <= {bound}.")


def _scoring_rows(features, canary_set: Canaries) -> list[list[dict]]:
    """Each canary's tokenized rows as the data collator takes them (no user, text, prompt or other string
    columns)."""
    expected = len(canary_set) * len(canary_set.rows[0])
    if len(features) != expected:
        raise ValueError(f"tokenize (or score_tokenize) turned {expected} canary rows into {len(features)}: it must "
                         "map rows one to one (no filtering, no packing, a max_length that leaves every row a target).")
    raw = (canary_set.user_id_column, canary_set.text_column, canary_set.prompt_column)
    drop = [c for c in features.column_names if c in raw
            or getattr(features.features[c], "dtype", None) in ("string", "large_string")]
    features = features.remove_columns(drop)
    rows = [features[i] for i in range(len(features))]
    k = len(canary_set.rows[0])
    return [rows[i * k : (i + 1) * k] for i in range(len(canary_set))]


def _per_canary(losses: np.ndarray, canary_rows: Sequence[Sequence[dict]]) -> list[np.ndarray]:
    out, start = [], 0
    for rows in canary_rows:
        out.append(losses[start : start + len(rows)])
        start += len(rows)
    return out
