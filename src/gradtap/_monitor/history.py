"""The Monitor's history kept in memory, with the API of the store's.

A Monitor writes every computed step to one history, its first sink
(:mod:`~gradtap._monitor.sinks`): a :class:`~gradtap.store.RunWriter` when it has a store,
else a :class:`MemoryRun`. It reads back through one *view*: a
:class:`~gradtap.store.Run` over the store, or the same :class:`MemoryRun`. ``MemoryRun``
answers every query of ``Run`` (``frame``, ``arrays``, ``series``, ``histogram``, ``steps``,
``names``, ``meta``, ``ewma``, ...) with the same values, types and errors, so each query has
one code path whatever the storage.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradtap.store import (
    NO_HISTOGRAMS,
    SCHEMA_VERSION,
    Histogram,
    build_frame,
    filter_series,
    missing_message,
    series_kind,
    writer_identity,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from gradtap._monitor.run_spikes import Spike

__all__ = ["MemoryRun"]


class MemoryRun:
    """A run kept in memory: the writing API of ``RunWriter`` and the reading API of ``Run``.

    About 8 bytes per value plus ~100 bytes per step: each step keeps its values and a
    reference to its (shared) array of series ids.

    Args:
        meta: the run metadata (``status``, ``writer`` and ``schema_version`` are added, as a
            store does).

    Example:
        >>> import numpy as np
        >>> run = MemoryRun({"config": {}})
        >>> run.write_step(0, [(0, "w", "param_grad", "norm")], np.array([0]), np.array([1.5]))
        >>> run.steps, run.names, run.series("w", "norm")[1].tolist()
        ([0], ['w'], [1.5])
    """

    def __init__(self, meta: dict[str, Any]) -> None:
        self._meta = _plain({**meta, "status": "running", "writer": writer_identity(),
                             "schema_version": SCHEMA_VERSION})
        self._series: list[tuple[str, str, str]] = []
        self._steps: list[int] = []
        self._times: list[float] = []
        self._ids: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._hists: dict[tuple[str, str], tuple[list[int], list[np.ndarray]]] = {}
        self._ewma: dict[str, dict[str, Any]] = {}

    # -- writing (the RunWriter API) ---------------------------------------------------------

    def write_step(
        self,
        step: int,
        new_series: Sequence[tuple[int, str, str, str]],
        ids: np.ndarray,
        values: np.ndarray,
        hists: Sequence[tuple[str, str, np.ndarray]] = (),
        wall_time: float | None = None,
    ) -> None:
        """Append one step (see ``RunWriter.write_step``)."""
        for i, name, kind, stat in new_series:
            if i != len(self._series):
                raise ValueError(f"series id {i} given at position {len(self._series)}")
            self._series.append((name, kind, stat))
        self._steps.append(int(step))
        self._times.append(time.time() if wall_time is None else wall_time)
        self._ids.append(ids)
        self._values.append(np.asarray(values, dtype=np.float64))
        for kind, name, counts in hists:
            steps, rows = self._hists.setdefault((kind, name), ([], []))
            steps.append(int(step))
            rows.append(np.asarray(counts, dtype=np.int64))

    def set_meta(self, **items: Any) -> None:
        """Insert or replace metadata keys."""
        self._meta.update(_plain(items))

    def write_ewma(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Replace the EWMA summaries (rows as ``RunWriter.write_ewma`` takes them)."""
        self._ewma = {}
        for name, beta, updates, numel, shape, *values in rows:
            self._ewma[name] = {
                "beta": float(beta), "updates": int(updates), "numel": int(numel),
                "shape": json.loads(shape),
                **dict(zip(("mean_norm", "mean_absmax", "var_mean", "var_max"),
                           (math.nan if v is None else float(v) for v in values))),
            }

    def close(self, status: str = "finished") -> None:
        """Record ``status`` and the end time."""
        self.set_meta(status=status, end_time=time.strftime("%Y-%m-%dT%H:%M:%S%z",
                                                            time.localtime()))

    # -- reading (the Run API) ---------------------------------------------------------------

    @property
    def meta(self) -> dict[str, Any]:
        """Run metadata, as ``Run.meta``."""
        return copy.deepcopy(self._meta)

    @property
    def status(self) -> str:
        """``"running"``, ``"finished"`` or ``"failed"``."""
        return str(self._meta.get("status"))

    @property
    def steps(self) -> list[int]:
        """Sorted step numbers stored (computed steps)."""
        return sorted(self._steps)

    @property
    def names(self) -> list[str]:
        """Sorted names with statistics."""
        return sorted({s[0] for s in self._series})

    @property
    def kinds(self) -> list[str]:
        """Sorted kinds with statistics."""
        return sorted({s[1] for s in self._series})

    @property
    def stats(self) -> list[str]:
        """Sorted statistic names stored."""
        return sorted({s[2] for s in self._series})

    @property
    def ewma(self) -> dict[str, dict[str, Any]]:
        """EWMA summaries per parameter, written when the monitor closed (empty otherwise)."""
        return copy.deepcopy(dict(sorted(self._ewma.items())))

    def frame(
        self,
        names: str | Sequence[str] | None = None,
        stats: str | Sequence[str] | None = None,
        kinds: str | Sequence[str] | None = None,
    ) -> pd.DataFrame:
        """Statistics as a long DataFrame ``step, name, kind, stat, value`` (see ``Run.frame``)."""
        return build_frame(*self.arrays(names, stats, kinds))

    def arrays(
        self,
        names: str | Sequence[str] | None = None,
        stats: str | Sequence[str] | None = None,
        kinds: str | Sequence[str] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[str, str, str]]]:
        """``(steps [R], series_ids [R], values [R], series)`` ordered by step, then series id."""
        series = list(self._series)
        keep = filter_series(series, names, stats, kinds)
        steps, ids, values = self._columns()
        if len(keep) != len(series):
            mask = np.isin(ids, np.asarray(keep, dtype=np.int64))
            steps, ids, values = steps[mask], ids[mask], values[mask]
        order = np.lexsort((ids, steps))
        return steps[order], ids[order], values[order], series

    def wall_times(self) -> dict[int, float]:
        """Seconds since the epoch at which each step was stored, by step."""
        return dict(zip(self._steps, self._times))

    def series(self, name: str, stat: str, kind: str | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of one statistic (``kind`` as in ``Run.series``).

        Raises:
            KeyError: no such series (the message names close matches).
        """
        kind = series_kind(name, kind, lambda k: (name, k, stat) in self._series)
        try:
            sid = self._series.index((name, kind, stat))
        except ValueError:
            raise KeyError(self._missing(name, f"{kind}/{stat}")) from None
        steps, ids, values = self._columns()
        at = np.flatnonzero(ids == sid)
        order = np.argsort(steps[at], kind="stable")
        return steps[at][order], values[at][order]

    def histogram(self, name: str, kind: str = "param_grad") -> Histogram:
        """``(bin_edges [B+1], counts [steps, B])`` of one tensor; ``.steps`` [steps].

        Raises:
            KeyError: no histograms of that name and kind (histograms need ``hist_bins``).
        """
        edges = self._meta.get("histogram", {}).get("edges")
        if edges is None:
            raise KeyError(NO_HISTOGRAMS)
        if (kind, name) not in self._hists:
            raise KeyError(self._missing(name, f"{kind} histograms"))
        steps, rows = self._hists[(kind, name)]
        order = np.argsort(np.array(steps), kind="stable")
        return Histogram(np.asarray(edges, dtype=np.float64), np.stack(rows)[order],
                         np.array(steps, dtype=np.int64)[order])

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
        return sorted(self._hists)

    def __repr__(self) -> str:
        return f"MemoryRun(steps={len(self._steps)}, series={len(self._series)})"

    # -- helpers -----------------------------------------------------------------------------

    def _columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._steps:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0)
        steps = np.repeat(np.array(self._steps, dtype=np.int64), [len(i) for i in self._ids])
        return steps, np.concatenate(self._ids), np.concatenate(self._values)

    def _missing(self, name: str, what: str) -> str:
        return missing_message(name, {s[0] for s in self._series}, what, "memory")


def _plain(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` as a store would read it back: through JSON when it is JSON-serialisable."""
    try:
        return json.loads(json.dumps(meta))
    except (TypeError, ValueError):
        return copy.deepcopy(meta)
