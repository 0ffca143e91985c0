"""Histogram bin edges and per-tensor bin counts of finite elements, batched, no host sync."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradtap._types import is_int

__all__ = ["hist_edges", "histogram_counts"]


def hist_edges(
    bins: int,
    scale: str = "symlog",
    range: tuple[float, float] | None = None,  # noqa: A002 (numpy's name for it)
    linthresh: float = 1e-8,
) -> Tensor:
    """Return ``bins + 1`` float64 bin edges, each exactly representable in float32.

    ``scale="linear"``: equal bins over ``range`` (default ``(-1, 1)``). ``scale="symlog"``:
    equal bins in ``t(x) = sign(x) * log10(1 + |x| / linthresh)`` over ``range`` (default
    ``(-10, 10)``), i.e. logarithmic in magnitude above ``linthresh`` and symmetric about 0.
    Edges are rounded to float32 so that float32 and float64 comparisons bin alike.

    Example:
        >>> hist_edges(4, "linear").tolist()
        [-1.0, -0.5, 0.0, 0.5, 1.0]
    """
    if not is_int(bins) or bins < 1:
        raise ValueError(f"hist_bins must be a positive int; got {bins!r}")
    if scale not in ("linear", "symlog"):
        raise ValueError(f"hist_scale must be 'linear' or 'symlog'; got {scale!r}")
    lo, hi = range if range is not None else ((-1.0, 1.0) if scale == "linear" else (-10.0, 10.0))
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"hist_range must be two finite numbers lo < hi; got {range!r}")
    if scale == "linear":
        edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    else:
        if not (math.isfinite(linthresh) and linthresh > 0):
            raise ValueError(f"hist_linthresh must be a positive number; got {linthresh!r}")

        def fwd(x: float) -> float:
            return math.copysign(math.log10(1.0 + abs(x) / linthresh), x)

        u = torch.linspace(fwd(lo), fwd(hi), bins + 1, dtype=torch.float64)
        edges = torch.sign(u) * linthresh * torch.expm1(u.abs() * math.log(10.0))
        edges[0], edges[-1] = lo, hi
    edges = edges.to(torch.float32).to(torch.float64)
    if not bool((edges[1:] > edges[:-1]).all()):
        raise ValueError(
            f"{bins} bins over {range!r} give edges that collide in float32; use fewer bins"
        )
    return edges


def histogram_counts(ts: Sequence[Tensor], edges: Tensor, batched: bool = True) -> Tensor:
    """Counts of finite elements per bin, float64 [len(ts), B], of tensors sharing a device
    and dtype. Bin ``i`` is ``[edges[i], edges[i+1])``; values outside the edges fall in the end
    bins, NaN and Inf in none. ``batched=False`` is the plain loop the fast path is tested
    against.

    Example:
        >>> import torch
        >>> histogram_counts([torch.tensor([-3.0, 0.2, 0.7, float("nan")])], hist_edges(2, "linear")).tolist()
        [[1.0, 2.0]]
    """
    bins = edges.numel() - 1
    acc = torch.promote_types(ts[0].dtype, torch.float32)
    inner = edges[1:-1].to(device=ts[0].device, dtype=acc)
    if not batched:
        rows = []
        for t in ts:
            x = t.reshape(-1).to(acc)
            x = x[torch.isfinite(x)]
            idx = torch.bucketize(x, inner, right=True)
            rows.append(torch.bincount(idx, minlength=bins))
        return torch.stack(rows).to(torch.float64)
    flat = torch.cat([t.reshape(-1) for t in ts]).to(acc)
    idx = torch.bucketize(flat, inner, right=True)
    idx.masked_fill_(~torch.isfinite(flat), bins)  # non-finite elements go to a dropped bin
    width = bins + 1
    if len(ts) > 1:
        torch._foreach_add_(list(idx.split([t.numel() for t in ts])),
                            [i * width for i in range(len(ts))])
    if idx.device.type == "cpu":
        counts = torch.bincount(idx, minlength=len(ts) * width)
    else:  # bincount reads max(idx) on the host; index_add_ never syncs
        counts = torch.zeros(len(ts) * width, dtype=torch.int64, device=idx.device)
        counts.index_add_(0, idx, torch.ones((), dtype=torch.int64, device=idx.device).expand(idx.numel()))
    return counts.view(len(ts), width)[:, :bins].to(torch.float64)
