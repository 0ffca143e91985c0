"""Render a run (see :mod:`gradtap.report.data`) as one self-contained HTML file.

Inline CSS, inline SVG charts (:mod:`gradtap.report.svg`) and a few lines of inline script for
legend highlighting (:mod:`gradtap.report.assets`); no network access, no external assets.
This module assembles the page and holds the chart sections; the sections of cards and tables
are in :mod:`gradtap.report.tables`. Every name that comes from user code (module and
parameter names, metadata, messages) goes through :func:`html.escape`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from html import escape
from pathlib import Path

import numpy as np

from gradtap.report import health, svg, tables
from gradtap.report.assets import CSS, JS
from gradtap.report.data import ReportData, build_report_data
from gradtap.report.layers import group_rows
from gradtap.report.reduce import ewma_band
from gradtap.store import Run

__all__ = ["REPORT_NAME", "render_html", "write_report"]

#: File name of the report inside a run directory.
REPORT_NAME = "report.html"


def write_report(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
                 hist_names: Sequence[str] | None = None) -> Path:
    """Render the report of ``run_dir`` and write it to ``out`` (default ``run_dir/report.html``).

    Args:
        run_dir: a run directory written by a Monitor with ``store=``.
        out: the HTML file to write.
        hist_names: globs of tensors whose histograms to show (default: weight gradients).

    Returns:
        The path written.

    Raises:
        StoreError: no readable run store, or a corrupt side file.
        SelectionError: a ``hist_names`` glob matches nothing.
    """
    data = build_report_data(run_dir, hist_names=hist_names)
    target = Path(out) if out is not None else data.path / REPORT_NAME
    page = render_html(data)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, target)
    return target


def render_html(data: ReportData | Run | str | os.PathLike[str]) -> str:
    """Return the report page as a string (from :class:`ReportData`, a Run or a directory)."""
    if not isinstance(data, ReportData):
        data = build_report_data(data)
    sections = [
        ("overview", "Overview", tables.overview(data)),
        ("top", "Layers that matter", tables.top_table(data)),
        ("loss", "Loss", health.loss_section(data.health)),
        ("metrics", "Training", _metrics(data)),
        ("norms", "Gradient norms", _norms(data)),
        ("spikes", "Gradient spikes", tables.spikes(data)),
        ("gns", "Gradient noise scale", health.gns_section(data.health)),
        ("gain", "Gradient gain", health.gain_section(data.health)),
        ("rms", "RMS", health.rms_section(data.health)),
        ("experts", "Slices (experts)", health.experts_section(data.health)),
        ("heatmap", "Layers × steps", _heatmaps(data)),
        ("histograms", "Histograms", _histograms(data)),
        ("ewma", "EWMA bands", _ewma(data)),
        ("ratios", "Update / weight", _ratios(data)),
        ("anomalies", "Anomalies", tables.anomalies(data)),
        ("layers", "Layer summary", tables.layer_table(data)),
        ("meta", "Run metadata", tables.metadata(data)),
    ]
    sections = [s for s in sections if s[2]]
    nav = "".join(f'<a href="#{sid}">{escape(title)}</a>' for sid, title, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{escape(title)}</h2>{html}</section>'
                   for sid, title, html in sections)
    name = data.path.resolve().name or str(data.path)
    status = str(data.meta.get("status"))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
        f"<title>gradtap report: {escape(name)}</title><style>{CSS}</style></head><body>"
        f'<header><div class="brand">gradtap</div><h1>{escape(name)}</h1>'
        f'<span class="status status-{escape(status)}">{escape(status)}</span>'
        f'<div class="path">{escape(str(data.path.resolve()))}</div>'
        f"<nav>{nav}</nav></header><main>{body}</main>"
        f"<footer>Written by gradtap {escape(str(data.meta.get('gradtap_version', '')))} "
        "from the run store; self-contained, no network access.</footer>"
        f"<script>{JS}</script></body></html>\n"
    )


# -- chart helpers ---------------------------------------------------------------------------


def _legend(plot_id: str, names: Sequence[str], colors: Sequence[tuple[str, str]] | None = None) -> str:
    items = []
    for i, name in enumerate(names):
        color, dash = colors[i] if colors else svg.color_for(i)
        style = f"background:{color}" if not dash else (
            f"background:repeating-linear-gradient(90deg,{color} 0 5px,transparent 5px 8px)")
        items.append(f'<li data-series="{escape(name)}"><span class="sw" style="{style}"></span>'
                     f"{escape(name)}</li>")
    return f'<ul class="legend" data-for="{escape(plot_id)}">{"".join(items)}</ul>'


def _figure(chart: str, legend: str = "", caption: str = "") -> str:
    cap = f"<figcaption>{caption}</figcaption>" if caption else ""
    return f'<figure class="chart">{chart}{legend}{cap}</figure>'


def _empty(message: str) -> str:
    return f'<p class="empty">{escape(message)}</p>'


def _band_domain(*arrays: np.ndarray) -> tuple[float, float]:
    both = np.concatenate([a[np.isfinite(a)] for a in arrays])
    hi = float(both.max()) if len(both) else 1.0
    return 0.0, (hi * 1.05 if hi > 0 else 1.0)


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


# -- chart sections --------------------------------------------------------------------------


def _metrics(data: ReportData) -> str:
    if not data.metrics:
        return ""
    out = []
    for i, (name, (st, vals)) in enumerate(data.metrics.items()):
        x, y = st.astype(float), vals
        pos = np.isfinite(y) & (y > 0)
        log = bool(pos.all() and len(y) and y[pos].max() / y[pos].min() > 20)
        pid = f"metric-{i}"
        chart = svg.line_chart([svg.Line(name, x, y)], plot_id=pid, title=name, log_y=log,
                               y_label=_short(name) + (" (log)" if log else ""), width=460,
                               height=220)
        out.append(_figure(chart, caption=f"{escape(name)} per step (from metrics.json)."))
    return '<div class="grid2">' + "".join(out) + "</div>"


def _norms(data: ReportData) -> str:
    out = []
    for kind, label in (("param_grad", "parameter gradients ‖∂L/∂θ‖"),
                        ("grad_output", "output gradients ‖∂L/∂output‖")):
        series = data.norms.get(kind)
        if not series:
            continue
        names = list(series)
        lines = [svg.Line(name, series[name][0].astype(float), series[name][1]) for name in names]
        pid = f"norms-{kind}"
        spikes = [(float(a["step"]), f"spike at step {a['step']} in {a['module_name']!r} "
                   f"({a['where']})") for a in data.anomalies if a.get("kind") == "spike"]
        marks = []
        if spikes:
            marks.append("the spikes the detector reported")
        if kind == "param_grad" and (data.spikes or data.clipped):
            marks.append("the steps Run.spikes() flags (with the first layer to spike) "
                         "and those clipped (by a spike rule or the script's own clip)")
            spikes += [(float(e["step"]), f"step {e['step']}: {e['name']} spiked first "
                        f"(score {e['z']:.1f}; {e['count']} tensor(s) spiking)")
                       for e in tables.largest_spikes(data)]
            spikes += [(float(step), f"step {step}: clipped (smallest factor "
                        f"{factor:.3g})")
                       for step, factor in list(data.clipped.items())[:tables.MAX_EVENTS]]
        chart = svg.line_chart(lines, plot_id=pid, title=f"L2 norm of {label} per step",
                               log_y=True, y_label="L2 norm (log)", events=spikes)
        out.append(f"<h3>{escape(label)}</h3>" + _figure(
            chart, _legend(pid, names), _which(data, kind, len(names)) +
            "L2 norm per step, log scale. Hover a name to highlight its line; red triangles "
            "mark steps with NaN/Inf" + (", dashed orange lines " + "; ".join(marks) + "."
                                         if marks else ".")))
    return "".join(out) or _empty("No gradient norms were recorded (the Monitor's stats "
                                  "did not include 'norm').")


def _which(data: ReportData, kind: str, shown: int) -> str:
    """The caption's first words when a chart shows only the layers that matter."""
    total = data.tensors.get(kind, shown)
    if total <= shown:
        return ""
    return (f"The {shown} of {total} tensors that matter most (non-finite, spiking, most "
            "clipped, largest: see the table of the layers that matter); find any other in the "
            "layer table's search. ")


