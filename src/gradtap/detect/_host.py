"""The one host copy of a check: batched L2 norms of many tensors, read back together."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from gradtap import _tensorops as ops

__all__ = ["measurable", "norms", "to_host"]


def measurable(g: Tensor) -> bool:
    """A dense floating tensor with elements: what a norm can check."""
    return g.is_floating_point() and g.layout == torch.strided and g.numel() > 0


def norms(tensors: list[Tensor], host: bool = False, extra: Sequence[Tensor] = ()
          ) -> np.ndarray:
    """L2 norm of each tensor (float32 accumulation at least), then the value of each 0-d
    tensor in ``extra``, with one host copy per device (``host=True``: CPU tensors, read
    directly)."""
    parts, order = [], []
    for (_, dtype), idx in ops.group_by_device_dtype(tensors).items():
        group = [tensors[i] for i in idx]
        if dtype in (torch.float16, torch.bfloat16):
            values = torch._foreach_norm(group, 2, dtype=torch.float32)
        else:
            values = torch._foreach_norm(group)
        parts.append(torch.stack(values))
        order.append(idx)
    n = len(tensors)
    for _, idx in ops.group_by_device_dtype(list(extra)).items():
        parts.append(torch.stack([extra[i] for i in idx]))
        order.append([n + i for i in idx])
    out = np.empty(n + len(extra))
    arrays = [p.numpy() for p in parts] if host else to_host(parts)
    for idx, arr in zip(order, arrays):
        out[idx] = arr
    return out


def to_host(parts: list[Tensor]) -> list[np.ndarray]:
    """Copy 1-d tensors to the host as float64 arrays: one transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(parts):
        by_device.setdefault(t.device, []).append(i)
    out: list[np.ndarray] = [np.empty(0)] * len(parts)
    for idx in by_device.values():
        flat = torch.cat([parts[i].reshape(-1).to(torch.float64) for i in idx])
        host = flat.cpu().numpy()
        offset = 0
        for i in idx:
            n = parts[i].numel()
            out[i] = host[offset:offset + n]
            offset += n
    return out
