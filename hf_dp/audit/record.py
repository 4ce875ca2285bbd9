"""The audit report beside a model card: what its "## Empirical audit" section states, kept where publishing sees it.

[`write_card_section`] (what [`~hf_dp.audit.AuditReport.write_to_card`] does) saves the report the section is
rendered from as `dp_audit.json` beside `README.md`, with the `audited_model` flag it was rendered with, then puts
the section into the card. `hf-dp publish` ([`hf_dp.card_check`]) reads the file back ([`read_audit_record`]),
checks what its figures can prove about one another ([`check_audit_record`]), renders the section again with
[`~hf_dp.audit.AuditReport.card_section`] and refuses a card whose section is not that rendering.

What the file cannot prove: the canaries' scores and coins are not in it (the coins stay in `output_dir/_audit/`,
never uploaded), and the ledger of a separate audited run is not beside the card, so its proven ε is checked only
against this run's target ε. Post-processing only: nothing here changes a guarantee.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Mapping

from hf_dp.audit.estimator import STEINKE, epsilon_lower_bound, steinke_p_value

__all__ = ["AUDIT_FILE", "check_audit_record", "read_audit_record", "write_card_section"]

AUDIT_FILE = "dp_audit.json"  # beside README.md: the report its "Empirical audit" section is rendered from
SECTION_TITLE = "## Empirical audit"
_TOLERANCE = 1e-6  # the estimator's bisection tolerance, relative to max(1, ε)
_LARGEST = 500.0  # half the estimator's search cap: above it the bisection may stop early
_REL = 1e-9  # figures recomputed from the same inputs: floating point only


def write_card_section(report, model_dir: str | os.PathLike, *, audited_model: bool = False) -> Path:
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
    pattern = re.compile(rf"^{re.escape(SECTION_TITLE)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
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


def read_audit_record(model_dir: str | os.PathLike) -> dict | None:
    """`model_dir/dp_audit.json` as a dict, or None when there is none.

    Raises:
        ValueError: a file that is not a JSON object (one line).
    """
    path = Path(model_dir) / AUDIT_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"its audit report ({AUDIT_FILE}) is not JSON ({str(error).splitlines()[0]})") from error
    if not isinstance(record, dict):
        raise ValueError(f"its audit report ({AUDIT_FILE}) holds a {type(record).__name__}, not a report")
    return record


def check_audit_record(record: Mapping[str, Any]):
    """The report and `audited_model` flag of an audit file, once its figures agree with one another.

    Checked: it is a report [`~hf_dp.audit.AuditReport.to_dict`] wrote (every key as the report rebuilt from it
    writes it again, so the verdict and `audit_failed` follow from the lower bound and the audited ε as
    [`~hf_dp.audit.AuditReport`] computes them); its counts are possible (included ≤ m, correct ≤ guesses, and no
    more than the coins allow); its lower bound is the one Steinke et al.'s test gives for those counts, at its δ and
    confidence split over its guess counts; its ceiling is at least that bound, and is the ceiling of m canaries
    when its guess counts are the default ones.

    Returns:
        `(report, audited_model)`.

    Raises:
        ValueError: one line naming the figure that does not follow.
    """
    from hf_dp.audit.report import AuditReport
    from hf_dp.audit.run import audit_guesses

    flag = record.get("audited_model")
    if not isinstance(flag, bool):
        raise ValueError(f"its audit report ({AUDIT_FILE}) records audited_model = {flag!r}, not true or false")
    written = {key: value for key, value in record.items() if key != "audited_model"}
    try:
        report = AuditReport.from_dict(written)
        again = report.to_dict()
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"its audit report ({AUDIT_FILE}) is not one AuditReport.to_dict wrote "
                         f"({type(error).__name__}: {error})") from error
    for key in sorted(set(written) | set(again)):
        if written.get(key) != again.get(key):
            raise ValueError(f"its audit report ({AUDIT_FILE}) says {key} = {written.get(key)!r}, but its own figures "
                             f"give {again.get(key)!r}: the file was edited")
    _check_types(report)
    result = report.steinke
    m, kept, (k_plus, k_minus), v = result.canaries, result.included, result.guesses, result.correct
    possible = (result.method == STEINKE and m >= 2 and 0 <= kept <= m and k_plus >= 0 and k_minus >= 0
                and 1 <= k_plus + k_minus <= m and 0 <= v <= min(k_plus, kept) + min(k_minus, m - kept)
                and result.hypotheses >= 1 and 0 <= result.delta < 1 and 0 < result.confidence < 1
                and report.rows_per_canary >= 1)
    if not possible:
        raise ValueError(f"its audit report ({AUDIT_FILE}) has counts no audit gives (m = {m}, included = {kept}, "
                         f"guesses = {result.guesses}, correct = {v}, method {result.method!r}): the file was edited")
    _check_lower_bound(result)
    ceiling = report.epsilon_ceiling
    if ceiling is None or ceiling < result.epsilon_lower_bound * (1 - _REL):
        raise ValueError(f"its audit report ({AUDIT_FILE}) has ceiling {ceiling!r} below its lower bound "
                         f"{result.epsilon_lower_bound!r}: no audit gives that; the file was edited")
    pairs = audit_guesses(m)
    if result.hypotheses == len(pairs):
        perfect = [True] * kept + [False] * (m - kept)
        most = epsilon_lower_bound([float(x) for x in perfect], perfect, delta=result.delta,
                                   confidence=result.confidence, guesses=pairs).epsilon_lower_bound
        if abs(most - ceiling) > _REL * max(1.0, most):
            raise ValueError(f"its audit report ({AUDIT_FILE}) has ceiling {ceiling!r}, but {m} canaries ({kept} "
                             f"included) can show at most {most!r}: the file was edited")
    return report, flag


def _check_types(report) -> None:
    """Counts are integers, figures finite numbers, and the score one the section has words for (the section
    writes it into the card)."""
    from hf_dp.audit.run import SCORES

    result = report.steinke
    counts = {"canaries": result.canaries, "included": result.included, "correct": result.correct,
              "hypotheses": result.hypotheses, "rows_per_canary": report.rows_per_canary, "guesses": result.guesses}
    figures = {"epsilon_lower_bound": result.epsilon_lower_bound, "delta": result.delta,
               "confidence": result.confidence, "epsilon_ceiling": report.epsilon_ceiling,
               "epsilon_upper_bound": report.epsilon_upper_bound}
    optional = ("epsilon_ceiling", "epsilon_upper_bound")

    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def finite(value) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

    bad = [name for name, value in counts.items()
           if not (integer(value) or name == "guesses" and len(value) == 2 and all(map(integer, value)))]
    bad += [name for name, value in figures.items() if not (finite(value) or value is None and name in optional)]
    if report.score not in SCORES or report.score == "auto":
        bad.append("score")
    if bad:
        value = {**counts, **figures, "score": report.score}[bad[0]]
        raise ValueError(f"its audit report ({AUDIT_FILE}) has {bad[0]} = {value!r}, which no audit writes: the file "
                         "was edited")


def _check_lower_bound(result) -> None:
    """ε is refuted by `correct` right of `guesses` at the split level, and nothing more than the search tolerance
    above it is (the p-value grows with ε)."""
    m, r, v, delta = result.canaries, sum(result.guesses), result.correct, result.delta
    level = (1 - result.confidence) / result.hypotheses
    epsilon = result.epsilon_lower_bound
    refuted = epsilon >= 0 and (epsilon == 0 or steinke_p_value(m, r, v, epsilon, delta) < level)
    above = epsilon + 2 * _TOLERANCE * max(1.0, epsilon)
    if not refuted or (epsilon < _LARGEST and steinke_p_value(m, r, v, above, delta) < level):
        raise ValueError(f"its audit report ({AUDIT_FILE}) states the lower bound {epsilon!r}, which {v} right of {r} "
                         f"guesses among {m} canaries do not give at δ = {delta:g} and "
                         f"{100 * result.confidence:g} % confidence over {result.hypotheses} guess counts: the file "
                         "was edited")
