"""A watched training step: gt.Monitor + gt.detect + gradient clipping vs the same by hand.

Run: .venv/bin/python benchmarks/session_overhead.py [--quick] [--threads N] [--models SUBSTRING]

What a training loop that leaves gradtap on pays, against what the same work costs written by
hand. A step is forward, ``F.cross_entropy``, backward, ``SGD(momentum=0.9).step()`` and
``zero_grad()``; per model, side by side in one run:

* ``plain``        the step alone;
* ``plain again``  the same step a second time: its ratio to ``plain`` is the floor, what the
  machine's noise alone makes of two identical variants;
* ``by hand``      the step plus, after the backward, what the gradtap session below computes,
  written with torch's foreach kernels: each parameter gradient's norm (one
  ``torch._foreach_norm``), each gradient clipped to norm 1 by a clamped factor (one
  ``torch._foreach_mul_``; what ``gt.clip_norm(1.0)`` does per tensor), the Monitor's default
  statistics of the clipped gradients (norm from the factor, mean and std from one sum per
  tensor and the norm, absmax from one ``aminmax`` per tensor, the non-finite count from the
  norm being finite), one finiteness test of the loss and every norm for the step, and one
  host copy of it all; raises on a non-finite step;
* ``gradtap``      the step with ``gt.Monitor(model)`` (default statistics, ``mon.step()`` every
  step), ``gt.detect(model)`` (default watch, ``det.check_loss(loss)`` and ``det.step()``) and
  ``gt.transform(model, {"*": gt.clip_norm(1.0)})`` (per tensor, ``when="accumulate"``);
* ``by hand, global`` and ``gradtap, global``: the same with the joint norm of all gradients
  clipped instead (``torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)`` by hand,
  ``gt.clip_global_norm(1.0)`` in gradtap), the per-tensor norms for the statistics taken
  after the clip by hand.

Each variant has its own copy of the model (same initialization) and optimizer; the gradtap
objects are made at the start of each of their rounds and removed at its end, so their hooks
exist only while they run (``_harness.interleaved(fresh=True)``). Times are medians over
interleaved rounds; each ratio is the median over rounds of the variant's time over the other
variant's in the same round, with the first and third quartiles of those per-round ratios
(the run-to-run spread) in brackets. Goal: ``gradtap`` at most 1.02x ``by hand``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import gradtap as gt  # noqa: E402
from _harness import (  # noqa: E402
    Timing,
    interleaved,
    machine,
    markdown_table,
    paired,
    paired_quartiles,
    steps_for,
)

Step = Callable[[], None]
_EPS = 1e-6  # gt.clip_norm's and clip_grad_norm_'s epsilon


def _loop(model: nn.Module, x: Tensor, y: Tensor,
          after_backward: Callable[[Tensor], object] = lambda loss: None,
          wrap_loss: Callable[[Tensor], Tensor] = lambda loss: loss) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        loss = wrap_loss(F.cross_entropy(model(x), y))
        loss.backward()
        after_backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _plain(model: nn.Module, x: Tensor, y: Tensor) -> Step:
    return _loop(model, x, y)


def by_hand(params: Sequence[nn.Parameter], global_clip: bool = False) -> Callable[[Tensor], np.ndarray]:
    """After a backward, what the gradtap variant computes, by hand (see the module docstring):
    clips the gradients in place and returns, from one host copy, ``[finite, norms..., means...,
    stds..., absmaxes..., nonfinite...]`` of the clipped gradients; raises on a non-finite step."""
    params = [p for p in params if p.requires_grad]
    numels = torch.tensor([p.numel() for p in params], dtype=torch.float32)

    def after(loss: Tensor) -> np.ndarray:
        grads = [p.grad for p in params if p.grad is not None]
        if global_clip:
            total = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            norms = torch.stack(torch._foreach_norm(grads))  # of the clipped gradients
            finite = torch.isfinite(total)
        else:
            before = torch.stack(torch._foreach_norm(grads))
            factors = (1.0 / (before + _EPS)).clamp_(max=1.0)
            torch._foreach_mul_(grads, list(factors.unbind()))
            norms = before * factors
            finite = torch.isfinite(before).all()
        finite = finite & torch.isfinite(loss)
        sums = torch.stack([g.sum() for g in grads])
        minmax = [torch.aminmax(g) for g in grads]
        absmax = torch.maximum(torch.stack([m.max for m in minmax]).abs(),
                               torch.stack([m.min for m in minmax]).abs())
        mean = sums / numels
        std = (norms.square() / numels - mean.square()).clamp_(min=0).sqrt()
        nonfinite = (~torch.isfinite(norms)).float()
        host = torch.cat([finite.float().reshape(1), norms, mean, std, absmax, nonfinite]).numpy()
        if host[0] != 1.0:
            raise FloatingPointError("non-finite loss or gradient")
        return host

    return after


def _by_hand(model: nn.Module, x: Tensor, y: Tensor, global_clip: bool = False) -> Step:
    return _loop(model, x, y, by_hand(list(model.parameters()), global_clip))


def _gradtap(model: nn.Module, x: Tensor, y: Tensor, global_clip: bool = False) -> Step:
    """The step under ``gt.Monitor`` + ``gt.detect`` + ``gt.transform`` (a maker: fresh
    objects per round, removed by ``cleanup``)."""
    mon = gt.Monitor(model)
    det = gt.detect(model)
    clip = gt.clip_global_norm(1.0) if global_clip else gt.clip_norm(1.0)
    handle = gt.transform(model, {"*": clip})

    def after(loss: Tensor) -> None:
        mon.step()
        det.step()

    step = _loop(model, x, y, after, wrap_loss=det.check_loss)

    def cleanup() -> None:
        handle.remove()
        det.remove()
        mon.close()

    step.cleanup = cleanup  # type: ignore[attr-defined]
    return step


VARIANTS: dict[str, Callable[[nn.Module, Tensor, Tensor], Step]] = {
    "plain": _plain,
    "plain again": _plain,
    "by hand": _by_hand,
    "gradtap": _gradtap,
    "by hand, global": lambda m, x, y: _by_hand(m, x, y, global_clip=True),
    "gradtap, global": lambda m, x, y: _gradtap(m, x, y, global_clip=True),
}

#: key -> quick -> (label, builder)
MODELS: dict[str, Callable[[bool], tuple[str, Callable[[], tuple[nn.Module, Tensor, Tensor]]]]] = {
    "cnn": lambda quick: (
        f"small CNN (_models.small_cnn), batch {4 if quick else 64}",
        lambda: _models.small_cnn(batch=4 if quick else 64)),
    "transformer": lambda quick: (
        "Transformer encoder (_models.transformer), 2 layers, "
        + ("d=16, 4 heads, 8 tokens, batch 2" if quick else "d=128, 4 heads, 64 tokens, batch 32"),
        lambda: _models.transformer(batch=2, tokens=8, dim=16) if quick else _models.transformer()),
}


def bench_model(build: Callable[[], tuple[nn.Module, Tensor, Tensor]], quick: bool, rounds: int,
                budget: float, clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Each variant's :class:`Timing` on one model (ratios to ``plain``)."""
    model, x, y = build()
    copies = {name: copy.deepcopy(model) for name in VARIANTS}

    def maker(name: str) -> Callable[[], Step]:
        return lambda: VARIANTS[name](copies[name], x, y)

    steps = 1 if quick else steps_for(_plain(copy.deepcopy(model), x, y), budget=budget, cap=20)
    result = interleaved({name: maker(name) for name in VARIANTS}, steps=steps, rounds=rounds,
                         warmup=steps, fresh=True, clock=clock)
    failed = {k: v for k, v in result.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError(f"variants failed: {failed}")
    return result  # type: ignore[return-value]


def _ratio(a: Timing, b: Timing) -> str:
    lo, hi = paired_quartiles(a, b)
    return f"{paired(a, b):.3f}x [{lo:.3f}, {hi:.3f}]"


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, print the markdown table and return it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (tests)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 21)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by the wall clock (default) or by this process's CPU "
                        "time (time.process_time: on a loaded machine, without the waits for a "
                        "core)")
    parser.add_argument("--models", default="", help="run the models whose key contains this "
                        f"({', '.join(MODELS)})")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 21)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = []
        for key, describe in MODELS.items():
            if args.models not in key:
                continue
            label, build = describe(args.quick)
            t = bench_model(build, args.quick, rounds, budget=0.25,
                            clock=time.process_time if args.clock == "cpu" else time.perf_counter)
            plain = t["plain"]
            rows.append([
                label,
                f"{plain.seconds * 1e3:.2f} ms",
                f"{t['plain again'].seconds * 1e3:.2f} ms ({_ratio(t['plain again'], plain)})",
                f"{t['by hand'].seconds * 1e3:.2f} ms ({_ratio(t['by hand'], plain)})",
                f"{t['gradtap'].seconds * 1e3:.2f} ms ({_ratio(t['gradtap'], plain)})",
                _ratio(t["gradtap"], t["by hand"]),
                f"{t['by hand, global'].seconds * 1e3:.2f} ms "
                f"({_ratio(t['by hand, global'], plain)})",
                f"{t['gradtap, global'].seconds * 1e3:.2f} ms "
                f"({_ratio(t['gradtap, global'], plain)})",
                _ratio(t["gradtap, global"], t["by hand, global"]),
            ])
        header = ["model", "plain", "plain again (floor)", "by hand", "gradtap",
                  "gradtap / by hand", "by hand, global", "gradtap, global",
                  "gradtap / by hand, global"]
        table = markdown_table(header, rows)
        print(f"{machine()}; {args.clock} clock; median of {rounds} interleaved rounds; "
              "ms = median time per step; "
              "each ratio is the median over rounds of the variant's time over the other's in "
              "the same round (x plain in brackets after a time), with the first and third "
              "quartiles of the per-round ratios in square brackets; gradtap = Monitor "
              "(default stats) + detect (default watch) + transform clip_norm(1.0) per tensor "
              "('global': clip_global_norm(1.0)); by hand = the same work with foreach kernels "
              "and one host copy")
        print(table)
    finally:
        torch.set_num_threads(threads)  # run_all runs the next benchmark in this process
    return table


if __name__ == "__main__":
    main()
