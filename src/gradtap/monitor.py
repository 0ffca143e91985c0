"""Streaming gradient statistics: per-layer norms, moments, histograms and EWMA state.

The parameter kinds (``param_grad``, ``param``, ``update``, ``grad_cosine``) need no hook at
all: ``mon.step()`` reads ``p.grad`` / ``p`` and reduces every selected tensor in grouped,
batched form with one device-to-host copy. Only ``grad_output`` (activation gradients) and
``local_grads=True`` (DDP gradients before their all-reduce) hook the model, through
:mod:`gradtap.capture`; their hooks only launch device reductions, never sync with the host.
"""

from __future__ import annotations

import difflib
import json
import os
import platform
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from gradtap import _tensorops as ops
from gradtap import distributed
from gradtap._tensorops import moments as ops_moments
from gradtap._types import Selector
from gradtap.capture import HookSet, tap
from gradtap.errors import StoreError
from gradtap.record import GradRecord
from gradtap.select import select_parameters
from gradtap.store import KIND_NAMES, Histogram, Run, RunWriter, build_frame, filter_series

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["DEFAULT_STATS", "KINDS", "Monitor"]

KINDS = KIND_NAMES
DEFAULT_STATS = ("norm", "mean", "std", "absmax", "nonfinite")
_PARAM_KINDS = ("param_grad", "param", "update", "grad_cosine")


class _Job:
    """The tensors of one kind at one step, queued for the single host copy."""

    __slots__ = ("kind", "names", "tensors", "count", "gather", "group", "exact", "reduced")

    def __init__(self, kind: str, names: list[str]) -> None:
        self.kind = kind
        self.names = names
        self.tensors: list[Tensor] = []
        self.count = np.zeros(0)
        self.gather: Any = None
        self.group: np.ndarray | None = None  # parts -> names, when parts are combined
        self.exact: Any = None  # (rows, gather) of two-pass m2 queued up front
        self.reduced: Any = None  # (count, fields, check) handles of the device/DDP path


