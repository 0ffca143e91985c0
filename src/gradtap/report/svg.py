"""Tiny SVG plotting helpers for the HTML report: line charts (linear or log), bands, heatmaps
and histogram ridgelines. Pure Python and numpy; every string is escaped, nothing external.

Each chart is an ``<svg class="gt-plot">`` element. Data-bearing elements carry attributes a
browser test can read back: a line is a ``<path class="gt-line" data-series=NAME data-n=K>``
whose ``d`` holds its K points; the ``<svg>`` holds its value domain (``data-y0``,
``data-y1``, ``data-log``) and plot box (``data-top``, ``data-bottom``, ``data-left``,
``data-right``), so pixel positions can be mapped back to values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

import numpy as np

from gradtap._text import format_number
from gradtap.report.reduce import band_envelope, envelope

__all__ = [
    "PALETTE", "Band", "Line", "color_for", "heatmap", "line_chart", "ridgelines", "tick_labels",
    "viridis",
]

#: Categorical colours (Tableau 10), cycled with dash patterns beyond ten series.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
           "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#7f7f7f")
_DASHES = ("", "6 3", "2 2", "8 3 2 3")
#: Colour of non-finite (NaN/Inf) values in every chart.
NONFINITE = "#d7191c"
_VIRIDIS = ((68, 1, 84), (72, 40, 120), (62, 74, 137), (49, 104, 142), (38, 130, 142),
            (31, 158, 137), (53, 183, 121), (110, 206, 88), (181, 222, 43), (253, 231, 37))

FONT = "12px system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"


def color_for(i: int) -> tuple[str, str]:
    """``(colour, dash pattern)`` of the ``i``-th series."""
    return PALETTE[i % len(PALETTE)], _DASHES[(i // len(PALETTE)) % len(_DASHES)]


def viridis(t: float) -> str:
    """Hex colour of ``t`` in [0, 1] on the viridis map (interpolated between 10 stops)."""
    t = min(1.0, max(0.0, float(t))) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    f = t - i
    a, b = _VIRIDIS[i], _VIRIDIS[i + 1]
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b))


def _tick_label(v: float) -> str:
    """The shortest label that reads back as ``v`` exactly: plain digits from 0.01 to
    below 10^4 (``0.25``, ``1500``), ``mantissa e exponent`` outside (``1.5e-4``, ``2.5e4``).

    Example:
        >>> [_tick_label(v) for v in (1.5e-4, 2.5e-5, 7.5e-3, 0.25, 15000, 25000, 1e5)]
        ['1.5e-4', '2.5e-5', '7.5e-3', '0.25', '1.5e4', '2.5e4', '1e5']
    """
    v = float(v)
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else f"{v}"
    a = abs(v)
    for digits in range(16):
        text = f"{v:.{digits}e}"
        if float(text) == v:
            break
    mant, _, exp = text.partition("e")
    if a >= 1e4 or a < 1e-2:
        return f"{mant}e{int(exp)}"
    return np.format_float_positional(float(text), trim="-")


def tick_labels(values: Sequence[float]) -> list[str]:
    """Labels of tick values, no two alike: each value rounded to the fewest significant
    digits (at least 1) that keep every label distinct, then :func:`_tick_label`.

    Example:
        >>> tick_labels([1.04, 1.12, 1.31])
        ['1', '1.1', '1.3']
    """
    values = [float(v) for v in values]
    labels = [_tick_label(v) for v in values]
    for digits in range(1, 17):
        rounded = [float(f"{v:.{digits - 1}e}") if v else 0.0 for v in values]
        labels = [_tick_label(v) for v in rounded]
        if len(set(labels)) == len(set(values)):
            break
    return labels


# -- scales --------------------------------------------------------------------------------------


class _Scale:
    def __init__(self, lo: float, hi: float, a: float, b: float, log: bool) -> None:
        self.log = log
        if log:
            lo, hi = math.log10(lo), math.log10(hi)
        if hi <= lo:
            lo, hi = lo - 0.5, hi + 0.5
        self.lo, self.hi, self.a, self.b = lo, hi, a, b
        self.domain = (10**lo, 10**hi) if log else (lo, hi)

    def __call__(self, v: float) -> float:
        x = math.log10(v) if self.log else v
        return self.a + (x - self.lo) / (self.hi - self.lo) * (self.b - self.a)

    def ticks(self, n: int = 5) -> list[float]:
        if self.log:
            e0, e1 = math.floor(self.lo), math.ceil(self.hi)
            step = max(1, math.ceil((e1 - e0) / 7))
            # float("2e-5"), not 2 * 10.0**-5: the tick is the number its label reads
            out = [float(f"1e{e}") for e in range(e0, e1 + 1, step)]
            if e1 - e0 <= 2:
                out = sorted({float(f"{m}e{e}") for e in range(e0 - 1, e1 + 1) for m in (1, 2, 5)})
            return [t for t in out if self.lo - 1e-9 <= math.log10(t) <= self.hi + 1e-9]
        return _nice_ticks(self.lo, self.hi, n)


def _nice_ticks(lo: float, hi: float, n: int, integer: bool = False) -> list[float]:
    span = hi - lo
    if not span > 0:
        return [lo]
    raw = span / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if integer:  # steps: never a tick between two of them
        step = max(1.0, step if step == int(step) else math.ceil(step))
    start = math.ceil(lo / step - 1e-9) * step
    out, v = [], start
    while v <= hi + step * 1e-9:
        out.append(round(v, 12) + 0.0)
        v += step
    return out


def _log_domain(values: np.ndarray) -> tuple[float, float]:
    pos = values[np.isfinite(values) & (values > 0)]
    if not len(pos):
        return 1e-3, 1.0
    lo, hi = float(pos.min()), float(pos.max())
    if hi / lo < 10:  # at least one decade, centred
        mid = math.sqrt(lo * hi)
        lo, hi = min(lo, mid / math.sqrt(10)), max(hi, mid * math.sqrt(10))
    return 10 ** (math.floor(math.log10(lo) * 4) / 4), 10 ** (math.ceil(math.log10(hi) * 4) / 4)


def _lin_domain(values: np.ndarray, include_zero: bool = False) -> tuple[float, float]:
    fin = values[np.isfinite(values)]
    if not len(fin):
        return 0.0, 1.0
    lo, hi = float(fin.min()), float(fin.max())
    if include_zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi == lo:
        pad = abs(hi) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


# -- line charts ---------------------------------------------------------------------------------


@dataclass
class Line:
    """One series: ``x`` [K] (steps) and ``y`` [K]; non-finite ``y`` is marked, not drawn."""

    name: str
    x: np.ndarray
    y: np.ndarray
    color: str | None = None
    dash: str = ""
    width: float = 1.6
    opacity: float = 1.0
    markers: bool = False


@dataclass
class Band:
    """A filled band between ``lo`` and ``hi`` over ``x``."""

    name: str
    x: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    color: str = "#4e79a7"
    opacity: float = 0.2


@dataclass
class _Frame:
    width: int
    height: int
    left: int
    right: int
    top: int
    bottom: int
    extra: list[str] = field(default_factory=list)


def line_chart(
    lines: Sequence[Line],
    *,
    plot_id: str,
    title: str = "",
    log_y: bool = False,
    x_label: str = "step",
    y_label: str = "",
    bands: Sequence[Band] = (),
    hlines: Sequence[tuple[float, str]] = (),
    events: Sequence[tuple[float, str]] = (),
    width: int = 960,
    height: int = 320,
    y_domain: tuple[float, float] | None = None,
) -> str:
    """Render lines (and bands) over steps as one ``<svg>``.

    Non-finite points are left out of the line (a gap) and drawn as red triangles along the
    top edge, so a NaN step is visible at a glance; on a log scale values ``<= 0`` are gaps.
    A series longer than the plot is wide in pixels keeps, per pixel column, its minimum,
    maximum and first non-finite point (:func:`gradtap.report.reduce.envelope`), and a band
    its column's lowest ``lo`` and highest ``hi``: a one-step spike stays visible.

    Args:
        lines: the series; colours default to the palette in order.
        plot_id: the ``data-plot`` id (also used to link the HTML legend).
        title: accessible title of the chart.
        log_y: log10 value axis.
        x_label, y_label: axis labels.
        bands: filled bands drawn under the lines.
        hlines: ``(value, label)`` dashed reference lines.
        events: ``(step, label)`` marked by a dashed vertical line (a spike the detector
            reported), the label as its tooltip.
        width, height: size in px (the SVG scales to its container).
        y_domain: fixed value range instead of the data's.
    """
    f = _Frame(width, height, left=64, right=16, top=14, bottom=40)
    columns = width - f.left - f.right  # one per pixel: min/max/first non-finite of each
    lines = [ln if len(ln.x) <= columns else Line(
        ln.name, *envelope(ln.x, ln.y, columns), color=ln.color, dash=ln.dash, width=ln.width,
        opacity=ln.opacity, markers=ln.markers) for ln in lines]
    bands = [b if len(b.x) <= columns else Band(
        b.name, *band_envelope(b.x, b.lo, b.hi, columns), color=b.color, opacity=b.opacity)
        for b in bands]
    xs = [ln.x for ln in lines] + [b.x for b in bands]
    allx = np.concatenate([np.asarray(x, dtype=float) for x in xs]) if xs else np.zeros(0)
    ally = np.concatenate([np.asarray(ln.y, dtype=float) for ln in lines]
                          + [np.asarray(b.lo, dtype=float) for b in bands]
                          + [np.asarray(b.hi, dtype=float) for b in bands]
                          + [np.array([v for v, _ in hlines], dtype=float)]) if (lines or bands) else np.zeros(0)
    x0, x1 = (float(allx.min()), float(allx.max())) if len(allx) else (0.0, 1.0)
    if x1 == x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    if y_domain is None:
        y_domain = _log_domain(ally) if log_y else _lin_domain(ally)
    sx = _Scale(x0, x1, f.left, width - f.right, log=False)
    sy = _Scale(*y_domain, height - f.bottom, f.top, log=log_y)
    parts = [_open_svg(f, plot_id, title, sy, log_y, "line")]
    parts += _axes(f, sx, sy, x_label, y_label)
    for i, b in enumerate(bands):
        parts.append(_band_path(b, sx, sy, log_y, f, i))
    for v, label in hlines:
        if not (log_y and v <= 0) and sy.lo <= (math.log10(v) if log_y else v) <= sy.hi:
            y = sy(v)
            parts.append(f'<line class="gt-ref" x1="{f.left}" x2="{width - f.right}" y1="{y:.1f}" '
                         f'y2="{y:.1f}" stroke="#888" stroke-dasharray="4 4"/>'
                         f'<text x="{width - f.right - 4}" y="{y - 4:.1f}" text-anchor="end" '
                         f'class="gt-reflabel">{escape(label)}</text>')
    for v, label in events:
        if x0 <= v <= x1:
            x = sx(v)
            parts.append(f'<line class="gt-event" x1="{x:.1f}" x2="{x:.1f}" y1="{f.top}" '
                         f'y2="{height - f.bottom}" stroke="#bc4c00" stroke-dasharray="2 3">'
                         f'<title>{escape(label)}</title></line>')
    bad_x: dict[float, list[str]] = {}
    for i, ln in enumerate(lines):
        color, dash = (ln.color, ln.dash) if ln.color else color_for(i)
        parts.append(_line_path(ln, sx, sy, log_y, color, dash, f, bad_x))
    for x, names in sorted(bad_x.items()):
        px = sx(x)
        label = escape(f"step {x:g}: non-finite in {', '.join(names[:6])}"
                       + (f" and {len(names) - 6} more" if len(names) > 6 else ""))
        parts.append(f'<path class="gt-nonfinite" d="M{px - 5:.1f},{f.top - 2} L{px + 5:.1f},'
                     f'{f.top - 2} L{px:.1f},{f.top + 7} Z" fill="{NONFINITE}">'
                     f'<title>{label}</title></path>')
    parts.append("</svg>")
    return "".join(parts)


def _open_svg(f: _Frame, plot_id: str, title: str, sy: _Scale | None, log: bool, kind: str) -> str:
    dom = ""
    if sy is not None:
        dom = (f' data-y0="{sy.domain[0]!r}" data-y1="{sy.domain[1]!r}" data-log="{int(log)}"')
    return (f'<svg class="gt-plot" data-plot="{escape(plot_id)}" data-kind="{kind}" '
            f'viewBox="0 0 {f.width} {f.height}" width="{f.width}" height="{f.height}" '
            f'preserveAspectRatio="xMinYMin meet" role="img" aria-label="{escape(title)}" '
            f'data-left="{f.left}" data-right="{f.width - f.right}" data-top="{f.top}" '
            f'data-bottom="{f.height - f.bottom}"{dom} xmlns="http://www.w3.org/2000/svg">'
            f"<title>{escape(title)}</title>")


def _axes(f: _Frame, sx: _Scale, sy: _Scale, x_label: str, y_label: str) -> list[str]:
    out = ['<g class="gt-axes">']
    bottom, right = f.height - f.bottom, f.width - f.right
    for t in sy.ticks():
        y = sy(t)
        out.append(f'<line x1="{f.left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" class="gt-grid"/>'
                   f'<text x="{f.left - 6}" y="{y + 4:.1f}" text-anchor="end">{_tick_label(t)}</text>')
    for t in _nice_ticks(sx.lo, sx.hi, max(2, (right - f.left) // 90), integer=True):
        if t < sx.lo - 1e-9 or t > sx.hi + 1e-9:
            continue
        x = sx(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" class="gt-tick"/>'
                   f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_tick_label(t)}</text>')
    out.append(f'<rect x="{f.left}" y="{f.top}" width="{right - f.left}" height="{bottom - f.top}" '
               'class="gt-box"/>')
    if x_label:
        out.append(f'<text x="{(f.left + right) / 2:.0f}" y="{f.height - 6}" text-anchor="middle" '
                   f'class="gt-axlabel">{escape(x_label)}</text>')
    if y_label:
        cy = (f.top + bottom) / 2
        out.append(f'<text x="14" y="{cy:.0f}" text-anchor="middle" class="gt-axlabel" '
                   f'transform="rotate(-90 14 {cy:.0f})">{escape(y_label)}</text>')
    out.append("</g>")
    return out


def _ok(v: float, log: bool) -> bool:
    return math.isfinite(v) and (v > 0 or not log)


def _line_path(ln: Line, sx: _Scale, sy: _Scale, log: bool, color: str, dash: str, f: _Frame,
               bad_x: dict[float, list[str]]) -> str:
    cmds: list[str] = []
    pen_up = True
    n = 0
    lo_px, hi_px = f.top, f.height - f.bottom
    for x, y in zip(np.asarray(ln.x, dtype=float).tolist(), np.asarray(ln.y, dtype=float).tolist()):
        if not math.isfinite(y):
            bad_x.setdefault(x, []).append(ln.name)
            pen_up = True
            continue
        if not _ok(y, log):
            pen_up = True
            continue
        py = min(max(sy(y), lo_px), hi_px)
        cmds.append(f"{'M' if pen_up else 'L'}{sx(x):.2f},{py:.2f}")
        pen_up = False
        n += 1
    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
    style = f' stroke-opacity="{ln.opacity}"' if ln.opacity != 1 else ""
    path = (f'<path class="gt-line" data-series="{escape(ln.name)}" data-n="{n}" '
            f'd="{" ".join(cmds)}" fill="none" stroke="{color}" stroke-width="{ln.width}"'
            f'{dash_attr}{style} stroke-linejoin="round"><title>{escape(ln.name)}</title></path>')
    if ln.markers and n:
        dots = "".join(f'<circle cx="{c[1:].split(",")[0]}" cy="{c.split(",")[1]}" r="1.6"/>'
                       for c in cmds)
        path += f'<g class="gt-dots" fill="{color}" fill-opacity="{ln.opacity}">{dots}</g>'
    return path


def _band_path(b: Band, sx: _Scale, sy: _Scale, log: bool, f: _Frame, i: int) -> str:
    x = np.asarray(b.x, dtype=float)
    lo = np.asarray(b.lo, dtype=float)
    hi = np.asarray(b.hi, dtype=float)
    ok = np.isfinite(lo) & np.isfinite(hi)
    if log:
        floor = sy.domain[0]
        lo = np.where(lo > floor, lo, floor)
        ok &= hi > 0
    segs, cur = [], []
    for j in range(len(x)):
        if ok[j]:
            cur.append(j)
        elif cur:
            segs.append(cur)
            cur = []
    if cur:
        segs.append(cur)
    top, bottom = f.top, f.height - f.bottom
    d = []
    for seg in segs:
        upper = [f"{sx(x[j]):.2f},{min(max(sy(hi[j]), top), bottom):.2f}" for j in seg]
        lower = [f"{sx(x[j]):.2f},{min(max(sy(lo[j]), top), bottom):.2f}" for j in reversed(seg)]
        d.append("M" + " L".join(upper + lower) + " Z")
    return (f'<path class="gt-band" data-series="{escape(b.name)}" data-n="{int(ok.sum())}" '
            f'd="{" ".join(d)}" fill="{b.color}" fill-opacity="{b.opacity}" stroke="none">'
            f"<title>{escape(b.name)}</title></path>")


# -- heatmaps ------------------------------------------------------------------------------------


def heatmap(
    rows: Sequence[str],
    cols: Sequence[float],
    values: np.ndarray,
    *,
    plot_id: str,
    title: str = "",
    log: bool = True,
    value_label: str = "value",
    col_label: str = "step",
    col_edges: Sequence[tuple[float, float]] | None = None,
    width: int = 960,
    row_height: int = 18,
) -> str:
    """Render ``values`` [rows, cols] as coloured cells (viridis, log10 by default).

    NaN/Inf cells are red, cells ``<= 0`` on a log scale light grey; each cell has a
    ``<title>`` tooltip ``row, step: value``. A colour bar shows the value range.

    Args:
        rows: row labels (escaped).
        cols: the step of each column.
        values: the cell values.
        plot_id: the ``data-plot`` id.
        title: accessible title.
        log: colour by log10 of the value.
        value_label: what a value is, for the colour bar and tooltips.
        col_label: the x axis label.
        col_edges: ``(first, last)`` step of each column when a column covers several steps.
        width: total width in px.
        row_height: height of one row in px.
    """
    values = np.asarray(values, dtype=float).reshape(len(rows), len(cols))
    label_w = min(280, 12 + 7 * max((len(r) for r in rows), default=4))
    f = _Frame(width, 0, left=label_w, right=16, top=8, bottom=74)
    f.height = f.top + row_height * len(rows) + f.bottom
    fin = values[np.isfinite(values) & ((values > 0) if log else True)]
    if len(fin):
        lo, hi = float(fin.min()), float(fin.max())
    else:
        lo, hi = (1e-3, 1.0) if log else (0.0, 1.0)
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    if hi <= lo:
        hi = lo + 1.0
    parts = [_open_svg(f, plot_id, title, None, log, "heatmap")]
    parts[0] = parts[0].replace('data-kind="heatmap"',
                                f'data-kind="heatmap" data-rows="{len(rows)}" data-cols="{len(cols)}"')
    plot_w = width - f.left - f.right
    cw = plot_w / max(len(cols), 1)
    for r, name in enumerate(rows):
        y = f.top + r * row_height
        short = name if len(name) * 7 + 12 <= label_w else name[: (label_w - 24) // 7] + "…"
        parts.append(f'<text x="{f.left - 6}" y="{y + row_height / 2 + 4:.1f}" text-anchor="end" '
                     f'class="gt-rowlabel"><title>{escape(name)}</title>{escape(short)}</text>')
        parts.append(f'<g class="gt-row" data-series="{escape(name)}">')
        for c, step in enumerate(cols):
            v = float(values[r, c])
            if not math.isfinite(v):
                color, cls = NONFINITE, ' class="gt-cell-nonfinite"'
            elif log and v <= 0:
                color, cls = "#e8e8e8", ""
            else:
                t = ((math.log10(v) if log else v) - lo) / (hi - lo)
                color, cls = viridis(t), ""
            where = (f"steps {col_edges[c][0]:g}–{col_edges[c][1]:g}" if col_edges
                     and col_edges[c][0] != col_edges[c][1] else f"step {step:g}")
            tip = escape(f"{name}, {where}: {value_label} {format_number(v, short=True)}")
            parts.append(f'<rect x="{f.left + c * cw:.2f}" y="{y}" width="{cw + 0.3:.2f}" '
                         f'height="{row_height - 1}" fill="{color}"{cls}><title>{tip}</title></rect>')
        parts.append("</g>")
    bottom = f.top + row_height * len(rows)
    for t in _nice_ticks(float(cols[0]) if len(cols) else 0.0,
                         float(cols[-1]) if len(cols) else 1.0, max(2, plot_w // 90),
                         integer=True):
        if not len(cols) or t < cols[0] or t > cols[-1]:
            continue
        c = int(np.searchsorted(np.asarray(cols, dtype=float), t))
        x = f.left + (c + 0.5) * cw
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" class="gt-tick"/>'
                     f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_tick_label(t)}</text>')
    parts.append(f'<text x="{f.left + plot_w / 2:.0f}" y="{bottom + 32}" text-anchor="middle" '
                 f'class="gt-axlabel">{escape(col_label)}</text>')
    parts.append(_colorbar(f.left, bottom + 44, min(320, plot_w), lo, hi, log, value_label))
    parts.append("</svg>")
    return "".join(parts)


def _colorbar(x: float, y: float, w: float, lo: float, hi: float, log: bool, label: str) -> str:
    n = 32
    cells = "".join(f'<rect x="{x + i * w / n:.1f}" y="{y}" width="{w / n + 0.3:.1f}" height="10" '
                    f'fill="{viridis(i / (n - 1))}"/>' for i in range(n))
    def show(v: float) -> str:
        return format_number(float(f"{10**v:.3g}") if log else v, short=True)
    return (f'<g class="gt-colorbar">{cells}'
            f'<text x="{x}" y="{y + 24}" text-anchor="start">{show(lo)}</text>'
            f'<text x="{x + w}" y="{y + 24}" text-anchor="end">{show(hi)}</text>'
            f'<text x="{x + w / 2}" y="{y + 24}" text-anchor="middle">{escape(label)}'
            f'{" (log scale)" if log else ""}</text>'
            f'<rect x="{x + w + 16}" y="{y}" width="10" height="10" fill="{NONFINITE}"/>'
            f'<text x="{x + w + 30}" y="{y + 9}">NaN/Inf</text></g>')


# -- histograms over time ------------------------------------------------------------------------


def ridgelines(
    edges: np.ndarray,
    counts: np.ndarray,
    steps: np.ndarray,
    *,
    plot_id: str,
    title: str = "",
    max_slices: int = 24,
    width: int = 460,
    height: int = 300,
    symlog: bool = True,
    zero_below: float = 0.0,
) -> str:
    """Render histograms over time as stacked ridgelines (first step at the top, last in front).

    ``edges`` [B+1] bin edges, ``counts`` [S, B], ``steps`` [S]. At most ``max_slices``
    evenly spaced steps are drawn. The x axis is the bin index (symlog bins are uneven in
    value, even on screen), cropped to the bins that ever hold a value, and labelled with edge
    values; ridge height is the square root of the count, scaled to the largest count of all
    drawn steps, so a spike of exact zeros does not flatten everything else.

    Args:
        edges, counts, steps: the histograms.
        plot_id: the ``data-plot`` id.
        title: accessible title.
        max_slices: how many steps to draw at most.
        width, height: size in px.
        symlog: the bins are symmetric-log (axis label only).
        zero_below: edges with a magnitude below this are labelled 0.
    """
    edges = np.asarray(edges, dtype=float)
    counts = np.asarray(counts, dtype=float).reshape(len(steps), -1)
    steps = np.asarray(steps)
    s, b = counts.shape
    pick = (np.unique(np.linspace(0, s - 1, min(s, max_slices)).round().astype(int))
            if s else np.zeros(0, dtype=int))
    used = np.flatnonzero(counts.sum(0) > 0) if s else np.zeros(0, dtype=int)
    j0, j1 = (max(int(used[0]) - 1, 0), min(int(used[-1]) + 2, b)) if len(used) else (0, b)
    nb = max(j1 - j0, 1)
    f = _Frame(width, height, left=58, right=14, top=10, bottom=40)
    plot_w = width - f.left - f.right
    plot_h = height - f.top - f.bottom
    n = max(len(pick), 1)
    gap = plot_h / (n + 3)
    ridge_h = 4 * gap
    peak = math.sqrt(counts[pick].max()) if len(pick) and counts[pick].max() > 0 else 1.0
    parts = [_open_svg(f, plot_id, title, None, False, "ridgelines")]
    parts[0] = parts[0].replace(
        'data-kind="ridgelines"',
        f'data-kind="ridgelines" data-slices="{len(pick)}" data-bins="{b}" data-shown-bins="{nb}"')
    parts.append('<g class="gt-axes">')
    bottom = height - f.bottom

    def bx(j: float) -> float:
        return f.left + (j - j0) / nb * plot_w

    where = np.unique(np.linspace(j0, j1, 6).round().astype(int))
    shown = [0.0 if abs(float(edges[j])) < zero_below else float(edges[j]) for j in where]
    for j, label in zip(where, tick_labels(shown), strict=True):
        parts.append(f'<line x1="{bx(j):.1f}" x2="{bx(j):.1f}" y1="{f.top}" y2="{bottom + 4}" '
                     f'class="gt-grid"/><text x="{bx(j):.1f}" y="{bottom + 16}" '
                     f'text-anchor="middle">{label}</text>')
    parts.append(f'<text x="{f.left + plot_w / 2:.0f}" y="{height - 6}" text-anchor="middle" '
                 f'class="gt-axlabel">value{" (symlog bins)" if symlog else ""}</text>')
    parts.append("</g>")
    for k, i in enumerate(pick):
        base = f.top + ridge_h + k * gap
        row = np.sqrt(counts[i, j0:j1])
        total = counts[i].sum()
        pts = " ".join(f"L{bx(j0 + j + 0.5):.1f},{base - row[j] / peak * ridge_h:.1f}"
                       for j in range(len(row)))
        d = f"M{bx(j0):.1f},{base:.1f} {pts} L{bx(j1):.1f},{base:.1f} Z"
        color = viridis(k / max(n - 1, 1))
        parts.append(f'<path class="gt-ridge" data-step="{int(steps[i])}" data-total="{int(total)}" '
                     f'd="{d}" fill="{color}" fill-opacity="0.6" stroke="#fff" stroke-width="0.8">'
                     f"<title>step {int(steps[i])}: {int(total):,} finite values</title></path>")
        if k in (0, n - 1) or (n > 4 and k == n // 2):
            parts.append(f'<text x="{f.left - 6}" y="{base + 3:.1f}" text-anchor="end" '
                         f'class="gt-ridgelabel">{int(steps[i])}</text>')
    parts.append(f'<text x="12" y="{f.top + plot_h / 2:.0f}" text-anchor="middle" class="gt-axlabel" '
                 f'transform="rotate(-90 12 {f.top + plot_h / 2:.0f})">step</text>')
    parts.append("</svg>")
    return "".join(parts)
