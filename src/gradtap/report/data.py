"""The report's plain data model, built from a run directory; no HTML here.

A run directory holds the Monitor's ``run.db`` and, optionally, two JSON side files that
``gradtap demo`` (or your own loop) writes next to it:

* ``anomalies.json``: ``{"version": 1, "source": str, "anomalies": [{"step", "module_name",
  "kind", "where", "message"}, ...]}``, e.g. ``det.anomalies`` of :func:`gradtap.detect`
  saved with :func:`write_anomalies`;
* ``metrics.json``: ``{"version": 1, "series": {name: {"steps": [...], "values": [...]}},
  "summary": {name: number}}``, e.g. the loss per step, saved with :func:`write_metrics`.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradtap.errors import StoreError
from gradtap.report.health import HealthData, is_slice, read_health
from gradtap.store import DB_NAME, Run, open_run

__all__ = [
    "ANOMALIES_FILE", "METRICS_FILE", "LayerSummary", "ReportData", "RunInfo",
    "anomaly_to_dict", "build_report_data", "layer_summary", "list_runs", "read_anomalies",
    "read_metrics", "write_anomalies", "write_metrics",
]

ANOMALIES_FILE = "anomalies.json"
METRICS_FILE = "metrics.json"
_ANOMALY_FIELDS = ("step", "module_name", "kind", "where", "message")


# -- side files ----------------------------------------------------------------------------------


def anomaly_to_dict(anomaly: Any) -> dict[str, Any]:
    """Turn a ``gt.Anomaly`` (or a mapping) into a JSON-ready dict of its plain fields."""
    if isinstance(anomaly, Mapping):
        src = dict(anomaly)
    elif callable(getattr(anomaly, "to_dict", None)):
        src = dict(anomaly.to_dict())
    else:
        names = getattr(anomaly, "__dataclass_fields__", None) or getattr(anomaly, "_fields", None)
        names = list(names) if names else [n for n in _ANOMALY_FIELDS if hasattr(anomaly, n)]
        src = {n: getattr(anomaly, n) for n in names}
    out: dict[str, Any] = {}
    for k, v in src.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v if not (isinstance(v, float) and not math.isfinite(v)) else repr(v)
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, str)) for x in v):
            out[k] = list(v)
        elif isinstance(v, os.PathLike):
            out[k] = os.fspath(v)
    for k in _ANOMALY_FIELDS:
        out.setdefault(k, None)
    return out


def write_anomalies(run_dir: str | os.PathLike[str], anomalies: Iterable[Any],
                    source: str = "gradtap.detect") -> Path:
    """Save anomalies (``gt.Anomaly`` objects or dicts) as ``run_dir/anomalies.json``."""
    path = Path(run_dir) / ANOMALIES_FILE
    doc = {"version": 1, "source": source, "anomalies": [anomaly_to_dict(a) for a in anomalies]}
    _write_json(path, doc)
    return path


def read_anomalies(run_dir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], str | None]:
    """Return ``(anomalies, source)`` from ``run_dir/anomalies.json``; ``([], None)`` if absent.

    Raises:
        StoreError: the file is not valid JSON of the expected shape.
    """
    path = Path(run_dir) / ANOMALIES_FILE
    if not path.exists():
        return [], None
    doc = _read_json(path)
    items = doc.get("anomalies") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not all(isinstance(a, dict) for a in items):
        raise StoreError(f"{str(path)!r} is not an anomalies file: expected "
                         '{"anomalies": [{...}, ...]}')
    return [{k: a.get(k) for k in (*_ANOMALY_FIELDS, *a)} for a in items], str(doc.get("source"))


def write_metrics(run_dir: str | os.PathLike[str],
                  series: Mapping[str, tuple[Sequence[int], Sequence[float]]],
                  summary: Mapping[str, float] | None = None) -> Path:
    """Save per-step training metrics (loss, ...) and summary numbers as ``metrics.json``."""
    def num(v: float) -> float | None:
        v = float(v)
        return v if math.isfinite(v) else None  # JSON has no NaN
    doc = {"version": 1,
           "series": {k: {"steps": [int(s) for s in st], "values": [num(v) for v in vals]}
                      for k, (st, vals) in series.items()},
           "summary": {k: num(v) for k, v in (summary or {}).items()}}
    path = Path(run_dir) / METRICS_FILE
    _write_json(path, doc)
    return path


def read_metrics(run_dir: str | os.PathLike[str]
                 ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, float]]:
    """Return ``(series, summary)`` from ``run_dir/metrics.json``; empty when absent.

    Raises:
        StoreError: the file is not valid JSON of the expected shape.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return {}, {}
    doc = _read_json(path)
    try:
        series = {str(k): (np.asarray(v["steps"], dtype=np.int64),
                           np.array([math.nan if x is None else x for x in v["values"]], dtype=float))
                  for k, v in doc.get("series", {}).items()}
        summary = {str(k): math.nan if v is None else float(v)
                   for k, v in doc.get("summary", {}).items()}
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise StoreError(f"{str(path)!r} is not a metrics file: {err}") from err
    return series, summary


