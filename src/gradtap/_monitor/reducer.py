"""The step reducer: which statistics of which tensors, with one host copy per step.

Each kind's tensors become a *job*: their moments are launched on the device (batched
``torch._foreach_*`` kernels, :mod:`gradtap._tensorops`), queued on the step's one
:class:`~gradtap._tensorops.HostCopy`, and after the copy finished into rows of statistics.
Three shapes of job:

* tensors read at the step (``param_grad``, ``param``, ``update``): moments on the host side
  are completed lazily (non-finite counts, two-pass ``m2`` for a dominant mean);
* parts recorded during backward (``grad_output``, one part per call), combined per name on
  the host: on the CPU finished at once, while the call's tensors are alive (lazy non-finite
  counts and two-pass ``m2`` only where needed, as for the tensors read at the step); on
  other devices exact moments launched in the hook, read with the step's copy;
* rank-local tensors or shards under a process group (``grad_output``, ``local_grads``, every
  parameter kind of a sharded model): exact moments, combined per name and reduced across
  ranks on the device before the copy. All such jobs of a step share one
  :class:`~gradtap.distributed.Reduction`: at most two collectives per step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtap import _tensorops as ops
from gradtap import distributed
from gradtap._tensorops import HostCopy, Moments
from gradtap._tensorops import moments as ops_moments

__all__ = ["Part", "StepReducer"]

#: One call's grad_output tensors: their names, element counts and either grouped device
#: moments or (CPU) the refined moments, already on the host.
Part = tuple[list[str], np.ndarray, list[tuple[list[int], Moments[Tensor]]] | Moments[np.ndarray]]

#: Reduction plans of grad_output calls kept (one per distinct list of output shapes).
_PART_PLANS = 256


#: The element counts of a job without rows (shared, never written to).
_NO_ROWS = np.zeros(0)
_NO_ROWS.setflags(write=False)


class _Job:
    """The tensors of one kind at one step, queued for the single host copy."""

    __slots__ = ("kind", "names", "tensors", "count", "gather", "hist", "group", "exact",
                 "reduced")

    def __init__(self, kind: str, names: list[str]) -> None:
        self.kind = kind
        self.names = names
        self.tensors: list[Tensor] = []
        self.count = _NO_ROWS
        self.gather: Callable[[], Moments[np.ndarray] | dict[str, np.ndarray]] | None = None
        self.hist: Callable[[], np.ndarray] | None = None  # histograms of a plan's tensors
        self.group: np.ndarray | None = None  # parts -> names, when parts are combined
        # (rows, gather) of two-pass m2 queued up front
        self.exact: tuple[np.ndarray, Callable[[], Moments[np.ndarray]]] | None = None
        # block of the step's Reduction (the rank-reduced path)
        self.reduced: int | None = None


class StepReducer:
    """Turns a step's tensors into rows of statistics: ``stats`` and histograms over ``edges``.

    Remembers, per kind, which names needed the two-pass ``m2`` last time, so that their
    centred pass is launched up front (no second host copy) from then on.

    Args:
        stats: statistic names (checked).
        edges: histogram bin edges [B+1], or ``None`` for no histograms.
        reduce: reduce rank-local jobs across the ranks of the process group.
    """

    def __init__(self, stats: Sequence[str], edges: Tensor | None, *, reduce: bool) -> None:
        self.stats = tuple(stats)
        self.edges = edges
        self.reduce = reduce
        self._needs = ops.needs_for(self.stats)
        self._needs_exact = ops.needs_for(self.stats, exact_nonfinite=True)
        self._scratch = ops.Scratch()
        self._exact_names: dict[str, set[str]] = {}
        self._plans: dict[str, tuple[tuple[Any, ...], ops.MomentPlan]] = {}
        self._part_plans: OrderedDict[tuple[Any, ...], ops.MomentPlan] = OrderedDict()
        self._reduction: distributed.Reduction | None = None

    # -- the step's reduction across ranks ---------------------------------------------------

    @property
    def reduction(self) -> distributed.Reduction:
        """The current step's :class:`~gradtap.distributed.Reduction` (made on first use)."""
        if self._reduction is None:
            self._reduction = distributed.Reduction()
        return self._reduction

    def flush(self, copy: HostCopy) -> None:
        """Reduce what the step queued across ranks (at most two collectives) and queue the
        results on ``copy``; call once per step, after the last job, before ``copy.run()``.
        Without a process group to reduce over, a reduction nothing was queued on is skipped."""
        if self._reduction is not None and (self.reduce or not self._reduction.empty):
            self._reduction.run(copy, reduce=self.reduce)

    def end_step(self) -> None:
        """Forget the step's reduction."""
        self._reduction = None

    # -- queueing (device work only, no host sync) -------------------------------------------

    def part(self, keys: list[str], tensors: list[Tensor]) -> Part:
        """The moments of one call's tensors (inside backward): on the CPU finished on the
        host now (nothing to wait for there); on other devices exact moments launched on the
        device, no host sync."""
        if not self.reduce and all(t.device.type == "cpu" for t in tensors):
            return self._host_part(keys, tensors)
        count = np.array([t.numel() for t in tensors], dtype=np.float64)
        groups = ops.tensor_moments(tensors, self._needs_exact, edges=self.edges,
                                    exact_m2=True, scratch=self._scratch)
        return keys, count, groups

    def _host_part(self, keys: list[str], tensors: list[Tensor]) -> Part:
        """A CPU call's refined moments, as the parameter kinds get theirs: one plan's
        kernels, then exact non-finite counts and two-pass ``m2`` only for the rows that need
        them (the tensors are still alive)."""
        signature = ops.MomentPlan.signature(tensors)
        plan = self._part_plans.get(signature)
        if plan is None:
            plan = self._part_plans[signature] = ops.MomentPlan(tensors, self._needs)
            if len(self._part_plans) > _PART_PLANS:
                self._part_plans.popitem(last=False)
        if plan.order is not None:
            keys = [keys[i] for i in plan.order]
            tensors = [tensors[i] for i in plan.order]
        copy = HostCopy()
        get = plan.queue(tensors, copy, self._scratch)
        hist = self._queue_hist(plan, tensors, copy)
        copy.run()
        raw = get() if hist is None else {**get(), "hist": hist()}
        refined, _ = ops.complete_fields(tensors, plan.count, raw, self._needs,
                                         scratch=self._scratch)
        return keys, plan.count, refined

    def _queue_hist(self, plan: ops.MomentPlan, tensors: list[Tensor], copy: HostCopy
                    ) -> Callable[[], np.ndarray] | None:
        """Queue the histograms of a plan's tensors (in its order) on ``copy``."""
        if self.edges is None:
            return None
        edges = self.edges
        return copy.add_rows([(idx, ops.histogram_counts([tensors[i].detach() for i in idx], edges))
                              for idx, _, _ in plan.groups], len(tensors))

    def tensors(self, kind: str, names: list[str], tensors: list[Tensor], copy: HostCopy) -> _Job:
        """A job over tensors that stay alive until :meth:`finish`.

        The kind's :class:`~gradtap._tensorops.MomentPlan` is kept from step to step while its
        tensors keep their devices, dtypes and sizes."""
        signature = ops.MomentPlan.signature(tensors)
        plan = self._plans.get(kind)
        if plan is None or plan[0] != signature:
            plan = self._plans[kind] = (signature, ops.MomentPlan(tensors, self._needs))
        order = plan[1].order
        if order is not None:  # the plan's order (a step's rows may come in any order)
            names = [names[i] for i in order]
            tensors = [tensors[i] for i in order]
        job = _Job(kind, names)
        job.tensors = tensors
        job.count = plan[1].count
        job.gather = plan[1].queue(tensors, copy, self._scratch)
        job.hist = self._queue_hist(plan[1], tensors, copy)
        known = self._exact_names.get(kind)
        if known and self._needs.std:
            rows = np.array([i for i, n in enumerate(names) if n in known], dtype=np.int64)
            if len(rows):
                # Looked up on the module at call time, like every caller of centered_moments.
                exact = ops_moments.centered_moments([tensors[i] for i in rows],
                                                     scratch=self._scratch)
                job.exact = (rows, ops.host_moments(exact, len(rows), copy))
        return job

    def parts(self, pending: Sequence[Part], copy: HostCopy) -> _Job:
        """A ``grad_output`` job over the parts recorded during backward."""
        keys = [k for keys, _, _ in pending for k in keys]
        names = sorted(set(keys))
        position = {n: i for i, n in enumerate(names)}
        group = np.array([position[k] for k in keys], dtype=np.int64)
        job = _Job("grad_output", names)
        count = np.concatenate([c for _, c, _ in pending])
        if self.reduce:
            # (a reducing step's parts are all device moments: part() keeps them there)
            fields = Moments.cat([_assemble(groups, len(k)) for k, _, groups in pending
                                  if not isinstance(groups, Moments)])
            job.reduced = self.reduction.add_moments(count, fields, group, names)
            return job
        job.count = count
        gathers = [_refined_part(c, groups, copy) for _, c, groups in pending]
        job.group = group

        def gather() -> Moments[np.ndarray]:
            parts = [g() for g in gathers]
            common = set.intersection(*(set(p) for p in parts))  # CPU and device parts mixed
            return Moments.cat([Moments.coerce({f: v for f, v in p.items() if f in common})
                                for p in parts])

        job.gather = gather
        return job

    def local(self, kind: str, names: list[str], present: list[str], tensors: list[Tensor],
              device: torch.device) -> _Job:
        """A job over rank-local tensors (or shards) of ``present`` names out of ``names`` (all
        ranks pass the same ``names``); reduced across ranks when :attr:`reduce`."""
        job = _Job(kind, names)
        if not tensors:
            if not self.reduce:
                job.names = []
                return job
            # This rank saw no gradient, but the others may have: take part with empty rows.
            fields = _empty_fields(self._needs_exact, self.edges, device)
            job.reduced = self.reduction.add_moments(np.zeros(0), fields,
                                                     np.zeros(0, dtype=np.int64), names)
            return job
        count = np.array([t.numel() for t in tensors], dtype=np.float64)
        groups = ops.tensor_moments(tensors, self._needs_exact, edges=self.edges,
                                    exact_m2=True, scratch=self._scratch)
        position = {n: i for i, n in enumerate(names)}
        group = np.array([position[n] for n in present], dtype=np.int64)
        job.reduced = self.reduction.add_moments(count, _assemble(groups, len(tensors)), group,
                                                 names)
        return job

    # -- finishing (host, after the copy) ----------------------------------------------------

    def finish(self, job: _Job, copy: HostCopy, step: int
               ) -> tuple[list[str], np.ndarray, Moments[np.ndarray]]:
        """``(names, element counts, refined moments)`` of a job after ``copy.run()``."""
        if job.reduced is not None:
            red = self.reduction
            if red.host_mismatch():
                raise RuntimeError(
                    f"ranks reduced different tensors at step {step} ({job.kind} among them); "
                    "every rank must select the same parameters, run the selected modules and "
                    "produce the same output slots"
                )
            count, fields = red.host_moments(job.reduced)
            keep = np.flatnonzero(count > 0)
            return ([job.names[i] for i in keep], count[keep],
                    fields.map(lambda v: v[keep]))
        if not job.names or job.gather is None:
            return [], job.count, Moments()
        raw = job.gather()
        count = job.count
        if job.group is not None:  # parts (calls), refined: combine them
            assert isinstance(raw, Moments)
            count, refined = ops.combine_parts(count, raw, job.group, len(job.names))
            return job.names, count, refined
        exact = None if job.exact is None else (job.exact[0], job.exact[1]())
        if job.hist is not None:
            raw = {**raw, "hist": job.hist()}
        refined, unreliable = ops.complete_fields(job.tensors, count, raw, self._needs,
                                                  exact=exact, scratch=self._scratch)
        self._exact_names[job.kind] = {job.names[i] for i in unreliable} if len(unreliable) else set()
        return job.names, count, refined

    def columns(self, count: np.ndarray, fields: Moments[np.ndarray]) -> dict[str, np.ndarray]:
        """The statistics, one array per stat name in :attr:`stats` order."""
        return ops.finish_stats(count, fields, self.stats)


