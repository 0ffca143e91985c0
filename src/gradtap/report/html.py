"""Render a run (see :mod:`gradtap.report.data`) as one self-contained HTML file.

Inline CSS, inline SVG charts (:mod:`gradtap.report.svg`) and a few lines of inline script for
legend highlighting; no network access, no external assets. Every name that comes from user
code (module and parameter names, metadata, messages) goes through :func:`html.escape`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradtap._tensorops import ewma_init, ewma_update_
from gradtap._text import format_number
from gradtap.report import svg
from gradtap.report.data import ReportData, build_report_data
from gradtap.store import Run

__all__ = ["REPORT_NAME", "render_html", "write_report"]

#: File name of the report inside a run directory.
REPORT_NAME = "report.html"
_MAX_POINTS = 800  # line charts bucket longer runs
_MAX_COLS = 240  # heatmap columns
_MORE = ' class="more"'


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
        ("overview", "Overview", _overview(data)),
        ("metrics", "Training", _metrics(data)),
        ("norms", "Gradient norms", _norms(data)),
        ("heatmap", "Layers × steps", _heatmaps(data)),
        ("histograms", "Histograms", _histograms(data)),
        ("ewma", "EWMA bands", _ewma(data)),
        ("ratios", "Update / weight", _ratios(data)),
        ("anomalies", "Anomalies", _anomalies(data)),
        ("layers", "Layer summary", _layer_table(data)),
        ("meta", "Run metadata", _metadata(data)),
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
        f"<title>gradtap report: {escape(name)}</title><style>{_CSS}</style></head><body>"
        f'<header><div class="brand">gradtap</div><h1>{escape(name)}</h1>'
        f'<span class="status status-{escape(status)}">{escape(status)}</span>'
        f'<div class="path">{escape(str(data.path.resolve()))}</div>'
        f"<nav>{nav}</nav></header><main>{body}</main>"
        f"<footer>Written by gradtap {escape(str(data.meta.get('gradtap_version', '')))} "
        "from the run store; self-contained, no network access.</footer>"
        f"<script>{_JS}</script></body></html>\n"
    )


# -- helpers ---------------------------------------------------------------------------------


def _bucket(x: np.ndarray, y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``n`` points: each bucket's max, NaN when any value in it is non-finite."""
    if len(x) <= n:
        return x, y
    edges = np.linspace(0, len(x), n + 1).astype(int)
    xs, ys = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        seg = y[a:b]
        xs.append(x[a])
        ys.append(math.nan if not np.isfinite(seg).all() else float(seg.max()))
    return np.asarray(xs), np.asarray(ys)


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


