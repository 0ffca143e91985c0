"""The demo: train a small conv net on scikit-learn's bundled digits with everything switched on.

:func:`run_demo` trains a tiny conv net on ``sklearn.datasets.load_digits`` (8x8 images, bundled
with scikit-learn, no download) while a :class:`~gradtap.Monitor` writes a run store, a
transform rule normalizes (then clips) the conv weight gradients, and :func:`gradtap.detect`
records where a NaN came from. It returns
data; printing is the command line's job (``gradtap demo``).

Files written into the run directory: ``run.db`` (the Monitor's store), ``anomalies.json``
(anomalies found, see :func:`gradtap.report.data.write_anomalies`) and ``metrics.json``
(loss per step and test accuracy, see :func:`gradtap.report.data.write_metrics`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradtap._types import is_int
from gradtap.errors import missing_extra
from gradtap.report.data import anomaly_to_dict, write_anomalies, write_metrics

__all__ = ["DemoNet", "DemoResult", "load_digits_tensors", "run_demo"]

#: Module whose forward gets the NaN with ``inject_nan``.
FAULT_MODULE = "block2"
#: Parameters the demo's transform rule applies to.
TRANSFORM_RULE = "block*.conv.weight"

ProgressFn = Callable[[int, int, float, float], None]


class ConvBlock(nn.Module):
    """``conv -> ReLU -> (max-pool)``; can plant a NaN in its forward output (for the demo)."""

    def __init__(self, cin: int, cout: int, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()
        self.fault = False  # set by the demo loop for exactly one step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if self.fault:
            # One NaN in one channel of one sample, as a bad kernel or a division by zero would.
            y = y.clone()
            y[0, 0, 0, 0] = math.nan
        return self.pool(self.act(y))


class DemoNet(nn.Module):
    """Three conv blocks and two linear layers for ``[N, 1, 8, 8]`` digits (~30k parameters)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.block1 = ConvBlock(1, 16, pool=False)   # 16 x 8 x 8
        self.block2 = ConvBlock(16, 32, pool=True)   # 32 x 4 x 4
        self.block3 = ConvBlock(32, 32, pool=True)   # 32 x 2 x 2
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block3(self.block2(self.block1(x)))
        return self.fc2(self.act(self.fc1(x.flatten(1))))