def _heatmaps(data: ReportData) -> str:
    out = []
    for kind, label in (("param_grad", "parameter gradients"), ("grad_output", "output gradients")):
        heat = data.heat.get(kind)
        if heat is None or not heat.names or not heat.grid.shape[1]:
            continue
        rows, grid = group_rows(heat)
        edges = heat.edges
        cols = [e[0] for e in edges]
        wide = any(a != b for a, b in edges)
        grouped = len(rows) < len(heat.names)
        chart = svg.heatmap(rows, cols, grid, plot_id=f"heatmap-{kind}",
                            title=f"Gradient norm of {label}, layers by steps",
                            value_label="L2 norm", col_edges=edges if wide else None)
        out.append(f"<h3>{escape(label)}</h3>" + _figure(
            chart, caption="Colour is log10 of the L2 norm; red cells hold NaN/Inf; grey cells "
                           "were not recorded (or are exactly zero)."
                           + (" Columns cover several steps (the max is shown)." if wide else "")
                           + (f" Rows cover several of the {len(heat.names)} tensors, "
                              "consecutive in model order (the max is shown)." if grouped else "")))
    return "".join(out)


def _histograms(data: ReportData) -> str:
    if not data.histograms:
        return _empty("No histograms: gt.Monitor(..., hist_bins=N) and the callbacks' "
                      "hist_bins=N record them (gradtap watch records none).")
    cells = []
    edges0 = np.asarray(next(iter(data.histograms.values()))[0], dtype=float)
    widths = np.diff(edges0)
    symlog = bool(len(widths) > 2 and widths.max() / max(widths.min(), 1e-300) > 10)
    pos = edges0[edges0 > 0]
    linthresh = float(pos.min()) * 0.999 if symlog and len(pos) else 0.0
    for i, (name, h) in enumerate(data.histograms.items()):
        edges, counts = h
        chart = svg.ridgelines(edges, counts, h.steps, plot_id=f"hist-{i}",
                               title=f"Histogram of {name} over steps", symlog=symlog,
                               zero_below=linthresh)
        cells.append(f'<figure class="chart small"><figcaption class="title">'
                     f"<code>{escape(name)}</code></figcaption>{chart}</figure>")
    kind = "parameter gradients" if data.hist_kind == "param_grad" else data.hist_kind
    return (f'<p class="muted">Distribution of the {escape(kind)} over training, one ridge per '
            "sampled step (top: first, bottom: last, in front). Bins are symmetric-log, so "
            "small and large values share the axis; NaN/Inf are not binned (see Anomalies). "
            "Choose layers with <code>gradtap report RUN --hist GLOB</code>.</p>"
            f'<div class="grid2">{"".join(cells)}</div>')


