"""Overhead of the noise scale from ranks (``gns_from="ranks"``) over the plain DDP Monitor.

Two gloo ranks on CPU each train an MLP under ``DistributedDataParallel`` (forward,
cross-entropy on its half of the batch, backward, AdamW step, zero_grad) and time, in
interleaved rounds (``_harness.interleaved``; both ranks run the same schedule):

* ``plain``            the DDP step alone;
* ``monitor``          the step + ``mon.step()`` with the default stats of every parameter
  gradient (DDP's gradients are already reduced: no collective);
* ``monitor (again)``  the same Monitor once more, as a separate variant: how far two identical
  variants drift apart is the run-to-run spread;
* ``+gns ranks``       the default stats plus ``gns``, ``gns_trace`` and ``gns_sqnorm`` with
  ``gns_from="ranks"`` (a post-accumulate hook per parameter and, per step, one SUM
  all_reduce of one number per tensor plus three).

The table gives each variant's median step time and its median ratio to ``plain``, then the
paired ratio of ``+gns ranks`` to ``monitor`` beside the spread: the range over rounds of
``monitor (again)`` / ``monitor``.

    python benchmarks/gns_overhead.py            # full run
    python benchmarks/gns_overhead.py --quick    # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

VARIANTS = ("plain", "monitor", "monitor (again)", "+gns ranks")


def rank_main(rank: int, world: int, hidden: int, batch: int, rounds: int, steps: int,
              warmup: int) -> dict[str, Any]:
    """One rank's timings (run by ``tests._dist.run_ranks``)."""
    import torch
    import torch.nn.functional as F

    import gradtap as gt
    from _harness import interleaved
    from _models import mlp

    model, x, y = mlp(batch=batch, hidden=hidden)
    per = batch // world
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    monitors: dict[str, Callable[[], gt.Monitor]] = {
        "monitor": lambda: gt.Monitor(ddp),
        "monitor (again)": lambda: gt.Monitor(ddp),
        "+gns ranks": lambda: gt.Monitor(
            ddp, stats=("norm", "mean", "std", "absmax", "nonfinite", "gns", "gns_trace",
                        "gns_sqnorm"), gns_from="ranks"),
    }

    def maker(variant: str) -> Callable[[], Any]:
        def make() -> Callable[[], None]:
            mon = monitors[variant]() if variant in monitors else None

            def step() -> None:
                F.cross_entropy(ddp(x), y).backward()
                if mon is not None:
                    mon.step(batch_size=per)
                opt.step()
                opt.zero_grad()

            step.cleanup = (lambda: mon.close()) if mon is not None else (  # type: ignore[attr-defined]
                lambda: None)
            return step

        return make

    timings = interleaved({v: maker(v) for v in VARIANTS}, steps=steps, rounds=rounds,
                          warmup=warmup, fresh=True)
    return {"timings": {v: {"seconds": t.seconds, "ratio": t.ratio,  # type: ignore[union-attr]
                            "per_round": t.per_round}  # type: ignore[union-attr]
                        for v, t in timings.items()},
            "params": sum(p.numel() for p in model.parameters())}


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark on two gloo ranks, print the markdown table and return it."""
    from tests._dist import run_ranks

    from _harness import machine, markdown_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CI)")
    parser.add_argument("--hidden", default="256,1024",
                        help="comma-separated MLP widths (784 -> hidden x3 -> 10)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 11)")
    args = parser.parse_args(argv)
    if args.quick:
        sizes, batch, rounds, steps, warmup = [32], 8, 2, 1, 1
    else:
        sizes = [int(h) for h in args.hidden.split(",")]
        batch, rounds, steps, warmup = 128, args.rounds or 11, 5, 2
    rows = []
    for hidden in sizes:
        res = run_ranks("gns_overhead:rank_main", 2, path=[HERE], timeout=590, kwargs={
            "hidden": hidden, "batch": batch, "rounds": rounds, "steps": steps,
            "warmup": warmup})
        t = res[0]["timings"]
        gns = _ratios(t["+gns ranks"], t["monitor"])
        again = _ratios(t["monitor (again)"], t["monitor"])
        rows.append([f"MLP 784-{hidden}x3-10", f"{res[0]['params'] / 1e6:.2f}M",
                     *(f"{t[v]['seconds'] * 1e3:.2f} ms ({t[v]['ratio']:.3f}x)"
                       for v in VARIANTS),
                     f"{statistics.median(gns):.3f}x",
                     f"{min(again):.3f}x - {max(again):.3f}x"])
    table = markdown_table(["model", "params", *VARIANTS, "+gns ranks / monitor",
                            "spread: again / monitor"], rows)
    out = "\n\n".join([f"DDP on 2 gloo ranks (CPU, one intra-op thread each), global batch "
                       f"{batch}; {machine(threads=False)}; median step time of {rounds} "
                       f"interleaved rounds x {steps} steps per variant, (in brackets) the "
                       "median over rounds of its ratio to plain in the same round; then the "
                       "paired median ratio of +gns ranks to monitor and, as the run-to-run "
                       "spread, the range over rounds of monitor (again) / monitor", table])
    print(out)
    return out


def _ratios(a: dict[str, Any], b: dict[str, Any]) -> list[float]:
    return [x / y for x, y in zip(a["per_round"], b["per_round"], strict=True)]


if __name__ == "__main__":
    main()
