"""Reading a run store: :func:`open_run` and the read-only :class:`Run`."""

from __future__ import annotations

import html
import json
import math
import os
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradtap.errors import StoreError
from gradtap.store._common import (
    APPLICATION_ID,
    DB_NAME,
    NO_HISTOGRAMS,
    SCHEMA_VERSION,
    Histogram,
    build_frame,
    filter_series,
    live_status,
    missing_message,
    series_kind,
    series_table,
)
from gradtap.store._rows import Block, ChunkRows, SqlRows

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from gradtap._monitor.run_spikes import Spike


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

    Every accessor reads the store afresh, so a ``Run`` over a run in progress sees the steps
    stored so far. Nothing is ever written. Stores of schema 1 (one SQLite row per value) are
    read as well.

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
        if version not in (1, SCHEMA_VERSION):
            raise StoreError(
                f"run store {str(p)!r} has schema version {version}, but this gradtap reads "
                f"versions 1 to {SCHEMA_VERSION}; open it with the gradtap version that wrote it"
                + (" (a newer one)" if version > SCHEMA_VERSION else "")
            )
        #: The schema version of the store (1: the all-SQLite layout of older gradtap).
        self.schema_version = version
        self._rows: ChunkRows | SqlRows = ChunkRows(p) if version == 2 else SqlRows()

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
        """``"running"`` (being written), ``"finished"``, ``"failed"`` or ``"killed"``: stored
        as running, but its writing process (on this host) is gone (see ``docs/run-store.md``)."""
        return live_status(self.meta)

    @property
    def steps(self) -> list[int]:
        """Sorted step numbers stored (computed steps)."""
        return self.step_array().tolist()  # type: ignore[no-any-return]

    def step_array(self) -> np.ndarray:
        """The stored step numbers as an int64 array (:attr:`steps` without the list)."""
        with self._connect() as conn:
            return self._rows.steps(conn)[0]

    @property
    def names(self) -> list[str]:
        """Sorted names with statistics (parameter names, ``"<module>:<output path>"``)."""
        return self._distinct("name")

    @property
    def kinds(self) -> list[str]:
        """Sorted kinds with statistics."""
        return self._distinct("kind")

    @property
    def stats(self) -> list[str]:
        """Sorted statistic names stored."""
        return self._distinct("stat")

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

        Rows are ordered by step, then by series id (the order in which series first
        appeared). The whole selection is in memory at once: select names, stats or kinds, or
        read a large store with :meth:`iter_frames`.

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

    def iter_frames(
        self,
        names: str | Sequence[str] | None = None,
        stats: str | Sequence[str] | None = None,
        kinds: str | Sequence[str] | None = None,
    ) -> Iterator[pd.DataFrame]:
        """:meth:`frame` in pieces of consecutive steps (one stored chunk each), so a store of
        any size reads in bounded memory; concatenated they are :meth:`frame`."""
        series, keep = self._select(names, stats, kinds)
        for steps, ids, values in self._blocks(keep, len(series)):
            yield build_frame(steps, ids, values, series)

    def iter_arrays(
        self,
        names: str | Sequence[str] | None = None,
        stats: str | Sequence[str] | None = None,
        kinds: str | Sequence[str] | None = None,
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`arrays` in pieces of consecutive steps (one stored chunk each): ``(steps [R],
        series_ids [R], values [R])`` per piece, ordered by (step, series id); the ids index
        ``arrays()[3]`` (or the ``series`` table)."""
        series, keep = self._select(names, stats, kinds)
        yield from self._blocks(keep, len(series))

    def arrays(
        self,
        names: str | Sequence[str] | None = None,
        stats: str | Sequence[str] | None = None,
        kinds: str | Sequence[str] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[str, str, str]]]:
        """The data of :meth:`frame` without pandas: ``(steps [R], series_ids [R], values [R],
        series)``, where ``series[i]`` is ``(name, kind, stat)`` of id ``i``."""
        series, keep = self._select(names, stats, kinds)
        blocks = list(self._blocks(keep, len(series)))
        if not blocks:
            return (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0),
                    series)
        return (np.concatenate([b[0] for b in blocks]), np.concatenate([b[1] for b in blocks]),
                np.concatenate([b[2] for b in blocks]), series)

    def series_keys(self) -> list[tuple[str, str, str]]:
        """``(name, kind, stat)`` of every series, indexed by series id (the ids of
        :meth:`arrays`), read from the catalogue alone."""
        return self._select(None, None, None)[0]

    def wall_times(self) -> dict[int, float]:
        """Seconds since the epoch at which each step was stored, by step."""
        with self._connect() as conn:
            steps, walls = self._rows.steps(conn)
        return dict(zip(steps.tolist(), walls.tolist()))

    def series(self, name: str, stat: str, kind: str | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(steps, values)`` of one statistic as numpy arrays (no pandas needed).
        ``kind`` defaults to ``"param_grad"``, and to ``"health"`` for ``"<loss>"`` and
        ``"<scaler>"`` and ``"<clip>"`` (``"param_grad"`` in runs stored before that kind).

        Raises:
            KeyError: no such series (the message names close matches).
        """
        with self._connect() as conn:
            def sid(k: str) -> Any:
                return conn.execute("SELECT id FROM series WHERE name=? AND kind=? AND stat=?",
                                    (name, k, stat)).fetchone()

            kind = series_kind(name, kind, lambda k: sid(k) is not None)
            row = sid(kind)
            if row is None:
                raise KeyError(self._missing(conn, name, f"{kind}/{stat}"))
            return self._rows.series(conn, int(row[0]))

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
            steps = np.array([s for s, _ in rows], dtype=np.int64)
            # a step cut off by a kill may have committed its histograms, not its values
            stored = np.isin(steps, self._rows.steps(conn)[0])
        counts = np.stack([np.frombuffer(c, dtype="<i8") for _, c in rows]).astype(np.int64)
        return Histogram(np.asarray(edges, dtype=np.float64), counts[stored], steps[stored])

    def spikes(self, threshold: float | None = None, warmup: int | None = None) -> list[Spike]:
        """The run's gradient spikes: each ``(step, parameter)`` whose stored gradient norm left
        its own running baseline by more than ``threshold`` (a robust z-score of the log-norm;
        default 6) after ``warmup`` values of its history (default 20), as
        :class:`~gradtap.Spike`, by step then in backward order; ``first`` marks each step's
        first. Exact definition: ``docs/semantics.md``, "Gradient spikes". Reads the norms one
        series at a time into one table (8 bytes per step and tensor).

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
        steps = self.step_array()
        rows = [("path", str(self.path)), ("status", str(self.status)),
                ("steps", f"{len(steps)}" + (f" ({steps[0]}-{steps[-1]})" if len(steps) else "")),
                ("tensors", str(len(self.names))), ("kinds", ", ".join(self.kinds)),
                ("stats", ", ".join(self.stats))]
        body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                       for k, v in rows)
        return f"<table>{body}</table>"

    # -- helpers ----------------------------------------------------------------------------

    def _connect(self) -> _Connection:
        return _Connection(self._db)

    def _distinct(self, column: str) -> list[str]:
        with self._connect() as conn:
            return [r[0] for r in conn.execute(
                f"SELECT DISTINCT {column} FROM series ORDER BY {column}")]

    def _select(self, names: str | Sequence[str] | None, stats: str | Sequence[str] | None,
                kinds: str | Sequence[str] | None) -> tuple[list[tuple[str, str, str]], list[int]]:
        with self._connect() as conn:
            series = series_table(conn.execute(
                "SELECT id, name, kind, stat FROM series ORDER BY id"))
        return series, filter_series(series, names, stats, kinds)

    def _blocks(self, keep: list[int], n_series: int) -> Iterator[Block]:
        if not keep:
            return
        with self._connect() as conn:
            yield from self._rows.blocks(
                conn, None if len(keep) == n_series else np.asarray(keep, dtype=np.int64))

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
