"""What `hf-dp publish` checks before it uploads anything: a saved model and a privacy card the run earned.

[`check_privacy_card`]: the folder has a `README.md` whose YAML front matter parses with
[`~huggingface_hub.ModelCard`] and [`~huggingface_hub.repocard.metadata_load`] and carries the `privacy:` block
that [`hf_dp.card`] writes (ε, δ, privacy unit, mechanism), with ε and δ written as numbers, and what it states is
what the ledger saved beside it (`dp_ledger.json`) accounts: ε is recomputed from the ledger and a card claiming
less (in its front matter or its text), another δ, unit or mechanism, or no ledger at all is refused, as is a
number of its Accounting paragraph below the ledger's, or a local path as `base_model`; then [`hf_dp.card_check`]:
every other figure and statement must be what hf_dp renders from the ledger's verified report, no line may add a
privacy claim, and an "Empirical audit" section must be what the audit report beside the card (`dp_audit.json`)
renders. A fixed-seed card (no guarantee) needs `no_guarantee=True`. A non-private run's card is refused unless
`allow_non_private=True`: its data has no protection. [`check_model_files`]: the folder holds a model
(`config.json` and weights). [`resolve_model_dir`]: a result JSON names the folder.

Uploading is [`hf_dp.hub`]'s job; this module only reads.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
from pathlib import Path
from typing import Mapping

__all__ = ["PrivacyCardError", "check_model_files", "check_privacy_card", "resolve_model_dir"]

# The privacy block must state at least the guarantee itself.
_CARD_KEYS = ("epsilon", "delta", "privacy_unit", "mechanism")
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_NOT_WEIGHTS = {"training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt"}  # Trainer's state
_HOW_TO_CARD = (
    "train with hf_dp.DPTrainer (it writes the card at the end of train()), call trainer.write_privacy_card(dir), "
    "or hf_dp.card.write_privacy_card(report, dir, ledger=trainer.privacy_ledger(), base_model=...)"
)
# allow_non_private publishes a card that says "no DP", never a model without a card (e.g. Trainer's own).
_HOW_TO_NON_PRIVATE_CARD = (
    "--allow_non_private publishes a card that states the model has no DP guarantee, not a model without one (e.g. a "
    "plain Trainer's); write it first: hf_dp.card.write_privacy_card({'non_private': True}, dir, "
    "base_model=<Hub id>) (what the recipes' --non_private runs write)."
)
# Relative slack for ε recomputed from the ledger (floating point), never for rounding down.
_EPSILON_RTOL = 1e-6
_FINE_TUNED_FROM = re.compile(r"^Fine-tuned from `([^`]+)`", re.MULTILINE)


class PrivacyCardError(ValueError):
    """The folder has no usable privacy card (`README.md` with a `privacy:` block in its front matter)."""


def resolve_model_dir(run_dir_or_model_dir: str | os.PathLike) -> Path:
    """The model folder to publish: the folder itself, or the `model_dir` of a result JSON (`results/<run>.json`).

    Raises:
        FileNotFoundError: nothing at that path, or a result without a saved model (the public-only baseline).
    """
    path = Path(run_dir_or_model_dir)
    if path.is_file() and path.suffix == ".json":
        try:
            result = json.loads(path.read_text())
        except ValueError as error:
            raise FileNotFoundError(f"{path} is not a result JSON ({error}).") from error
        model_dir = result.get("model_dir") if isinstance(result, Mapping) else None
        if not model_dir:
            raise FileNotFoundError(
                f"{path} has no saved model (model_dir is empty: a public-only baseline is the base model itself)."
            )
        path = path.parent / model_dir
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a folder: pass a saved model folder or a results/<run>.json.")
    return path


def check_privacy_card(model_dir: str | os.PathLike, *, allow_non_private: bool = False,
                       no_guarantee: bool = False) -> dict:
    """Check `model_dir/README.md` is a privacy card the Hub can read; return its `privacy:` block.

    Args:
        model_dir (`str` or `os.PathLike`): the saved model folder.
        allow_non_private (`bool`, *optional*, defaults to `False`): accept the card of a run trained
            without DP (`privacy: {non_private: true}`).
        no_guarantee (`bool`, *optional*, defaults to `False`): accept a card that says it carries no guarantee
            (`privacy: {no_guarantee: true}`: a run whose noise came from a fixed `noise_seed`); everything else is
            checked as for any card.

    Raises:
        PrivacyCardError: no README, front matter that does not parse, no `privacy:` block, a block without
            ε/δ/unit/mechanism, or a non-private card when not allowed; for a DP card, an ε or δ that is not a
            number (e.g. written as a string), an ε that is not finite and ≥ 0 or a δ outside (0, 1), a mechanism
            that is not `"uls"`, `"els"` or `"example"`, no ledger (`dp_ledger.json`) beside it, or a card that
            states a smaller ε than the ledger proves (front matter or text), another δ, unit, mechanism or step
            count; any other figure or statement of the card that is not what hf_dp renders from the ledger's
            verified report, or a privacy claim the card adds ([`hf_dp.card_check`]); an "Empirical audit"
            section that is not what its audit report (`dp_audit.json`) renders, or no such report; a fixed-seed
            card without `no_guarantee`. One line, naming the field and saying how to make a card.
    """
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard import metadata_load

    readme = Path(model_dir) / "README.md"
    how_to = _HOW_TO_NON_PRIVATE_CARD if allow_non_private else f"To make one, {_HOW_TO_CARD}."
    if not readme.is_file():
        raise PrivacyCardError(f"{readme} does not exist: no privacy card to publish. {how_to}")
    try:
        card = ModelCard.load(readme)
        metadata = metadata_load(readme)
    except Exception as error:  # yaml errors, ValueError: any unreadable front matter
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise PrivacyCardError(
            f"{readme}: its YAML front matter does not parse ({message}). Regenerate it: {_HOW_TO_CARD}."
        ) from error
    privacy = (metadata or {}).get("privacy")
    if not isinstance(privacy, Mapping):
        raise PrivacyCardError(
            f"{readme} is not a privacy card: its front matter has no 'privacy:' block. {how_to}"
        )
    _check_base_model(readme, metadata, card.text)
    if privacy.get("non_private"):
        if not allow_non_private:
            raise PrivacyCardError(
                f"{readme} describes a model trained WITHOUT differential privacy: refusing to publish it "
                "(pass allow_non_private=True / --allow_non_private if its training data is not private)."
            )
        return dict(privacy)
    missing = [key for key in _CARD_KEYS if privacy.get(key) is None]
    if missing:
        raise PrivacyCardError(
            f"{readme}: the 'privacy:' block lacks {missing}. Regenerate the card: {_HOW_TO_CARD}."
        )
    ledger, accountant, sampler = _check_against_ledger(readme, privacy, card.text)
    _check_claims(readme, privacy, metadata, card, ledger, accountant, sampler)
    if privacy.get("no_guarantee") and not no_guarantee:
        raise PrivacyCardError(f"{readme} says its model carries NO privacy guarantee (its noise came from a fixed "
                               f"noise_seed, {privacy.get('noise_seed')!r}, which anyone who knows it can subtract): "
                               "refusing to publish it (pass no_guarantee=True / --no_guarantee to publish it so "
                               "labelled; train without noise_seed for a guarantee).")
    return dict(privacy)


def _check_claims(readme: Path, privacy: Mapping, metadata: Mapping, card, ledger: Mapping, accountant,
                  sampler) -> None:
    """Every privacy figure and statement of the card is what hf_dp renders from the ledger's verified report
    ([`hf_dp.card_check`])."""
    from .card_check import AuditSectionError, CardClaimError, check_card_claims, expected_report, read_audit

    raw = readme.read_text(encoding="utf-8")  # as written: YAML comments too
    front_matter = raw.split("---", 2)[1] if raw.startswith("---") else ""
    try:
        check_card_claims(privacy, metadata, front_matter, card.text,
                          expected_report(ledger, accountant, sampler_delta=sampler), audit=read_audit(readme.parent))
    except CardClaimError as error:
        how = "" if isinstance(error, AuditSectionError) else f". Regenerate the card: {_HOW_TO_CARD}"
        raise PrivacyCardError(f"{readme}: {error}{how}; or publish it labelled as carrying no guarantee "
                               "(--no_guarantee).") from error


def _check_base_model(readme: Path, metadata: Mapping, text: str) -> None:
    """Refuse a card whose `base_model` (or first sentence) is a local path: the Hub expects a repo id there, and a
    path tells the world a folder of the training machine."""
    from .card import hub_model_id

    stated = [("base_model", metadata.get("base_model"))] if metadata.get("base_model") is not None else []
    stated += [("its first sentence", name) for name in _FINE_TUNED_FROM.findall(text)[:1]]
    for where, name in stated:
        names = name if isinstance(name, list) else [name]
        for one in names:
            if not isinstance(one, str) or hub_model_id(one) is None:
                raise PrivacyCardError(f"{readme}: {where} names {one!r}, not a Hub model id (owner/name): write the "
                                       "Hub id of the model it was fine-tuned from, or remove it (the card then "
                                       f"says 'a local model'); or regenerate the card: {_HOW_TO_CARD}.")


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _card_number(readme: Path, privacy: Mapping, key: str, symbol: str) -> float:
    """`privacy[key]` as a float, or one line naming the field when the YAML holds something else (a string)."""
    value = _number(privacy[key])
    if value is None:
        written = f"the {type(privacy[key]).__name__} {privacy[key]!r}"
        raise PrivacyCardError(f"{readme}: privacy.{key} ({symbol}) is {written} in the card's YAML, not a number: "
                               f"write it unquoted (e.g. {key}: 7.98), or regenerate the card: {_HOW_TO_CARD}.")
    return value


def _ledger_mechanism(ledger: Mapping) -> str:
    """The mechanism a ledger records: its `mechanism` key, or the one its `privacy_unit` and `sampling` select."""
    from .mechanisms import mechanism_of, registered_mechanisms

    key = ledger.get("mechanism")
    if key in {m.key for m in registered_mechanisms()}:
        return key
    return mechanism_of(ledger.get("privacy_unit"), ledger.get("sampling"))


def _check_against_ledger(readme: Path, privacy: Mapping, text: str):
    """Refuse a card whose ε, δ, unit or mechanism is not what its ledger proves (ε recomputed from it); return the
    ledger, its accountant and δ its noise sampler adds as a function of ε."""
    from .accounting import PrivacyAccountant
    from .mechanisms import registered_mechanisms
    from .vocabulary import LEDGER_FILE

    epsilon = _card_number(readme, privacy, "epsilon", "ε")
    delta = _card_number(readme, privacy, "delta", "δ")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise PrivacyCardError(f"{readme}: ε = {privacy['epsilon']!r} is not a finite number ≥ 0. "
                               f"Regenerate the card: {_HOW_TO_CARD}.")
    if not 0 < delta < 1:
        raise PrivacyCardError(f"{readme}: δ = {privacy['delta']!r} is not in (0, 1). Regenerate the card: "
                               f"{_HOW_TO_CARD}.")
    keys = tuple(m.key for m in registered_mechanisms())
    if privacy["mechanism"] not in keys:
        raise PrivacyCardError(f"{readme}: privacy.mechanism = {privacy['mechanism']!r} is not one of "
                               f"{keys}. Regenerate the card: {_HOW_TO_CARD}.")
    path = readme.parent / LEDGER_FILE
    if not path.is_file():
        raise PrivacyCardError(f"{path} does not exist: without the ledger the card's ε cannot be checked. "
                               f"Regenerate card and ledger: {_HOW_TO_CARD}.")
    try:
        ledger = json.loads(path.read_text(encoding="utf-8"))
        accountant = PrivacyAccountant()
        accountant.load_state_dict(ledger["accountant"])
        ledger_delta = _number(ledger["delta"])
        if ledger_delta is None or not 0 < ledger_delta < 1:
            raise ValueError(f"its delta {ledger['delta']!r} is not in (0, 1)")
        accountant_delta = ledger_delta
        lower, estimate, accounted = accountant.epsilon_bounds(ledger_delta)
        added_delta = _sampler_delta(ledger, accounted, ledger_delta, accountant.steps)
        ledger_delta += added_delta
        ledger_mechanism = _ledger_mechanism(ledger)
    except (ValueError, KeyError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise PrivacyCardError(f"{path} is not a ledger written by hf_dp ({reason}).") from error
    checks = [("privacy_unit", privacy.get("privacy_unit"), ledger.get("privacy_unit")),
              ("mechanism", privacy["mechanism"], ledger_mechanism), ("steps", privacy.get("steps"), accountant.steps)]
    for key, stated, recorded in checks:
        if stated != recorded:
            raise PrivacyCardError(f"{readme}: the card says {key} = {stated!r} but its ledger ({LEDGER_FILE}) "
                                   f"records {recorded!r}. Regenerate the card: {_HOW_TO_CARD}.")
    if not math.isclose(delta, ledger_delta, rel_tol=1e-9):
        raise PrivacyCardError(f"{readme}: the card says δ = {delta:g} but its ledger was accounted at "
                               f"δ = {ledger_delta:g}. Regenerate the card: {_HOW_TO_CARD}.")
    floor = accounted * (1 - _EPSILON_RTOL)
    if epsilon < floor:
        raise PrivacyCardError(f"{readme}: the card claims ε = {epsilon:g} but its ledger proves ε = "
                               f"{accounted:.6g} at δ = {ledger_delta:g}: refusing to publish an understated "
                               f"guarantee. Regenerate the card: {_HOW_TO_CARD}.")
    reach = _number((ledger.get("noise") or {}).get("reach"))
    figures = [("epsilon_lower", lower), ("epsilon_estimate", estimate), ("delta_floating_point", added_delta)]
    for key, bound in figures:  # never understated, like ε
        shown = _number(privacy.get(key))
        if shown is not None and bound is not None and shown < bound * (1 - _EPSILON_RTOL):
            raise PrivacyCardError(f"{readme}: privacy.{key} = {shown:g} is below its ledger's {bound:.6g}: the card "
                                   f"was edited. Regenerate it: {_HOW_TO_CARD}.")
    for key, value in [("delta_accountant", accountant_delta), ("noise_reach", reach)]:
        shown = _number(privacy.get(key))
        if shown is not None and value is not None and not math.isclose(shown, value, rel_tol=1e-9):
            raise PrivacyCardError(f"{readme}: privacy.{key} = {shown:g}, but its ledger records {value:g}: the card "
                                   f"was edited. Regenerate it: {_HOW_TO_CARD}.")
    _check_text_against_report(readme, privacy, text)
    return ledger, accountant, lambda epsilon: _sampler_delta(ledger, epsilon, accountant_delta, accountant.steps)


def _check_text_against_report(readme: Path, privacy: Mapping, text: str) -> None:
    """The card's privacy section must be what its own `privacy:` block (the machine-readable report, checked
    against the ledger above) renders: no number or word of it is read back from prose."""
    from huggingface_hub import ModelCard

    from .card import render_privacy_card

    try:
        rendered = ModelCard(str(render_privacy_card(dict(privacy), base_model=None))).text
    except (ValueError, TypeError, KeyError) as error:
        raise PrivacyCardError(f"{readme}: its privacy: block does not render a card ({error}). Regenerate it: "
                               f"{_HOW_TO_CARD}.") from error
    expected, stated = _privacy_section(rendered), _privacy_section(text)
    if stated is None:
        raise PrivacyCardError(f"{readme}: its text has no '## Privacy guarantee' section stating the (ε, δ) "
                               f"guarantee. Regenerate the card: {_HOW_TO_CARD}.")
    if stated != expected:
        lines = zip(stated.splitlines() + [""] * 999, expected.splitlines())
        first = next(((a, b) for a, b in lines if a.strip() != b.strip()), ("", ""))
        raise PrivacyCardError(f"{readme}: its privacy section differs from what its privacy: block states (it says "
                               f"{first[0].strip()[:120]!r} where the block gives {first[1].strip()[:120]!r}): the "
                               f"card was edited. Regenerate it: {_HOW_TO_CARD}.")


def _privacy_section(text: str) -> str | None:
    """From '## Privacy guarantee' to the next '## ' heading (the guarantee, its parameters, the accounting)."""
    start = text.find("## Privacy guarantee")
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _sampler_delta(ledger: Mapping, epsilon: float, delta: float, steps: int) -> float:
    """What the ledger's noise sampler adds to δ over its steps; a ledger without a sampler is refused."""
    from .accounting.floating_point import sampler_delta

    noise = ledger.get("noise")
    if not isinstance(noise, Mapping) or _number(noise.get("draws_per_step")) is None:
        raise ValueError("it records no noise sampler (ledgers written before hf_dp's noise reached 14σ): its δ "
                         "assumed ideal Gaussian noise, which the noise drawn then did not match; train again")
    tail = _number(noise.get("tail_per_draw"))
    if tail is None or not 0 < tail < 1:
        raise ValueError(f"its noise tail_per_draw {noise.get('tail_per_draw')!r} is not in (0, 1)")
    return sampler_delta(epsilon=epsilon, delta=delta, draws=steps * noise["draws_per_step"], tail_per_draw=tail)


def check_model_files(model_dir: Path) -> None:
    """Refuse a folder without a saved model: `config.json` (or `adapter_config.json`) and weights."""
    if not (model_dir / "config.json").is_file() and not (model_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir} has no config.json: not a saved model (save it with model.save_pretrained(dir))."
        )
    if not any(path.name not in _NOT_WEIGHTS for pattern in _WEIGHTS for path in model_dir.glob(pattern)):
        raise FileNotFoundError(f"{model_dir} has no weights (*.safetensors / *.bin): save the model first.")
