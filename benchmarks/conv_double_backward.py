"""Gradient-norm penalty step through convolutions: native vs ``gt.explicit_conv``; hvp vs grad.

A gradient-norm penalty step computes the parameter gradient with ``create_graph=True`` and
then back-propagates ``loss + 0.1 * sum ||grad||^2``, so every convolution is differentiated twice.
The benchmark times, side by side in one interleaved run on a small CNN
(conv 1->16, conv 16->32 stride 2, linear; batch 32 of 1x28x28):

* a plain forward+backward step (the reference for every ratio),
* the penalty step with native convolutions and under ``gt.explicit_conv(model)``,
* one gradient and one ``gt.hvp`` (each including its forward pass), native and explicit.

Cases are timed in interleaved rounds (``_harness.interleaved``); every ratio is the median over
rounds of one case's time over the other's in the same round.

Run: ``.venv/bin/python benchmarks/conv_double_backward.py [--quick] [--device cuda] [--threads N]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradtap as gt  # noqa: E402
from _harness import Timing, interleaved, machine, markdown_table, paired  # noqa: E402


def small_cnn(
    batch: int, device: torch.device, seed: int = 0
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Two tanh convolutions and a linear layer on random MNIST-sized inputs [N, 1, 28, 28]."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.Tanh(),
        nn.Flatten(), nn.Linear(32 * 14 * 14, 10),
    ).to(device)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    return model, x, y


def make_cases(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], None]]:
    params = [p for p in model.parameters() if p.requires_grad]
    vectors = [torch.randn_like(p) for p in params]

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss().backward()

    def penalty() -> None:
        model.zero_grad(set_to_none=True)
        value = loss()
        grads = torch.autograd.grad(value, params, create_graph=True)
        (value + 0.1 * sum(g.square().sum() for g in grads)).backward()

    def gradient() -> None:
        torch.autograd.grad(loss(), params)

    def hvp() -> None:
        gt.hvp(loss(), params, vectors, retain_graph=False)

    def explicit(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with gt.explicit_conv(model):
                fn()

        return run

    return {
        "plain forward+backward (native)": plain,
        "gradient-norm penalty, native": penalty,
        "gradient-norm penalty, explicit": explicit(penalty),
        "gradient (one), native": gradient,
        "hvp (one), native": hvp,
        "gradient (one), explicit": explicit(gradient),
        "hvp (one), explicit": explicit(hvp),
    }


def table(timings: dict[str, Timing]) -> str:
    rows = [[name, f"{t.seconds * 1e3:.2f}", f"{t.ratio:.2f}"] for name, t in timings.items()]
    pen = paired(timings["gradient-norm penalty, explicit"], timings["gradient-norm penalty, native"])
    hvp_native = paired(timings["hvp (one), native"], timings["gradient (one), native"])
    hvp_explicit = paired(timings["hvp (one), explicit"], timings["gradient (one), explicit"])
    return "\n".join(
        [
            markdown_table(["case", "time per step (ms)", "x plain fwd+bwd"], rows),
            "",
            f"explicit / native penalty step: {pen:.2f}x (goal: at most 1.5x)",
            f"one hvp / one gradient: {hvp_native:.2f}x native, {hvp_explicit:.2f}x explicit",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (a few seconds)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=40,
                        help="interleaved rounds, one timed call per case in each")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch, rounds, warmup = (4, 2, 1) if args.quick else (args.batch, args.rounds, args.warmup)
    device = torch.device(args.device)

    model, x, y = small_cnn(batch, device)
    cases = make_cases(model, x, y)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    timings = interleaved(cases, steps=1, rounds=rounds, warmup=warmup,
                          base="plain forward+backward (native)", sync=sync)
    print(f"{machine(device)}; device {device.type}, batch {batch}, {rounds} interleaved rounds "
          "of one call per case; ratios are medians over rounds of paired ratios\n")
    print(table(timings))  # type: ignore[arg-type]  # no case is a maker, so none fails
    return 0


if __name__ == "__main__":
    sys.exit(main())
