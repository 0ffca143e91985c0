"""Overhead of gt.detect versus a plain step and versus torch.autograd.detect_anomaly.

Run: .venv/bin/python benchmarks/detect_overhead.py [--quick]

Side by side in one run, per model: a plain forward+backward step (``F.cross_entropy``,
``zero_grad``); ``gt.detect`` on every module, the default watch (a light screen of the model;
a replay would run only after an anomaly, so never here), with ``det.check_loss(loss)`` and
``det.step()`` each step; the same with ``screen="modules"`` (every module's outputs and
their gradients screened too); the same with ``replay=False`` (every call captured as it runs);
the same with ``spike=10`` (the screen plus every module's parameter-gradient norm, read with
the screen's host copy; no hook on any call); the step inside
``torch.autograd.detect_anomaly(check_nan=True)``; and two floors, the plain step plus only
one fused finiteness pass over every parameter gradient (or one foreach L2 norm of them) and
one host read, with no hook and no bookkeeping: what any screen of every parameter gradient
(or any per-parameter spike check) pays at least with torch's kernels. Variants are timed in interleaved rounds
by ``_harness.interleaved``, median per step; each ratio is the median over rounds of the
variant's time over the plain step's in the same round (a paired comparison: drift between
rounds on a noisy machine cancels). Each variant's hooks exist only while it runs.

Models: the MLP, small CNN and ResNet-18-like net of ``_models.py``, a deep narrow net
(40 x Linear(64, 64) + Tanh), where per-op checks hurt most, and a small deep MLP of 33
modules (16 x (Linear(32, 32) + Tanh) + Linear(32, 10), batch 16) trained with SGD, where a
step is under a millisecond and every per-call cost shows. ``--threads N`` sets torch's
intra-op threads; ``--models SUBSTRING`` runs the models whose label contains it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import gradtap as gt  # noqa: E402
from _harness import Timing, interleaved, machine, markdown_table, steps_for  # noqa: E402
from gradtap._detect._params import ParamGrads  # noqa: E402
from gradtap._detect._screen import Screen  # noqa: E402


def deep_narrow(depth: int = 40, width: int = 64, batch: int = 128,
                seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """``depth`` x (Linear(width, width) + Tanh), then Linear(width, 10), on [batch, width]."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 10))
    g = torch.Generator().manual_seed(seed)
    return (nn.Sequential(*layers), torch.randn(batch, width, generator=g),
            torch.randint(0, 10, (batch,), generator=g))


def _optimizer_step(model: nn.Module, sgd: bool) -> Callable[[], None]:
    """SGD's step on ``model`` (a small learning rate: the model barely moves), or nothing."""
    if not sgd:
        return lambda: None
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    return opt.step


def _plain(model: nn.Module, x: Tensor, y: Tensor, sgd: bool = False) -> Callable[[], None]:
    opt_step = _optimizer_step(model, sgd)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt_step()
        model.zero_grad(set_to_none=True)

    return step


def _detect(model: nn.Module, x: Tensor, y: Tensor, spike: float | None = None,
            replay: bool | None = None, screen: str | None = None,
            sgd: bool = False) -> Callable[[], None]:
    det = gt.detect(model, spike=spike, action="raise", replay=replay, screen=screen)
    opt_step = _optimizer_step(model, sgd)

    def step() -> None:
        det.check_loss(F.cross_entropy(model(x), y)).backward()
        opt_step()
        model.zero_grad(set_to_none=True)
        det.step()

    step.cleanup = det.remove  # type: ignore[attr-defined]
    return step


def _anomaly(model: nn.Module, x: Tensor, y: Tensor, sgd: bool = False) -> Callable[[], None]:
    opt_step = _optimizer_step(model, sgd)

    def step() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            F.cross_entropy(model(x), y).backward()
        opt_step()
        model.zero_grad(set_to_none=True)

    return step


def _floor(model: nn.Module, x: Tensor, y: Tensor, sgd: bool = False,
           norms: bool = False) -> Callable[[], None]:
    """The plain step plus only what a screen of every parameter gradient cannot do without:
    one fused finiteness pass over the gradients (GradScaler's kernel, inverse scale 1), or
    with ``norms`` one foreach L2 norm of them, and one host read; no hook, no bookkeeping."""
    opt_step = _optimizer_step(model, sgd)
    params = [p for p in model.parameters() if p.requires_grad]
    found, one = torch.zeros(()), torch.ones(())

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in params]
        if norms:
            torch.stack(torch._foreach_norm(grads)).cpu().numpy()
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
            found.cpu().numpy()
        opt_step()
        model.zero_grad(set_to_none=True)

    return step


VARIANTS: dict[str, Callable[..., Callable[[], None]]] = {
    "plain": _plain,
    "detect": _detect,
    "detect_modules": lambda model, x, y, sgd=False: _detect(model, x, y, screen="modules",
                                                               sgd=sgd),
    "detect_calls": lambda model, x, y, sgd=False: _detect(model, x, y, replay=False, sgd=sgd),
    "detect_spike": lambda model, x, y, sgd=False: _detect(model, x, y, spike=10.0, sgd=sgd),
    "anomaly": _anomaly,
    "floor": _floor,
    "floor_norms": lambda model, x, y, sgd=False: _floor(model, x, y, sgd=sgd, norms=True),
}

