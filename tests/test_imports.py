"""Import rules of the package, checked on its source (AST) and, for torch, in a fresh interpreter.

1. `hf_dp.accounting` is pure math: it imports neither torch (nor transformers) nor `hf_dp.clipping`, so that
   `hf-dp plan` (even `--adaptive_clipping`) never loads torch.
2. The core imports nothing from `hf_dp.audit`, `hf_dp.workflows`, `hf_dp.cli` or the UI (gradio). The core is
   `hf_dp` minus `hf_dp/workflows/`, `hf_dp/audit/` (an optional library feature built on the core, run by
   `hf-dp audit`) and the command line (`hf_dp/cli.py`, `hf_dp/__main__.py`). One edge is allowed
   (`CORE_TO_AUDIT`): publishing checks a card's "Empirical audit" section by rendering it again with the audit's
   own code (`hf_dp.card_check` imports `hf_dp.audit.record`), so the card and its check cannot drift apart.
3. No private name crosses a module boundary inside `hf_dp`: no `from .x import _name`, no `x._name` where `x`
   is an `hf_dp` module. A name another module needs is public (or lives in the module that uses it).
4. No mechanism key is written into the core outside `hf_dp.mechanisms`: not compared, not a dict key, not a
   lookup, not the first argument of a row (the study's task names: compared nowhere outside the task registry).
5. The plan's layers (`PLAN_LAYERS`) import only downwards and at the top of the file, so the planner and the
   mechanisms cannot form a circle again; `hf_dp.accounting` imports nothing else of hf_dp.
6. No import circle anywhere in hf_dp, function-level imports included.

Every rule checks imports anywhere in a file (inside functions too) and names the offending file:line.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_dp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = sorted(PACKAGE.rglob("*.py"))
MODULES = {_module_name(path): path for path in FILES}
NON_CORE = ("hf_dp.workflows", "hf_dp.audit", "hf_dp.cli", "hf_dp.__main__")
CORE_TO_AUDIT = {("hf_dp.card_check", "hf_dp.audit.record")}  # (core module, the audit module it may import)


def _within(module: str, prefixes) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The module an `from ... import` statement imports from, made absolute."""
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path):
    """(line, imported module) for every import in the file; `from a import b` yields `a.b` when that is a module."""
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(path, node)
            yield node.lineno, module
            for alias in node.names:
                if f"{module}.{alias.name}" in MODULES:
                    yield node.lineno, f"{module}.{alias.name}"


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def _report(violations: list[str], rule: str) -> str:
    return f"{rule}; {len(violations)} violation(s):\n  " + "\n  ".join(violations)


# ---- 1. accounting: no torch, no clipping ------------------------------------------------------------


def test_accounting_imports_neither_torch_nor_clipping():
    violations = [
        f"{_where(path, line)} imports {module}"
        for path in FILES if _within(_module_name(path), ("hf_dp.accounting",))
        for line, module in _imports(path)
        if _within(module, ("torch", "transformers", "hf_dp.clipping"))
    ]
    assert not violations, _report(violations, "hf_dp.accounting must import neither torch/transformers nor "
                                               "hf_dp.clipping (move the pure math into hf_dp.accounting)")