def _ewma(data: ReportData) -> str:
    series = data.norms.get("param_grad")
    if not series:
        return ""
    beta_run = (data.meta.get("config") or {}).get("ewma")
    n = max(len(data.steps), 1)
    beta = float(beta_run) if isinstance(beta_run, (int, float)) else 0.9
    beta = max(0.5, min(beta, 1 - 10 / n)) if n > 20 else min(beta, 0.5)
    cells = []
    for i, (name, (st, vals)) in enumerate(series.items()):
        m, s = ewma_band(vals, beta)
        x = st.astype(float)
        color, _ = svg.color_for(i)
        chart = svg.line_chart(
            [svg.Line(f"{name} (per step)", x, vals, color="#9aa4b1", width=0.8, opacity=0.8),
             svg.Line(f"{name} (EWMA mean)", x, m, color=color, width=2.0)],
            bands=[svg.Band(f"{name} (EWMA mean ± std)", x, np.maximum(m - s, 0.0), m + s,
                            color=color, opacity=0.22)],
            y_domain=_band_domain(vals, m + s),
            plot_id=f"ewma-{i}", title=f"EWMA of the gradient norm of {name}",
            y_label="L2 norm", width=460, height=210)
        cells.append(f'<figure class="chart small"><figcaption class="title">'
                     f"<code>{escape(name)}</code></figcaption>{chart}</figure>")
    note = (f"EWMA factor beta = {beta:g}"
            + (f" (the run's ewma={beta_run:g}, shortened to fit {n} steps)"
               if isinstance(beta_run, (int, float)) and abs(beta - beta_run) > 1e-12 else "")
            + ", the Monitor's formula, over each step's gradient norm (grey). The band is ±1 EWMA "
              "standard deviation: wide bands mean noisy gradients.")
    html = f'<p class="muted">{escape(note)}</p><div class="grid2">{"".join(cells)}</div>'
    return html + tables.ewma_state(data)


def _ratios(data: ReportData) -> str:
    if not data.ratios:
        return _empty("No update ratios: add kinds=('param_grad', 'update') to the Monitor.")
    names = list(data.ratios)
    lines = [svg.Line(name, data.ratios[name][0].astype(float), data.ratios[name][1])
             for name in names]
    chart = svg.line_chart(lines, plot_id="ratios", title="Update-to-weight ratio per step",
                           log_y=True, y_label="‖Δθ‖ / ‖θ‖ (log)", hlines=[(1e-3, "1e-3")])
    return _figure(chart, _legend("ratios", names), _which(data, "param_grad", len(names)) +
                   "Norm of each parameter's change in one step divided by its norm, log scale. "
                   "Around 1e-3 is a common rule of thumb; far above, the layer moves too fast; "
                   "far below, it barely learns. Gaps are skipped steps (zero update).")
