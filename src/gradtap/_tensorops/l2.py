"""L2 norms and sums of squares of many tensors, batched per device and dtype, no host sync.

Two accuracies. ``accurate=False`` is one ``torch._foreach_norm`` per group, accumulating in
float32 at least: torch's CPU kernel sums each lane in one float32 pass (relative error 4e-5
at 2.4M elements, 1e-3 at 16M), which is plenty to compare a norm with a threshold.
``accurate=True`` views CPU tensors longer than a block as rows of ``BLOCK`` elements, so every
partial sum stays short, and adds the pieces' squares in float64 (~1e-8); other devices
reduce in trees and are accurate as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor

from gradtap._tensorops.groups import group_by_device_dtype

__all__ = ["BLOCK", "group_norms", "group_sumsq", "norms"]

#: Elements per row of the blocked CPU reduction of ``accurate=True``.
BLOCK = 1024


def group_norms(group: Sequence[Tensor], *, accurate: bool = False) -> Tensor:
    """L2 norm of each tensor of a list sharing one device and dtype: a tensor [len(group)].

    ``accurate=False``: one ``torch._foreach_norm``, in the tensors' dtype (float16 and
    bfloat16 accumulate and return float32). ``accurate=True``: float64, from
    :func:`group_sumsq`.

    Example:
        >>> import torch
        >>> group_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0])]).tolist()
        [5.0, 1.0]
    """
    if accurate:
        return group_sumsq(group).sqrt()
    if len(group) == 1:  # one tensor (a per-tensor clip): no foreach list, no stack
        t = group[0]
        low = t.dtype in (torch.float16, torch.bfloat16)
        return torch.linalg.vector_norm(t, dtype=torch.float32 if low else None).reshape(1)
    if group[0].dtype in (torch.float16, torch.bfloat16):
        return torch.stack(torch._foreach_norm(list(group), 2, dtype=torch.float32))
    return torch.stack(torch._foreach_norm(list(group)))


def norms(tensors: Sequence[Tensor], *, accurate: bool = True) -> list[tuple[list[int], Tensor]]:
    """L2 norms of tensors on any devices and dtypes, grouped by ``(device, dtype)``.

    Returns one ``(indices, norms [len(indices)])`` per group, on the group's device (float64
    when ``accurate``, see :func:`group_norms`); ``HostCopy.add_rows`` puts them back in order.

    Example:
        >>> import torch
        >>> [(idx, n.tolist()) for idx, n in norms([torch.ones(4), torch.ones(9, dtype=torch.float64)])]
        [([0], [2.0]), ([1], [3.0])]
    """
    tensors = [t.detach() for t in tensors]
    return [(idx, group_norms([tensors[i] for i in idx], accurate=accurate))
            for idx in group_by_device_dtype(tensors).values()]


def group_sumsq(group: Sequence[Tensor], acc: torch.dtype | None = None) -> Tensor:
    """Accurate sums of squares, float64 [len(group)], of tensors sharing a device and dtype.

    ``acc`` is the accumulation dtype (default: the dtype promoted to float32 at least).

    Example:
        >>> import torch
        >>> group_sumsq([torch.full((4096,), 0.5), torch.tensor([3.0, 4.0])]).tolist()
        [1024.0, 25.0]
    """
    ts = list(group)
    f64 = torch.float64
    acc = acc or torch.promote_types(ts[0].dtype, torch.float32)
    kw = {"dtype": acc} if acc != ts[0].dtype else {}
    if ts[0].device.type != "cpu":  # tree reductions: accurate as they are
        return torch.stack(torch._foreach_norm(ts, 2, **kw)).to(f64).square()
    # Tensors longer than a block are viewed as rows of BLOCK elements (one norm kernel per
    # tensor); short tensors and the tails go through one foreach norm. Every piece's square
    # is then added to its tensor's total in float64 (index_add_ over a cached index).
    rows: list[Tensor] = []
    short: list[Tensor] = []
    for t in ts:
        n = t.numel()
        if n <= BLOCK:
            short.append(t)
            continue
        flat = t.reshape(-1)
        q = n // BLOCK
        rows.append(torch.linalg.vector_norm(flat[: q * BLOCK].view(q, BLOCK), dim=1, **kw))
        if n % BLOCK:
            short.append(flat[q * BLOCK:])
    if short:
        rows.append(torch.stack(torch._foreach_norm(short, 2, **kw)))
    pieces = torch.cat(rows) if len(rows) > 1 else rows[0]
    index = _piece_index(tuple(t.numel() for t in ts), ts[0].device)
    return torch.zeros(len(ts), dtype=f64).index_add_(0, index, pieces.to(f64).square())


@lru_cache(maxsize=256)
def _piece_index(numels: tuple[int, ...], device: torch.device) -> Tensor:
    """Tensor index of each piece ``group_sumsq`` produces (rows first, then short pieces)."""
    rows: list[int] = []
    short: list[int] = []
    for j, n in enumerate(numels):
        if n <= BLOCK:
            short.append(j)
        else:
            rows += [j] * (n // BLOCK)
            if n % BLOCK:
                short.append(j)
    return torch.tensor(rows + short, dtype=torch.int64, device=device)