def test_accounting_the_plan_command_and_the_trainer_load_only_what_they_need():
    """What three entry points load, each in a fresh interpreter: one subprocess that forks a child per check
    before it imports anything of hf_dp (so no check sees another's modules; one interpreter to start, and the
    checks run side by side): importing `hf_dp.accounting` and planning with adaptive clipping, then `hf-dp plan
    --adaptive_clipping`, load no torch; `hf_dp.report` checks the Hub through `hf_dp.hub`, and the publish
    command's parser is imported only to run it, so the trainers load no command-line parser."""
    accounting = sorted(name for name in MODULES if _within(name, ("hf_dp.accounting",)))
    no_torch = "\n".join([
        *[f"import {name}" for name in accounting],
        "from hf_dp import mechanism_table",
        "mechanism_table.compare(users=300, examples_per_user=4, examples_per_step=30, steps=20, target_epsilon=5,",
        "                        adaptive_clipping=True, noise_multiplier=1.0)",
        "loaded = sorted(m for m in ('torch', 'transformers', 'hf_dp.clipping') if m in sys.modules)",
        "assert not loaded, f'importing hf_dp.accounting and planning with adaptive clipping loaded {loaded}'",
        "from hf_dp import cli",
        "assert cli.main(['plan', '--users', '300', '--examples_per_user', '4', '--adaptive_clipping']) == 0",
        "loaded = [m for m in ('torch', 'gradio', 'matplotlib', 'hf_dp.trainer') if m in sys.modules]",
        "assert not loaded, f'hf-dp plan loaded {loaded}'",
    ])
    trainer = "\n".join([
        "import hf_dp.trainer, hf_dp.sft",
        "loaded = sorted(m for m in sys.modules if m in ('hf_dp.command_line', 'hf_dp.cli'))",
        "assert not loaded, f'importing the trainers loaded {loaded}'",
    ])
    code = "\n".join([
        "import os, sys, traceback",
        "def check(code):",
        "    pid = os.fork()",
        "    if pid == 0:",
        "        try:",
        "            exec(code, {'sys': sys})",
        "        except BaseException:",
        "            traceback.print_exc()",
        "            sys.stderr.flush()",
        "            os._exit(1)",
        "        sys.stdout.flush()",
        "        os._exit(0)",
        "    return pid",
        f"children = [check({no_torch!r}), check({trainer!r})]",
        "sys.exit(sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in children))",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-4000:]


# ---- 2. the core: nothing from audit, workflows, the command line or the UI ---------------------------


def test_the_core_imports_no_audit_workflows_or_ui():
    forbidden = ("hf_dp.audit", "hf_dp.workflows", "hf_dp.cli", "gradio")
    violations = [
        f"{_where(path, line)} imports {module}"
        for path in FILES if not _within(_module_name(path), NON_CORE)
        for line, module in _imports(path)
        if _within(module, forbidden) and (_module_name(path), module) not in CORE_TO_AUDIT
    ]
    assert not violations, _report(violations, "the core (hf_dp minus workflows/, audit/ and the CLI) must import "
                                               "nothing from hf_dp.audit, hf_dp.workflows, hf_dp.cli or gradio")


# ---- 3. no private name crosses a module boundary -----------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _private_crossings(path: Path) -> list[str]:
    tree = _tree(path)
    modules = {}  # local name -> hf_dp module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_dp":
                    if alias.asname:
                        modules[alias.asname] = alias.name
                    else:
                        modules["hf_dp"] = "hf_dp"
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(path, node)
            if not _within(module, ("hf_dp",)):
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{_where(path, node.lineno)} imports {module}.{alias.name}")
                if f"{module}.{alias.name}" in MODULES:
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = _dotted(node.value)
            if base is None:
                continue
            head, _, rest = base.partition(".")
            if head not in modules:
                continue
            target = modules[head] + (f".{rest}" if rest else "")
            if target in MODULES and target != _module_name(path):
                found.append(f"{_where(path, node.lineno)} uses {target}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module_boundary():
    violations = [violation for path in FILES for violation in _private_crossings(path)]
    assert not violations, _report(violations, "a private name (_x) is used outside its module: make it public "
                                               "with a clear name or move it to the module that uses it")


@pytest.mark.parametrize("source, expected", [
    ("from .card import _fmt_sig\n", "imports hf_dp.card._fmt_sig"),
    ("from hf_dp import corpora\ncorpora._sha256(b'')\n", "uses hf_dp.corpora._sha256"),
    ("import hf_dp.card as card\ncard._rounded(1)\n", "uses hf_dp.card._rounded"),
])
def test_the_private_name_rule_catches(tmp_path, monkeypatch, source, expected):
    path = PACKAGE / "_probe_module.py"  # never written: the check reads the source through _tree
    monkeypatch.setitem(MODULES, "hf_dp.corpora", PACKAGE / "corpora.py")
    monkeypatch.setattr(sys.modules[__name__], "_tree", lambda _: ast.parse(source))
    found = _private_crossings(path)
    assert len(found) == 1 and expected in found[0] and "hf_dp/_probe_module.py:" in found[0], found


# ---- 4. mechanisms are looked up, not compared ----------------------------------------------------------------------

MECHANISM_KEYS = {"uls", "els", "example"}
MECHANISM_HOMES = {"hf_dp.mechanisms"}  # the registry: each mechanism names itself there


def _constant_in(node, keys) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys


def _names_a_key(node, keys=MECHANISM_KEYS, comparisons_only: bool = False) -> bool:
    """A key written into code: `x == "uls"`, `"els" != x`, `x in ("uls", "els")`, a dict keyed by one
    (`{"uls": ...}`, `dict(els=...)`), a lookup by one (`table["example"]`), or a row built for one
    (`_row("uls", ...)`)."""
    if isinstance(node, ast.Compare):
        for operand in (node.left, *node.comparators):
            values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            if any(_constant_in(v, keys) for v in values):
                return True
    if comparisons_only:
        return False
    if isinstance(node, ast.Dict):
        return any(key is not None and _constant_in(key, keys) for key in node.keys)
    if isinstance(node, ast.Subscript):
        return _constant_in(node.slice, keys)
    if isinstance(node, ast.Call):
        return any(_constant_in(arg, keys) for arg in node.args) or any(kw.arg in keys for kw in node.keywords)
    return False


def test_the_core_never_compares_a_mechanism_key():
    """Every difference between ULS, ELS and example-level is a method of its `hf_dp.mechanisms` object."""
    violations = [
        _where(path, node.lineno) for module, path in MODULES.items()
        if not _within(module, NON_CORE) and module not in MECHANISM_HOMES
        for node in ast.walk(_tree(path)) if _names_a_key(node)
    ]
    assert not violations, _report(violations, "a mechanism key compared, or written as a dict key, lookup or "
                                               "row, outside hf_dp.mechanisms")


@pytest.mark.parametrize("source", [
    'x == "uls"\n', '"els" != x\n', 'x in ("uls", "els")\n',  # comparisons
    '{"uls": 1}\n', 'dict(els=1)\n', 'table["example"]\n',  # a dict keyed by a mechanism, a lookup by one
    '_row("uls", 8, 0.1)\n',  # a hard-coded row, as the planner had
])
def test_the_mechanism_key_rule_catches(source):
    assert [node for node in ast.walk(ast.parse(source)) if _names_a_key(node)], source


def test_the_mechanism_key_rule_lets_names_and_defaults_pass():
    source = 'sampling: str = field(default="uls")\nget_mechanism(args.mechanism)\nlabel = "ULS"\n'
    assert not [node for node in ast.walk(ast.parse(source)) if _names_a_key(node)]


# ---- 5. the plan's layers: one direction, no circle ----------------------------------------------------------------

# Lowest first. The accountant is pure math; rows per user and their DP quantile build on it; the mechanisms on
# both; the arguments select a registered mechanism; G and the partition, the privacy plan, then `mechanism_table`
# (which compares every registered mechanism for `hf-dp plan` and the app) build on those.
PLAN_LAYERS = ("hf_dp.accounting", "hf_dp.user_counts", "hf_dp.mechanisms", "hf_dp.vocabulary", "hf_dp.arguments",
               "hf_dp.contribution", "hf_dp.privacy_plan", "hf_dp.mechanism_table")


def _layer(module: str) -> int | None:
    return next((i for i, layer in enumerate(PLAN_LAYERS) if _within(module, (layer,))), None)


def _function_level(path: Path) -> set[int]:
    """Lines of the imports made inside a function."""
    return {node.lineno for function in ast.walk(_tree(path))
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))}


