"""`ruff check` is clean at the code's width (configuration in pyproject.toml): run with the tests, so in CI."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    result = subprocess.run([ruff, "check", "--output-format", "concise", "hf_dp", "tests", "recipes", "benchmarks",
                             "app"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
