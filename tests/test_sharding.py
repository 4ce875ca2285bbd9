"""`hf_dp/sharding.py`: the refusals of sharded setups DP cannot run exactly, and which elements a rank holds.

The sharded path itself (reduce-scatter into DTensor shards) runs with two gloo processes in
`tests/trainer/test_fsdp.py`; here a one-rank mesh checks the DTensor calls."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from transformers.trainer_utils import SaveStrategy

from hf_dp import sharding


def _trainer(mixed_precision="no", save_strategy=SaveStrategy.NO, enable_jit_checkpoint=False, **plugin):
    settings = dict(fsdp_version=2, auto_wrap_policy=transformer_auto_wrap_policy, activation_checkpointing=False,
                    cpu_offload=OffloadPolicy(),
                    cpu_ram_efficient_loading=False)
    settings.update(plugin)
    return SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=True,
                           args=SimpleNamespace(save_strategy=save_strategy,
                                                enable_jit_checkpoint=enable_jit_checkpoint),
                           accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(**settings)),
                                                       mixed_precision=mixed_precision))


@pytest.mark.parametrize("plugin, message", [
    ({"fsdp_version": 1}, "FSDP2 only"),
    ({"auto_wrap_policy": size_based_auto_wrap_policy}, "use TRANSFORMER_BASED_WRAP"),
    ({"auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=10)}, "SIZE_BASED_WRAP"),
    ({"activation_checkpointing": True}, "gradient_checkpointing=True"),
    ({"cpu_offload": CPUOffloadPolicy()}, "fsdp_offload_params: false"),
    ({"cpu_ram_efficient_loading": True}, "fsdp_cpu_ram_efficient_loading"),
])
def test_sharded_setups_that_would_not_clip_exactly_are_refused_in_one_line(plugin, message):
    sharding.check_supported(_trainer())  # FSDP2 as recipes/configs/fsdp.yaml sets it
    # bf16, sharded checkpoints and just-in-time saves train (tests/trainer/test_fsdp.py)
    sharding.check_supported(_trainer(mixed_precision="bf16", save_strategy=SaveStrategy.STEPS,
                                      enable_jit_checkpoint=True))
    with pytest.raises(ValueError, match=message) as error:
        sharding.check_supported(_trainer(**plugin))
    assert "\n" not in str(error.value)


def test_a_sharded_checkpoint_whose_shards_are_unfinished_is_incomplete(tmp_path):
    """torch.distributed.checkpoint writes `.metadata` after every rank's shards: without it, not resumable."""
    from hf_dp.checkpoint import read_checkpoint, unfinished_shards

    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"")
    (tmp_path / "optimizer_0" / ".metadata").write_bytes(b"")
    (tmp_path / "optimizer.pt").write_bytes(b"")  # a plain run's file: not a folder, not checked here
    assert unfinished_shards(str(tmp_path)) == ["pytorch_model_fsdp_0"]
    for name in ("dp_ledger.json", "dp_resume.json", "trainer_state.json"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(ValueError, match="pytorch_model_fsdp_0 has no .metadata") as error:
        read_checkpoint(str(tmp_path))
    assert "\n" not in str(error.value)


def test_deepspeed_is_refused_with_a_pointer_to_fsdp2():
    with pytest.raises(ValueError, match="recipes/configs/fsdp.yaml"):
        sharding.check_supported(SimpleNamespace(is_deepspeed_enabled=True))


@pytest.mark.parametrize("how", ["argument", "accelerate"])
def test_a_deepspeed_config_is_refused_as_dp_not_as_a_missing_package(tmp_path, monkeypatch, how):
    """Without DeepSpeed installed, Trainer would ask for it (which DP training then refuses): refused first."""
    from hf_dp import DPTrainingArguments

    kwargs = {"deepspeed": {"train_batch_size": 8}} if how == "argument" else {}
    if how == "accelerate":
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch sets for a DeepSpeed config
    with pytest.raises(ValueError, match="whether or not DeepSpeed is installed; shard with FSDP2") as error:
        DPTrainingArguments(str(tmp_path), report_to="none", use_cpu=True, **kwargs)
    assert "\n" not in str(error.value) and "pip" not in str(error.value)


def test_a_one_rank_shard_holds_the_whole_tensor_and_takes_the_whole_sum(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = torch.nn.Parameter(distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)]))
        sharding.check_sharded([param])
        with pytest.raises(ValueError, match="not sharded by FSDP2"):
            sharding.check_sharded([torch.nn.Parameter(torch.zeros(2))])
        full = torch.arange(15.0).reshape(5, 3)
        sharding.add_to_shard(param, full)
        sharding.add_to_shard(param, full)
        assert sharding.is_sharded(param.grad)
        flat, first, total = sharding.local_elements(param.grad)
        assert (first, total) == (0, 15) and torch.equal(flat, 2 * full.reshape(-1))
    finally:
        dist.destroy_process_group()
