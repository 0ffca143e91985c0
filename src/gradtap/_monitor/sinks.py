"""Where a Monitor's steps go: one small protocol, and the run's history as the first sink.

Each computed step ends as one :class:`~gradtap._monitor.rows.StepRows` handed to every sink
of the Monitor in order. The run's history (the SQLite :class:`~gradtap.store.RunWriter` or the
in-memory :class:`~gradtap._monitor.history.MemoryRun`) is always the first
(:class:`HistorySink`); a live tracker is another :class:`StepSink` beside it, without a change
to the step itself.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from gradtap._monitor.rows import StepRows

__all__ = ["HistorySink", "StepSink"]


@runtime_checkable
class StepSink(Protocol):
    """Anything that takes a Monitor's finished steps."""

    def write(self, step: int, rows: StepRows) -> None:
        """Take the rows of computed step ``step`` (``rows.step == step``). The rows are
        shared by every sink and must not be modified."""

    def close(self, status: str) -> None:
        """The run ended with ``status`` (``"finished"`` or ``"failed"``); called once."""


class HistorySink:
    """The run's history as a sink: each step's arrays go to ``history.write_step``.

    Args:
        history: a :class:`~gradtap.store.RunWriter` or a
            :class:`~gradtap._monitor.history.MemoryRun` (anything with their ``write_step``
            and ``close``).
    """

    def __init__(self, history: Any) -> None:
        self.history = history

    def write(self, step: int, rows: StepRows) -> None:
        self.history.write_step(step, rows.new_series, rows.ids, rows.values, rows.hists,
                                wall_time=rows.wall_time)

    def close(self, status: str) -> None:
        self.history.close(status)
