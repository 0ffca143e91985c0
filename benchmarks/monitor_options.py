"""What each option of gt.Monitor costs on a training step, side by side in one run.

For a small CNN (three conv-BN-ReLU-pool stages, batch 64, 3x32x32) and a small causal
transformer LM (2 pre-norm blocks, width 128, 64 tokens, batch 16), times one training step
(forward, cross-entropy, backward, SGD step, zero_grad) alone (``plain``) and with
``mon.step()`` of a Monitor with one option changed from the default (kind ``param_grad``,
stats ``norm, mean, std, absmax, nonfinite``, every step, in memory):

* ``stat X``        ``stats=(X,)`` alone, for every moment statistic and ``zscore``
  (``gain`` is a statistic of kind ``grad_output``: ``grad_output + gain``); ``stat gns``:
  ``stats=("norm", "gns")`` with ``gns_from="microbatches"`` (its hooks on every gradient;
  one micro-batch per step here);
* ``kind X``        ``kinds=(X,)`` with the default stats, for every kind;
* ``hist``          ``hist_bins=32`` on kind ``param_grad``, and on ``grad_output``;
* ``ewma``          ``ewma=0.9`` (the elementwise EWMA of every gradient);
* ``all options``   every kind, every moment statistic with ``gain``, ``zscore`` and ``gns``,
  ``hist_bins=32`` and ``ewma=0.9`` together.

The noise scale from ranks under DDP has its own benchmark (``gns_overhead.py``). Each Monitor and
its hooks exist only during its own rounds (``fresh=True``), so no variant slows another;
``plain again`` is the plain step once more: the floor, what noise alone makes of two
identical variants. Cells: time per step (median over rounds), its ratio to ``plain`` in the
same round (median over rounds) and the first and third quartiles of that ratio.

    python benchmarks/monitor_options.py                  # full run
    python benchmarks/monitor_options.py --quick          # a few seconds, for CI
    python benchmarks/monitor_options.py --models lm --variants "kind grad_output,all options"
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import gradtap as gt  # noqa: E402
from _harness import Timing, interleaved, machine, markdown_table, paired_quartiles  # noqa: E402
from gradtap._monitor.options import KINDS, STAT_NAMES  # noqa: E402

#: Every moment statistic, ``zscore`` and ``gain``: the stats of ``all options`` (with ``gns``).
ALL_STATS = (*STAT_NAMES, "zscore", "gain")


def options() -> dict[str, dict[str, Any] | None]:
    """Each variant's Monitor keywords (``None``: the plain step, no Monitor)."""
    out: dict[str, dict[str, Any] | None] = {"plain": None, "plain again": None, "default": {}}
    out.update({f"stat {s}": {"stats": (s,)} for s in (*STAT_NAMES, "zscore")})
    # the noise scale's hooks on every gradient (one micro-batch per step here)
    out["stat gns (microbatches)"] = {"stats": ("norm", "gns"), "gns_from": "microbatches"}
    out.update({f"kind {k}": {"kinds": (k,)} for k in KINDS})
    out["grad_output + gain"] = {"kinds": ("grad_output",), "stats": ("norm", "gain")}
    out["hist param_grad"] = {"hist_bins": 32}
    out["hist grad_output"] = {"kinds": ("grad_output",), "hist_bins": 32}
    out["param_grad + grad_output + hist"] = {"kinds": ("param_grad", "grad_output"),
                                              "hist_bins": 32}
    out["ewma"] = {"ewma": 0.9}
    out["all options"] = {"kinds": KINDS, "stats": (*ALL_STATS, "gns"), "gns_from": "microbatches",
                          "hist_bins": 32, "ewma": 0.9}
    return out


def _workloads(quick: bool) -> dict[str, tuple[str, Callable[[], Any]]]:
    if quick:
        return {"cnn": ("small CNN, batch 2", lambda: _models.small_cnn(batch=2)),
                "lm": ("transformer LM, batch 2, 16 tokens",
                       lambda: _models.transformer_lm(batch=2, tokens=16, dim=32, vocab=64))}
    return {"cnn": ("small CNN, batch 64, 3x32x32", _models.small_cnn),
            "lm": ("transformer LM, 2 blocks x 128, 64 tokens, batch 16", _models.transformer_lm)}


def bench_model(build: Callable[[], Any], variants: dict[str, dict[str, Any] | None], *,
                rounds: int, steps: int, warmup: int, clock: Callable[[], float]
                ) -> dict[str, Timing | str]:
    """Each variant's :class:`Timing` on one model (ratios to ``plain``)."""
    model, x, y = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def loss() -> torch.Tensor:
        out = model(x)
        return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())

    def maker(kw: dict[str, Any] | None) -> Callable[[], Any]:
        def make() -> Callable[[], None]:
            mon = None if kw is None else gt.Monitor(model, **kw)
            step_kw = {"batch_size": len(x)} if kw and "gns_from" in kw else {}

            def step() -> None:
                loss().backward()
                if mon is not None:
                    mon.step(**step_kw)
                opt.step()
                opt.zero_grad()

            step.cleanup = (lambda: None) if mon is None else mon.close  # type: ignore[attr-defined]
            return step

        return make

    return interleaved({v: maker(kw) for v, kw in variants.items()}, steps=steps,
                       rounds=rounds, warmup=warmup, fresh=True, clock=clock)


def _cell(t: Timing | str, plain: Timing) -> list[str]:
    if isinstance(t, str):
        return [f"fails: {t[:60]}", "", ""]
    q1, q3 = paired_quartiles(t, plain)
    return [f"{t.seconds * 1e3:.1f} ms", f"{t.ratio:.2f}x", f"[{q1:.2f}, {q3:.2f}]"]


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark, print the markdown table and return it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CI)")
    parser.add_argument("--models", default="cnn,lm", help="comma-separated subset of cnn, lm")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variant names (plain and plain again always run)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 11)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                        help="this process's CPU time (default; the machine is shared) or wall")
    args = parser.parse_args(argv)
    every = options()
    if args.variants:
        wanted = [v.strip() for v in args.variants.split(",")]
        unknown = [v for v in wanted if v not in every]
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(every)}")
        every = {v: kw for v, kw in every.items() if v in ("plain", "plain again", *wanted)}
    work = _workloads(args.quick)
    keys = [k.strip() for k in args.models.split(",")]
    if set(keys) - set(work):
        raise SystemExit(f"--models: choose from {', '.join(work)}")
    rounds = args.rounds or (1 if args.quick else 11)
    steps = args.steps or (1 if args.quick else 4)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = {k: bench_model(work[k][1], every, rounds=rounds, steps=steps,
                                  warmup=0 if args.quick else 1, clock=clock) for k in keys}
    finally:
        torch.set_num_threads(threads)
    header = ["option"]
    for k in keys:
        header += [f"{work[k][0]}: time", "x plain", "[q1, q3]"]
    rows = []
    for v in every:
        row = [v]
        for k in keys:
            plain = results[k]["plain"]
            assert isinstance(plain, Timing)
            row += _cell(results[k][v], plain)
        rows.append(row)
    table = markdown_table(header, rows, "l" + "rrr" * len(keys))
    print(f"{machine('cpu', threads=False)}, {args.threads} thread(s); "
          f"{'CPU' if args.clock == 'cpu' else 'wall'} clock; median over {rounds} interleaved "
          f"rounds of {steps} steps per variant; x plain = median over rounds of the variant's "
          "time over the plain step's in the same round, [first, third quartile]; "
          "'plain again' is the floor\n")
    print(table)
    return table


if __name__ == "__main__":
    main()
