"""The report's per-tensor pass over a run: one tensor at a time, in bounded memory.

For every stored tensor of a kind, :func:`scan_kind` reads its ``norm`` series once (and
its ``nonfinite`` counts when the norm is ever non-finite, its ``clip_factor`` and update
ratio when the run has them), keeps a few summary numbers (:class:`LayerSummary`), one row of
the layers-by-steps heatmap (the maximum of each of at most :data:`HEAT_COLS` step columns)
and its first non-finite step, and lets the series go. :func:`top_layers` then picks the
layers that matter (non-finite, spiking, most clipped, largest), at most :data:`TOP_K` of
them, whose full series the charts draw; every other tensor is in the layer table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gradtap.report.reduce import _columns, column_max

__all__ = ["HEAT_COLS", "HEAT_ROWS", "TOP_K", "Heat", "LayerSummary", "group_rows",
           "nonfinite_row", "scan_kind", "top_layers"]

Series = tuple[np.ndarray, np.ndarray]
Getter = Callable[[str, str, str], "Series | None"]

#: How many tensors of a kind the charts draw at most (the rest are in the layer table).
TOP_K = 12
#: Columns of a heatmap at most (each the maximum over the steps it covers).
HEAT_COLS = 200
#: Rows of a heatmap at most (beyond, consecutive tensors in model order share a row).
HEAT_ROWS = 40


@dataclass
class LayerSummary:
    """Per-tensor numbers for the summary tables (report and ``gradtap demo``).

    ``peak`` is the largest factor by which a norm exceeds both its neighbours (a one-step
    spike of 10x shows as about 10, a trend or slow drift as about 1); ``clipped_steps`` the
    steps a spike rule scaled the gradient down (``clip_factor < 1``); ``why`` the reasons the report charts it (empty when the run has
    no more than :data:`TOP_K` tensors of its kind, or when it is only in the table).
    """

    name: str
    kind: str
    shape: list[int] | None
    steps: int
    first_norm: float
    last_norm: float
    median_norm: float
    max_norm: float
    nonfinite_steps: int
    last_ratio: float | None
    median_ratio: float | None
    peak: float = math.nan
    clipped_steps: int = 0
    why: list[str] = field(default_factory=list)


@dataclass
class Heat:
    """A layers-by-steps heatmap: one row per tensor (model order), ``grid`` [rows, cols] of
    each column's largest norm (NaN: a non-finite value, -1: nothing recorded), ``edges``
    the first and last step of each column."""

    names: list[str]
    grid: np.ndarray
    edges: list[tuple[float, float]]


def _heat_axis(steps: np.ndarray) -> tuple[int, list[tuple[float, float]]]:
    """The heatmap's column count and each column's first and last stored step (the range
    it covers, when it holds none)."""
    if len(steps) <= HEAT_COLS:
        return len(steps), [(float(s), float(s)) for s in steps]
    col = _columns(steps.astype(float), HEAT_COLS, float(steps[0]), float(steps[-1]))
    starts = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])
    ends = np.r_[starts[1:], len(steps)] - 1
    lo, width = float(steps[0]), (float(steps[-1]) - float(steps[0])) / HEAT_COLS
    edges = [(float(round(lo + c * width)), float(round(lo + (c + 1) * width)))
             for c in range(HEAT_COLS)]  # for the columns without a stored step
    for c, a, z in zip(col[starts].tolist(), starts.tolist(), ends.tolist(), strict=True):
        edges[c] = (float(steps[a]), float(steps[z]))
    return HEAT_COLS, edges


def _spike_factor(vals: np.ndarray) -> float:
    """``max_t min(v[t] / v[t-1], v[t] / v[t+1])`` over positive finite neighbours."""
    v = np.where(np.isfinite(vals) & (vals > 0), vals, np.nan)
    if len(v) < 3:
        return math.nan
    with np.errstate(invalid="ignore", divide="ignore"):
        up = np.fmin(v[1:-1] / v[:-2], v[1:-1] / v[2:])
    up = up[np.isfinite(up)]
    return float(up.max()) if len(up) else math.nan


def nonfinite_row(get: Getter, name: str, kind: str) -> dict | None:
    """From the stored ``nonfinite`` counts of a tensor: its first and last step with NaN/Inf,
    how many steps and the largest count; ``None`` when it never held one."""
    nf = get(name, "nonfinite", kind)
    if nf is None:
        return None
    where = np.flatnonzero(np.nan_to_num(nf[1], nan=0.0) > 0)
    if not len(where):
        return None
    return {"step": int(nf[0][where[0]]), "kind": kind, "name": name, "steps": int(len(where)),
            "max_count": int(nf[1][where].max()), "last_step": int(nf[0][where[-1]])}


def scan_kind(get: Getter, names: Sequence[str], kind: str, steps: Sequence[int],
              shapes: dict[str, list[int]], ratio_of: Callable[[str], Series | None]
              ) -> tuple[list[LayerSummary], Heat, list[dict]]:
    """Summaries, the heatmap and the non-finite rows of every tensor of ``kind``.

    Args:
        get: reads one series ``(name, stat, kind)`` or gives ``None``.
        names: the tensors with a ``norm`` of this kind, in model order.
        kind: ``"param_grad"`` or ``"grad_output"``.
        steps: the run's stored steps.
        shapes: parameter shapes by name (from the run's metadata).
        ratio_of: the update-to-weight ratio series of a parameter, or ``None``.
    """
    all_steps = np.asarray(steps, dtype=np.int64)
    ncols, edges = _heat_axis(all_steps)
    lo, hi = (float(all_steps[0]), float(all_steps[-1])) if len(all_steps) else (0.0, 1.0)
    grid = np.full((len(names), ncols), -1.0)
    layers, bad_rows = [], []
    for r, name in enumerate(names):
        series = get(name, "norm", kind)
        if series is None:
            continue
        st, vals = series
        if ncols == len(all_steps):
            grid[r, np.searchsorted(all_steps, st)] = vals
        else:
            grid[r] = column_max(st, vals, ncols, lo, hi)
        fin = vals[np.isfinite(vals)]
        nonfinite_steps = int(len(vals) - len(fin))
        # a NaN/Inf element makes the norm non-finite: read the counts only then
        row = nonfinite_row(get, name, kind) if nonfinite_steps else None
        if row is not None:
            bad_rows.append(row)
            nonfinite_steps = max(nonfinite_steps, row["steps"])
        clip = get(name, "clip_factor", kind) if kind == "param_grad" else None
        ratio = ratio_of(name) if kind == "param_grad" else None
        rfin = ratio[1][np.isfinite(ratio[1]) & (ratio[1] > 0)] if ratio is not None else None
        median = float(np.median(fin)) if len(fin) else math.nan
        top = float(fin.max()) if len(fin) else math.nan
        layers.append(LayerSummary(
            name=name, kind=kind, shape=shapes.get(name), steps=len(st),
            first_norm=float(vals[0]) if len(vals) else math.nan,
            last_norm=float(vals[-1]) if len(vals) else math.nan,
            median_norm=median, max_norm=top, nonfinite_steps=nonfinite_steps,
            last_ratio=float(rfin[-1]) if rfin is not None and len(rfin) else None,
            median_ratio=float(np.median(rfin)) if rfin is not None and len(rfin) else None,
            peak=_spike_factor(vals),
            clipped_steps=int((clip[1] < 1.0).sum()) if clip is not None else 0))
    present = {ly.name for ly in layers}
    keep = [i for i, n in enumerate(names) if n in present]
    return layers, Heat([names[i] for i in keep], grid[keep], edges), bad_rows


def top_layers(layers: Sequence[LayerSummary], k: int = TOP_K,
               spiking: Sequence[str] = ()) -> list[str]:
    """The names of at most ``k`` layers that matter, in model order, each with its reasons
    set in ``why``: those that held NaN/Inf (model order), spiked (first to cross the
    spike threshold most often, then the largest ``peak``, above 3), were clipped most, had the
    largest norms, taken in turn from each list. With ``k`` or fewer layers: all of them."""
    if len(layers) <= k:
        return [ly.name for ly in layers]
    order = {ly.name: i for i, ly in enumerate(layers)}
    by_name = {ly.name: ly for ly in layers}
    spike_count: dict[str, int] = {}
    for n in spiking:
        spike_count[n] = spike_count.get(n, 0) + 1

    def fin(v: float) -> float:
        return v if math.isfinite(v) else -math.inf

    lists = [
        ("non-finite", sorted((ly for ly in layers if ly.nonfinite_steps),
                              key=lambda ly: order[ly.name])),
        ("spiking", sorted((ly for ly in layers if spike_count.get(ly.name) or fin(ly.peak) > 3),
                           key=lambda ly: (-spike_count.get(ly.name, 0), -fin(ly.peak)))),
        ("clipped", sorted((ly for ly in layers if ly.clipped_steps),
                           key=lambda ly: -ly.clipped_steps)),
        ("largest", sorted(layers, key=lambda ly: -fin(ly.max_norm))),
    ]
    chosen: list[str] = []
    cursors = [0] * len(lists)
    while len(chosen) < k and any(c < len(lst) for c, (_, lst) in zip(cursors, lists)):
        for i, (_, lst) in enumerate(lists):
            while cursors[i] < len(lst) and lst[cursors[i]].name in chosen:
                cursors[i] += 1
            if cursors[i] < len(lst) and len(chosen) < k:
                chosen.append(lst[cursors[i]].name)
                cursors[i] += 1
    chosen_set = set(chosen)
    for why, lst in lists:
        for ly in lst:
            if ly.name in chosen_set and why not in by_name[ly.name].why and (
                    why != "largest" or not by_name[ly.name].why):
                by_name[ly.name].why.append(why)
    return sorted(chosen, key=order.__getitem__)


def group_rows(heat: Heat, rows: int = HEAT_ROWS) -> tuple[list[str], np.ndarray]:
    """At most ``rows`` heatmap rows: consecutive tensors (model order) share one, whose
    cell is the group's largest value (NaN if any is non-finite, -1 if none recorded)."""
    n = len(heat.names)
    if n <= rows:
        return list(heat.names), heat.grid
    bounds = np.linspace(0, n, rows + 1).round().astype(int)
    labels, out = [], np.empty((rows, heat.grid.shape[1]))
    for i, (a, z) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        block = heat.grid[a:z]
        out[i] = np.where(np.isnan(block).any(0), math.nan, block.max(0))
        labels.append(f"{heat.names[a]} … {heat.names[z - 1]} ({z - a})")
    return labels, out
