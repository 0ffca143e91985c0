"""The options of :func:`~gradtap.detect`: what each may be, and the checks of them together.

Checked once, when the :class:`~gradtap.Detector` is made, before anything is hooked.
(:class:`~gradtap._detect._watch.WatchOptions`, which tunes how the per-call watch measures,
lives with the watch.)
"""

from __future__ import annotations

import math
from typing import Literal

from gradtap._tensorops.spikes import THRESHOLD
from gradtap._types import ACTIONS, ActionLiteral, is_int

__all__ = ["ActionLiteral", "ScreenLiteral", "check_options", "check_samples"]

ScreenLiteral = Literal["model", "modules"]
_SCREENS = ("model", "modules")


def check_options(*, action: str, spike: float | bool | None, warmup: int | None,
                  nonfinite: bool, replay: bool | None, screen: str | None) -> bool:
    """Whether the step is replayed (the default watch), or a ``ValueError`` for a bad option."""
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {', '.join(map(repr, ACTIONS))}; "
                         f"got {action!r}")
    if spike is not None and not isinstance(spike, bool) and (
            not isinstance(spike, (int, float)) or not spike > 0 or math.isinf(spike)):
        raise ValueError("spike must be None, True (the default threshold, "
                         f"{THRESHOLD:g}) or a finite score threshold > 0 (a robust z-score "
                         f"of the log-norm against its own baseline); got {spike!r}")
    if warmup is not None and (not is_int(warmup) or warmup < 3):
        raise ValueError(f"warmup must be None or an int >= 3 (values of a norm's history "
                         f"before it is scored); got {warmup!r}")
    if not nonfinite and spike in (None, False):
        raise ValueError("nothing to detect: nonfinite=False and no spike=; pass spike=True "
                         "or leave nonfinite=True")
    if replay is not None and not isinstance(replay, bool):
        raise ValueError(f"replay must be None, True or False; got {replay!r}")
    replays = replay if replay is not None else True
    if screen is not None and screen not in _SCREENS:
        raise ValueError(f"screen must be None, 'model' or 'modules'; got {screen!r}")
    if screen is not None and not replays:
        raise ValueError("screen= chooses what the replay watch screens each step; the "
                         "per-call watch (replay=False) checks every selected call anyway: "
                         "leave screen=None")
    return replays


def check_samples(samples: object, batch_dim: object, replays: bool) -> None:
    """A ``ValueError`` for a bad ``samples`` or ``batch_dim``, or ``samples`` without replays."""
    if not isinstance(samples, bool):
        raise ValueError(f"samples must be True or False; got {samples!r}")
    if not is_int(batch_dim) or batch_dim < 0:
        raise ValueError(f"batch_dim must be an int >= 0 (the dim that indexes samples); "
                         f"got {batch_dim!r}")
    if samples and not replays:
        raise ValueError("samples=True names the samples in the replay of a bad step; the "
                         "per-call watch (replay=False) does not replay: leave replay=None")
