"""Which examples form which unit, and the order of units: the one owner of that mapping.

A *unit* is what differential privacy protects (a user, or a single example). Its gradient is the sum
of its examples' gradients, so every norm and clipped sum is taken per unit. [`UnitIndex`] fixes, once
per micro-batch and on the host, which unit each example belongs to and the order of units in the norms
that [`~hf_dp.clipping.GhostClipper.backward`] returns (sorted unique unit id). Building it on the host
is what keeps a clipping step free of device-to-host reads.

Example:

```python
>>> from hf_dp.clipping.units import UnitIndex
>>> units = UnitIndex([7, 3, 7], 3)
>>> units.num_units, units.inverse.tolist()  # unit 3 comes first
(2, [1, 0, 1])

```
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ..transfer import to_device


class UnitIndex:
    """Which examples form which unit, known on the host before the forward pass.

    Args:
        unit_ids (`Sequence[int]` or `torch.Tensor`, *optional*): `(B,)` integer ids; examples sharing an id
            form one unit. `None`: every example is its own unit. Read on the host: a CPU tensor or a list costs
            no device sync; a tensor on an accelerator is copied back once.
        batch_size (`int`): B.

    Units are ordered by sorted unique id; `inverse[i]` is example i's unit. Everything here is host data
    (numpy); the few index tensors the kernels need are built once per micro-batch and copied to the device
    without blocking ([`UnitIndex.on`]), so no kernel of a layer waits for the host.

    Two layouts need no index at all: one example per unit, and units of equal size `k` whose examples are
    consecutive (what the trainer builds): a `(B, N, ...)` factor is then `(U, k·N, ...)` as a view
    ([`UnitIndex.grouped`]). Other groupings go through *pairs* of examples of the same unit, so uneven units
    cost Σ_u n_u² example pairs, never a padded U × max n_u layout.
    """

    def __init__(self, unit_ids: Optional[Union[Tensor, Sequence[int]]], batch_size: int):
        self.batch_size = batch_size
        if unit_ids is None:
            inverse = np.arange(batch_size)
        else:
            ids = unit_ids.detach().cpu().numpy() if isinstance(unit_ids, Tensor) else np.asarray(unit_ids)
            ids = ids.reshape(-1)
            if ids.size != batch_size:
                raise ValueError(f"unit_ids has {ids.size} entries for a batch of {batch_size} examples")
            if ids.size and not np.issubdtype(ids.dtype, np.integer):
                raise TypeError("unit_ids must be an integer tensor")
            inverse = np.unique(ids, return_inverse=True)[1].reshape(-1)
        self.inverse = inverse.astype(np.int64)  # (B,) unit of each example
        self.counts = np.bincount(self.inverse, minlength=0) if batch_size else np.zeros(0, np.int64)  # (U,)
        self.num_units = len(self.counts)
        self.identity = self.num_units == batch_size and bool((self.inverse == np.arange(batch_size)).all())
        self.consecutive = bool((np.diff(self.inverse) >= 0).all())  # each unit's examples side by side, in order
        equal = self.num_units > 0 and bool((self.counts == self.counts[0]).all())
        self.group_size = int(self.counts[0]) if self.consecutive and equal else None  # k for the grouped view
        self._device_tensors: Dict[Tuple[str, torch.device], Tensor] = {}

    @classmethod
    def from_counts(cls, counts: Sequence[int]) -> "UnitIndex":
        """Units of `counts[u]` consecutive examples each (the trainer's micro-batches)."""
        return cls(np.repeat(np.arange(len(counts)), counts), int(sum(counts)))

    def on(self, name: str, device: torch.device) -> Tensor:
        """Index tensor `name` (`"inverse"`, `"order"`, `"sorted_inverse"`, `"pairs"`, `"ordered_pairs"`) on
        `device`, built once per micro-batch, copied without blocking the host."""
        key = (name, torch.device(device))
        if key not in self._device_tensors:
            order = np.argsort(self.inverse, kind="stable")
            if name == "inverse":
                array = self.inverse
            elif name == "order":  # examples grouped by unit
                array = order
            elif name == "sorted_inverse":  # the unit of each example in that order
                array = self.inverse[order]
            else:  # (3, P): first example, second example, their unit
                same_unit = self.inverse[:, None] == self.inverse[None, :]
                first, second = np.nonzero(same_unit if name == "ordered_pairs" else np.triu(same_unit))
                array = np.stack([first, second, self.inverse[first]])
            self._device_tensors[key] = to_device(torch.from_numpy(np.ascontiguousarray(array)), key[1])
        return self._device_tensors[key]

    def grouped(self, per_example: Tensor) -> Optional[Tensor]:
        """`(B, N, ...)` -> `(U, k·N, ...)`: each unit's tokens together, for one example per unit or equal
        consecutive units; `None` otherwise."""
        if self.identity:
            return per_example
        if self.group_size is None:
            return None
        shape = per_example.shape
        return per_example.reshape((self.num_units, self.group_size * shape[1]) + tuple(shape[2:]))

    def sum_examples(self, per_example: Tensor) -> Tensor:
        """`(B, *shape)` -> `(U, *shape)`: sum over each unit's examples."""
        if self.identity:
            return per_example
        if self.group_size is not None:
            return per_example.reshape((self.num_units, self.group_size) + tuple(per_example.shape[1:])).sum(1)
        out = per_example.new_zeros((self.num_units,) + tuple(per_example.shape[1:]))
        return out.index_add_(0, self.on("inverse", per_example.device), per_example)

    def example_weights(self, unit_weights: Tensor) -> Tensor:
        """`(U,)` -> `(B,)`: each example gets its unit's weight."""
        if self.identity:
            return unit_weights
        if self.group_size is not None:
            return unit_weights.repeat_interleave(self.group_size, output_size=self.batch_size)
        return unit_weights[self.on("inverse", unit_weights.device)]

    def example_pairs_per_unit(self) -> float:
        """Σ_u n_u (n_u + 1) / 2: the number of i <= j example pairs the ghost norm visits."""
        return float((self.counts * (self.counts + 1)).sum()) / 2