def _ewma_band(values: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """The EWMA mean and std of a series (the Monitor's formula), skipping non-finite values.

    Before the first finite value both are NaN; a non-finite value leaves the EWMA as it was.
    """
    m = np.full(len(values), math.nan)
    s = np.full(len(values), math.nan)
    state: tuple[torch.Tensor, torch.Tensor] | None = None
    for i, g in enumerate(values.tolist()):
        if math.isfinite(g):
            value = torch.tensor(g, dtype=torch.float64)
            if state is None:
                state = ewma_init(value)
            else:
                ewma_update_(*state, value, beta)
        if state is not None:
            m[i], s[i] = state[0].item(), math.sqrt(state[1].item())
    return m, s


def _first_line(message: Any) -> str:
    return str(message or "").strip().split("\n", 1)[0]


def _message(message: Any) -> str:
    """The first line of a (detector) message, the rest folded away as preformatted text."""
    text = str(message or "").strip()
    first, _, rest = text.partition("\n")
    if not rest.strip():
        return escape(first)
    return (f"{escape(first)}<details><summary>details</summary><pre>{escape(rest)}</pre>"
            "</details>")


def _band_domain(*arrays: np.ndarray) -> tuple[float, float]:
    both = np.concatenate([a[np.isfinite(a)] for a in arrays])
    hi = float(both.max()) if len(both) else 1.0
    return 0.0, (hi * 1.05 if hi > 0 else 1.0)


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _shape(shape: Any) -> str:
    if isinstance(shape, list):
        return "×".join(str(s) for s in shape) or "scalar"
    return "" if shape is None else str(shape)


def _kv_table(rows: Sequence[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{escape(str(k))}</th><td>{_value(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _value(v: Any) -> str:
    if isinstance(v, float):
        return escape(format_number(v, short=True))
    if isinstance(v, (dict, list)):
        return f"<code>{escape(json.dumps(v, default=str))}</code>"
    return escape("—" if v is None else str(v))


# -- sections --------------------------------------------------------------------------------


def _ending(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """Why a failed run ended, as overview cards: the exception, the exit code or signal."""
    cards = []
    if meta.get("error"):
        cards.append(("error", str(meta["error"])))
    code = meta.get("exit_code")
    if isinstance(code, int) and code != 0:
        cards.append(("exit code", f"{code}" + (f" (signal {code - 128})" if code > 128 else "")))
    return cards


def _overview(data: ReportData) -> str:
    meta = data.meta
    model = meta.get("model") or {}
    steps = data.steps
    cards = [("status", str(meta.get("status"))),
             *_ending(meta),
             ("steps stored", f"{len(steps)}" + (f" ({steps[0]}–{steps[-1]})" if steps else "")),
             ("model", f"{model.get('class', '?')}"),
             ("parameters", f"{model.get('num_parameters', 0):,}" if isinstance(
                 model.get("num_parameters"), int) else "?")]
    for k, v in data.summary.items():
        cards.append((k, f"{v:.1%}" if "accuracy" in k and math.isfinite(v)
                      else format_number(v, short=True)))
    loss = data.metrics.get("loss")
    if loss is not None and len(loss[1]):
        fin = loss[1][np.isfinite(loss[1])]
        if len(fin):
            cards.append(("final loss", format_number(float(fin[-1]), short=True)))
    n_anom = len(data.anomalies) + (0 if data.anomalies else len(data.derived_anomalies))
    cards.append(("anomalies", str(n_anom)))
    html = '<div class="cards">' + "".join(
        f'<div class="card"><div class="k">{escape(k)}</div><div class="v">{escape(v)}</div></div>'
        for k, v in cards) + "</div>"
    first = _first_anomaly(data)
    if first:
        html += f'<div class="callout bad">{first}</div>'
    for w in data.warnings:
        html += f'<div class="callout warn">{escape(w)}</div>'
    when = f"{meta.get('start_time', '?')} → {meta.get('end_time', '…')}"
    html += f'<p class="muted">Run time: {escape(str(when))}</p>'
    return html


def _first_anomaly(data: ReportData) -> str:
    if data.anomalies:
        a = min(data.anomalies, key=lambda a: (a.get("step") is None, a.get("step") or 0))
        kind = str(a.get("kind") or "anomaly")
        where = a.get("where")
        kind = {"nan": "NaN", "inf": "Inf"}.get(kind, kind)
        return (f"<b>First anomaly:</b> {escape(kind)}"
                f" at step {escape(str(a.get('step')))} in <code>{escape(str(a.get('module_name')))}"
                f"</code>" + (f" ({escape(str(where))})" if where else "")
                + (f": {escape(_first_line(a.get('message')))}" if a.get("message") else ""))
    if data.derived_anomalies:
        a = data.derived_anomalies[0]
        return (f"<b>Non-finite values</b> first at step {a['step']} in "
                f"<code>{escape(a['name'])}</code> ({escape(a['kind'])}); no detector output "
                "was stored with this run, so this comes from the statistics.")
    return ""


def _metrics(data: ReportData) -> str:
    if not data.metrics:
        return ""
    out = []
    for i, (name, (st, vals)) in enumerate(data.metrics.items()):
        x, y = _bucket(st.astype(float), vals, _MAX_POINTS)
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
        lines = []
        for name in names:
            x, y = _bucket(series[name][0].astype(float), series[name][1], _MAX_POINTS)
            lines.append(svg.Line(name, x, y))
        pid = f"norms-{kind}"
        spikes = [(float(a["step"]), f"spike at step {a['step']} in {a['module_name']!r} "
                   f"({a['where']})") for a in data.anomalies if a.get("kind") == "spike"]
        chart = svg.line_chart(lines, plot_id=pid, title=f"L2 norm of {label} per step",
                               log_y=True, y_label="L2 norm (log)", events=spikes)
        out.append(f"<h3>{escape(label)}</h3>" + _figure(
            chart, _legend(pid, names),
            "L2 norm per step, log scale. Hover a name to highlight its line; red triangles "
            "mark steps with NaN/Inf" + (", dashed orange lines the spikes the detector "
                                         "reported." if spikes else ".")))
    return "".join(out) or _empty("No gradient norms were recorded (the Monitor's stats "
                                  "did not include 'norm').")


def _heatmaps(data: ReportData) -> str:
    out = []
    for kind, label in (("param_grad", "parameter gradients"), ("grad_output", "output gradients")):
        series = data.norms.get(kind)
        if not series:
            continue
        names = list(series)
        steps = np.asarray(sorted({int(s) for st, _ in series.values() for s in st}))
        if not len(steps):
            continue
        col = np.searchsorted(steps, steps)
        grid = np.full((len(names), len(steps)), -1.0)  # -1: not recorded (grey)
        for r, name in enumerate(names):
            st, vals = series[name]
            grid[r, np.searchsorted(steps, st)] = vals
        edges = None
        cols = steps.astype(float)
        if len(steps) > _MAX_COLS:
            b = np.linspace(0, len(steps), _MAX_COLS + 1).astype(int)
            new = np.empty((len(names), _MAX_COLS))
            for c, (a, z) in enumerate(zip(b[:-1], b[1:])):
                block = grid[:, a:z]
                new[:, c] = np.where(np.isfinite(block).all(1), block.max(1), math.nan)
            edges = [(float(steps[a]), float(steps[z - 1])) for a, z in zip(b[:-1], b[1:])]
            cols = np.array([e[0] for e in edges])
            grid = new
        del col
        chart = svg.heatmap(names, cols.tolist(), grid, plot_id=f"heatmap-{kind}",
                            title=f"Gradient norm of {label}, layers by steps",
                            value_label="L2 norm", col_edges=edges)
        out.append(f"<h3>{escape(label)}</h3>" + _figure(
            chart, caption="Colour is log10 of the L2 norm; red cells hold NaN/Inf; grey cells "
                           "were not recorded (or are exactly zero)."
                           + (" Columns cover several steps (the max is shown)." if edges else "")))
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
        m, s = _ewma_band(vals, beta)
        x = st.astype(float)
        xb, vb = _bucket(x, vals, _MAX_POINTS)
        idx = np.linspace(0, len(x) - 1, min(len(x), _MAX_POINTS)).round().astype(int) if len(x) else []
        color, _ = svg.color_for(i)
        chart = svg.line_chart(
            [svg.Line(f"{name} (per step)", xb, vb, color="#9aa4b1", width=0.8, opacity=0.8),
             svg.Line(f"{name} (EWMA mean)", x[idx], m[idx], color=color, width=2.0)],
            bands=[svg.Band(f"{name} (EWMA mean ± std)", x[idx],
                            np.maximum(m[idx] - s[idx], 0.0), m[idx] + s[idx],
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
    if data.ewma:
        rows = []
        for name, e in data.ewma.items():
            numel = e.get("numel") or 0
            rms_std = math.sqrt(e["var_mean"]) if isinstance(e.get("var_mean"), float) and e[
                "var_mean"] >= 0 else math.nan
            snr = (e["mean_norm"] ** 2 / (numel * e["var_mean"])
                   if numel and e.get("var_mean") and math.isfinite(e["var_mean"]) else math.nan)
            rows.append(f"<tr><td><code>{escape(name)}</code></td><td>{escape(_shape(e.get('shape')))}"
                        f"</td><td>{e.get('updates')}</td><td>{_value(e.get('mean_norm'))}</td>"
                        f"<td>{_value(rms_std)}</td><td>{_value(snr)}</td></tr>")
        poisoned = len([e for e in data.ewma.values()
                        if not (isinstance(e.get("mean_norm"), float)
                                and math.isfinite(e["mean_norm"]))])
        if poisoned:
            html += (f'<div class="callout warn">The Monitor\'s EWMA state is NaN for {poisoned} of '
                     f"{len(data.ewma)} parameters: a non-finite gradient entered it (see "
                     "Anomalies) and an EWMA keeps a NaN forever. The bands above are recomputed "
                     "from the stored per-step norms and skip non-finite steps.</div>")
        html += ("<h3>Elementwise EWMA state at the end of the run</h3>"
                 '<p class="muted">From the Monitor (<code>ewma=</code>): the norm of the EWMA mean '
                 "of each gradient, the RMS of its elementwise EWMA std, and their ratio "
                 "‖m‖²/(n·mean v) (a signal-to-noise ratio; below 1 the gradient is mostly noise). "
                 "NaN means a non-finite gradient entered the EWMA.</p>"
                 '<table class="data"><thead><tr><th>parameter</th><th>shape</th><th>updates</th>'
                 "<th>‖EWMA mean‖</th><th>RMS EWMA std</th><th>SNR</th></tr></thead>"
                 f"<tbody>{''.join(rows)}</tbody></table>")
    return html


def _ratios(data: ReportData) -> str:
    if not data.ratios:
        return _empty("No update ratios: add kinds=('param_grad', 'update') to the Monitor.")
    names = list(data.ratios)
    lines = []
    for name in names:
        x, y = _bucket(data.ratios[name][0].astype(float), data.ratios[name][1], _MAX_POINTS)
        lines.append(svg.Line(name, x, y))
    chart = svg.line_chart(lines, plot_id="ratios", title="Update-to-weight ratio per step",
                           log_y=True, y_label="‖Δθ‖ / ‖θ‖ (log)", hlines=[(1e-3, "1e-3")])
    return _figure(chart, _legend("ratios", names),
                   "Norm of each parameter's change in one step divided by its norm, log scale. "
                   "Around 1e-3 is a common rule of thumb; far above, the layer moves too fast; "
                   "far below, it barely learns. Gaps are skipped steps (zero update).")


def _anomalies(data: ReportData) -> str:
    html = ""
    if data.anomalies:
        rows = "".join(
            f"<tr><td>{escape(str(a.get('step')))}</td><td><code>{escape(str(a.get('module_name')))}"
            f"</code></td><td>{escape(str(a.get('kind')))}</td><td>{escape(str(a.get('where')))}</td>"
            f"<td>{_message(a.get('message'))}</td></tr>" for a in data.anomalies)
        src = f" (source: {escape(data.anomaly_source)})" if data.anomaly_source else ""
        html += (f"<h3>Recorded anomalies{src}</h3>"
                 '<table class="data anomalies" id="anomaly-table"><thead><tr><th>step</th>'
                 "<th>module</th><th>kind</th><th>where</th><th>message</th></tr></thead>"
                 f"<tbody>{rows}</tbody></table>")
    elif data.anomaly_source is not None:
        html += f'<p class="ok">The detector ({escape(data.anomaly_source)}) recorded no anomaly.</p>'
    else:
        html += ('<p class="muted">No anomalies.json in the run directory (it is written by '
                 "<code>gradtap demo</code>, or by <code>gradtap.report.write_anomalies(run_dir, "
                 "det.anomalies)</code>).</p>")
    if data.derived_anomalies:
        rows = "".join(
            f"<tr{_MORE if i >= 8 else ''}><td>{a['step']}</td><td><code>"
            f"{escape(a['name'])}</code></td><td>{escape(a['kind'])}</td><td>{a['steps']}</td>"
            f"<td>{a['last_step']}</td><td>{a['max_count']:,}</td></tr>"
            for i, a in enumerate(data.derived_anomalies))
        html += ("<h3>Non-finite values in the statistics</h3>"
                 '<p class="muted">From the stored <code>nonfinite</code> counts of every '
                 "tensor that ever held NaN/Inf: by first step; within a step, the block "
                 "holding the origin the detector named first, then output gradients before "
                 "parameter gradients, in model order.</p>"
                 '<table class="data" id="nonfinite-table"><thead><tr><th>first step</th>'
                 "<th>tensor</th><th>kind</th><th>steps affected</th><th>last step</th>"
                 f"<th>max NaN/Inf count</th></tr></thead><tbody>{rows}</tbody></table>")
        if len(data.derived_anomalies) > 8:
            html += (f'<p><button type="button" class="more-toggle">show all '
                     f"{len(data.derived_anomalies)} rows</button></p>")
    elif data.nonfinite:
        html += '<p class="ok">No NaN or Inf in any recorded gradient.</p>'
    return html


def _layer_table(data: ReportData) -> str:
    if not data.layers:
        return ""
    rows = []
    for ly in data.layers:
        bad = ' class="bad"' if ly.nonfinite_steps else ""
        rows.append(
            f"<tr{bad}><td><code>{escape(ly.name)}</code></td><td>{escape(ly.kind)}</td>"
            f"<td>{escape(_shape(ly.shape))}</td><td>{ly.steps}</td>"
            f"<td>{_value(ly.first_norm)}</td><td>{_value(ly.last_norm)}</td>"
            f"<td>{_value(ly.median_norm)}</td><td>{_value(ly.max_norm)}</td>"
            f"<td>{ly.nonfinite_steps}</td><td>{_value(ly.median_ratio)}</td></tr>")
    return ('<table class="data" id="layer-table"><thead><tr><th>name</th><th>kind</th>'
            "<th>shape</th><th>steps</th><th>first norm</th><th>last norm</th><th>median norm</th>"
            "<th>max norm</th><th>NaN/Inf steps</th><th>median update ratio</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")


def _metadata(data: ReportData) -> str:
    meta = dict(data.meta)
    model = meta.pop("model", None) or {}
    config = meta.pop("config", None) or {}
    selected = meta.pop("selected", None) or {}
    meta.pop("histogram", None)
    rows: list[tuple[str, Any]] = [("run directory", str(data.path.resolve()))]
    for key in ("status", "start_time", "end_time", "gradtap_version", "torch_version",
                "python_version", "world_size", "schema_version"):
        if key in meta:
            rows.append((key.replace("_", " "), meta.pop(key)))
    rows += [(f"config: {k}", v) for k, v in config.items()]
    rows += [(f"selected {k}", ", ".join(map(str, v)) if isinstance(v, list) else v)
             for k, v in selected.items()]
    rows += [(k, v) for k, v in meta.items()]  # anything passed as meta=
    html = _kv_table(rows)
    params = model.get("parameters") or []
    if params:
        prow = "".join(
            f"<tr><td><code>{escape(str(p[0]))}</code></td><td>{escape(_shape(p[1]))}</td>"
            f"<td>{escape(str(p[2]) if len(p) > 2 else '')}</td>"
            f"<td>{escape(str(p[3]) if len(p) > 3 else '')}</td></tr>"
            for p in params if isinstance(p, list) and p)
        html += (f"<h3>Model: {escape(str(model.get('class', '?')))}</h3>"
                 '<table class="data"><thead><tr><th>parameter</th><th>shape</th><th>dtype</th>'
                 f"<th>trainable</th></tr></thead><tbody>{prow}</tbody></table>")
    if model.get("repr"):
        html += (f"<details><summary>Model structure</summary><pre>{escape(str(model['repr']))}"
                 "</pre></details>")
    return html


_CSS = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d8dee4;--bg:#f6f8fa;--accent:#4e79a7;--bad:#d7191c}
*{box-sizing:border-box}
body{margin:0;font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:#fff}
header{padding:20px 32px 0;border-bottom:1px solid var(--line);background:var(--bg);position:sticky;top:0;z-index:2}
header h1{display:inline-block;margin:0 12px 0 0;font-size:22px}
.brand{font-weight:700;color:var(--accent);letter-spacing:.04em;font-size:12px;text-transform:uppercase}
.path{color:var(--muted);font-size:12px;margin-top:2px;word-break:break-all}
nav{display:flex;flex-wrap:wrap;gap:2px 18px;margin-top:10px}
nav a{color:var(--fg);text-decoration:none;padding:6px 0;border-bottom:2px solid transparent;font-size:13px}
nav a:hover{border-color:var(--accent)}
main{max-width:1040px;margin:0 auto;padding:8px 32px 32px}
section{padding-top:12px;scroll-margin-top:120px}
h2{font-size:18px;border-bottom:1px solid var(--line);padding-bottom:4px;margin:20px 0 10px}
h3{font-size:14px;margin:16px 0 6px;color:#333}
.status{display:inline-block;padding:1px 10px;border-radius:10px;font-size:12px;vertical-align:4px;background:#ddd}
.status-finished{background:#dafbe1;color:#116329}.status-failed{background:#ffebe9;color:#a40e26}
.status-running{background:#fff8c5;color:#7d4e00}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid var(--line);border-radius:8px;padding:8px 14px;min-width:120px;background:#fff}
.card .k{color:var(--muted);font-size:12px}.card .v{font-size:18px;font-weight:600}
.callout{margin:12px 0;padding:10px 14px;border-radius:6px;border-left:4px solid}
.callout.bad{background:#fff0f0;border-color:var(--bad)}.callout.warn{background:#fff8e1;border-color:#d4a72c}
.muted{color:var(--muted)}.ok{color:#116329}.empty{color:var(--muted);font-style:italic}
figure{margin:8px 0 18px}
figure.chart svg.gt-plot{width:100%;height:auto;display:block}
figcaption{color:var(--muted);font-size:12px;margin-top:4px}
figcaption.title{color:var(--fg);font-size:13px;margin:0 0 2px}
.grid2{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:8px 24px}
.legend{list-style:none;padding:0;margin:6px 0 0;display:flex;flex-wrap:wrap;gap:2px 14px;font-size:12px}
.legend li{cursor:pointer;user-select:none;white-space:nowrap}
.legend li.off{opacity:.35}
.legend .sw{display:inline-block;width:18px;height:4px;border-radius:2px;margin-right:6px;vertical-align:middle}
svg.gt-plot text{font:11px system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;fill:#57606a}
svg.gt-plot .gt-axlabel{fill:#24292f;font-size:12px}
svg.gt-plot .gt-grid{stroke:#eaeef2}
svg.gt-plot .gt-tick{stroke:#8c959f}
svg.gt-plot .gt-box{fill:none;stroke:#d0d7de}
svg.gt-plot .gt-rowlabel{fill:#24292f;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:11px}
svg.gt-plot .gt-reflabel{fill:#6e7781}
svg.gt-plot.dim .gt-line{stroke-opacity:.15}
svg.gt-plot.dim .gt-line.hl{stroke-opacity:1;stroke-width:2.6}
svg.gt-plot .gt-line.off{display:none}
table{border-collapse:collapse;font-size:13px;margin:6px 0 12px}
table.data{width:100%}
table.data th,table.data td{border-bottom:1px solid var(--line);padding:4px 8px;text-align:left;vertical-align:top}
table.data td{font-variant-numeric:tabular-nums}
table.data thead th{background:var(--bg);font-weight:600}
table.data tr.bad td{background:#fff0f0}
#nonfinite-table tr.more{display:none}#nonfinite-table.all tr.more{display:table-row}
button.more-toggle{font:inherit;font-size:12px;padding:2px 10px;border:1px solid var(--line);border-radius:6px;background:#fff;cursor:pointer}
table.kv th{text-align:left;font-weight:500;color:var(--muted);padding:2px 16px 2px 0;vertical-align:top;white-space:nowrap}
table.kv td{padding:2px 0;word-break:break-word}
code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;background:var(--bg);padding:1px 4px;border-radius:4px}
pre{background:var(--bg);padding:12px;overflow:auto;font-size:12px;border-radius:6px}
details{margin:8px 0}
table.data details{margin:4px 0 0}table.data details pre{margin:4px 0;font-size:11px;white-space:pre}
summary{cursor:pointer;color:var(--muted);font-size:12px}
footer{color:var(--muted);font-size:12px;text-align:center;padding:16px;border-top:1px solid var(--line)}
"""

# Legend interaction only; the page is complete without it.
_JS = """
(function () {
  "use strict";
  document.querySelectorAll("ul.legend").forEach(function (legend) {
    var svgEl = legend.parentNode.querySelector("svg.gt-plot");
    if (!svgEl) { return; }
    var lines = Array.prototype.slice.call(svgEl.querySelectorAll(".gt-line"));
    function matching(name) {
      return lines.filter(function (p) { return p.getAttribute("data-series") === name; });
    }
    legend.querySelectorAll("li").forEach(function (item) {
      var name = item.getAttribute("data-series");
      item.addEventListener("mouseenter", function () {
        svgEl.classList.add("dim");
        matching(name).forEach(function (p) { p.classList.add("hl"); });
      });
      item.addEventListener("mouseleave", function () {
        svgEl.classList.remove("dim");
        matching(name).forEach(function (p) { p.classList.remove("hl"); });
      });
      item.addEventListener("click", function () {
        var off = item.classList.toggle("off");
        matching(name).forEach(function (p) { p.classList.toggle("off", off); });
      });
    });
  });
  document.querySelectorAll("button.more-toggle").forEach(function (button) {
    button.addEventListener("click", function () {
      var table = document.getElementById("nonfinite-table");
      var all = table.classList.toggle("all");
      button.textContent = all ? "show fewer rows" : button.getAttribute("data-label");
    });
    button.setAttribute("data-label", button.textContent);
  });
  document.documentElement.setAttribute("data-gt-ready", "1");
})();
"""
