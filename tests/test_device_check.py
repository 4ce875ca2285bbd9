"""benchmarks/device_check.py (the prepared accelerator check) keeps working: run it on the CPU, `--quick`."""

import importlib.util
import json
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
    script = load_script()
    out = tmp_path / "r.json"
    report = script.main(["--device", "cpu", "--quick", "--dtype", dtype, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report["exactness"]) == set(script.CONFIGS)
    for exactness in report["exactness"].values():
        assert exactness["max_relative_error"] < tolerance
    lines = iter(report["verdicts"])
    for config in script.CONFIGS:
        for finetune in script.FINETUNES:
            runs = report["runs"][config][finetune]
            assert set(runs) == {"trainer", "dp"}, runs
            for run in runs.values():
                # One forward/backward pass a step for both, so the step times compare like for like.
                assert run["passes_per_step"] == 1.0 and run["rows_per_step"] > 0
                assert run["median_step_s"] > 0 and run["p10_step_s"] <= run["median_step_s"] <= run["p90_step_s"]
                # CUDA-only figures are missing on the CPU, not zero.
                assert run["peak_step_memory_bytes"] is None and run["syncs_per_step"] is None
                assert run["gpu_busy_fraction"] is None
            assert runs["trainer"]["rows_per_step"] == report["sizes"]["rows"]
            assert 0 < runs["dp"]["epsilon"] <= 8.0 and runs["dp"]["dp_steps"] == runs["dp"]["steps"]
            line = next(lines)
            assert line.startswith(f"{config} {finetune}: step x") and line.endswith(("PASS", "FAIL"))
            assert "memory n/a" in line
