"""What a privacy card may claim: exactly the card hf_dp renders from the run's verified ledger, and nothing else.

`hf-dp publish` ([`hf_dp.publish_check.check_privacy_card`]) reads every privacy figure from the ledger saved
beside the card (`dp_ledger.json`), never from the card:

1. [`expected_report`]: the ledger written by [`~hf_dp.DPTrainer.privacy_ledger`] holds the accountant's state and,
   under `report`, the run's own privacy report less what the accountant computes (σ, C, G, q, the target ε, the
   users and examples, the seed and noise source, ...). Those facts are checked against the accountant's state
   (every step's q and σ_eff, G as the mixture size, the ε-DP choice of G, δ, the step count, the noise sampler),
   and ε, its bounds, δ and the group-privacy ε are recomputed from it. The result is the report the card must state.
2. [`check_card_claims`]: the card's `privacy:` block must equal that report, key for key; the card hf_dp renders
   from it (with the card's own base model, dataset, task and evaluation) must appear in the card line for line,
   in order; every line the card adds — an appended section, an HTML comment, a table row, an extra not-covered
   item, a YAML comment or key — must state no privacy claim: no ε, δ, σ, "DP", "differential", "privacy",
   "guarantee", noise, clipping or sample rate, and no count of users, examples, rows or steps. Text is compared
   after Unicode NFKC and HTML unescaping, so `&epsilon;` or a mathematical ε count as ε.

3. [`check_audit_section`]: the "## Empirical audit" section ([`~hf_dp.audit.AuditReport.write_to_card`]) must be
   what [`~hf_dp.audit.AuditReport.card_section`] renders from the audit report saved beside the card
   (`dp_audit.json`), with the `audited_model` flag recorded there, line for line. The file's figures must agree with
   one another ([`hf_dp.audit.record.check_audit_record`]: the lower bound from its counts, the verdict from the
   bound and the audited ε) and with the ledger: the same mechanism and privacy unit; when the card's model is the
   audited run, its ε; when the audit was a separate run, whose ledger is not here, no more than this run's target ε.

Post-processing only: nothing here changes a guarantee, it refuses cards that state one the run did not earn.
"""

from __future__ import annotations

import difflib
import html
import math
import numbers
import re
import unicodedata
from typing import Any, Mapping

__all__ = ["AuditSectionError", "CardClaimError", "RECOMPUTED_KEYS", "check_audit_section", "check_card_claims",
           "expected_report", "ledger_facts", "read_audit"]

# Report keys the publish check recomputes from the accountant's state; every other report key is a recorded fact.
RECOMPUTED_KEYS = ("epsilon", "epsilon_lower", "epsilon_estimate", "delta", "delta_floating_point",
                   "epsilon_training", "epsilon_group_privacy")
_EPSILON_KEYS = ("epsilon", "epsilon_lower", "epsilon_estimate", "epsilon_training", "epsilon_group_privacy")
_EPSILON_RTOL = 1e-6  # ε recomputed by the accountant: floating point only
_RTOL = 1e-9  # recorded figures that went through JSON and YAML
AUDIT_HEADING = "## Empirical audit"
_AUDIT_HOW = ("Regenerate the section and its report with hf_dp: AuditReport.write_to_card(model_dir) "
              "(AuditReport.from_dict of output_dir/_audit/report.json, with the same audited_model), or rerun `hf-dp "
              "audit`; or remove the section")
# A privacy claim in text the card adds (matched on NFKC-normalised, HTML-unescaped, case-folded text).
_CLAIM = re.compile(
    r"ε|epsilon|δ|delta|σ|sigma|(?<![a-z0-9_])dp(?![a-z0-9_])|differential|privacy|guarantee|anonymi|noise|clip"
    r"|sampl(e|ing)[ _-]?rate|contribution[ _-]?bound|max_grad_norm|poisson"
    r"|\d[\d,._ ]*\s*(k|m|thousand|million)?\s*(users?|examples?|rows?|steps?)\b")


