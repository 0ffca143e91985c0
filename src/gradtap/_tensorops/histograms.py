"""Histogram bin edges and per-tensor bin counts of finite elements, batched, no host sync.

Counts are exact for tensors of at most :data:`HIST_SAMPLE` elements. A larger tensor is
counted from :data:`HIST_SAMPLE` of its elements at fixed positions (:func:`sample_positions`)
and its counts scaled by ``numel / HIST_SAMPLE`` (rounded): binning costs several times a plain pass over
the elements (a sort or a binary search per element), more than the training step that made
an activation gradient, so a tensor's share of it is capped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from gradtap._types import is_int

__all__ = ["HIST_SAMPLE", "hist_edges", "histogram_counts", "sample_positions"]

#: A tensor of more than this many elements gets the histogram of this many of its elements,
#: scaled to its size (:func:`histogram_counts`).
HIST_SAMPLE = 1 << 13
_PHI = (math.sqrt(5.0) - 1.0) / 2.0


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


def histogram_counts(ts: Sequence[Tensor], edges: Tensor, batched: bool = True,
                     sample: int | None = HIST_SAMPLE) -> Tensor:
    """Counts of finite elements per bin, float64 [len(ts), B], of tensors sharing a device
    and dtype. Bin ``i`` is ``[edges[i], edges[i+1])``; values outside the edges fall in the end
    bins, NaN and Inf in none.

    A tensor of at most ``sample`` elements is counted exactly. A larger one is counted from
    ``sample`` of its elements, at the fixed positions :func:`sample_positions` gives (the same
    every call), and those counts are scaled by ``numel / sample`` and rounded to whole
    numbers: an estimate of its histogram whose counts still add up to about its number of
    finite elements.
    ``sample=None`` counts every element of every tensor.

    On the CPU the counts come from sorting each tensor's elements (numpy) and locating the
    edges among them; on other devices from one ``bucketize`` and one ``index_add_`` over all
    the tensors (no host sync). ``batched=False`` is the plain per-tensor loop both are tested
    against.

    Example:
        >>> import torch
        >>> histogram_counts([torch.tensor([-3.0, 0.2, 0.7, float("nan")])], hist_edges(2, "linear")).tolist()
        [[1.0, 2.0]]
    """
    pieces, scale = [], []
    for t in ts:
        n = t.numel()
        if sample is None or n <= sample:
            pieces.append(t.reshape(-1))
            scale.append(1.0)
        else:
            pieces.append(torch.take(t, sample_positions(n, sample, t.device)))
            scale.append(n / sample)
    acc = torch.promote_types(ts[0].dtype, torch.float32)
    if not batched:
        counts = _loop_counts(pieces, edges, acc)
    elif ts[0].device.type == "cpu":
        counts = _sorted_counts(pieces, edges, acc)
    else:
        counts = _device_counts(pieces, edges, acc)
    sampled = [i for i, s in enumerate(scale) if s != 1.0]
    if sampled:  # python scalars: nothing crosses to the device
        rows = [counts[i] for i in sampled]
        torch._foreach_mul_(rows, [scale[i] for i in sampled])
        torch._foreach_round_(rows)  # counts stay whole numbers
    return counts


@lru_cache(maxsize=64)  # at most 64 x 64 KiB of positions kept (HIST_SAMPLE int64 each)
def sample_positions(numel: int, size: int, device: torch.device) -> Tensor:
    """The ``size`` flat positions a histogram samples in a tensor of ``numel`` elements:
    ``floor(frac(j * phi) * numel)`` for ``j = 0 .. size - 1``, ``phi = (sqrt(5) - 1) / 2``
    (a low-discrepancy sequence: spread over the whole tensor, in step with no period of its
    layout), sorted; computed in float64, alike on every device.

    Example:
        >>> sample_positions(10, 4, torch.device("cpu")).tolist()
        [0, 2, 6, 8]
    """
    j = torch.arange(size, dtype=torch.float64, device=device)
    return j.mul_(_PHI).frac_().mul_(numel).floor_().to(torch.int64).sort().values


def _loop_counts(pieces: Sequence[Tensor], edges: Tensor, acc: torch.dtype) -> Tensor:
    bins = edges.numel() - 1
    inner = edges[1:-1].to(device=pieces[0].device, dtype=acc)
    rows = []
    for p in pieces:
        x = p.to(acc)
        x = x[torch.isfinite(x)]
        rows.append(torch.bincount(torch.bucketize(x, inner, right=True), minlength=bins))
    return torch.stack(rows).to(torch.float64)


def _sorted_counts(pieces: Sequence[Tensor], edges: Tensor, acc: torch.dtype) -> Tensor:
    """CPU: sort each piece and find the edges among its elements (numpy's sort is far
    faster than a binary search per element). ``#(x < -max)`` counts the -Inf elements and
    ``#(x < +Inf)`` all but the +Inf and NaN ones (NaN sorts last), so the differences of
    ``#(x < bound)`` over ``[-max, inner edges, +Inf]`` are the finite elements of each bin."""
    dtype = np.float64 if acc == torch.float64 else np.float32
    bounds = np.concatenate([[-np.finfo(dtype).max], edges[1:-1].numpy(), [np.inf]]).astype(dtype)
    out = np.empty((len(pieces), edges.numel() - 1))
    for i, p in enumerate(pieces):
        x = np.sort(p.detach().to(acc).numpy())
        out[i] = np.diff(np.searchsorted(x, bounds, side="left"))
    return torch.from_numpy(out)


def _device_counts(pieces: Sequence[Tensor], edges: Tensor, acc: torch.dtype) -> Tensor:
    """One ``bucketize`` and one ``index_add_`` over all pieces (no host sync)."""
    bins = edges.numel() - 1
    inner = edges[1:-1].to(device=pieces[0].device, dtype=acc)
    flat = torch.cat(list(pieces)).to(acc) if len(pieces) > 1 else pieces[0].to(acc)
    idx = torch.bucketize(flat, inner, right=True)
    idx.masked_fill_(~torch.isfinite(flat), bins)  # non-finite elements go to a dropped bin
    width = bins + 1
    if len(pieces) > 1:
        torch._foreach_add_(list(idx.split([p.numel() for p in pieces])),
                            [i * width for i in range(len(pieces))])
    counts = torch.zeros(len(pieces) * width, dtype=torch.int64, device=idx.device)
    # bincount reads max(idx) on the host; index_add_ never syncs
    counts.index_add_(0, idx, torch.ones((), dtype=torch.int64, device=idx.device).expand(idx.numel()))
    return counts.view(len(pieces), width)[:, :bins].to(torch.float64)
