"""An audit's result: the measured ε lower bound beside the proven ε, and the card section that states both.

[`AuditReport`] is what [`hf_dp.audit.audit_training`] returns and saves; its `card_section()` is the model card's
"Empirical audit" section and `write_to_card(model_dir)` puts it there with the report beside it (`dp_audit.json`,
which [`hf_dp.audit.record`] reads back and checks for `hf-dp publish`). Post-processing only: nothing here changes
a guarantee.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Mapping

from hf_dp.audit.estimator import AuditResult

__all__ = ["AUDIT_FILE", "AuditReport"]

AUDIT_FILE = "dp_audit.json"  # beside README.md: the report its "Empirical audit" section is rendered from

_SECTION_TITLE = "## Empirical audit"
_SCORE_TEXT = {
    "white-box": "white box: how far the training update went along the canary's own loss gradient at the start, "
                 "−<θ_T − θ_0, ∇L(θ_0)> / ‖∇L(θ_0)‖ over the trainable weights",
    "black-box": "black box: the drop of the canary's loss from the public-only base model to the trained model",
    "trained-loss": "black box: the canary's loss under the trained model alone (lower = guessed trained on)",
}


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The outcome of an empirical audit, beside the proven guarantee.

    Attributes:
        steinke: Steinke, Nasr & Jagielski's bound (no assumption on the training algorithm): the headline.
        fdp: Mahloujifar, Melis & Chaudhuri's f-DP bound, valid only for algorithms whose trade-off curve is
            Gaussian (μ-GDP). Poisson-subsampled DP-SGD's is not, and on ε-DP randomized response it went above the
            true ε in 20 of 40 runs at ε = 1 and 40 of 40 at ε = 2 (`tests/audit/test_estimator.py`): a diagnostic
            kept in the JSON, never reported as a bound (the card and the summary report Steinke's alone). None when
            δ = 0.
        rows_per_canary: Rows of each canary user k.
        score: `"white-box"`, `"black-box"` or `"trained-loss"`.
        epsilon_upper_bound: The accountant's ε for the audited run (None: trained without DP).
        epsilon_ceiling: The largest Steinke bound this audit could have shown (every guess right): with m
            canaries no audit result exceeds it, whatever the training algorithm.
        privacy_unit: `"user"` or `"example"` (None: not a DP run).
        mechanism: The audited run's key of [`~hf_dp.vocabulary.MECHANISMS`]: `"uls"`, `"els"`, `"example"`, or
            `"non-private"` for a plain Trainer.
    """

    steinke: AuditResult
    fdp: AuditResult | None
    rows_per_canary: int
    score: str
    epsilon_upper_bound: float | None = None
    epsilon_ceiling: float | None = None
    privacy_unit: str | None = None
    mechanism: str | None = None

    @property
    def epsilon_lower_bound(self) -> float:
        """ε refuted with probability ≥ `confidence` (Steinke et al.; no assumption)."""
        return self.steinke.epsilon_lower_bound

    @property
    def fdp_epsilon_lower_bound(self) -> float | None:
        """ε refuted assuming a Gaussian trade-off curve (None when not computed)."""
        return None if self.fdp is None else self.fdp.epsilon_lower_bound

    @property
    def canaries(self) -> int:
        """Number of canary users m."""
        return self.steinke.canaries

    @property
    def confidence(self) -> float:
        return self.steinke.confidence

    @property
    def delta(self) -> float:
        return self.steinke.delta

    @property
    def exceeds_upper_bound(self) -> bool:
        """Whether the audit refutes the proven ε (Steinke's bound above it): a bug in training or accounting."""
        return self.epsilon_upper_bound is not None and self.epsilon_lower_bound > self.epsilon_upper_bound

    @property
    def failed(self) -> bool:
        """The audit FAILED: its lower bound exceeds the proven ε (the same as `exceeds_upper_bound`)."""
        return self.exceeds_upper_bound

    @property
    def verdict(self) -> str:
        """One line for the report, the JSON, the CLI and the card: FAILED (lower bound > proven ε) or passed."""
        lower = _round_down(self.epsilon_lower_bound)
        if self.epsilon_upper_bound is None:
            return f"no proven ε to check (trained without DP); lower bound {lower}"
        upper = _round_up(self.epsilon_upper_bound)
        if self.failed:
            return (f"the audit FAILED: lower bound {lower} > proven ε {upper}: the implementation is broken "
                    "(sampling, clipping, noise or accounting), or the run was not trained as its card says")
        ceiling = _round_down(self.epsilon_ceiling)
        return f"the audit passed: lower bound {lower} <= proven ε {upper} (ceiling {ceiling})"

    def to_dict(self) -> dict:
        """A JSON-ready dict: the headline numbers first, then each estimator's full result."""
        return {
            "epsilon_lower_bound": self.epsilon_lower_bound,
            "fdp_epsilon_lower_bound": self.fdp_epsilon_lower_bound,
            "epsilon_upper_bound": self.epsilon_upper_bound,
            "exceeds_upper_bound": self.exceeds_upper_bound,
            "audit_failed": self.failed,
            "verdict": self.verdict,
            "epsilon_ceiling": self.epsilon_ceiling,
            "delta": self.delta,
            "confidence": self.confidence,
            "canaries": self.canaries,
            "rows_per_canary": self.rows_per_canary,
            "included": self.steinke.included,
            "guesses": list(self.steinke.guesses),
            "correct": self.steinke.correct,
            "score": self.score,
            "privacy_unit": self.privacy_unit,
            "mechanism": self.mechanism,
            "steinke": self.steinke.to_dict(),
            "fdp": None if self.fdp is None else self.fdp.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AuditReport:
        """Rebuild a report from `to_dict()` (e.g. `output_dir/_audit/report.json`)."""

        def result(entry):
            return None if entry is None else AuditResult(**{**entry, "guesses": tuple(entry["guesses"])})

        return cls(steinke=result(data["steinke"]), fdp=result(data.get("fdp")),
                   rows_per_canary=int(data["rows_per_canary"]), score=data["score"],
                   epsilon_upper_bound=data.get("epsilon_upper_bound"), epsilon_ceiling=data.get("epsilon_ceiling"),
                   privacy_unit=data.get("privacy_unit"), mechanism=data.get("mechanism"))

    def card_section(self, *, audited_model: bool = False) -> str:
        """The model card's "## Empirical audit" section (markdown).

        Args:
            audited_model: True when the card's model is the audited run itself (its training data held the
                included canaries); False (the default) when the audit was a separate run of the same
                configuration, the usual case.

        Returns:
            The section, starting with its "## Empirical audit" heading, ending with a newline.
        """
        m, k, c = self.canaries, self.rows_per_canary, self.confidence
        unit = {"user": "user", "example": "example (row)"}.get(self.privacy_unit or "", "user")
        upper = "∞ (trained without DP: no guarantee)" if self.epsilon_upper_bound is None \
            else _round_up(self.epsilon_upper_bound)
        run = ("this model's own training run (its training data held the included canaries: synthetic users with "
               "random content, nothing about real users)") if audited_model else \
            "a separate training run with this model's configuration and data, plus the canaries"
        rows = "one row" if k == 1 else f"{k} rows"
        lower = _round_down(self.epsilon_lower_bound)
        lines = [_SECTION_TITLE, ""]
        if self.failed:
            lines += [f"**WARNING: {self.verdict}.** Do not rely on the stated guarantee until the cause is found.", ""]
        lines += [
            f"An empirical check of the implementation, not part of the guarantee: a one-run privacy audit (Steinke, "
            f"Nasr and Jagielski 2023) of {run}. {m} canary users with {rows} each (random text that cannot occur in "
            "real data) were each added to the training data by an independent fair coin, recorded apart from the "
            "training data. They went through the same contribution bound, sampling, clipping and noise as real "
            f"users. After training every canary was scored ({_SCORE_TEXT.get(self.score, self.score)}), and the "
            "audit guessed which canaries had been trained on: the more correct guesses, the larger the ε they rule "
            "out.",
            "",
            "| Audit | Value |",
            "|---|---|",
            f"| Empirical lower bound on ε (Steinke et al. 2023; no assumption) | **{lower}** |",
            f"| Proven upper bound on ε (the accountant) | {upper} |",
            f"| δ of the bounds | {self.delta:.3g} |",
            f"| Confidence | {_percent(c)} (corrected for the {self.steinke.hypotheses} guess counts tried) |",
            f"| Canary {unit}s m; rows per canary k | {m}; {k} |",
            f"| Guesses made; correct | {sum(self.steinke.guesses)}; {self.steinke.correct} |",
            f"| Largest lower bound {m} canaries could show (every guess right) | "
            f"{_round_down(self.epsilon_ceiling)} |",
            "",
        ]
        if self.epsilon_lower_bound > 0:
            lines.append(f"**What it shows.** With {_percent(c)} confidence the audited run does not satisfy (ε, δ)-DP "
                         f"for any ε below {lower}, whatever the proof says.")
        else:
            lines.append(f"**What it shows.** At {_percent(c)} confidence the guesses were no better than chance: the "
                         "audit refutes no ε > 0 and found nothing at odds with the proof.")
        if self.failed:
            lines.append(
                f"**The audit FAILED: this lower bound exceeds the proven ε = {upper}.** The implementation or its "
                "accounting is broken (or this run was not trained as the card says): do not rely on the stated "
                "guarantee until the cause is found."
            )
        else:
            lines.append(
                "A lower bound well below the proven ε is expected: the canaries and the guesser are far weaker than "
                "the worst case the proof covers, and one run with m canaries cannot show more than the ceiling in "
                "the table. A lower bound above the proven ε would reveal a bug."
            )
        lines += [
            "",
            "**What it does not show.** The audit checks the implementation (sampling, clipping, noise and "
            "accounting, as they ran); it does not tighten the guarantee. The proven ε above is what the model "
            "offers, however small the lower bound: a lower bound of 0 does not mean the model is more private. "
            "The audit says nothing about what the guarantee does not cover. Canaries are not counted in the "
            "evaluation or in the public-only baseline.",
            "",
        ]
        return "\n".join(lines)

    def write_to_card(self, model_dir: str | Path, *, audited_model: bool = False) -> Path:
        """Put `card_section()` into `model_dir/README.md` (replacing an earlier "Empirical audit" section, or
        appended), and this report, with `audited_model`, into `model_dir/dp_audit.json` beside it: `hf-dp publish`
        renders the section again from that file and refuses a card whose section differs.

        Args:
            model_dir: Folder holding the model card (README.md).
            audited_model: See `card_section`.

        Returns:
            The README path.

        Raises:
            FileNotFoundError: If there is no README.md (write the privacy card first).
        """
        return _write_card_section(self, model_dir, audited_model=audited_model)


def _round_down(value: float | None, decimals: int = 2) -> str:
    if value is None:
        return "-"
    return f"{math.floor(value * 10**decimals) / 10**decimals:.{decimals}f}"


def _round_up(value: float, decimals: int = 2) -> str:
    return f"{math.ceil(value * 10**decimals - 1e-9) / 10**decimals:.{decimals}f}"


def _percent(confidence: float) -> str:
    return f"{100 * confidence:g} %"


def _write_card_section(report, model_dir: str | os.PathLike, *, audited_model: bool = False) -> Path:
    """Save `report` as `model_dir/dp_audit.json` (with `audited_model`), then put its section into the card.

    Both files are written atomically (a temporary file, then a rename), the report first: a card whose section
    its report does not render is refused by `hf-dp publish`, never published.

    Returns:
        The README path.

    Raises:
        FileNotFoundError: no `model_dir/README.md` (write the privacy card first).
    """
    path = Path(model_dir) / "README.md"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: write the privacy card first (trainer.write_privacy_card).")
    text = path.read_text(encoding="utf-8")
    section = report.card_section(audited_model=audited_model)
    pattern = re.compile(rf"^{re.escape(_SECTION_TITLE)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section
    text = _with_composition_item(text, separate=not audited_model)
    record = {**report.to_dict(), "audited_model": bool(audited_model)}
    _write_atomically(path.parent / AUDIT_FILE, json.dumps(record, indent=2) + "\n")
    _write_atomically(path, text)
    return path


def _with_composition_item(text: str, *, separate: bool) -> str:
    """The card's not-covered list with the item saying how a separate audit run composes with this one (as
    [`~hf_dp.card.render_privacy_card`] writes it beside an audit section), or without it when the audited run is
    this model's own: scoring that model is post-processing, nothing to compose."""
    from hf_dp.card import AUDIT_COMPOSITION_ITEM

    item = "- " + AUDIT_COMPOSITION_ITEM
    lines = [line for line in text.split("\n") if line.rstrip() != item]
    if separate and "Not covered:" in lines:
        start = lines.index("Not covered:")
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")), len(lines))
        last = max((i for i in range(start, end) if lines[i].startswith("- ")), default=start + 1)
        lines.insert(last + 1, item)
    return "\n".join(lines)


def _write_atomically(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
