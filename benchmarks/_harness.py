"""The one timing harness of the benchmarks: interleaved rounds, paired ratios, page faults,
peak memory in a child process, the machine's description and markdown tables.

Variants are timed in interleaved rounds (round ``r`` runs them in the order rotated by ``r``:
A B C, B C A, C A B, ...), so drift on a shared machine and the cost of coming first hit
every variant alike. A round times ``steps`` consecutive steps of one variant. Each
variant's time is the median over rounds of its seconds per step, and its ratio to the base
variant (the plain step) is the median over rounds of its time over the base's time *in the
same round*: a paired comparison, in which drift between rounds cancels.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["NO_TRIM_ENV", "Timing", "allocator", "child_json", "interleaved", "machine",
           "markdown_table", "paired", "paired_quartiles", "peak_memory_mib", "rss_bytes",
           "steps_for"]

Step = Callable[[], object]

#: glibc malloc tunables: never return freed heap memory to the OS, never mmap a block (read
#: when a process starts: a table under them runs in a child process).
NO_TRIM_ENV = {"MALLOC_TRIM_THRESHOLD_": str(2**40), "MALLOC_MMAP_THRESHOLD_": str(2**31)}


def allocator() -> str:
    """Which allocator this process runs under, in words."""
    if all(os.environ.get(k) == v for k, v in NO_TRIM_ENV.items()):
        return "glibc malloc, no trim (" + ", ".join(f"{k}={v}" for k, v in NO_TRIM_ENV.items()) + ")"
    return "default allocator"


@dataclass(frozen=True)
class Timing:
    """One variant's result.

    Attributes:
        seconds: median over rounds of the seconds per step.
        ratio: median over rounds of its time over the base variant's in the same round
            (1.0 for the base itself; NaN without a base).
        faults: median over rounds of the minor page faults per step (memory the process had
            to get fresh from the OS), when counted, else ``None``.
        per_round: seconds per step in each round, for :func:`paired` comparisons.
    """

    seconds: float
    ratio: float
    faults: float | None
    per_round: tuple[float, ...]


def paired(a: Timing, b: Timing) -> float:
    """The median over rounds of ``a``'s time over ``b``'s time in the same round."""
    return statistics.median(x / y for x, y in zip(a.per_round, b.per_round, strict=True))


def paired_quartiles(a: Timing, b: Timing) -> tuple[float, float]:
    """The first and third quartiles over rounds of ``a``'s time over ``b``'s in the same round:
    the run-to-run spread of :func:`paired` (both ends equal with a single round)."""
    ratios = [x / y for x, y in zip(a.per_round, b.per_round, strict=True)]
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, q3


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved(
    variants: Mapping[str, Callable[[], object]],
    *,
    steps: int,
    rounds: int,
    warmup: int = 1,
    base: str | None = "plain",
    fresh: bool = False,
    faults: bool = False,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing | str]:
    """Time every variant in interleaved rounds; return a :class:`Timing` per variant.

    Args:
        variants: name -> step function. With ``fresh=True``, name -> a *maker* that is called
            at the start of each of that variant's rounds and returns its step function (which
            may carry a ``cleanup`` attribute, called at the end of the round), or a string
            saying why the variant cannot run, which then becomes its result. Fresh makers
            let each variant's hooks exist only while it runs, so they cannot slow the others.
        steps: steps per variant and round.
        rounds: timed rounds.
        warmup: untimed steps of every variant before the first round; with ``fresh=True``,
            each round also runs one untimed step after making the variant.
        base: the variant every ratio is taken against, or ``None`` for no ratios.
        faults: also count minor page faults per step.
        sync: called before and after each timed block (e.g. ``torch.cuda.synchronize``).
        clock: the clock of the timed blocks: wall time (the default) or, on a machine other
            processes load, ``time.process_time`` (this process's CPU time, all its threads:
            what the work cost, without the time it waited for a core; CPU only).
    """
    names = list(variants)
    if base is not None and base not in variants:
        raise ValueError(f"base {base!r} is not a variant; variants: {names}")
    errors: dict[str, str] = {}
    times: dict[str, list[float]] = {n: [] for n in names}
    counts: dict[str, list[float]] = {n: [] for n in names}

    def make(name: str) -> Step | None:
        if not fresh:
            return variants[name]  # type: ignore[return-value]
        step = variants[name]()
        if isinstance(step, str):
            errors[name] = step
            return None
        step()  # type: ignore[operator]
        return step  # type: ignore[return-value]

    def done(step: Step) -> None:
        if fresh:
            getattr(step, "cleanup", lambda: None)()

    for name in names:
        step = make(name)
        if step is not None:
            for _ in range(warmup):
                step()
            done(step)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in errors:
                continue
            step = make(name)
            if step is None:
                continue
            if sync is not None:
                sync()
            before = _minor_faults()
            start = clock()
            for _ in range(steps):
                step()
            if sync is not None:
                sync()
            elapsed = clock() - start
            counts[name].append((_minor_faults() - before) / steps)
            times[name].append(elapsed / steps)
            done(step)
    out: dict[str, Timing | str] = dict(errors)
    for name in names:
        if name in errors:
            continue
        ratio = math.nan
        if base is not None and base not in errors:
            ratio = statistics.median(t / b for t, b in zip(times[name], times[base], strict=True))
        out[name] = Timing(statistics.median(times[name]), ratio,
                           statistics.median(counts[name]) if faults else None,
                           tuple(times[name]))
    return {name: out[name] for name in names}


def steps_for(step: Step, budget: float, cap: int) -> int:
    """Steps per round such that one round of ``step`` takes about ``budget`` seconds."""
    step()
    start = time.perf_counter()
    step()
    return max(2, min(cap, int(budget / max(time.perf_counter() - start, 1e-6))))


# -- peak memory -------------------------------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    """The process's resident set size now."""
    return _status("VmRSS")