def _write_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(f"cannot read {str(path)!r}: {err}") from err


# -- listing runs --------------------------------------------------------------------------------


@dataclass
class RunInfo:
    """One row of ``gradtap runs``: a run directory and what its store says."""

    path: Path
    steps: int | None
    last_step: int | None
    start_time: str | None
    status: str
    error: str | None = None


def list_runs(root: str | os.PathLike[str], max_depth: int = 3) -> list[RunInfo]:
    """Find run directories (holding ``run.db``) at or below ``root``, sorted by path.

    A store that cannot be read is listed with status ``"unreadable"`` and the reason.

    Raises:
        StoreError: ``root`` does not exist or is not a directory.
    """
    base = Path(root)
    if not base.is_dir():
        raise StoreError(f"no such directory: {str(base)!r}" if not base.exists()
                         else f"{str(base)!r} is not a directory")
    found: list[Path] = []

    def walk(d: Path, depth: int) -> None:
        if (d / DB_NAME).is_file():
            found.append(d)
        if depth >= max_depth:
            return
        try:
            subs = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for p in subs:
            walk(p, depth + 1)

    walk(base, 0)
    out = []
    for d in sorted(found):
        try:
            run = open_run(d)
            meta, steps = run.meta, run.steps
            out.append(RunInfo(d, len(steps), steps[-1] if steps else None,
                               meta.get("start_time"), str(meta.get("status"))))
        except (StoreError, OSError, sqlite3.Error, ValueError) as err:
            out.append(RunInfo(d, None, None, None, "unreadable", str(err)))
    return out


# -- the report's data model ---------------------------------------------------------------------

Series = tuple[np.ndarray, np.ndarray]


@dataclass
class LayerSummary:
    """Per-tensor numbers for the summary tables (report and ``gradtap demo``)."""

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


@dataclass
class ReportData:
    """Everything the HTML report shows, read from one run directory."""

    path: Path
    meta: dict[str, Any]
    steps: list[int]
    # kind -> name -> (steps, values)
    norms: dict[str, dict[str, Series]] = field(default_factory=dict)
    nonfinite: dict[str, dict[str, Series]] = field(default_factory=dict)
    ratios: dict[str, Series] = field(default_factory=dict)
    histograms: dict[str, Any] = field(default_factory=dict)  # name -> store.Histogram
    hist_kind: str = "param_grad"
    ewma: dict[str, dict[str, Any]] = field(default_factory=dict)
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    anomaly_source: str | None = None
    derived_anomalies: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Series] = field(default_factory=dict)
    summary: dict[str, float] = field(default_factory=dict)
    layers: list[LayerSummary] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # gradient spikes, exactly Run.spikes(): {"step", "name" (the step's first spiking tensor
    # in backward order), "z" (its score), "count" (how many spiked)}, by step
    spikes: list[dict[str, Any]] = field(default_factory=list)
    # step -> the smallest clip_factor a spike rule applied at that step (only steps < 1)
    clipped: dict[int, float] = field(default_factory=dict)
    health: HealthData = field(default_factory=HealthData)


def _order(names: Iterable[str], meta: dict[str, Any], kind: str) -> list[str]:
    """Model order (as the Monitor selected them) when the metadata has it, else sorted."""
    names = list(names)
    sel = meta.get("selected") or {}
    if kind == "grad_output":
        ref = [m for m in sel.get("modules", []) if isinstance(m, str)]
        rank = {m: i for i, m in enumerate(ref)}
        return sorted(names, key=lambda n: (rank.get(n.rpartition(":")[0], len(ref)), n))
    ref = [p for p in sel.get("parameters", []) if isinstance(p, str)]
    rank = {p: i for i, p in enumerate(ref)}
    return sorted(names, key=lambda n: (rank.get(n, len(ref)), n))


