"""The critical batch size of a tiny language model, measured three ways that agree.

A character-level neural n-gram model (the 4 previous characters, embedded, through an MLP,
predict the next one) is trained for a while on text drawn from a fixed random order-2
Markov chain; then, with its parameters held fixed, the Monitor measures the gradient noise
scale ``B_simple = tr(Sigma) / |G|^2`` (docs/health.md) over the same number of fresh batches:

* ``samples``       per-sample gradient norms (``gt.per_sample`` norms-only, b = 1);
* ``microbatches``  two backwards of half a batch each, accumulated (b = B / 2);
* ``ranks``         two gloo processes under DDP, each half the batch (b = B / 2).

Each estimate is a ratio of EMAs over those batches. Different small batches, one quantity:
the three agree within their noise (the b = B / 2 estimates are the noisier: their small and
large batches differ by a factor of two only). A fourth number, the same ratio from per-sample
gradients written out by ``torch.func``, checks the first.

Run: ``python examples/critical_batch_size.py`` (about 3 minutes on two CPU cores;
``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import tempfile
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import gradtap as gt

VOCAB, CONTEXT, BATCH = 16, 4, 256


@functools.lru_cache(maxsize=4)
def corpus(length: int, seed: int = 0) -> torch.Tensor:
    """Text from a random order-2 Markov chain over ``VOCAB`` characters: one fixed language
    (its table drawn once), ``seed`` picks the text."""
    table = np.random.default_rng(1234).dirichlet(np.full(VOCAB, 0.3), size=(VOCAB, VOCAB))
    rng = np.random.default_rng(seed)
    cumulative = table.cumsum(-1)
    out = [0, 1]
    for u in rng.random(length - 2):
        out.append(min(int(np.searchsorted(cumulative[out[-2], out[-1]], u)), VOCAB - 1))
    return torch.tensor(out)


def windows(text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(contexts [N, CONTEXT], next characters [N])``."""
    x = text.unfold(0, CONTEXT + 1, 1)
    return x[:, :CONTEXT], x[:, CONTEXT]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(CONTEXT * 16, 64)
        self.out = nn.Linear(64, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(x).flatten(1))))


def trained(steps: int) -> dict[str, torch.Tensor]:
    """Train for ``steps`` Adam steps; return the state the measurements start from."""
    torch.manual_seed(0)
    model = TinyLM()
    x, y = windows(corpus(20_000, seed=1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (BATCH,), generator=g)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def batches(count: int, seed: int) -> list[torch.Tensor]:
    x_all, _ = windows(corpus(20_000, seed=3))
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, len(x_all), (BATCH,), generator=g) for _ in range(count)]


def measure_one_process(state: dict[str, torch.Tensor], source: str, steps: int) -> float:
    """``gns`` of ``"<all>"`` after ``steps`` fixed-parameter steps, from samples or
    micro-batches."""
    model = TinyLM()
    model.load_state_dict(state)
    x_all, y_all = windows(corpus(20_000, seed=3))
    ps = gt.per_sample(model, quantities=("norm",)) if source == "samples" else None
    mon = gt.Monitor(model, stats=("gns",), gns_from=source, gns_beta=0.99, per_sample=ps)
    for idx in batches(steps, seed=4):
        x, y = x_all[idx], y_all[idx]
        if source == "samples":
            F.cross_entropy(model(x), y).backward()
            mon.step()
        else:  # two micro-batches, each half the mean
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                (F.cross_entropy(model(xs), ys) / 2).backward()
            mon.step(batch_size=BATCH // 2)
        model.zero_grad()
    value = mon.frame(stats="gns", names="<all>").value.iloc[-1]
    mon.close()
    if ps is not None:
        ps.remove()
    return float(value)


def _rank(rank: int, world: int, port: int, state: dict, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = TinyLM()
        model.load_state_dict(state)
        ddp = nn.parallel.DistributedDataParallel(model)
        x_all, y_all = windows(corpus(20_000, seed=3))
        per = BATCH // world
        mon = gt.Monitor(ddp, stats=("gns",), gns_from="ranks", gns_beta=0.99)
        for idx in batches(steps, seed=4):
            part = idx[rank * per:(rank + 1) * per]
            F.cross_entropy(ddp(x_all[part]), y_all[part]).backward()
            mon.step(batch_size=per)
            model.zero_grad()
        if rank == 0:
            value = mon.frame(stats="gns", names="<all>").value.iloc[-1]
            with open(out, "w") as f:
                f.write(repr(float(value)))
        mon.close()
    finally:
        dist.destroy_process_group()


def measure_ranks(state: dict[str, torch.Tensor], steps: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gns.txt")
        mp.spawn(_rank, args=(2, port, state, steps, out), nprocs=2)
        with open(out) as f:
            return float(f.read())


def direct(state: dict[str, torch.Tensor], steps: int) -> float:
    """The same EMAs from per-sample gradients written out by ``torch.func`` (``vmap`` of
    ``grad`` over the samples, b = 1), in float64 arithmetic from there on."""
    from torch.func import functional_call, grad, vmap

    model = TinyLM()
    model.load_state_dict(state)
    x_all, y_all = windows(corpus(20_000, seed=3))
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    ema = None
    for idx in batches(steps, seed=4):
        grads = per_sample(params, x_all[idx], y_all[idx])
        g = torch.cat([v.reshape(len(idx), -1) for v in grads.values()], 1).double()
        small, big = float(g.pow(2).sum(1).mean()), float(g.mean(0).pow(2).sum())
        inv_b, inv_big = 1.0, 1.0 / len(idx)
        trace = (small - big) / (inv_b - inv_big)
        sq = (inv_b * big - inv_big * small) / (inv_b - inv_big)
        ema = (trace, sq) if ema is None else (ema[0] + 0.01 * (trace - ema[0]),
                                               ema[1] + 0.01 * (sq - ema[1]))
    assert ema is not None
    return ema[0] / ema[1]


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke run)")
    args = parser.parse_args(argv)
    train, steps = (20, 20) if args.quick else (100, 400)
    state = trained(train)
    results = {
        "samples (b = 1)": measure_one_process(state, "samples", steps),
        f"microbatches (b = {BATCH // 2})": measure_one_process(state, "microbatches", steps),
        f"ranks (2 x {BATCH // 2}, DDP)": measure_ranks(state, steps),
        "torch.func per sample": direct(state, steps),
    }
    print(f"B_simple of the tiny LM after {train} training steps, EMA over {steps} batches "
          f"of {BATCH}:")
    for name, value in results.items():
        print(f"  {name:<26} {value:8.1f}")
    return results


if __name__ == "__main__":
    main()
