"""The README's code runs: the DPTrainer example, on the embedded MiniLM, offline."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_the_two_commands():
    head = README.read_text().splitlines()[:15]
    assert any("hf-dp demo" in line for line in head)
    assert any("pytest" in line for line in head)


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
