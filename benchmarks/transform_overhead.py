"""Overhead of gradient transforms: normalize + clip_norm on every conv weight vs a plain step.

One command, every variant side by side in one run (rounds interleave the variants so that
machine noise hits them alike, ``_harness.interleaved``). A step is forward + backward +
``SGD.step()`` + ``zero_grad()`` of ``small_cnn`` (benchmarks/_models.py) on one batch; each
variant has its own copy of the model, from the same initialization. The table reports the
median time per step over rounds and the median over rounds of its time over the plain step's
in the same round. Goal: at most 1.10x on CPU.

    python benchmarks/transform_overhead.py            # full run
    python benchmarks/transform_overhead.py --quick    # seconds, for tests

``--clip-norm`` times, instead, ``clip_norm(1.0)`` on every parameter of the Transformer
encoder (``_models.transformer``, batch 16) with ``when="accumulate"``: as it runs (one pass
at the end of each backward over the tensors it reached) beside the same rule one tensor at
a time as each ``.grad`` is accumulated (what compiled autograd gets), and a plain step,
by this process's CPU time.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradtap as gt  # noqa: E402
from _harness import interleaved, machine, markdown_table  # noqa: E402
from _models import small_cnn, transformer  # noqa: E402

WHENS = ("accumulate", "backward", "step")


def _conv_weights(model: nn.Module) -> tuple[str, ...]:
    return tuple(f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Conv2d))


def _make_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, when: str | None) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if when is not None:
        rules = {_conv_weights(model): gt.chain(gt.normalize(beta=0.99), gt.clip_norm(1.0))}
        gt.transform(model, rules, when=when, optimizer=opt if when == "step" else None)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def run(batch: int, rounds: int, steps: int, warmup: int) -> list[tuple[str, float, float]]:
    """Return ``[(variant, median seconds per step, paired ratio to plain)]``."""
    base, x, y = small_cnn(batch=batch)
    variants: dict[str, Callable[[], None]] = {"plain step": _make_step(copy.deepcopy(base), x, y, None)}
    for when in WHENS:
        variants[f"normalize+clip_norm, when={when!r}"] = _make_step(copy.deepcopy(base), x, y, when)
    timings = interleaved(variants, steps=steps, rounds=rounds, warmup=warmup, base="plain step")
    return [(name, t.seconds, t.ratio) for name, t in timings.items()
            if not isinstance(t, str)]


def _one_by_one(t: gt.Transform) -> gt.Transform:
    """``t`` without its ``update_many``: one tensor at a time on accumulate."""
    return gt.Transform(t.init, lambda g, s, p, **kw: t.update(g, s, p, **kw))


def run_clip_norm(batch: int, rounds: int, steps: int,
                  warmup: int) -> tuple[list[tuple[str, float, float]], int]:
    """clip_norm on accumulate, batched vs one by one, on the encoder; and its tensor count."""
    base, x, y = transformer(batch=batch)
    variants: dict[str, Callable[[], None]] = {}
    for name, rule in (("plain step", None), ("clip_norm, one pass per backward", gt.clip_norm(1.0)),
                       ("clip_norm, one tensor at a time", _one_by_one(gt.clip_norm(1.0)))):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if rule is not None:
            gt.transform(model, {"*": rule}, when="accumulate")

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        variants[name] = step
    # This process's CPU time: other jobs on a shared machine weigh less on the figures.
    timings = interleaved(variants, steps=steps, rounds=rounds, warmup=warmup, base="plain step",
                          clock=time.process_time)
    rows = [(name, t.seconds, t.ratio) for name, t in timings.items() if not isinstance(t, str)]
    return rows, len(list(base.parameters()))


def table(rows: list[tuple[str, float, float]], header: str) -> str:
    body = markdown_table(["variant", "ms / step", "ratio vs plain"],
                          [[name, f"{sec * 1e3:.2f}", f"{ratio:.3f}x"] for name, sec, ratio in rows],
                          align="lrr")
    return f"{header}\n\n{body}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gradient-transform overhead on small_cnn")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 64, quick 4)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--clip-norm", action="store_true",
                        help="clip_norm on accumulate, batched vs one tensor at a time")
    args = parser.parse_args(argv)
    quick = args.quick
    batch = args.batch or (4 if quick else 64)
    rounds = args.rounds or (2 if quick else 15)
    steps = args.steps or (1 if quick else 5)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.clip_norm:
            batch = args.batch or (2 if quick else 16)
            rows, count = run_clip_norm(batch, rounds, steps, warmup=1 if quick else 3)
            print(table(rows, f"{machine()}; Transformer encoder ({count} tensors), batch "
                        f"{batch}, CPU time; median of {rounds} interleaved rounds x {steps} steps, "
                        "ratio paired per round; rule: every parameter -> clip_norm(1.0), "
                        "when='accumulate'"))
            return 0
        rows = run(batch, rounds, steps, warmup=1 if quick else 3)
        header = (
            f"{machine()}; small_cnn, batch {batch}, CPU; median of {rounds} interleaved rounds "
            f"x {steps} steps, ratio paired per round; rule: every conv weight -> "
            "chain(normalize(0.99), clip_norm(1.0))"
        )
    finally:
        torch.set_num_threads(threads)  # run_all runs the next benchmark in this process
    print(table(rows, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
