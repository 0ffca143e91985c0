"""Shared timing for the benchmarks: interleaved rounds, median per-step time, markdown tables.

Variants are timed in interleaved rounds (A B C A B C ...) so that drift on a shared machine
hits every variant alike; each round times ``steps`` consecutive steps after a warmup.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

__all__ = ["markdown_table", "paired_ratios", "time_variants"]


def time_variants(
    variants: dict[str, Callable[[], object]],
    *,
    steps: int,
    rounds: int,
    warmup: int = 3,
) -> dict[str, float]:
    """Return the median seconds per step of each variant (``None`` value: it raised)."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            samples[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(s) for name, s in samples.items()}


def paired_ratios(per_round: dict[str, Sequence[float]], base: str = "plain") -> dict[str, float]:
    """The median over rounds of each variant's time over ``base``'s time in the same round
    (``per_round[name][r]``: a time of round ``r``); pairing cancels drift between rounds."""
    return {name: statistics.median(a / b for a, b in zip(times, per_round[base], strict=True))
            for name, times in per_round.items()}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Format rows as a markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
