"""The Monitor: streaming per-layer gradient statistics, composed of its parts.

The parameter kinds (``param_grad``, ``param``, ``update``, ``grad_cosine``) need no hook at
all: ``mon.step()`` reads ``p.grad`` / ``p`` and reduces every selected tensor in grouped,
batched form with one device-to-host copy (:mod:`~gradtap._monitor.reducer`). Only
``grad_output`` (activation gradients) and ``local_grads=True`` (DDP gradients before their
all-reduce) hook the model, through :mod:`gradtap.capture`; their hooks only launch device
reductions, never sync with the host. A computed step is one pipeline the Monitor owns
(:mod:`~gradtap._monitor.step`); its rows go to the Monitor's sinks, the first of them the one
history (:mod:`~gradtap._monitor.sinks`): the SQLite store, or a run in memory with the same
API (:mod:`~gradtap._monitor.history`).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from gradtap import distributed
from gradtap._monitor.clips import ClipRows
from gradtap._monitor.ewma import GradEwma
from gradtap._monitor.gns import GnsSource, LossReduction, SampleNorms
from gradtap._monitor.health import HealthStats, gns_stats
from gradtap._monitor.history import MemoryRun
from gradtap._monitor.meta import run_meta
from gradtap._monitor.options import (
    DEFAULT_STATS,
    KINDS,
    STAT_NAMES,
    check_logging,
    check_options,
    watched_parameters,
)
from gradtap._monitor.reducer import Part, StepReducer
from gradtap._monitor.rows import RowBuilder
from gradtap._monitor.sharded import Layouts
from gradtap._monitor.sinks import HistorySink
from gradtap._monitor.snapshots import Snapshots
from gradtap._monitor.spikes import ZSCORE_BETA, ZScores, late_factor_names, queue_clip_factors
from gradtap._monitor.split import Splits, check_split
from gradtap._monitor.step import StepPipeline
from gradtap._monitor.trackers.queue import TrackerQueue
from gradtap._monitor.trackers.resolve import resolve
from gradtap._monitor.trackers.summary import Summary, check_groups
from gradtap._tensorops import HostCopy
from gradtap._types import Selector
from gradtap.capture import (
    Clip,
    HookSet,
    ScalerWatch,
    check_scaler,
    compiled_feature,
    session,
    tap,
    unscale,
)
from gradtap.record import GradRecord
from gradtap.select import clean_name
from gradtap.store import Histogram, Run, RunWriter

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["DEFAULT_STATS", "KINDS", "Monitor"]


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

    Statistics (``stats=``) are taken over all elements:
    ``norm`` (L2), ``mean``, ``std`` (population), ``absmax``, ``min``, ``max``, ``nonfinite``
    (count of NaN/Inf), ``zero_frac``, ``rms`` (``sqrt(mean(x**2))``). NaN propagates into
    mean/std/norm/rms/absmax/min/max. Training health (``docs/health.md``): ``gain`` (kind
    ``grad_output``: ``|dL/d input| / |dL/d output|`` of each module's calls, the input its first
    floating one with a gradient); ``gns``, ``gns_trace``, ``gns_sqnorm`` (with ``gns_from``:
    the gradient noise scale ``B_simple = ewma(tr(Sigma)) / ewma(|G|^2)`` and its two EMAs, per
    parameter and for ``"<all>"``, kind ``param_grad``); ``step(loss=...)`` stores the loss.

    Args:
        model: the model to watch; a wrapper (``DistributedDataParallel``, ``DataParallel``,
            ``torch.compile``, FSDP1) is looked through, so names never carry ``module.``,
            ``_orig_mod.`` or ``_fsdp_wrapped_module.`` and globs match the inner names.
        select: parameter selector for the parameter kinds and module selector for
            ``grad_output`` (glob, list of globs, class, predicate; see ``gt.select_*``).
        stats: statistic names (default ``norm, mean, std, absmax, nonfinite``).
        kinds: which tensors to watch (default ``("param_grad",)``).
        ewma: factor ``beta`` of an elementwise EWMA of each parameter gradient
            (``m = g, v = 0``, then ``d = g - m; m += (1 - beta) d; v = beta (v + (1 - beta) d^2)``);
            ``None`` turns it off. Advanced on computed steps, from the global gradient.
        hist_bins: number of histogram bins per tensor and step (``None``: no histograms);
            exact for tensors of up to 8,192 elements, above that estimated from 8,192
            elements at fixed positions (``docs/semantics.md``, "Exact and sampled histograms").
        every: compute every ``every`` steps.
        store: run directory for a crash-safe SQLite store (``None``: keep in memory).
        hist_scale: ``"symlog"`` (default) or ``"linear"`` bins.
        hist_range: ``(lo, hi)`` of the bins (default ``(-10, 10)`` symlog, ``(-1, 1)`` linear);
            values outside fall in the end bins.
        hist_linthresh: magnitude below which symlog bins are linear.
        local_grads: under DDP, watch rank-local parameter gradients (see above).
        overwrite: replace an existing store at ``store``.
        meta: extra JSON-serialisable metadata for the run (checked when a store is written).
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision run. Every statistic,
            histogram, EWMA and snapshot then sees the unscaled gradient ``g / scale``, whether
            ``step()`` runs before or after ``scaler.unscale_(opt)`` / ``scaler.step(opt)``
            (fused optimizers, which keep their gradients scaled, included); and each step
            stores, on name ``"<scaler>"``, stat ``amp_scale`` (the step's scale) and
            ``nonfinite`` (1 when the scaler found an inf/NaN and skipped the optimizer step;
            before the scaler checked, the count of non-finite elements of the selected
            gradients).
        split: ``{parameter glob: dim}``: also the statistics (kinds ``param_grad``, ``param``)
            of each slice along ``dim`` of the matched parameters, named ``"<name>[i]"`` (an
            MoE ``[E, out, in]`` expert weight gives ``experts.w1[0]`` ... ``[E-1]``).
        gns_from: where the noise scale's small batches come from: ``"ranks"`` (each rank's
            gradient before the reduction; needs a process group), ``"microbatches"`` (each
            backward of an accumulation step) or ``"samples"`` (``per_sample=``'s norms).
            ``"ranks"`` and ``"microbatches"`` need ``step(batch_size=...)``.
        gns_beta: the factor of the noise scale's two EMAs.
        loss_reduction: ``"mean"`` (default) or ``"sum"``: each rank's step gradient is the
            mean or the sum of its samples' gradients (``"samples"``: per_sample's own).
        per_sample: a ``gt.per_sample(model, quantities=("norm",))`` handle on the same model
            (``gns_from="samples"``; the Monitor clears it at each step).
        log_to: live trackers that also get each logged step (``docs/guide-trackers.md``): a
            ``torch.utils.tensorboard.SummaryWriter``, a wandb run or the ``wandb`` module (its
            active run), the ``mlflow`` module (its active run), a Lightning ``Logger``, a
            callable ``f(metrics: dict[str, float], step: int)``, or a list of them. Keys are
            slash paths (``grad/norm/fc.weight``, ``grad/global_norm``, ``loss``). The store
            stays the complete record (``store=None`` is fine); only rank 0 logs, the values of
            the global gradient (the other ranks ignore ``log_to``: ``wandb.init()`` on rank 0
            alone is fine). The trackers run on a thread behind a bounded queue: a
            tracker that cannot keep up never stalls training (its steps are dropped, with one
            warning); :meth:`close` waits for what is queued.
        log_every: log the computed steps ``s`` with ``s % log_every == 0`` (a multiple of
            ``every``; default ``every``). A step that is not logged costs the trackers nothing.
        log_keys: ``"summary"`` (default): at most 64 keys per step whatever the model's size
            (global and per-block gradient norms, the largest value of each stat and its
            tensor, spike and clip counts, the loss); ``"all"``: every row of the step too.
        log_groups: ``{parameter glob: label}``: the summary's group norms over these groups
            (a parameter in the first group whose glob matches it) instead of the model's
            top-level blocks; at most 16 labels.

    Raises:
        SelectionError: ``select`` matches nothing.
        ValueError: unknown stat or kind names (listing the valid ones), or a bad option (a
            noise-scale stat without ``gns_from``, ``"ranks"`` without a process group, ...).
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
        *,
        stats: Sequence[str] = DEFAULT_STATS,
        kinds: Sequence[str] = ("param_grad",),
        ewma: float | None = None,
        hist_bins: int | None = None,
        every: int = 1,
        store: str | os.PathLike[str] | None = None,
        hist_scale: str = "symlog",
        hist_range: tuple[float, float] | None = None,
        hist_linthresh: float = 1e-8,
        local_grads: bool = False,
        overwrite: bool = False,
        meta: dict[str, Any] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        split: dict[str, int] | None = None,
        gns_from: GnsSource | None = None,
        gns_beta: float = 0.95,
        loss_reduction: LossReduction | None = None,
        per_sample: SampleNorms | None = None,
        log_to: Any = None,
        log_every: int | None = None,
        log_keys: str = "summary",
        log_groups: dict[str, str] | None = None,
    ) -> None:
        sess = session(model, "Monitor")
        check_scaler(scaler, "Monitor")
        # DDP / torch.compile / FSDP1 wrappers: watch (and name) the model inside; a
        # compiled model's per-call taps go through its wrapper (they run eagerly).
        compiled, model = model, sess.root
        self.stats, self.kinds, edges = check_options(
            stats, kinds, ewma=ewma, every=every, local_grads=local_grads, hist_bins=hist_bins,
            hist_scale=hist_scale, hist_range=hist_range, hist_linthresh=hist_linthresh)
        self.log_every = check_logging(log_to, log_every, log_keys, log_groups, every)
        self.ewma_beta = None if ewma is None else float(ewma)
        self.every = every
        self.local_grads = local_grads
        self.rank, self.world_size = distributed.world()
        # Only rank 0 logs: the other ranks need no tracker (wandb.init() only on rank 0).
        trackers = [] if log_to is None or self.rank != 0 else resolve(log_to)
        moment_stats = tuple(st for st in self.stats if st in STAT_NAMES)
        if "zscore" in self.stats and "norm" not in moment_stats:  # zscore is the norm's
            moment_stats += ("norm",)
        self._zscores = None if "zscore" not in self.stats else ZScores(
            ZSCORE_BETA if ewma is None else float(ewma))
        # Known at construction (create the Monitor after init_process_group, as DDP needs).
        self._reducer = StepReducer(moment_stats, edges, reduce=distributed.is_distributed())
        self._moments = bool(moment_stats) or edges is not None
        gns = gns_stats(self.stats, gns_from, loss_reduction, per_sample)
        self._params, self._sharded = watched_parameters(
            model, select, self.kinds, gradients=ewma is not None or bool(gns),
            local_grads=local_grads, split=bool(split))
        self._splits = Splits(check_split(split, model, self._params),
                              {n: p.shape for n, p in self._params})
        self._model = weakref.ref(model)
        self._ewma = None if self.ewma_beta is None else GradEwma(
            self.ewma_beta, [n for n, _ in self._params])
        self._layouts = Layouts(self._ewma)
        if self._sharded:  # gradients are laid out like their parameters
            self._layouts.shards({n: p for n, p in self._params})
        self._snapshots = Snapshots(self._params, update="update" in self.kinds,
                                    cosine="grad_cosine" in self.kinds)

        self._step = 0
        self._active = True
        self._closed = False
        self._pending: list[Part] = []
        self._local: dict[str, Tensor] = {}
        # a computed step whose clip factors a when="step" rule has yet to apply
        self._held: tuple[int, RowBuilder, list[str]] | None = None
        self._after_steps = False

        self._hooks = HookSet()
        self._hooks.add_cleanup(sess.attach().detach)
        self._session = sess
        self._amp: ScalerWatch | None = sess.scaler(scaler, "Monitor")
        self._tap = None
        self._writer: RunWriter | None = None
        self._store_path = None if store is None else os.fspath(store)
        try:
            if "grad_output" in self.kinds:
                with compiled_feature("Monitor(kinds=['grad_output'])"):
                    self._tap = tap(compiled, select, store=False, on_record=self._on_record)
            if local_grads:
                for name, p in self._params:
                    if p.requires_grad:
                        self._hooks.post_accumulate_grad(p, self._local_hook(name))
            self._health = HealthStats(
                self.stats, gns_from=gns_from, gns_beta=gns_beta, loss_reduction=loss_reduction,
                per_sample=per_sample, params=self._params, model=model, hooks=self._hooks,
                amp=self._amp, active=lambda: self._active)
            to_store = self._store_path is not None and self.rank == 0
            run_info = run_meta(
                model, select=select, config={
                    "stats": list(self.stats), "kinds": list(self.kinds), "ewma": self.ewma_beta,
                    "every": self.every, "local_grads": self.local_grads,
                    "hist_bins": None if edges is None else edges.numel() - 1,
                    "scaler": scaler is not None, "split": dict(self._splits.dims),
                    **self._health.config()},
                parameters=[n for n, _ in self._params],
                modules=[clean_name(n) for n in self._tap.names] if self._tap is not None else [],
                world_size=self.world_size, edges=None if edges is None else edges.tolist(),
                extra=meta, check=to_store)
            # The one history: written step by step, read back by every query.
            self._sink: RunWriter | MemoryRun
            if to_store:
                assert self._store_path is not None
                self._sink = self._writer = RunWriter(self._store_path, run_info,
                                                      overwrite=overwrite)
            else:
                self._sink = MemoryRun(run_info)
            sinks: list[Any] = [HistorySink(self._sink)]
            names = [n for n, _ in self._params]
            groups = None if log_groups is None else check_groups(log_groups, names)
            #: the trackers' sink (rank 0 with log_to=), for the callbacks' own cadence
            self._trackers: TrackerQueue | None = None
            if trackers and self.rank == 0:  # the values of the global gradient, once
                self._trackers = TrackerQueue(trackers, log_every=self.log_every, summary=Summary(
                    names, groups, everything=log_keys == "all"))
                sinks.append(self._trackers)
            self._pipeline = StepPipeline(
                kinds=self.kinds, stats=self.stats, params=self._params, model=model,
                sharded=self._sharded, local_grads=local_grads, reducer=self._reducer,
                moments=self._moments, layouts=self._layouts, splits=self._splits,
                snapshots=self._snapshots, ewma=self._ewma, health=self._health,
                zscores=self._zscores, amp=self._amp, session=sess, rank=self.rank,
                world_size=self.world_size, sinks=sinks)
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
        if self._writer is None or self._store_path is None:
            return None
        return Run(self._store_path)

    def step(self, loss: Tensor | float | None = None, *,
             batch_size: int | Sequence[int] | None = None) -> None:
        """Close the current step: compute its statistics if it is due, then advance.

        Args:
            loss: the step's loss (a one-element tensor or a number; read with the step's one
                host copy), stored as name ``"<loss>"``, stat ``value``, kind ``health``;
                under a process group the mean of the ranks' values.
            batch_size: for the noise scale: the samples of this rank in the step
                (``gns_from="ranks"``), or of each micro-batch (``"microbatches"``: one int
                for all, or one per backward of the step).

        Raises:
            RuntimeError: the monitor was closed.
            ValueError: the noise scale lacks ``batch_size``, or it disagrees with the step.
        """
        self._close_step(loss, batch_size, None)

    def step_clipped(self, clip: Clip, loss: Tensor | float | None = None, *,
                     batch_size: int | Sequence[int] | None = None) -> None:
        """Close the current step right before a gradient clip, run the clip, and store what
        it did with the step: what ``gradtap watch`` and the framework callbacks do when the
        script clips (``clip`` is the :class:`gradtap.capture.Clip` they are shown).

        The step's statistics are those of the gradients before the clip; the step also
        stores the clip's ``clip_factor`` per tensor and its total norm and factor on name
        ``"<clip>"`` (see ``docs/semantics.md``). The clip runs once, even when the step
        fails; its own error is raised as it is.

        Raises:
            RuntimeError: the monitor was closed.
        """
        self._close_step(loss, batch_size, clip)

    def _close_step(self, loss: Tensor | float | None,
                    batch_size: int | Sequence[int] | None, clip: Clip | None) -> None:
        if self._closed:
            raise RuntimeError("this Monitor is closed; create a new one to keep monitoring")
        self._release_held()
        s = self._step
        try:
            rows = None
            if self._active:
                rows = self._pipeline.compute(s, pending=self._pending, local=self._local,
                                              loss=loss, batch_size=batch_size)
                if rows is None:
                    warnings.warn(
                        f"Monitor.step() at step {s}: no selected tensor has a gradient "
                        "(called before backward, or after optimizer.zero_grad()?); nothing "
                        "is stored for this step", UserWarning, stacklevel=3)
            if (s + 1) % self.every == 0:
                self._snapshots.take(s)
            if clip is not None:
                extra = None if rows is None else ClipRows(clip, self._params, self._session)
                clip.run()
                if extra is not None and rows is not None:
                    extra.add(rows)
            if rows is not None:
                late = late_factor_names(self._session, [n for n, p in self._params
                                                         if p.grad is not None])
                if late:  # stored with this step once the rule ran in optimizer.step()
                    self._hold(s, rows, late)
                else:
                    self._pipeline.send(s, rows)
        finally:
            if clip is not None and not clip.ran:
                clip.run()
            self._pipeline.end_step()
            if self._pending:
                self._pending = []
            if self._local:
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
        return self._history().frame(names=names, stats=stats, kinds=kinds)

    def histogram(self, name: str, kind: str = "param_grad") -> Histogram:
        """Return ``(bin_edges [B+1], counts [steps, B])`` of one tensor (``.steps`` [steps]).

        Raises:
            KeyError: histograms are off, or none was recorded for ``name`` and ``kind``.
        """
        return self._history().histogram(name, kind)

    def ewma_mean(self, name: str) -> Tensor:
        """Elementwise EWMA mean of parameter ``name``'s gradient (a copy, its shape).

        Under FSDP2 each rank keeps the EWMA of its own shard: the result is a DTensor laid
        out like the gradient (``.full_tensor()`` gathers it; ``.to_local()`` is this rank's
        part).

        Raises:
            ValueError: the EWMA is off (``ewma=None``).
            KeyError: ``name`` is not a selected parameter, or had no gradient yet.
        """
        return self._layouts.as_dtensor(name, self._ewma_state(name)[0].clone())

    def ewma_var(self, name: str) -> Tensor:
        """Elementwise EWMA variance of parameter ``name``'s gradient (see ``ewma=``); a
        DTensor under FSDP2, like :meth:`ewma_mean`.

        Raises:
            ValueError: the EWMA is off (``ewma=None``).
            KeyError: ``name`` is not a selected parameter, or had no gradient yet.
        """
        return self._layouts.as_dtensor(name, self._ewma_state(name)[1].clone())

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this one: the step count, the EWMA and the
        ``update``/``grad_cosine`` snapshots, as tensors and plain values (``torch.save``-able).

        Save it with the training checkpoint and give it to :meth:`load_state_dict` of a
        Monitor made the same way (same selection, ``ewma``, ``every``) after resuming: the
        statistics and EWMA go on as if training had not stopped.

        Example:
            >>> import torch, gradtap as gt
            >>> net = torch.nn.Linear(3, 1)
            >>> mon = gt.Monitor(net, ewma=0.9)
            >>> net(torch.randn(4, 3)).sum().backward(); mon.step()
            >>> resumed = gt.Monitor(net, ewma=0.9)
            >>> resumed.load_state_dict(mon.state_dict())
            >>> resumed.steps_done, torch.equal(resumed.ewma_var("weight"), mon.ewma_var("weight"))
            (1, True)
        """
        return {"step": self._step, "every": self.every,
                "parameters": [n for n, _ in self._params],
                "ewma": None if self._ewma is None else self._ewma.state_dict(),
                "snapshots": self._snapshots.state_dict(), "gns": self._health.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` of an earlier Monitor (call before the first
        :meth:`step`).

        Raises:
            RuntimeError: this Monitor has already taken steps.
            ValueError: the saved state comes from a Monitor with another ``every``, ``ewma``
                or selection.
        """
        if self._step:
            raise RuntimeError("load_state_dict() must come before the first step()")
        if state["every"] != self.every:
            raise ValueError(f"the saved state has every={state['every']}; this Monitor has "
                             f"every={self.every}")
        if (state["ewma"] is None) != (self._ewma is None):
            raise ValueError("the saved state and this Monitor disagree on ewma= (one is off)")
        devices = {n: p.device for n, p in self._params}
        missing = sorted(set(state["parameters"]) - set(devices))
        if missing:
            raise ValueError(f"the saved state watched parameters this Monitor does not: "
                             f"{', '.join(missing[:5])}")
        if self._ewma is not None:
            self._ewma.load_state_dict(state["ewma"], devices)
        self._snapshots.load_state_dict(state["snapshots"])
        self._health.load_state_dict(state.get("gns"))
        self._step = int(state["step"])
        self._active = self._step % self.every == 0

    def close(self, status: str = "finished") -> None:
        """Remove hooks, store EWMA summaries and ``status`` in the run metadata, close the
        store. Safe to call twice; :meth:`frame` keeps working afterwards.

        Under FSDP2 with ``ewma=`` on, a ``"finished"`` close reduces the EWMA summaries over
        the shards (two collectives): call it on every rank. A failed close (an exception in
        the ``with`` block) stores no EWMA summaries rather than wait for the other ranks.
        """
        if self._closed:
            return
        self._closed = True
        self._remove_hooks()
        try:
            self._release_held()
            if self._ewma:
                if not self._sharded:
                    self._sink.write_ewma(self._ewma.summaries())
                elif status == "finished":
                    self._sink.write_ewma(self._ewma.summaries(self._layouts.ewma_summaries(
                        [n for n, _ in self._params], self._pipeline.device)))
        finally:
            self._pipeline.close(status)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close("failed" if exc_type is not None else "finished")

    def __repr__(self) -> str:
        where = f"store={self._store_path!r}" if self._store_path else "in memory"
        return (f"<Monitor kinds={list(self.kinds)} stats={list(self.stats)} every={self.every} "
                f"steps={self._step} {where}{' closed' if self._closed else ''}>")

    # -- a step kept for the factors of a rule that runs inside optimizer.step() --------------

    def _hold(self, s: int, rows: RowBuilder, late: list[str]) -> None:
        self._held = (s, rows, late)
        if not self._after_steps:  # once: the held step is sent after the optimizer step
            self._after_steps = True
            self._hooks.any_optimizer_step_post(self._after_optimizer_step)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        held = self._held
        if held is not None and not late_factor_names(self._session, held[2]):
            self._release_held()

    def _release_held(self) -> None:
        """Send the held step with the factors its rules applied since (one small copy);
        a rule that never ran (the optimizer step was skipped) stores none."""
        held, self._held = self._held, None
        if held is None:
            return
        s, rows, names = held
        copy = HostCopy()
        factors = queue_clip_factors(self._session, names, copy)
        copy.run()
        if factors is not None:
            rows.add("param_grad", factors[0], {"clip_factor": factors[1]()})
        self._pipeline.send(s, rows)

    # -- hooks (run inside backward: device work only, never a host sync) ---------------------

    def _on_record(self, rec: GradRecord) -> None:
        if not self._active:
            return
        keys, tensors = [], []
        scale = None if self._amp is None else self._amp.step_scale()
        for path, g in rec.grad_outputs.items():
            if g is not None and g.numel() and g.is_floating_point():
                keys.append(f"{clean_name(rec.module_name)}:{path}")
                # Activation gradients are always those of the scaled loss.
                tensors.append(unscale(g, scale))
        if self._health.gain is not None:  # a ratio: the same with or without the scale
            self._health.gain.record(rec.grad_inputs, list(zip(keys, tensors)))
        if tensors and self._moments:
            self._pending.append(self._reducer.part(keys, tensors))

    def _local_hook(self, name: str) -> Any:
        def hook(p: Tensor) -> None:
            # DDP copies the reduced gradient back into p.grad later: keep this rank's own.
            if self._active and p.grad is not None:
                scale = None if self._amp is None else self._amp.step_scale()
                g = p.grad.detach()
                self._local[name] = g.clone() if scale is None else unscale(g, scale)

        return hook

    # -- one step -----------------------------------------------------------------------------

    # -- helpers ------------------------------------------------------------------------------

    def _history(self) -> Run | MemoryRun:
        """The one view every query reads: the store's ``Run``, or the run in memory."""
        if self._writer is not None:
            assert self._store_path is not None
            return Run(self._store_path)
        assert isinstance(self._sink, MemoryRun)
        return self._sink

    def _ewma_state(self, name: str) -> tuple[Tensor, Tensor]:
        if self._ewma is None:
            raise ValueError("the EWMA is off; pass ewma=0.99 (its factor beta) to Monitor")
        return self._ewma.state(name)

    def _remove_hooks(self) -> None:
        if self._tap is not None:
            self._tap.remove()
        self._hooks.remove()

