"""What the run store's writer and reader share: names, the schema, the step record of the
append log, the chunk layout, and the helpers the Monitor's in-memory history reuses."""

from __future__ import annotations

import difflib
import fnmatch
import os
import socket
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradtap._types import STAT_NAMES
from gradtap.errors import SelectionError, StoreError, missing_extra

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

#: File name of the catalogue database inside a run directory.
DB_NAME = "run.db"
#: File of the compacted chunks: series-major little-endian float64 matrices, appended.
VALUES_NAME = "values.f64"
#: Version of the schema this gradtap writes (``PRAGMA user_version``); it also reads 1.
SCHEMA_VERSION = 2
#: ``PRAGMA application_id`` of a gradtap run store ("gtp1").
APPLICATION_ID = 0x67747031

KIND_NAMES = ("param_grad", "grad_output", "param", "update", "grad_cosine")
#: The kind of the step's own rows: the loss (``"<loss>"``), the grad scaler (``"<scaler>"``)
#: and the script's own clip (``"<clip>"``); runs stored before it have them as kind
#: ``param_grad``.
HEALTH_KIND = "health"
#: The names of the rows of kind :data:`HEALTH_KIND`.
HEALTH_NAMES = ("<loss>", "<scaler>", "<clip>")
#: Every kind a run stores: the Monitor's kinds, then the step's own rows.
STORED_KINDS = (*KIND_NAMES, HEALTH_KIND)
#: Every stat a run stores: the moments' statistics, then those of particular kinds.
ALL_STAT_NAMES = (*STAT_NAMES, "ratio", "cosine", "amp_scale", "zscore", "clip_factor", "gain",
                  "gns", "gns_trace", "gns_sqnorm", "value")

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE series (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, kind TEXT NOT NULL, stat TEXT NOT NULL,
    UNIQUE (name, kind, stat)
);
CREATE TABLE layouts (id INTEGER PRIMARY KEY, series_ids BLOB NOT NULL);
CREATE TABLE chunks (
    id INTEGER PRIMARY KEY, first_step INTEGER NOT NULL, last_step INTEGER NOT NULL,
    n_steps INTEGER NOT NULL, layout_id INTEGER NOT NULL, offset INTEGER NOT NULL,
    steps BLOB NOT NULL, wall_times BLOB NOT NULL
);
CREATE TABLE histograms (
    step INTEGER NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, counts BLOB NOT NULL,
    PRIMARY KEY (step, kind, name)
) WITHOUT ROWID;
CREATE TABLE ewma (
    name TEXT PRIMARY KEY, beta REAL NOT NULL, updates INTEGER NOT NULL, numel INTEGER NOT NULL,
    shape TEXT NOT NULL, mean_norm REAL, mean_absmax REAL, var_mean REAL, var_max REAL
);
"""

#: The values one chunk holds at most (steps x series): 8 MiB of float64.
CHUNK_VALUES = 1 << 20
#: The fewest and the most steps a chunk holds, whatever the width of a step.
CHUNK_STEPS = (16, 4096)

#: The bits of the NaN that marks "no value at this step" in a chunk (a signalling NaN; every
#: stored NaN is the quiet NaN ``0x7ff8000000000000``, so the two never meet).
ABSENT_BITS = np.uint64(0x7FF4_0000_0000_0001)

#: Header of a step record: magic, value count, step, wall time, whether series ids follow.
RECORD = struct.Struct("<4sIqdI")
RECORD_MAGIC = b"gtr2"
_CRC = struct.Struct("<I")


def segment_name(chunk: int) -> str:
    """File name of the append log of chunk ``chunk`` (its steps before compaction)."""
    return f"rows-{chunk:06d}.log"


def chunk_steps(width: int) -> int:
    """How many steps a chunk holds when its first step has ``width`` values."""
    lo, hi = CHUNK_STEPS
    return int(min(hi, max(lo, CHUNK_VALUES // max(width, 1))))


def encode_record(step: int, wall_time: float, ids: np.ndarray | None,
                  values: np.ndarray) -> bytes:
    """One step of the append log: header, ``int32`` ids (when the layout changed),
    ``float64`` values, CRC-32 of all of it."""
    body = RECORD.pack(RECORD_MAGIC, len(values), step, wall_time, ids is not None)
    if ids is not None:
        body += np.asarray(ids, dtype="<i4").tobytes()
    body += np.asarray(values, dtype="<f8").tobytes()
    return body + _CRC.pack(zlib.crc32(body))


def decode_records(data: bytes) -> list[tuple[int, float, np.ndarray, np.ndarray]]:
    """``(step, wall_time, ids, values)`` of every whole record in ``data``; a torn or corrupt
    tail (a write cut off by a kill) ends the list."""
    out: list[tuple[int, float, np.ndarray, np.ndarray]] = []
    pos, ids = 0, np.zeros(0, dtype=np.int64)
    while pos + RECORD.size <= len(data):
        magic, n, step, wall, has_ids = RECORD.unpack_from(data, pos)
        size = RECORD.size + (4 * n if has_ids else 0) + 8 * n
        if magic != RECORD_MAGIC or pos + size + _CRC.size > len(data):
            break
        (crc,) = _CRC.unpack_from(data, pos + size)
        if crc != zlib.crc32(data[pos:pos + size]):
            break
        at = pos + RECORD.size
        if has_ids:
            ids = np.frombuffer(data, dtype="<i4", count=n, offset=at).astype(np.int64)
            at += 4 * n
        elif len(ids) != n:
            break
        out.append((step, wall, ids, np.frombuffer(data, dtype="<f8", count=n, offset=at)))
        pos += size + _CRC.size
    return out


def quiet_nans(values: np.ndarray) -> np.ndarray:
    """``values`` as float64 with every NaN the quiet NaN (a new array if one had to change)."""
    values = np.asarray(values, dtype=np.float64)
    nan = np.isnan(values)
    if nan.any():
        values = values.copy()
        values[nan] = np.nan
    return values


def chunk_matrix(records: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Series-major block of steps given as ``(ids, values)`` pairs: ``(layout, matrix)``, where
    ``layout`` is the sorted series ids and ``matrix[i, j]`` the value of ``layout[i]`` at the
    ``j``-th step (:data:`ABSENT_BITS` where it has none)."""
    first = records[0][0]
    if all(ids is first or np.array_equal(ids, first) for ids, _ in records):
        order = np.argsort(first, kind="stable")
        block = np.stack([v for _, v in records]) if records else np.zeros((0, len(first)))
        return first[order], np.ascontiguousarray(block[:, order].T)
    layout = np.unique(np.concatenate([ids for ids, _ in records]))
    matrix = np.full((len(layout), len(records)), ABSENT_BITS, dtype=np.uint64).view(np.float64)
    for j, (ids, values) in enumerate(records):
        matrix[np.searchsorted(layout, ids), j] = values
    return layout, matrix


