"""What every tracker adapter is: one small protocol."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Tracker"]


class Tracker(Protocol):
    """One tracker the Monitor logs to (one adapter module per tracker).

    Attributes:
        name: how messages name it (``"SummaryWriter(runs/x)"``, ``"wandb run abc123"``).
        thread_safe: :meth:`log` may run on gradtap's logging thread; ``False``: on the
            training thread, at the Monitor's next step (the tracker's own calls are
            not safe beside the training loop's own use of it).
    """

    name: str
    thread_safe: bool

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str],
            wall_time: float) -> None:
        """Log one step's values (``texts``: where the tracker takes text)."""

    def close(self, status: str) -> None:
        """The run ended with ``status``; flush (close only what gradtap opened)."""
