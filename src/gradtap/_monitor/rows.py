"""A step's rows: the series ids of a run, and the finished values of one step for its sinks.

A computed step ends as one :class:`StepRows`: every value of the step in one float64 array,
the series id of each (an index into the run's series table, ``(name, kind, stat)`` by id),
the series first seen at this step, and the step's histograms. It is columnar, so a sink pays
nothing per value to take it: the run store writes the arrays, and a sink that wants labels
reads :meth:`StepRows.labels` (cached per layout of the step, not rebuilt each step).
:class:`RowBuilder` collects a step's blocks into one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

__all__ = ["RowBuilder", "SeriesTable", "StepRows"]


class SeriesTable:
    """Ids of the series ``(name, kind, stat)``, numbered in order of first appearance.

    The layout of a block of values (``names x stats`` of one kind, name-major) is cached, so a
    step that looks like the last one costs no Python loop over its series.
    """

    def __init__(self) -> None:
        self.series: list[tuple[str, str, str]] = []
        self._ids: dict[tuple[str, str, str], int] = {}
        self._new: list[tuple[int, str, str, str]] = []
        self._layouts: dict[tuple[str, tuple[str, ...], tuple[str, ...]], np.ndarray] = {}
        self._concat: dict[tuple[int, ...], np.ndarray] = {}
        self._by_stat: dict[int, np.ndarray] = {}
        self._labels: dict[int, tuple[np.ndarray, tuple[list[str], list[str], list[str]]]] = {}

    def layout(self, kind: str, names: Sequence[str], stats: Sequence[str]) -> np.ndarray:
        """Series ids [len(names) * len(stats)] of a block, name-major; new series are noted."""
        key = (kind, tuple(names), tuple(stats))
        ids = self._layouts.get(key)
        if ids is None:
            out = []
            for name in names:
                for stat in stats:
                    sk = (name, kind, stat)
                    i = self._ids.get(sk)
                    if i is None:
                        i = self._ids[sk] = len(self.series)
                        self.series.append(sk)
                        self._new.append((i, name, kind, stat))
                    out.append(i)
            ids = self._layouts[key] = np.array(out, dtype=np.int64)
            ids.setflags(write=False)
        return ids

    def stat_major(self, ids: np.ndarray, n_stats: int) -> np.ndarray:
        """The ids of a :meth:`layout` block in stat-major order (cached)."""
        out = self._by_stat.get(id(ids))
        if out is None:
            out = np.ascontiguousarray(ids.reshape(-1, n_stats).T).reshape(-1)
            out.setflags(write=False)
            self._by_stat[id(ids)] = out
        return out

    def concat(self, layouts: Sequence[np.ndarray]) -> np.ndarray:
        """The ids of a step made of ``layouts`` (arrays from :meth:`stat_major`), cached."""
        key = tuple(id(i) for i in layouts)  # layout arrays live in this table: ids are stable
        ids = self._concat.get(key)
        if ids is None:
            ids = (np.concatenate(layouts) if len(layouts) > 1 else layouts[0] if layouts
                   else np.zeros(0, dtype=np.int64))
            ids.setflags(write=False)
            self._concat[key] = ids
        return ids

    def labels(self, ids: np.ndarray) -> tuple[list[str], list[str], list[str]]:
        """``(names, kinds, stats)`` of the series ``ids``, one entry per id (cached per array
        of ids, which steps of the same layout share)."""
        hit = self._labels.get(id(ids))
        if hit is None or hit[0] is not ids:
            rows = [self.series[i] for i in ids.tolist()]
            hit = self._labels[id(ids)] = (ids, ([r[0] for r in rows], [r[1] for r in rows],
                                                 [r[2] for r in rows]))
        return hit[1]

    def take_new(self) -> list[tuple[int, str, str, str]]:
        """``(id, name, kind, stat)`` of the series first seen since the last call."""
        new, self._new = self._new, []
        return new


class StepRows:
    """Every value of one computed step, columnar, as each sink receives it (shared by every
    sink: read it, never modify it).

    Attributes:
        step: the step number.
        wall_time: seconds since the epoch at which the step's values were ready.
        ids: series id of each value [R] (int64, read-only; steps of the same layout share it).
        values: the values [R] (float64; NaN where a statistic is undefined).
        new_series: ``(id, name, kind, stat)`` of the series first seen at this step (every
            id in ``ids`` was in the ``new_series`` of this step or an earlier one).
        hists: ``(kind, name, counts [B])`` histograms of this step (int64 counts).
        table: the run's series table (``table.series[i]`` is ``(name, kind, stat)`` of id ``i``).
    """

    __slots__ = ("hists", "ids", "new_series", "step", "table", "values", "wall_time")

    def __init__(self, step: int, wall_time: float, ids: np.ndarray, values: np.ndarray,
                 new_series: Sequence[tuple[int, str, str, str]],
                 hists: Sequence[tuple[str, str, np.ndarray]], table: SeriesTable) -> None:
        self.step = step
        self.wall_time = wall_time
        self.ids = ids
        self.values = values
        self.new_series = new_series
        self.hists = hists
        self.table = table

    def labels(self) -> tuple[list[str], list[str], list[str]]:
        """``(names, kinds, stats)``: the series of each value, in :attr:`values` order."""
        return self.table.labels(self.ids)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return f"StepRows(step={self.step}, values={len(self.values)}, hists={len(self.hists)})"


class RowBuilder:
    """Collects the finished blocks of one step into :class:`StepRows`.

    Example:
        >>> import numpy as np
        >>> rows = RowBuilder(SeriesTable())
        >>> rows.add("param_grad", ["w", "b"], {"norm": np.array([3.0, 4.0])})
        >>> step = rows.finish(0)
        >>> step.labels()[0], step.values.tolist(), step.new_series[0]
        (['w', 'b'], [3.0, 4.0], (0, 'w', 'param_grad', 'norm'))
    """

    def __init__(self, table: SeriesTable) -> None:
        self._table = table
        self._layouts: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self.hists: list[tuple[str, str, np.ndarray]] = []

    def add(self, kind: str, names: Sequence[str], columns: dict[str, np.ndarray]) -> None:
        """One block: ``columns[stat]`` holds one value per name."""
        if not columns:
            return
        ids = self._table.layout(kind, names, list(columns))
        self._layouts.append(self._table.stat_major(ids, len(columns)))
        self._values += columns.values()

    def add_hists(self, kind: str, names: Sequence[str], counts: np.ndarray) -> None:
        """Histogram counts [len(names), B] of one kind."""
        counts = counts.astype(np.int64)
        self.hists += [(kind, n, c) for n, c in zip(names, counts)]

    def finish(self, step: int) -> StepRows:
        """The step's rows (a new array of values, owned by the rows)."""
        values = self._values
        # concatenate always copies, so the rows own their values (columns may be views)
        flat = (np.concatenate(values) if values else np.zeros(0)).astype(np.float64, copy=False)
        return StepRows(step, time.time(), self._table.concat(self._layouts), flat,
                        self._table.take_new(), self.hists, self._table)
