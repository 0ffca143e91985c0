"""Rank workers for the distributed health-statistics tests (run by ``tests._dist.run_ranks``):
the noise scale from ranks and micro-batches, gain and loss under DDP and FSDP2, and ``split=``
slices of expert weights whose expert dimension FSDP2 shards. ``reference_*`` replays the same
training in one process (float64)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tests._dist_monitor import BATCH, LR, STEPS, _Counter, build, data, wrap

BETA = 0.7
GNS_STATS = ("gns", "gns_trace", "gns_sqnorm")


def _step_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, per: int) -> torch.Tensor:
    """This rank's loss: the mean over its ``per`` samples of each one's summed squared error
    (DDP/FSDP2 average the ranks: the mean over the whole batch)."""
    return ((model(x) - y) ** 2).sum() / per


def gns_run(rank: int, world: int, mode: str, source: str, micro: int) -> dict:
    """Train ``STEPS`` SGD steps under ``mode`` with ``micro`` micro-batches per rank and step
    (the gradient synchronised on the last only), a Monitor with the noise scale from
    ``source``, gain and the loss; count the collectives of each ``mon.step``."""
    import gradtap as gt

    model = build()
    wrapped = wrap(mode, model)
    x, y = data()
    per = BATCH // world
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    mon = gt.Monitor(wrapped, stats=(*GNS_STATS, "gain", "norm"),
                     kinds=("param_grad", "grad_output"), gns_from=source, gns_beta=BETA)
    calls = []
    for s in range(STEPS):
        xs, ys = x[s, rank * per:(rank + 1) * per], y[s, rank * per:(rank + 1) * per]
        total = 0.0
        for k, (xc, yc) in enumerate(zip(xs.chunk(micro), ys.chunk(micro))):
            last = k == micro - 1
            if mode == "ddp":
                ctx = contextlib.nullcontext() if last else wrapped.no_sync()
            else:
                wrapped.set_requires_gradient_sync(last)  # type: ignore[operator]
                ctx = contextlib.nullcontext()
            with ctx:
                loss = _step_loss(wrapped, xc, yc, per)
                loss.backward()
            total += loss.item()
        with _Counter() as counter:
            mon.step(loss=total, batch_size=per if source == "ranks" else per // micro)
        calls.append([c for c, _ in counter.calls])
        opt.step()
        opt.zero_grad()
    frame = mon.frame()
    mon.close()
    return {"rows": [[int(r.step), r.name, r.kind, r.stat, float(r.value)]
                     for r in frame.itertuples()], "calls": calls}


def gns_modes(rank: int, world: int, runs: list[list]) -> dict:
    """:func:`gns_run` for each ``[mode, source, micro]``, one after the other."""
    return {"/".join(map(str, r)): gns_run(rank, world, *r) for r in runs}


def reference_gns() -> dict:
    """One process: per step, each sample's own gradient (a loop of ``autograd.grad``, float64),
    the whole batch's loss (mean of the samples'), and the Monitor's gain of the same training
    (one process; the single-process gain is checked against autograd in test_health)."""
    import gradtap as gt

    model = build()
    x, y = data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = list(model.named_parameters())
    mon = gt.Monitor(model, stats=("gain",), kinds=("grad_output",))
    out: dict = {"grads": [], "loss": []}
    for s in range(STEPS):
        per_sample = {n: [] for n, _ in params}
        for i in range(BATCH):
            li = ((model(x[s, i:i + 1]) - y[s, i:i + 1]) ** 2).sum()
            for (n, _), g in zip(params, torch.autograd.grad(li, [p for _, p in params])):
                per_sample[n].append(g.reshape(-1))
        out["grads"].append({n: torch.stack(v).numpy() for n, v in per_sample.items()})
        loss = _step_loss(model, x[s], y[s], BATCH)
        loss.backward()
        out["loss"].append(loss.item())
        mon.step()
        opt.step()
        opt.zero_grad()
    out["gain"] = [[int(r.step), r.name, float(r.value)] for r in mon.frame().itertuples()]
    mon.close()
    return out


# -- split= under FSDP2 ---------------------------------------------------------------------------

E = 3  # experts: uneven over 2 ranks (2 + 1)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(5, E)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.randn(E, 4, 5))
        self.experts.w2 = nn.Parameter(torch.randn(E, 2, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.router(x).softmax(-1)
        h = torch.einsum("ni,eoi->neo", x, self.experts.w1).tanh()
        return (gate[..., None] * torch.einsum("neo,eio->nei", h, self.experts.w2)).sum(1)


SPLIT_STATS = ("norm", "mean", "rms", "absmax", "std")


def split_run(rank: int, world: int) -> dict:
    """FSDP2 over ``MoE`` (dim 0 sharded: the experts), ``split`` on dims 0 and 1."""
    from torch.distributed.fsdp import fully_shard

    import gradtap as gt

    model = MoE().double()
    fully_shard(model)
    x, y = data()
    per = BATCH // world
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    mon = gt.Monitor(model, stats=SPLIT_STATS, kinds=("param_grad", "param"),
                     split={"experts.w1": 0, "experts.w2": 1})
    calls = []
    for s in range(2):
        xs, ys = x[s, rank * per:(rank + 1) * per], y[s, rank * per:(rank + 1) * per]
        _step_loss(model, xs, ys, per).backward()
        with _Counter() as counter:
            mon.step()
        calls.append([c for c, _ in counter.calls])
        opt.step()
        opt.zero_grad()
    frame = mon.frame()
    mon.close()
    return {"rows": [[int(r.step), r.name, r.kind, r.stat, float(r.value)]
                     for r in frame.itertuples()], "calls": calls}


def reference_split() -> list[dict[str, dict[str, torch.Tensor]]]:
    """One process, the concatenated batch: each step's gradients and parameters."""
    model = MoE().double()
    x, y = data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for s in range(2):
        _step_loss(model, x[s], y[s], BATCH).backward()
        out.append({"param_grad": {n: p.grad.clone() for n, p in model.named_parameters()},
                    "param": {n: p.detach().clone() for n, p in model.named_parameters()}})
        opt.step()
        opt.zero_grad()
    return out
