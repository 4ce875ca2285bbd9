"""Packed rows: several examples concatenated in one row of the batch.

With packing (transformers' `DataCollatorWithFlattening`, or rows built by hand) a row holds
several examples one after another, `position_ids` restarting at 0 at each, and no 2-D
attention mask; transformers then masks attention block by block, so no example sees
another. Every clipping rule is a sum over tokens, so an example's gradient is that of its
own tokens: [`PackedRows`] regroups each layer's `(rows, T, ...)` activations and output
gradients into `(examples, L, ...)` (L: the longest example, zero rows after the shorter
ones, which contribute nothing) before the rules see them.

Example:

```python
>>> import torch
>>> from hf_dp.clipping.packing import examples_from_position_ids
>>> examples_from_position_ids(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]))
tensor([[0, 0, 0, 1, 1],
        [2, 2, 3, 3, 3]])

```
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..transfer import to_device


def examples_from_position_ids(position_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
    """`(B, T)` index of the example each token belongs to: a new example wherever the position
    does not follow the previous one (transformers' rule for packed sequences), numbered row by
    row from 0; `-1` where `attention_mask` is 0.

    Args:
        position_ids (`torch.LongTensor`): `(B, T)` positions restarting at each example.
        attention_mask (`torch.Tensor`, *optional*): `(B, T)`, 0 for tokens of no example.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must have shape (batch_size, seq_len), got {tuple(position_ids.shape)}")
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    within_row = (step != 1).cumsum(-1)  # (B, T) example index inside its row
    row_offsets = torch.cumsum(within_row[:, -1] + 1, 0) - (within_row[:, -1] + 1)  # (B,)
    example_ids = within_row + row_offsets[:, None]
    if attention_mask is not None:
        example_ids = example_ids.masked_fill(attention_mask == 0, -1)
        kept = example_ids[example_ids >= 0]
        if kept.numel():  # renumber consecutively once masked-only examples are gone
            _, renumbered = torch.unique(kept, sorted=True, return_inverse=True)
            example_ids = example_ids.masked_scatter(example_ids >= 0, renumbered)
    return example_ids


class PackedRows:
    """Which tokens of which rows form each example, worked out on the host.

    Args:
        example_ids (`torch.LongTensor`): `(B, T)`: the index in the per-example losses of the
            example each token belongs to, `-1` for tokens of none (padding). Read on the host: a CPU
            tensor costs no device sync (a tensor on an accelerator is copied back once).
        num_examples (`int`): the number of examples S (the length of the losses).
    """

    def __init__(self, example_ids: Tensor, num_examples: int):
        if example_ids.dim() != 2:
            raise ValueError(f"example_ids must have shape (rows, seq_len), got {tuple(example_ids.shape)}")
        ids = example_ids.detach().cpu()
        flat = ids.reshape(-1).numpy()  # host work only: numpy, never a device read
        if flat.size and (flat.max() >= num_examples or flat.min() < -1):
            raise ValueError(f"example_ids must lie in [-1, {num_examples}) for {num_examples} per-example losses")
        self.example_ids = ids
        self.rows, self.tokens = ids.shape
        self.num_examples = num_examples
        positions = np.flatnonzero(flat >= 0)  # token positions in the flattened rows
        examples = flat[positions]
        order = np.argsort(examples, kind="stable")
        positions, examples = positions[order], examples[order]
        counts = np.bincount(examples, minlength=num_examples)
        rank = np.arange(len(examples)) - (np.cumsum(counts) - counts)[examples]
        longest = int(counts.max()) if num_examples and len(examples) else 1
        padding = self.rows * self.tokens  # index of an all-zero row appended to the flattened tensor
        index = np.full((num_examples, longest), padding, dtype=np.int64)  # (S, L)
        index[examples, rank] = positions
        self.index = torch.from_numpy(index)
        self._on_device: dict = {}

    def _host_to(self, name: str, device: torch.device) -> Tensor:
        """`self.<name>` on `device`, copied once per micro-batch without blocking the host."""
        key = (name, torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = to_device(getattr(self, name), key[1])
        return self._on_device[key]

    def regroup(self, tensor: Tensor) -> Tensor:
        """`(B, T, ...)` -> `(S, L, ...)`: each example's tokens in order, zeros after its end."""
        flat = tensor.reshape((self.rows * self.tokens,) + tuple(tensor.shape[2:]))
        flat = torch.cat([flat, flat.new_zeros((1,) + tuple(flat.shape[1:]))])
        return flat[self._host_to("index", tensor.device)]

    def token_weights(self, example_weights: Tensor) -> Tensor:
        """`(S,)` -> `(B, T)`: each token gets its example's weight, 0 for tokens of none."""
        padded = torch.cat([example_weights, example_weights.new_zeros(1)])
        return padded[self._host_to("example_ids", example_weights.device)]  # -1 picks the appended 0
