"""Writing a run store: one appended record per step, compacted into series-major chunks."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradtap.errors import StoreError
from gradtap.store._common import (
    APPLICATION_ID,
    DB_NAME,
    SCHEMA,
    SCHEMA_VERSION,
    VALUES_NAME,
    chunk_matrix,
    chunk_steps,
    encode_record,
    quiet_nans,
    segment_name,
    writer_identity,
)


class RunWriter:
    """Create a run directory and append steps to it, each whole or not at all.

    A step is one record appended to the current chunk's log (``rows-NNNNNN.log``) with one
    ``write``; new series and histograms of the step are committed to ``run.db`` just before.
    Every ``chunk_steps`` steps the log is compacted into ``values.f64`` (series-major), the
    chunk is entered in ``run.db`` and the log removed: no page is rewritten per step.

    Args:
        path: the run directory (created if missing).
        meta: JSON-serialisable metadata stored under its keys (``status`` is added).
        overwrite: replace an existing store in ``path`` instead of raising.
        chunk_steps: steps per chunk (default: as many as keep a chunk near 2**20 values,
            between 16 and 4096).

    Raises:
        StoreError: ``path`` already holds a run store and ``overwrite`` is false, or it is
            not a directory.
    """

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any], *,
                 overwrite: bool = False, chunk_steps: int | None = None) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"run store path {str(self.path)!r} exists and is not a directory")
        if chunk_steps is not None and (not isinstance(chunk_steps, int) or chunk_steps < 1):
            raise StoreError(f"chunk_steps must be a positive int, got {chunk_steps!r}")
        db = self.path / DB_NAME
        if db.exists():
            if not overwrite:
                raise StoreError(
                    f"{str(self.path)!r} already holds a run store; pick a new directory, or "
                    "pass overwrite=True to replace it"
                )
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)
            (self.path / VALUES_NAME).unlink(missing_ok=True)
            for log in self.path.glob("rows-*.log"):
                log.unlink()
        self.path.mkdir(parents=True, exist_ok=True)
        self._conn: sqlite3.Connection | None = sqlite3.connect(db)
        conn = self._conn
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a commit survives the process being killed (the OS holds the
        # WAL); only a power cut can drop the last ones. The step records are plain writes,
        # held by the OS the same way.
        conn.execute("PRAGMA synchronous=NORMAL")
        with conn:
            conn.executescript(SCHEMA)
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            meta = {**meta, "status": "running", "writer": writer_identity(),
                    "schema_version": SCHEMA_VERSION}
            conn.executemany("INSERT INTO meta VALUES (?, ?)",
                             [(k, json.dumps(v)) for k, v in meta.items()])
        self._values = os.open(self.path / VALUES_NAME,
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
        self._offset = 0
        self._chunk_steps = chunk_steps
        self._chunk = 0  # number of the chunk being logged
        self._log: int | None = None
        self._limit = 0  # steps of the chunk being logged
        self._rows: list[tuple[np.ndarray, np.ndarray]] = []
        self._steps: list[int] = []
        self._walls: list[float] = []
        self._last_ids: np.ndarray | None = None
        self._last_step: int | None = None
        self._layout: np.ndarray | None = None
        self._layout_id = -1

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
            step: the step number (larger than the last one written).
            new_series: ``(id, name, kind, stat)`` of series first seen at this step.
            ids: series id of each value [R].
            values: the values [R] (every NaN is stored as the quiet NaN).
            hists: ``(kind, name, counts [B])`` histograms of this step.
            wall_time: seconds since the epoch (default: now).

        Raises:
            StoreError: the writer was closed, or ``step`` is not after the last step.
        """
        conn = self._live()
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            raise StoreError(f"step {step} written after step {self._last_step}: steps of a run "
                             "store must increase")
        ids = np.asarray(ids)
        if len(ids) != len(values):
            raise StoreError(f"write_step got {len(ids)} series ids for {len(values)} values")
        if new_series or hists:
            with conn:
                if new_series:
                    conn.executemany("INSERT INTO series VALUES (?, ?, ?, ?)", new_series)
                if hists:
                    conn.executemany(
                        "INSERT INTO histograms VALUES (?, ?, ?, ?)",
                        [(step, kind, name, np.asarray(c, dtype="<i8").tobytes())
                         for kind, name, c in hists],
                    )
        wall = time.time() if wall_time is None else float(wall_time)
        values = quiet_nans(values)
        if self._log is None:
            self._limit = self._chunk_steps or chunk_steps(len(values))
            self._log = os.open(self.path / segment_name(self._chunk),
                                os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
            self._last_ids = None
        same = self._last_ids is not None and (
            ids is self._last_ids or np.array_equal(ids, self._last_ids))
        if not same:
            ids = ids.astype(np.int64, copy=True)
        else:
            ids = self._last_ids  # type: ignore[assignment]
        os.write(self._log, encode_record(step, wall, None if same else ids, values))
        self._last_ids, self._last_step = ids, step
        self._rows.append((ids, values))
        self._steps.append(step)
        self._walls.append(wall)
        if len(self._rows) >= self._limit:
            self._compact()

    def _compact(self) -> None:
        """Write the logged steps as one series-major chunk, enter it in the catalogue, drop
        the log. A kill in between leaves the log, which readers use until the chunk is in."""
        conn = self._live()
        if self._log is None:
            return
        layout, matrix = chunk_matrix(self._rows)
        data = matrix.astype("<f8", copy=False).tobytes()
        view = memoryview(data)
        while view:
            view = view[os.write(self._values, view):]
        with conn:
            if self._layout is None or not np.array_equal(layout, self._layout):
                self._layout_id += 1
                self._layout = layout
                conn.execute("INSERT INTO layouts VALUES (?, ?)",
                             (self._layout_id, layout.astype("<i4").tobytes()))
            conn.execute(
                "INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (self._chunk, self._steps[0], self._steps[-1], len(self._steps), self._layout_id,
                 self._offset, np.asarray(self._steps, dtype="<i8").tobytes(),
                 np.asarray(self._walls, dtype="<f8").tobytes()))
        self._offset += len(data)
        os.close(self._log)
        (self.path / segment_name(self._chunk)).unlink()
        self._log = None
        self._chunk += 1
        self._rows, self._steps, self._walls = [], [], []

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
        """Compact the last steps, record ``status`` and the end time, fold the WAL into the
        database and close."""
        if self._conn is None:
            return
        try:
            self._compact()
            self.set_meta(status=status, end_time=_now_iso())
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            # A finished run is run.db and values.f64: readers need no -wal/-shm beside them.
            self._conn.execute("PRAGMA journal_mode=DELETE")
        finally:
            self._conn.close()
            self._conn = None
            os.close(self._values)
            if self._log is not None:
                os.close(self._log)
                self._log = None

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
