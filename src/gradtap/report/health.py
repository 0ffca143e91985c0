"""The report's training-health panels: the loss on top, the gradient noise scale (global and
per layer), gain per block, RMS per kind, and the slices of ``split=`` parameters (experts) as
heatmaps.

:func:`read_health` gathers the series from a run (through the report's series reader);
the ``*_section`` functions render them (empty strings when the run holds none).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from html import escape

import numpy as np

from gradtap.report import svg

__all__ = ["HealthData", "experts_section", "gain_section", "gns_section", "is_slice",
           "loss_section", "read_health", "rms_section"]

Series = tuple[np.ndarray, np.ndarray]
_SLICE = re.compile(r"^(.*)\[(\d+)\]$")
_SPECIAL = ("<all>", "<loss>", "<scaler>")
_MAX_COLS = 240


def is_slice(name: str) -> bool:
    """Whether ``name`` is a slice of a ``split=`` parameter (``experts.w1[3]``).

    Example:
        >>> is_slice("experts.w1[3]"), is_slice("experts.w1")
        (True, False)
    """
    return _SLICE.match(name) is not None


@dataclass
class HealthData:
    """The series of the health panels."""

    loss: Series | None = None
    gns: dict[str, Series] = field(default_factory=dict)  # "<all>" first, then per tensor
    gain: dict[str, Series] = field(default_factory=dict)
    rms: dict[str, dict[str, Series]] = field(default_factory=dict)  # kind -> name -> series
    # split tensor -> its slices' gradient norms, by slice index
    experts: dict[str, list[tuple[int, Series]]] = field(default_factory=dict)
    gns_beta: float | None = None

    def __bool__(self) -> bool:
        return bool(self.loss is not None or self.gns or self.gain or self.rms or self.experts)


def read_health(names: Iterable[str], get: Callable[[str, str, str], Series | None],
                config: dict) -> HealthData:
    """The health series of a run with ``names`` (in display order); ``get(name, stat, kind)``
    reads one series or gives ``None``."""
    names = list(names)
    data = HealthData(loss=get("<loss>", "value", "health")  # runs stored before that kind:
                      or get("<loss>", "value", "param_grad"))
    beta = config.get("gns_beta")
    data.gns_beta = float(beta) if isinstance(beta, (int, float)) else None
    for name in ["<all>", *(n for n in names if n not in _SPECIAL and not is_slice(n))]:
        s = get(name, "gns", "param_grad")
        if s is not None:
            data.gns[name] = s
    for name in names:
        s = get(name, "gain", "grad_output")
        if s is not None:
            data.gain[name] = s
    for kind in ("param_grad", "grad_output", "param", "update"):
        for name in names:
            if is_slice(name) or name in _SPECIAL:
                continue
            s = get(name, "rms", kind)
            if s is not None:
                data.rms.setdefault(kind, {})[name] = s
    for name in names:
        m = _SLICE.match(name)
        if m is not None:
            s = get(name, "norm", "param_grad")
            if s is not None:
                data.experts.setdefault(m.group(1), []).append((int(m.group(2)), s))
    for slices in data.experts.values():
        slices.sort(key=lambda t: t[0])
    return data


# -- rendering -------------------------------------------------------------------------------


def _lines(series: dict[str, Series]) -> list[svg.Line]:
    out = []
    for i, (name, (st, vals)) in enumerate(series.items()):
        x, y = st.astype(float), vals
        color, dash = svg.color_for(i)
        out.append(svg.Line(name, x, y, color=color, dash=dash,
                            width=2.6 if name == "<all>" else 1.4))
    return out


def _legend(plot_id: str, names: list[str]) -> str:
    items = []
    for i, name in enumerate(names):
        color, dash = svg.color_for(i)
        style = f"background:{color}" if not dash else (
            f"background:repeating-linear-gradient(90deg,{color} 0 5px,transparent 5px 8px)")
        items.append(f'<li data-series="{escape(name)}"><span class="sw" style="{style}"></span>'
                     f"{escape(name)}</li>")
    return f'<ul class="legend" data-for="{escape(plot_id)}">{"".join(items)}</ul>'


def _figure(chart: str, legend: str, caption: str) -> str:
    return f'<figure class="chart">{chart}{legend}<figcaption>{caption}</figcaption></figure>'


def _wide(values: np.ndarray) -> bool:
    pos = values[np.isfinite(values) & (values > 0)]
    return bool(len(pos) and pos.max() / pos.min() > 20 and (values[np.isfinite(values)] > 0).all())


def loss_section(data: HealthData) -> str:
    """The loss given to ``mon.step(loss=...)`` (or by a callback), per step."""
    if data.loss is None:
        return ""
    st, vals = data.loss
    log = _wide(vals)
    chart = svg.line_chart([svg.Line("loss", st.astype(float), vals)],
                           plot_id="health-loss", title="Loss per step", log_y=log,
                           y_label="loss" + (" (log)" if log else ""), height=240)
    return _figure(chart, "", "The loss stored with each step (<code>mon.step(loss=...)</code>, "
                   "or the trainer's loss from a callback), on the same steps as the gradient "
                   "statistics below.")


def gns_section(data: HealthData) -> str:
    """The gradient noise scale ``B_simple``: all tensors together (thick) and per tensor."""
    if not data.gns:
        return ""
    names = list(data.gns)
    chart = svg.line_chart(_lines(data.gns), plot_id="health-gns", log_y=True,
                           title="Gradient noise scale B_simple per step",
                           y_label="B_simple (samples, log)")
    warm = (f" Its EMAs (beta = {data.gns_beta:g}) average about {1 / (1 - data.gns_beta):.0f} "
            "steps: read it after that many, and expect the per-layer lines to be noisier "
            "than the whole (<code>&lt;all&gt;</code>)." if data.gns_beta else "")
    return _figure(chart, _legend("health-gns", names),
                   "tr(&Sigma;) / |G|&sup2;, a ratio of EMAs: near the critical batch size, "
                   "training with a batch much smaller wastes steps, much larger wastes "
                   "samples. Missing points: steps with no estimate yet (or a non-finite "
                   "one)." + warm)


def gain_section(data: HealthData) -> str:
    """Gain ``|dL/d input| / |dL/d output|`` of each module per step."""
    if not data.gain:
        return ""
    names = list(data.gain)
    chart = svg.line_chart(_lines(data.gain), plot_id="health-gain", log_y=True,
                           title="Gradient gain per module per step", hlines=[(1.0, "1")],
                           y_label="|∂L/∂input| / |∂L/∂output| (log)")
    return _figure(chart, _legend("health-gain", names),
                   "How much each module amplifies (above 1) or damps (below 1) the gradient "
                   "passing back through it, over all its calls in the step. A block whose "
                   "gain drifts far from 1 is where gradients explode or vanish.")


def rms_section(data: HealthData) -> str:
    """Root mean square per tensor, for each kind with ``rms``."""
    out = []
    labels = {"param_grad": "parameter gradients", "grad_output": "output gradients",
              "param": "parameters", "update": "updates (change per step)"}
    for kind, series in data.rms.items():
        names = list(series)
        pid = f"health-rms-{kind}"
        chart = svg.line_chart(_lines(series), plot_id=pid, log_y=True,
                               title=f"RMS of {labels[kind]} per step", y_label="RMS (log)")
        out.append(f"<h3>{escape(labels[kind])}</h3>" + _figure(
            chart, _legend(pid, names), "sqrt(mean(x&sup2;)) per tensor: comparable across "
            "tensors of different sizes. Update RMS over parameter RMS is the "
            "update-to-weight ratio (kind <code>update</code>'s stat <code>ratio</code>)."))
    return "".join(out)


def experts_section(data: HealthData) -> str:
    """One heatmap per ``split=`` parameter: its slices' gradient norms by steps."""
    out = []
    for i, (name, slices) in enumerate(data.experts.items()):
        rows = [f"[{k}]" for k, _ in slices]
        steps = np.asarray(sorted({int(s) for _, (st, _) in slices for s in st}))
        if not len(steps):
            continue
        grid = np.full((len(rows), len(steps)), -1.0)  # -1: not recorded (grey)
        for r, (_, (st, vals)) in enumerate(slices):
            grid[r, np.searchsorted(steps, st)] = vals
        cols = steps.astype(float)
        edges = None
        if len(steps) > _MAX_COLS:
            b = np.linspace(0, len(steps), _MAX_COLS + 1).astype(int)
            grid = np.stack([np.where(np.isfinite(grid[:, a:z]).all(1), grid[:, a:z].max(1),
                                      math.nan) for a, z in zip(b[:-1], b[1:])], axis=1)
            edges = [(float(steps[a]), float(steps[z - 1])) for a, z in zip(b[:-1], b[1:])]
            cols = np.array([e[0] for e in edges])
        chart = svg.heatmap(rows, cols.tolist(), grid, plot_id=f"health-experts-{i}",
                            title=f"Gradient norm of each slice of {name}",
                            value_label="L2 norm", col_edges=edges)
        out.append(f"<h3><code>{escape(name)}</code></h3>" + _figure(
            chart, "", "One row per slice along the split dimension (an expert of a stacked "
            "MoE weight): a row much darker than the others is an expert that gets little "
            "gradient (rarely routed), a bright one an expert that takes most of it."))
    return "".join(out)
