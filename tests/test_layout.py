"""The core stands alone: nothing outside `hf_dp.workflows` (and the `hf-dp` front door) imports from it."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_dp"
FRONT_DOORS = {"cli.py", "__main__.py"}  # the command line dispatches to workflows by name


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)[: -node.level]
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
        bad = sorted(name for name in _imports(path) if name.startswith("hf_dp.workflows"))
        if bad:
            offenders[str(relative)] = bad
    assert not offenders, f"core modules import workflow code: {offenders}"


def test_the_check_sees_a_workflow_import(tmp_path):
    """The scan above can fail: a relative import of the workflows is resolved and caught."""
    probe = PACKAGE / "_layout_probe.py"
    probe.write_text("from .workflows import study\n")
    try:
        assert any(name.startswith("hf_dp.workflows") for name in _imports(probe))
    finally:
        probe.unlink()