def present(values: np.ndarray) -> np.ndarray:
    """Mask of the entries of a chunk row that hold a value (not :data:`ABSENT_BITS`)."""
    return values.view(np.uint64) != ABSENT_BITS


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


def writer_identity() -> dict[str, Any]:
    """The writing process, stored as the run's ``writer``: its pid, host and start time (the
    kernel's, where ``/proc`` has it: a pid reused by another process has another)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": _started(os.getpid())}


def _started(pid: int) -> str | None:
    """Process ``pid``'s start time in clock ticks after boot (``/proc/PID/stat``), ``"Z"``
    for a zombie (exited, not reaped yet), None where not readable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return "Z" if fields[0] in ("Z", "X") else fields[19] if len(fields) > 19 else None


def live_status(meta: dict[str, Any]) -> str:
    """The run's ``status``, ``"killed"`` for a ``"running"`` run whose writer (on this host)
    is gone: its pid is free, a zombie, or another process's. A run written on another host,
    or before the writer was stored, keeps its stored status."""
    status = str(meta.get("status"))
    writer = meta.get("writer")
    if status != "running" or os.name != "posix" or not isinstance(writer, dict):
        return status
    pid = writer.get("pid")
    if (not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0
            or writer.get("host") != socket.gethostname()):
        return status
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return "killed"
    except PermissionError:
        pass  # it exists, as another user
    now = _started(pid)
    if now == "Z" or (now is not None and writer.get("started") not in (None, now)):
        return "killed"
    return status


def series_kind(name: str, kind: str | None, has: Callable[[str], bool]) -> str:
    """The kind ``series(name, stat, kind)`` reads: ``kind``, else ``"param_grad"`` or, for a
    name of :data:`HEALTH_NAMES`, ``"health"`` (``"param_grad"`` in a run stored before the
    health kind, where ``has("health")``, whether that series exists, is false)."""
    if kind is not None:
        return kind
    if name in HEALTH_NAMES and has(HEALTH_KIND):
        return HEALTH_KIND
    return "param_grad"


def filter_series(
    series: Sequence[tuple[str, str, str]],
    names: str | Sequence[str] | None,
    stats: str | Sequence[str] | None,
    kinds: str | Sequence[str] | None,
) -> list[int]:
    """Ids of the series ``(name, kind, stat)`` that pass the filters of ``frame()``."""
    stat_list, kind_list, name_list = _as_list(stats), _as_list(kinds), _as_list(names)
    for given, valid, what in ((stat_list, ALL_STAT_NAMES, "stat"), (kind_list, STORED_KINDS, "kind")):
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
        raise missing_extra(what, "pandas", "pandas") from err
    return pd


def series_table(rows: Iterable[tuple[int, str, str, str]]) -> list[tuple[str, str, str]]:
    """``(name, kind, stat)`` by series id from the ``series`` table's rows, ordered by id."""
    table: list[tuple[str, str, str]] = []
    for i, name, kind, stat in rows:
        if i != len(table):
            raise StoreError(f"series ids are not consecutive (id {i} at position {len(table)})")
        table.append((name, kind, stat))
    return table
