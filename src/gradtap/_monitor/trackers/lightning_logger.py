"""A Lightning ``Logger`` (``TensorBoardLogger``, ``CSVLogger``, ``WandbLogger``, ...) as a
tracker: ``logger.log_metrics(metrics, step)``, numbers only, then ``logger.save()`` at the end.

Loggers known to be safe beside the training loop's own calls log on gradtap's thread; any
other (``CSVLogger`` keeps a list it rewrites) gets its steps on the training thread, at the
Monitor's next step and at ``close()``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LightningTracker"]

_THREAD_SAFE = ("TensorBoardLogger", "WandbLogger", "MLFlowLogger")


class LightningTracker:
    """Log to a Lightning ``Logger``."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.name = f"Lightning {type(logger).__name__}"
        self.thread_safe = type(logger).__name__ in _THREAD_SAFE

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str],
            wall_time: float) -> None:
        self.logger.log_metrics(numbers, step)

    def close(self, status: str) -> None:
        self.logger.save()
