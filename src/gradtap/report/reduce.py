"""Vectorised reductions of long series for the report's charts: min/max per pixel column,
column maxima of a heatmap row, and the EWMA band of a series. numpy only, no per-value
Python loop, so a 100,000-step series costs milliseconds.

Downsampling keeps each column's minimum, maximum and first non-finite value (in step
order), so a one-step spike, a one-step dip and a one-step NaN all stay visible however
long the run.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["band_envelope", "column_max", "envelope", "ewma_band"]


def _columns(x: np.ndarray, n: int, lo: float, hi: float) -> np.ndarray:
    """Column index in ``[0, n)`` of each (sorted) ``x`` over ``[lo, hi]``."""
    if hi <= lo:
        return np.zeros(len(x), dtype=np.int64)
    col = np.floor((x - lo) / (hi - lo) * n).astype(np.int64)
    return np.clip(col, 0, n - 1)


def _first_per_segment(mask: np.ndarray, seg: np.ndarray, nseg: int) -> np.ndarray:
    """Index of the first true ``mask`` element of each segment (``-1`` where none)."""
    pos = np.flatnonzero(mask)
    out = np.full(nseg, -1, dtype=np.int64)
    if len(pos):
        s = seg[pos]
        first = np.r_[True, s[1:] != s[:-1]]
        out[s[first]] = pos[first]
    return out


def envelope(x: np.ndarray, y: np.ndarray, n: int,
             x_range: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """At most ``3 n`` points of ``(x, y)`` (``x`` sorted): in each of ``n`` equal columns of
    ``x``, the points holding the column's finite minimum and maximum and its first
    non-finite value, in their original order. Series of at most ``n`` points come back as
    they are.

    Example:
        >>> x = np.arange(10_000.0); y = np.ones(10_000); y[4321] = 1e3
        >>> xs, ys = envelope(x, y, 100)
        >>> len(xs) <= 300, float(ys.max()), float(xs[ys.argmax()])
        (True, 1000.0, 4321.0)
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(x) <= n:
        return x, y
    lo, hi = x_range if x_range is not None else (float(x[0]), float(x[-1]))
    col = _columns(x, n, lo, hi)
    starts = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])
    nseg = len(starts)
    seg = np.repeat(np.arange(nseg), np.diff(np.r_[starts, len(y)]))
    fin = np.isfinite(y)
    lo_src = np.where(fin, y, np.inf)
    hi_src = np.where(fin, y, -np.inf)
    seg_min = np.minimum.reduceat(lo_src, starts)
    seg_max = np.maximum.reduceat(hi_src, starts)
    picks = np.stack([_first_per_segment(fin & (lo_src == seg_min[seg]), seg, nseg),
                      _first_per_segment(fin & (hi_src == seg_max[seg]), seg, nseg),
                      _first_per_segment(~fin, seg, nseg)], axis=1)
    idx = np.unique(picks[picks >= 0])  # segments are in index order: sorted is step order
    return x[idx], y[idx]


def band_envelope(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, n: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """At most ``n`` points of a band (``x`` sorted): per column of ``x``, its first ``x``,
    the smallest finite ``lo`` and the largest finite ``hi`` (NaN where it has none)."""
    x = np.asarray(x, dtype=float)
    lo = np.asarray(lo, dtype=float)
    hi = np.asarray(hi, dtype=float)
    if len(x) <= n:
        return x, lo, hi
    col = _columns(x, n, float(x[0]), float(x[-1]))
    starts = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])
    ok = np.isfinite(lo) & np.isfinite(hi)
    lows = np.minimum.reduceat(np.where(ok, lo, np.inf), starts)
    highs = np.maximum.reduceat(np.where(ok, hi, -np.inf), starts)
    some = np.logical_or.reduceat(ok, starts)
    return x[starts], np.where(some, lows, math.nan), np.where(some, highs, math.nan)


def column_max(x: np.ndarray, y: np.ndarray, n: int, lo: float, hi: float) -> np.ndarray:
    """``[n]`` per column of ``x`` over ``[lo, hi]``: the largest value, NaN where the column
    holds a non-finite value, ``-1`` where it holds none (not recorded)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    out = np.full(n, -1.0)
    if not len(x):
        return out
    col = _columns(x, n, lo, hi)
    starts = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])
    fin = np.isfinite(y)
    best = np.maximum.reduceat(np.where(fin, y, -np.inf), starts)
    bad = np.logical_or.reduceat(~fin, starts)
    out[col[starts]] = np.where(bad, math.nan, best)
    return out


def _scan(x: np.ndarray, beta: float, y0: float, block: int) -> np.ndarray:
    """``y[t] = beta * y[t-1] + x[t]`` with ``y[-1] = y0``, in blocks of closed forms."""
    out = np.empty(len(x))
    k = np.arange(block)
    up = beta ** k  # beta^k
    down = beta ** -k.astype(float)  # beta^-k, finite for the block sizes chosen
    carry = y0
    for a in range(0, len(x), block):
        seg = x[a:a + block]
        m = len(seg)
        out[a:a + m] = up[:m] * (beta * carry + np.cumsum(seg * down[:m]))
        carry = out[a + m - 1]
    return out


def ewma_band(values: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """The EWMA mean and standard deviation of a series, with the formula of
    :mod:`gradtap._tensorops.ewma` (``m = g, v = 0`` at the first finite value, then
    ``d = g - m; m += (1 - beta) d; v = beta (v + (1 - beta) d^2)``), skipping non-finite
    values (they leave the EWMA as it was). Before the first finite value both are NaN.

    Vectorised: the two recursions are linear, so each is evaluated in blocks of closed
    forms (a cumulative sum per block).
    """
    values = np.asarray(values, dtype=float)
    mean = np.full(len(values), math.nan)
    std = np.full(len(values), math.nan)
    fin = np.flatnonzero(np.isfinite(values))
    if not len(fin):
        return mean, std
    g = values[fin]
    beta = float(beta)
    if beta <= 0.0:
        m = g.copy()
        v = np.zeros(len(g))
    else:
        # beta^-block stays far below the float64 range
        block = int(max(1, min(4096, math.floor(250.0 / max(-math.log10(beta), 1e-12)))))
        m = _scan((1.0 - beta) * g, beta, float(g[0]), block)
        prev = np.r_[g[0], m[:-1]]
        d = g - prev
        v = _scan(beta * (1.0 - beta) * d * d, beta, 0.0, block)
    # forward-fill over the non-finite steps: the state they leave unchanged
    where = np.searchsorted(fin, np.arange(len(values)), side="right") - 1
    ok = where >= 0
    mean[ok] = m[where[ok]]
    std[ok] = np.sqrt(np.maximum(v[where[ok]], 0.0))
    return mean, std
