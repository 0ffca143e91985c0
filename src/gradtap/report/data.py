"""The report's plain data model, built from a run directory; no HTML here.

A run directory holds the Monitor's ``run.db`` and, optionally, two JSON side files that
``gradtap demo`` (or your own loop) writes next to it:

* ``anomalies.json``: ``{"version": 1, "source": str, "anomalies": [{"step", "module_name",
  "kind", "where", "message", ...}, ...]}`` (with ``detect(samples=True)`` also
  ``"samples"`` and ``"sample_ids"``, lists), e.g. ``det.anomalies`` of :func:`gradtap.detect`
  saved with :func:`write_anomalies`;
* ``metrics.json``: ``{"version": 1, "series": {name: {"steps": [...], "values": [...]}},
  "summary": {name: number}}``, e.g. the loss per step, saved with :func:`write_metrics`.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradtap.errors import StoreError
from gradtap.report.health import HealthData, is_slice, read_health
from gradtap.report.layers import TOP_K, Heat, LayerSummary, nonfinite_row, scan_kind, top_layers
from gradtap.store import DB_NAME, Run, open_run

__all__ = [
    "ANOMALIES_FILE", "METRICS_FILE", "LayerSummary", "ReportData", "RunInfo",
    "anomaly_to_dict", "build_report_data", "layer_summary", "list_runs", "read_anomalies",
    "read_metrics", "write_anomalies", "write_metrics",
]

ANOMALIES_FILE = "anomalies.json"
METRICS_FILE = "metrics.json"
#: The row of a script's own gradient clip (its total norm and factor), no tensor.
CLIP_ROW = "<clip>"

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
                               meta.get("start_time"), run.status))
        except (StoreError, OSError, sqlite3.Error, ValueError) as err:
            out.append(RunInfo(d, None, None, None, "unreadable", str(err)))
    return out


# -- the report's data model ---------------------------------------------------------------------

Series = tuple[np.ndarray, np.ndarray]


@dataclass
class ReportData:
    """Everything the HTML report shows, read from one run directory.

    ``layers`` holds every tensor's summary (the layer table); the per-step series in
    ``norms``, ``nonfinite`` and ``ratios`` are those of the charted layers only (all of a
    kind when it has at most :data:`~gradtap.report.layers.TOP_K` tensors, else the layers
    that matter, see :func:`~gradtap.report.layers.top_layers`); ``heat`` has every tensor.
    """

    path: Path
    meta: dict[str, Any]
    steps: list[int]
    # kind -> name -> (steps, values), of the charted tensors
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
    # kind -> the layers-by-steps heatmap of every tensor of that kind
    heat: dict[str, Heat] = field(default_factory=dict)
    # kind -> how many tensors of that kind the run stored (charted or not)
    tensors: dict[str, int] = field(default_factory=dict)


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
    """One series at a time through ``Run.series()``, asked only for series the run holds.

    Which ``(name, kind, stat)`` series exist comes from the run's catalogue
    (``Run.series_keys()``; an in-memory run's ``arrays(names=[])`` returns the same table
    without reading a value); where neither is available, a missing series is a ``KeyError``
    of ``Run.series()``.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.keys: set[tuple[str, str, str]] | None
        try:
            keys = getattr(run, "series_keys", None)
            table = keys() if keys is not None else run.arrays(names=[])[3]
            self.keys = {(str(n), str(k), str(s)) for n, k, s in table}
        except (TypeError, ValueError, LookupError, AttributeError):
            self.keys = None

    def has(self, name: str, stat: str, kind: str) -> bool:
        return self.keys is None or (name, kind, stat) in self.keys

    def names(self, stat: str, kind: str) -> list[str] | None:
        """The names with series ``(kind, stat)``, or ``None`` when unknown."""
        if self.keys is None:
            return None
        return sorted({n for n, k, s in self.keys if k == kind and s == stat})

    def get(self, name: str, stat: str, kind: str) -> Series | None:
        if not self.has(name, stat, kind):
            return None
        try:
            return self.run.series(name, stat, kind)
        except KeyError:
            return None


