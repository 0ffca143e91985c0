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
  ``p = 1.4826 * median(|d|)`` over the up to ``WINDOW`` values of ``d`` before its ``r``-th,
  where the pair has ``u >= warmup // 2`` values before this one and ``r = u`` while
  ``u < EXACT``, else ``r = u - u % PAIR_REFRESH`` (a pair's spread is recomputed at each
  value for its first ``EXACT``, then held for ``PAIR_REFRESH`` values: eight pairs a tensor
  make it most of the detector's cost, and a spread is a slow, steady quantity); the partner
  is the neighbour of least ``p`` (nearest first, lower first among equals) and
  ``q = d / max(SCALE_FLOOR, p)``: a jump the tensors that usually move with it did not
  share;
* ``score = max(own / s, min(c_score, dev / s), q if own / s > PAIR_GATE)``: the tensor's
  own jump, the whole step's jump where this tensor took part in it, or its jump against
  its partner where it also rose against the step.

A value is scored once ``h`` holds ``warmup`` values; it is a spike when ``score >
threshold``. Every valid value enters the history, a spike too: medians move by at most one
rank per value, so one spike neither masks the next nor moves the baseline.

:func:`scores` scores a table of norms (vectorised over steps); :class:`OnlineScores` scores
many tensors one step at a time (vectorised over tensors) with exactly the same numbers.
Medians are those of sorted rows (several times quicker than ``np.median`` on rows of 64),
sorted a chunk at a time in a buffer that stays in the cache (one numpy pass over a row of
64 costs most of what its sort costs, and updating a sorted window in place takes several:
find the leaving value, the entering one's place, shift); where
every tensor has a norm at every step, each tensor's partner is chosen once per change of
the pairs' spreads.

Example:
    >>> import numpy as np
    >>> norms = np.exp(np.sin(np.arange(40) / 5.0) * 0.1)
    >>> norms[30] *= 10
    >>> z = series_scores(norms, warmup=20)
    >>> np.flatnonzero(z > THRESHOLD).tolist()
    [30]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

__all__ = ["EXACT", "MIN_COMMON", "NEIGHBOURS", "PAIR_GATE", "PAIR_REFRESH", "SCALE_FLOOR",
           "THRESHOLD", "WARMUP", "WINDOW", "OnlineScores", "check_spike_args",
           "scores", "series_scores"]

#: Values of history the baseline and the scale are taken over.
WINDOW = 64
#: Values of a pair's history before its spread is recomputed only before every
#: ``PAIR_REFRESH``-th value, not before each one (a tensor's baseline and scale are
#: recomputed before each value): the first steps of training move fastest.
EXACT = 2 * WINDOW
#: Values between two recomputations of a pair's spread after ``EXACT`` (a divisor of
#: ``EXACT``); in between it holds.
PAIR_REFRESH = 32
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
#: Rows :func:`_middle` sorts at a time (a buffer of 1 MiB at rows of 64).
_CHUNK = 2048
#: Tensors with a deviation at a step for it to have a common deviation.
MIN_COMMON = 3
#: How far apart (in the tensors' order) two tensors may be to pair: a layer's weight, its
#: bias and the layers next to it share most of their step-to-step noise.
NEIGHBOURS = 8
#: The least own score (``own / s``) at which the jump against the partner counts: a
#: partner's dip alone is not a spike of the tensor.
PAIR_GATE = 2.0

#: :func:`_baselines` or :func:`_spreads`: statistics of histories, one per row.
Stat = Callable[[np.ndarray], "np.ndarray | tuple[np.ndarray, np.ndarray]"]


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


def _held(t: np.ndarray, every: int = 1) -> np.ndarray:
    """The position whose history gives the statistics at each position ``t`` of a series:
    ``t`` itself while fewer than ``EXACT`` values precede it, else the last multiple of
    ``every``."""
    return np.where(t < EXACT, t, t - t % every)


def _carry(center: np.ndarray, slope: np.ndarray, n: np.ndarray, age: np.ndarray) -> np.ndarray:
    """The baseline ``age`` values after the end of a history of ``n`` values with that median
    and slope."""
    return center + slope * ((n + 1) / 2 + age)


def _baselines(win: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(median, slope)`` of each row of ``win`` ([rows, n], n >= 2): a history in step
    order."""
    n = win.shape[1]
    m = n // 2
    return _middle(win), _middle(win[:, m:] - win[:, :n - m]) / m


def _spreads(win: np.ndarray) -> np.ndarray:
    """The robust spread of each row of ``win`` ([rows, n], n >= 1): deviations from 0."""
    return 1.4826 * _middle(win, absolute=True)


def _middle(win: np.ndarray, absolute: bool = False) -> np.ndarray:
    """The median of each row of ``win`` (of its absolute values with ``absolute``): the mean
    of its middle one or two values, as ``np.median`` computes it. Rows are copied (or their
    absolute values written) into a buffer and sorted there, :data:`_CHUNK` at a time: a sort
    of rows of 64 is several times quicker than ``np.median``, and in a buffer that stays in
    the cache it costs about 60% of a sort of the whole array."""
    rows, n = win.shape
    out = np.empty(rows)
    buf = np.empty((min(rows, _CHUNK), n))
    for r0 in range(0, rows, _CHUNK):
        b = buf[:min(_CHUNK, rows - r0)]
        if absolute:
            np.abs(win[r0:r0 + _CHUNK], out=b)
        else:
            np.copyto(b, win[r0:r0 + _CHUNK])
        b.sort(axis=1)
        np.add(b[:, (n - 1) // 2], b[:, n // 2], out=out[r0:r0 + len(b)])
    out /= 2
    return out


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


def _stats(x: np.ndarray, f: Stat, least: int, every: int = 1) -> tuple[np.ndarray, ...]:
    """``f`` (:func:`_baselines` or :func:`_spreads`) at each position ``t`` of ``x``: of the
    up to ``WINDOW`` values before ``_held(t, every)`` (NaN where ``t < least``)."""
    got, index = _held_stats(x, f, least, every)
    return tuple(np.append(g, np.nan)[index] for g in got)  # index -1: the NaN


def _held_stats(x: np.ndarray, f: Stat, least: int, every: int = 1
                ) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """``f`` at the positions ``_held`` names (each from ``least`` to ``EXACT``, then every
    ``every``-th), and for each position of ``x`` the index of its own among them (-1 where
    ``t < least``)."""
    size = len(x)
    early = np.arange(least, min(size, WINDOW))
    parts: list[tuple[np.ndarray, ...]] = []
    if len(early):  # short histories, every position: medians of prefixes, all at once
        head = x[:WINDOW]
        if f is _spreads:
            parts.append((1.4826 * _medians(_prefixes(np.abs(head), early), early),))
        else:
            m = early // 2
            j = np.arange(WINDOW)[None, :]
            hi = np.minimum(m[:, None] + j, len(head) - 1)
            diffs = np.where(j < (early - m)[:, None],
                             head[hi] - head[np.minimum(j, len(head) - 1)], np.inf)
            parts.append((_medians(_prefixes(head, early), early), _medians(diffs, early - m) / m))
    if size > WINDOW:  # full histories: each position, then each every-th (views, no copy)
        for rows in (slice(0, EXACT - WINDOW), slice(EXACT - WINDOW, None, every)):
            stat = _full_stats(x, f, rows)
            if len(stat[0]):
                parts.append(stat)
    k = 2 if f is _baselines else 1
    got = tuple(np.concatenate([p[s] for p in parts]) if parts else np.zeros(0)
                for s in range(k))
    return got, _held_index(size, least, every)


def _full_stats(x: np.ndarray, f: Stat, rows: slice) -> tuple[np.ndarray, ...]:
    """``f`` of the full histories ``rows`` of ``x`` (row ``r``: the ``WINDOW`` values
    before ``x[WINDOW + r]``). A baseline's differences ``h[m:] - h[:m]`` are those of the
    series, ``x[k + m] - x[k]``, taken once (the same numbers as row by row)."""
    wins = np.lib.stride_tricks.sliding_window_view(x[:-1], WINDOW)[rows]
    if f is not _baselines:
        return (_spreads(wins),)
    m = WINDOW // 2
    diffs = np.lib.stride_tricks.sliding_window_view(x[m:-1] - x[:-1 - m], WINDOW - m)[rows]
    return _middle(wins), _middle(diffs) / m


@functools.lru_cache(maxsize=8)
def _held_index(size: int, least: int, every: int) -> np.ndarray:
    """For each of ``size`` positions, the index of its statistics among those
    :func:`_held_stats` computes (-1 where ``t < least``); read-only."""
    t = np.arange(size)
    early = max(0, min(size, WINDOW) - least)
    index = np.where(t < WINDOW, t - least, np.where(
        t < EXACT, early + t - WINDOW, early + EXACT - WINDOW + (t - EXACT) // every))
    index[t < least] = -1
    index.setflags(write=False)
    return index


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
    """Each step's common deviation: the median over the tensors with one (``dev``:
    [tensors, steps], NaN: none), 0 where fewer than :data:`MIN_COMMON` have one."""
    n, steps = dev.shape
    out = np.zeros(steps)
    for s0 in range(0, steps, 4096):
        rows = dev[:, s0:s0 + 4096].T  # [steps, tensors]
        have = ~np.isnan(rows)
        counts = have.sum(axis=1)
        full = np.flatnonzero(counts == n) if n >= MIN_COMMON else np.zeros(0, np.int64)
        if len(full):
            out[s0 + full] = np.median(rows[full], axis=1)
        some = np.flatnonzero((counts >= MIN_COMMON) & (counts < n))
        if len(some):
            out[s0 + some] = _medians(np.where(have[some], rows[some], np.inf), counts[some])
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
    dev = np.full((n, steps), np.nan)  # log-norm - its baseline, where it has one
    valid = []
    for i in range(n):
        x, at = _log_valid(values[:, i])
        center, slope = _stats(x, _baselines, 2)
        t = np.arange(len(x))
        held = _held(t)
        dev[i, at] = x - _carry(center, slope, np.minimum(held, WINDOW), t - held)
        valid.append(at)
    common = _common(dev)
    c_score = np.full(steps, -np.inf)  # the step's common score, -inf: none
    c_at = np.flatnonzero(np.sum(~np.isnan(dev), axis=0) >= MIN_COMMON)
    c_score[c_at] = common[c_at] / np.maximum(SCALE_FLOOR, _stats(common[c_at], _spreads,
                                                                   warmup)[0])
    c_score[np.isnan(c_score)] = -np.inf
    least = max(warmup // 2, 1)
    pairs: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}  # (a, k): pair (a, a + k)
    out = np.full((n, steps), np.nan)
    nan = np.isnan(dev)
    # every tensor has a deviation at the same steps (the usual table): every pair's spreads
    # change at the same steps, and each tensor's partner is chosen once per change
    shared = np.flatnonzero(~nan[0]) if n and (nan == nan[0]).all() else None
    for i in range(n):
        for k in range(1, min(NEIGHBOURS, n - 1 - i) + 1):
            if shared is None:
                pairs[i, k] = _pair(dev[i], dev[i + k], least)
            else:
                pairs[i, k] = _held_stats(dev[i, shared] - dev[i + k, shared], _spreads,
                                          least, PAIR_REFRESH)[0]
        q = (_partner_scores(i, n, pairs, steps) if shared is None
             else _shared_partner_scores(i, dev, shared, pairs, least))
        for k in range(1, NEIGHBOURS + 1):
            pairs.pop((i - k, k), None)  # both of its tensors are done
        keep = ~np.isnan(dev[i, valid[i]])  # the first values have no baseline
        at = valid[i][keep]
        own = dev[i, at] - common[at]
        scale = np.maximum(SCALE_FLOOR, _stats(own, _spreads, 1)[0])
        sc = np.flatnonzero(keep) >= warmup  # valid values before each: its index in valid
        t = at[sc]
        out[i, t] = _combine(own[sc], scale[sc], dev[i, t], c_score[t], q[t])
    return out.T


def _pair(dev_a: np.ndarray, dev_b: np.ndarray, least: int) -> tuple[np.ndarray, ...]:
    """``(steps, spreads, d)`` of a pair: the steps where both have a deviation, the spread
    of ``d = dev_a - dev_b`` there (NaN: too few values), ``d`` itself."""
    d = dev_a - dev_b
    at = np.flatnonzero(~np.isnan(d))
    d = d[at]
    return at, _stats(d, _spreads, least, PAIR_REFRESH)[0], d


def _partner_scores(i: int, n: int, pairs: dict[tuple[int, int], tuple[np.ndarray, ...]],
                    steps: int) -> np.ndarray:
    """Tensor ``i``'s jump against its partner at each step (``q``; NaN: no partner)."""
    best = np.full(steps, np.inf)  # the partner's spread so far
    q = np.full(steps, np.nan)
    for off in _offsets().tolist():  # in the order of preference: only a lower spread wins
        if not 0 <= i + off < n:
            continue
        at, p, d = pairs[min(i, i + off), abs(off)]
        better = p < best[at]  # False where NaN: too few values
        t = at[better]
        best[t] = p[better]
        q[t] = (d[better] if off > 0 else -d[better]) / np.maximum(SCALE_FLOOR, p[better])
    return q


def _shared_partner_scores(i: int, dev: np.ndarray, shared: np.ndarray,
                           pairs: dict[tuple[int, int], tuple[np.ndarray, ...]],
                           least: int) -> np.ndarray:
    """:func:`_partner_scores` where every tensor has a deviation at the steps ``shared``
    (``pairs``: each pair's spreads at the positions :func:`_held_stats` names)."""
    n, steps = dev.shape
    offs = [off for off in _offsets().tolist() if 0 <= i + off < n]
    q = np.full(steps, np.nan)
    held = np.stack([pairs[min(i, i + off), abs(off)][0] for off in offs]) if offs else None
    if held is None or not held.shape[1]:  # no neighbour, or too few values yet
        return q
    held[np.isnan(held)] = np.inf  # too few values
    pick = np.argmin(held, axis=0)  # the first least: nearest, lower first
    best = np.append(held[pick, np.arange(held.shape[1])], np.inf)
    index = _held_index(len(shared), least, PAIR_REFRESH)
    spread = best[index]  # index -1: the inf
    partner = i + np.asarray(offs)[pick][index]
    d = dev[i, shared] - dev[partner, shared]
    q[shared] = np.where(np.isfinite(spread), d / np.maximum(SCALE_FLOOR, spread), np.nan)
    return q


@functools.lru_cache(maxsize=8)
def _pair_slots(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For :meth:`OnlineScores._pair_scores` of ``n`` tensors: at ``[i, c]`` the row (in an
    array of pairs with ``NEIGHBOURS`` rows before the first) and column of the pair of
    tensor ``i`` and its neighbour of column ``c`` (:func:`_offsets`' order); the sign of
    ``dev_i - dev_j`` in the pair's difference, per column. Read-only."""
    offs = _offsets()
    k = np.abs(offs)
    rows = NEIGHBOURS + np.arange(n)[:, None] + np.minimum(offs, 0)[None, :]
    cols = np.broadcast_to(k - 1, rows.shape)
    sign = np.where(offs > 0, 1.0, -1.0)
    for a in (rows, sign):
        a.setflags(write=False)
    return rows, cols, sign


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
        self._x = _Histories(n, _baselines)  # log-norms
        self._own = _Histories(n, _spreads)  # own deviations (dev - common)
        self._c = _Histories(1, _spreads)  # common deviations of the steps that had one
        # pair (a, a + k) at a * NEIGHBOURS + k - 1
        self._d = _Histories(n * NEIGHBOURS, _spreads, PAIR_REFRESH)
        self._base = np.full(n, np.nan)  # each tensor's baseline for the next value
        self._spread = np.full((n, NEIGHBOURS), np.nan)  # each pair's spread (NaN: too few)
        self._fresh = False
        self._pending: tuple[np.ndarray, ...] | None = None
        self._c_pending: float | None = None

    @property
    def count(self) -> np.ndarray:
        """Valid values in each tensor's history so far."""
        return self._x.count

    def grow(self, k: int) -> None:
        """Add ``k`` tensors with no history (after the last ones)."""
        self._x.grow(k)
        self._own.grow(k)
        self._d.grow(k * NEIGHBOURS)
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
        common = float(_common(dev[:, None])[0])
        c = common if have.sum() >= MIN_COMMON else None
        own = dev - common
        out = np.full(len(values), np.nan)
        scored = have & (self.count >= self.warmup)
        diffs = self._diffs(dev)
        if scored.any():
            c_score = -np.inf
            if c is not None and self._c.count[0] >= self.warmup:
                c_score = c / np.maximum(SCALE_FLOOR, self._c.stats[0])[0]
            rows = np.flatnonzero(scored)
            scale = np.maximum(SCALE_FLOOR, self._own.stats[0][rows])
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
        ok = ~np.isnan(self._spread) & ~np.isnan(diffs)  # [a, k - 1]: pair (a, a + k)
        pad = np.full((n + NEIGHBOURS, NEIGHBOURS), np.inf)  # NEIGHBOURS rows of none first
        pad[NEIGHBOURS:] = np.where(ok, self._spread, np.inf)
        rows, cols, sign = _pair_slots(n)
        spread = pad[rows, cols]  # [i, column of the offset]
        pad[:NEIGHBOURS] = np.nan
        pad[NEIGHBOURS:] = np.where(ok, diffs, np.nan)
        d = sign * pad[rows, cols]  # dev_i - dev_j
        pick = np.argmin(spread, axis=1)  # the first least: nearest, lower first
        at = np.arange(n)
        best = spread[at, pick]
        return np.where(np.isfinite(best), d[at, pick] / np.maximum(SCALE_FLOOR, best), np.nan)

    def push(self, values: np.ndarray) -> None:
        """Add the norms of the step just scored (``values``, as given to :meth:`score`)."""
        if self._pending is None:
            self.score(values)
        assert self._pending is not None
        ok, x, own, diffs = self._pending
        c = self._c_pending
        self._pending = None
        self._x.push(ok, x)
        self._own.push(~np.isnan(own), own)
        self._d.push(~np.isnan(diffs).reshape(-1), diffs.reshape(-1))
        if c is not None:
            self._c.push(np.ones(1, dtype=bool), np.array([c]))
        self._fresh = False

    def _refresh(self) -> None:
        if self._fresh:
            return
        self._fresh = True
        for h in (self._x, self._own, self._c, self._d):
            h.refresh()
        x = self._x
        self._base = _carry(x.stats[0], x.stats[1], x.length, x.count - x.at)
        least = max(self.warmup // 2, 1)
        spread = np.where(self._d.count >= least, self._d.stats[0], np.nan)
        self._spread = spread.reshape(-1, NEIGHBOURS)


class _Histories:
    """The last ``WINDOW`` values of many series (a ring per row, written at ``count %
    WINDOW`` and again ``WINDOW`` after it, so that each history is one slice of its row) and
    ``f`` of each, recomputed as :func:`_stats` computes it: before each value
    while fewer than ``EXACT`` precede it, then before every ``every``-th."""

    def __init__(self, rows: int, f: Stat, every: int = 1) -> None:
        self.f, self.every = f, every
        self.ring = np.full((rows, 2 * WINDOW), np.nan)
        self.count = np.zeros(rows, dtype=np.int64)  # values so far
        self.stats = tuple(np.full(rows, np.nan) for _ in range(2 if f is _baselines else 1))
        self.at = np.full(rows, -1, dtype=np.int64)  # the count they were computed at
        self.length = np.zeros(rows, dtype=np.int64)  # the history they were computed of

    def grow(self, k: int) -> None:
        """Add ``k`` series with no values."""
        self.ring = np.concatenate([self.ring, np.full((k, 2 * WINDOW), np.nan)])
        self.count = np.concatenate([self.count, np.zeros(k, dtype=np.int64)])
        self.stats = tuple(np.concatenate([s, np.full(k, np.nan)]) for s in self.stats)
        self.at = np.concatenate([self.at, np.full(k, -1, dtype=np.int64)])
        self.length = np.concatenate([self.length, np.zeros(k, dtype=np.int64)])

    def push(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Append ``values[rows]`` to the series ``rows`` (a mask)."""
        at = np.flatnonzero(rows)
        pos = self.count[at] % WINDOW
        self.ring[at, pos] = self.ring[at, pos + WINDOW] = values[at]
        self.count[at] += 1

    def refresh(self) -> None:
        """Recompute the statistics due at the present counts."""
        c = self.count
        due = (c != self.at) & (c >= (2 if self.f is _baselines else 1)) & (
            (c < EXACT) | (c % self.every == 0))
        rows = np.flatnonzero(due)
        if not len(rows):
            return
        length = np.minimum(c[rows], WINDOW)
        # rows with histories of one length together (the same numbers, row by row)
        for n in np.unique(length).tolist():
            r = rows[length == n]
            start = (c[r] - n) % WINDOW  # the oldest value's slot
            got = self.f(np.lib.stride_tricks.sliding_window_view(self.ring, n, axis=1)[r, start])
            for s, g in zip(self.stats, got if isinstance(got, tuple) else (got,)):
                s[r] = g
        self.at[rows] = c[rows]
        self.length[rows] = length
