"""FSDP2 (`torch.distributed.fsdp.fully_shard`, through accelerate): what DP needs from sharded parameters.

Ghost clipping needs nothing from the weights: each rank computes its own units' norms and clipped sums from the
activations and output gradients of whole (all-gathered) layers, so the norms are exact. A clipped sum has the
shape of the whole weight; [`reduce_scatter_rows`] reduce-scatters it at once (summed over ranks, in float32) and
this rank keeps its rows of it (in the sharded `.grad`, or in a float32 buffer for a bf16 parameter), so no rank
ever holds the whole model's gradient. The noise is then added to each shard alone ([`local_elements`] says which
elements of the whole tensor a rank holds).

Every collective must run the same number of times on every rank: the passes of a step are padded to the same
count on all ranks ([`~hf_dp.batching.LogicalBatches`]), and every parameter is reduce-scattered in each pass.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.distributed.tensor import DTensor, Shard

FSDP2_CONFIG = "recipes/configs/fsdp.yaml"
# torch 2.13 deprecates reduce_scatter_tensor for reduce_scatter_single (the same call), which older torch lacks
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_sharded(tensor) -> bool:
    """Whether `tensor` is a DTensor (a parameter or gradient sharded by FSDP2)."""
    return isinstance(tensor, DTensor)


def is_quantized(model) -> bool:
    """Whether bitsandbytes holds some of `model`'s weights (`Params4bit`, `Int8Params`: packed, with their own
    quantization state), as `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))` loads them."""
    if model is None:
        return False
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        return True
    return any(type(param).__module__.startswith("bitsandbytes") for param in model.parameters())


def check_supported(trainer) -> None:
    """Refuse, with one line each, the sharded setups DP training cannot run exactly or that are not tested:
    DeepSpeed, FSDP1, size-based wrapping, FSDP's own activation checkpointing, offloading, loading the weights
    on the main process only, and a quantized (QLoRA) base."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError(f"DeepSpeed: its engine owns the backward pass and the gradient reduction, which DP training "
                         f"replaces; shard with FSDP2 instead (accelerate launch --config_file {FSDP2_CONFIG}).")
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if not getattr(trainer, "is_fsdp_enabled", False) or plugin is None:
        return
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(f"FSDP version {plugin.fsdp_version}: DP training supports FSDP2 only (fully_shard, DTensor "
                         f"parameters); set fsdp_version: 2 in the accelerate config ({FSDP2_CONFIG}).")
    policy = getattr(plugin, "auto_wrap_policy", None)
    if getattr(policy, "func", policy) is size_based_auto_wrap_policy:
        raise ValueError("fsdp_auto_wrap_policy: SIZE_BASED_WRAP picks modules by parameter count, containers such as "
                         "a ModuleList of layers among them, which FSDP2's fully_shard cannot shard (they have no "
                         "forward); use TRANSFORMER_BASED_WRAP (one unit per decoder layer, as in "
                         f"{FSDP2_CONFIG}).")
    if getattr(plugin, "activation_checkpointing", False):
        raise ValueError("fsdp_activation_checkpointing: its checkpoint wrappers recompute layers outside the clipping "
                         "engine's view; set it to false and use gradient_checkpointing=True (transformers' "
                         "non-reentrant checkpointing, which clips exactly).")
    if isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy):
        raise ValueError("fsdp_offload_params: offloaded gradient shards live on the host, where the clipped sums "
                         "and the noise are not added; set fsdp_offload_params: false.")
    if getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ValueError("fsdp_cpu_ram_efficient_loading: the other ranks hold empty weights until sharding, and DP "
                         "training checks the model (batch independence, clipping) before that; set it to false.")
    if is_quantized(getattr(trainer, "model", None)):
        raise ValueError("a bitsandbytes-quantized (4-bit or 8-bit) base under FSDP2: fully_shard would split its "
                         "packed weights and their quantization state, which DP training does not test; train QLoRA "
                         "on one process, or shard an unquantized (bf16) base.")


def reshard(model) -> None:
    """Free the whole parameters a forward pass outside training left gathered (FSDP2 keeps the root's after its
    forward), so the parameters seen by name are the shards again."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def check_sharded(params) -> None:
    """Every trainable parameter must be sharded along its first dimension on a 1-D mesh (FSDP2's default)."""
    for param in params:
        if not is_sharded(param):
            raise ValueError(f"a trainable parameter of shape {tuple(param.shape)} is not sharded by FSDP2: DP "
                             "training needs every trainable parameter in a fully_shard unit (no ignored_modules).")
        if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),) or param.dim() == 0:
            raise ValueError(f"a parameter sharded as {tuple(param.placements)} on a {param.device_mesh.ndim}-D mesh: "
                             "DP training supports FSDP2's Shard(0) on a 1-D mesh only (no HSDP, no tensor "
                             "parallelism).")


def reduce_scatter_rows(param: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of `full` (this rank's clipped sum, the shape of the whole parameter) summed over the ranks:
    one reduce-scatter in `full`'s dtype (float32 for the clipped sums), the rows padded as FSDP2 pads its shards."""
    group = param.device_mesh.get_group()
    world = dist.get_world_size(group)
    rows = full.shape[0]
    per_rank = math.ceil(rows / world)
    if per_rank * world != rows:
        full = torch.cat([full, full.new_zeros((per_rank * world - rows, *full.shape[1:]))])
    out = full.new_empty((per_rank, *full.shape[1:]))
    _reduce_scatter(out, full.contiguous(), group=group)
    return out[: param.to_local().shape[0]]


def add_to_shard(param: DTensor, full: torch.Tensor) -> None:
    """Sum `full` over the ranks ([`reduce_scatter_rows`]) and add this rank's rows of the result to `param.grad`."""
    out = reduce_scatter_rows(param, full).to(param.dtype)
    if param.grad is None:
        param.grad = DTensor.from_local(out.contiguous(), param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
    else:
        param.grad.to_local().add_(out)


def local_elements(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """`(flat view of the elements this rank holds, index of the first in the whole tensor, elements of the whole
    tensor)`: the whole tensor for a plain one; for a Shard(0) DTensor, its rows `[r·⌈n/W⌉, ...)`."""
    if not is_sharded(tensor):
        return tensor.view(-1), 0, tensor.numel()
    local = tensor.to_local()
    rows = tensor.shape[0]
    first_row = min(tensor.device_mesh.get_local_rank() * math.ceil(rows / tensor.device_mesh.size()), rows)
    return local.view(-1), first_row * (tensor.numel() // max(1, rows)), tensor.numel()
