"""benchmarks/device_check.py (the prepared accelerator check) keeps working: run it on the CPU."""

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("device_check", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_device_check_runs_on_the_cpu(tmp_path, dtype, tolerance):
    report = load_script().main(["--device", "cpu", "--quick", "--dtype", dtype, "--out", str(tmp_path / "r.json")])
    assert (tmp_path / "r.json").exists()
    assert report["exactness"]["max_relative_error"] < tolerance
    assert 0 < report["dp"]["epsilon"] <= 8.0 and report["dp"]["steps"] == report["sizes"]["steps"]
    assert report["step_time_ratio"] > 0
