"""The signal that a call cannot give per-sample gradients by a replay."""

from __future__ import annotations

__all__ = ["CannotReplay"]


class CannotReplay(Exception):  # noqa: N818 - internal signal, never reaches users
    """This call cannot give per-sample gradients by a replay; ``str(err)`` says why."""
