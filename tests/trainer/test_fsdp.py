"""FSDP2 with CPU processes (gloo) under `accelerate launch --config_file recipes/configs/fsdp.yaml`: two sharded
ranks reproduce one process (really sharded: DTensor parameters, half the bytes per rank), in float32 and in bf16;
sharded checkpoints carry the ledger and resume exactly, on the same or another number of ranks, after a killed
rank or a just-in-time save; a stalled rank stops the others within `ddp_timeout`.

Starting ranks costs more than a 4-step run, so the straight runs the tests compare with (one plain process, one
rank, two ranks) are each one launch for the module (the `*_runs` fixtures), and every test compares with those."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_dp.checkpoint import read_checkpoint
from test_distributed import free_port

HERE = Path(__file__).parent
CONFIG = HERE.parent.parent / "recipes" / "configs" / "fsdp.yaml"


def run(out: Path, sampling: str, variant: str, mode: str = "straight", *, steps: int = 4,
        run_dir: Path | None = None) -> dict:
    """One run for `fsdp_train.py` (the keyword arguments of its `main`): its outcome saved to `out`, its
    checkpoints in `run_dir` (`out` with the suffix `.run` unless given)."""
    return dict(out_path=str(out), sampling=sampling, variant=variant, mode=mode, steps=steps,
                run_dir=str(run_dir or out.with_suffix(".run")))


def launch(num_processes: int | None, *runs: dict, must_succeed: bool = True):
    """`fsdp_train.py` training `runs` in turn in one launch on `num_processes` FSDP2 ranks (`None`: one plain
    process): their saved dicts, in order, or the completed process when it may fail. Starting the ranks costs
    more than a run, so each group of runs the tests compare is launched once (the fixtures below)."""
    spec = Path(runs[0]["out_path"]).with_suffix(".runs.json")
    spec.write_text(json.dumps(list(runs)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parent.parent)]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    script = [str(HERE / "fsdp_train.py"), str(spec)]
    if num_processes is None:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
                   "--num_processes", str(num_processes), "--main_process_port", str(free_port()), *script]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if (result.returncode != 0 and TEARDOWN_ABORT in result.stderr and must_succeed
            and num_processes is not None and all(one["mode"] in ("straight", "cut") for one in runs)):
        # gloo's teardown race on a loaded 2-core machine (a rank aborts at exit after its work is done, despite
        # finish_processes): run these runs once more from nothing, rather than read a half-torn-down one
        for one in runs:
            shutil.rmtree(one["run_dir"], ignore_errors=True)
            Path(one["out_path"]).unlink(missing_ok=True)
        command[command.index("--main_process_port") + 1] = str(free_port())
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if not must_succeed:
        return result
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [torch.load(one["out_path"]) for one in runs]


TEARDOWN_ABORT = "terminate called without an active exception"


def assert_same_weights(a: dict, b: dict, rtol=1e-5, atol=1e-6) -> None:
    for name, value in a["state"].items():
        torch.testing.assert_close(b["state"][name], value, rtol=rtol, atol=atol, msg=f"{name} differs")


def largest_update(run: dict) -> float:
    return max(float((value - run["initial"][name]).abs().max()) for name, value in run["state"].items())


# The straight runs the tests compare, each launched once for the module: the same variant on one plain process,
# one FSDP2 rank and two, keyed (sampling, variant, steps). Runs in one launch are independent: each builds its own
# model, arguments and trainer from fixed seeds, and records its precision (float32 runs come first).
SHARDED = [("els", "full"), ("uls", "lora"), ("example", "full"), ("uls", "checkpointing")]
ONE_PROCESS = [*SHARDED, ("uls", "bf16-full"), ("uls", "bf16weights-full")]
ONE_RANK = [("uls", "bf16-full"), ("els", "bf16-lora")]
TWO_RANKS = [*SHARDED, ("uls", "full"), ("uls", "full", 30), ("uls", "bf16-full"), ("els", "bf16-lora"),
             ("uls", "bf16weights-full")]


def launch_straight(folder: Path, num_processes: int | None, variants: list[tuple], *extra: dict) -> dict:
    keys = [(sampling, variant, *rest) if rest else (sampling, variant, 4) for sampling, variant, *rest in variants]
    runs = [run(folder / f"{sampling}-{variant}-{steps}.pt", sampling, variant, steps=steps)
            for sampling, variant, steps in keys]
    return dict(zip(keys + [Path(one["out_path"]).stem for one in extra], launch(num_processes, *runs, *extra)))


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    return launch_straight(tmp_path_factory.mktemp("one-process"), None, ONE_PROCESS)


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    """The straight runs on one FSDP2 rank, and "cut": the run folder of one rank stopped after step 2."""
    folder = tmp_path_factory.mktemp("one-rank")
    cut = run(folder / "cut.pt", "uls", "full", "cut")
    return {**launch_straight(folder, 1, ONE_RANK, cut), "cut": Path(cut["run_dir"])}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    return launch_straight(tmp_path_factory.mktemp("two-ranks"), 2, TWO_RANKS)


@pytest.mark.slow
@pytest.mark.parametrize("sampling, variant", SHARDED)
def test_two_sharded_processes_reproduce_one(one_process_runs, two_rank_runs, sampling, variant):
    single, sharded = one_process_runs[sampling, variant, 4], two_rank_runs[sampling, variant, 4]
    assert (single["world_size"], single["fsdp"]) == (1, False)
    assert (sharded["world_size"], sharded["fsdp"]) == (2, True)
    assert single["mixed_precision"] == sharded["mixed_precision"] == "no"  # float32, whatever ran before
    assert sharded["sharded"] == [True] * 4  # every parameter a DTensor at every optimizer step: not DDP
    assert sharded["epsilon"] == single["epsilon"]
    # gradient_checkpointing=True (non-reentrant) really checkpoints the (one) decoder layer, in both runs
    assert sharded["checkpointing"] == single["checkpointing"] == [variant == "checkpointing"]
    # Per rank, parameters + gradients + optimizer state: half of one process (rows split as torch.chunk does).
    ratios = [two / one for two, one in zip(sharded["bytes"], single["bytes"])]
    assert all(0.5 <= ratio < 0.52 for ratio in ratios), ratios
    assert_same_weights(single, sharded)
    assert largest_update(single) > 1e-3  # the runs trained (and the noise was added), so equality says something


@pytest.mark.slow
@pytest.mark.parametrize("sampling, variant", ONE_RANK)
def test_bf16_under_fsdp2_matches_one_rank_and_one_process(one_process_runs, one_rank_runs, two_rank_runs, sampling,
                                                           variant):
    """accelerate's bf16 policy (parameters gathered in bf16): 2 ranks equal 1 rank under the same policy to within
    one bf16 rounding of the update: the norms, clipped sums, their reduce-scatter and the noise stay float32, but a
    rank's bf16 forward over half the rows may round differently from one over all of them (measured with the
    libraries of 2026-12-03: 2.4e-5 on a LoRA update of 0.12, ELS); one plain process under bf16 autocast (what DDP
    runs) rounds other ops to bf16 too, so its updates agree to about one bf16 step as well."""
    one_rank, two_ranks = one_rank_runs[sampling, variant, 4], two_rank_runs[sampling, variant, 4]
    assert (one_rank["param_dtype"], two_ranks["param_dtype"]) == ("torch.bfloat16", "torch.bfloat16")
    assert (one_rank["world_size"], one_rank["fsdp"], two_ranks["world_size"]) == (1, True, 2)
    assert two_ranks["sharded"] == [True] * 4 and two_ranks["epsilon"] == one_rank["epsilon"]
    assert all(value.dtype == torch.float32 for value in two_ranks["state"].values())  # float32 master weights
    assert_same_weights(one_rank, two_ranks, rtol=0, atol=2**-7 * largest_update(two_ranks))
    if variant == "bf16-full":
        autocast = one_process_runs[sampling, variant, 4]
        assert autocast["mixed_precision"] == "bf16" and autocast["epsilon"] == two_ranks["epsilon"]
        step = largest_update(autocast)
        # bf16 keeps 8 significant bits: updates agree within 2⁻⁷ of the largest (measured: 3·10⁻³ of it)
        assert_same_weights(autocast, two_ranks, rtol=0, atol=2**-7 * step)
        assert step > 1e-2


@pytest.mark.slow
def test_bf16_weights_sum_in_float32_under_fsdp2_as_in_one_process(one_process_runs, two_rank_runs):
    """A model loaded in bf16 (no mixed-precision policy): its shards and gradients are bf16, but the clipped sums
    are reduce-scattered, accumulated and noised in float32 and rounded once, as one plain process does."""
    single, sharded = one_process_runs["uls", "bf16weights-full", 4], two_rank_runs["uls", "bf16weights-full", 4]
    assert single["mixed_precision"] == sharded["mixed_precision"] == "no"
    assert sharded["sharded"] == [True] * 4 and sharded["epsilon"] == single["epsilon"]
    assert all(value.dtype == torch.bfloat16 for value in sharded["state"].values())
    assert_same_weights(single, sharded, rtol=0, atol=2**-7 * largest_update(single))
    assert largest_update(single) > 1e-2


@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_after_a_killed_rank_and_on_another_number_of_ranks(
        tmp_path, one_rank_runs, two_rank_runs):
    straight = two_rank_runs["uls", "full", 4]
    # Rank 1 is killed (SIGKILL) after step 3; checkpoint-2 was saved: model and optimizer shards, ledger once.
    killed = launch(2, run(tmp_path / "killed.pt", "uls", "full", "kill", run_dir=tmp_path / "killed"),
                    must_succeed=False)
    assert killed.returncode != 0
    folder = tmp_path / "killed" / "checkpoint-2"
    assert {"dp_ledger.json", "dp_resume.json", "trainer_state.json", "pytorch_model_fsdp_0", "optimizer_0"} <= {
        path.name for path in folder.iterdir()}
    assert (folder / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert len(list((folder / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2  # one file of shards per rank
    assert read_checkpoint(str(folder)).accountant.steps == 2
    shutil.copytree(tmp_path / "killed", tmp_path / "killed-on-one")
    # A one-rank checkpoint (the run cut after step 2) resumed on two ranks, in the same launch.
    cut = shutil.copytree(one_rank_runs["cut"], tmp_path / "cut")
    resumed, on_two = launch(2, run(tmp_path / "resumed.pt", "uls", "full", "resume", run_dir=tmp_path / "killed"),
                             run(tmp_path / "on_two.pt", "uls", "full", "resume", run_dir=cut))
    assert resumed["steps"] == 4 and resumed["epsilon"] == straight["epsilon"]
    assert_same_weights(straight, resumed, rtol=0, atol=0)  # the same sample and noise: bit for bit
    (on_one,) = launch(1, run(tmp_path / "on_one.pt", "uls", "full", "resume", run_dir=tmp_path / "killed-on-one"))
    assert (on_one["world_size"], on_one["epsilon"]) == (1, straight["epsilon"])
    assert_same_weights(straight, on_one)
    assert (on_two["world_size"], on_two["epsilon"]) == (2, straight["epsilon"])
    assert_same_weights(straight, on_two)


@pytest.mark.slow
def test_a_just_in_time_save_on_sigterm_resumes_exactly_on_one_rank(tmp_path, two_rank_runs):
    """Each rank gets its own SIGTERM at step 2; they agree on one step to save (transformers' 3 s wait), stop,
    and the run resumed on one rank ends where the uninterrupted one does."""
    steps = 30
    launch(2, run(tmp_path / "jit.pt", "uls", "full", "jit", run_dir=tmp_path / "jit", steps=steps))
    (saved,) = [path for path in (tmp_path / "jit").iterdir() if path.name.startswith("checkpoint-")]
    assert 2 < read_checkpoint(str(saved)).accountant.steps < steps
    assert not (saved / "checkpoint-is-incomplete.txt").exists()
    straight = two_rank_runs["uls", "full", steps]
    (resumed,) = launch(1, run(tmp_path / "resumed.pt", "uls", "full", "resume", run_dir=tmp_path / "jit",
                               steps=steps))
    assert resumed["steps"] == steps and resumed["epsilon"] == straight["epsilon"]
    assert_same_weights(straight, resumed)


@pytest.mark.slow
def test_a_stalled_rank_stops_the_others_within_ddp_timeout(tmp_path):
    """Rank 1 hangs after step 3 (`ddp_timeout=10`): rank 0 fails in its next collective within seconds, says so
    in one line and names the checkpoint to resume from, which reads."""
    start = time.perf_counter()
    result = launch(2, run(tmp_path / "stall.pt", "uls", "full", "stall", run_dir=tmp_path / "stall", steps=8),
                    must_succeed=False)
    assert result.returncode != 0 and time.perf_counter() - start < 120
    notes = [line for line in result.stderr.splitlines() if "stopped training on the error below" in line]
    assert notes and "ddp_timeout=10 s" in notes[0]
    assert f"go on from {tmp_path / 'stall' / 'checkpoint-2'}, the newest complete checkpoint" in notes[0]
    read_checkpoint(str(tmp_path / "stall" / "checkpoint-2"))


@pytest.mark.slow
def test_bf16_checkpoints_and_jit_saves_build_under_fsdp2(tmp_path):
    """A real DPTrainer on one FSDP2 rank builds sharded with each; a missing checkpoint is refused in one line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parent.parent)]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = tmp_path / "building.pt"
    result = subprocess.run([sys.executable, str(HERE / "fsdp_train.py"), str(out), "building"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    outcome = torch.load(out)
    assert set(outcome) == {"save_strategy", "jit", "bf16", "none"}
    for message in outcome.values():
        assert message.startswith("built, fsdp True | resume_from_checkpoint=") and "does not exist" in message
        assert "\n" not in message


@pytest.mark.slow
def test_two_machines_on_one_host_match_one_rank(tmp_path, one_rank_runs):
    """recipes/configs/fsdp_multi_node.yaml as users run it: one `accelerate launch` per machine (machine_rank 0 and
    1, one process each, 127.0.0.1), in bf16; the result equals one FSDP2 rank under the same policy."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parent.parent)]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "FSDP_TRAIN_RUN_DIR": str(tmp_path / "run")}
    port, out = str(free_port()), tmp_path / "machines.pt"
    machines = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG.with_name(
            "fsdp_multi_node.yaml")), "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
         "--main_process_ip", "127.0.0.1", "--main_process_port", port, str(HERE / "fsdp_train.py"), str(out), "uls",
         "bf16-full"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for machine in machines:
        _, stderr = machine.communicate(timeout=600)
        assert machine.returncode == 0, stderr[-5000:]
    two_machines = torch.load(out)
    assert (two_machines["world_size"], two_machines["fsdp"], two_machines["param_dtype"]) == (2, True,
                                                                                                "torch.bfloat16")
    one_rank = one_rank_runs["uls", "bf16-full", 4]
    assert two_machines["epsilon"] == one_rank["epsilon"]
    assert_same_weights(one_rank, two_machines)
