"""The label `hf-dp publish --no_guarantee` puts on a card: it carries NO privacy guarantee.

[`label_no_guarantee`] returns the card's text as it is uploaded: `privacy.no_guarantee: true` in its front matter,
the `no-privacy-guarantee` tag in place of the tags that say the model is differentially private, and a warning as
the first line of its text. The folder's own `README.md` is not changed. Post-processing: no effect on any ε.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["NO_GUARANTEE_BANNER", "NO_GUARANTEE_TAG", "label_no_guarantee"]

NO_GUARANTEE_TAG = "no-privacy-guarantee"
_DP_TAGS = ("differential-privacy", "user-level-dp", "example-level-dp")
NO_GUARANTEE_BANNER = (
    "> **⚠️ No privacy guarantee.** This card was published with `hf-dp publish --no_guarantee`: whatever it says "
    "below, this model carries NO differential privacy guarantee (its noise came from a fixed seed, or its privacy "
    "statements are not what its training ledger proves)."
)


def label_no_guarantee(readme: str | os.PathLike) -> str:
    """The card at `readme`, labelled as carrying no guarantee (idempotent: a labelled card is labelled once).

    Raises:
        PrivacyCardError: no README, or front matter that does not parse (nothing to label).
    """
    from huggingface_hub import ModelCard

    from .publish_check import PrivacyCardError

    path = Path(readme)
    try:
        card = ModelCard.load(path)
    except Exception as error:  # a missing file, yaml errors: one line
        raise PrivacyCardError(f"{path}: cannot label the card as carrying no guarantee ({type(error).__name__}: "
                               f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}); write a card "
                               "first (trainer.write_privacy_card).") from error
    data = card.data
    privacy = dict(getattr(data, "privacy", None) or {})
    data.privacy = {"no_guarantee": True, **{k: v for k, v in privacy.items() if k != "no_guarantee"}}
    data.tags = [NO_GUARANTEE_TAG] + [tag for tag in (data.tags or []) if tag not in (*_DP_TAGS, NO_GUARANTEE_TAG)]
    text = card.text if card.text.lstrip().startswith(NO_GUARANTEE_BANNER) else \
        f"\n{NO_GUARANTEE_BANNER}\n\n{card.text.lstrip(chr(10))}"
    return f"---\n{data.to_yaml()}\n---\n{text}"