#: The small deep MLP's label (trained with SGD in every variant).
SMALL_DEEP = "33-module MLP 16 x (Linear(32, 32) + Tanh) + Linear(32, 10), batch 16, SGD"


def _screen_time(model: nn.Module, x: Tensor, y: Tensor, steps: int) -> float:
    """Median seconds per step spent inside the default screen's hooks and check, timed around
    each of them: the screen's own cost, without the noise of whole-step timings (the timers
    themselves add about a microsecond per hook)."""
    spent = [0.0]
    patched: dict[tuple[type, str], Callable] = {}
    for owner, name in ((Screen, "_before"), (Screen, "_after"), (Screen, "_on_grad"),
                        (ParamGrads, "sum_grad"), (Screen, "check")):
        real = patched[owner, name] = getattr(owner, name)

        def timed(*a: object, real: Callable = real, **k: object) -> object:
            start = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(owner, name, timed)
    try:
        step = _detect(model, x, y)
        for _ in range(3):
            step()
        per_step = []
        for _ in range(steps):
            spent[0] = 0.0
            step()
            per_step.append(spent[0])
        step.cleanup()  # type: ignore[attr-defined]
    finally:
        for (owner, name), real in patched.items():
            setattr(owner, name, real)
    return statistics.median(per_step)


def _timings(results: dict[str, Timing | str]) -> dict[str, Timing]:
    failed = {k: v for k, v in results.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError(f"variants failed: {failed}")
    return results  # type: ignore[return-value]


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run to check the script works")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--models", default="", help="run the models whose label contains this")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # detect_anomaly warns that it is slow, once per use.
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    rounds = 1 if args.quick else 21
    if args.quick:
        builders = {"MLP, batch 8": lambda: _models.mlp(batch=8),
                    "deep narrow 4 x (Linear(16, 16) + Tanh), batch 8":
                        lambda: deep_narrow(depth=4, width=16, batch=8)}
    else:
        builders = {"MLP (_models.mlp), batch 128": _models.mlp,
                    "small CNN (_models.small_cnn), batch 64": _models.small_cnn,
                    "ResNet-18-like, batch 16": _models.resnet18_like,
                    "deep narrow 40 x (Linear(64, 64) + Tanh), batch 128": deep_narrow,
                    SMALL_DEEP: lambda: deep_narrow(depth=16, width=32, batch=16)}
    builders = {k: v for k, v in builders.items() if args.models in k}
    rows = []
    for label, build in builders.items():
        model, x, y = build()
        sgd = label == SMALL_DEEP
        steps = 1 if args.quick else steps_for(_plain(model, x, y, sgd=sgd), budget=0.3,
                                               cap=200 if sgd else 10)
        # Each variant's hooks exist only while it runs (a fresh detector every round).
        makers = {name: functools.partial(make, model, x, y, sgd=sgd)
                  for name, make in VARIANTS.items()}
        t = _timings(interleaved(makers, steps=steps, rounds=rounds, warmup=steps, fresh=True))

        def cell(name: str, t: dict[str, Timing] = t) -> str:
            return f"{t[name].seconds * 1e3:.2f} ms ({t[name].ratio:.2f}x)"

        def share(name: str, t: dict[str, Timing] = t) -> str:
            ref = t["anomaly"].ratio - 1.0
            return f"{(t[name].ratio - 1.0) / ref:.2f}" if ref > 0 else "-"

        inside = _screen_time(model, x, y, steps=3 if args.quick else 40)
        plain = t["plain"].seconds
        rows.append([label, f"{plain * 1e3:.2f} ms ({steps} steps)", cell("detect"),
                     f"{inside * 1e6:.0f} us ({inside / plain:.1%})",
                     cell("detect_modules"), cell("detect_calls"), cell("detect_spike"),
                     cell("anomaly"), f"{share('detect')} / {share('detect_modules')} / "
                     f"{share('detect_calls')} / {share('detect_spike')}",
                     cell("floor"), cell("floor_norms")])
    header = ["model", "plain step", "gt.detect", "inside gt.detect's screen per step",
              "gt.detect(screen='modules')",
              "gt.detect(replay=False)", "gt.detect(spike=10)", "detect_anomaly(check_nan=True)",
              "overhead / detect_anomaly's (detect / modules / replay=False / spike=10)",
              "floor: one fused finiteness pass + one read",
              "floor: one foreach norm + one read"]
    table = markdown_table(header, rows)
    print(f"{machine()}; median of {rounds} "
          "interleaved rounds (steps per round in the plain column); each ratio is the median "
          "over rounds of the variant's time over the plain step's in the same round; 'inside' is "
          "the median time per step spent in the default screen's hooks and check, over the "
          "median plain step")
    print(table)
    return table


if __name__ == "__main__":
    main()
