"""Any callable ``f(metrics: dict[str, float], step: int)`` as a tracker (on gradtap's
logging thread)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FunctionTracker"]


class FunctionTracker:
    """Call ``f(numbers, step)`` for each logged step."""

    thread_safe = True

    def __init__(self, f: Callable[[dict[str, float], int], object]) -> None:
        self.f = f
        self.name = getattr(f, "__qualname__", None) or repr(f)

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str],
            wall_time: float) -> None:
        self.f(dict(numbers), step)

    def close(self, status: str) -> None:
        """Nothing to flush."""