class _SeriesReader:
    """Per-series reads, batched: one ``Run.frame()`` query for all of them when pandas is
    installed (``Run.series()`` scans the scalars table once per call), else ``Run.series()``."""

    def __init__(self, run: Run, stats: Sequence[str], kinds: Sequence[str]) -> None:
        self.run = run
        self.table: dict[tuple[str, str, str], Series] | None = None
        try:
            import pandas  # noqa: F401
        except ImportError:
            return
        wanted_kinds = [k for k in kinds if k in run.kinds]
        if not wanted_kinds:
            self.table = {}
            return
        df = run.frame(stats=list(stats), kinds=wanted_kinds)
        self.table = {}
        for key, part in df.groupby(["name", "kind", "stat"], sort=False):
            self.table[key] = (part["step"].to_numpy(np.int64), part["value"].to_numpy(float))

    def get(self, name: str, stat: str, kind: str) -> Series | None:
        if self.table is not None:
            return self.table.get((name, kind, stat))
        try:
            return self.run.series(name, stat, kind)
        except KeyError:
            return None


def build_report_data(run_dir: str | os.PathLike[str] | Run,
                      hist_names: Sequence[str] | None = None, max_hists: int = 6) -> ReportData:
    """Read everything the report needs from a run directory (or an open :class:`Run`).

    Args:
        run_dir: the run directory.
        hist_names: globs of tensors whose histograms to show (default: the weights' gradients,
            up to ``max_hists``).
        max_hists: how many histograms at most when ``hist_names`` is not given.

    Raises:
        StoreError: no readable run store there, or a side file is corrupt.
        SelectionError: a ``hist_names`` glob matches no histogram.
    """
    import fnmatch

    from gradtap.errors import SelectionError

    run = run_dir if isinstance(run_dir, Run) else open_run(run_dir)
    try:
        meta = run.meta
        steps = run.steps
        names = run.names
        kinds = run.kinds
        hist_pairs = run.histogram_names()
        ewma = run.ewma
    except (sqlite3.Error, ValueError) as err:  # a damaged file past its header, bad JSON
        if isinstance(err, StoreError):
            raise
        raise _damaged(run, err) from err
    data = ReportData(path=run.path, meta=meta, steps=steps, ewma=ewma)
    try:
        reader = _SeriesReader(run, ("norm", "nonfinite", "ratio", "clip_factor"),
                               ("param_grad", "grad_output", "update"))
        for kind in ("param_grad", "grad_output", "update"):
            if kind not in kinds:
                continue
            # split= slices have a panel of their own (the experts' heatmaps)
            for name in _order([n for n in names if not is_slice(n)], meta, kind):
                s = reader.get(name, "norm", kind)
                if s is not None:
                    data.norms.setdefault(kind, {})[name] = s
                nf = reader.get(name, "nonfinite", kind)
                if nf is not None:
                    data.nonfinite.setdefault(kind, {})[name] = nf
                if kind == "update":
                    r = reader.get(name, "ratio", kind)
                    if r is not None:
                        data.ratios[name] = r
        if "param_grad" in kinds:
            data.spikes, data.clipped = _spike_events(run, reader,
                                                      _order(names, meta, "param_grad"))
        available = [n for k, n in hist_pairs if k == "param_grad"]
        if not available and hist_pairs:
            data.hist_kind = hist_pairs[0][0]
            available = [n for k, n in hist_pairs if k == data.hist_kind]
        available = _order(available, meta, data.hist_kind)
        if hist_names:
            chosen = []
            for pattern in hist_names:
                hits = [n for n in available if fnmatch.fnmatchcase(n, pattern)]
                if not hits:
                    raise SelectionError(
                        f"--hist {pattern!r} matches no tensor with histograms; tensors with "
                        f"histograms: {', '.join(available) or '(none: the run has no hist_bins)'}")
                chosen += [h for h in hits if h not in chosen]
        else:
            weights = [n for n in available if n.endswith("weight")]
            chosen = (weights or available)[:max_hists]
        for name in chosen:
            data.histograms[name] = run.histogram(name, data.hist_kind)
        wanted = ("gns", "gain", "rms", "value")
        if set(wanted) & set(run.stats) or any(is_slice(n) for n in names):
            health = _SeriesReader(run, wanted, ("param_grad", "grad_output", "param", "update"))
            data.health = read_health(
                _order(names, meta, "param_grad"),
                lambda n, st, k: (reader if st == "norm" else health).get(n, st, k),
                meta.get("config") or {})
    except sqlite3.Error as err:
        raise _damaged(run, err) from err
    data.anomalies, data.anomaly_source = read_anomalies(run.path)
    data.derived_anomalies = _derived_anomalies(data)
    data.metrics, data.summary = read_metrics(run.path)
    data.layers = _layers(data)
    if meta.get("status") == "running":
        data.warnings.append("status is 'running': the run is still being written, or its "
                             "writer stopped without closing it; the report shows the steps "
                             "committed so far")
    if not steps:
        data.warnings.append("the run has no stored steps yet")
    return data