class CardClaimError(ValueError):
    """The card states a privacy figure or claim its ledger does not prove (one line, the figure named)."""


class AuditSectionError(CardClaimError):
    """The card's "Empirical audit" section is not what its audit report (`dp_audit.json`) renders, or that report's
    figures do not follow from one another or from the ledger (one line, saying how to regenerate it)."""


def ledger_facts(report: Mapping[str, Any]) -> dict:
    """The part of a trainer's privacy report the ledger records for publishing: every key but those the
    accountant recomputes ([`RECOMPUTED_KEYS`])."""
    return {key: value for key, value in report.items() if key not in RECOMPUTED_KEYS}


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _same(a, b, rtol: float = _RTOL) -> bool:
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return math.isclose(x, y, rel_tol=rtol, abs_tol=0.0)
    return a == b and type(a) is type(b) or (a is None and b is None)


def expected_report(ledger: Mapping[str, Any], accountant, *, sampler_delta) -> dict:
    """The privacy report a card of this ledger must state: its recorded facts, checked against the accountant's
    state, and the figures recomputed from it.

    Args:
        ledger (`Mapping`): the ledger beside the card (`dp_ledger.json`), with its `report` facts.
        accountant ([`~hf_dp.accounting.PrivacyAccountant`]): its accountant state, loaded.
        sampler_delta (`Callable[[float], float]`): δ the noise sampler adds at a given total ε over the steps.

    Raises:
        CardClaimError: no facts (a ledger written before publishing checked every figure), or facts that do not
            match the accountant (an edited ledger).
    """
    from .mechanisms import MECHANISMS, get_mechanism
    from .accounting.ledger import ACCOUNTANT_NAME

    facts = ledger.get("report")
    if not isinstance(facts, Mapping):
        raise CardClaimError("its ledger records ε's inputs but not the run's other privacy figures (σ, C, G, users, "
                             "target ε, noise seed): it was written before hf_dp checked every figure a card states")
    key, delta = facts.get("mechanism"), _number(ledger.get("delta"))
    mechanism = get_mechanism(key) if key in MECHANISMS and MECHANISMS[key].is_private else None
    if mechanism is None or delta is None:
        raise CardClaimError(f"its ledger's report names mechanism {key!r} and δ {ledger.get('delta')!r}")
    bound, sigma_eff, rate = facts.get("contribution_bound"), facts.get("effective_noise_multiplier"), \
        facts.get("sample_rate")
    recorded = {"steps": accountant.steps, "mechanism": ledger.get("mechanism"),
                "privacy_unit": ledger.get("privacy_unit"), "sampling": ledger.get("sampling"),
                "delta_accountant": delta, "noise_reach": (ledger.get("noise") or {}).get("reach"),
                "contribution_bound_epsilon": accountant.pure_dp_epsilon,
                "mechanism_description": MECHANISMS[key].description,
                "accountant": ACCOUNTANT_NAME + mechanism.accountant_note}
    for name, value in recorded.items():
        if name in facts and not _same(facts[name], value):
            raise CardClaimError(f"its ledger's report says {name} = {facts[name]!r} but its accountant records "
                                 f"{value!r}: the ledger was edited")
    for i, segment in enumerate(accountant.history):
        found = (segment["sample_rate"], segment["effective_noise_multiplier"], segment["group_size"])
        wanted = (rate, sigma_eff, mechanism.group_size(bound))
        if not all(_same(a, b) for a, b in zip(found, wanted)):
            raise CardClaimError(f"its accountant's segment {i} has (q, σ_eff, group size) = {found}, but its report "
                                 f"says {wanted}: the ledger was edited")
    _check_noise_chain(facts)
    seed = facts.get("noise_seed")
    if bool(facts.get("no_guarantee")) != (seed not in (None, "os-entropy")):
        raise CardClaimError(f"its ledger's report has noise_seed = {seed!r} and no_guarantee = "
                             f"{facts.get('no_guarantee')!r}: a fixed seed is no guarantee, and only a fixed seed")
    lower, estimate, upper = accountant.epsilon_bounds(delta) if accountant.steps else \
        (accountant.pure_dp_epsilon,) * 3
    added = sampler_delta(upper)
    loose = mechanism.group_privacy_epsilon(
        sample_rate=rate, noise_multiplier=sigma_eff, steps=accountant.steps, delta=delta,
        group_size=mechanism.group_size(bound)) if accountant.steps else None
    computed = {"epsilon": upper, "epsilon_lower": lower, "epsilon_estimate": estimate, "delta": delta + added,
                "delta_floating_point": added, "epsilon_training": upper - accountant.pure_dp_epsilon,
                "epsilon_group_privacy": None if loose is None else loose + accountant.pure_dp_epsilon}
    return {**dict(facts), **computed}