def build_report_data(run_dir: str | os.PathLike[str] | Run,
                      hist_names: Sequence[str] | None = None, max_hists: int = 6,
                      top_k: int = TOP_K) -> ReportData:
    """Read everything the report needs from a run directory (or an open :class:`Run`).

    One tensor at a time: memory does not grow with the number of tensors times the number
    of steps beyond the charted layers' series.

    Args:
        run_dir: the run directory.
        hist_names: globs of tensors whose histograms to show (default: the weights' gradients,
            up to ``max_hists``).
        max_hists: how many histograms at most when ``hist_names`` is not given.
        top_k: how many tensors of a kind to chart at most (the layers that matter).

    Raises:
        StoreError: no readable run store there, or a side file is corrupt.
        SelectionError: a ``hist_names`` glob matches no histogram.
    """
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
    shapes = {p[0]: p[1] for p in (meta.get("model") or {}).get("parameters", [])
              if isinstance(p, list) and len(p) >= 2}
    try:
        reader = _SeriesReader(run)
        rows: list[dict[str, Any]] = []
        if "param_grad" in kinds:
            data.spikes, data.clipped = _spike_events(run, reader,
                                                      _order(names, meta, "param_grad"), steps)
        spiking = [e["name"] for e in data.spikes]
        for kind in ("param_grad", "grad_output", "health"):
            if kind not in kinds:
                continue
            known = reader.names("norm", kind)
            # split= slices have a panel of their own (the experts' heatmaps); "<clip>" (the
            # script's clip, its total norm) is no tensor
            kind_names = _order([n for n in (names if known is None else known)
                                 if not is_slice(n) and n != CLIP_ROW
                                 and reader.has(n, "norm", kind)], meta, kind)
            layers, heat, bad = scan_kind(
                reader.get, kind_names, kind, steps, shapes,
                lambda n: reader.get(n, "ratio", "update") if "update" in kinds else None)
            rows += bad
            # rows without a norm that count NaN/Inf (the "<scaler>" row's overflows)
            others = reader.names("nonfinite", kind)
            scanned = set(kind_names)
            for name in _order([n for n in (names if others is None else others)
                                if n not in scanned], meta, kind):
                row = nonfinite_row(reader.get, name, kind)
                if row is not None:
                    rows.append(row)
            if not layers:
                continue
            data.layers += layers
            data.heat[kind] = heat
            data.tensors[kind] = len(layers)
            for name in top_layers(layers, top_k, spiking if kind == "param_grad" else ()):
                s = reader.get(name, "norm", kind)
                if s is not None:
                    data.norms.setdefault(kind, {})[name] = s
                nf = reader.get(name, "nonfinite", kind)
                if nf is not None:
                    data.nonfinite.setdefault(kind, {})[name] = nf
                if kind == "param_grad" and "update" in kinds:
                    r = reader.get(name, "ratio", "update")
                    if r is not None:
                        data.ratios[name] = r
        if "update" in kinds:
            for name in _order(names, meta, "update"):
                row = nonfinite_row(reader.get, name, "update")
                if row is not None:
                    rows.append(row)
        _histograms(run, data, hist_pairs, meta, hist_names, max_hists)
        wanted = ("gns", "gain", "rms", "value")
        if set(wanted) & set(run.stats) or any(is_slice(n) for n in names):
            charted = [n for by_name in data.norms.values() for n in by_name]
            order = _order(names, meta, "param_grad")
            rank = {n: i for i, n in enumerate(charted)}
            data.health = read_health(
                sorted(order, key=lambda n: rank.get(n, len(rank))),  # charted layers first
                _capped(reader, top_k), meta.get("config") or {})
    except sqlite3.Error as err:
        raise _damaged(run, err) from err
    data.anomalies, data.anomaly_source = read_anomalies(run.path)
    data.derived_anomalies = _derived_anomalies(data.anomalies, rows)
    data.metrics, data.summary = read_metrics(run.path)
    status = run.status
    if status == "running":
        data.warnings.append("status is 'running': the run is still being written (or its "
                             "writer, on another host, stopped without closing it); the "
                             "report shows the steps committed so far")
    elif status == "killed":
        data.warnings.append("status is 'killed': the process writing the run ended without "
                             "closing it; the report shows every step it committed")
    if not steps:
        data.warnings.append("the run has no stored steps yet")
    return data


