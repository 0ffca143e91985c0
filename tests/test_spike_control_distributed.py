"""Spike control under DDP and FSDP2 on two gloo ranks: the same decisions (factors) and the
same parameters as one process on the concatenated batch, with a spike on one rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradtap as gt
from tests._dist import gloo_available, run_ranks

needs_gloo = pytest.mark.skipif(not gloo_available(),
                                reason="torch.distributed with gloo is not in this torch build")

BATCH = 4  # samples per rank
STEPS = 8
# (step, rank): that rank's loss is 100x larger (a spike in the averaged gradient).
SPIKES = {(5, 1), (7, 0)}

RULES = {
    "zclip": lambda: {"*": gt.zclip(warmup=3)},
    "zclip per tensor": lambda: {"*": gt.zclip(warmup=3, per_tensor=True, max_norm=0.5)},
    "adagc": lambda: {"*": gt.adagc(warmup=3, abs_max=0.5)},
    "agc": lambda: {"*": gt.agc(clip=0.02)},
    "adagn": lambda: {"0.*": gt.adagn(), "2.*": gt.chain(gt.agc(), gt.adagn())},
    "spam_clip": lambda: {"*": gt.spam_clip(threshold=20)},
}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    # 7 and 3 rows: uneven shards over two ranks under FSDP2.
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _loss(net: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2 * BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randn(2 * BATCH, 3, generator=g, dtype=torch.float64)
    part = slice(rank * BATCH, (rank + 1) * BATCH)
    loss = ((net(x[part]) - y[part]) ** 2).mean()
    return loss * (100.0 if (step, rank) in SPIKES else 1.0)


def _train(net: nn.Module, inner: nn.Module, rules: dict, rank: int | None) -> dict:
    """STEPS steps at when='step' with Adam; rank None: one process on both halves."""
    import torch.distributed as dist

    opt = torch.optim.Adam(inner.parameters(), lr=1e-2)
    factors = []
    calls: list[int] = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(args[0].numel())
        return real(*args, **kwargs)

    with gt.transform(net, rules, when="step", optimizer=opt) as h:
        for step in range(STEPS):
            if rank is None:
                loss = (_loss(net, step, 0) + _loss(net, step, 1)) / 2
            else:
                loss = _loss(net, step, rank)
            loss.backward()
            dist.all_reduce = counting
            try:
                opt.step()
            finally:
                dist.all_reduce = real
            opt.zero_grad()
            factors.append({n: float(f) for n, f in h.last_factors.items()})
    params = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
              for n, p in inner.named_parameters()}
    return {"factors": factors, "params": params, "all_reduce": calls}


def _worker(rank: int, world: int) -> dict:
    from tests._dist_monitor import wrap

    out: dict = {}
    for name, rules in RULES.items():
        inner = _mlp()
        out[f"ddp {name}"] = _train(wrap("ddp", inner), inner, rules(), rank)
        net = wrap("fsdp", _mlp())
        out[f"fsdp {name}"] = _train(net, net, rules(), rank)
    import torch.distributed as dist

    dist.barrier()
    return out


@needs_gloo
def test_ddp_and_fsdp2_match_one_process_on_the_whole_batch():
    out = run_ranks(_worker, 2, timeout=240)
    for name, rules in RULES.items():
        net = _mlp()
        want = _train(net, net, rules(), None)
        assert any(f < 0.9 for step in want["factors"] for f in step.values()), name
        for rank, r in enumerate(out):
            for wrapper in ("ddp", "fsdp"):
                got = r[f"{wrapper} {name}"]
                where = f"{wrapper} {name} rank {rank}"
                for step, (g, w) in enumerate(zip(got["factors"], want["factors"], strict=True)):
                    assert g.keys() == w.keys(), where
                    for n in w:
                        assert g[n] == pytest.approx(w[n], rel=1e-9, abs=1e-12), (where, step, n)
                for n, p in want["params"].items():
                    torch.testing.assert_close(torch.tensor(got["params"][n], dtype=torch.float64),
                                               p, rtol=1e-9, atol=1e-12, msg=f"{where} {n}")
                # DDP: nothing of its own; FSDP2: at most two all-reduces a step per rule
                limit = 0 if wrapper == "ddp" else 2 * len(rules()) * STEPS
                assert len(got["all_reduce"]) <= limit, (where, got["all_reduce"])