def _check_noise_chain(facts: Mapping[str, Any]) -> None:
    """σ_eff is what σ, σ_log and σ_b compose to (so an edited σ is caught with the accountant's σ_eff)."""
    from .accounting.adaptive_noise import StepReleases

    sigma, logged, count = (_number(facts.get(k)) for k in ("noise_multiplier", "logging_noise_multiplier",
                                                             "clipping_count_noise"))
    if sigma is None or not sigma > 0:
        raise CardClaimError(f"its ledger's report has noise_multiplier = {facts.get('noise_multiplier')!r}")
    composed = StepReleases(logged / sigma if logged else None, count).effective_noise_multiplier(sigma)
    if not _same(composed, facts.get("effective_noise_multiplier")):
        raise CardClaimError(f"its ledger's report has σ = {sigma:g}, which composes to σ_eff = {composed:.6g}, not "
                             f"the {facts.get('effective_noise_multiplier')!r} its accountant used: the ledger was "
                             "edited")


def check_card_claims(privacy: Mapping[str, Any], metadata: Mapping[str, Any], front_matter: str, text: str,
                      expected: Mapping[str, Any], *, audit: Mapping[str, Any] | None = None) -> None:
    """Refuse a card whose privacy block is not `expected`, that lacks a line hf_dp renders from it, that adds a
    privacy claim anywhere, or whose audit section is not what `audit` renders (see the module docstring).

    Args:
        audit (`Mapping`, *optional*): the audit report beside the card (`dp_audit.json`), None when there is none.

    Raises:
        CardClaimError: one line naming the figure or the line ([`AuditSectionError`] for the audit section).
    """
    for key in sorted(set(privacy) | set(expected)):
        stated, proven = privacy.get(key), expected.get(key)
        rtol = _EPSILON_RTOL if key in _EPSILON_KEYS else _RTOL
        if key not in expected:
            raise CardClaimError(f"its privacy: block states {key} = {stated!r}, which its ledger does not record")
        if not _same(stated, proven, rtol):
            raise CardClaimError(f"the card says {key} = {stated!r} but its ledger proves {key} = {proven!r}")
    rendered = _rendered(expected, metadata, text, check_audit_section(text, audit, expected))
    _check_metadata(metadata, front_matter, rendered)
    _check_lines(text, rendered.text)


