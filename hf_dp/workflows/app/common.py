"""What every tab shares: the one-line error the page shows and the mechanisms' labels.

Numbers are written by [`hf_dp.formatting.format_number`], as in the card and the plan table.
"""

from __future__ import annotations

from typing import Any

from hf_dp.vocabulary import MECHANISMS


class AppError(Exception):
    """An error the page shows as one line (bad input, nothing to show yet)."""


def one_line(error: BaseException) -> str:
    """The error's message on one line (at most 400 characters), never a traceback."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def error_md(error: BaseException | str) -> str:
    """An error as the one bold line the page shows."""
    message = error if isinstance(error, str) else one_line(error)
    return f"**⚠️ {message}**"


def mechanism_label(key: Any) -> str:
    """`MECHANISMS[key].label` (what tables, plots and dropdowns show), or the key itself if unknown."""
    entry = MECHANISMS.get(str(key))
    return entry.label if entry is not None else str(key)