def _refined_part(count: np.ndarray, moments: Moments[np.ndarray] | list[tuple[list[int], Moments[Tensor]]],
                  copy: HostCopy) -> Callable[[], Moments[np.ndarray]]:
    """After ``copy.run()``, one part's refined moments (a CPU part has them already)."""
    if isinstance(moments, Moments):
        return lambda: moments
    get = ops.host_moments(moments, len(count), copy)
    return lambda: ops.refine_fields(count, get())


def _assemble(groups: list[tuple[list[int], Moments[Tensor]]], n: int) -> Moments[Tensor]:
    """Put the rows of ``tensor_moments`` groups back in tensor order, on one device."""
    if len(groups) == 1:
        return groups[0][1]
    device = next(iter(groups[0][1].items()))[1].device
    order = torch.tensor([i for idx, _ in groups for i in idx], device=device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=device)
    return Moments.cat([m for _, m in groups]).map(lambda v: v[inverse])


def _empty_fields(needs: ops.Needs, edges: Tensor | None, device: torch.device) -> Moments[Tensor]:
    names = (*needs.fields(), *(("shift", "csum", "m2c") if needs.std else ()))
    fields: dict[str, Any] = {f: torch.zeros(0, dtype=torch.float64, device=device) for f in names}
    if edges is not None:
        fields["hist"] = torch.zeros(0, edges.numel() - 1, dtype=torch.float64, device=device)
    return Moments.coerce(fields)
