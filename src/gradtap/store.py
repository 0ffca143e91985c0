"""Run store: an append-only SQLite database of per-step statistics that survives a crash.

A run directory holds ``run.db`` (schema in ``docs/run-store.md``). The writer (the
:class:`~gradtap.Monitor`) commits one transaction per computed step in WAL mode, so a
process killed at any moment leaves every completed step readable; :func:`open_run` returns a
read-only :class:`Run` over it.
"""

from __future__ import annotations

import difflib
import fnmatch
import html
import json
import math
import os
import sqlite3
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradtap._types import STAT_NAMES
from gradtap.errors import SelectionError, StoreError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from gradtap._monitor.run_spikes import Spike

__all__ = ["DB_NAME", "SCHEMA_VERSION", "Histogram", "Run", "RunWriter", "open_run",
           "set_run_meta"]

#: File name of the database inside a run directory.
DB_NAME = "run.db"
#: Version of the schema this gradtap writes and reads (``PRAGMA user_version``).
SCHEMA_VERSION = 1
#: ``PRAGMA application_id`` of a gradtap run store ("gtp1").
APPLICATION_ID = 0x67747031

KIND_NAMES = ("param_grad", "grad_output", "param", "update", "grad_cosine")
#: Every stat a run stores: the moments' statistics, then those of particular kinds.
ALL_STAT_NAMES = (*STAT_NAMES, "ratio", "cosine", "amp_scale", "zscore", "clip_factor", "gain",
                  "gns", "gns_trace", "gns_sqnorm", "value")

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE series (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, kind TEXT NOT NULL, stat TEXT NOT NULL,
    UNIQUE (name, kind, stat)
);
CREATE TABLE steps (step INTEGER PRIMARY KEY, wall_time REAL NOT NULL);
CREATE TABLE scalars (
    step INTEGER NOT NULL, series_id INTEGER NOT NULL, value REAL,
    PRIMARY KEY (step, series_id)
) WITHOUT ROWID;
-- Reading one series over all steps (Run.series, the report) must not scan every scalar.
CREATE INDEX scalars_by_series ON scalars (series_id, step);
CREATE TABLE histograms (
    step INTEGER NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, counts BLOB NOT NULL,
    PRIMARY KEY (step, kind, name)
) WITHOUT ROWID;
CREATE TABLE ewma (
    name TEXT PRIMARY KEY, beta REAL NOT NULL, updates INTEGER NOT NULL, numel INTEGER NOT NULL,
    shape TEXT NOT NULL, mean_norm REAL, mean_absmax REAL, var_mean REAL, var_max REAL
);
"""


class Histogram(tuple):
    """``(bin_edges [B+1], counts [steps, B])``, unpackable as a pair, with ``.steps`` [steps].

    ``counts[i]`` holds the finite elements of the tensor at step ``steps[i]``; values outside
    the edges are counted in the first or last bin, NaN and Inf are left to ``nonfinite``.
    """

    bin_edges: np.ndarray
    counts: np.ndarray
    steps: np.ndarray

    def __new__(cls, bin_edges: np.ndarray, counts: np.ndarray, steps: np.ndarray) -> Histogram:
        obj = super().__new__(cls, (bin_edges, counts))
        obj.bin_edges, obj.counts, obj.steps = bin_edges, counts, steps
        return obj


# -- writing ---------------------------------------------------------------------------------


class RunWriter:
    """Create a run directory and append steps to it, one transaction per step.

    Args:
        path: the run directory (created if missing).
        meta: JSON-serialisable metadata stored under its keys (``status`` is added).
        overwrite: replace an existing store in ``path`` instead of raising.

    Raises:
        StoreError: ``path`` already holds a run store and ``overwrite`` is false, or it is
            not a directory.
    """

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any], *,
                 overwrite: bool = False) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"run store path {str(self.path)!r} exists and is not a directory")
        db = self.path / DB_NAME
        if db.exists():
            if not overwrite:
                raise StoreError(
                    f"{str(self.path)!r} already holds a run store; pick a new directory, or "
                    "pass overwrite=True to replace it"
                )
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)
        self._conn: sqlite3.Connection | None = sqlite3.connect(db)
        conn = self._conn
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a committed step survives the process being killed (the OS
        # holds the WAL); only a power cut can drop the last steps.
        conn.execute("PRAGMA synchronous=NORMAL")
        with conn:
            conn.executescript(_SCHEMA)
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            meta = {**meta, "status": "running", "schema_version": SCHEMA_VERSION}
            conn.executemany("INSERT INTO meta VALUES (?, ?)",
                             [(k, json.dumps(v)) for k, v in meta.items()])

    def write_step(
        self,
        step: int,
        new_series: Sequence[tuple[int, str, str, str]],
        ids: np.ndarray,
        values: np.ndarray,
        hists: Sequence[tuple[str, str, np.ndarray]] = (),
        wall_time: float | None = None,
    ) -> None:
        """Append one step atomically.

        Args:
            step: the step number (unique).
            new_series: ``(id, name, kind, stat)`` of series first seen at this step.
            ids: series id of each value [R].
            values: the values [R] (NaN is stored as SQL NULL).
            hists: ``(kind, name, counts [B])`` histograms of this step.
            wall_time: seconds since the epoch (default: now).
        """
        conn = self._live()
        with conn:
            if new_series:
                conn.executemany("INSERT INTO series VALUES (?, ?, ?, ?)", new_series)
            conn.execute("INSERT INTO steps VALUES (?, ?)",
                         (int(step), time.time() if wall_time is None else wall_time))
            conn.executemany("INSERT INTO scalars VALUES (?, ?, ?)",
                             zip([int(step)] * len(ids), ids.tolist(), values.tolist()))
            if hists:
                conn.executemany(
                    "INSERT INTO histograms VALUES (?, ?, ?, ?)",
                    [(int(step), kind, name, np.asarray(c, dtype="<i8").tobytes())
                     for kind, name, c in hists],
                )

    def set_meta(self, **items: Any) -> None:
        """Insert or replace metadata keys (one transaction)."""
        conn = self._live()
        with conn:
            conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                             [(k, json.dumps(v)) for k, v in items.items()])

    def write_ewma(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Replace the EWMA summaries: ``(name, beta, updates, numel, shape_json, mean_norm,
        mean_absmax, var_mean, var_max)`` per parameter."""
        conn = self._live()
        with conn:
            conn.execute("DELETE FROM ewma")
            conn.executemany("INSERT INTO ewma VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def close(self, status: str = "finished") -> None:
        """Record ``status`` and the end time, fold the WAL into the database and close."""
        if self._conn is None:
            return
        try:
            self.set_meta(status=status, end_time=_now_iso())
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            # A finished run is one plain file: readers need no -wal/-shm beside it.
            self._conn.execute("PRAGMA journal_mode=DELETE")
        finally:
            self._conn.close()
            self._conn = None

    def _live(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"the run store {str(self.path)!r} was closed")
        return self._conn


def set_run_meta(path: str | os.PathLike[str], **items: Any) -> None:
    """Insert or replace metadata keys of a run store no Monitor writes any more (e.g. how the
    process that wrote it ended: ``status``, ``exit_code``).

    Raises:
        StoreError: ``path`` holds no run store.

    Example:
        >>> import tempfile, torch, gradtap as gt
        >>> d = tempfile.mkdtemp()
        >>> gt.Monitor(torch.nn.Linear(1, 1), store=d).close()
        >>> set_run_meta(d, status="failed", exit_code=3)
        >>> gt.open_run(d).meta["exit_code"]
        3
    """
    db = Path(path) / DB_NAME
    if not db.is_file():
        raise StoreError(f"{os.fspath(path)!r} holds no {DB_NAME}")
    conn = sqlite3.connect(db)
    try:
        with conn:
            conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                             [(k, json.dumps(v)) for k, v in items.items()])
    finally:
        conn.close()


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime())


