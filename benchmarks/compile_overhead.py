"""Overhead of gt.Monitor's parameter kinds on a compiled model, side by side with eager.

For an MLP and a small CNN (``--models`` adds the ResNet-18-like net), times one training
step (forward, cross-entropy, backward, AdamW step, zero_grad) in four variants, interleaved
round by round (``_harness.interleaved``):

* ``eager plain``       the step on the model as it is;
* ``eager monitor``     the same + ``mon.step()`` (default stats on every parameter gradient);
* ``compiled plain``    the step on ``torch.compile(model)`` (the default backend, inductor);
* ``compiled monitor``  the same + ``mon.step()`` of a Monitor made on the compiled model;
* ``compiled floor``    the compiled step + only the reduction passes the default stats need
  and one host copy (``_models.bare_stat_kernels``): the floor the Monitor is held to.

Each monitor variant's ratio is the median over rounds of its time over its own plain step's
time in the same round (eager over eager, compiled over compiled). The Monitor's parameter
kinds hook nothing, so the compiled forward and backward are exactly those of the plain
compiled step; what the ratio shows is the cost of ``mon.step()`` next to a faster step.

    python benchmarks/compile_overhead.py            # full run
    python benchmarks/compile_overhead.py --quick    # a few seconds, for CI (backend "eager")
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import gradtap as gt  # noqa: E402
from _harness import Timing, interleaved, machine, markdown_table, paired  # noqa: E402

VARIANTS = ("eager plain", "eager monitor", "compiled plain", "compiled monitor",
            "compiled floor")


def bench_model(build: Callable, *, rounds: int, steps: int, warmup: int, backend: str,
                kinds: Sequence[str]) -> dict[str, Timing]:
    """Each variant's :class:`Timing` on one model (ratios to ``eager plain``)."""
    import torch._dynamo

    torch._dynamo.reset()
    variants = {}
    for compiled in (False, True):
        model, x, y = build()
        target = torch.compile(model, backend=backend) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = gt.Monitor(target, kinds=kinds)

        def step(after: Callable[[], object], target: torch.nn.Module = target,
                 x: torch.Tensor = x, y: torch.Tensor = y,
                 opt: torch.optim.Optimizer = opt) -> Callable[[], None]:
            def run() -> None:
                F.cross_entropy(target(x), y).backward()
                after()
                opt.step()
                opt.zero_grad()

            return run

        prefix = "compiled" if compiled else "eager"
        variants[f"{prefix} plain"] = step(lambda: None)
        variants[f"{prefix} monitor"] = step(mon.step)
        if compiled:
            variants["compiled floor"] = step(lambda m=model: _models.bare_stat_kernels(m))
    with warnings.catch_warnings():
        # Inductor may warn about a missing tuning option on a CPU; not our code.
        warnings.simplefilter("ignore")
        out = interleaved(variants, steps=steps, rounds=rounds, warmup=warmup,
                          base="eager plain")
    return out  # type: ignore[return-value]  # no variant is a maker, so none fails


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, print the markdown table and return it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, few steps and the 'eager' backend (CI)")
    parser.add_argument("--models", default="mlp,cnn",
                        help="comma-separated subset of mlp, cnn, resnet")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 11)")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default inductor; 'eager' with --quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> str:
    torch.manual_seed(0)
    if args.quick:
        builders = {"mlp": ("MLP", lambda: _models.mlp(batch=4, hidden=32)),
                    "cnn": ("small CNN", lambda: _models.small_cnn(batch=2)),
                    "resnet": ("ResNet-18-like", lambda: _models.resnet18_like(batch=2, width=4))}
        rounds, steps, warmup = 1, 2, 1
    else:
        builders = {"mlp": ("MLP", _models.mlp), "cnn": ("small CNN", _models.small_cnn),
                    "resnet": ("ResNet-18-like", _models.resnet18_like)}
        rounds, steps, warmup = args.rounds or 11, 10, 3
    backend = args.backend or ("eager" if args.quick else "inductor")
    wanted = [k.strip() for k in args.models.split(",")]
    unknown = sorted(set(wanted) - set(builders))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {', '.join(builders)}")
    kinds = ("param_grad",)
    rows = []
    for key in wanted:
        name, build = builders[key]
        t = bench_model(build, rounds=rounds, steps=steps, warmup=warmup, backend=backend,
                        kinds=kinds)
        rows.append([
            name,
            f"{t['eager plain'].seconds * 1e3:.2f} ms",
            f"{t['eager monitor'].seconds * 1e3:.2f} ms "
            f"({paired(t['eager monitor'], t['eager plain']):.3f}x)",
            f"{t['compiled plain'].seconds * 1e3:.2f} ms",
            f"{t['compiled monitor'].seconds * 1e3:.2f} ms "
            f"({paired(t['compiled monitor'], t['compiled plain']):.3f}x)",
            f"{t['compiled floor'].seconds * 1e3:.2f} ms "
            f"({paired(t['compiled floor'], t['compiled plain']):.3f}x)",
        ])
    table = markdown_table(["model", *VARIANTS], rows)
    print(f"{machine()}; backend {backend}; median over {rounds} interleaved rounds of the "
          f"step time (rounds of {steps} steps per variant), and (in brackets) the median over "
          "rounds of its ratio to the plain step of the same kind (eager or compiled) in the "
          "same round; AdamW; monitor = default stats on every parameter gradient, every "
          "step, on the model as it runs (the compiled model for the compiled variants)\n")
    print(table)
    return table


if __name__ == "__main__":
    main()