class Monitor:
    """Collect per-layer gradient statistics every step, cheaply enough to leave on.

    Call :meth:`step` once per training step, after ``backward()`` (before or after
    ``optimizer.step()``; before ``zero_grad()``). Steps count from 0: the first ``step()``
    closes step 0, and ``every=k`` computes the steps with ``step % k == 0``.

    Kinds of tensors (``kinds=``):

    * ``param_grad`` ``p.grad`` of each selected parameter (DDP: after the all-reduce, already
      global; ``local_grads=True`` takes the rank-local gradient before it and reduces its
      statistics across ranks).
    * ``grad_output`` dL/d(output) of each selected module, named ``"<module>:<output path>"``;
      a module called several times in a step gets the statistics of all its calls' elements
      together. Rank-local under DDP, so reduced across ranks.
    * ``param`` the parameter values; ``update`` their change since the previous ``step()``
      (from the second step on; keeps one copy of the parameters) plus stat ``ratio`` =
      update norm / parameter norm (0 when the update is zero);
      ``grad_cosine`` stat ``cosine`` between this step's and the previous step's gradient
      (0 when either is all zeros; keeps one copy of the gradients).

    Statistics (``stats=``) are taken over all elements, exactly as DESIGN.md defines them:
    ``norm`` (L2), ``mean``, ``std`` (population), ``absmax``, ``min``, ``max``, ``nonfinite``
    (count of NaN/Inf), ``zero_frac``. NaN propagates into mean/std/norm/absmax/min/max.

    Args:
        model: the model to watch.
        select: parameter selector for the parameter kinds and module selector for
            ``grad_output`` (glob, list of globs, class, predicate; see ``gt.select_*``).
        stats: statistic names (default ``norm, mean, std, absmax, nonfinite``).
        kinds: which tensors to watch (default ``("param_grad",)``).
        ewma: factor ``beta`` of an elementwise EWMA of each parameter gradient (DESIGN.md);
            ``None`` turns it off. Advanced on computed steps, from the global gradient.
        hist_bins: number of histogram bins per tensor and step (``None``: no histograms).
        every: compute every ``every`` steps.
        store: run directory for a crash-safe SQLite store (``None``: keep in memory).
        hist_scale: ``"symlog"`` (default) or ``"linear"`` bins.
        hist_range: ``(lo, hi)`` of the bins (default ``(-10, 10)`` symlog, ``(-1, 1)`` linear);
            values outside fall in the end bins.
        hist_linthresh: magnitude below which symlog bins are linear.
        local_grads: under DDP, watch rank-local parameter gradients (see above).
        overwrite: replace an existing store at ``store``.
        meta: extra JSON-serialisable metadata for the store.

    Raises:
        SelectionError: ``select`` matches nothing.
        ValueError: unknown stat or kind names (listing the valid ones), or a bad option.
        StoreError: ``store`` already holds a run and ``overwrite`` is false.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> with gt.Monitor(net, ewma=0.9) as mon:
        ...     for _ in range(3):
        ...         net(torch.randn(16, 4)).pow(2).mean().backward()
        ...         mon.step()
        ...         net.zero_grad()
        >>> df = mon.frame()
        >>> sorted(df["stat"].unique())
        ['absmax', 'mean', 'nonfinite', 'norm', 'std']
        >>> mon.ewma_var("0.weight").shape
        torch.Size([8, 4])
    """

    def __init__(
        self,
        model: nn.Module,
        select: Selector = "*",
        stats: Sequence[str] = DEFAULT_STATS,
        kinds: Sequence[str] = ("param_grad",),
        ewma: float | None = None,
        hist_bins: int | None = None,
        every: int = 1,
        store: str | os.PathLike[str] | None = None,
        *,
        hist_scale: str = "symlog",
        hist_range: tuple[float, float] | None = None,
        hist_linthresh: float = 1e-8,
        local_grads: bool = False,
        overwrite: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Monitor needs an nn.Module; got {type(model).__name__}")
        self.stats = ops.check_stats(stats)
        self.kinds = _check_kinds(kinds)
        if ewma is not None and not (isinstance(ewma, (int, float)) and 0.0 <= ewma < 1.0):
            raise ValueError(f"ewma must be None or a factor beta with 0 <= beta < 1; got {ewma!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int; got {every!r}")
        if local_grads and "param_grad" not in self.kinds:
            raise ValueError("local_grads=True watches param_grad; add 'param_grad' to kinds")
        self._edges = None if hist_bins is None else ops.hist_edges(
            hist_bins, hist_scale, hist_range, hist_linthresh)
        if not self.stats and self._edges is None and ewma is None and not (
                {"update", "grad_cosine"} & set(self.kinds)):
            raise ValueError("nothing to compute: stats is empty and there are no histograms, "
                             "EWMA, update ratio or grad_cosine")
        self.ewma_beta = None if ewma is None else float(ewma)
        self.every = every
        self.local_grads = local_grads
        self._needs = ops.needs_for(self.stats)
        self._needs_exact = ops.needs_for(self.stats, exact_nonfinite=True)
        self.rank, self.world_size = distributed.world()
        # Known at construction (create the Monitor after init_process_group, as DDP needs).
        self._reduce = distributed.is_distributed()

        wants_params = bool(set(self.kinds) & set(_PARAM_KINDS)) or ewma is not None
        self._params: list[tuple[str, nn.Parameter]] = (
            select_parameters(model, select) if wants_params else [])
        self._param_index = {name: i for i, (name, _) in enumerate(self._params)}

        self._step = 0
        self._active = True
        self._closed = False
        self._pending: list[tuple[list[str], np.ndarray, list]] = []
        self._local: dict[str, Tensor] = {}
        self._ewma: dict[str, tuple[Tensor, Tensor]] = {}
        self._ewma_updates: dict[str, int] = {}
        self._scratch = ops.Scratch()
        # Names whose std needed the two-pass m2 last time: computed that way up front.
        self._exact_names: dict[str, set[str]] = {}
        self._prev_param: dict[str, Tensor] = {}
        self._prev_grad: dict[str, Tensor] = {}
        self._snap_step = -1
        self._snap_grads: set[str] = set()
        self._series: list[tuple[str, str, str]] = []
        self._series_id: dict[tuple[str, str, str], int] = {}
        self._new_series: list[tuple[int, str, str, str]] = []
        self._layouts: dict[tuple, np.ndarray] = {}
        # In-memory history: per computed step its number, its (shared, cached) series ids
        # and its values; about 8 bytes per value plus ~100 bytes per step.
        self._h_steps: list[int] = []
        self._h_ids: list[np.ndarray] = []
        self._h_vals: list[np.ndarray] = []
        self._id_cache: dict[tuple[int, ...], np.ndarray] = {}
        self._h_hist: dict[tuple[str, str], tuple[list[int], list[np.ndarray]]] = {}

        self._hooks = HookSet()
        self._tap = None
        self._writer: RunWriter | None = None
        self._store_path = None if store is None else os.fspath(store)
        try:
            if "grad_output" in self.kinds:
                self._tap = tap(model, select, store=False, on_record=self._on_record)
            if local_grads:
                for name, p in self._params:
                    if p.requires_grad:
                        self._hooks.post_accumulate_grad(p, self._local_hook(name))
            if self._store_path is not None and self.rank == 0:
                self._writer = RunWriter(self._store_path, self._meta(model, select, meta),
                                         overwrite=overwrite)
        except BaseException:
            self._remove_hooks()
            raise

    # -- public API ---------------------------------------------------------------------------

    @property
    def steps_done(self) -> int:
        """Number of ``step()`` calls so far (the next step's number)."""
        return self._step

    @property
    def run(self) -> Run | None:
        """The :class:`~gradtap.Run` over this monitor's store (rank 0), else ``None``."""
        return Run(self._store_path) if self._store_path is not None and self.rank == 0 else None

    def step(self) -> None:
        """Close the current step: compute its statistics if it is due, then advance.

        Raises:
            RuntimeError: the monitor was closed.
        """
        if self._closed:
            raise RuntimeError("this Monitor is closed; create a new one to keep monitoring")
        s = self._step
        try:
            if self._active:
                self._compute(s)
            if (s + 1) % self.every == 0:
                self._snapshot(s)
        finally:
            self._pending = []
            self._local = {}
            if self._tap is not None:
                self._tap.clear()
            self._step = s + 1
            self._active = self._step % self.every == 0

    def frame(
        self,
        names: str | Sequence[str] | None = None,
        stats: str | Sequence[str] | None = None,
        kinds: str | Sequence[str] | None = None,
    ) -> pd.DataFrame:
        """Return the statistics so far as a long DataFrame ``step, name, kind, stat, value``.

        The same table as ``gt.open_run(store).frame(...)``; arguments filter as there.

        Raises:
            ImportError: pandas is missing (``pip install gradtap[pandas]``).
        """
        run = self.run
        if run is not None:
            return run.frame(names=names, stats=stats, kinds=kinds)
        keep = filter_series(self._series, names, stats, kinds)
        if self._h_steps:
            steps = np.repeat(np.array(self._h_steps, dtype=np.int64),
                              [len(i) for i in self._h_ids])
            ids, vals = np.concatenate(self._h_ids), np.concatenate(self._h_vals)
        else:
            steps = ids = np.zeros(0, dtype=np.int64)
            vals = np.zeros(0)
        return build_frame(steps, ids, vals, self._series, keep)

    def histogram(self, name: str, kind: str = "param_grad") -> Histogram:
        """Return ``(bin_edges [B+1], counts [steps, B])`` of one tensor (``.steps`` [steps]).

        Raises:
            KeyError: histograms are off, or none was recorded for ``name`` and ``kind``.
        """
        run = self.run
        if run is not None:
            return run.histogram(name, kind)
        if self._edges is None:
            raise KeyError("histograms are off; pass hist_bins=N to Monitor")
        if (kind, name) not in self._h_hist:
            names = sorted({n for k, n in self._h_hist if k == kind})
            raise KeyError(_unknown(name, names, f"{kind} histograms"))
        steps, counts = self._h_hist[(kind, name)]
        return Histogram(self._edges.numpy().copy(), np.stack(counts),
                         np.array(steps, dtype=np.int64))

    def ewma_mean(self, name: str) -> Tensor:
        """Elementwise EWMA mean of parameter ``name``'s gradient (a copy, its shape).

        Raises:
            ValueError: the EWMA is off (``ewma=None``).
            KeyError: ``name`` is not a selected parameter, or had no gradient yet.
        """
        return self._ewma_state(name)[0].clone()

    def ewma_var(self, name: str) -> Tensor:
        """Elementwise EWMA variance of parameter ``name``'s gradient (DESIGN.md formula).

        Raises:
            ValueError: the EWMA is off (``ewma=None``).
            KeyError: ``name`` is not a selected parameter, or had no gradient yet.
        """
        return self._ewma_state(name)[1].clone()

    def close(self, status: str = "finished") -> None:
        """Remove hooks, store EWMA summaries and ``status`` in the run metadata, close the
        store. Safe to call twice; :meth:`frame` keeps working afterwards."""
        if self._closed:
            return
        self._closed = True
        self._remove_hooks()
        if self._writer is not None:
            try:
                if self._ewma:
                    self._writer.write_ewma(self._ewma_rows())
            finally:
                self._writer.close(status)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close("failed" if exc_type is not None else "finished")

    def __repr__(self) -> str:
        where = f"store={self._store_path!r}" if self._store_path else "in memory"
        return (f"<Monitor kinds={list(self.kinds)} stats={list(self.stats)} every={self.every} "
                f"steps={self._step} {where}{' closed' if self._closed else ''}>")

    # -- hooks (run inside backward: device work only, never a host sync) ---------------------

    def _on_record(self, rec: GradRecord) -> None:
        if not self._active:
            return
        keys, tensors = [], []
        for path, g in rec.grad_outputs.items():
            if g is not None and g.numel() and g.is_floating_point():
                keys.append(f"{rec.module_name}:{path}")
                tensors.append(g)
        if tensors:
            count = np.array([t.numel() for t in tensors], dtype=np.float64)
            groups = ops.tensor_moments(tensors, self._needs_exact, edges=self._edges,
                                        exact_m2=True, scratch=self._scratch)
            self._pending.append((keys, count, groups))

    def _local_hook(self, name: str) -> Any:
        def hook(p: Tensor) -> None:
            # DDP copies the reduced gradient back into p.grad later: keep this rank's own.
            if self._active and p.grad is not None:
                self._local[name] = p.grad.detach().clone()

        return hook

    # -- one step -----------------------------------------------------------------------------

    def _compute(self, s: int) -> None:
        copy = ops.HostCopy()
        jobs: list[_Job] = []
        reduce = self._reduce
        grads = {}
        for n, p in self._params:
            g = p.grad
            if g is not None and g.numel():
                grads[n] = g
        if "param_grad" in self.kinds:
            if self.local_grads:
                names = [n for n, p in self._params if p.requires_grad]
                present = [n for n in names if n in self._local]
                jobs.append(self._device_job("param_grad", names, present,
                                             [self._local[n] for n in present], copy, reduce))
            elif grads:
                jobs.append(self._host_job("param_grad", list(grads), list(grads.values()), copy))
        if "grad_output" in self.kinds and self._pending:
            jobs.append(self._parts_job(copy, reduce))
        wants_params = "param" in self.kinds or "update" in self.kinds
        params = [(n, p.detach()) for n, p in self._params if p.numel()] if wants_params else []
        if "param" in self.kinds and params:
            jobs.append(self._host_job("param", [n for n, _ in params], [p for _, p in params],
                                       copy))
        ratio = None
        if "update" in self.kinds and self._snap_step == s - 1 and self._prev_param:
            names = [n for n, _ in params if n in self._prev_param]
            cur = [p for n, p in params if n in self._prev_param]
            diffs = torch._foreach_sub(cur, [self._prev_param[n] for n in names])
            jobs.append(self._host_job("update", names, diffs, copy))
            ratio = (names, copy.add(_norms(diffs)), copy.add(_norms(cur)))
        cosine = None
        if "grad_cosine" in self.kinds and self._snap_step == s - 1:
            names = [n for n in grads if n in self._snap_grads]
            if names:
                g = [grads[n] for n in names]
                h = [self._prev_grad[n] for n in names]
                cosine = (names, copy.add(_dots(g, h)), copy.add(_norms(g)), copy.add(_norms(h)))
        if self.ewma_beta is not None:
            self._update_ewma(grads)
        copy.run()

        ids: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        hists: list[tuple[str, str, np.ndarray]] = []
        for job in jobs:
            names, count, fields = self._finish_job(job, copy)
            if not names:
                continue
            result = ops.finish_stats(count, fields, self.stats)
            cols = [result[st] for st in self.stats]
            stat_names = list(self.stats)
            if job.kind == "update" and ratio is not None:
                un, pn = copy.get(ratio[1]), copy.get(ratio[2])
                with np.errstate(all="ignore"):  # no update is ratio 0, even of a zero param
                    cols.append(np.where(un == 0, 0.0, un / pn))
                stat_names.append("ratio")
            if cols:
                ids.append(self._layout(job.kind, names, stat_names))
                vals.append(np.stack(cols, axis=1).reshape(-1))
            if "hist" in fields:
                hists += [(job.kind, n, c.astype(np.int64)) for n, c in zip(names, fields["hist"])]
        if cosine is not None:
            names, dot, ng, nh = cosine
            denom = copy.get(ng) * copy.get(nh)
            with np.errstate(all="ignore"):
                cos = np.where(denom == 0, 0.0, copy.get(dot) / np.where(denom == 0, 1.0, denom))
            ids.append(self._layout("grad_cosine", names, ["cosine"]))
            vals.append(cos)
        self._record(s, ids, vals, hists)

    def _host_job(self, kind: str, names: list[str], tensors: list[Tensor],
                  copy: ops.HostCopy) -> _Job:
        job = _Job(kind, names)
        job.tensors = tensors
        job.count = np.array([t.numel() for t in tensors], dtype=np.float64)
        groups = ops.tensor_moments(tensors, self._needs, edges=self._edges)
        job.gather = ops.host_moments(groups, len(tensors), copy)
        known = self._exact_names.get(kind)
        if known and self._needs.std:
            rows = np.array([i for i, n in enumerate(names) if n in known], dtype=np.int64)
            if len(rows):
                exact = ops_moments.centered_moments([tensors[i] for i in rows], scratch=self._scratch)
                job.exact = (rows, ops.host_moments(exact, len(rows), copy))
        return job

    def _parts_job(self, copy: ops.HostCopy, reduce: bool) -> _Job:
        keys = [k for keys, _, _ in self._pending for k in keys]
        names = sorted(set(keys))
        if reduce:
            tensors_fields = _assemble_parts(self._pending)
            position = {n: i for i, n in enumerate(names)}
            job = _Job("grad_output", names)
            count = np.concatenate([c for _, c, _ in self._pending])
            group = np.array([position[k] for k in keys], dtype=np.int64)
            job.reduced = _queue_reduced(count, tensors_fields, group, names, copy)
            return job
        job = _Job("grad_output", names)
        job.count = np.concatenate([c for _, c, _ in self._pending])
        gathers = [ops.host_moments(groups, len(c), copy) for _, c, groups in self._pending]
        position = {n: i for i, n in enumerate(names)}
        job.group = np.array([position[k] for k in keys], dtype=np.int64)

        def gather() -> ops.Moments[np.ndarray]:
            return ops.Moments.cat([g() for g in gathers])

        job.gather = gather
        return job

    def _device_job(self, kind: str, names: list[str], present: list[str],
                    tensors: list[Tensor], copy: ops.HostCopy, reduce: bool) -> _Job:
        job = _Job(kind, names)
        if not tensors:
            if not reduce:
                job.names = []
                return job
            # This rank saw no gradient, but the others may have: take part with empty rows.
            dev = next((p.device for _, p in self._params), torch.device("cpu"))
            fields = _empty_fields(self._needs_exact, self._edges, dev)
            job.reduced = _queue_reduced(np.zeros(0), fields, np.zeros(0, dtype=np.int64),
                                         names, copy)
            return job
        count = np.array([t.numel() for t in tensors], dtype=np.float64)
        groups = ops.tensor_moments(tensors, self._needs_exact, edges=self._edges,
                                    exact_m2=True, scratch=self._scratch)
        position = {n: i for i, n in enumerate(names)}
        group = np.array([position[n] for n in present], dtype=np.int64)
        job.reduced = _queue_reduced(count, _assemble(groups, len(tensors)), group, names, copy)
        return job

    def _finish_job(self, job: _Job, copy: ops.HostCopy) -> tuple[list[str], np.ndarray, dict]:
        if job.reduced is not None:
            hc, hf, hcheck = job.reduced
            if distributed.layout_mismatch(copy.get(hcheck)):
                raise RuntimeError(
                    f"ranks reduced different {job.kind} tensors at step {self._step}; every "
                    "rank must run the selected modules and produce the same output slots"
                )
            count = copy.get(hc)
            fields = {f: copy.get(h) for f, h in hf.items()}
            keep = np.flatnonzero(count > 0)
            return ([job.names[i] for i in keep], count[keep],
                    ops.Moments.coerce({f: v[keep] for f, v in fields.items()}))
        if not job.names:
            return [], job.count, {}
        fields = job.gather()
        count = job.count
        if job.group is not None:  # parts (calls) with exact fields: combine them
            fields = ops.refine_fields(count, fields)
            count, fields = ops.combine_parts(count, fields, job.group, len(job.names))
            return job.names, count, fields
        exact = None if job.exact is None else (job.exact[0], job.exact[1]())
        fields, unreliable = ops.complete_fields(job.tensors, count, fields, self._needs,
                                                 exact=exact, scratch=self._scratch)
        self._exact_names[job.kind] = {job.names[i] for i in unreliable} if len(unreliable) else set()
        return job.names, count, fields

    def _update_ewma(self, grads: dict[str, Tensor]) -> None:
        beta = self.ewma_beta
        assert beta is not None
        for name, g in grads.items():
            state = self._ewma.get(name)
            if state is None:
                self._ewma[name] = ops.ewma_init(g)
                self._ewma_updates[name] = 1
            else:
                ops.ewma_update_(state[0], state[1], g, beta)
                self._ewma_updates[name] += 1

    def _snapshot(self, s: int) -> None:
        """Keep what the next step's ``update`` / ``grad_cosine`` compare against."""
        if "update" in self.kinds:
            names = [n for n, p in self._params if p.numel()]
            cur = [p.detach() for n, p in self._params if p.numel()]
            if not self._prev_param:
                self._prev_param = {n: torch.empty_like(p) for n, p in zip(names, cur)}
            if names:
                torch._foreach_copy_([self._prev_param[n] for n in names], cur)
        if "grad_cosine" in self.kinds:
            self._snap_grads = set()
            for n, p in self._params:
                g = p.grad
                if g is None or not g.numel():
                    continue
                buf = self._prev_grad.get(n)
                if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
                    self._prev_grad[n] = buf = torch.empty_like(g, memory_format=torch.contiguous_format)
                buf.copy_(g)
                self._snap_grads.add(n)
        self._snap_step = s

    # -- bookkeeping --------------------------------------------------------------------------

    def _layout(self, kind: str, names: list[str], stats: list[str]) -> np.ndarray:
        key = (kind, tuple(names), tuple(stats))
        ids = self._layouts.get(key)
        if ids is None:
            out = []
            for name in names:
                for stat in stats:
                    sk = (name, kind, stat)
                    i = self._series_id.get(sk)
                    if i is None:
                        i = self._series_id[sk] = len(self._series)
                        self._series.append(sk)
                        self._new_series.append((i, name, kind, stat))
                    out.append(i)
            ids = self._layouts[key] = np.array(out, dtype=np.int64)
        return ids

    def _record(self, s: int, ids: list[np.ndarray], vals: list[np.ndarray],
                hists: list[tuple[str, str, np.ndarray]]) -> None:
        key = tuple(id(i) for i in ids)  # layout arrays live in self._layouts: ids are stable
        all_ids = self._id_cache.get(key)
        if all_ids is None:
            all_ids = self._id_cache[key] = (np.concatenate(ids) if ids
                                             else np.zeros(0, dtype=np.int64))
        all_vals = np.concatenate(vals) if vals else np.zeros(0)
        if self._writer is not None:
            self._writer.write_step(s, self._new_series, all_ids, all_vals, hists)
            self._new_series = []
            return
        self._new_series = []
        self._h_steps.append(s)
        self._h_ids.append(all_ids)
        self._h_vals.append(all_vals)
        for kind, name, counts in hists:
            steps, rows = self._h_hist.setdefault((kind, name), ([], []))
            steps.append(s)
            rows.append(counts)

    def _ewma_state(self, name: str) -> tuple[Tensor, Tensor]:
        if self.ewma_beta is None:
            raise ValueError("the EWMA is off; pass ewma=0.99 (its factor beta) to Monitor")
        if name not in self._ewma:
            if name in self._param_index:
                raise KeyError(f"parameter {name!r} has had no gradient at a computed step yet")
            raise KeyError(_unknown(name, list(self._param_index), "selected parameter"))
        return self._ewma[name]

    def _ewma_rows(self) -> list[tuple[Any, ...]]:
        rows = []
        for name, (m, v) in self._ewma.items():
            rows.append((name, self.ewma_beta, self._ewma_updates[name], m.numel(),
                         json.dumps(list(m.shape)), float(torch.linalg.vector_norm(m)),
                         float(m.abs().max()), float(v.mean()), float(v.max())))
        return rows

    def _meta(self, model: nn.Module, select: Selector, extra: dict[str, Any] | None) -> dict:
        import gradtap

        params = list(model.named_parameters())
        selected_modules = self._tap.names if self._tap is not None else []
        meta: dict[str, Any] = {
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime()),
            "gradtap_version": gradtap.__version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "world_size": self.world_size,
            "config": {
                "select": select if isinstance(select, str) or (
                    isinstance(select, (list, tuple)) and all(isinstance(s, str) for s in select)
                ) else repr(select),
                "stats": list(self.stats), "kinds": list(self.kinds), "ewma": self.ewma_beta,
                "every": self.every, "local_grads": self.local_grads,
                "hist_bins": None if self._edges is None else self._edges.numel() - 1,
            },
            "selected": {"parameters": [n for n, _ in self._params], "modules": selected_modules},
            "model": {
                "class": type(model).__name__,
                "num_parameters": sum(p.numel() for _, p in params),
                "trainable_parameters": sum(p.numel() for _, p in params if p.requires_grad),
                "parameters": [[n, list(p.shape), str(p.dtype).replace("torch.", ""),
                                p.requires_grad] for n, p in params],
                "repr": repr(model)[:20000],
            },
        }
        if self._edges is not None:
            meta["histogram"] = {"edges": self._edges.tolist()}
        if extra:
            clash = sorted(set(extra) & set(meta) | set(extra) & {"status", "schema_version"})
            if clash:
                raise ValueError(f"meta= may not set reserved keys {clash}")
            try:
                json.dumps(extra)
            except TypeError as err:
                raise StoreError(f"meta= must be JSON-serialisable: {err}") from err
            meta.update(extra)
        return meta

    def _remove_hooks(self) -> None:
        if self._tap is not None:
            self._tap.remove()
        self._hooks.remove()