# -- reading ---------------------------------------------------------------------------------


def open_run(path: str | os.PathLike[str]) -> Run:
    """Open a run directory written by a :class:`~gradtap.Monitor` with ``store=path``.

    Args:
        path: the run directory (or its ``run.db``).

    Returns:
        A read-only :class:`Run`.

    Raises:
        StoreError: no run store there, not a gradtap store, or a schema version this
            gradtap cannot read.

    Example:
        >>> import gradtap as gt, torch, tempfile
        >>> net = torch.nn.Linear(3, 1)
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with gt.Monitor(net, store=tmp.name) as mon:
        ...     net(torch.randn(4, 3)).sum().backward(); mon.step()
        >>> run = gt.open_run(tmp.name)
        >>> run.steps, run.names, run.meta["status"]
        ([0], ['bias', 'weight'], 'finished')
        >>> tmp.cleanup()
    """
    return Run(path)


class Run:
    """A read-only view of a run store: statistics, histograms, EWMA summaries, metadata.

    Every accessor reads the database afresh, so a ``Run`` over a run in progress sees the
    steps committed so far. Nothing is ever written.

    Attributes:
        path: the run directory.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        if p.name == DB_NAME and p.is_file():
            p = p.parent
        self.path = p
        self._db = p / DB_NAME
        if not self._db.is_file():
            where = "does not exist" if not p.exists() else f"holds no {DB_NAME}"
            raise StoreError(f"no run store at {str(p)!r}: the directory {where}")
        with self._connect() as conn:
            app, version = _header(conn, self._db)
        if app != APPLICATION_ID:
            raise StoreError(f"{str(self._db)!r} is an SQLite database but not a gradtap run "
                             f"store (application_id {app:#x})")
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"run store {str(p)!r} has schema version {version}, but this gradtap reads "
                f"version {SCHEMA_VERSION}; open it with the gradtap version that wrote it"
                + (" (a newer one)" if version > SCHEMA_VERSION else "")
            )

    # -- plain properties -------------------------------------------------------------------

    @property
    def meta(self) -> dict[str, Any]:
        """Run metadata: ``status`` ("running", "finished" or "failed"), ``start_time``,
        ``end_time``, ``config``, ``selected``, ``model``, ``torch_version``,
        ``gradtap_version``, ``histogram`` (bin edges) and anything passed as ``meta=``."""
        with self._connect() as conn:
            return {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta")}

    @property
    def status(self) -> str:
        """``"running"`` (being written, or the writer died), ``"finished"`` or ``"failed"``."""
        return str(self.meta.get("status"))

    @property
    def steps(self) -> list[int]:
        """Sorted step numbers stored (computed steps)."""
        with self._connect() as conn:
            return [r[0] for r in conn.execute("SELECT step FROM steps ORDER BY step")]

    @property
    def names(self) -> list[str]:
        """Sorted names with statistics (parameter names, ``"<module>:<output path>"``)."""
        with self._connect() as conn:
            return [r[0] for r in conn.execute("SELECT DISTINCT name FROM series ORDER BY name")]

    @property
    def kinds(self) -> list[str]:
        """Sorted kinds with statistics."""
        with self._connect() as conn:
            return [r[0] for r in conn.execute("SELECT DISTINCT kind FROM series ORDER BY kind")]

    @property
    def stats(self) -> list[str]:
        """Sorted statistic names stored."""
        with self._connect() as conn:
            return [r[0] for r in conn.execute("SELECT DISTINCT stat FROM series ORDER BY stat")]

    @property
    def ewma(self) -> dict[str, dict[str, Any]]:
        """EWMA summaries per parameter, written when the monitor closed (empty otherwise):
        ``beta``, ``updates``, ``numel``, ``shape``, ``mean_norm``, ``mean_absmax``,
        ``var_mean``, ``var_max``."""
        with self._connect() as conn:
            cur = conn.execute("SELECT * FROM ewma ORDER BY name")
            cols = [d[0] for d in cur.description]
            out = {}
            for row in cur:
                rec = {c: _nan(v) if isinstance(v, float) or v is None else v
                       for c, v in zip(cols[1:], row[1:])}
                rec["shape"] = json.loads(str(rec["shape"]))
                out[row[0]] = rec
            return out

    # -- data -------------------------------------------------------------------------------

    def frame(
        self,
        names: str | Sequence[str] | None = None,
        stats: str | Sequence[str] | None = None,
        kinds: str | Sequence[str] | None = None,
    ) -> pd.DataFrame:
        """Return statistics as a long pandas DataFrame: ``step, name, kind, stat, value``.

        Rows are ordered by step, then by the order in which series first appeared.

        Args:
            names: names or globs (``"layer1.*"``) to keep; default all.
            stats: statistic names to keep; default all.
            kinds: kinds to keep; default all.

        Raises:
            ImportError: pandas is missing (``pip install gradtap[pandas]``).
            ValueError: an unknown stat or kind name (the message lists the valid ones).
            SelectionError: a name glob matched nothing.
        """
        steps, ids, values, series = self.arrays(names, stats, kinds)
        return build_frame(steps, ids, values, series)

    def arrays(
        self,
        names: str | Sequence[str] | None = None,
        stats: str | Sequence[str] | None = None,
        kinds: str | Sequence[str] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[str, str, str]]]:
        """The data of :meth:`frame` without pandas: ``(steps [R], series_ids [R], values [R],
        series)``, where ``series[i]`` is ``(name, kind, stat)`` of id ``i``."""
        with self._connect() as conn:
            series = _series_table(conn)
            keep = filter_series(series, names, stats, kinds)
            if len(keep) == len(series):
                rows = conn.execute(
                    "SELECT step, series_id, value FROM scalars ORDER BY step, series_id"
                ).fetchall()
            elif keep:
                ids = ",".join(str(i) for i in keep)
                rows = conn.execute(
                    f"SELECT step, series_id, value FROM scalars WHERE series_id IN ({ids}) "
                    "ORDER BY step, series_id"
                ).fetchall()
            else:
                rows = []
        arr = np.array(rows, dtype=np.float64).reshape(-1, 3)  # NULL (NaN) -> nan
        return arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64), arr[:, 2], series

    def wall_times(self) -> dict[int, float]:
        """Seconds since the epoch at which each step was stored, by step."""
        with self._connect() as conn:
            return dict(conn.execute("SELECT step, wall_time FROM steps"))

    def series(self, name: str, stat: str, kind: str = "param_grad") -> tuple[np.ndarray, np.ndarray]:
        """Return ``(steps, values)`` of one statistic as numpy arrays (no pandas needed).

        Raises:
            KeyError: no such series (the message names close matches).
        """
        with self._connect() as conn:
            row = conn.execute("SELECT id FROM series WHERE name=? AND kind=? AND stat=?",
                               (name, kind, stat)).fetchone()
            if row is None:
                raise KeyError(self._missing(conn, name, f"{kind}/{stat}"))
            data = conn.execute(
                "SELECT step, value FROM scalars WHERE series_id=? ORDER BY step", (row[0],)
            ).fetchall()
        arr = np.array(data, dtype=np.float64).reshape(-1, 2)
        return arr[:, 0].astype(np.int64), arr[:, 1]

    def histogram(self, name: str, kind: str = "param_grad") -> Histogram:
        """Return ``(bin_edges [B+1], counts [steps, B])`` of one tensor; ``.steps`` [steps].

        Raises:
            KeyError: no histograms of that name and kind (histograms need ``hist_bins``).
        """
        edges = self.meta.get("histogram", {}).get("edges")
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT step, counts FROM histograms WHERE name=? AND kind=? ORDER BY step",
                (name, kind),
            ).fetchall()
            if edges is None:
                raise KeyError(NO_HISTOGRAMS)
            if not rows:
                raise KeyError(self._missing(conn, name, f"{kind} histograms"))
        counts = np.stack([np.frombuffer(c, dtype="<i8") for _, c in rows]).astype(np.int64)
        return Histogram(np.asarray(edges, dtype=np.float64), counts,
                         np.array([s for s, _ in rows], dtype=np.int64))

    def spikes(self, threshold: float | None = None, warmup: int | None = None) -> list[Spike]:
        """The run's gradient spikes: each ``(step, parameter)`` whose stored gradient norm left
        its own running baseline by more than ``threshold`` (a robust z-score of the log-norm;
        default 6) after ``warmup`` values of its history (default 20), as
        :class:`~gradtap.Spike`, by step then in backward order; ``first`` marks each step's
        first. Exact definition: ``docs/semantics.md``, "Gradient spikes".

        Raises:
            ValueError: a bad ``threshold`` or ``warmup``.
        """
        from gradtap._monitor.run_spikes import spikes_of

        return spikes_of(self, threshold, warmup)

    def histogram_names(self) -> list[tuple[str, str]]:
        """Sorted ``(kind, name)`` pairs that have histograms."""
        with self._connect() as conn:
            return [tuple(r) for r in conn.execute(  # type: ignore[misc]
                "SELECT DISTINCT kind, name FROM histograms ORDER BY kind, name")]

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    def _repr_html_(self) -> str:
        """The run in a small table (status, steps, tensors, statistics), for notebooks."""
        steps = self.steps
        rows = [("path", str(self.path)), ("status", str(self.status)),
                ("steps", f"{len(steps)}" + (f" ({steps[0]}-{steps[-1]})" if steps else "")),
                ("tensors", str(len(self.names))), ("kinds", ", ".join(self.kinds)),
                ("stats", ", ".join(self.stats))]
        body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                       for k, v in rows)
        return f"<table>{body}</table>"

    # -- helpers ----------------------------------------------------------------------------

    def _connect(self) -> _Connection:
        return _Connection(self._db)

    def _missing(self, conn: sqlite3.Connection, name: str, what: str) -> str:
        names = [r[0] for r in conn.execute("SELECT DISTINCT name FROM series")]
        return missing_message(name, names, what, repr(str(self.path)))


class _Connection:
    """A read-only connection that is always closed (``with`` in sqlite3 only commits)."""

    def __init__(self, db: Path) -> None:
        try:
            self.conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        except sqlite3.Error as err:
            raise StoreError(f"cannot open run store {str(db)!r}: {err}") from err

    def __enter__(self) -> sqlite3.Connection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


def _header(conn: sqlite3.Connection, db: Path) -> tuple[int, int]:
    try:
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as err:
        raise StoreError(f"{str(db)!r} is not a readable SQLite database: {err}") from err
    return int(app), int(version)


def _nan(v: float | None) -> float:
    return math.nan if v is None else v


def _series_table(conn: sqlite3.Connection) -> list[tuple[str, str, str]]:
    rows = conn.execute("SELECT id, name, kind, stat FROM series ORDER BY id").fetchall()
    table: list[tuple[str, str, str]] = []
    for i, name, kind, stat in rows:
        if i != len(table):
            raise StoreError(f"series ids are not consecutive (id {i} at position {len(table)})")
        table.append((name, kind, stat))
    return table


# -- shared with the Monitor's in-memory history ---------------------------------------------

#: The KeyError message of ``histogram()`` on a run recorded without histograms.
NO_HISTOGRAMS = ("the run has no histograms (hist_bins=None): histograms are off; pass "
                 "hist_bins=N to Monitor")


def missing_message(name: str, names: Iterable[str], what: str, where: str) -> str:
    """The KeyError message for a name a run lacks, naming close matches among ``names``."""
    close = difflib.get_close_matches(name, list(names), n=5, cutoff=0.5)
    hint = f"; close names: {', '.join(close)}" if close else ""
    return f"no {what} for {name!r} in {where}{hint}"


def _as_list(x: str | Iterable[str] | None) -> list[str] | None:
    if x is None:
        return None
    return [x] if isinstance(x, str) else list(x)


def filter_series(
    series: Sequence[tuple[str, str, str]],
    names: str | Sequence[str] | None,
    stats: str | Sequence[str] | None,
    kinds: str | Sequence[str] | None,
) -> list[int]:
    """Ids of the series ``(name, kind, stat)`` that pass the filters of ``frame()``."""
    stat_list, kind_list, name_list = _as_list(stats), _as_list(kinds), _as_list(names)
    for given, valid, what in ((stat_list, ALL_STAT_NAMES, "stat"), (kind_list, KIND_NAMES, "kind")):
        bad = [g for g in given or () if g not in valid]
        if bad:
            raise ValueError(f"unknown {what} name(s) {', '.join(map(repr, bad))}; valid "
                             f"{what}s are: {', '.join(valid)}")
    keep = set(range(len(series)))
    if stat_list is not None:
        keep &= {i for i, s in enumerate(series) if s[2] in stat_list}
    if kind_list is not None:
        keep &= {i for i, s in enumerate(series) if s[1] in kind_list}
    if name_list is not None:
        all_names = sorted({s[0] for s in series})
        matched: set[str] = set()
        for pattern in name_list:
            hits = {n for n in all_names if fnmatch.fnmatchcase(n, pattern)}
            if not hits:
                close = difflib.get_close_matches(pattern, all_names, n=5, cutoff=0.5)
                hint = f"; close names: {', '.join(close)}" if close else ""
                raise SelectionError(f"names={pattern!r} matches no recorded name{hint}")
            matched |= hits
        keep &= {i for i, s in enumerate(series) if s[0] in matched}
    return sorted(keep)


def build_frame(
    steps: np.ndarray, ids: np.ndarray, values: np.ndarray, series: Sequence[tuple[str, str, str]],
    keep: Sequence[int] | None = None,
) -> pd.DataFrame:
    """The long DataFrame ``step, name, kind, stat, value``, sorted by (step, series id)."""
    pd = import_pandas("frame()")
    if keep is not None and len(keep) != len(series):
        mask = np.isin(ids, np.asarray(keep, dtype=np.int64))
        steps, ids, values = steps[mask], ids[mask], values[mask]
    order = np.lexsort((ids, steps))
    steps, ids, values = steps[order], ids[order], values[order]
    table = np.array(series, dtype=object).reshape(-1, 3)
    return pd.DataFrame({
        "step": steps.astype(np.int64),
        "name": pd.array(table[ids, 0] if len(ids) else [], dtype=object),
        "kind": pd.array(table[ids, 1] if len(ids) else [], dtype=object),
        "stat": pd.array(table[ids, 2] if len(ids) else [], dtype=object),
        "value": values.astype(np.float64),
    })


def import_pandas(what: str) -> Any:
    """Import pandas, or raise an ImportError naming the extra to install."""
    try:
        import pandas as pd
    except ImportError as err:
        raise ImportError(
            f"{what} needs pandas, an optional dependency of gradtap: pip install gradtap[pandas]"
        ) from err
    return pd