def _capped(reader: _SeriesReader, k: int) -> Callable[[str, str, str], Series | None]:
    """``reader.get`` that gives at most ``k`` series of each ``(stat, kind)`` (besides the
    slices of split parameters and the ``<...>`` rows), so that no panel draws more lines."""
    taken: dict[tuple[str, str], int] = {}

    def get(name: str, stat: str, kind: str) -> Series | None:
        if not reader.has(name, stat, kind):
            return None
        exempt = name.startswith("<") or is_slice(name)
        if not exempt and taken.get((stat, kind), 0) >= k:
            return None
        s = reader.get(name, stat, kind)
        if s is not None and not exempt:
            taken[(stat, kind)] = taken.get((stat, kind), 0) + 1
        return s
    return get


def _histograms(run: Run, data: ReportData, hist_pairs: list[tuple[str, str]],
                meta: dict[str, Any], hist_names: Sequence[str] | None, max_hists: int) -> None:
    """The histograms to show: ``hist_names``' matches, else the first weights'."""
    import fnmatch

    from gradtap.errors import SelectionError

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
        charted = set(data.norms.get(data.hist_kind, {}))
        weights = [n for n in available if n.endswith("weight")]
        pool = weights or available
        chosen = ([n for n in pool if n in charted] + [n for n in pool if n not in charted]
                  )[:max_hists] if len(pool) > max_hists else pool
    for name in chosen:
        data.histograms[name] = run.histogram(name, data.hist_kind)


def _spike_events(run: Run, reader: _SeriesReader, names: list[str], steps: Sequence[int]
                  ) -> tuple[list[dict[str, Any]], dict[int, float]]:
    """The run's spikes (exactly ``Run.spikes()``), one entry per step with its first tensor
    in backward order and how many tensors spiked there, and the steps a spike rule clipped
    (the smallest factor of each)."""
    spikes: list[dict[str, Any]] = []
    for s in run.spikes():
        if s.first:
            spikes.append({"step": s.step, "name": s.name, "z": s.score, "count": 1})
        else:
            spikes[-1]["count"] += 1
    all_steps = np.asarray(steps, dtype=np.int64)
    clip = np.ones(len(all_steps))
    for name in names:
        f = reader.get(name, "clip_factor", "param_grad")
        if f is not None:
            pos = np.searchsorted(all_steps, f[0][f[1] < 1.0])
            clip[pos] = np.minimum(clip[pos], f[1][f[1] < 1.0])
    return spikes, {int(all_steps[i]): float(clip[i]) for i in np.flatnonzero(clip < 1.0)}


def _damaged(run: Run, err: Exception) -> StoreError:
    return StoreError(f"the run store {str(run.path / DB_NAME)!r} is damaged and cannot be "
                      f"read: {err}")


def _derived_anomalies(anomalies: list[dict[str, Any]], rows: list[dict[str, Any]]
                       ) -> list[dict[str, Any]]:
    """First step with NaN/Inf elements of each tensor, from the stored ``nonfinite`` counts
    (``rows``, in model order per kind): by first step; within a step, the tensors of the
    top-level block holding a module the detector named as an origin at that step first,
    then output gradients before parameter gradients, in model order."""
    origins: dict[int, list[str]] = {}
    for a in anomalies:
        if isinstance(a.get("step"), int) and isinstance(a.get("module_name"), str):
            origins.setdefault(a["step"], []).append(a["module_name"].split(".")[0])

    def at_origin(row: dict[str, Any]) -> bool:
        name = str(row["name"])
        module = name.rpartition(":")[0] if row["kind"] == "grad_output" else name.rpartition(".")[0]
        return module.split(".")[0] in origins.get(row["step"], [])

    kind_rank = {"grad_output": 0, "param_grad": 1, "update": 2}
    out = sorted(rows, key=lambda a: (a["step"], not at_origin(a),  # stable: model order
                                      kind_rank.get(str(a["kind"]), 9)))
    return out


def layer_summary(run_dir: str | os.PathLike[str] | Run) -> list[LayerSummary]:
    """Per-tensor summary (norms, non-finite steps, update ratios) of a run's gradients."""
    data = build_report_data(run_dir, max_hists=0)
    return data.layers
