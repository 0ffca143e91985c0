"""FSDP2 in the Monitor: this rank's shard of each DTensor, and the EWMA laid out again.

Under a process group with DTensor parameters, every parameter kind is taken from this rank's
local shards (:meth:`Layouts.shards`) and reduced across ranks with the step's other
statistics (:func:`shard_job`). Each rank keeps the EWMA of its own shard: the layout of each
gradient seen turns it back into a DTensor (:meth:`Layouts.as_dtensor`), and the summaries
stored at the end are reduced over the shards (:meth:`Layouts.ewma_summaries`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtap import _tensorops as ops
from gradtap import distributed
from gradtap._monitor.ewma import GradEwma
from gradtap._monitor.reducer import StepReducer

__all__ = ["Layouts", "shard_job"]


class Layouts:
    """The DTensor layout of each tensor seen by name (device mesh, placements, shape, stride,
    and whether this rank's shard counts), learnt from the first one of each name."""

    def __init__(self, ewma: GradEwma | None) -> None:
        self._ewma = ewma
        self._layouts: dict[str, tuple[Any, ...]] = {}

    def shards(self, tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, bool]]:
        """This rank's local part of each tensor, and whether it counts (non-empty, and not a
        replicated copy other than the first: see :func:`gradtap.distributed.shard`)."""
        local, counts = {}, {}
        for n, t in tensors.items():
            part = distributed.shard(t, n)
            if n not in self._layouts and distributed.is_dtensor(t):
                self._layouts[n] = (t.device_mesh, t.placements,  # type: ignore[attr-defined]
                                    t.shape, t.stride(), part.counts)
                if self._ewma is not None:
                    self._ewma.shapes[n] = tuple(t.shape)
            local[n] = part.local
            counts[n] = part.counts and part.local.numel() > 0
        return local, counts

    def as_dtensor(self, name: str, t: Tensor) -> Tensor:
        """``t`` (this rank's part) as a DTensor laid out like ``name``'s gradient, if sharded."""
        layout = self._layouts.get(name)
        if layout is None:
            return t
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride, _ = layout
        return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)

    def ewma_summaries(self, names: list[str], device: torch.device
                       ) -> dict[str, tuple[float, float, float, float]]:
        """Per parameter ``(mean_norm, mean_absmax, var_mean, var_max)`` of the full EWMA of
        each of ``names``, reduced over the shards (two collectives; every rank calls it)."""
        assert self._ewma is not None
        names = [n for n in names if n in self._ewma]
        counts: dict[str, bool] = {}
        means, vars_ = {}, {}
        for n in names:
            m, v = self._ewma.state(n)
            layout = self._layouts.get(n)
            counts[n] = m.numel() > 0 and (layout[-1] if layout is not None
                                           else distributed.world()[0] == 0)
            means[n], vars_[n] = m, v
        present = [n for n in names if counts[n]]
        position = {n: i for i, n in enumerate(names)}
        group = np.array([position[n] for n in present], dtype=np.int64)
        red = distributed.Reduction()
        handles = []
        for tensors, needs in ((means, ops.Needs(sumsq=True, minmax=True)),
                               (vars_, ops.Needs(sum=True, minmax=True))):
            ts = [tensors[n] for n in present]
            count = np.array([t.numel() for t in ts], dtype=np.float64)
            fields = (_assemble_rows(ops.tensor_moments(ts, needs), len(ts)) if ts else
                      {f: torch.zeros(0, dtype=torch.float64, device=device)
                       for f in needs.fields()})
            handles.append(red.add_moments(count, fields, group, names))
        red.run()
        (mc, mm), (vc, vm) = (red.moments(h) for h in handles)
        out = {}
        for i, n in enumerate(names):
            out[n] = (float(mm["sumsq"][i].sqrt()),
                      float(torch.maximum(mm["max"][i], mm["negmin"][i])),
                      float(vm["sum"][i] / vc[i]), float(vm["max"][i]))
        return out


def shard_job(red: StepReducer, kind: str, local: dict[str, Tensor], counts: dict[str, bool],
              device: torch.device) -> Any:
    """A job over every name of ``local`` (the same on every rank) from the shards that count."""
    names = list(local)
    present = [n for n in names if counts[n]]
    return red.local(kind, names, present, [local[n] for n in present], device)


def _assemble_rows(groups: list[tuple[list[int], Any]], n: int) -> dict[str, Tensor]:
    """Fields of grouped ``tensor_moments`` results back in tensor order."""
    out: dict[str, Tensor] = {}
    for idx, m in groups:
        for f, v in m.items():
            if f not in out:
                out[f] = torch.zeros(n, dtype=torch.float64, device=v.device)
            out[f][torch.tensor(idx, device=v.device)] = v
    return out
