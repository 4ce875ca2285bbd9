"""Publish a trained model to the Hub with its privacy card as the repo README (`hf-dp publish`).

[`publish`] uploads a saved model folder (weights, config, tokenizer, `README.md`) through huggingface_hub's
standard APIs, [`~huggingface_hub.HfApi.create_repo`] then [`~huggingface_hub.HfApi.upload_folder`], after
checks that run *before anything is uploaded*:

1. [`check_privacy_card`]: the folder has a `README.md` whose YAML front matter parses with
   [`~huggingface_hub.ModelCard`] and [`~huggingface_hub.repocard.metadata_load`] and carries the `privacy:`
   block that [`hf_dp.card`] writes (ε, δ, privacy unit, mechanism), with ε and δ written as numbers, and what it
   states is what the ledger saved beside it (`dp_ledger.json`) accounts: ε is recomputed from the ledger and a
   card claiming less (in its front matter or its text), another δ, unit or mechanism, or no ledger at all is
   refused, as is a number of its Accounting paragraph below the ledger's, or a local path as `base_model`; then
   [`hf_dp.card_check`]: every other figure and statement must be what hf_dp renders from the ledger's verified
   report, no line may add a privacy claim, and an "Empirical audit" section must be what the audit report beside
   the card (`dp_audit.json`) renders. A fixed-seed card (no guarantee) needs `no_guarantee=True`.
   A non-private
   run's card is refused unless `allow_non_private=True`: its data has no protection.
2. the folder holds a model (`config.json` and weights);
3. [`ensure_hub_reachable`]: not in offline mode (`HF_HUB_OFFLINE=1`) and the Hub endpoint answers; otherwise
   one clear line ([`HubUnreachableError`]). [`~hf_dp.DPTrainer`]'s `push_to_hub` runs the same check.

Publishing is post-processing: it changes nothing about the guarantee the card states.

Example:

```bash
hf-dp publish results/models/uls-eps8 --repo_id alice/minilm-shakespeare-uls-eps8
hf-dp publish results/uls-eps8.json --repo_id alice/minilm-shakespeare-uls-eps8 --public
```
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping


logger = logging.getLogger(__name__)

__all__ = [
    "HubUnreachableError",
    "PrivacyCardError",
    "PublishArguments",
    "check_privacy_card",
    "ensure_hub_reachable",
    "main",
    "publish",
    "resolve_model_dir",
    "run",
]

# What never goes to the Hub: checkpoints (they hold optimizer state and the ledger), trainer internals.
IGNORE_PATTERNS = ["checkpoint-*", "checkpoint-*/**", "_*", "*.tmp", "training_args.bin", "dp_resume.json"]
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
_TRUE = {"1", "ON", "YES", "TRUE"}
_FINE_TUNED_FROM = re.compile(r"^Fine-tuned from `([^`]+)`", re.MULTILINE)
class HubUnreachableError(RuntimeError):
    """The Hub cannot be reached (offline mode, or the endpoint does not answer); nothing was uploaded."""


class PrivacyCardError(ValueError):
    """The folder has no usable privacy card (`README.md` with a `privacy:` block in its front matter)."""


# ----------------------------------------------------------------------------------------------------------
# Checks (all before any upload)
# ----------------------------------------------------------------------------------------------------------


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


def _check_model_files(model_dir: Path) -> None:
    if not (model_dir / "config.json").is_file() and not (model_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir} has no config.json: not a saved model (save it with model.save_pretrained(dir))."
        )
    if not any(path.name not in _NOT_WEIGHTS for pattern in _WEIGHTS for path in model_dir.glob(pattern)):
        raise FileNotFoundError(f"{model_dir} has no weights (*.safetensors / *.bin): save the model first.")


def _env_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return env.upper() in _TRUE or constants.is_offline_mode()


def ensure_hub_reachable(endpoint: str | None = None, *, timeout: float = 5.0) -> None:
    """Raise [`HubUnreachableError`] (one line) unless the Hub can be reached; uploads nothing.

    Offline mode (`HF_HUB_OFFLINE=1` or `TRANSFORMERS_OFFLINE=1`) fails without touching the network; otherwise one
    `HEAD` request to the endpoint (through huggingface_hub's HTTP session, so proxies apply) must get any answer.

    Args:
        endpoint (`str`, *optional*): defaults to huggingface_hub's endpoint (`HF_ENDPOINT` or the public Hub).
        timeout (`float`, *optional*, defaults to `5.0`): seconds to wait for the answer.

    Raises:
        HubUnreachableError: offline mode, or the endpoint did not answer.
    """
    from huggingface_hub import constants

    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    if _env_offline():
        raise HubUnreachableError(
            "Cannot publish: Hugging Face Hub offline mode is on (HF_HUB_OFFLINE=1); nothing was uploaded. "
            "Unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) on a machine that can reach the Hub."
        )
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=timeout, follow_redirects=False)
    except Exception as error:  # connection refused, DNS failure, timeout, proxy error
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise HubUnreachableError(
            f"Cannot publish: the Hub endpoint {endpoint} is unreachable ({reason}); nothing was uploaded. "
            "Check the network, a proxy, or HF_ENDPOINT."
        ) from error


# ----------------------------------------------------------------------------------------------------------
# Publishing
# ----------------------------------------------------------------------------------------------------------


def publish(run_dir_or_model_dir: str | os.PathLike, repo_id: str, *, token: str | None = None,
            private: bool = True, allow_non_private: bool = False, commit_message: str | None = None,
            no_guarantee: bool = False) -> str:
    """Upload a saved model, its tokenizer and its privacy card (`README.md`) to a Hub model repo.

    Args:
        run_dir_or_model_dir (`str` or `os.PathLike`): a saved model folder (e.g. `results/models/uls-eps8`,
            a `DPTrainer` `output_dir`) or a result JSON (`results/uls-eps8.json`).
        repo_id (`str`): `"user/name"` or `"org/name"`; created if missing.
        token (`str`, *optional*): a write token; defaults to the stored login or `HF_TOKEN`.
        private (`bool`, *optional*, defaults to `True`): create the repo private (no effect if it exists).
        allow_non_private (`bool`, *optional*, defaults to `False`): publish a run trained without DP.
        commit_message (`str`, *optional*): defaults to one stating ε, δ and the unit.
        no_guarantee (`bool`, *optional*, defaults to `False`): publish the card labelled as carrying NO privacy
            guarantee: the uploaded README gets `privacy.no_guarantee: true`, the `no-privacy-guarantee` tag in place
            of the DP tags, and a warning above its text (the folder's own README is left as it is). A fixed-seed
            run's card, already so labelled, is checked as any card; any other card is uploaded labelled even when
            its figures are not what its ledger proves.

    Returns:
        `str`: the repo's URL.

    Raises:
        PrivacyCardError: no usable privacy card (see [`check_privacy_card`]).
        FileNotFoundError: not a saved model folder.
        ValueError: a malformed `repo_id`, or no token.
        HubUnreachableError: offline mode or the Hub does not answer.
        All of these are raised before anything is uploaded.

    Example:

    ```python
    >>> from hf_dp.hub import publish
    >>> url = publish("results/models/uls-eps8", "alice/minilm-shakespeare-uls-eps8")  # doctest: +SKIP
    ```
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    model_dir = resolve_model_dir(run_dir_or_model_dir)
    labelled = None
    if no_guarantee:
        from .card_label import label_no_guarantee

        labelled = label_no_guarantee(model_dir / "README.md")  # refuses (PrivacyCardError) a card it cannot read
        try:
            privacy = check_privacy_card(model_dir, allow_non_private=True, no_guarantee=True)
        except PrivacyCardError as error:
            logger.warning("Publishing with no_guarantee: the card is uploaded labelled as carrying NO privacy "
                           "guarantee, since %s", error)
            privacy = {"no_guarantee": True}
    else:
        privacy = check_privacy_card(model_dir, allow_non_private=allow_non_private)
    _check_model_files(model_dir)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"--repo_id {repo_id!r}: {error}") from error
    if "/" not in repo_id:
        raise ValueError(f"--repo_id {repo_id!r}: use USER/NAME or ORG/NAME.")

    api = HfApi(token=token)
    ensure_hub_reachable(api.endpoint)
    if token is None and get_token() is None:
        raise ValueError("Not logged in to the Hub: run `hf auth login`, set HF_TOKEN, or pass --token.")

    if commit_message is None:
        if labelled is not None:
            commit_message = "Upload model WITHOUT a privacy guarantee (hf_dp publish --no_guarantee)"
        elif privacy.get("non_private"):
            commit_message = "Upload model fine-tuned without differential privacy (hf_dp)"
        else:
            from .formatting import format_significant, format_upper_bound  # as the card rounds them

            commit_message = (f"Upload DP model: ({format_upper_bound(privacy['epsilon'], 2)}, "
                              f"{format_significant(privacy['delta'], 3, up=True)})-DP at the "
                              f"{privacy['privacy_unit']} level (hf_dp)")
    repo_url = api.create_repo(repo_id, token=token, private=private, exist_ok=True)
    target = repo_url.repo_id if hasattr(repo_url, "repo_id") else repo_id
    ignore = IGNORE_PATTERNS
    if labelled is not None:  # the labelled card first: the repo never shows an unlabelled one beside the weights
        api.upload_file(path_or_fileobj=labelled.encode("utf-8"), path_in_repo="README.md", repo_id=target,
                        commit_message=commit_message, token=token)
        ignore = [*IGNORE_PATTERNS, "README.md"]
    api.upload_folder(repo_id=target, folder_path=model_dir, commit_message=commit_message, token=token,
                      ignore_patterns=ignore)
    return str(repo_url)


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


@dataclass
class PublishArguments:
    """The `hf-dp publish` flags (`python -m hf_dp.hub` takes the same)."""

    run_dir: str = field(metadata={
        "help": "Saved model folder (e.g. results/models/uls-eps8) or a result JSON (results/<run>.json).",
        "metavar": "RUN_DIR", "positional": True})
    repo_id: str = field(metadata={"help": "Hub repo USER/NAME (created if missing)."})
    token: str | None = field(default=None,
                              metadata={"help": "Write token (default: the stored login or HF_TOKEN)."})
    public: bool = field(default=False, metadata={"help": "Create the repo public (default: private)."})
    allow_non_private: bool = field(
        default=False, metadata={"help": "Publish a run trained without DP (its training data has no protection)."})
    no_guarantee: bool = field(
        default=False, metadata={"help": "Publish the card labelled as carrying NO privacy guarantee (a fixed-seed "
                                         "run, or a card whose figures its ledger does not prove); the local README "
                                         "is left as it is."})


def build_parser():
    """The `hf-dp publish` parser, over [`PublishArguments`] (the parser is imported here only: the trainer reaches
    this module for the Hub checks, never the command line)."""
    from .parser import ArgumentParser

    return ArgumentParser(
        PublishArguments, prog="hf-dp publish", one_line_errors=True, formatter_class=argparse.HelpFormatter,
        description="Upload a saved model, its tokenizer and its privacy card (README.md) to the Hub. Checks the "
                    "card and that the Hub is reachable before uploading anything.",
    )


def main(argv=None) -> int:
    """Entry point of `python -m hf_dp.hub` (`hf-dp publish` calls [`run`])."""
    from .parser import run_command

    return run_command(build_parser(), run, argv)


def run(args: PublishArguments) -> int:
    """Publish with parsed [`PublishArguments`]: prints the repo URL, or one line saying what failed (exit 1)."""
    try:
        url = publish(args.run_dir, args.repo_id, token=args.token, private=not args.public,
                      allow_non_private=args.allow_non_private, no_guarantee=args.no_guarantee)
    except (HubUnreachableError, PrivacyCardError, FileNotFoundError, ValueError) as error:
        print(f"hf-dp publish: error: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # HfHubHTTPError (401, 403...) and friends: one line, not a traceback
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"hf-dp publish: error: upload failed ({type(error).__name__}: {first})", file=sys.stderr)
        return 1
    print(f"Published to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
