"""One computed step of the Monitor: its jobs, their reduction and copy, and the stored rows.

Each kind's tensors become a job of the step reducer (:mod:`~gradtap._monitor.reducer`), the
slices of ``split=`` join their kind's job, snapshots (``update``, ``grad_cosine``), the grad
scaler and the health statistics (:mod:`~gradtap._monitor.health`) queue their parts; then the
step's one reduction across ranks (at most two collectives) and its one device-to-host copy
run, and the finished rows go to the history in one write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from gradtap import _tensorops as ops
from gradtap._monitor.history import StepRows
from gradtap._monitor.scaler import SCALER_NAME, queue_amp
from gradtap._monitor.sharded import shard_job
from gradtap._monitor.spikes import queue_clip_factors

if TYPE_CHECKING:  # pragma: no cover
    from gradtap._monitor.monitor import Monitor

__all__ = ["compute_step"]


def compute_step(mon: Monitor, s: int, loss: Tensor | float | None,
                 batch_size: int | Sequence[int] | None) -> None:
    """Compute, reduce and store the statistics of step ``s`` (see the module text)."""
    copy = ops.HostCopy()
    red = mon._reducer
    sharded = mon._sharded
    jobs = []
    grads = {}
    for n, p in mon._params:
        g = p.grad
        if g is not None and g.numel():  # a DTensor's numel is the global one
            grads[n] = g
    if not grads and mon._params:
        mon._check_not_replaced()
    counts: dict[str, bool] = {}
    full = grads
    if sharded:
        grads, counts = mon._layouts.shards(grads)
    amp = None
    if mon._amp is not None:
        owner = dict(mon._params)
        grads = {n: mon._amp.unscaled(g, owner[n]) for n, g in grads.items()}
        amp = (queue_amp(mon._amp, grads, copy, red.reduction, counts) if sharded
               else queue_amp(mon._amp, grads, copy))
    if "param_grad" in mon.kinds and mon._moments:
        if mon.local_grads:
            names = [n for n, p in mon._params if p.requires_grad]
            present = [n for n in names if n in mon._local]
            jobs.append(red.local("param_grad", names, present,
                                  [mon._local[n] for n in present], mon._device))
        else:
            jobs += _jobs(mon, "param_grad", grads, counts, full, copy)
    if "grad_output" in mon.kinds and mon._pending:
        jobs.append(red.parts(mon._pending, copy))
    wants_params = "param" in mon.kinds or "update" in mon.kinds
    params = [(n, p.detach()) for n, p in mon._params if p.numel()] if wants_params else []
    pcounts: dict[str, bool] = {}
    if sharded and params:
        local, pcounts = mon._layouts.shards(dict(params))
        params = list(local.items())
    if "param" in mon.kinds and params and mon._moments:
        jobs += _jobs(mon, "param", dict(params), pcounts,
                           {n: p for n, p in mon._params}, copy)
    ratio = None
    update = mon._snapshots.updates(s, params)
    if update is not None:
        names, cur, diffs = update
        if sharded:
            jobs.append(shard_job(red, "update", dict(zip(names, diffs)), pcounts,
                                  mon._device))
            ratio = mon._snapshots.queue_ratio(cur, diffs, copy, red.reduction,
                                                [pcounts[n] for n in names])
        else:
            jobs.append(red.tensors("update", names, diffs, copy))
            ratio = mon._snapshots.queue_ratio(cur, diffs, copy)
    cosine = mon._snapshots.queue_cosine(s, grads, copy, red.reduction if sharded else None,
                                          counts)
    if mon._ewma is not None:
        mon._ewma.update(grads)
    health = mon._health.queue(
        red.reduction, copy, reduce=red.reduce, world_size=mon.world_size, grads=grads,
        counts=counts if sharded else dict.fromkeys(grads, mon.rank == 0), loss=loss,
        batch_size=batch_size, device=mon._device)
    factors = queue_clip_factors(mon._session, list(grads), copy)
    red.flush(copy)  # at most two collectives for every reduced statistic of the step
    copy.run()

    rows = StepRows(mon._series)
    for job in jobs:
        names, count, fields = red.finish(job, copy, s)
        if not names:
            continue
        columns = red.columns(count, fields)
        if job.kind == "update" and ratio is not None:
            columns["ratio"] = ratio()
        if job.kind == "param_grad" and mon._zscores is not None:
            columns["zscore"] = mon._zscores(names, columns["norm"])
            if "norm" not in mon.stats:
                del columns["norm"]
        rows.add(job.kind, names, columns)
        if fields.hist is not None:
            rows.add_hists(job.kind, names, fields.hist)
    if cosine is not None:
        rows.add("grad_cosine", cosine[0], {"cosine": cosine[1]()})
    if factors is not None:
        rows.add("param_grad", factors[0], {"clip_factor": factors[1]()})
    if amp is not None:
        rows.add("param_grad", [SCALER_NAME], {"amp_scale": amp[0]().reshape(1),
                                               "nonfinite": amp[1]().reshape(1)})
    if health is not None:
        health(rows)
    mon._sink.write_step(s, mon._series.take_new(), rows.ids(), rows.values(), rows.hists)

def _jobs(mon: Monitor, kind: str, tensors: dict[str, Tensor], counts: dict[str, bool],
          full: dict[str, Tensor], copy: ops.HostCopy) -> list[Any]:
    """The job of a parameter kind over ``tensors`` and the slices of ``split=``."""
    red = mon._reducer
    if mon._sharded:
        if mon._splits:
            parts, flags = mon._splits.local(tensors, counts, full)
            tensors, counts = {**tensors, **parts}, {**counts, **flags}
        return [shard_job(red, kind, tensors, counts, mon._device)]
    if not tensors:
        return []
    if mon._splits:
        tensors = {**tensors, **mon._splits.whole(tensors)}
    return [red.tensors(kind, list(tensors), list(tensors.values()), copy)]
