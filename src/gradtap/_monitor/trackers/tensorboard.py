"""A ``torch.utils.tensorboard.SummaryWriter`` (or any writer with its ``add_scalar`` and
``add_text``) as a tracker: one scalar per key, the names of the summary's largest values as
text, each at the Monitor's step and the wall time of the step."""

from __future__ import annotations

from typing import Any

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker:
    """Log to ``writer``; ``owned``: gradtap opened it, so :meth:`close` closes it."""

    thread_safe = True  # the writer's event file has its own queue and lock

    def __init__(self, writer: Any, *, owned: bool = False) -> None:
        self.writer = writer
        self.owned = owned
        log_dir = getattr(writer, "log_dir", None) or getattr(writer, "logdir", None)
        self.name = f"{type(writer).__name__}({log_dir})" if log_dir else type(writer).__name__

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str],
            wall_time: float) -> None:
        add = self.writer.add_scalar
        for key, value in numbers.items():
            add(key, value, step, walltime=wall_time)
        for key, text in texts.items():
            self.writer.add_text(key, text, step, walltime=wall_time)

    def close(self, status: str) -> None:
        if self.owned:
            self.writer.close()
        else:
            self.writer.flush()