def _spike_events(run: Run, reader: _SeriesReader, names: list[str]
                  ) -> tuple[list[dict[str, Any]], dict[int, float]]:
    """The run's spikes (exactly ``Run.spikes()``), one entry per step with its first tensor
    in backward order, and the steps a spike rule clipped."""
    spikes: list[dict[str, Any]] = []
    for s in run.spikes():
        if s.first:
            spikes.append({"step": s.step, "name": s.name, "z": s.score, "count": 1})
        else:
            spikes[-1]["count"] += 1
    clipped: dict[int, float] = {}
    for name in names:
        f = reader.get(name, "clip_factor", "param_grad")
        if f is not None:
            for step, value in zip(f[0].tolist(), f[1].tolist(), strict=True):
                if value < 1.0:
                    clipped[int(step)] = min(clipped.get(int(step), 1.0), float(value))
    return spikes, dict(sorted(clipped.items()))


def _damaged(run: Run, err: Exception) -> StoreError:
    return StoreError(f"the run store {str(run.path / DB_NAME)!r} is damaged and cannot be "
                      f"read: {err}")


def _derived_anomalies(data: ReportData) -> list[dict[str, Any]]:
    """First step with NaN/Inf elements of each tensor, from the stored ``nonfinite`` counts:
    by first step; within a step, the tensors of the top-level block holding a module the
    detector named as an origin at that step first, then output gradients before parameter
    gradients, in model order."""
    origins: dict[int, list[str]] = {}
    for a in data.anomalies:
        if isinstance(a.get("step"), int) and isinstance(a.get("module_name"), str):
            origins.setdefault(a["step"], []).append(a["module_name"].split(".")[0])

    def at_origin(row: dict[str, Any]) -> bool:
        name = str(row["name"])
        module = name.rpartition(":")[0] if row["kind"] == "grad_output" else name.rpartition(".")[0]
        return module.split(".")[0] in origins.get(row["step"], [])

    out = []
    for kind, by_name in data.nonfinite.items():
        for name, (st, vals) in by_name.items():
            bad = np.flatnonzero(np.nan_to_num(vals, nan=0.0) > 0)
            if len(bad):
                out.append({"step": int(st[bad[0]]), "kind": kind, "name": name,
                            "steps": int(len(bad)), "max_count": int(np.nanmax(vals[bad])),
                            "last_step": int(st[bad[-1]])})
    kind_rank = {"grad_output": 0, "param_grad": 1, "update": 2}
    out.sort(key=lambda a: (a["step"], not at_origin(a),  # stable: model order
                            kind_rank.get(str(a["kind"]), 9)))
    return out


def _layers(data: ReportData) -> list[LayerSummary]:
    shapes = {p[0]: p[1] for p in (data.meta.get("model") or {}).get("parameters", [])
              if isinstance(p, list) and len(p) >= 2}
    out = []
    for kind in ("param_grad", "grad_output"):
        for name, (st, vals) in data.norms.get(kind, {}).items():
            fin = vals[np.isfinite(vals)]
            nf = data.nonfinite.get(kind, {}).get(name)
            nsteps = int((np.nan_to_num(nf[1], nan=0.0) > 0).sum()) if nf is not None else 0
            nsteps = max(nsteps, int((~np.isfinite(vals)).sum()))
            ratio = data.ratios.get(name) if kind == "param_grad" else None
            rfin = ratio[1][np.isfinite(ratio[1]) & (ratio[1] > 0)] if ratio is not None else None
            out.append(LayerSummary(
                name=name, kind=kind, shape=shapes.get(name), steps=len(st),
                first_norm=float(vals[0]) if len(vals) else math.nan,
                last_norm=float(vals[-1]) if len(vals) else math.nan,
                median_norm=float(np.median(fin)) if len(fin) else math.nan,
                max_norm=float(fin.max()) if len(fin) else math.nan,
                nonfinite_steps=nsteps,
                last_ratio=float(rfin[-1]) if rfin is not None and len(rfin) else None,
                median_ratio=float(np.median(rfin)) if rfin is not None and len(rfin) else None,
            ))
    return out


def layer_summary(run_dir: str | os.PathLike[str] | Run) -> list[LayerSummary]:
    """Per-tensor summary (norms, non-finite steps, update ratios) of a run's gradients."""
    data = build_report_data(run_dir, max_hists=0)
    return data.layers
