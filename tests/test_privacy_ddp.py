"""DP-SGD under DDP on two gloo ranks: the ranks' clipped sums are summed, the noise is drawn
once for the job (rank 0's), and every rank ends each step with the same parameters. One
process group for the file: the workers run every case and the tests read their results."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtap as gt
from tests._dist import gloo_available, run_ranks

pytestmark = pytest.mark.skipif(not gloo_available(), reason="torch.distributed with gloo needed")

Q, N_DATA, LR, C = 0.1, 80, 0.5, 0.3
SIGMA, C_NOISE = 1.3, 0.7
# Each step's union batch, split across the two ranks as micro-batches: rank -> [sizes].
STEPS = [{0: [3], 1: [5]}, {0: [2, 1], 1: [1, 3]}, {0: [0], 1: [4]}]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _union(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    n = sum(sum(sizes) for sizes in STEPS[step].values())
    return (torch.randn(n, 6, generator=gen, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=gen))


def _oracle_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """One private SGD step of a one-process run over the union batch: a per-sample loop."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        gs = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
        norm = math.sqrt(sum(float(g.square().sum()) for g in gs))
        k = min(1.0, C / (norm + 1e-6))
        total = [t + k * g for t, g in zip(total, gs, strict=True)]
    with torch.no_grad():
        for p, t in zip(params, total, strict=True):
            p -= LR * t / (Q * N_DATA)


def _noise_run(model: nn.Module, seed: int, steps: int = 2) -> list[list[float]]:
    """The updates of a zero-gradient model (noise alone) under dp_sgd."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(seed)
    out = []
    with gt.dp_sgd(model, opt, max_grad_norm=C_NOISE, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=SIGMA, generator=gen):
        for _ in range(steps):
            before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
            (model(torch.randn(4, 60)) * 0).sum().backward()
            opt.step()
            opt.zero_grad()
            after = torch.cat([p.detach().flatten() for p in model.parameters()])
            out.append((after - before).tolist())
    return out


def worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _mlp().double()
    ref = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    diffs = []
    dp = gt.dp_sgd(ddp, opt, max_grad_norm=C, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0)
    for step, split in enumerate(STEPS):
        x, y = _union(step)
        start = sum(sum(split[r]) for r in range(rank))
        for j, size in enumerate(split[rank]):
            xs, ys = x[start:start + size], y[start:start + size]
            start += size
            if j < len(split[rank]) - 1:  # the usual accumulation idiom
                with ddp.no_sync():
                    F.cross_entropy(ddp(xs), ys).backward()
            else:
                F.cross_entropy(ddp(xs), ys).backward()
        opt.step()
        opt.zero_grad()
        _oracle_step(ref, x, y)
        diffs.append(max(float((p - r).detach().abs().max())
                         for p, r in zip(model.parameters(), ref.parameters(), strict=True)))
    dp.detach()
    sync_back = ddp.require_backward_grad_sync
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()

    torch.manual_seed(1)
    plain = nn.Linear(60, 60)
    alone = _noise_run(copy.deepcopy(plain), seed=7)  # one process, rank 0's seed
    noisy = _noise_run(nn.parallel.DistributedDataParallel(plain), seed=7 if rank == 0 else 99)
    scaled = _scaled_run(rank)
    options = {"find_unused_parameters": _one_step(rank, find_unused_parameters=True)}
    static = nn.parallel.DistributedDataParallel(_mlp(), static_graph=True)
    try:
        gt.dp_sgd(static, torch.optim.SGD(static.parameters(), lr=LR), max_grad_norm=C,
                  sample_rate=Q, dataset_size=N_DATA, noise_multiplier=0.0)
        refused = ""
    except NotImplementedError as err:
        refused = str(err)
    refused_cleanly = static.require_backward_grad_sync
    return {"diffs": diffs, "params": params, "steps": dp.steps, "sync_back": sync_back,
            "noisy": noisy, "alone": alone, "options": options, "refused": refused,
            "refused_cleanly": refused_cleanly, **scaled}


def _one_step(rank: int, **ddp_options: bool) -> float:
    """Two steps with DDP made with ``ddp_options``: the largest difference to the
    one-process run."""
    torch.manual_seed(0)
    model = _mlp().double()
    ref = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_options)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    with gt.dp_sgd(ddp, opt, max_grad_norm=C, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0):
        for step in (0, 2):
            x, y = _union(step)
            start = sum(STEPS[step][0]) if rank else 0
            end = start + sum(STEPS[step][rank])
            F.cross_entropy(ddp(x[start:end]), y[start:end]).backward()
            opt.step()
            opt.zero_grad()
            _oracle_step(ref, x, y)
    return max(float((p - r).detach().abs().max())
               for p, r in zip(model.parameters(), ref.parameters(), strict=True))


def _scaled_run(rank: int) -> dict:
    """A GradScaler under DDP: a good step, one with an inf on rank 1 alone (every rank skips
    it), a good step; against the one-process run of the two good steps."""
    torch.manual_seed(0)
    model = _mlp().double()
    ref = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    dp = gt.dp_sgd(ddp, opt, max_grad_norm=C, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0, scaler=scaler)
    for step, bad in ((0, False), (2, True), (2, False)):
        x, y = _union(step)
        sizes = STEPS[step]
        start = sum(sizes[0]) if rank else 0
        xs, ys = x[start:start + sum(sizes[rank])].clone(), y[start:start + sum(sizes[rank])]
        if bad and rank == 1:
            xs[0, 0] = float("inf")
        scaler.scale(F.cross_entropy(ddp(xs), ys)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if not bad:
            _oracle_step(ref, x, y)
    dp.detach()
    return {"scaled_diff": max(float((p - r).detach().abs().max())
                               for p, r in zip(model.parameters(), ref.parameters(),
                                               strict=True)),
            "scaled_steps": dp.steps, "scale": scaler.get_scale(),
            "scaled_params": torch.cat([p.detach().flatten() for p in model.parameters()])
            .tolist()}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(worker, world=2, timeout=180)


def test_ddp_equals_one_process_over_the_union_batch(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["steps"] == len(STEPS)
        assert max(r["diffs"]) < 1e-13, r["diffs"]  # float64 rounding
        assert r["sync_back"] is True  # DDP's own all-reduce is back after detach
    assert ranks[0]["params"] == ranks[1]["params"]  # bit-identical replicas
    for r in ranks:  # DDP's options change nothing (its reducer is idle)
        assert max(r["options"].values()) < 1e-13, r["options"]
        assert "static_graph=True" in r["refused"] and r["refused_cleanly"] is True


def test_ddp_noise_is_drawn_once_for_the_job(ranks: list[dict]) -> None:
    zero, one = ranks
    assert zero["noisy"] == one["noisy"]  # the ranks' own generators differ: rank 0's counts
    # rank 0's draw, added once (not once per rank, not averaged): a one-process run's
    assert zero["noisy"] == zero["alone"]
    expected = SIGMA * C_NOISE * LR / (Q * N_DATA)
    first, second = (torch.tensor(d) for d in zero["noisy"])
    for d in (first, second):
        assert abs(float(d.std()) / expected - 1) < 0.05
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 0.06


def test_ddp_with_a_grad_scaler_skips_together(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["scaled_diff"] < 1e-13  # the skipped step left nothing behind
        assert r["scaled_steps"] == 3  # counted
        assert r["scale"] == 2.0 ** 9  # one backoff, on both ranks
    assert ranks[0]["scaled_params"] == ranks[1]["scaled_params"]
