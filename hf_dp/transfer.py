"""Host data to the device without stalling the host.

What the DP step knows about a sample (units, packed rows, loss weights, the collated features) is built on the
host; on an accelerator it is copied from pinned memory with `non_blocking=True`, so the host keeps queueing
kernels instead of waiting for the device to drain (torch's pinned allocator keeps the buffer until the copy is
done). On the CPU nothing is copied.
"""
from __future__ import annotations

import torch


def to_device(data, device):
    """A host tensor, or a dict of values (tensors among them), on `device`."""
    device = torch.device(device)
    if isinstance(data, dict):
        return {key: to_device(value, device) if torch.is_tensor(value) else value for key, value in data.items()}
    if device.type == "cpu":
        return data.to(device)
    return data.pin_memory().to(device, non_blocking=True)
