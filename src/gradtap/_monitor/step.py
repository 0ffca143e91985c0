"""One computed step of the Monitor, as a one-way pipeline its Monitor owns.

gather -> reduce (-> collective) -> one host copy -> the step's rows -> sinks:

1. **gather** the step's tensors: each selected ``p.grad`` (this rank's shard under FSDP2,
   unscaled under a grad scaler), the parameters for kinds ``param`` / ``update``, and what
   the Monitor's hooks recorded during backward (``grad_output`` parts, rank-local gradients);
2. **reduce** them on the device: each kind becomes a job of the step reducer
   (:mod:`~gradtap._monitor.reducer`), the slices of ``split=`` join their kind's job, and the
   snapshots (``update``, ``grad_cosine``), the grad scaler, the health statistics
   (:mod:`~gradtap._monitor.health`) and the clip factors queue their parts; under a process
   group everything that crosses ranks goes into one reduction (at most two collectives);
3. **one host copy** of everything queued;
4. **the step's rows**: the finished statistics as one :class:`~gradtap._monitor.rows.StepRows`;
5. **sinks**: the rows go to each :class:`~gradtap._monitor.sinks.StepSink` in order, the
   run's history first.

The pipeline is built once from the Monitor's parts and reads nothing else of the Monitor;
what changes from step to step comes in through :meth:`StepPipeline.run`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradtap import _tensorops as ops
from gradtap import distributed
from gradtap._monitor.ewma import GradEwma
from gradtap._monitor.health import HealthStats
from gradtap._monitor.reducer import Part, StepReducer
from gradtap._monitor.rows import RowBuilder, SeriesTable, StepRows
from gradtap._monitor.scaler import SCALER_NAME, queue_amp
from gradtap._monitor.sharded import Layouts, shard_job
from gradtap._monitor.sinks import StepSink
from gradtap._monitor.snapshots import Snapshots
from gradtap._monitor.spikes import ZScores, queue_clip_factors
from gradtap._monitor.split import Splits
from gradtap.capture import ScalerWatch, Session
from gradtap.store import HEALTH_KIND

__all__ = ["StepPipeline"]


class StepPipeline:
    """The computed steps of one Monitor (see the module text).

    Args:
        kinds, stats: the Monitor's kinds and stats.
        params: ``(name, parameter)`` of the selected parameters.
        model: the unwrapped model (held weakly, to tell a replaced parameter).
        sharded: the parameters are DTensors under a process group (FSDP2).
        local_grads: ``param_grad`` comes from the rank-local gradients the hooks kept.
        reducer: the step reducer (``None`` when no moment statistic is asked for).
        layouts, splits, snapshots, ewma, health, zscores: the Monitor's parts.
        amp: the grad scaler's watch, if any.
        session: the model's session (for the factors spike rules publish).
        rank, world_size: this process's place in the process group.
        sinks: where each step's rows go, in order (the run's history first).
    """

    def __init__(self, *, kinds: Sequence[str], stats: Sequence[str],
                 params: Sequence[tuple[str, nn.Parameter]], model: nn.Module, sharded: bool,
                 local_grads: bool, reducer: StepReducer, moments: bool, layouts: Layouts,
                 splits: Splits, snapshots: Snapshots, ewma: GradEwma | None,
                 health: HealthStats, zscores: ZScores | None, amp: ScalerWatch | None,
                 session: Session, rank: int, world_size: int,
                 sinks: Sequence[StepSink]) -> None:
        self.kinds = tuple(kinds)
        self.stats = tuple(stats)
        self.params = list(params)
        self._model = weakref.ref(model)
        self.sharded = sharded
        self.local_grads = local_grads
        self.reducer = reducer
        self.moments = moments
        self.layouts = layouts
        self.splits = splits
        self.snapshots = snapshots
        self.ewma = ewma
        self.health = health
        self.zscores = zscores
        self.amp = amp
        self.session = session
        self.rank = rank
        self.world_size = world_size
        self.sinks = list(sinks)
        self.series = SeriesTable()
        # invariant from step to step: what each step asks, decided once
        self._grad_job = "param_grad" in self.kinds and moments and not local_grads
        self._local_job = "param_grad" in self.kinds and moments and local_grads
        self._reads_params = "param" in self.kinds or "update" in self.kinds
        self._param_job = "param" in self.kinds and moments
        self._output_job = "grad_output" in self.kinds
        self._owner = dict(self.params)
        self._requiring = [n for n, p in self.params if p.requires_grad]
        self._gns_counts_default = rank == 0

    # -- questions before a step -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device of the first selected parameter (CPU without any)."""
        if not self.params:
            return torch.device("cpu")
        p = self.params[0][1]
        return (distributed.local_tensor(p) if self.sharded else p).device

    def check_not_replaced(self) -> None:
        """Raise when the model no longer holds the selected parameters (replaced after the
        Monitor was built, as ``fully_shard`` does): their gradients would never come."""
        model = self._model()
        if model is None:
            return
        current = {id(p) for p in model.parameters()}
        gone = [n for n, p in self.params if id(p) not in current]
        if gone:
            raise RuntimeError(
                f"the model no longer holds the parameters this Monitor watches ({gone[0]}"
                f"{f' and {len(gone) - 1} more' if len(gone) > 1 else ''}): they were replaced "
                "after it was built (fully_shard does this); build the Monitor after wrapping "
                "the model")

    # -- one step ----------------------------------------------------------------------------

    def run(self, s: int, *, pending: Sequence[Part], local: dict[str, Tensor],
            loss: Tensor | float | None, batch_size: int | Sequence[int] | None
            ) -> StepRows | None:
        """Compute step ``s``: gather, reduce, copy, rows; hand the rows to every sink.

        Returns the rows, or ``None`` (nothing computed, nothing stored) when only gradients
        are watched and no selected one arrived this step."""
        rows = self.compute(s, pending=pending, local=local, loss=loss, batch_size=batch_size)
        return None if rows is None else self.send(s, rows)

    def compute(self, s: int, *, pending: Sequence[Part], local: dict[str, Tensor],
                loss: Tensor | float | None, batch_size: int | Sequence[int] | None
                ) -> RowBuilder | None:
        """Step ``s``'s rows, computed from the gradients as they are now (gather, reduce,
        the one host copy) but not yet sent: more blocks may join them before :meth:`send`
        (what a clip that runs afterwards did). ``None`` as for :meth:`run`."""
        full = self._gathered_grads()
        if not full and not (self._reads_params or pending or local or self.health.gain
                             or any(p.grad is not None for _, p in self.params)):
            return None
        copy = ops.HostCopy()
        grads: dict[str, Tensor] = full
        counts: dict[str, bool] = {}
        if self.sharded:
            grads, counts = self.layouts.shards(full)
        if self.amp is not None:
            grads = {n: self.amp.unscaled(g, self._owner[n]) for n, g in grads.items()}
        queued = self._queue(s, grads, counts, full, pending, local, loss, batch_size, copy)
        self.reducer.flush(copy)  # at most two collectives for every reduced statistic
        copy.run()  # the step's one host copy
        return self._rows(s, queued, copy)

    def send(self, s: int, rows: RowBuilder) -> StepRows:
        """Finish step ``s``'s rows and hand them to every sink, in order."""
        out = rows.finish(s)
        for sink in self.sinks:
            sink.write(s, out)
        return out

    def end_step(self) -> None:
        """Forget what the step queued (called after every step, computed or not)."""
        self.reducer.end_step()
        self.health.end_step()

    def close(self, status: str) -> None:
        """Close every sink (each one, even when one fails; the first error is raised)."""
        error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close(status)
            except BaseException as err:  # noqa: BLE001  (re-raised below)
                error = error or err
        if error is not None:
            raise error

    # -- gather ------------------------------------------------------------------------------

    def _gathered_grads(self) -> dict[str, Tensor]:
        grads = {}
        for n, p in self.params:
            g = p.grad
            if g is not None and g.numel():  # a DTensor's numel is the global one
                grads[n] = g
        if not grads and self.params:
            self.check_not_replaced()
        return grads

    # -- reduce ------------------------------------------------------------------------------

    def _queue(self, s: int, grads: dict[str, Tensor], counts: dict[str, bool],
               full: dict[str, Tensor], pending: Sequence[Part], local: dict[str, Tensor],
               loss: Tensor | float | None, batch_size: int | Sequence[int] | None,
               copy: ops.HostCopy) -> _Queued:
        red = self.reducer
        sharded = self.sharded
        q = _Queued()
        if self.amp is not None:
            q.amp = (queue_amp(self.amp, grads, copy, red.reduction, counts) if sharded
                     else queue_amp(self.amp, grads, copy))
        if self._local_job:
            present = [n for n in self._requiring if n in local]
            q.jobs.append(red.local("param_grad", self._requiring, present,
                                    [local[n] for n in present], self.device))
        elif self._grad_job:
            q.jobs += self._kind_jobs("param_grad", grads, counts, full, copy)
        if self._output_job and pending:
            q.jobs.append(red.parts(pending, copy))
        params: list[tuple[str, Tensor]] = []
        pcounts: dict[str, bool] = {}
        if self._reads_params:
            params = [(n, p.detach()) for n, p in self.params if p.numel()]
            if sharded and params:
                shards, pcounts = self.layouts.shards(dict(params))
                params = list(shards.items())
        if self._param_job and params:
            q.jobs += self._kind_jobs("param", dict(params), pcounts, self._owner, copy)
        update = self.snapshots.updates(s, params)
        if update is not None:
            names, cur, diffs = update
            if sharded:
                q.jobs.append(shard_job(red, "update", dict(zip(names, diffs)), pcounts,
                                        self.device))
                q.ratio = self.snapshots.queue_ratio(cur, diffs, copy, red.reduction,
                                                     [pcounts[n] for n in names])
            else:
                q.jobs.append(red.tensors("update", names, diffs, copy))
                q.ratio = self.snapshots.queue_ratio(cur, diffs, copy)
        if self.snapshots.cosine:
            q.cosine = self.snapshots.queue_cosine(s, grads, copy,
                                                   red.reduction if sharded else None, counts)
        if self.ewma is not None:
            self.ewma.update(grads)
        q.health = self.health.queue(
            red.reduction, copy,
            reduce=red.reduce, world_size=self.world_size, grads=grads,
            counts=counts if sharded else dict.fromkeys(grads, self._gns_counts_default),
            loss=loss, batch_size=batch_size, device=self.device)
        q.factors = queue_clip_factors(self.session, list(grads), copy)
        return q

    def _kind_jobs(self, kind: str, tensors: dict[str, Tensor], counts: dict[str, bool],
                   full: Mapping[str, Tensor], copy: ops.HostCopy) -> list[Any]:
        """The job of a parameter kind over ``tensors`` and the slices of ``split=``."""
        red = self.reducer
        if self.sharded:
            if self.splits:
                parts, flags = self.splits.local(tensors, counts, full)
                tensors, counts = {**tensors, **parts}, {**counts, **flags}
            return [shard_job(red, kind, tensors, counts, self.device)]
        if not tensors:
            return []
        if self.splits:
            tensors = {**tensors, **self.splits.whole(tensors)}
        return [red.tensors(kind, list(tensors), list(tensors.values()), copy)]

    # -- rows --------------------------------------------------------------------------------

    def _rows(self, s: int, q: _Queued, copy: ops.HostCopy) -> RowBuilder:
        red = self.reducer
        rows = RowBuilder(self.series)
        for job in q.jobs:
            names, count, fields = red.finish(job, copy, s)
            if not names:
                continue
            columns = red.columns(count, fields)
            if job.kind == "update" and q.ratio is not None:
                columns["ratio"] = q.ratio()
            if job.kind == "param_grad" and self.zscores is not None:
                columns["zscore"] = self.zscores(names, columns["norm"])
                if "norm" not in self.stats:
                    del columns["norm"]
            rows.add(job.kind, names, columns)
            if fields.hist is not None:
                rows.add_hists(job.kind, names, fields.hist)
        if q.cosine is not None:
            rows.add("grad_cosine", q.cosine[0], {"cosine": q.cosine[1]()})
        if q.factors is not None:
            rows.add("param_grad", q.factors[0], {"clip_factor": q.factors[1]()})
        if q.amp is not None:
            rows.add(HEALTH_KIND, [SCALER_NAME], {"amp_scale": q.amp[0]().reshape(1),
                                                   "nonfinite": q.amp[1]().reshape(1)})
        if q.health is not None:
            q.health(rows)
        return rows


class _Queued:
    """What one step queued before its copy: jobs, and what finishes each other part."""

    __slots__ = ("amp", "cosine", "factors", "health", "jobs", "ratio")

    def __init__(self) -> None:
        self.jobs: list[Any] = []
        self.amp: Any = None
        self.ratio: Any = None
        self.cosine: Any = None
        self.factors: Any = None
        self.health: Any = None
