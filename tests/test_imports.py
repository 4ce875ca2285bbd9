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
        "from hf_dp.accounting import planner",
        "planner.plan(users=300, examples_per_user=4, examples_per_step=30, steps=20, target_epsilon=5,",
        "             adaptive_clipping=True, noise_multiplier=1.0)",
        "loaded = sorted(m for m in ('torch', 'transformers', 'hf_dp.clipping') if m in sys.modules)",
        "assert not loaded, f'importing hf_dp.accounting and planning with adaptive clipping loaded {loaded}'",
        "from hf_dp import cli",
        "assert cli.main(['plan', '--users', '300', '--examples_per_user', '4', '--adaptive_clipping']) == 0",
        "loaded = [m for m in ('torch', 'gradio', 'matplotlib', 'hf_dp.trainer') if m in sys.modules]",
        "assert not loaded, f'hf-dp plan loaded {loaded}'",
    ])
    trainer = "\n".join([
        "import hf_dp.trainer, hf_dp.sft",
        "loaded = sorted(m for m in sys.modules if m in ('hf_dp.parser', 'hf_dp.cli'))",
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
MECHANISM_HOMES = {"hf_dp.mechanisms", "hf_dp.vocabulary"}  # the registry, and the table of names and labels


def _compares_a_mechanism_key(node, keys=MECHANISM_KEYS) -> bool:
    """`x == "uls"`, `"els" != x`, `x in ("uls", "els")` and the like."""
    if not isinstance(node, ast.Compare):
        return False
    operands = [node.left, *node.comparators]
    for operand in operands:
        values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        if any(isinstance(v, ast.Constant) and v.value in keys for v in values):
            return True
    return False


def test_the_core_never_compares_a_mechanism_key():
    """Every difference between ULS, ELS and example-level is a method of its `hf_dp.mechanisms` object."""
    violations = [
        _where(path, node.lineno) for module, path in MODULES.items()
        if not _within(module, NON_CORE) and module not in MECHANISM_HOMES
        for node in ast.walk(_tree(path)) if _compares_a_mechanism_key(node)
    ]
    assert not violations, _report(violations, "a mechanism key compared outside hf_dp.mechanisms")


# The study's task names, and the app's (whose Train tab offers its own two): only the registry tells them apart.
TASK_KEYS = {"sft", "causal_lm", "classification", "chat-sft", "causal-lm"}
TASK_HOMES = {"hf_dp.workflows.tasks", "hf_dp.workflows.app.training"}  # the registry; the app's two Train-tab runs


def test_the_study_never_compares_a_task_name():
    """Every difference between the study's tasks is an entry of `hf_dp.workflows.tasks.TASK_REGISTRY`."""
    violations = [
        _where(path, node.lineno) for module, path in MODULES.items()
        if _within(module, ("hf_dp.workflows",)) and module not in TASK_HOMES
        for node in ast.walk(_tree(path)) if _compares_a_mechanism_key(node, TASK_KEYS)
    ]
    assert not violations, _report(violations, "a task name compared outside hf_dp.workflows.tasks")
