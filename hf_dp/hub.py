"""Publish a trained model to the Hub with its privacy card as the repo README: `hf-dp publish`.

[`publish`] uploads a saved model folder (weights, config, tokenizer, `README.md`) through huggingface_hub's
standard APIs, [`~huggingface_hub.HfApi.create_repo`] then [`~huggingface_hub.HfApi.upload_folder`], after
checks that run *before anything is uploaded*:

1. [`~hf_dp.publish_check.check_privacy_card`]: a privacy card that claims exactly what the run's ledger earned
   ([`hf_dp.publish_check`] says what is checked); a fixed-seed card (no guarantee) needs `no_guarantee=True`, a
   non-private run's card `allow_non_private=True`;
2. [`~hf_dp.publish_check.check_model_files`]: the folder holds a model (`config.json` and weights);
3. [`ensure_hub_reachable`]: not in offline mode (`HF_HUB_OFFLINE=1`) and the Hub endpoint answers; otherwise
   one clear line ([`HubUnreachableError`]). [`~hf_dp.DPTrainer`]'s `push_to_hub` runs the same check.

`hf-dp publish` (and `python -m hf_dp.hub`) is this module's command line ([`PublishArguments`], [`run`]).

Publishing is post-processing: it changes nothing about the guarantee the card states.

Example:

```bash
hf-dp publish results/models/uls-eps8 --repo_id alice/minilm-shakespeare-uls-eps8
hf-dp publish results/uls-eps8.json --repo_id alice/minilm-shakespeare-uls-eps8 --public
```
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field

from .publish_check import PrivacyCardError, check_model_files, check_privacy_card, resolve_model_dir

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
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubUnreachableError(RuntimeError):
    """The Hub cannot be reached (offline mode, or the endpoint does not answer); nothing was uploaded."""


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
    check_model_files(model_dir)
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
    from .command_line import ArgumentParser

    return ArgumentParser(
        PublishArguments, prog="hf-dp publish", one_line_errors=True, formatter_class=argparse.HelpFormatter,
        description="Upload a saved model, its tokenizer and its privacy card (README.md) to the Hub. Checks the "
                    "card and that the Hub is reachable before uploading anything.",
    )


def main(argv=None) -> int:
    """Entry point of `python -m hf_dp.hub` (`hf-dp publish` calls [`run`])."""
    from .command_line import run_command

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
