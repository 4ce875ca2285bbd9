"""pyproject.toml declares what the code imports: the core's imports as dependencies, the workflows' as extras.

The core's dependencies cover `hf_dp` outside `hf_dp/workflows/` (the trainer, accounting, card, hub, audit and the
`hf-dp plan`/`publish` commands); `hf_dp/workflows/` may also use the `demo` and `app` extras; the tests may use
the `test` extra. A dependency nothing imports is an error too (it was `evaluate`), except those listed below.
"""
from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Declared for what the code will use, or installed with another dependency and used through it.
DECLARED_UNIMPORTED = {
    "filelock",  # the run lock (installed with huggingface_hub anyway)
    "gguf",  # transformers reads SmolLM2's GGUF file with it (hf_dp.workflows.pretrained checks it is there)
    "dp-accounting", "playwright", "ruff", "pytest", "pytest-xdist", "pyyaml", "tokenizers",  # test-only; checked below
    "mkdocs-material",  # the docs build
}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def _extra(name: str) -> set[str]:
    names = set()
    for requirement in PROJECT["optional-dependencies"][name]:
        names.add(_name(requirement))
        included = re.fullmatch(r"hf[-_]dp\[([^\]]+)\]", requirement.replace(" ", ""))
        if included:
            for other in included.group(1).split(","):
                names |= _extra(other)
    return names - {"hf-dp"}


CORE = {_name(requirement) for requirement in PROJECT["dependencies"]}


def _third_party_imports(paths) -> dict[str, str]:
    """distribution name -> one file:line importing it."""
    distributions = packages_distributions()
    found = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "hf_dp" or top not in distributions:
                    continue  # local test helpers (tiny_models, ...) are not distributions
                for distribution in distributions[top]:
                    found.setdefault(_name(distribution), f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


# Core modules that need an extra of their own, and that extra.
OPTIONAL_MODULES = {ROOT / "hf_dp" / "sft.py": "trl"}
CORE_FILES = [p for p in (ROOT / "hf_dp").rglob("*.py")
              if "workflows" not in p.relative_to(ROOT).parts and p not in OPTIONAL_MODULES]
WORKFLOW_FILES = list((ROOT / "hf_dp" / "workflows").rglob("*.py"))


# Imported by the core without being a dependency: triton comes with CUDA builds of torch; hf_dp/noise_kernel.py is
# imported only for a CUDA device's noise, which falls back to the reference engine without it (the test extra
# installs it for Triton's interpreter).
WITH_CUDA_TORCH = {"triton"}


def test_the_core_imports_only_core_dependencies():
    undeclared = {name: where for name, where in _third_party_imports(CORE_FILES).items()
                  if name not in CORE | WITH_CUDA_TORCH}
    assert not undeclared, f"imported by the core but not in [project] dependencies: {undeclared}"


def test_workflows_import_only_core_dependencies_and_their_extras():
    allowed = CORE | _extra("demo") | _extra("app")
    undeclared = {name: where for name, where in _third_party_imports(WORKFLOW_FILES).items() if name not in allowed}
    assert not undeclared, f"imported by hf_dp/workflows but in neither the core nor the demo/app extras: {undeclared}"


@pytest.mark.parametrize("path, extra", OPTIONAL_MODULES.items(), ids=lambda value: str(value).split("/")[-1])
def test_optional_modules_import_only_core_dependencies_and_their_extra(path, extra):
    undeclared = {name: where for name, where in _third_party_imports([path]).items()
                  if name not in CORE | _extra(extra)}
    assert not undeclared, f"{path.name} imports what neither the core nor the {extra!r} extra declares: {undeclared}"


def test_tests_import_only_declared_packages():
    allowed = CORE | _extra("test")
    undeclared = {name: where for name, where in _third_party_imports((ROOT / "tests").rglob("*.py")).items()
                  if name not in allowed}
    assert not undeclared, f"imported by tests/ but not in the core or the test extra: {undeclared}"


def test_every_declared_dependency_is_used():
    imported = set(_third_party_imports([*CORE_FILES, *WORKFLOW_FILES, *OPTIONAL_MODULES]))
    declared = CORE | _extra("demo") | _extra("app") | set().union(*(_extra(e) for e in OPTIONAL_MODULES.values()))
    unused = sorted(declared - imported - DECLARED_UNIMPORTED)
    assert not unused, f"declared but imported nowhere in hf_dp (drop them or say why in DECLARED_UNIMPORTED): {unused}"


def test_the_test_extra_includes_every_workflow_extra():
    assert _extra("demo") | _extra("app") | _extra("docs") | _extra("trl") | _extra("qlora") <= _extra("test")
    assert "gradio" in _extra("app") and _extra("demo") <= _extra("app")