def _rendered(expected: Mapping[str, Any], metadata: Mapping[str, Any], text: str,
              audit: tuple[str, bool] | None):
    """The card hf_dp renders from the verified report, with the card's own non-privacy inputs and `audit`, the
    audit section its audit report renders and whether it reports on this model's own run (then no not-covered item
    on composing two runs: [`~hf_dp.audit.AuditReport.write_to_card`] writes the card so)."""
    from huggingface_hub import ModelCard

    from .card import LIBRARY_ITEMS, render_privacy_card

    evaluation = metadata.get("dp_evaluation") or {}
    title = re.search(r"(?m)^# (.+)$", text)
    datasets = metadata.get("datasets") or []
    local = "Fine-tuned from a local model" in text
    base_model = metadata.get("base_model") or ("./a-local-model" if local else None)
    kwargs = {"base_model": base_model if isinstance(base_model, str) else None,
              "dataset_name": datasets[0] if isinstance(datasets, list) and datasets else None,
              "task": metadata.get("pipeline_tag") or "text-classification",
              "library_name": metadata.get("library_name") or "transformers",
              "model_name": title.group(1).strip() if title else None,
              "audit_section": audit[0] if audit and not audit[1] else None,
              "extra_not_covered": [item for item in LIBRARY_ITEMS if f"- {item}" in text],  # hf_dp's own items
              **{key: evaluation.get(key) for key in ("eval_result", "baseline_result", "non_private_result")},
              "metric_name": evaluation.get("metric_name") or "accuracy"}
    try:
        content = str(render_privacy_card(dict(expected), **kwargs))
        if audit and audit[1]:
            content = content.rstrip("\n") + "\n\n" + audit[0].strip() + "\n"
        return ModelCard(content)
    except (ValueError, TypeError, KeyError) as error:
        raise CardClaimError(f"the card hf_dp renders from its ledger cannot be built ({error})") from error


def read_audit(model_dir) -> dict | None:
    """The audit report beside a card (`model_dir/dp_audit.json`), or None when there is none.

    Raises:
        AuditSectionError: a file that is not a JSON object.
    """
    from .audit.record import read_audit_record

    try:
        return read_audit_record(model_dir)
    except ValueError as error:
        raise AuditSectionError(f"{error}. {_AUDIT_HOW}") from error


def check_audit_section(text: str, audit: Mapping[str, Any] | None,
                        expected: Mapping[str, Any]) -> tuple[str, bool] | None:
    """The card's "## Empirical audit" section as hf_dp renders it from `audit`, and the `audited_model` flag it
    was rendered with (None when the card has no such section).

    Args:
        text (`str`): the card's text (no front matter).
        audit (`Mapping`, *optional*): the audit report beside the card (`dp_audit.json`), None when there is none.
        expected (`Mapping`): the report the card must state ([`expected_report`]).

    Raises:
        AuditSectionError: a section and no audit report, a report whose figures do not follow from one another
            or from the ledger, or a section that is not its rendering (the first differing line named).
    """
    from .audit.record import AUDIT_FILE, check_audit_record

    stated = _audit_section(text)
    if stated is None:
        return None
    if audit is None:
        raise AuditSectionError(f"it has an \"Empirical audit\" section but no audit report beside it ({AUDIT_FILE}) "
                                f"to check it against. {_AUDIT_HOW}")
    try:
        report, audited_model = check_audit_record(audit)
    except ValueError as error:
        raise AuditSectionError(f"{error}. {_AUDIT_HOW}") from error
    _check_audit_against_ledger(report, audited_model, expected)
    rendered = report.card_section(audited_model=audited_model)
    own = [line.rstrip() for line in rendered.splitlines() if line.strip()]
    said = [line.rstrip() for line in stated.splitlines() if line.strip()]
    for i, line in enumerate(own):
        if i >= len(said) or said[i] != line:
            at = 0 if i >= len(said) else next((k for k, (a, b) in enumerate(zip(line, said[i])) if a != b),
                                               min(len(line), len(said[i])))
            instead = f"it says {_excerpt(said[i], at)!r}" if i < len(said) else "it ends"
            raise AuditSectionError(f"its \"Empirical audit\" section differs from what its audit report "
                                    f"({AUDIT_FILE}) renders: {instead} where the report gives "
                                    f"{_excerpt(line, at)!r}. {_AUDIT_HOW}")
    if len(said) > len(own):
        raise AuditSectionError(f"its \"Empirical audit\" section adds the line {said[len(own)][:120]!r} to what its "
                                f"audit report ({AUDIT_FILE}) renders. {_AUDIT_HOW}")
    return rendered, audited_model


def _excerpt(line: str, at: int) -> str:
    """Up to 120 characters of `line` around position `at` (where two lines first differ), "…" where cut."""
    start = max(0, min(at - 40, len(line) - 120))
    return ("…" if start else "") + line[start:start + 120] + ("…" if start + 120 < len(line) else "")


