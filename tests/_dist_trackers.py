"""Rank worker for the distributed tracker test (run by ``tests._dist.run_ranks``)."""

from __future__ import annotations

import torch

from tests._dist_monitor import BATCH, LR, STEPS, build, data, wrap


def logged(rank: int, world: int, modes: list[str]) -> dict:
    """Per mode (ddp, fsdp): what a callable tracker got on this rank, 3 SGD steps, with
    ``log_keys="all"``."""
    import gradtap as gt

    out = {}
    for mode in modes:
        model = build()
        wrapped = wrap(mode, model)
        x, y = data()
        per = BATCH // world
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        got: list = []
        mon = gt.Monitor(wrapped, stats=("norm", "absmax"), log_keys="all",
                         log_to=lambda m, s, got=got: got.append([s, m]))
        for s in range(STEPS):
            xs, ys = x[s, rank * per:(rank + 1) * per], y[s, rank * per:(rank + 1) * per]
            loss = ((wrapped(xs) - ys) ** 2).sum() * world / BATCH  # as one process's sum / BATCH
            loss.backward()
            mon.step()
            opt.step()
            opt.zero_grad()
        mon.close()
        out[mode] = got
    return out
