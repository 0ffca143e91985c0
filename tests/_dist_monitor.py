"""Rank workers for the distributed Monitor tests (run by ``tests._dist.run_ranks``).

Kept apart from the test module so that a rank imports only torch and gradtap. The same
model, data and training loop are replayed in one process by ``reference`` (the oracle).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3
BATCH = 8
LR = 0.1
EWMA = 0.9
KINDS = ("param_grad", "grad_output", "param", "update", "grad_cosine")
HIST = {"hist_bins": 6, "hist_scale": "linear", "hist_range": (-0.5, 0.5)}
# Collectives a rank could issue; wrapped with counters around each Monitor step.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "broadcast", "all_to_all",
               "all_to_all_single", "reduce", "gather", "scatter", "barrier")


def build() -> nn.Module:
    """Dim 0 of the layers (7, 3, 2) is uneven over 2 and 4 ranks; over 4 some shards are
    empty."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(),
                         nn.Linear(3, 2)).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randn(STEPS, BATCH, 2, generator=g, dtype=torch.float64)
    return x, y


def wrap(mode: str, model: nn.Module) -> nn.Module:
    """``model`` under DDP, or each Linear and the whole under FSDP2 (``"fsdp"``: one mesh
    dim; ``"hsdp"``: replicate x shard)."""
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if mode == "hsdp":  # replicate x shard
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _Counter:
    """Counts calls (and element counts) of torch.distributed collectives while active."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> _Counter:
        for name in COLLECTIVES:
            real = getattr(dist, name, None)
            if real is None:
                continue
            self._saved[name] = real

            def counting(*args, _name=name, _real=real, **kwargs):
                t = args[0] if args else None
                numel = t.numel() if isinstance(t, torch.Tensor) else (
                    sum(x.numel() for x in t if isinstance(x, torch.Tensor))
                    if isinstance(t, list) else 0)
                self.calls.append((_name, numel))
                return _real(*args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)


def monitor_run(rank: int, world: int, mode: str, out: str) -> dict:
    """Train 3 SGD steps under ``mode`` (ddp, fsdp, hsdp) with a Monitor of every kind."""
    from torch.distributed.tensor.debug import CommDebugMode

    import gradtap as gt
    from gradtap._tensorops import STAT_NAMES

    model = build()
    wrapped = wrap(mode, model)
    x, y = data()
    per = BATCH // world
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    store = os.path.join(out, f"run-{mode}")
    # Given the wrapper under DDP: names come without "module.".
    mon = gt.Monitor(wrapped, stats=STAT_NAMES, kinds=KINDS, ewma=EWMA, store=store, **HIST)
    steps = []
    for s in range(STEPS):
        xs, ys = x[s, rank * per:(rank + 1) * per], y[s, rank * per:(rank + 1) * per]
        # Gradients are averaged over ranks: this makes them those of sum / BATCH.
        loss = ((wrapped(xs) - ys) ** 2).sum() * world / BATCH
        loss.backward()
        with _Counter() as counter, CommDebugMode() as comm:
            mon.step()
        steps.append({"calls": counter.calls, "comm": comm.get_total_counts()})
        opt.step()
        opt.zero_grad()
    ewma = {}
    for name, _ in model.named_parameters():
        m, v = mon.ewma_mean(name), mon.ewma_var(name)
        is_d = hasattr(m, "full_tensor")
        ewma[name] = {"dtensor": is_d,
                      "mean": m.full_tensor() if is_d else m,  # type: ignore[union-attr]
                      "var": v.full_tensor() if is_d else v}  # type: ignore[union-attr]
    mon.close()
    frame = mon.frame()
    hists = {}
    for kind in ("param_grad", "grad_output"):
        for name in sorted(frame[frame.kind == kind].name.unique()):
            h = mon.histogram(name, kind)
            hists[f"{kind}/{name}"] = {"edges": h[0], "counts": h[1], "steps": h.steps}
    run = gt.open_run(store) if rank == 0 else None
    return {
        "rows": [[int(r.step), r.name, r.kind, r.stat, float(r.value)]
                 for r in frame.itertuples()],
        "hists": hists,
        "ewma": ewma,
        "ewma_store": None if run is None else run.ewma,
        "steps": steps,
        "writes": mon.run is not None,
        "store_exists": os.path.exists(store),
        "store_rows": None if run is None else len(run.frame()),
    }


def modes(rank: int, world: int, modes: list[str], out: str) -> dict:
    """:func:`monitor_run` for each mode, one after the other on the same process group, and
    the errors of :func:`unsupported_layouts`."""
    result = {m: monitor_run(rank, world, m, out) for m in modes}
    result["errors"] = unsupported_layouts(world)
    if "fsdp" in modes:
        result["amp"] = amp_nonfinite(rank, world)
    return result


def amp_nonfinite(rank: int, world: int) -> dict:
    """FSDP2 with a GradScaler, ``mon.step()`` before the scaler checks: an Inf planted in
    rank 0's shard and a NaN in the last rank's; the "<scaler>" row must count both."""
    import gradtap as gt

    model = build().float()
    wrap("fsdp", model)
    x, y = data()
    per = BATCH // world
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    mon = gt.Monitor(model, stats=("nonfinite", "max"), scaler=scaler)
    xs, ys = x[0, rank * per:(rank + 1) * per].float(), y[0, rank * per:(rank + 1) * per].float()
    scaler.scale(((model(xs) - ys) ** 2).sum()).backward()
    local = model[0].weight.grad.to_local()
    if rank == 0:
        local[0, 0] = float("inf")
    if rank == world - 1:
        local[-1, -1] = float("nan")
    mon.step()
    rows = {(r.name, r.stat): float(r.value) for r in mon.frame().itertuples()}
    mon.close()
    return {"scaler_nonfinite": rows[("<scaler>", "nonfinite")],
            "amp_scale": rows[("<scaler>", "amp_scale")],
            "weight_nonfinite": rows[("0.weight", "nonfinite")]}


def unsupported_layouts(world: int) -> list[str]:
    """The messages of ``distributed.shard`` on a Partial placement and (with 4 ranks) on a
    mesh of 2 of the 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from gradtap import distributed

    errors = []
    mesh = init_device_mesh("cpu", (world,))
    layouts = [(mesh, [Partial()])]
    if world == 4:
        layouts.append((init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))["b"],
                        [Partial()]))
    for m, placements in layouts:
        t = DTensor.from_local(torch.ones(2), m, placements, run_check=False)
        try:
            distributed.shard(t, "layer.weight")
        except ValueError as err:
            errors.append(str(err))
    return errors


def reference() -> dict:
    """One process, the concatenated batch: per step, gradients, parameters, updates and
    grad_outputs (as each rank sees them: of the loss times the world size, the scale of
    the per-rank loss above, divided out again below by the caller)."""
    model = build()
    x, y = data()
    params = list(model.named_parameters())
    out: dict = {"grad": [], "param": [], "grad_output": []}
    for s in range(STEPS):
        outs = {}
        h = x[s]
        for i, m in enumerate(model):
            h = m(h)
            h.retain_grad()
            outs[str(i)] = h
        loss = ((h - y[s]) ** 2).sum() / BATCH
        loss.backward()
        out["grad"].append({n: p.grad.detach().clone() for n, p in params})
        out["param"].append({n: p.detach().clone() for n, p in params})
        out["grad_output"].append({f"{k}:output": v.grad.detach().clone()
                                   for k, v in outs.items()})
        with torch.no_grad():
            for _, p in params:
                p -= LR * p.grad
                p.grad = None
    return out
