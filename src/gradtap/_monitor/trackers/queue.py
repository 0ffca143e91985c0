"""The trackers as one sink of the Monitor's steps, behind a bounded queue and a thread.

:class:`TrackerQueue` is a :class:`~gradtap._monitor.sinks.StepSink` beside the run's history.
On the training thread, :meth:`~TrackerQueue.write` only hands the step's rows (already on the
host: no device work, no sync) to a queue when the step is logged; a daemon thread computes the
step's metrics once (:class:`~gradtap._monitor.trackers.summary.Summary`) and calls each
tracker. A tracker that cannot keep up never stalls training: a logged step that finds the
queue full is dropped, and the first drop is warned about (the run store keeps every step).
:meth:`~TrackerQueue.close` drains the queue, then flushes each tracker.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

from gradtap._monitor.rows import StepRows
from gradtap._monitor.trackers.base import Tracker
from gradtap._monitor.trackers.summary import Metrics, Summary

__all__ = ["QUEUE_SIZE", "TrackerQueue"]

#: Logged steps waiting for the trackers, at most (a fast training loop runs ahead of the
#: logging thread by a few steps between two of Python's thread switches).
QUEUE_SIZE = 64
#: Seconds ``close()`` waits for the trackers to take what is queued.
DRAIN_TIMEOUT = 120.0
#: Computed steps whose spike and clip counts wait for the next logged step, at most (with a
#: larger ``log_every``, the older steps of an interval are not counted).
HISTORY = 4096
_END = object()


class TrackerQueue:
    """Log every ``log_every``-th computed step to ``trackers`` (see the module text).

    Args:
        trackers: the adapters (:mod:`~gradtap._monitor.trackers.resolve`).
        log_every: log the steps ``s`` with ``s % log_every == 0``; ``None``: only what
            :meth:`log_last` asks for (a trainer that decides when it logs).
        summary: what each logged step becomes.
        size: the queue's bound, in logged steps (default :data:`QUEUE_SIZE`).
    """

    def __init__(self, trackers: Sequence[Tracker], *, log_every: int | None, summary: Summary,
                 size: int | None = None) -> None:
        self.trackers = list(trackers)
        self.log_every = log_every
        self.summary = summary
        self.dropped: list[int] = []
        self._queue: queue.Queue[object] = queue.Queue(maxsize=size or QUEUE_SIZE)
        self._last: StepRows | None = None
        # what the spike and clip counts need of each computed step, not yet counted
        self._history: collections.deque[tuple[int, Any, int]] = collections.deque(
            maxlen=HISTORY)
        self._outbox: collections.deque[tuple[Tracker, int, Metrics, float]] = collections.deque()
        self._failed: dict[int, str] = {}  # id(tracker) -> why it gets no more steps
        self._messages: list[str] = []  # for the training thread to warn about, once each
        self._warned: set[str] = set()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the training thread ---------------------------------------------------------------

    def write(self, step: int, rows: StepRows) -> None:
        self._history.append(self.summary.extract(rows))  # every computed step counts
        self._last = rows
        if self.log_every is not None and step % self.log_every == 0:
            self._put(step, rows)
        self._deliver()
        self._warn()

    def log_last(self, step: int) -> None:
        """Log the last computed step now, at the tracker step ``step`` (a trainer's global
        step); nothing when no step was computed yet."""
        if self._last is not None and not self._closed:
            self._put(step, self._last)
            self._last = None

    def for_trainer(self, *, on_demand: bool) -> None:
        """Log as a trainer's callback: without ``loss`` (the trainer logs its own, under that
        name in some trackers) and, ``on_demand``, only when :meth:`log_last` is called."""
        self.summary.loss = False
        if on_demand:
            self.log_every = None

    def drain(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Wait until the trackers have taken every queued step (before a trainer closes the
        writers they log to)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            if self._thread is None or not self._thread.is_alive():
                break
            time.sleep(0.005)
        self._deliver()
        self._warn()

    def _put(self, step: int, rows: StepRows) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="gradtap-trackers",
                                            daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait((step, rows))
        except queue.Full:
            self._drop(step)

    def close(self, status: str) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            try:
                self._queue.put(_END, timeout=DRAIN_TIMEOUT)
            except queue.Full:
                pass
            self._thread.join(DRAIN_TIMEOUT)
            if self._thread.is_alive():
                self._note(f"the trackers did not take the queued steps within "
                           f"{DRAIN_TIMEOUT:.0f} s; the steps still queued are not logged")
        self._deliver()
        error: BaseException | None = None
        for tracker in self.trackers:
            try:
                tracker.close(status)
            except BaseException as err:  # noqa: BLE001  (re-raised below)
                error = error or err
        self._warn()
        if error is not None:
            raise error

    def _drop(self, step: int) -> None:
        self.dropped.append(step)
        if len(self.dropped) == 1:
            names = ", ".join(t.name for t in self.trackers)
            warnings.warn(
                f"gradtap could not log step {step} to {names}: the trackers cannot keep up "
                f"({self._queue.maxsize} logged steps already wait); a logged step that "
                "finds the queue full is dropped (this warning is not repeated). The run store "
                "keeps every step; a larger log_every logs less often", UserWarning, stacklevel=6)

    def _deliver(self) -> None:
        """Trackers that are not thread-safe get their steps here, on the training thread."""
        while self._outbox:
            tracker, step, metrics, wall = self._outbox.popleft()
            self._call(tracker, step, metrics, wall)

    def _warn(self) -> None:
        for message in [*self.summary.notes, *self._messages, *self._failed.values()]:
            if message not in self._warned:
                self._warned.add(message)
                warnings.warn(message, UserWarning, stacklevel=5)

    def _note(self, message: str) -> None:
        self._messages.append(message)

    # -- the logging thread ----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            try:
                self._log(*item)  # type: ignore[misc]  # (step, rows)
            finally:
                self._queue.task_done()

    def _log(self, step: int, rows: StepRows) -> None:
        # time.sleep(0) hands the GIL back between pieces of work, so the training thread waits
        # for one piece at most, not Python's switch interval (5 ms)
        while self._history and self._history[0][0] <= rows.step:
            self.summary.observe(self._history.popleft())
            time.sleep(0)
        metrics = self.summary.metrics(rows)
        for tracker in self.trackers:
            time.sleep(0)
            if id(tracker) in self._failed:
                continue
            if tracker.thread_safe:
                self._call(tracker, step, metrics, rows.wall_time)
            else:
                self._outbox.append((tracker, step, metrics, rows.wall_time))

    def _call(self, tracker: Tracker, step: int, metrics: Metrics, wall: float) -> None:
        if id(tracker) in self._failed:
            return
        try:
            tracker.log(step, metrics.numbers, metrics.texts, wall)
        except Exception as err:  # a tracker's failure must not end training
            self._failed[id(tracker)] = (
                f"gradtap stopped logging to {tracker.name}: it raised at step {step}: "
                f"{type(err).__name__}: {err}")