def _check_audit_against_ledger(report, audited_model: bool, expected: Mapping[str, Any]) -> None:
    """The audited run is this run (its ε), or a separate run of its configuration (its mechanism and unit, an ε no
    more than its target ε); the separate run's ledger is not here, so nothing finer is checked."""
    from .audit.record import AUDIT_FILE

    for name in ("mechanism", "privacy_unit"):
        if getattr(report, name) != expected.get(name):
            raise AuditSectionError(f"its audit report ({AUDIT_FILE}) audited a run with {name} = "
                                    f"{getattr(report, name)!r}, but this card's ledger records "
                                    f"{expected.get(name)!r}: the section says the audit ran this configuration. "
                                    f"{_AUDIT_HOW}")
    audited, proven = report.epsilon_upper_bound, expected.get("epsilon")
    target = _number(expected.get("target_epsilon"))
    if audited_model and not _same(audited, proven, _EPSILON_RTOL):
        raise AuditSectionError(f"its audit report ({AUDIT_FILE}) says it tested ε = {audited!r} on this model's own "
                                f"run, whose ledger proves ε = {proven!r}. {_AUDIT_HOW}")
    if not audited_model and target is not None and (_number(audited) is None
                                                     or _number(audited) > target * (1 + _EPSILON_RTOL)):
        raise AuditSectionError(f"its audit report ({AUDIT_FILE}) says the separate audited run was proven ε = "
                                f"{audited!r}, above the target ε = {target:g} of this configuration, which no run "
                                f"of it spends. {_AUDIT_HOW}")


def _audit_section(text: str) -> str | None:
    """The card's "## Empirical audit" section, up to the next "## " heading (a section after it is the card's)."""
    start = text.find(AUDIT_HEADING + "\n")
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end + 1]


def _normal(line: str) -> str:
    return unicodedata.normalize("NFKC", html.unescape(line)).casefold()


def _claim(line: str) -> bool:
    return _CLAIM.search(_normal(line)) is not None


def _check_metadata(metadata: Mapping[str, Any], front_matter: str, rendered) -> None:
    """Every metadata key hf_dp renders is as rendered (tags: at least those); added keys, tags and YAML lines (a
    comment too) state no privacy claim."""
    own = rendered.data.to_dict()
    for key, value in own.items():
        if key == "privacy":
            continue
        stated = metadata.get(key)
        if key == "tags":
            missing = [tag for tag in value if tag not in (stated or [])]
            if missing:
                raise CardClaimError(f"its tags lack {missing}, which hf_dp's card of this ledger carries")
        elif stated != value:
            raise CardClaimError(f"its metadata says {key} = {stated!r} where hf_dp's card of this ledger says "
                                 f"{value!r}")
    own_lines = {line.strip() for line in rendered.data.to_yaml().splitlines()}
    for line in front_matter.splitlines():
        if line.strip() and line.strip() not in own_lines and _claim(line):
            raise CardClaimError(f"its YAML front matter adds a privacy claim ({line.strip()[:120]!r})")


def _check_lines(text: str, rendered: str) -> None:
    """The rendered card's lines appear in the card in order; each added line makes no privacy claim (the audit
    section, already compared with its report's rendering, is in both). Blank lines and trailing spaces are not
    compared."""
    stated = [line.rstrip() for line in text.splitlines() if line.strip()]
    own = [line.rstrip() for line in rendered.splitlines() if line.strip()]
    matcher = difflib.SequenceMatcher(a=own, b=stated, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag in ("replace", "delete"):
            instead = f" (it says {stated[j1][:120]!r} there)" if tag == "replace" else ""
            raise CardClaimError(f"it lacks the line {own[i1][:120]!r} that hf_dp renders from its ledger{instead}")
        if tag == "insert":
            for j in range(j1, j2):
                if _claim(stated[j]):
                    raise CardClaimError(f"it adds a privacy claim that its ledger does not prove "
                                         f"({stated[j][:120]!r})")
