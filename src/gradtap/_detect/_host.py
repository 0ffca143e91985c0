"""The one host copy of a check: batched L2 norms of many tensors, read back together."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from gradtap import _tensorops as ops
from gradtap.capture import compat

__all__ = ["measurable", "nonfinite_flags", "norms", "to_host"]


def measurable(g: Tensor) -> bool:
    """A dense floating tensor with elements: what a norm can check."""
    return g.is_floating_point() and g.layout == torch.strided and g.numel() > 0


#: A parameter gradient of at least this many elements is summed by the screen as soon as it is
#: accumulated (while in cache) rather than in the fused finiteness pass of the check.
BIG = 1 << 18


def norms(tensors: list[Tensor], host: bool = False, extra: Sequence[Tensor] = (),
          vectors: Sequence[Tensor] = ()) -> np.ndarray:
    """L2 norm of each tensor (float32 accumulation at least), then the value of each 0-d
    tensor in ``extra``, then the elements of each 1-d tensor in ``vectors``, with one host
    copy per device (``host=True``: CPU tensors, read directly)."""
    parts, order = [], []
    for idx in ops.group_by_device_dtype(tensors).values():
        parts.append(ops.group_norms([tensors[i] for i in idx]))
        order.append(idx)
    n = len(tensors)
    for _, idx in ops.group_by_device_dtype(list(extra)).items():
        parts.append(torch.stack([extra[i] for i in idx]))
        order.append([n + i for i in idx])
    at = n + len(extra)
    for v in vectors:
        parts.append(v)
        order.append(list(range(at, at + v.numel())))
        at += v.numel()
    out = np.empty(at)
    arrays = [p.numpy() for p in parts] if host else to_host(parts)
    for idx, arr in zip(order, arrays):
        out[idx] = arr
    return out


def nonfinite_flags(groups: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    """For each non-empty list of tensors sharing one device and dtype, a 0-d float32 tensor
    on that device: 1 if any element of the list is NaN or +-Inf, else 0. No host sync.

    For float32 and float64, one fused pass a list (``capture.compat.flag_nonfinite_``), without one
    output per tensor. Other lists, and those the kernel refuses (an inference tensor, a moved
    tensor), have their foreach norms summed instead: for float16 and bfloat16 the kernel goes
    through float32 and back, which can change the sign or payload bits of a NaN.
    """
    flags = []
    for group in groups:
        if not group:
            continue
        head = group[0]
        found = torch.zeros((), dtype=torch.float32, device=head.device)
        if compat.flag_nonfinite_(group, found):
            flags.append(found)
        else:
            flags.append(_flag_from_norms(group, head.device))
    return flags


def _flag_from_norms(group: Sequence[Tensor], device: torch.device) -> Tensor:
    """``nonfinite_flags``' fallback: the list's norms summed, by device and dtype."""
    total = torch.stack([ops.group_norms([group[i] for i in idx]).sum().to(device)
                         for idx in ops.group_by_device_dtype(group).values()]).sum()
    return torch.isfinite(total).logical_not().to(torch.float32)


def to_host(parts: list[Tensor]) -> list[np.ndarray]:
    """The check's one host copy (``gradtap._tensorops.to_host``), looked up here so the
    number of copies a check makes can be counted in tests."""
    for p in parts:
        if p.device.type != "cpu" or p.dtype == torch.bfloat16:
            return ops.to_host(parts)
    return [p.detach().numpy() for p in parts]  # on CPU, views (what ops.to_host gives too)
