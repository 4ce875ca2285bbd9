"""The documentation builds, links only to what the repository holds, and states the arguments the code has.

`mkdocs build --strict` fails on a broken link or anchor between pages and on a page missing from the nav. The
README is not part of the site, so its links are checked here, as are the paths the pages name in code (the
benchmark or test that reproduces a table must exist).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = [README, *PAGES]
INSTALL_HINT = ('mkdocs-material is not installed: install the docs extra, pip install -e ".[docs]" '
                "(the test extra includes it).")


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)


def _links(path: Path) -> list[str]:
    """Targets of inline links and images, outside fenced code and code spans."""
    text = re.sub(r"`[^`\n]*`", "", _without_code_blocks(path.read_text()))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


def _slug(heading: str) -> str:
    """Python-Markdown's default toc slug, as mkdocs makes it, of a heading's rendered text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _without_code_blocks(path.read_text()), flags=re.M)
    return {_slug(heading) for heading in headings}


def test_mkdocs_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail(INSTALL_HINT)
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    for page in PAGES:
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), f"{page.name} was not built into {built}"


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def entries(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from entries(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from entries(value)

    assert sorted(entries(config["nav"])) == sorted(page.name for page in PAGES)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda path: str(path.relative_to(ROOT)))
def test_links_point_to_files_in_the_repository(path):
    broken = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if ROOT not in destination.parents and destination != ROOT:
            broken.append(f"{target} (outside the repository)")
        elif not destination.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{path.name} links to: {broken}"


REPO_PATH = re.compile(r"(?<![\w/.~])((?:benchmarks|recipes|tests|docs|model_cards|app|hf_dp|\.ci)/[\w./-]*\w)")


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda path: str(path.relative_to(ROOT)))
def test_named_repository_paths_exist(path):
    """A table's reproducing command, a test or a template the text names is in the repository."""
    missing = sorted({name for name in REPO_PATH.findall(path.read_text()) if not (ROOT / name).exists()})
    assert not missing, f"{path.name} names paths the repository lacks: {missing}"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_citation_of_documents_outside_the_repository(path):
    assert not re.search(r"DESIGN\s*§", path.read_text()), f"{path.name} cites a design document the repo lacks"


def _argument_table(path: Path) -> dict[str, str]:
    """`name -> default cell` of the table whose header starts `| argument | default |`."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*argument\s*\|\s*default\s*\|", line))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1]
    return rows


@pytest.mark.parametrize("path", [README, DOCS / "trainer.md"], ids=lambda path: str(path.relative_to(ROOT)))
def test_argument_tables_state_every_privacy_field_and_its_default(path):
    from hf_dp.arguments import DPTrainingArguments

    own = inspect.get_annotations(DPTrainingArguments)  # the fields it declares, not Trainer's
    fields = {field.name: field.default for field in dataclasses.fields(DPTrainingArguments) if field.name in own}
    table = _argument_table(path)
    assert sorted(table) == sorted(fields), f"{path.name}'s argument table and DPTrainingArguments differ"
    for name, cell in table.items():
        stated = re.match(r"`([^`]*)`", cell)
        assert stated and stated.group(1) == repr(fields[name]), (
            f"{path.name}: {name} defaults to {fields[name]!r}, the table says {cell}")