# -- helpers ---------------------------------------------------------------------------------


def _check_kinds(kinds: str | Iterable[str]) -> tuple[str, ...]:
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown kind(s) {', '.join(map(repr, bad))}; valid kinds are: "
                         f"{', '.join(KINDS)}")
    if not kinds:
        raise ValueError(f"kinds is empty; choose from: {', '.join(KINDS)}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"kinds lists a kind twice: {list(kinds)}")
    return kinds


def _unknown(name: str, names: list[str], what: str) -> str:
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = f"; close names: {', '.join(close)}" if close else ""
    return f"no {what} named {name!r}{hint}"


def _norms(tensors: list[Tensor]) -> Tensor:
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) if t.dtype in (
        torch.float16, torch.bfloat16) else torch.linalg.vector_norm(t).to(torch.float64)
        for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float64)


def _dots(a: list[Tensor], b: list[Tensor]) -> Tensor:
    out = []
    for x, y in zip(a, b):
        acc = torch.promote_types(x.dtype, torch.float32)
        out.append(torch.dot(x.reshape(-1).to(acc), y.reshape(-1).to(acc)).to(torch.float64))
    return torch.stack(out)


def _assemble(groups: list[tuple[list[int], ops.Moments[Tensor]]], n: int) -> ops.Moments[Tensor]:
    """Put the rows of ``tensor_moments`` groups back in tensor order, on one device."""
    if len(groups) == 1:
        return groups[0][1]
    device = next(iter(groups[0][1].items()))[1].device
    order = torch.tensor([i for idx, _ in groups for i in idx], device=device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=device)
    return ops.Moments.cat([m for _, m in groups]).map(lambda v: v[inverse])


def _assemble_parts(pending: list[tuple[list[str], np.ndarray, list]]) -> ops.Moments[Tensor]:
    return ops.Moments.cat([_assemble(groups, len(keys)) for keys, _, groups in pending])


def _empty_fields(needs: ops.Needs, edges: Tensor | None, device: torch.device) -> ops.Moments[Tensor]:
    names = (*needs.fields(), *(("shift", "csum", "m2c") if needs.std else ()))
    fields = {f: torch.zeros(0, dtype=torch.float64, device=device) for f in names}
    if edges is not None:
        fields["hist"] = torch.zeros(0, edges.numel() - 1, dtype=torch.float64, device=device)
    return ops.Moments.coerce(fields)


def _queue_reduced(count: np.ndarray, fields: dict[str, Tensor], group: np.ndarray,
                   names: list[str], copy: ops.HostCopy) -> tuple[int, dict[str, int], int]:
    rcount, rfields, check = distributed.reduce_parts(count, fields, group, names)
    return copy.add(rcount), {f: copy.add(v) for f, v in rfields.items()}, copy.add(check)
