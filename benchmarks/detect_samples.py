"""What ``gt.detect(..., samples=True)`` costs: nothing on a healthy step, a little on a bad one.

Run: .venv/bin/python benchmarks/detect_samples.py [--quick] [--clock cpu|wall]

Per model, timed in interleaved rounds by ``_harness.interleaved`` (fresh hooks every round):
a plain step; ``gt.detect`` (the default watch, ``check_loss`` and ``step()`` each step) and
the same with ``samples=True``; ``gt.detect(spike=10)`` and the same with ``samples=True``.
On a healthy step no replay runs, so ``samples=True`` should cost nothing: the ratio columns
are the median over rounds of the samples variant's time over the same detector's without it
in the same round (goal: at most 1.05x). The last two columns time a bad step (row 0 of the
batch holds a NaN, ``action="record"``): the screen, the replay that names the origin, and
with ``samples=True`` the rows it names too. ``--clock cpu`` (the default) times this
process's CPU time (``time.process_time``), which other jobs on a shared machine do not
inflate; ``--clock wall`` times wall time.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import gradtap as gt  # noqa: E402
from _harness import Timing, interleaved, machine, markdown_table, paired, steps_for  # noqa: E402
from detect_overhead import deep_narrow  # noqa: E402


def _plain(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], None]:
    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)

    return step


def _detect(model: nn.Module, x: Tensor, y: Tensor, *, samples: bool = False,
            spike: float | None = None, bad: bool = False) -> Callable[[], None]:
    det = gt.detect(model, spike=spike, samples=samples, action="record" if bad else "raise")
    if bad:
        x = x.clone()
        x.view(len(x), -1)[0, 0] = float("nan")

    def step() -> None:
        det.check_loss(F.cross_entropy(model(x), y)).backward()
        model.zero_grad(set_to_none=True)
        det.step(sample_ids=list(range(len(x))) if samples else None)
        if bad:
            assert det.anomalies and (not samples or det.anomalies[-1].samples == (0,))
            det.anomalies.clear()

    step.cleanup = det.remove  # type: ignore[attr-defined]
    return step


VARIANTS: dict[str, Callable[..., Callable[[], None]]] = {
    "plain": _plain,
    "detect": _detect,
    "detect_samples": functools.partial(_detect, samples=True),
    "spike": functools.partial(_detect, spike=10.0),
    "spike_samples": functools.partial(_detect, spike=10.0, samples=True),
    "bad": functools.partial(_detect, bad=True),
    "bad_samples": functools.partial(_detect, bad=True, samples=True),
}


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run to check the script works")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="this process's CPU time (default) or wall time")
    args = parser.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rounds = 1 if args.quick else 21
    if args.quick:
        builders = {"MLP, batch 8": lambda: _models.mlp(batch=8)}
    else:
        builders = {"MLP (_models.mlp), batch 128": _models.mlp,
                    "small CNN (_models.small_cnn), batch 64": _models.small_cnn,
                    "33-module MLP, batch 16": lambda: deep_narrow(depth=16, width=32, batch=16)}
    rows = []
    for label, build in builders.items():
        model, x, y = build()
        steps = 1 if args.quick else steps_for(_plain(model, x, y), budget=0.3, cap=100)
        makers = {name: functools.partial(make, model, x, y) for name, make in VARIANTS.items()}
        t = interleaved(makers, steps=steps, rounds=rounds, warmup=steps, fresh=True,
                        clock=clock)
        failed = {k: v for k, v in t.items() if isinstance(v, str)}
        if failed:
            raise RuntimeError(f"variants failed: {failed}")
        tt: dict[str, Timing] = t  # type: ignore[assignment]

        def ms(name: str, tt: dict[str, Timing] = tt) -> str:
            return f"{tt[name].seconds * 1e3:.2f} ms"

        rows.append([label, f"{ms('plain')} ({steps} steps)",
                     f"{ms('detect')} ({tt['detect'].ratio:.2f}x)",
                     f"{ms('detect_samples')} ({paired(tt['detect_samples'], tt['detect']):.3f}x)",
                     f"{ms('spike')} ({tt['spike'].ratio:.2f}x)",
                     f"{ms('spike_samples')} ({paired(tt['spike_samples'], tt['spike']):.3f}x)",
                     ms("bad"), f"{ms('bad_samples')} ({paired(tt['bad_samples'], tt['bad']):.2f}x)"])
    header = ["model", "plain step", "gt.detect (x plain)", "samples=True (x gt.detect)",
              "spike=10 (x plain)", "spike=10, samples=True (x spike=10)",
              "bad step: gt.detect", "bad step: samples=True (x gt.detect)"]
    table = markdown_table(header, rows)
    print(f"{machine()}; {args.clock} clock; median of {rounds} interleaved rounds (steps per "
          "round in the plain column); each ratio is the median over rounds of the variant's "
          "time over the named variant's in the same round")
    print(table)
    return table


if __name__ == "__main__":
    main()
