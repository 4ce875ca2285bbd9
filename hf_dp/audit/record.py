"""The audit report beside a model card, read back and checked: what its "## Empirical audit" section may state.

[`~hf_dp.audit.AuditReport.write_to_card`] saves the report the section is rendered from as `dp_audit.json` beside
`README.md`, with the `audited_model` flag it was rendered with, then puts the section into the card. `hf-dp publish`
([`hf_dp.card_check`]) reads the file back ([`read_audit_record`]), checks what its figures can prove about one
another ([`check_audit_record`]), renders the section again with [`~hf_dp.audit.AuditReport.card_section`] and
refuses a card whose section is not that rendering.

What the file cannot prove: the canaries' scores and coins are not in it (the coins stay in `output_dir/_audit/`,
never uploaded), and the ledger of a separate audited run is not beside the card, so its proven ε is checked only
against this run's target ε. Post-processing only: nothing here changes a guarantee.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Mapping

from hf_dp.audit.estimator import STEINKE, audit_guesses, epsilon_lower_bound, steinke_p_value
from hf_dp.audit.report import AUDIT_FILE, AuditReport
from hf_dp.audit.scoring import SCORES

__all__ = ["AUDIT_FILE", "check_audit_record", "read_audit_record"]

_TOLERANCE = 1e-6  # the estimator's bisection tolerance, relative to max(1, ε)
_LARGEST = 500.0  # half the estimator's search cap: above it the bisection may stop early
_REL = 1e-9  # figures recomputed from the same inputs: floating point only


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