def _reset_peak() -> int:
    """Return freed heap to the OS, reset ``VmHWM`` to the current RSS and return it."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def peak_memory_mib(build: Callable[[], Step | None], *, steps: int = 3) -> float | None:
    """Peak resident memory of ``steps`` steps, in MiB over the resident size before ``build``.

    ``build()`` makes the workload (and may run it once); one more warmup step follows, then
    the peak (``VmHWM``) is reset, so one-time costs of a first call do not count while memory
    the workload keeps between steps does. ``None`` when ``build`` returns ``None``. Measure in
    a fresh process (:func:`child_json`) to keep other workloads' memory out.
    """
    before = _reset_peak()
    step = build()
    if step is None:
        return None
    step()
    _reset_peak()
    for _ in range(steps):
        step()
    return (_status("VmHWM") - before) / 2**20


def child_json(script: str, *args: str, env: Mapping[str, str] | None = None) -> object | None:
    """Run ``python script args...`` in a fresh process; the JSON on its last output line, or
    ``None`` when it fails."""
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                         check=False, env=None if env is None else {**os.environ, **env})
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- reporting ---------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device | str | None = None, *, threads: bool = True) -> str:
    """The machine in words: CPU, cores, GPU (when ``device`` is one), torch and, with
    ``threads``, the intra-op threads torch uses now."""
    parts = [f"{_cpu_model()}, {os.cpu_count()} CPU cores"]
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    parts.append(f"torch {torch.__version__}"
                 + (f", {torch.get_num_threads()} threads" if threads else ""))
    return "; ".join(parts)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]],
                   align: str | None = None) -> str:
    """Format rows as a markdown table; ``align`` has one ``l`` or ``r`` per column (``r``:
    right-aligned, ``---:``), or ``None`` for the default alignment everywhere."""
    rule = ["---" if align is None or a == "l" else "---:" for a in (align or header)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
