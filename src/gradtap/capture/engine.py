"""The autograd engine as consumers see it: which backward is running, and what runs when it ends.

Consumers never ask autograd directly; they use these names:

* :func:`current_backward`: an id of the backward now running in this thread, or ``None``.
* :func:`at_end_of_backward`: run a function once, when the running backward has finished.
* :class:`OncePerBackward`: a function run at the end of every backward in which it was armed,
  once per backward however often it was armed (the usual "one check per backward" pattern).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradtap.capture import compat

__all__ = ["OncePerBackward", "at_end_of_backward", "current_backward"]


def graph_task_id() -> int:
    """The autograd graph task running in this thread, -1 outside a backward."""
    return compat.graph_task_id()


def current_node() -> Any:
    """The autograd node running in this thread, or None."""
    return compat.current_node()


def current_backward() -> int | None:
    """An id of the backward (autograd graph task) now running in this thread, ``None`` outside
    one. Ids only grow, so a stale id left by a backward that raised is never reused."""
    task = compat.graph_task_id()
    return None if task == -1 else task


def at_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn()`` once, when the backward now running has finished.

    Only valid inside a backward (from a node or tensor hook); consumers use it to do one
    check per backward instead of one per record.
    """
    compat.queue_callback(fn)


class OncePerBackward:
    """``fn()`` at the end of each backward in which :meth:`arm` was called, once per backward.

    Example:
        >>> import torch
        >>> ends = OncePerBackward(lambda: print("backward over"))
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = x * 2
        >>> _ = y.register_hook(lambda g: (ends.arm(), ends.arm()) and None)
        >>> y.sum().backward()
        backward over
    """

    __slots__ = ("_fn", "_task")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._task: int | None = None

    def arm(self) -> bool:
        """Have ``fn`` run at the end of the running backward; True the first time in that
        backward (the caller may start per-backward state then). False, and nothing queued,
        outside a backward."""
        task = compat.graph_task_id()
        if task == self._task or task == -1:
            return False
        self._task = task
        at_end_of_backward(self._run)
        return True

    def reset(self) -> None:
        """Forget the backward armed last (its end still runs ``fn``)."""
        self._task = None

    def _run(self) -> None:
        self._task = None
        self._fn()
