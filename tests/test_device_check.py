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


def test_the_fsdp2_runs_are_on_with_a_gpu_and_off_on_the_cpu_unless_asked():
    script = load_script()
    assert script.parse_args(["--device", "cuda"]).fsdp  # parsing needs no GPU
    assert not script.parse_args(["--device", "cuda", "--fsdp", "off"]).fsdp
    assert not script.parse_args(["--device", "cpu"]).fsdp  # on the CPU only with the shim, so only when asked
    assert script.parse_args(["--device", "cpu", "--fsdp", "on"]).fsdp
    assert script.parse_args(["--device", "cuda"]).worker_timeout < 300  # a hung process costs the GPU run little


@pytest.mark.slow
def test_a_one_process_fsdp2_run_reproduces_the_plain_dp_run_on_the_cpu(tmp_path):
    """The FSDP2 run (its own process: a one-rank gloo group, the model really sharded) does the plain DP run's
    steps: same ε, same weights; its step time is reported beside the plain one."""
    script = load_script()
    report = script.main(["--device", "cpu", "--quick", "--dtype", "float32", "--configs", "llama-12x768",
                          "--finetune", "lora", "--fsdp", "on", "--out", str(tmp_path / "r.json")])
    runs = report["runs"]["llama-12x768"]["lora"]
    assert set(runs) == {"trainer", "dp", "fsdp"}, runs
    plain, sharded = runs["dp"], runs["fsdp"]
    assert (plain["fsdp"], plain["sharded"]) == (False, False)
    assert (sharded["fsdp"], sharded["world_size"], sharded["sharded"]) == (True, 1, True)  # DTensors: not plain
    assert sharded["passes_per_step"] == 1.0 and sharded["dp_steps"] == sharded["steps"] == plain["steps"]
    assert sharded["epsilon"] == plain["epsilon"] and sharded["median_step_s"] > 0
    assert sharded["weights_sum_of_squares"] == pytest.approx(plain["weights_sum_of_squares"], rel=1e-6)
    assert sharded["weights_sum"] == pytest.approx(plain["weights_sum"], rel=1e-5)
    # The noise moved the DP runs away from Trainer's, so their agreement says something.
    assert abs(plain["weights_sum"] - runs["trainer"]["weights_sum"]) > 1e-3
    ratios = report["ratios"]["llama-12x768"]["lora"]["fsdp_vs_dp"]
    assert ratios["epsilon_equal"] and ratios["memory"] is None and ratios["step"] > 0
    assert ratios["weights_relative_difference"] < 1e-6
    assert any(line.startswith("llama-12x768 lora fsdp: step x") for line in report["verdicts"])
