"""Overhead of gt.Monitor on a training step, side by side in one run.

For an MLP, a small CNN and a ResNet-18-like net (CPU, or the GPU with ``--device cuda``),
times one training step (forward, cross-entropy, backward, AdamW step, zero_grad):

* ``plain``       the step alone;
* ``monitor``     the step + ``mon.step()`` with the default stats (norm, mean, std, absmax,
  nonfinite) on every parameter gradient, every step, kept in memory;
* ``+store``      the same, writing every step to a run store (SQLite, one transaction/step);
* ``naive loop``  the step + a per-tensor loop calling ``.item()`` on each statistic (what
  hand-written logging usually does: one host sync per tensor and statistic);
* ``bare kernels`` the step + only the three reduction passes these stats need (a sum and an
  aminmax per tensor, one foreach L2 norm without the monitor's blocking for accuracy) and
  one host copy, with no bookkeeping: about the floor that torch's unfused kernels allow.

Variants are interleaved round by round (``_harness.interleaved``) so that machine noise hits
them alike; the table gives the median time per step and the median over rounds of its ratio
to ``plain`` in the same round; ``bare kernels`` is the floor. A second table gives the growth of the process's resident memory over many monitored
steps (kept in memory, and with a store).

    python benchmarks/monitor_overhead.py            # full run
    python benchmarks/monitor_overhead.py --quick    # a few seconds, for CI
    python benchmarks/monitor_overhead.py --models cnn --threads 1 --clock cpu --floor

``--clock cpu`` times this process's CPU time instead of wall time (on a machine other
processes load); ``--floor`` adds ``plain again``, the plain step a second time, whose ratio is
what the machine's noise alone makes of two identical variants, and gives every ratio with the
first and third quartiles over rounds in brackets.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import gradtap as gt  # noqa: E402
from _harness import (  # noqa: E402
    Timing,
    interleaved,
    machine,
    markdown_table,
    paired_quartiles,
    rss_bytes,
)

VARIANTS = ("plain", "monitor", "+store", "naive loop", "bare kernels")


def _naive_stats(model: torch.nn.Module) -> list[float]:
    out = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        out += [g.norm().item(), g.mean().item(), g.std(correction=0).item(),
                g.abs().max().item(), (~torch.isfinite(g)).sum().item()]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _SGD:
    """A plain SGD step (``--quick``: avoids torch.optim's multi-second first import)."""

    def __init__(self, params: object, lr: float = 1e-3) -> None:
        self.params = list(params)  # type: ignore[call-overload]
        self.lr = lr

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _optimizer(model: torch.nn.Module, quick: bool) -> object:
    return _SGD(model.parameters()) if quick else torch.optim.AdamW(model.parameters(), lr=1e-3)


def bench_model(name: str, build: Callable, *, device: torch.device, rounds: int, steps: int,
                warmup: int, quick: bool = False, variants: Sequence[str] = VARIANTS,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Each variant's :class:`Timing` on one model (ratios to ``plain``)."""
    model, x, y = build()
    model, x, y = model.to(device), x.to(device), y.to(device)
    opt = _optimizer(model, quick)
    mon = gt.Monitor(model)
    tmp = tempfile.TemporaryDirectory()
    mon_store = gt.Monitor(model, store=Path(tmp.name) / "run")

    def train_step(after: Callable[[], object]) -> Callable[[], None]:
        def step() -> None:
            F.cross_entropy(model(x), y).backward()
            after()
            opt.step()
            opt.zero_grad()

        return step

    after: dict[str, Callable[[], object]] = {
        "plain": lambda: None,
        "plain again": lambda: None,
        "monitor": mon.step,
        "+store": mon_store.step,
        "naive loop": lambda: _naive_stats(model),
        "bare kernels": lambda: _models.bare_stat_kernels(model),
    }
    try:
        result = interleaved({v: train_step(after[v]) for v in variants}, steps=steps,
                             rounds=rounds, warmup=warmup, sync=lambda: _sync(device),
                             clock=clock)
    finally:
        mon.close()
        mon_store.close()
        tmp.cleanup()
    return result  # type: ignore[return-value]  # no variant is a maker, so none fails


def memory_growth(build: Callable, *, device: torch.device, steps: int, store: bool,
                  quick: bool = False) -> tuple[float, float]:
    """Resident-memory growth (MiB) between step steps//10 and the last step, and bytes/step."""
    model, x, y = build()
    model, x, y = model.to(device), x.to(device), y.to(device)
    opt = _optimizer(model, quick)
    with tempfile.TemporaryDirectory() as tmp:
        mon = gt.Monitor(model, store=Path(tmp) / "run" if store else None)
        start = None
        first = max(steps // 10, 1)
        for i in range(steps):
            F.cross_entropy(model(x), y).backward()
            mon.step()
            opt.step()
            opt.zero_grad()
            if i + 1 == first:
                start = rss_bytes()
        end = rss_bytes()
        mon.close()
    assert start is not None
    grown = end - start
    return grown / 2**20, grown / (steps - first)


def _cell(t: Timing, plain: Timing, quartiles: bool) -> str:
    """``time (ratio)``, with the ratio's quartiles over rounds when asked for."""
    if not quartiles:
        return f"{t.seconds * 1e3:.2f} ms ({t.ratio:.3f}x)"
    q1, q3 = paired_quartiles(t, plain)
    return f"{t.seconds * 1e3:.2f} ms ({t.ratio:.3f}x [{q1:.3f}, {q3:.3f}])"


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, print the markdown tables and return them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CI)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--memory-steps", type=int, default=None,
                        help="steps of the memory test (default 2000, 40 with --quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--models", default="mlp,cnn,resnet",
                        help="comma-separated subset of mlp, cnn, resnet")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 11)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time (default) or this process's CPU time")
    parser.add_argument("--floor", action="store_true",
                        help="add 'plain again' and the quartiles of every ratio")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, device)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, device: torch.device) -> str:
    torch.manual_seed(0)
    if args.quick:
        models = [("MLP", lambda: _models.mlp(batch=4, hidden=32)),
                  ("small CNN", lambda: _models.small_cnn(batch=2)),
                  ("ResNet-18-like", lambda: _models.resnet18_like(batch=2, width=4))]
        rounds, steps, warmup = 1, 2, 1
    else:
        models = [("MLP", _models.mlp), ("small CNN", _models.small_cnn),
                  ("ResNet-18-like", _models.resnet18_like)]
        rounds, steps, warmup = args.rounds or 11, 10, 3
    keys = ("mlp", "cnn", "resnet")
    wanted = [k.strip() for k in args.models.split(",")]
    unknown = sorted(set(wanted) - set(keys))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {', '.join(keys)}")
    models = [m for k, m in zip(keys, models) if k in wanted]
    mem_steps = args.memory_steps or (40 if args.quick else 2000)

    variants = (VARIANTS[0], "plain again", *VARIANTS[1:]) if args.floor else VARIANTS
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for name, build in models:
        n_params = sum(p.numel() for p in build()[0].parameters())
        t = bench_model(name, build, device=device, rounds=rounds, steps=steps, warmup=warmup,
                        quick=args.quick, variants=variants, clock=clock)
        rows.append([name, f"{n_params / 1e6:.2f}M", f"{t['plain'].seconds * 1e3:.2f} ms"] + [
            _cell(t[v], t["plain"], args.floor) for v in variants[1:]])
    timing = markdown_table(["model", "params", *variants], rows)

    mem_rows = []
    for store in (False, True):
        mib, per_step = memory_growth(models[0][1], device=device, steps=mem_steps, store=store,
                                      quick=args.quick)
        mem_rows.append(["run store (SQLite)" if store else "in memory", f"{mib:.2f} MiB",
                         f"{per_step:.0f} B"])
    memory = markdown_table(["history", f"RSS growth over {mem_steps} steps ({models[0][0]})", "per step"],
                            mem_rows)
    print(f"{machine(device)}; device {device}; median over {rounds} interleaved rounds of the "
          f"step time ({'CPU' if args.clock == 'cpu' else 'wall'} clock; rounds of {steps} "
          "steps per variant), and (in brackets) the median over rounds of its ratio to plain "
          f"in the same round{' [first, third quartile]' if args.floor else ''}; "
          f"{'plain SGD' if args.quick else 'AdamW'}; monitor = default stats on every "
          "parameter gradient, every step\n")
    print(timing)
    print(f"\nResident memory growth from step {max(mem_steps // 10, 1)} to {mem_steps}:\n")
    print(memory)
    return timing + "\n\n" + memory


if __name__ == "__main__":
    main()
