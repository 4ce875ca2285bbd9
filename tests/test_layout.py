"""The package's layout: the core stands alone, each module has one job, and no function outgrows a reader.

1. Nothing outside `hf_dp.workflows` (and the `hf-dp` front door) imports from it.
2. Every module's docstring opens with one sentence saying its one job: modules are split by job, not by size.
3. No function has more than 80 lines of code unless its docstring says why it is one function.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_dp"
FRONT_DOORS = {"cli.py", "__main__.py"}  # the command line dispatches to workflows by name
MAX_FUNCTION_LINES = 80  # lines of code, docstring not counted
LONG_BECAUSE = "One function because"  # how a longer function's docstring says why it is one
MAX_JOB_LINE = 120


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


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's code: from its first statement after the docstring to its end."""
    body = function.body
    if len(body) > 1 and ast.get_docstring(function) is not None:
        body = body[1:]
    return function.end_lineno - body[0].lineno + 1


def _long_functions(source: str, where: str) -> dict[str, int]:
    """`{"<where>:<name>": lines}` for every function over `MAX_FUNCTION_LINES` lines of code whose docstring does
    not say why it is one function (a line starting with `LONG_BECAUSE`)."""
    offenders = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > MAX_FUNCTION_LINES:
            reason = any(line.strip().startswith(LONG_BECAUSE) for line in (ast.get_docstring(node) or "").splitlines())
            if not reason:
                offenders[f"{where}:{node.name}"] = _code_lines(node)
    return offenders


def _job_line(source: str) -> str | None:
    """What is wrong with a module's first docstring line as the statement of its one job, or None."""
    docstring = ast.get_docstring(ast.parse(source))
    if not docstring:
        return "no module docstring"
    first = docstring.splitlines()[0]
    if not first.endswith(".") or len(first) > MAX_JOB_LINE:
        return f"first line is not one sentence of at most {MAX_JOB_LINE} characters: {first!r}"
    return None


def _modules():
    return {path.relative_to(PACKAGE).as_posix(): path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py")}


def test_every_module_says_its_one_job_in_its_first_line():
    """Modules are split by job, not by size: each module's docstring opens with the one thing it is for."""
    modules = _modules()
    assert "trainer.py" in modules
    offenders = {path: what for path, source in modules.items() if (what := _job_line(source))}
    assert not offenders, "modules whose docstring does not open with their job:\n  " + "\n  ".join(
        f"hf_dp/{path}: {what}" for path, what in sorted(offenders.items()))


def test_no_function_is_long_without_saying_why():
    offenders = {}
    for path, source in _modules().items():
        offenders.update(_long_functions(source, f"hf_dp/{path}"))
    assert not offenders, (
        f"functions over {MAX_FUNCTION_LINES} lines of code: split them, or say in the docstring why they are one "
        f"function (a line starting {LONG_BECAUSE!r}):\n  " + "\n  ".join(f"{k}: {v}" for k, v in offenders.items()))


def test_the_layout_checks_name_what_they_catch():
    """The two checks above can fail: a long function without a reason, and modules without a job line."""
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES + 1))
    long_source = f'def long():\n    """Does a lot."""\n{body}'
    assert _long_functions(long_source, "m.py") == {"m.py:long": MAX_FUNCTION_LINES + 1}
    reasoned = long_source.replace('"""Does a lot."""', f'"""Does a lot.\n\n    {LONG_BECAUSE} a table."""')
    assert _long_functions(reasoned, "m.py") == {}
    short = "def f():\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(short, "m.py") == {}
    assert _job_line("x = 1\n") == "no module docstring"
    assert "one sentence" in _job_line('"""Helpers for this and\nthat."""\n')
    assert _job_line('"""Helpers for one thing.\n\nMore words."""\n') is None
