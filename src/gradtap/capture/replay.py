"""Replays: running a step's forward and backward again for one consumer, and what the others see.

A replay (``gt.detect`` runs one to find where a NaN came from) is not a training step. While
one runs inside :func:`replaying`, the rule is:

* the replay's owner (a :class:`~gradtap.capture.Listener`) sees every call, record and
  rewrite of the replayed step;
* any other listener sees the replay only if it declares ``sees_replays = True``; the
  consumers of gradtap (Monitor, transform, per_sample) do not, so a replay advances no
  statistic, no transform state and no per-sample result, and rewrites nothing;
* a :class:`~gradtap.capture.HookSet` sees it only if made with ``sees_replays=True``.

:func:`in_recomputation` says whether a forward call is an activation-checkpoint
recomputation (made inside a backward to refill saved tensors), which no consumer counts as
a call; inside a replay started at the end of a backward, forward calls of that backward
count as real calls again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gradtap.capture.engine import graph_task_id

__all__ = ["in_recomputation", "replaying", "stands_aside"]


class _Replay:
    """Set by :func:`replaying`: the listener whose hooks run, and the backward (graph task) in
    which forward calls still count as real calls (-1: none, the usual case)."""

    owner: Any = None
    task: int = -1


def stands_aside(listener: Any) -> bool:
    """Whether hooks working for ``listener`` (``None``: a tap without one) must do nothing
    because a replay owned by another listener runs."""
    owner = _Replay.owner
    return (owner is not None and owner is not listener
            and not getattr(listener, "sees_replays", False))


def replay_running() -> bool:
    """Whether a replay runs now."""
    return _Replay.owner is not None


def in_recomputation() -> bool:
    """Whether a forward call made now is an activation-checkpoint recomputation: made inside
    a backward (other than the one a running replay started in), only to refill saved
    tensors."""
    return graph_task_id() != _Replay.task


@contextmanager
def replaying(owner: Any) -> Iterator[None]:
    """Run a model's forward and backward again, seen by ``owner`` (a listener) and by the
    listeners and hook sets that declare ``sees_replays``; every other hook does nothing.

    Forward calls made inside the backward now running (a replay started at its end) count as
    real calls; forward calls inside the replay's own backward (activation checkpoint
    recomputation) still do not. Not reentrant.
    """
    if _Replay.owner is not None:
        raise RuntimeError("a replay is already running; replays do not nest")
    _Replay.owner, _Replay.task = owner, graph_task_id()
    try:
        yield
    finally:
        _Replay.owner, _Replay.task = None, -1
