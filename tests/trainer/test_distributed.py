"""Two CPU processes (gloo) under `accelerate launch` must reproduce one process.

Starting the ranks costs more than a 3-step run, so each side (one process, two) is one launch that trains every
sampling in turn (the module's fixtures), and each test compares one sampling's two runs."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SAMPLINGS = ["uls", "els", "uls-adaptive", "uls-bf16"]


def launch(out: Path, num_processes: int, samplings: list[str]) -> dict:
    """`distributed_train.py` on `num_processes` processes training each of `samplings`: their saved dicts."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parent.parent)]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if num_processes == 1:
        command = [sys.executable, str(HERE / "distributed_train.py"), str(out), *samplings]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(num_processes), "--num_machines", "1", "--main_process_port", str(free_port()),
                   "--mixed_precision", "no", "--dynamo_backend", "no",
                   str(HERE / "distributed_train.py"), str(out), *samplings]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return {sampling: torch.load(out / f"{sampling}.pt") for sampling in samplings}


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("one"), 1, SAMPLINGS)


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("two"), 2, SAMPLINGS)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_two_processes_reproduce_one(one_process_runs, two_process_runs, sampling):
    single, double = one_process_runs[sampling], two_process_runs[sampling]
    assert (single["world_size"], double["world_size"]) == (1, 2)
    assert double["epsilon"] == single["epsilon"]
    assert double["max_grad_norm"] == pytest.approx(single["max_grad_norm"], rel=1e-6)  # the tracked C, if adaptive
    if sampling.endswith("adaptive"):
        assert single["max_grad_norm"] != 0.05
    # bf16: the float32 sums differ by the all-reduce's float32 rounding, then each is rounded once to bf16
    tolerance = dict(rtol=1e-2, atol=1e-3) if sampling.endswith("bf16") else dict(rtol=1e-5, atol=1e-6)
    for name, value in single["state"].items():
        assert double["state"][name].dtype == value.dtype
        torch.testing.assert_close(double["state"][name], value, **tolerance, msg=f"{name} differs")
