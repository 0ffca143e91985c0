"""The checks of the privacy parameters, shared by the sampler and the accountant."""

from __future__ import annotations

import math

__all__ = ["check_delta", "check_noise", "check_number", "check_rate", "check_steps"]


def check_number(name: str, value: float, low: float, high: float, *, low_open: bool,
                 high_open: bool, meaning: str) -> float:
    """``value`` as a float, or a clear error naming ``name``, its ``meaning`` and the
    interval it must lie in."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} ({meaning}) must be a number, got {type(value).__name__}")
    x = float(value)
    ok_low = x > low if low_open else x >= low
    ok_high = x < high if high_open else x <= high
    if not (ok_low and ok_high):  # NaN fails both
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} ({meaning}) must be in {interval}, got {value!r}")
    return x


def check_rate(sample_rate: float) -> float:
    return check_number("sample_rate", sample_rate, 0.0, 1.0, low_open=True, high_open=False,
                        meaning="each example's probability of joining a step's batch")


def check_delta(delta: float) -> float:
    return check_number("delta", delta, 0.0, 1.0, low_open=True, high_open=True,
                        meaning="the probability the epsilon bound may fail")


def check_noise(noise_multiplier: float) -> float:
    return check_number("noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=False,
                        high_open=True,
                        meaning="the noise's standard deviation over the clipping bound")


def check_steps(steps: int, least: int = 0, name: str = "steps") -> int:
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"{name} must be an int, got {type(steps).__name__}")
    if steps < least:
        raise ValueError(f"{name} must be >= {least}, got {steps}")
    return steps