def test_the_plan_layers_import_downwards_at_the_top_of_the_file():
    """No circle between the planner and the mechanisms, hidden in a function or not; `hf_dp.accounting` imports
    nothing else of hf_dp."""
    violations = []
    for module, path in MODULES.items():
        layer = _layer(module)
        if layer is None:
            continue
        inside = _function_level(path)
        for line, imported in _imports(path):
            other = _layer(imported)
            if layer == 0 and _within(imported, ("hf_dp",)) and imported != "hf_dp" and other != 0:
                violations.append(f"{_where(path, line)} (accounting) imports {imported}")
            elif other is not None and other > layer:
                violations.append(f"{_where(path, line)} imports {imported}, a layer above")
            elif other is not None and other != layer and line in inside:
                violations.append(f"{_where(path, line)} imports {imported} inside a function")
    assert not violations, _report(violations, f"the plan's layers ({' < '.join(PLAN_LAYERS)}) import only "
                                               "downwards, at the top of the file")


# The study's task names, and the app's (whose Train tab offers its own two): only the registry tells them apart.
TASK_KEYS = {"sft", "causal_lm", "classification", "chat-sft", "causal-lm"}
TASK_HOMES = {"hf_dp.workflows.tasks", "hf_dp.workflows.app.training"}  # the registry; the app's two Train-tab runs


def _keys_by_a_task_name(node) -> bool:
    """`{"sft": ...}` and `table["sft"]`: a table keyed by task name tells tasks apart as a comparison does."""
    if isinstance(node, ast.Dict):
        return any(isinstance(key, ast.Constant) and key.value in TASK_KEYS for key in node.keys)
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in TASK_KEYS


def test_the_study_never_compares_a_task_name():
    """Every difference between the study's tasks is a field of its `hf_dp.workflows.tasks.StudyTask`."""
    violations = [
        _where(path, node.lineno) for module, path in MODULES.items()
        if _within(module, ("hf_dp.workflows",)) and module not in TASK_HOMES
        for node in ast.walk(_tree(path))
        if _names_a_key(node, TASK_KEYS) or _keys_by_a_task_name(node)
    ]
    assert not violations, _report(violations, "a task name compared, or a table keyed by task name, outside "
                                               "hf_dp.workflows.tasks")


@pytest.mark.parametrize("source", ['TABLE = {"sft": 1}\n', 'x = settings["causal_lm"]\n', 'ok = task == "sft"\n'])
def test_the_task_name_check_catches(source):
    assert any(_names_a_key(node, TASK_KEYS) or _keys_by_a_task_name(node)
               for node in ast.walk(ast.parse(source)))


# ---- 6. no import circle anywhere in hf_dp ------------------------------------------------------------------------

def _dependencies(path: Path) -> set[str]:
    """The hf_dp modules a file imports, inside functions too: `from a import b` depends on `a.b` when that is a
    module (importing a sibling through its package), on `a` otherwise."""
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(path, node)
            found |= {f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module
                      for alias in node.names}
    return {name for name in found if name in MODULES and name != _module_name(path)}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted: every one holds a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(edges.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return groups


def test_no_module_imports_itself_back_through_others():
    """A circle hidden in function-level imports still ties its modules together (neither can be read, tested or
    moved without the other): there is none in hf_dp, inside functions or not."""
    circles = _circles({module: _dependencies(path) for module, path in MODULES.items()})
    assert not circles, _report([" <-> ".join(group) for group in circles], "modules that import each other "
                                "(directly or through others): move the shared piece down to a module both import")


def test_the_circle_check_catches():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
