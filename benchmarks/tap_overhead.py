"""Overhead of gt.tap versus a plain step and versus no-op full backward hooks.

Run: .venv/bin/python benchmarks/tap_overhead.py [--quick]

Side by side in one run, per model: a plain forward+backward step; a no-op
``register_full_backward_hook`` on every leaf module (the hand-written alternative; it raises
when an in-place op follows a hooked module, as in ResNet's ReLU(inplace=True)); and
``gt.tap`` on every module keeping gradients only, with ``tap.clear()`` each step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import gradtap as gt  # noqa: E402
from _timing import markdown_table  # noqa: E402


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


def _with_tap(model, x, y) -> Callable[[], None]:
    tap = gt.tap(model)  # every submodule, gradients only
    plain = _step(model, x, y)

    def step() -> None:
        plain()
        tap.clear()

    step.cleanup = tap.remove  # type: ignore[attr-defined]
    return step


def _interleaved(model, x, y, *, steps: int, rounds: int) -> dict[str, float | str]:
    """Median seconds per step of each variant, timed in interleaved rounds; each variant's
    hooks are installed only while it runs, so they cannot slow the others down."""
    makers = {"plain": lambda: _step(model, x, y), "hooks": lambda: _with_full_hooks(model, x, y),
              "tap": lambda: _with_tap(model, x, y)}
    samples: dict[str, list[float]] = {name: [] for name in makers}
    errors: dict[str, str] = {}
    for r in range(rounds + 1):  # round 0 is warmup
        for name, make in makers.items():
            if name in errors:
                continue
            fn = make()
            if isinstance(fn, str):
                errors[name] = fn
                continue
            fn()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            elapsed = (time.perf_counter() - start) / steps
            getattr(fn, "cleanup", lambda: None)()
            if r:
                samples[name].append(elapsed)
    out: dict[str, float | str] = {k: statistics.median(v) for k, v in samples.items() if v}
    out.update(errors)
    return out


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run to check the script works")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    args = parser.parse_args(argv)
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
        t = _interleaved(model, x, y, steps=steps, rounds=rounds)
        base = t["plain"]
        assert isinstance(base, float)

        def cell(v: float | str, base: float = base) -> str:
            return v if isinstance(v, str) else f"{v * 1e3:.2f} ms ({v / base:.2f}x)"

        rows.append([label, f"{base * 1e3:.2f} ms", cell(t["hooks"]), cell(t["tap"])])
    header = ["model", "plain step", "no-op full_backward_hook on every leaf", "gt.tap on every module"]
    table = markdown_table(header, rows)
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; median of {rounds} "
          f"interleaved rounds of {steps} steps each")
    print(table, flush=True)
    return table


if __name__ == "__main__":
    main()