def load_digits_tensors(seed: int = 0, test_size: int = 297) -> tuple[torch.Tensor, ...]:
    """Return ``(x_train [N, 1, 8, 8], y_train [N], x_test, y_test)``, standardized, split by seed.

    Raises:
        ImportError: scikit-learn is missing (``pip install "gradtap[demo]"``).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - scikit-learn is a demo/test dependency
        raise missing_extra("the demo (its bundled digits data)", "scikit-learn", "demo") from err
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    x = (x - x.mean()) / x.std()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = perm[:test_size], perm[test_size:]
    return x[train], y[train], x[test], y[test]


@dataclass
class DemoResult:
    """What :func:`run_demo` did: where the run is, the loss curve, anomalies, accuracy."""

    run_dir: Path
    steps: int
    losses: list[float]
    grad_norms: list[float]
    test_accuracy: float
    anomalies: list[dict[str, Any]]
    skipped_steps: list[int]
    transform_plan: dict[str, str]
    seconds: float
    meta: dict[str, Any] = field(default_factory=dict)


def run_demo(
    out: str | os.PathLike[str] = "runs/demo",
    steps: int = 200,
    seed: int = 0,
    inject_nan: int | None = None,
    *,
    batch_size: int = 64,
    lr: float = 0.02,
    hist_bins: int = 40,
    kinds: tuple[str, ...] = ("param_grad", "grad_output", "update"),
    threads: int | None = 1,
    spike: float | None = None,
    progress: ProgressFn | None = None,
) -> DemoResult:
    """Train :class:`DemoNet` on the digits with a Monitor, a transform rule and detection.

    The run directory ``out`` is replaced if it already holds a run. At step ``inject_nan``
    block2's forward output gets one NaN; that step's optimizer step is skipped (detect's
    ``should_skip()``) and training goes on.

    Args:
        out: the run directory.
        steps: optimizer steps (batches of ``batch_size``).
        seed: seed of the weights, the data split and the batch order.
        inject_nan: step at which to plant a NaN, or ``None``.
        batch_size: samples per step.
        lr: SGD learning rate (momentum 0.9).
        hist_bins: histogram bins per tensor and step.
        kinds: the Monitor's kinds.
        threads: torch intra-op threads while training (restored afterwards); one is fastest
            for tensors this small and avoids oversubscribing a busy machine. ``None`` keeps
            the current setting.
        spike: also report gradient-norm spikes scoring above ``spike`` against their own
            baseline (``gt.detect(spike=...)``; recorded only, they do not skip the optimizer
            step).
        progress: called after every step with ``(step, steps, loss, grad_norm)``.

    Returns:
        A :class:`DemoResult`.

    Raises:
        ValueError: ``steps`` < 1, or ``inject_nan`` outside ``[0, steps)``.
    """
    if not is_int(steps) or steps < 1:
        raise ValueError(f"steps must be a positive int; got {steps!r}")
    if inject_nan is not None and not 0 <= inject_nan < steps:
        raise ValueError(f"inject_nan must be a step in [0, {steps}); got {inject_nan}")
    start = time.perf_counter()
    run_dir = Path(out)
    prev_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(run_dir, steps, seed, inject_nan, batch_size, lr, hist_bins, kinds,
                      progress, start, spike)
    finally:
        torch.set_num_threads(prev_threads)


def _train(run_dir: Path, steps: int, seed: int, inject_nan: int | None, batch_size: int,
           lr: float, hist_bins: int, kinds: tuple[str, ...], progress: ProgressFn | None,
           start: float, spike: float | None) -> DemoResult:
    from gradtap._detect import detect
    from gradtap._monitor import Monitor
    from gradtap._transform import chain, clip_norm, normalize, transform

    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = load_digits_tensors(seed)
    model = DemoNet()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)

    losses: list[float] = []
    grad_norms: list[float] = []
    skipped: list[int] = []
    anomalies: list[dict[str, Any]] = []
    meta = {"demo": {"dataset": "sklearn digits (8x8)", "train_size": len(y_train),
                     "test_size": len(y_test), "batch_size": batch_size, "steps": steps,
                     "seed": seed, "optimizer": f"SGD(lr={lr}, momentum=0.9)",
                     "transform": f"{TRANSFORM_RULE}: chain(normalize(0.99), clip_norm(1.0)) "
                                  "when='step'",
                     "inject_nan": inject_nan, "detect": True}}

    stack = contextlib.ExitStack()
    mon = None
    failed = True
    try:
        # The transform runs inside optimizer.step(), so a skipped step leaves its state clean.
        handle = transform(model, {TRANSFORM_RULE: chain(normalize(beta=0.99), clip_norm(1.0))},
                           when="step", optimizer=opt)
        stack.callback(handle.remove)
        # No dump_dir: dumps keep every forward tensor of every step, which the demo does not
        # need; an anomaly's message already names the module, slot and value ranges.
        det = detect(model, action="record", spike=spike)
        stack.callback(det.remove)
        mon = Monitor(model, select=(nn.Conv2d, nn.Linear), kinds=kinds,
                      stats=("norm", "mean", "std", "absmax", "nonfinite"), ewma=0.99,
                      hist_bins=hist_bins, store=run_dir, overwrite=True, meta=meta)
        plan = dict(handle.plan())
        perm = torch.randperm(len(y_train), generator=gen)
        pos = seen = 0
        for step in range(steps):
            if pos + batch_size > len(perm):
                perm, pos = torch.randperm(len(y_train), generator=gen), 0
            idx = perm[pos:pos + batch_size]
            pos += batch_size
            # The fault stays planted for the whole step, so gt.detect's replay of the step
            # (it runs the forward again to find the origin) sees it too.
            getattr(model, FAULT_MODULE).fault = step == inject_nan
            model.train()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            det.check_loss(loss)
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            gnorm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
            lval = loss.detach().item()
            # Spikes are recorded; only NaN/Inf cost the optimizer step.
            new = list(det.anomalies)[seen:]
            seen += len(new)
            skip = det.should_skip() and any(a.kind in ("nan", "inf") for a in new)
            # Before the optimizer: the Monitor sees the gradients backward produced (the
            # transform changes them inside opt.step()); `update` is then the previous step's.
            mon.step()
            if skip:
                skipped.append(step)
            else:
                opt.step()
            det.step()
            opt.zero_grad(set_to_none=True)
            losses.append(lval)
            grad_norms.append(gnorm)
            if progress is not None:
                progress(step, steps, lval, gnorm)
        model.eval()
        with torch.no_grad():
            acc = float((model(x_test).argmax(1) == y_test).float().mean())
        failed = False
    finally:
        try:
            if mon is not None:
                mon.close("failed" if failed else "finished")
                # Stored with the run (also after a crash) so `gradtap report` shows them.
                anomalies = [anomaly_to_dict(a) for a in det.anomalies]
                write_anomalies(run_dir, anomalies, source="gradtap.detect")
        finally:
            stack.close()
    write_metrics(run_dir, {"loss": (list(range(steps)), losses),
                            "total grad norm": (list(range(steps)), grad_norms)},
                  {"test accuracy": acc, "skipped steps": len(skipped)})
    return DemoResult(run_dir=run_dir, steps=steps, losses=losses, grad_norms=grad_norms,
                      test_accuracy=acc, anomalies=anomalies, skipped_steps=skipped,
                      transform_plan=plan,
                      seconds=time.perf_counter() - start, meta=meta)
