"""The gradient-spike detector: each tensor's log-norm against a robust, trend-following
baseline of its own recent history, with the step's common deviation taken out, and against
its steadiest neighbour (``docs/semantics.md``, "Gradient spikes", is the definition; this is
its implementation).

For tensor ``i`` let ``x`` be the log of its finite, positive gradient norms in step order
(other values are not scored and enter no history), ``h`` the up to ``WINDOW`` values before
``x[t]`` (``n = len(h) >= 2``, ``m = n // 2``):

* ``dev = x[t] - (median(h) + slope * (n + 1) / 2)``, ``slope = median(h[m:] - h[:n-m]) / m``:
  the deviation from the history's median carried forward along its robust trend;
* ``common``: the median of ``dev`` over the tensors that have one at this step (0 with fewer
  than ``MIN_COMMON``): what the whole step shares (a harder batch, a schedule);
* ``own = dev - common``, and ``s = max(SCALE_FLOOR, 1.4826 * median(|own|))`` over the tensor's
  up to ``WINDOW`` previous ``own`` values;
* ``c_score = common / max(SCALE_FLOOR, 1.4826 * median(|common|))`` over the up to ``WINDOW``
  previous steps that had a common deviation (``-inf`` before ``warmup`` of them, or without
  one this step);
* pairs: for each neighbour ``j`` of ``i`` (``0 < |i - j| <= NEIGHBOURS`` in the tensors'
  order), ``d = dev_i - dev_j`` at the steps where both have a deviation, and its spread
  ``p = 1.4826 * median(|d|)`` over the pair's up to ``WINDOW`` previous values (at least
  ``warmup // 2`` of them); the partner is the neighbour of least ``p`` (nearest first,
  lower first among equals) and ``q = d / max(SCALE_FLOOR, p)``: a jump the tensors that
  usually move with it did not share;
* ``score = max(own / s, min(c_score, dev / s), q if own / s > PAIR_GATE)``: the tensor's
  own jump, the whole step's jump where this tensor took part in it, or its jump against
  its partner where it also rose against the step.

A value is scored once ``h`` holds ``warmup`` values; it is a spike when ``score >
threshold``. Every valid value enters the history, a spike too: medians move by at most one
rank per value, so one spike neither masks the next nor moves the baseline.

:func:`scores` scores a table of norms (vectorised over steps); :class:`OnlineScores` scores
many tensors one step at a time (vectorised over tensors) with exactly the same numbers.

Example:
    >>> import numpy as np
    >>> norms = np.exp(np.sin(np.arange(40) / 5.0) * 0.1)
    >>> norms[30] *= 10
    >>> z = series_scores(norms, warmup=20)
    >>> np.flatnonzero(z > THRESHOLD).tolist()
    [30]
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["MIN_COMMON", "NEIGHBOURS", "PAIR_GATE", "SCALE_FLOOR", "THRESHOLD", "WARMUP",
           "WINDOW", "OnlineScores", "check_spike_args", "scores", "series_scores"]

#: Values of history the baseline and the scale are taken over.
WINDOW = 64
#: Default values of a tensor's history before its norms are scored.
WARMUP = 20
#: Default score above which a norm is a spike.
THRESHOLD = 6.0
#: The smallest scale, in natural-log units: with it a norm must be at least
#: ``exp(threshold * SCALE_FLOOR)`` times its baseline (2.46x at the default threshold).
SCALE_FLOOR = 0.15
#: ``1.4826 / sqrt(2)``: a median absolute difference of successive values of independent
#: normal values, to their standard deviation.
_DIFF_TO_SD = 1.4826 / math.sqrt(2.0)
#: Tensors with a deviation at a step for it to have a common deviation.
MIN_COMMON = 3
#: How far apart (in the tensors' order) two tensors may be to pair: a layer's weight, its
#: bias and the layers next to it share most of their step-to-step noise.
NEIGHBOURS = 8
#: The least own score (``own / s``) at which the jump against the partner counts: a
#: partner's dip alone is not a spike of the tensor.
PAIR_GATE = 2.0


def check_spike_args(threshold: float, warmup: int, what: str = "spikes()") -> None:
    """Raise ``ValueError`` for a threshold that is not a finite number > 0 or a warm-up that
    is not an int >= 3."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            0 < threshold < math.inf):
        raise ValueError(f"{what}: threshold must be a finite number > 0 (a robust z-score of "
                         f"the log-norm, e.g. {THRESHOLD:g}); got {threshold!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 3:
        raise ValueError(f"{what}: warmup must be an int >= 3 (values of a tensor's history "
                         f"before it is scored); got {warmup!r}")


def _log_valid(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log of the valid values, their positions)``: valid = finite and > 0."""
    values = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(values) & (values > 0)
    return np.log(values[ok]), np.flatnonzero(ok)


def _baselines(win: np.ndarray) -> np.ndarray:
    """The trend-following baseline of each row of ``win`` ([rows, n], n >= 2): a history in
    step order."""
    n = win.shape[1]
    m = n // 2
    slope = np.median(win[:, m:] - win[:, :n - m], axis=1) / m
    return np.median(win, axis=1) + slope * ((n + 1) / 2)


def _spreads(win: np.ndarray) -> np.ndarray:
    """The robust spread of each row of ``win`` ([rows, n], n >= 1): deviations from 0."""
    return 1.4826 * np.median(np.abs(win), axis=1)


def _scales(win: np.ndarray) -> np.ndarray:
    """:func:`_spreads`, at least :data:`SCALE_FLOOR`."""
    return np.maximum(SCALE_FLOOR, _spreads(win))


def _combine(own: np.ndarray, s: np.ndarray, dev: np.ndarray, c_score: np.ndarray | float,
             q: np.ndarray) -> np.ndarray:
    """The score from its parts (``q``: the jump against the partner, NaN: no partner)."""
    z = own / s
    out = np.maximum(z, np.minimum(c_score, dev / s))
    pair = (z > PAIR_GATE) & (q > out)  # False where q is NaN
    return np.where(pair, q, out)


def _offsets() -> np.ndarray:
    """The neighbours' offsets in the order of preference: nearest first, lower first."""
    return np.array([o for k in range(1, NEIGHBOURS + 1) for o in (-k, k)], dtype=np.int64)


def _trailing(x: np.ndarray, f: Callable[[np.ndarray], np.ndarray], least: int) -> np.ndarray:
    """``f`` of the up to ``WINDOW`` values of ``x`` before each position (NaN where fewer
    than ``least``)."""
    out = np.full(len(x), np.nan)
    ts = np.arange(least, len(x))
    full = ts[ts >= WINDOW]
    if len(full):
        out[full] = f(np.lib.stride_tricks.sliding_window_view(x, WINDOW)[full - WINDOW])
    early = ts[ts < WINDOW]
    if not len(early):
        return out
    head = x[:WINDOW]
    if f is _spreads or f is _scales:  # the first values at once: medians of prefixes
        spread = 1.4826 * _medians(_prefixes(np.abs(head), early), early)
        out[early] = spread if f is _spreads else np.maximum(SCALE_FLOOR, spread)
    elif f is _baselines:
        m = early // 2
        j = np.arange(WINDOW)[None, :]
        hi = np.minimum(m[:, None] + j, len(head) - 1)
        diffs = np.where(j < (early - m)[:, None], head[hi] - head[np.minimum(j, len(head) - 1)],
                         np.inf)
        slope = _medians(diffs, early - m) / m
        out[early] = _medians(_prefixes(head, early), early) + slope * ((early + 1) / 2)
    else:
        for t in early.tolist():
            out[t] = f(x[None, :t])[0]
    return out


def _prefixes(x: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Row ``r``: ``x[:ends[r]]``, then ``inf``."""
    return np.where(np.arange(len(x))[None, :] < ends[:, None], x[None, :], np.inf)


def _medians(rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The median of the first ``counts[r]`` (>= 1) values of each row, the rest ``inf``: the
    mean of the middle one or two sorted values, as ``np.median`` computes it."""
    rows = np.sort(rows, axis=1)
    r = np.arange(len(counts))
    return (rows[r, (counts - 1) // 2] + rows[r, counts // 2]) / 2


def _common(dev: np.ndarray) -> np.ndarray:
    """The step's common deviation: the median over the tensors with one (rows of ``dev``,
    NaN: none), 0 with fewer than :data:`MIN_COMMON`."""
    counts = np.sum(~np.isnan(dev), axis=1)
    out = np.zeros(len(dev))
    many = counts >= MIN_COMMON
    if many.any():
        out[many] = np.nanmedian(dev[many], axis=1)
    return out


def scores(values: np.ndarray, warmup: int = WARMUP) -> np.ndarray:
    """Score the norms ``values`` ([steps, tensors], NaN: no norm that step): the score of each,
    NaN where not scored (not finite, not > 0, or fewer than ``warmup`` valid values of that
    tensor before it)."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"scores() needs norms [steps, tensors]; got shape {values.shape}")
    steps, n = values.shape
    warmup = max(int(warmup), 3)
    dev = np.full((steps, n), np.nan)  # log-norm - its baseline, where it has one
    count = np.zeros((steps, n), dtype=np.int64)  # valid values before each step
    valid = [np.flatnonzero(np.isfinite(values[:, i]) & (values[:, i] > 0)) for i in range(n)]
    for i, at in enumerate(valid):
        x = np.log(values[at, i])
        dev[at, i] = x - _trailing(x, _baselines, 2)
        count[at, i] = np.arange(len(at))
    common = _common(dev)
    has_common = np.sum(~np.isnan(dev), axis=1) >= MIN_COMMON
    c_score = np.full(steps, -np.inf)  # the step's common score, -inf: none
    c_at = np.flatnonzero(has_common)
    c_score[c_at] = common[c_at] / _trailing(common[c_at], _scales, warmup)
    c_score[np.isnan(c_score)] = -np.inf
    q = _pair_scores(dev, warmup)
    out = np.full((steps, n), np.nan)
    for i, at in enumerate(valid):
        at = at[~np.isnan(dev[at, i])]  # the first value has no baseline
        own = dev[at, i] - common[at]
        scale = _trailing(own, _scales, 1)
        sc = at[count[at, i] >= warmup]
        keep = count[at, i] >= warmup
        out[sc, i] = _combine(own[keep], scale[keep], dev[sc, i], c_score[sc], q[sc, i])
    return out


def _pair_scores(dev: np.ndarray, warmup: int) -> np.ndarray:
    """Each deviation's jump against its partner (``q``; NaN: no partner), [steps, tensors]."""
    steps, n = dev.shape
    least = max(warmup // 2, 1)
    best = np.full((steps, n), np.inf)  # the partner's spread so far
    q = np.full((steps, n), np.nan)
    for k in range(1, NEIGHBOURS + 1):
        # pair (a, a + k) is a + k's neighbour at -k and a's at +k; by ascending a, each
        # tensor meets its lower neighbour before its upper one
        for a in range(n - k):
            d = dev[:, a] - dev[:, a + k]
            at = np.flatnonzero(~np.isnan(d))
            p = _trailing(d[at], _spreads, least)
            for i, di in ((a + k, -d[at]), (a, d[at])):  # dev_i - dev_j from either side
                better = p < best[at, i]  # False where NaN: too few values
                t = at[better]
                best[t, i] = p[better]
                q[t, i] = di[better] / np.maximum(SCALE_FLOOR, p[better])
    return q


def series_scores(values: np.ndarray, warmup: int = WARMUP) -> np.ndarray:
    """:func:`scores` of one tensor's norms (in step order)."""
    return scores(np.asarray(values, dtype=np.float64)[:, None], warmup)[:, 0]


class OnlineScores:
    """:func:`scores` for ``n`` tensors, one step at a time, with exactly the same numbers.

    :meth:`score` scores a step's norms (NaN: no valid norm this step, or not warmed up)
    without changing the history; :meth:`push` then adds them to it. Call both once a step.
    """

    def __init__(self, n: int, warmup: int = WARMUP) -> None:
        self.warmup = max(int(warmup), 3)
        self._x = np.full((n, WINDOW), np.nan)  # log-norms, right-aligned, oldest first
        self._own = np.full((n, WINDOW), np.nan)  # own deviations (dev - common), likewise
        self._c = np.full(WINDOW, np.nan)  # common deviations of the steps that had one
        self._count = np.zeros(n, dtype=np.int64)
        self._n_own = np.zeros(n, dtype=np.int64)
        self._n_c = 0
        self._base = np.full(n, np.nan)  # each tensor's baseline for the next value
        # pair (a, a + k): its deviations' differences, right-aligned, at [a, k - 1]
        self._d = np.full((n, NEIGHBOURS, WINDOW), np.nan)
        self._n_d = np.zeros((n, NEIGHBOURS), dtype=np.int64)
        self._spread = np.full((n, NEIGHBOURS), np.nan)  # each pair's spread (NaN: too few)
        self._fresh = True
        self._pending: tuple[np.ndarray, ...] | None = None
        self._c_pending: float | None = None

    @property
    def count(self) -> np.ndarray:
        """Valid values in each tensor's history so far."""
        return self._count

    def grow(self, k: int) -> None:
        """Add ``k`` tensors with no history (after the last ones)."""
        n = len(self._count)
        self._x = np.concatenate([self._x, np.full((k, WINDOW), np.nan)])
        self._own = np.concatenate([self._own, np.full((k, WINDOW), np.nan)])
        self._count = np.concatenate([self._count, np.zeros(k, dtype=np.int64)])
        self._n_own = np.concatenate([self._n_own, np.zeros(k, dtype=np.int64)])
        self._base = np.concatenate([self._base[:n], np.full(k, np.nan)])
        self._d = np.concatenate([self._d, np.full((k, NEIGHBOURS, WINDOW), np.nan)])
        self._n_d = np.concatenate([self._n_d, np.zeros((k, NEIGHBOURS), dtype=np.int64)])
        self._pending = None
        self._fresh = False

    def baseline(self) -> np.ndarray:
        """Each tensor's baseline for its next value, in log units (NaN before two values)."""
        self._refresh()
        return self._base

    def score(self, values: np.ndarray) -> np.ndarray:
        """The scores of one step's norms (NaN where not scored)."""
        self._refresh()
        values = np.asarray(values, dtype=np.float64)
        ok = np.isfinite(values) & (values > 0)
        x = np.full(len(values), np.nan)
        x[ok] = np.log(values[ok])
        dev = x - self._base  # NaN where no value or no baseline
        have = ~np.isnan(dev)
        common = float(_common(dev[None, :])[0])
        c = common if have.sum() >= MIN_COMMON else None
        own = dev - common
        out = np.full(len(values), np.nan)
        scored = have & (self._count >= self.warmup)
        diffs = self._diffs(dev)
        if scored.any():
            c_score = -np.inf
            if c is not None and self._n_c >= self.warmup:
                c_score = c / _scales(self._c[None, WINDOW - min(self._n_c, WINDOW):])[0]
            rows = np.flatnonzero(scored)
            scale = self._own_scales(rows)
            q = self._pair_scores(diffs)[rows]
            out[rows] = _combine(own[rows], scale, dev[rows], c_score, q)
        self._pending = (ok, x, np.where(have, own, np.nan), diffs)
        self._c_pending = c
        return out

    def _diffs(self, dev: np.ndarray) -> np.ndarray:
        """``dev[a] - dev[a + k]`` at ``[a, k - 1]`` (NaN: either has none, or no such pair)."""
        n = len(dev)
        out = np.full((n, NEIGHBOURS), np.nan)
        for k in range(1, min(NEIGHBOURS, n - 1) + 1):
            out[:n - k, k - 1] = dev[:n - k] - dev[k:]
        return out

    def _pair_scores(self, diffs: np.ndarray) -> np.ndarray:
        """Each tensor's jump against its partner this step (NaN: no partner)."""
        n = len(diffs)
        offsets = _offsets()
        spread = np.full((n, len(offsets)), np.inf)
        d = np.full((n, len(offsets)), np.nan)
        for slot, off in enumerate(offsets.tolist()):
            k = abs(off)
            if k >= n:
                continue
            lo = np.arange(n - k)  # the pair's lower tensor
            i = lo if off > 0 else lo + k
            p = self._spread[lo, k - 1]
            di = diffs[lo, k - 1] if off > 0 else -diffs[lo, k - 1]
            ok = ~np.isnan(p) & ~np.isnan(di)
            spread[i[ok], slot] = p[ok]
            d[i[ok], slot] = di[ok]
        pick = np.argmin(spread, axis=1)  # the first least: nearest, lower first
        rows = np.arange(n)
        best = spread[rows, pick]
        return np.where(np.isfinite(best), d[rows, pick] / np.maximum(SCALE_FLOOR, best), np.nan)

    def push(self, values: np.ndarray) -> None:
        """Add the norms of the step just scored (``values``, as given to :meth:`score`)."""
        if self._pending is None:
            self.score(values)
        assert self._pending is not None
        ok, x, own, diffs = self._pending
        c = self._c_pending
        self._pending = None
        _shift_in(self._x, ok, x)
        has_own = ~np.isnan(own)
        _shift_in(self._own, has_own, own)
        self._n_own += has_own
        has_d = ~np.isnan(diffs)
        flat = self._d.reshape(-1, WINDOW)
        _shift_in(flat, has_d.reshape(-1), diffs.reshape(-1))
        self._n_d += has_d
        if c is not None:
            self._c[:-1] = self._c[1:]
            self._c[-1] = c
            self._n_c += 1
        self._count += ok
        self._fresh = False

    def _own_scales(self, rows: np.ndarray) -> np.ndarray:
        n_own = np.minimum(self._n_own[rows], WINDOW)
        out = np.empty(len(rows))
        # rows with histories of one length together (the same numbers, row by row)
        for n in np.unique(n_own).tolist():
            at = np.flatnonzero(n_own == n)
            out[at] = _scales(self._own[rows[at], WINDOW - n:])
        return out

    def _refresh(self) -> None:
        if self._fresh:
            return
        self._fresh = True
        count = np.minimum(self._count, WINDOW)
        self._base = np.full(len(self._count), np.nan)
        # tensors with histories of one length together (the same numbers, row by row)
        for n in np.unique(count[count >= 2]).tolist():
            at = np.flatnonzero(count == n)
            self._base[at] = _baselines(self._x[at, WINDOW - n:])
        least = max(self.warmup // 2, 1)
        self._spread = np.full(self._n_d.shape, np.nan)
        flat, spread = self._d.reshape(-1, WINDOW), self._spread.reshape(-1)
        n_d = np.minimum(self._n_d.reshape(-1), WINDOW)
        for n in np.unique(n_d[n_d >= least]).tolist():
            at = np.flatnonzero(n_d == n)
            spread[at] = _spreads(flat[at, WINDOW - n:])


def _shift_in(ring: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """Append ``values[rows]`` to the right-aligned histories ``ring[rows]``."""
    if rows.all():
        ring[:, :-1] = ring[:, 1:]
        ring[:, -1] = values
    elif rows.any():
        at = np.flatnonzero(rows)
        ring[at, :-1] = ring[at, 1:]
        ring[at, -1] = values[at]
