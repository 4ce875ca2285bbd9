"""hf_dp.transfer: host data to the device, copied from pinned memory without blocking the host (on the CPU: as is)."""
from __future__ import annotations

from unittest import mock

import torch

from hf_dp.transfer import to_device


def test_a_dict_of_features_keeps_its_keys_and_its_non_tensor_values():
    features = {"input_ids": torch.arange(6).reshape(2, 3), "labels": torch.tensor([0, 1]), "use_cache": False,
                "name": "batch", "nothing": None}
    moved = to_device(features, "cpu")
    assert list(moved) == list(features)
    assert (moved["use_cache"], moved["name"], moved["nothing"]) == (False, "batch", None)
    for key in ("input_ids", "labels"):
        assert moved[key].device.type == "cpu" and torch.equal(moved[key], features[key])
    assert features["use_cache"] is False and torch.equal(features["labels"], torch.tensor([0, 1]))  # not mutated


def test_on_the_cpu_nothing_is_pinned():
    data = mock.MagicMock()
    to_device(data, "cpu")
    data.to.assert_called_once_with(torch.device("cpu"))
    data.pin_memory.assert_not_called()


def test_to_an_accelerator_the_copy_is_pinned_and_non_blocking():
    data = mock.MagicMock()
    result = to_device(data, "cuda:1")
    data.pin_memory.assert_called_once_with()
    data.pin_memory.return_value.to.assert_called_once_with(torch.device("cuda:1"), non_blocking=True)
    assert result is data.pin_memory.return_value.to.return_value
    data.to.assert_not_called()  # never a blocking copy from pageable memory

# A real host-to-GPU copy is exercised by benchmarks/device_check.py on a GPU machine (no skipped test here).
