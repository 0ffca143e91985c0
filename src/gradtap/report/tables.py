"""The report's sections of cards and tables: overview, anomalies, layer summary, metadata.

Each is a function of the :class:`~gradtap.report.data.ReportData` returning an HTML fragment
(empty when it has nothing to show), placed in the page by :func:`gradtap.report.html.render_html`
beside the chart sections; :func:`ewma_state` is the table under the EWMA bands. Every name
that comes from user code (module and parameter names, metadata, messages) goes through
:func:`html.escape`.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from html import escape
from typing import Any

import numpy as np

from gradtap._text import format_number
from gradtap.report.data import ReportData
from gradtap.report.layers import Heat

__all__ = ["anomalies", "ewma_state", "layer_table", "metadata", "overview", "top_table"]

_MORE = ' class="more"'


def overview(data: ReportData) -> str:
    """Cards (status, steps, model, summary, final loss, anomalies), the first anomaly."""
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


def _ending(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """Why a failed run ended, as overview cards: the exception, the exit code or signal."""
    cards = []
    if meta.get("error"):
        cards.append(("error", str(meta["error"])))
    code = meta.get("exit_code")
    if isinstance(code, int) and code != 0:
        cards.append(("exit code", f"{code}" + (f" (signal {code - 128})" if code > 128 else "")))
    return cards


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


def anomalies(data: ReportData) -> str:
    """The detector's anomalies, and the non-finite values found in the statistics."""
    html = ""
    if data.anomalies:
        rows = "".join(
            f"<tr><td>{escape(str(a.get('step')))}</td><td><code>{escape(str(a.get('module_name')))}"
            f"</code></td><td>{escape(str(a.get('kind')))}</td><td>{escape(str(a.get('where')))}</td>"
            f"<td>{_samples(a)}</td><td>{_message(a.get('message'))}</td></tr>"
            for a in data.anomalies)
        src = f" (source: {escape(data.anomaly_source)})" if data.anomaly_source else ""
        html += (f"<h3>Recorded anomalies{src}</h3>"
                 '<table class="data anomalies" id="anomaly-table"><thead><tr><th>step</th>'
                 "<th>module</th><th>kind</th><th>where</th><th>samples</th><th>message</th></tr>"
                 "</thead>"
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


def _samples(a: dict[str, Any]) -> str:
    """The samples an anomaly names (``detect(samples=True)``), worst first: each batch
    position with the user's id where ``sample_ids`` gave one; empty when not asked."""
    samples, ids = a.get("samples"), a.get("sample_ids")
    if not isinstance(samples, list):
        return ""
    if not samples:
        return '<span class="muted">none stands out</span>'
    if isinstance(ids, list) and len(ids) == len(samples):
        items = [f"{escape(str(i))} <span class=\"muted\">(row {p})</span>"
                 for p, i in zip(samples, ids)]
    else:
        items = [f"row {escape(str(p))}" for p in samples]
    more = f" ... ({len(items)} in all)" if len(items) > 10 else ""
    return ", ".join(items[:10]) + more


def layer_table(data: ReportData) -> str:
    """One row per stored tensor: its norms over the run, NaN/Inf steps, update ratio; a
    search box above it filters the rows by name (the page's script)."""
    if not data.layers:
        return ""
    rows = []
    codes = {kind: _heat_codes(heat) for kind, heat in data.heat.items()}
    for ly in data.layers:
        bad = ' class="bad"' if ly.nonfinite_steps else ""
        code, lo, hi, first, last = codes.get(ly.kind, {}).get(ly.name, ("", 0, 0, 0, 0))
        heat = (f' data-heat="{code}" data-lo="{lo:.4g}" data-hi="{hi:.4g}" '
                f'data-steps="{first:g}–{last:g}"' if code else "")
        rows.append(
            f"<tr{bad}{heat}><td><code>{escape(ly.name)}</code></td><td>{escape(ly.kind)}</td>"
            f"<td>{escape(_shape(ly.shape))}</td><td>{ly.steps}</td>"
            f"<td>{_value(ly.first_norm)}</td><td>{_value(ly.last_norm)}</td>"
            f"<td>{_value(ly.median_norm)}</td><td>{_value(ly.max_norm)}</td>"
            f"<td>{_value(ly.peak)}</td><td>{ly.nonfinite_steps}</td><td>{ly.clipped_steps}</td>"
            f"<td>{_value(ly.median_ratio)}</td></tr>")
    n = len(data.layers)
    return ('<p class="search"><input type="search" id="layer-search" placeholder="find a '
            f'layer by name" aria-label="find a layer by name"> <span id="layer-count">{n} of '
            f"{n} tensors</span> <span class=\"muted\">Click a row for its norm over the run "
            "(each point the largest of its steps, log scale; red: NaN/Inf).</span></p>"
            '<table class="data" id="layer-table"><thead><tr><th>name</th><th>kind</th>'
            "<th>shape</th><th>steps</th><th>first norm</th><th>last norm</th><th>median norm</th>"
            "<th>max norm</th><th>spike ×</th><th>NaN/Inf steps</th><th>clipped steps</th>"
            "<th>median update ratio</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")


def _heat_codes(heat: Heat) -> dict[str, tuple[str, float, float, float, float]]:
    """Each heatmap row as base64 bytes for the page's script to draw on demand: 0 nothing
    recorded (or not positive), 1-253 log10 of the value between the kind's smallest and
    largest (``lo``, ``hi``), 254 NaN/Inf; with the first and last step."""
    grid = heat.grid
    pos = grid[np.isfinite(grid) & (grid > 0)]
    if not len(pos) or not len(heat.edges):
        return {}
    lo, hi = math.log10(float(pos.min())), math.log10(float(pos.max()))
    span = hi - lo if hi > lo else 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = 1 + np.round((np.log10(grid) - lo) / span * 252)
    code = np.where(np.isfinite(grid) & (grid > 0), scaled, 0)
    code = np.where(np.isnan(grid), 254, code).clip(0, 254).astype(np.uint8)
    first, last = heat.edges[0][0], heat.edges[-1][1]
    return {name: (base64.b64encode(code[i].tobytes()).decode("ascii"), lo, hi, first, last)
            for i, name in enumerate(heat.names)}


def top_table(data: ReportData) -> str:
    """The layers the charts show when a kind has more tensors than they draw, and why."""
    chosen = [ly for ly in data.layers if ly.why]
    if not chosen:
        return ""
    counts = ", ".join(f"{len(data.norms.get(k, {}))} of {n} {k}" for k, n in data.tensors.items())
    rows = "".join(
        f"<tr><td><code>{escape(ly.name)}</code></td><td>{escape(ly.kind)}</td>"
        f"<td>{escape(', '.join(ly.why))}</td><td>{_value(ly.max_norm)}</td>"
        f"<td>{_value(ly.peak)}</td><td>{ly.nonfinite_steps}</td><td>{ly.clipped_steps}</td></tr>"
        for ly in chosen)
    return (f"<p>The charts below show the layers that matter ({escape(counts)} tensors): "
            "those that held NaN/Inf, spiked (a norm more than 3x both its neighbours, the "
            "largest first, or first to cross the spike threshold), were clipped most, or had "
            "the largest norms, taken in turn from each list. Spike × is the largest factor by "
            "which a norm exceeds both its neighbours' (about 1 for a smooth series). Every "
            'tensor is in the <a href="#layers">layer table</a>: search it by name, click a '
            'row for its norm over the run.</p><table class="data" id="top-table"><thead><tr>'
            "<th>name</th><th>kind</th>"
            "<th>why</th><th>max norm</th><th>spike ×</th><th>NaN/Inf steps</th>"
            f"<th>clipped steps</th></tr></thead><tbody>{rows}</tbody></table>")


#: Spike steps shown at most, in the table and as markers on the norm chart.
MAX_EVENTS = 100


def largest_spikes(data: ReportData) -> list[dict[str, Any]]:
    """At most :data:`MAX_EVENTS` spike steps, those with the largest score, by step."""
    if len(data.spikes) <= MAX_EVENTS:
        return data.spikes
    return sorted(sorted(data.spikes, key=lambda e: -e["z"])[:MAX_EVENTS], key=lambda e: e["step"])


def spikes(data: ReportData) -> str:
    """The run's gradient spikes (``Run.spikes()``), each step with its first tensor to spike
    (in backward order), and the steps a spike rule clipped."""
    if not data.spikes and not data.clipped:
        return ""
    out = ""
    if data.spikes:
        rows = "".join(
            f"<tr><td>{e['step']}</td><td><code>{escape(e['name'])}</code></td>"
            f"<td>{e['z']:.2f}</td><td>{e['count']}</td>"
            f"<td>{_value(data.clipped.get(e['step']))}</td></tr>" for e in largest_spikes(data))
        if len(data.spikes) > MAX_EVENTS:
            out += (f'<p class="muted">The {MAX_EVENTS} of {len(data.spikes)} spike steps with '
                    "the largest score, by step.</p>")
        out += ("<p>Steps where a tensor's gradient norm left its own running baseline by more "
                "than the spike threshold (<code>Run.spikes()</code>: a robust z-score of the "
                "log-norm, see docs/semantics.md), with the first tensor (in backward order) "
                'to spike: where the spike started.</p><table class="data" id="spike-table">'
                "<thead><tr><th>step</th><th>first layer to spike</th><th>score</th>"
                "<th>tensors spiking</th>"
                f"<th>smallest clip factor</th></tr></thead><tbody>{rows}</tbody></table>")
    if data.clipped:
        steps = ", ".join(f"{step} ({factor:.3g})"
                          for step, factor in list(data.clipped.items())[:MAX_EVENTS])
        more = f" and {len(data.clipped) - MAX_EVENTS} more" if len(data.clipped) > MAX_EVENTS else ""
        out += (f"<p>A spike rule clipped at {len(data.clipped)} step(s) (smallest factor): "
                f"{escape(steps)}{more}.</p>")
    return out


def ewma_state(data: ReportData) -> str:
    """The Monitor's elementwise EWMA at the end of the run, under the EWMA section's bands."""
    if not data.ewma:
        return ""
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
    html = ""
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


def metadata(data: ReportData) -> str:
    """The run's metadata, its configuration and selection, and the model's parameters."""
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


def _value(v: Any) -> str:
    if isinstance(v, float):
        return escape(format_number(v, short=True))
    if isinstance(v, (dict, list)):
        return f"<code>{escape(json.dumps(v, default=str))}</code>"
    return escape("—" if v is None else str(v))


def _shape(shape: Any) -> str:
    if isinstance(shape, list):
        return "×".join(str(s) for s in shape) or "scalar"
    return "" if shape is None else str(shape)


def _kv_table(rows: Sequence[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{escape(str(k))}</th><td>{_value(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _message(message: Any) -> str:
    """The first line of a (detector) message, the rest folded away as preformatted text."""
    text = str(message or "").strip()
    first, _, rest = text.partition("\n")
    if not rest.strip():
        return escape(first)
    return (f"{escape(first)}<details><summary>details</summary><pre>{escape(rest)}</pre>"
            "</details>")


def _first_line(message: Any) -> str:
    return str(message or "").strip().split("\n", 1)[0]
