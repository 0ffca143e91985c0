"""The one host copy of a check: batched L2 norms of many tensors, read back together."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from gradtap import _tensorops as ops

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
        parts.append(_norm_vector([tensors[i] for i in idx]))
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

    For float32 and float64, one fused pass a list, without one output per tensor: the check
    torch's GradScaler runs (``_amp_foreach_non_finite_check_and_unscale_``) with an inverse
    scale of exactly 1, for which it writes every value back as it was, bit for bit. It writes
    through ``.data`` aliases, so the tensors' version counters, which autograd checks, do not
    move. Other lists, and those the kernel refuses (an inference tensor, a moved tensor),
    have their foreach norms summed instead: for float16 and bfloat16 the kernel goes through
    float32 and back, which can change the sign or payload bits of a NaN.
    """
    flags = []
    for group in groups:
        if not group:
            continue
        head = group[0]
        if head.dtype in (torch.float32, torch.float64) and all(
                t.dtype == head.dtype for t in group):  # a part of the model cast since
            found = torch.zeros((), dtype=torch.float32, device=head.device)
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(
                    [t.data for t in group], found,
                    torch.ones((), dtype=torch.float32, device=head.device))
                flags.append(found)
                continue
            except (RuntimeError, NotImplementedError):
                pass
        flags.append(_flag_from_norms(group, head.device))
    return flags


def _flag_from_norms(group: Sequence[Tensor], device: torch.device) -> Tensor:
    """``nonfinite_flags``' fallback: the list's norms summed, by device and dtype."""
    total = torch.stack([_norm_vector([group[i] for i in idx]).sum().to(device)
                         for idx in ops.group_by_device_dtype(group).values()]).sum()
    return torch.isfinite(total).logical_not().to(torch.float32)


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
