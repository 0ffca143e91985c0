"""Overhead of gt.tap versus a plain step, no-op full backward hooks, and hand-written hooks.

Run: .venv/bin/python benchmarks/tap_overhead.py [--quick] [--allocator default|no-trim|both]

Side by side in one run, per model: a plain forward+backward step; a no-op
``register_full_backward_hook`` on every leaf module (the usual hand-written hook; it raises
when an in-place op follows a hooked module, as in ResNet's ReLU(inplace=True)); hand-written
tensor hooks that keep what a tap keeps (every module's output gradient and every parameter
gradient) until the step ends; and ``gt.tap`` on every module keeping gradients only, with
``tap.clear()`` each step. Each cell gives the median time per step, its paired ratio to the
plain step (the median over rounds of its time over the plain step's in the same round, which
cancels the machine's drift between rounds), and the minor page faults per step (memory the
process had to get fresh from the OS).

Why two allocator settings: keeping every gradient of a step means the backward cannot reuse
the memory of gradients it has consumed, and when the records are dropped glibc's malloc hands
that memory back to the OS, so the next step pays page faults for it again. ``--allocator
no-trim`` reruns the table in a child process with ``MALLOC_TRIM_THRESHOLD_`` and
``MALLOC_MMAP_THRESHOLD_`` set (freed memory stays in the process, as with jemalloc or
tcmalloc), for every variant alike; ``both`` (the default) prints the two tables.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import gradtap as gt  # noqa: E402
from _harness import NO_TRIM_ENV, Timing, allocator, interleaved, machine, markdown_table  # noqa: E402

HEADER = ["model", "plain step", "no-op full_backward_hook on every leaf",
          "hand-written hooks keeping the same gradients", "gt.tap on every module"]


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)

    return step


def _with_full_hooks(model, x, y) -> Callable[[], None] | str:
    """A step with a no-op full backward hook on every leaf module, or why it cannot run."""
    # The first layer's input needs no grad: torch warns that the hook sees outputs only.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    handles = [m.register_full_backward_hook(lambda mod, gi, go: None)
               for m in model.modules() if not list(m.children())]
    step = _step(model, x, y)
    step.cleanup = lambda: [h.remove() for h in handles]  # type: ignore[attr-defined]
    try:
        step()
    except RuntimeError as err:
        step.cleanup()  # type: ignore[attr-defined]
        return "fails: " + str(err).split("\n")[0][:70]
    return step


def _with_kept_grads(model, x, y) -> Callable[[], None]:
    """A step whose tensor hooks keep every module's output gradient and every parameter's
    gradient until the step ends: the memory a tap's records hold, with no bookkeeping."""
    kept: list[torch.Tensor] = []
    keep = kept.append

    def on_output(mod: nn.Module, args: tuple, out: object) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(keep)

    handles = [m.register_forward_hook(on_output) for m in model.modules() if m is not model]
    handles += [p.register_hook(keep) for p in model.parameters()]
    plain = _step(model, x, y)

    def step() -> None:
        plain()
        kept.clear()

    step.cleanup = lambda: [h.remove() for h in handles]  # type: ignore[attr-defined]
    return step


def _with_tap(model, x, y) -> Callable[[], None]:
    tap = gt.tap(model)  # every submodule, gradients only
    plain = _step(model, x, y)

    def step() -> None:
        plain()
        tap.clear()

    step.cleanup = tap.remove  # type: ignore[attr-defined]
    return step


def _table(args: argparse.Namespace) -> str:
    steps, rounds = (2, 1) if args.quick else (args.steps, args.rounds)
    builders = {"MLP 784-512x3-10, batch 128": _models.mlp,
                "small CNN, batch 64, 3x32x32": _models.small_cnn,
                "ResNet-18-like, batch 16, 3x32x32": _models.resnet18_like}
    if args.quick:  # tiny sizes: only checks that the script works
        builders = {"MLP (quick)": lambda: _models.mlp(batch=4, hidden=32),
                    "small CNN (quick)": lambda: _models.small_cnn(batch=2),
                    "ResNet-18-like (quick)": lambda: _models.resnet18_like(batch=2, width=4)}
    rows = []
    for label, build in builders.items():
        model, x, y = build()
        # Each variant's hooks are installed only while it runs, so they cannot slow the others.
        makers = {name: functools.partial(make, model, x, y) for name, make in
                  (("plain", _step), ("hooks", _with_full_hooks), ("kept", _with_kept_grads),
                   ("tap", _with_tap))}
        t = interleaved(makers, steps=steps, rounds=rounds, warmup=steps, fresh=True, faults=True)

        def cell(v: Timing | str) -> str:
            if isinstance(v, str):
                return v
            return f"{v.seconds * 1e3:.2f} ms ({v.ratio:.2f}x), {v.faults:.0f} faults"

        rows.append([label, cell(t["plain"]), cell(t["hooks"]), cell(t["kept"]), cell(t["tap"])])
    print(f"{machine()}, {allocator()}; median of {rounds} interleaved rounds of {steps} steps "
          "each; ratio = median over rounds of the variant's time over the plain step's in the "
          "same round; faults = minor page faults per step", flush=True)
    table = markdown_table(HEADER, rows)
    print(table, flush=True)
    return table


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run to check the script works")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round (default 5)")
    parser.add_argument("--rounds", type=int, default=11,
                        help="interleaved rounds (default 11)")
    parser.add_argument("--allocator", choices=("default", "no-trim", "both"), default="both",
                        help="run under the default allocator, glibc without trimming, or both")
    args = parser.parse_args(argv)
    tables = []
    if args.allocator in ("default", "both"):
        tables.append(_table(args))
    if args.allocator in ("no-trim", "both"):
        print(flush=True)
        # The tunables are read when the process starts: run the table in a child process.
        cmd = [sys.executable, __file__, "--allocator", "default", "--steps", str(args.steps),
               "--rounds", str(args.rounds)] + (["--quick"] if args.quick else [])
        child = subprocess.run(cmd, env={**os.environ, **NO_TRIM_ENV}, check=True,
                               capture_output=True, text=True)
        print(child.stdout, end="", flush=True)
        tables.append(child.stdout.split("\n", 1)[1].strip())
    return "\n\n".join(tables)


if __name__ == "__main__":
    main()
