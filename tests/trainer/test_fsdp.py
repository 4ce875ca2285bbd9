"""FSDP2 with two CPU processes (gloo) under `accelerate launch --config_file recipes/configs/fsdp.yaml` must
reproduce one plain process, while really sharded: DTensor parameters during training, half the bytes per rank."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_distributed import free_port

HERE = Path(__file__).parent
CONFIG = HERE.parent.parent / "recipes" / "configs" / "fsdp.yaml"


def launch(out: Path, num_processes: int, sampling: str, variant: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parent.parent)]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    script = [str(HERE / "fsdp_train.py"), str(out), sampling, variant]
    if num_processes == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
                   "--num_processes", str(num_processes), "--main_process_port", str(free_port()), *script]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("sampling, variant", [("els", "full"), ("uls", "lora"), ("example", "full"),
                                               ("uls", "checkpointing")])
def test_two_sharded_processes_reproduce_one(tmp_path, sampling, variant):
    single = launch(tmp_path / "one.pt", 1, sampling, variant)
    sharded = launch(tmp_path / "two.pt", 2, sampling, variant)
    assert (single["world_size"], single["fsdp"]) == (1, False)
    assert (sharded["world_size"], sharded["fsdp"]) == (2, True)
    assert sharded["sharded"] == [True] * 3  # every parameter a DTensor at every optimizer step: not DDP
    assert sharded["epsilon"] == single["epsilon"]
    # gradient_checkpointing=True (non-reentrant) really checkpoints the (one) decoder layer, in both runs
    assert sharded["checkpointing"] == single["checkpointing"] == [variant == "checkpointing"]
    # Per rank, parameters + gradients + optimizer state: half of one process (rows split as torch.chunk does).
    ratios = [two / one for two, one in zip(sharded["bytes"], single["bytes"])]
    assert all(0.5 <= ratio < 0.52 for ratio in ratios), ratios
    for name, value in single["state"].items():
        torch.testing.assert_close(sharded["state"][name], value, rtol=1e-5, atol=1e-6, msg=f"{name} differs")
    moved = max(float((value - single["initial"][name]).abs().max()) for name, value in single["state"].items())
    assert moved > 1e-3  # the runs trained (and the noise was added), so equality says something


@pytest.mark.slow
def test_checkpoints_resuming_and_mixed_precision_are_refused_under_fsdp2(tmp_path):
    """A real DPTrainer on one FSDP2 rank: each refusal is one line; without them it builds sharded."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parent.parent)]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = tmp_path / "refusals.pt"
    result = subprocess.run([sys.executable, str(HERE / "fsdp_train.py"), str(out), "refusals"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    outcome = torch.load(out)
    assert outcome["save_strategy"].startswith(" | checkpoints under FSDP2") and "save_strategy='no'" in outcome[
        "save_strategy"]
    assert outcome["jit"].startswith(" | checkpoints under FSDP2") and "enable_jit_checkpoint=False" in outcome["jit"]
    assert outcome["bf16"].startswith(" | mixed_precision bf16 under FSDP2")
    assert outcome["none"].startswith("built, fsdp True | resume_from_checkpoint under FSDP2")
    assert all("\n" not in message for message in outcome.values())
