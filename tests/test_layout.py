"""The package's layout: the core stands alone, and no module grows past what a reader can hold.

1. Nothing outside `hf_dp.workflows` (and the `hf-dp` front door) imports from it.
2. Every module under `hf_dp/` is at most 600 lines, and `hf_dp/trainer.py` at most 450: a module that grows past
   that is split by job.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_dp"
FRONT_DOORS = {"cli.py", "__main__.py"}  # the command line dispatches to workflows by name
MAX_LINES = 600
MAX_LINES_OF = {"trainer.py": 450}  # paths under hf_dp/ with a tighter limit


def _imports(source: str, relative: Path) -> set[str]:
    """Every module name a file imports (`from a import b` gives `a` and `a.b`).

    `relative` is the file's path under `hf_dp/`; relative imports are resolved against it. Only the text is read,
    so a probe needs no file.
    """
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                parts = [PACKAGE.name, *relative.with_suffix("").parts][: -node.level]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_core_imports_nothing_from_the_workflows():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "workflows" or str(relative) in FRONT_DOORS:
            continue
        bad = sorted(name for name in _imports(path.read_text(encoding="utf-8"), relative)
                     if name.startswith("hf_dp.workflows"))
        if bad:
            offenders[str(relative)] = bad
    assert not offenders, f"core modules import workflow code: {offenders}"


def test_the_check_sees_a_workflow_import():
    """The scan above can fail: a relative import of the workflows is resolved and caught (no file is written)."""
    assert "hf_dp.workflows.study" in _imports("from .workflows import study\n", Path("_layout_probe.py"))
    assert "hf_dp.workflows.runs" in _imports("from ..workflows.runs import fit\n", Path("audit/_probe.py"))
    assert "hf_dp.workflows" in _imports("from . import study\n", Path("workflows/__init__.py"))


def _too_long(line_counts: dict[str, int]) -> dict[str, str]:
    """`{path under hf_dp/: "<n> lines (limit <m>)"}` for every module over its limit."""
    return {
        f"hf_dp/{path}": f"{count} lines (limit {MAX_LINES_OF.get(path, MAX_LINES)})"
        for path, count in sorted(line_counts.items())
        if count > MAX_LINES_OF.get(path, MAX_LINES)
    }


def test_no_module_is_too_long():
    counts = {path.relative_to(PACKAGE).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
              for path in PACKAGE.rglob("*.py")}
    assert "trainer.py" in counts
    offenders = _too_long(counts)
    assert not offenders, (
        f"modules over {MAX_LINES} lines (hf_dp/trainer.py: over {MAX_LINES_OF['trainer.py']}); split them by job "
        "into modules with a docstring saying why each exists:\n  "
        + "\n  ".join(f"{path}: {what}" for path, what in offenders.items())
    )


def test_the_length_check_names_every_offender():
    counts = {"trainer.py": 451, "card.py": 600, "workflows/study.py": 601, "workflows/trainer.py": 500}
    assert _too_long(counts) == {"hf_dp/trainer.py": "451 lines (limit 450)",
                                 "hf_dp/workflows/study.py": "601 lines (limit 600)"}
