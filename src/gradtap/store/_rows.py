"""Where a run's statistics are read from: the chunks of schema 2, or the ``scalars`` table of
schema 1. Both hand out numpy arrays, chunk by chunk."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradtap.store._common import VALUES_NAME, chunk_matrix, decode_records, present

#: ``(steps [R], series_ids [R], values [R])`` of some steps, ordered by (step, series id).
Block = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass
class Chunk:
    """Steps ``steps`` with wall times ``walls``; values of the series ``layout`` (sorted ids),
    series-major, at ``offset`` in ``values.f64`` or held in ``matrix`` (a log not compacted)."""

    steps: np.ndarray
    walls: np.ndarray
    layout: np.ndarray
    offset: int = 0
    matrix: np.ndarray | None = None


class ChunkRows:
    """Reader of schema 2: compacted chunks (catalogue in ``run.db``) and the logs after them.

    Chunks are immutable once in the catalogue, so they are kept between calls; a log is read
    again only when its size or time changed.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._chunks: list[Chunk] = []
        self._layouts: dict[int, np.ndarray] = {}
        self._logs: dict[str, tuple[tuple[int, int], Chunk | None]] = {}

    def chunks(self, conn: sqlite3.Connection) -> list[Chunk]:
        """Every stored chunk, in step order (the logs are read before the catalogue, so a log
        compacted meanwhile is found in the catalogue)."""
        logs = self._read_logs()
        done = len(self._chunks)
        rows = conn.execute("SELECT id, layout_id, offset, steps, wall_times FROM chunks "
                            "WHERE id >= ? ORDER BY id", (done,)).fetchall()
        if rows:
            for lid, blob in conn.execute("SELECT id, series_ids FROM layouts WHERE id >= ?",
                                          (len(self._layouts),)):
                self._layouts[lid] = np.frombuffer(blob, dtype="<i4").astype(np.int64)
        for _, lid, offset, steps, walls in rows:
            self._chunks.append(Chunk(np.frombuffer(steps, dtype="<i8").astype(np.int64),
                                      np.frombuffer(walls, dtype="<f8").astype(np.float64),
                                      self._layouts[lid], int(offset)))
        n = len(self._chunks)
        return self._chunks + [c for i, c in sorted(logs.items()) if i >= n]

    def _read_logs(self) -> dict[int, Chunk]:
        out: dict[int, Chunk] = {}
        names = sorted(p.name for p in self.path.glob("rows-*.log"))
        for name in names:
            try:
                with open(self.path / name, "rb") as f:
                    st = os.fstat(f.fileno())
                    key = (st.st_size, st.st_mtime_ns)
                    cached = self._logs.get(name)
                    if cached is None or cached[0] != key:
                        cached = (key, _log_chunk(f.read()))
                        self._logs[name] = cached
            except FileNotFoundError:  # compacted meanwhile: the catalogue has it
                continue
            if cached[1] is not None:
                out[int(name[5:-4])] = cached[1]
        for gone in set(self._logs) - set(names):
            del self._logs[gone]
        return out

    def steps(self, conn: sqlite3.Connection) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, wall_times)`` of every stored step."""
        chunks = self.chunks(conn)
        if not chunks:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        return (np.concatenate([c.steps for c in chunks]),
                np.concatenate([c.walls for c in chunks]))

    def series(self, conn: sqlite3.Connection, sid: int) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of one series."""
        steps, values = [], []
        with _Values(self.path) as file:
            for c in self.chunks(conn):
                pos = int(np.searchsorted(c.layout, sid))
                if pos == len(c.layout) or c.layout[pos] != sid:
                    continue
                row = file.rows(c, pos, pos + 1)[0]
                keep = present(row)
                steps.append(c.steps[keep])
                values.append(row[keep])
        if not steps:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        return np.concatenate(steps), np.concatenate(values)

    def blocks(self, conn: sqlite3.Connection, keep: np.ndarray | None) -> Iterator[Block]:
        """One :data:`Block` per chunk, of the series ``keep`` (sorted ids; None: all)."""
        chunks = self.chunks(conn)
        with _Values(self.path) as file:
            for c in chunks:
                if keep is None:
                    pos = np.arange(len(c.layout))
                    matrix = file.rows(c, 0, len(c.layout))
                else:
                    pos = np.flatnonzero(np.isin(c.layout, keep))
                    if not len(pos):
                        continue
                    matrix = file.rows(c, int(pos[0]), int(pos[-1]) + 1)[pos - pos[0]]
                flat = matrix.T.reshape(-1)  # step-major: (step, series id) order
                mask = present(flat)
                yield (np.repeat(c.steps, len(pos))[mask], np.tile(c.layout[pos], len(c.steps))[mask],
                       flat[mask])


def _log_chunk(data: bytes) -> Chunk | None:
    records = decode_records(data)
    if not records:
        return None
    layout, matrix = chunk_matrix([(ids, values) for _, _, ids, values in records])
    return Chunk(np.array([r[0] for r in records], dtype=np.int64),
                 np.array([r[1] for r in records], dtype=np.float64), layout, matrix=matrix)


class _Values:
    """``values.f64``, open for the reads of one call."""

    def __init__(self, path: Path) -> None:
        self.file = path / VALUES_NAME
        self.fd: int | None = None

    def __enter__(self) -> _Values:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)

    def rows(self, c: Chunk, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of chunk ``c`` [stop - start, steps]."""
        if c.matrix is not None:
            return c.matrix[start:stop]
        if self.fd is None:
            self.fd = os.open(self.file, os.O_RDONLY)
        n = len(c.steps)
        size = 8 * n * (stop - start)
        data = os.pread(self.fd, size, c.offset + 8 * n * start)
        if len(data) != size:
            raise OSError(f"{str(self.file)!r} is shorter than its catalogue says (a chunk at "
                          f"byte {c.offset} is cut off)")
        return np.frombuffer(data, dtype="<f8").reshape(stop - start, n)


class SqlRows:
    """Reader of schema 1: the ``scalars`` table (one row per value) and the ``steps`` table."""

    def steps(self, conn: sqlite3.Connection) -> tuple[np.ndarray, np.ndarray]:
        rows = conn.execute("SELECT step, wall_time FROM steps ORDER BY step").fetchall()
        arr = np.array(rows, dtype=np.float64).reshape(-1, 2)
        return arr[:, 0].astype(np.int64), arr[:, 1]

    def series(self, conn: sqlite3.Connection, sid: int) -> tuple[np.ndarray, np.ndarray]:
        data = conn.execute("SELECT step, value FROM scalars WHERE series_id=? ORDER BY step",
                            (sid,)).fetchall()
        arr = np.array(data, dtype=np.float64).reshape(-1, 2)  # NULL (NaN) -> nan
        return arr[:, 0].astype(np.int64), arr[:, 1]

    def blocks(self, conn: sqlite3.Connection, keep: np.ndarray | None) -> Iterator[Block]:
        where = "" if keep is None else f"WHERE series_id IN ({','.join(map(str, keep.tolist()))}) "
        if keep is not None and not len(keep):
            return
        rows = conn.execute(f"SELECT step, series_id, value FROM scalars {where}"
                            "ORDER BY step, series_id").fetchall()
        arr = np.array(rows, dtype=np.float64).reshape(-1, 3)
        yield arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64), arr[:, 2]
