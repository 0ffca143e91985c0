"""Grouping tensors by device and dtype, and reusable device work buffers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Scratch", "group_by_device_dtype"]


def group_by_device_dtype(tensors: Sequence[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Group tensor indices by ``(device, dtype)``, keeping the original order inside a group.

    Example:
        >>> import torch
        >>> group_by_device_dtype([torch.ones(2), torch.ones(1, dtype=torch.float64), torch.ones(3)])
        {(device(type='cpu'), torch.float32): [0, 2], (device(type='cpu'), torch.float64): [1]}
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


class Scratch:
    """Reusable work buffers, one per ``(device, dtype)``, grown on demand.

    Allocating a fresh centred copy every step costs page faults on CPU that dwarf the
    arithmetic; a persistent buffer does not. Not shared between threads of one device.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def get(self, n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """A 1-D buffer of at least ``n`` elements (contents undefined)."""
        buf = self._bufs.get((device, dtype))
        if buf is None or buf.numel() < n:
            buf = self._bufs[(device, dtype)] = torch.empty(n, device=device, dtype=dtype)
        return buf[:n]
