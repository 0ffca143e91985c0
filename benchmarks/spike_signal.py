"""Whether the spike signal can be trusted: false positives on healthy runs, recall of injected
spikes, for ``Run.spikes()`` and for ``gt.detect(spike=True)``.

Four healthy training runs of real models (each ``--steps`` steps, 600 by default):

* ``cnn``: a CNN with BatchNorm (``examples.small_cnn``), SGD with momentum, the learning rate
  divided by 10 at 50% and 75% of the run (step decay), on learnable 32x32 images;
* ``lm``: a small causal transformer LM (the spike demo's ``TinyLM``), AdamW, linear warm-up
  over 10% of the run then cosine decay, on sentences of a small grammar;
* ``regression``: an MLP (GELU) fitting a smooth function of 8 inputs (4 outputs) with Adam
  and an exponentially decaying learning rate, whose loss falls by more than 100x;
* ``noisy``: an MLP classifier trained with SGD on batches of 4 (noisy gradients).

Each run has a Monitor storing ``norm`` (its default) and a ``gt.detect(spike=True)``.

* **False positives.** Steps after the warm-up at which ``Run.spikes()`` of the healthy run's
  store (and ``detect``) flagged anything, per 1,000 steps. Goal: <= 1.
* **Recall, Run.spikes().** A gradient multiplied by 10 in one tensor (after backward, in
  ``p.grad``) at one step, random tensor and step after the warm-up, ``--trials`` trials per
  run: from the healthy run's stored norms, with that one norm multiplied by 10 (exact: the
  detector's verdict at a step depends on that step's norms and the earlier ones only, and
  a gradient times 10 has 10 times the norm), scored as ``Run.spikes()`` scores the store
  (checked on the healthy run). Counted: flagged at that step, with ``first``
  naming that tensor. Goal: >= 95%.
* **Recall, detect (online).** A second run of each model with a real injection
  (``p.grad *= 10`` after backward) every ``--every`` steps, random tensor; counted: an
  anomaly of kind ``"spike"`` at that step naming the tensor's module and parameter.

    python benchmarks/spike_signal.py                # the full measurement (a few minutes)
    python benchmarks/spike_signal.py --quick        # seconds, to check it works
    python benchmarks/spike_signal.py --cost 300x5000  # the detector's CPU time alone
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradtap as gt  # noqa: E402
from _harness import machine, markdown_table  # noqa: E402
from gradtap._tensorops.spikes import THRESHOLD, WARMUP, OnlineScores, scores  # noqa: E402
from gradtap.demo_spike import VOCAB, TinyLM, grammar_tokens  # noqa: E402

Batch = Callable[[int], tuple[Tensor, Tensor]]


@dataclass
class Case:
    """A model, its optimizer and schedule, its data and its loss."""

    model: nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    batch: Batch
    loss: Callable[[Tensor, Tensor], Tensor]


def cnn(steps: int, seed: int) -> Case:
    torch.manual_seed(seed)
    def stage(cin: int, cout: int) -> list[nn.Module]:  # no conv bias in front of BatchNorm
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.MaxPool2d(2)]

    model = nn.Sequential(*stage(3, 16), *stage(16, 32), *stage(32, 64), nn.Flatten(),
                          nn.Linear(64 * 4 * 4, 10))
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(10, 3, 32, 32, generator=g)

    def batch(step: int) -> tuple[Tensor, Tensor]:
        y = torch.randint(0, 10, (32,), generator=g)
        return protos[y] * 0.15 + torch.randn(32, 3, 32, 32, generator=g), y

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [steps // 2, steps * 3 // 4], 0.1)
    return Case(model, opt, sched, batch, F.cross_entropy)


def lm(steps: int, seed: int) -> Case:
    torch.manual_seed(seed)
    tokens = 32
    model = TinyLM(len(VOCAB), 64, 4, 2, tokens)
    data = grammar_tokens(200_000, seed)
    g = torch.Generator().manual_seed(seed)

    def batch(step: int) -> tuple[Tensor, Tensor]:
        at = torch.randint(0, len(data) - tokens - 1, (16,), generator=g)
        seq = torch.stack([data[i:i + tokens + 1] for i in at.tolist()])
        return seq[:, :-1], seq[:, 1:]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    warm = max(steps // 10, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - warm) / max(steps - warm, 1)))))
    return Case(model, opt, sched, batch,
                lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))


def regression(steps: int, seed: int) -> Case:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 4))
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(8, 4, generator=g) * 0.5

    def batch(step: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(64, 8, generator=g)
        return x, torch.sin(x @ mix) * 2.0

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.1 ** (1 / steps))
    return Case(model, opt, sched, batch, F.mse_loss)


def noisy(steps: int, seed: int) -> Case:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, 32, generator=g)

    def batch(step: int) -> tuple[Tensor, Tensor]:
        y = torch.randint(0, 10, (4,), generator=g)
        return centers[y] * 0.3 + torch.randn(4, 32, generator=g), y

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return Case(model, opt, sched, batch, F.cross_entropy)


CASES: dict[str, Callable[[int, int], Case]] = {
    "cnn": cnn, "lm": lm, "regression": regression, "noisy": noisy}


@dataclass
class Result:
    """What one training run gave."""

    names: list[str]  # parameter names, model order
    table: np.ndarray  # [steps, tensors] the stored norms (NaN: none)
    run_spikes: list[gt.Spike]  # Run.spikes() of its store
    anomalies: list[gt.Anomaly]  # detect's
    injected: list[tuple[int, str]]  # (step, parameter name)
    loss_ratio: float  # mean loss of the first 20 steps over that of the last 20
    seconds: float


def train(name: str, steps: int, seed: int, every: int = 0) -> Result:
    """Train case ``name`` for ``steps`` steps under a Monitor and ``detect(spike=True)``;
    with ``every``, multiply one random tensor's gradient by 10 in the backward of every
    ``every``-th step after the warm-up (a hook on that parameter for that one backward)."""
    case = CASES[name](steps, seed)
    params = list(case.model.named_parameters())
    rng = np.random.default_rng(seed + 1)
    injected: list[tuple[int, str]] = []
    losses = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        with gt.Monitor(case.model, store=tmp) as mon, \
                gt.detect(case.model, spike=True, action="record") as det:
            for step in range(steps):
                x, y = case.batch(step)
                hook = None
                if every and step >= 2 * WARMUP and step % every == 0:
                    i = int(rng.integers(len(params)))
                    hook = params[i][1].register_hook(lambda g: g * 10.0)
                    injected.append((step, params[i][0]))
                loss = case.loss(case.model(x), y)
                case.opt.zero_grad(set_to_none=True)
                loss.backward()
                if hook is not None:
                    hook.remove()
                det.should_skip()
                mon.step()
                det.step()
                case.opt.step()
                case.sched.step()
                losses.append(float(loss.detach()))
        run = gt.open_run(tmp)
        run_spikes = run.spikes()
        steps_, ids, values, series = run.arrays(stats="norm", kinds="param_grad")
        col = {s[0]: j for j, s in enumerate(series) if s[1:] == ("param_grad", "norm")}
        table = np.full((steps, len(params)), np.nan)
        for k, (n, _) in enumerate(params):
            at = ids == col[n]
            table[steps_[at], k] = values[at]
    return Result([n for n, _ in params], table, run_spikes, list(det.anomalies), injected,
                  float(np.mean(losses[:20]) / np.mean(losses[-20:])), time.perf_counter() - t0)


def table_spikes(table: np.ndarray) -> list[tuple[int, int]]:
    """``(step, tensor)`` of each spike of a norm table (columns in the model's order), by step
    then in backward order: what ``Run.spikes()`` computes from the store."""
    z = scores(table)
    return [(t, k) for t in range(len(table)) for k in reversed(range(table.shape[1]))
            if z[t, k] > THRESHOLD]


def offline_recall(res: Result, trials: int, seed: int) -> tuple[int, int]:
    """Trials of a x10 norm at a random (step after the warm-up, tensor) of the healthy run's
    stored norms: ``(flagged there with first naming it, trials)``. The scores at step t are
    those of the rows up to t, from the first (the steps at which a history's statistics are
    recomputed count from its first value)."""
    rng = np.random.default_rng(seed)
    steps, n = res.table.shape
    hits = 0
    for _ in range(trials):
        t, i = int(rng.integers(WARMUP, steps)), int(rng.integers(n))
        rows = res.table[:t + 1].copy()
        rows[-1, i] *= 10.0
        z = scores(rows)[-1]
        flagged = [k for k in reversed(range(n)) if z[k] > THRESHOLD]  # backward order
        hits += bool(flagged) and flagged[0] == i
    return hits, trials


def online_recall(res: Result, modules: dict[str, str]) -> tuple[int, int]:
    """Injected spikes ``detect`` reported at their step, naming the tensor's module and the
    tensor among the slot's parameters."""
    found = {(a.step, a.module_name, p) for a in res.anomalies if a.kind == "spike"
             for p in a.slot.split(",")}
    hits = sum((step, *modules[name]) in found for step, name in res.injected)
    return hits, len(res.injected)


def cost(tensors: int, steps: int) -> list[str]:
    """The detector's CPU time on a table of ``steps`` x ``tensors`` log-normal norms (a falling
    trend, a level per tensor, every norm valid): ``scores()`` of the whole table, and
    ``OnlineScores`` step by step (``score`` then ``push``, as ``detect`` calls them)."""
    rng = np.random.default_rng(0)
    table = np.exp(rng.normal(0, 0.1, (steps, tensors)) - np.arange(steps)[:, None] / steps
                   + rng.normal(0, 1, tensors))
    t0 = time.process_time()
    scores(table)
    offline = time.process_time() - t0
    online = OnlineScores(tensors)
    t0 = time.process_time()
    for row in table:
        online.score(row)
        online.push(row)
    per_step = (time.process_time() - t0) / steps
    return [str(tensors), str(steps), f"{offline:.2f}", f"{1e6 * offline / (steps * tensors):.2f}",
            f"{1e3 * per_step:.2f}", f"{1e6 * per_step / tensors:.2f}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--trials", type=int, default=500, help="offline trials per run")
    ap.add_argument("--every", type=int, default=10, help="steps between online injections")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="100 steps, 50 trials")
    ap.add_argument("--cost", default=None, metavar="TENSORSxSTEPS",
                    help="time the detector alone on a synthetic table of that size")
    args = ap.parse_args(argv)
    if args.cost:
        tensors, steps = (int(v) for v in args.cost.split("x"))
        print(f"# spike detector cost: {machine()}\n")
        print(markdown_table(["tensors", "steps", "scores() CPU s", "µs per (step, tensor)",
                              "OnlineScores ms per step", "µs per tensor"],
                             [cost(tensors, steps)]))
        return 0
    if args.quick:
        args.steps, args.trials = 100, 50
    torch.set_num_threads(1)
    print(f"# spike signal: {machine()}; Run.spikes() threshold {THRESHOLD:g}, warmup "
          f"{WARMUP}; detect(spike=True)\n")
    rows = []
    for name in args.cases.split(","):
        healthy = train(name, args.steps, args.seed)
        # the offline trials score tables as Run.spikes() does: check it on the healthy run
        assert [(s.step, s.name) for s in healthy.run_spikes] == [
            (t, healthy.names[k]) for t, k in table_spikes(healthy.table)]
        after = max(args.steps - WARMUP, 1)
        fp_run = len({s.step for s in healthy.run_spikes if s.step >= WARMUP})
        fp_det = len({a.step for a in healthy.anomalies if a.kind == "spike"})
        hit, n = offline_recall(healthy, args.trials, args.seed)
        spiked = train(name, args.steps, args.seed, every=args.every)
        model = CASES[name](8, args.seed).model
        owner = {f"{m}.{p}" if m else p: (m, p) for m, mod in model.named_modules()
                 for p, _ in mod.named_parameters(recurse=False)}
        on_hit, on_n = online_recall(spiked, owner)
        rows.append([name, len(healthy.names), args.steps, f"{healthy.loss_ratio:.3g}x",
                     f"{fp_run} ({1000 * fp_run / after:.2f})",
                     f"{fp_det} ({1000 * fp_det / after:.2f})",
                     f"{hit}/{n} ({100 * hit / n:.1f}%)",
                     f"{on_hit}/{on_n} ({100 * on_hit / max(on_n, 1):.1f}%)",
                     f"{healthy.seconds + spiked.seconds:.0f}"])
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(markdown_table(
        ["run", "tensors", "steps", "loss first/last", "Run.spikes() flagged steps (per 1,000)",
         "detect flagged steps (per 1,000)", "x10 recall, Run.spikes()",
         "x10 recall, detect (online)", "seconds"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
