"""Moderate conv-kernel gradients by the running variance of their own history.

The question this project started from: "give the conv kernels a new gradient computed from
the history of their gradients (running mean and variance)". Here each conv weight and bias
gradient is divided elementwise by the running std of its own past values
(``gt.normalize``, the EWMA of docs/semantics.md), then bounded with ``gt.clip_norm``; the linear
classifier keeps its plain gradient. The same conv net, from the same initialization and on
the same mini-batches, is trained with plain SGD and with the moderated conv gradients, on
scikit-learn's bundled 8x8 digits (no download). Both loss curves are printed.

Run: ``python examples/moderate_conv_gradients.py`` (about 10 s on a CPU).
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import gradtap as gt


def make_net(seed: int) -> nn.Module:
    """A small conv net for [N, 1, 8, 8] digits; ``features.*`` are the conv layers."""
    torch.manual_seed(seed)
    features = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    )  # fmt: skip
    return nn.Sequential(
        OrderedDict(features=features, flatten=nn.Flatten(), classifier=nn.Linear(32 * 4 * 4, 10))
    )


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_train = 1400
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def train(
    moderated: bool, data: tuple, epochs: int, lr: float, batch: int, seed: int
) -> tuple[list[float], float]:
    """Train one model; return the mean training loss per epoch and the test accuracy."""
    x_train, y_train, x_test, y_test = data
    net = make_net(seed)  # same seed: both runs start from the same weights
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    handle = None
    if moderated:
        # Every conv weight and bias of `features`: divide by the running std of the
        # gradient's own history, then bound the norm (early steps have a tiny variance).
        rules = {"features.*": gt.chain(gt.normalize(beta=0.95), gt.clip_norm(1.0))}
        handle = gt.transform(net, rules, when="accumulate")
        for name, rule in handle.plan().items():
            print(f"  {name:<20} <- rule {rule!r}")
    order = torch.Generator().manual_seed(seed + 1)
    curve = []
    for _ in range(epochs):
        perm = torch.randperm(len(y_train), generator=order)
        total, count = 0.0, 0
        for i in range(0, len(perm), batch):
            idx = perm[i : i + batch]
            loss = F.cross_entropy(net(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            total += loss.item() * len(idx)
            count += len(idx)
        curve.append(total / count)
    if handle is not None:
        handle.remove()
    with torch.no_grad():
        acc = (net(x_test).argmax(1) == y_test).float().mean().item()
    return curve, acc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = load_data(args.seed)
    start = time.perf_counter()
    plain, plain_acc = train(False, data, args.epochs, args.lr, args.batch, args.seed)
    moder, moder_acc = train(True, data, args.epochs, args.lr, args.batch, args.seed)
    print(f"\n{'epoch':>5}  {'plain SGD':>10}  {'moderated':>10}   (mean training loss)")
    for k, (a, b) in enumerate(zip(plain, moder, strict=True)):
        print(f"{k:>5}  {a:>10.4f}  {b:>10.4f}")
    print(f"test accuracy: plain {plain_acc:.3f}, moderated conv gradients {moder_acc:.3f}")
    print(f"({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
