"""A wandb run (or the ``wandb`` module: its active run) as a tracker.

Each logged step is one ``run.log`` with the step as ``gradtap/step``, the step metric of
gradtap's keys (``run.define_metric``), as Lightning's and the Hugging Face Trainer's wandb
loggers do with their global step: the run's own ``_step`` keeps counting the calls, so the
script's other ``wandb.log`` calls are unaffected. Texts (the tensors of the summary's largest
values) are logged as strings.
"""

from __future__ import annotations

from typing import Any

__all__ = ["STEP_KEY", "WandbTracker"]

STEP_KEY = "gradtap/step"
_PREFIXES = ("grad", "grad_output", "update", "param", "grad_cosine", "health")


class WandbTracker:
    """Log to a wandb ``Run``; ``owned``: gradtap started it, so :meth:`close` finishes it."""

    thread_safe = True  # wandb's run.log takes its own lock

    def __init__(self, run: Any, *, owned: bool = False) -> None:
        self.run = run
        self.owned = owned
        self.name = f"wandb run {getattr(run, 'id', '?')}"
        self._defined = False

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str],
            wall_time: float) -> None:
        if not self._defined:
            self._defined = True
            self.run.define_metric(STEP_KEY)
            for prefix in _PREFIXES:
                self.run.define_metric(f"{prefix}/*", step_metric=STEP_KEY)
            self.run.define_metric("loss", step_metric=STEP_KEY)
        self.run.log({**numbers, **texts, STEP_KEY: step})

    def close(self, status: str) -> None:
        if self.owned:  # else the run is the script's: it finishes it
            self.run.finish(exit_code=0 if status == "finished" else 1)
