"""Overhead of gt.Monitor under FSDP2 (two gloo ranks on CPU), side by side in one run.

Each rank trains an MLP sharded with ``fully_shard`` (every Linear and the root; forward,
cross-entropy on its half of the batch, backward, AdamW step, zero_grad) and times, in
interleaved rounds (``_harness.interleaved``; both ranks run the same schedule in lockstep):

* ``plain``          the FSDP2 step alone;
* ``monitor``        the step + ``mon.step()`` with the default stats (norm, mean, std,
  absmax, nonfinite) of every parameter gradient, reduced over the shards;
* ``+grad_output``   the same plus the activation gradients of every module (global batch);
* ``all kinds``      every stat of param_grad, param, update, grad_cosine and grad_output,
  32-bin histograms and the EWMA;
* ``clip_grad_norm_`` the step + torch's own ``clip_grad_norm_`` over the DTensor gradients
  (one all_reduce of its own): a reference for what one small collective costs here.

Ratios are medians over rounds of the variant's time over ``plain``'s in the same round
(rank 0's clock; the ranks wait for each other in every collective). A second table counts,
per step, the collectives and bytes of FSDP2's own step and of each Monitor's ``step()``
(counted by wrapping ``torch.distributed``'s functions in the rank process; bytes are those
of each collective's full buffer: an all_reduce's, a reduce-scatter's input, an all-gather's
output).

    python benchmarks/distributed.py            # full run
    python benchmarks/distributed.py --quick    # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

VARIANTS = ("plain", "monitor", "+grad_output", "all kinds", "clip_grad_norm_")
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
                "all_to_all_single")


class _Count:
    """Counts ``torch.distributed`` collectives and their bytes while active."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Count:
        import torch.distributed as dist

        for name in _COLLECTIVES:
            real = getattr(dist, name, None)
            if real is None:
                continue
            self._saved[name] = real

            def counting(*args: Any, _name: str = name, _real: Any = real, **kw: Any) -> Any:
                # The largest tensor argument: the buffer of an all_reduce, the full tensor
                # of a reduce-scatter (input) or an all-gather (output).
                sizes = [t.numel() * t.element_size() for t in (*args, *kw.values())
                         if hasattr(t, "numel") and hasattr(t, "element_size")]
                self.calls.append((_name, max(sizes, default=0)))
                return _real(*args, **kw)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        for name, real in self._saved.items():
            setattr(dist, name, real)


def rank_main(rank: int, world: int, hidden: int, batch: int, rounds: int, steps: int,
              warmup: int, quick: bool) -> dict[str, Any]:
    """One rank's timings and collective counts (run by ``tests._dist.run_ranks``)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    import gradtap as gt
    from _harness import interleaved
    from _models import mlp

    model, x, y = mlp(batch=batch, hidden=hidden)
    per = batch // world
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    monitors: dict[str, Callable[[], gt.Monitor]] = {
        "monitor": lambda: gt.Monitor(model),
        "+grad_output": lambda: gt.Monitor(model, kinds=("param_grad", "grad_output")),
        "all kinds": lambda: gt.Monitor(
            model, stats=("norm", "mean", "std", "absmax", "min", "max", "nonfinite", "zero_frac"),
            kinds=("param_grad", "grad_output", "param", "update", "grad_cosine"),
            ewma=0.99, hist_bins=32),
    }

    def forward_backward() -> None:
        F.cross_entropy(model(x), y).backward()

    def finish() -> None:
        opt.step()
        opt.zero_grad()

    def maker(variant: str) -> Callable[[], Any]:
        def make() -> Callable[[], None]:
            mon = monitors[variant]() if variant in monitors else None

            def step() -> None:
                forward_backward()
                if mon is not None:
                    mon.step()
                elif variant == "clip_grad_norm_":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                finish()

            step.cleanup = (lambda: mon.close()) if mon is not None else (  # type: ignore[attr-defined]
                lambda: None)
            return step

        return make

    timings = interleaved({v: maker(v) for v in VARIANTS}, steps=steps, rounds=rounds,
                          warmup=warmup, fresh=True)

    # Collectives per step: FSDP2's own (forward + backward) and each Monitor's step().
    counts: dict[str, list[tuple[str, int]]] = {}
    with _Count() as own:
        forward_backward()
    counts["FSDP2 forward + backward"] = own.calls
    finish()
    for name, build in monitors.items():
        mon = build()
        for _ in range(2):  # the second step has update and grad_cosine too
            forward_backward()
            with _Count() as c:
                mon.step()
            finish()
        counts[f"Monitor.step(), {name}"] = c.calls
        mon.close()
    n_params = sum(p.numel() for p in model.parameters())
    return {"timings": {v: {"seconds": t.seconds, "ratio": t.ratio}  # type: ignore[union-attr]
                        for v, t in timings.items()},
            "counts": counts, "params": n_params,
            "tensors": sum(1 for _ in model.parameters())}


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark on two gloo ranks, print the markdown tables and return them."""
    from tests._dist import run_ranks

    from _harness import markdown_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CI)")
    parser.add_argument("--hidden", default="256,1024",
                        help="comma-separated MLP widths (784 -> hidden x3 -> 10)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 9)")
    args = parser.parse_args(argv)
    if args.quick:
        sizes, batch, rounds, steps, warmup = [32], 8, 1, 1, 1
    else:
        sizes = [int(h) for h in args.hidden.split(",")]
        batch, rounds, steps, warmup = 128, args.rounds or 9, 5, 2
    rows, comm_rows = [], []
    for hidden in sizes:
        res = run_ranks("distributed:rank_main", 2, path=[HERE], timeout=590, kwargs={
            "hidden": hidden, "batch": batch, "rounds": rounds, "steps": steps,
            "warmup": warmup, "quick": args.quick})
        t = res[0]["timings"]
        model = f"MLP 784-{hidden}x3-10"
        rows.append([model, f"{res[0]['params'] / 1e6:.2f}M",
                     f"{t['plain']['seconds'] * 1e3:.2f} ms"]
                    + [f"{t[v]['seconds'] * 1e3:.2f} ms ({t[v]['ratio']:.3f}x)"
                       for v in VARIANTS[1:]])
        for what, calls in res[0]["counts"].items():
            kinds: dict[str, int] = {}
            for name, _ in calls:
                kinds[name] = kinds.get(name, 0) + 1
            comm_rows.append([model, what, len(calls),
                              ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "-",
                              _bytes(sum(b for _, b in calls))])
    timing = markdown_table(["model", "params", *VARIANTS], rows)
    comm = markdown_table(["model", "per step", "collectives", "which", "bytes (full buffers)"],
                          comm_rows)
    from _harness import machine

    out = "\n\n".join([f"FSDP2 on 2 gloo ranks (CPU, one intra-op thread each), global batch "
                       f"{batch}; {machine(threads=False)}; median step time of {rounds} "
                       f"interleaved rounds x {steps} steps per variant, and (in brackets) the "
                       "median over rounds of its ratio to plain in the same round",
                       timing, comm])
    print(out)
    return out


def _bytes(n: int) -> str:
    for unit, size in (("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


if __name__ == "__main__":
    main()
