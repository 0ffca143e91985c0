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


#: A parameter gradient of at least this many elements is summed by the screen as soon as it is
#: accumulated (while in cache) rather than in the foreach norm of the check.
BIG = 1 << 18


def norms(tensors: list[Tensor], host: bool = False, extra: Sequence[Tensor] = (),
          grouped: Sequence[Sequence[Tensor]] = ()) -> np.ndarray:
    """L2 norm of each tensor (float32 accumulation at least), then of each tensor of each
    list in ``grouped`` (lists the caller already knows to share one device and dtype), then
    the value of each 0-d tensor in ``extra``, with one host copy per device (``host=True``:
    CPU tensors, read directly)."""
    # (device, dtype) -> tensors and their positions in the result: one foreach norm each.
    by_key: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[int]]] = {}
    for key, idx in ops.group_by_device_dtype(tensors).items():
        by_key[key] = ([tensors[i] for i in idx], list(idx))
    n = len(tensors)
    for group in grouped:
        if not group:
            continue
        head = group[0]
        same = by_key.setdefault((head.device, head.dtype), ([], []))
        same[0].extend(group)
        same[1].extend(range(n, n + len(group)))
        n += len(group)
    parts, order = [], []
    for ts, idx in by_key.values():
        try:
            parts.append(_norm_vector(ts))
            order.append(idx)
        except RuntimeError:  # a grouped list moved since it was grouped: regroup
            for sub in ops.group_by_device_dtype(ts).values():
                parts.append(_norm_vector([ts[i] for i in sub]))
                order.append([idx[i] for i in sub])
    for _, idx in ops.group_by_device_dtype(list(extra)).items():
        parts.append(torch.stack([extra[i] for i in idx]))
        order.append([n + i for i in idx])
    out = np.empty(n + len(extra))
    arrays = [p.numpy() for p in parts] if host else to_host(parts)
    for idx, arr in zip(order, arrays):
        out[idx] = arr
    return out


def _norm_vector(group: list[Tensor]) -> Tensor:
    """L2 norms [len(group)] of tensors of one device and dtype."""
    if group[0].dtype in (torch.float16, torch.bfloat16):
        return torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32))
    return torch.stack(torch._foreach_norm(group))


def to_host(parts: list[Tensor]) -> list[np.ndarray]:
    """Copy 1-d tensors to the host as numpy arrays: one transfer per device (float64), or
    for CPU tensors a view of their own memory (float32 or float64 as they are; bfloat16,
    which numpy lacks, as float64)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(parts):
        by_device.setdefault(t.device, []).append(i)
    out: list[np.ndarray] = [np.empty(0)] * len(parts)
    for device, idx in by_device.items():
        if device.type == "cpu":
            for i in idx:
                t = parts[i].reshape(-1)
                out[i] = (t if t.dtype != torch.bfloat16 else t.to(torch.float64)).numpy()
            continue
        flat = torch.cat([parts[i].reshape(-1).to(torch.float64) for i in idx])
        host = flat.cpu().numpy()
        offset = 0
        for i in idx:
            n = parts[i].numel()
            out[i] = host[offset:offset + n]
            offset += n
    return out
