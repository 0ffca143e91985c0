"""The watch inside the script's process: a Monitor per optimizer, stepped before each of its
steps, closed at exit.

Started by the start-up code (:mod:`gradtap._watch.site`) once torch is imported. Nothing is
done until an optimizer steps: at its first ``step()`` (or ``scaler.step(optimizer)``) the
optimizer's parameters are named by the modules that own them and its Monitor (and, with
``detect``, a detector that records and never skips) is made; from then on the Monitor closes
one step right before each of the optimizer's steps, so its statistics are those of the
gradients the optimizer receives; right before the script's first gradient clip of the step
instead when it clips (the gradients before the clip, and what the clip did), and, for a
``step(closure)``, when the closure first returns (its backward ran inside ``step()``). Under a ``torch.amp.GradScaler`` the Monitor is given the
scaler (unscaled statistics, fused optimizers included), and a step the scaler skips (no
``optimizer.step()``) is still one Monitor step, stored as an overflow.

Which processes write: the main process (the first one started under the watch), or, under
``torch.distributed``, every rank runs the Monitor (its statistics may need collectives) and
rank 0 writes. Other processes (DataLoader workers, a forked child, subprocesses) watch
nothing. Errors inside the watch never reach the script: the watch says so once on stderr
and stops.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradtap._detect._detector import Detector, detect
from gradtap._monitor.monitor import Monitor
from gradtap._monitor.trackers.resolve import from_spec
from gradtap.capture import Clip, HookSet, ScalerWatch
from gradtap.report.data import write_anomalies
from gradtap.select import select_parameters, unwrap_model
from gradtap.store import set_run_meta

__all__ = ["install", "uninstall", "owner_model", "store_path"]

MAIN_ENV = "GRADTAP_WATCH_MAIN"
ANOMALY_SOURCE = "gradtap watch --detect"

_current: _Watcher | None = None


def install(config: dict[str, Any]) -> None:
    """Watch every optimizer of this process (see the module docstring); once per process."""
    global _current
    if _current is None:
        _current = _Watcher(config)


def uninstall() -> None:
    """Close every Monitor and remove the hooks now (what exit does)."""
    global _current
    if _current is not None:
        _current.close()
        _current = None


def store_path(out: str | os.PathLike[str], index: int) -> Path:
    """Where the ``index``-th optimizer (in order of first step) writes: ``out`` for the first,
    ``out/optimizer-<index>`` for the others."""
    return Path(out) if index == 0 else Path(out) / f"optimizer-{index}"


class _Watched:
    """One optimizer's Monitor (and detector, and the view of its grad scaler)."""

    def __init__(self, monitor: Monitor, detector: Detector | None, path: Path,
                 amp: ScalerWatch | None, batch_size: int | None = None) -> None:
        self.monitor = monitor
        self.batch_size = batch_size
        self.detector = detector
        self.path = path
        self.amp = amp
        self.stepped = False  # optimizer.step() ran inside the current scaler.step()
        self.clipped = False  # this optimizer step's Monitor step was taken before a clip

    def step(self, clip: Clip | None = None) -> None:
        if clip is None:
            self.monitor.step(batch_size=self.batch_size)
        else:
            self.monitor.step_clipped(clip, batch_size=self.batch_size)
        if self.detector is not None:
            self.detector.step()

    def close(self, status: str) -> None:
        try:
            self.monitor.close(status)
            if self.amp is not None:
                self.amp.remove()
        finally:
            if self.detector is not None:
                self.detector.remove()
                if self.monitor.rank == 0 and self.path.is_dir():
                    write_anomalies(self.path, self.detector.anomalies, source=ANOMALY_SOURCE)


class _Watcher:
    def __init__(self, config: dict[str, Any]) -> None:
        self.out = config["out"]
        self.select = config.get("select", "*")
        self.stats = tuple(config.get("stats") or ())
        self.kinds = tuple(config.get("kinds") or ("param_grad",))
        self.every = int(config.get("every", 1))
        self.detect = bool(config.get("detect", False))
        self.gns_from = config.get("gns_from")
        self.batch_size = config.get("batch_size")
        self.log_to = list(config.get("log_to") or ())
        self.pid = os.getpid()
        self.main = os.environ.get(MAIN_ENV, str(self.pid)) == str(self.pid)
        self.count = 0
        self.failed = False
        self.watched: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Watched | None] = (
            weakref.WeakKeyDictionary())
        self.open: list[_Watched] = []
        self.hooks = HookSet()
        self.hooks.any_optimizer_step_pre(self._before_step)
        self.hooks.around_any_grad_scaler_step(self._before_scaler_step, self._after_scaler_step)
        self.hooks.around_any_clip(self._around_clip, self._give_up_on)
        self._unowned: set[frozenset[int]] = set()  # clipped tensors no optimizer holds
        atexit.register(self.close)

    # Without a grad scaler, one Monitor step right before each optimizer.step(). Through
    # scaler.step(optimizer), the same, and after a scaler.step() that skipped the optimizer
    # (inf/NaN: optimizer.step() never ran) one Monitor step there, stored as an overflow.

    # A script that clips (clip_grad_norm_, clip_grad_value_): the Monitor step is taken right
    # before the first clip of an optimizer's step, over the gradients before it, with what
    # the clip did; that optimizer's step() then takes none.

    # An optimizer stepped with a closure (Lightning's, LBFGS) computes its gradients inside
    # step(): the closure is wrapped, and the Monitor step taken when it first returns (or
    # before the clip it makes).

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any,
                     kwargs: Any) -> tuple[Any, Any] | None:
        watched = self._get(optimizer, None)
        if watched is None:
            return None
        watched.stepped = True
        if watched.clipped:
            watched.clipped = False
            return None
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):
            self._guarded(watched.step)
            return None
        first = [True]

        def closure_then_step() -> Any:
            out = closure()
            if first[0]:
                first[0] = False
                if watched.clipped:
                    watched.clipped = False
                else:
                    self._guarded(watched.step)
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_step}
        return (closure_then_step, *args[1:]), kwargs

    def _around_clip(self, clip: Clip) -> None:
        watched = None if self.failed else self._clipped_optimizer(clip.parameters)
        if watched is None or watched.clipped:
            clip.run()
            return
        watched.clipped = True
        watched.step(clip)  # runs the clip; an error of the watch reaches _give_up_on

    def _clipped_optimizer(self, params: list[torch.Tensor]) -> _Watched | None:
        """The watch of the optimizer holding the clipped tensors (started here when the
        clip comes before its first step: found among the live optimizers)."""
        if os.getpid() != self.pid or not params:
            return None
        ids = frozenset(id(p) for p in params)
        for optimizer, watched in list(self.watched.items()):
            if watched is not None and _holds(optimizer, ids):
                return watched
        if ids in self._unowned:
            return None
        live = gc.get_objects()  # by type: isinstance() would touch lazy module proxies
        optimizers = [o for o in live if issubclass(type(o), torch.optim.Optimizer)
                      and o not in self.watched and _holds(o, ids)]
        scalers = [o for o in live
                   if issubclass(type(o), torch.amp.GradScaler) and o.is_enabled()]
        del live
        for optimizer in optimizers:
            watched = self._get(optimizer, scalers[0] if len(scalers) == 1 else None)
            if watched is not None:
                return watched
        self._unowned.add(ids)
        return None

    def _before_scaler_step(self, scaler: torch.amp.GradScaler, optimizer: Any) -> None:
        if isinstance(optimizer, torch.optim.Optimizer) and scaler.is_enabled():
            watched = self._get(optimizer, scaler)
            if watched is not None:
                watched.stepped = False

    def _after_scaler_step(self, scaler: torch.amp.GradScaler, optimizer: Any) -> None:
        if isinstance(optimizer, torch.optim.Optimizer) and scaler.is_enabled():
            watched = self._get(optimizer, scaler)
            if watched is not None and not watched.stepped and not watched.clipped:
                self._guarded(watched.step)
            if watched is not None:
                watched.stepped = watched.clipped = False

    def _get(self, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler | None) -> _Watched | None:
        """The optimizer's watch, made at its first step (``None``: not watched)."""
        if self.failed or os.getpid() != self.pid:  # a forked child steps nothing of ours
            return None
        try:
            if optimizer not in self.watched:
                self.watched[optimizer] = self._start(optimizer, scaler)
            return self.watched[optimizer]
        except Exception as exc:
            self._give_up(exc)
            return None

    def _guarded(self, fn: Any) -> None:
        if self.failed:
            return
        try:
            fn()
        except Exception as exc:
            self._give_up(exc)

    def _writes(self) -> bool:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return True  # every rank runs the Monitor; rank 0 writes
        rank = os.environ.get("RANK")
        return self.main and rank in (None, "0")

    def _start(self, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler | None) -> _Watched | None:
        # A wrapper stepping an inner optimizer (Accelerate's): the inner one is watched.
        if isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            return None
        if not self._writes():
            return None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        index = self.count
        self.count += 1
        label = f"optimizer {index} ({type(optimizer).__name__})"
        model, missing = owner_model(params)
        if missing:
            self._say(f"{label}: {missing} of its tensors belong to no nn.Module and are not "
                      "watched")
        if model is None:
            return None
        mine = {id(p) for p in params}
        chosen = [n for n, p in select_parameters(model, self.select) if id(p) in mine]
        if not chosen:
            self._say(f"{label}: --select {self.select!r} matches none of its parameters")
            return None
        everything = len(chosen) == sum(1 for _ in model.parameters())
        select: Any = self.select if everything or "grad_output" in self.kinds else (
            _Names(chosen, self.select, index))
        path = store_path(self.out, index)
        # First stepped through scaler.step(): the Monitor gets the scaler (unscaled
        # statistics, fused optimizers included), told what the scaler did in this step
        # already (the user's own unscale_ before scaler.step).
        amp = None
        if scaler is not None:
            amp = ScalerWatch(scaler)
            amp.sync(optimizer)
        kwargs: dict[str, Any] = {} if not self.stats else {"stats": self.stats}
        if self.gns_from is not None:  # the first step's backward came before: its gns is NaN
            kwargs["gns_from"] = self.gns_from
        if self.log_to:  # --log-to: the trackers, made now (a second optimizer: its own folder)
            kwargs["log_to"] = [from_spec(spec, index)() for spec in self.log_to]
        try:
            monitor = Monitor(model, select, kinds=self.kinds, every=self.every, store=path,
                              scaler=scaler, meta={"watch": {
                                  "command": list(sys.argv),
                                  "optimizer": type(optimizer).__name__, "index": index}},
                              **kwargs)
        except BaseException:
            if amp is not None:
                amp.remove()
            raise
        detector = None
        if self.detect:
            try:
                detector = detect(model, action="record", scaler=scaler)
            except BaseException:
                monitor.close("failed")
                if amp is not None:
                    amp.remove()
                raise
        watched = _Watched(monitor, detector, path, amp, self.batch_size)
        self.open.append(watched)
        return watched

    def _give_up_on(self, exc: BaseException) -> None:
        self._give_up(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))

    def _give_up(self, exc: Exception) -> None:
        self.failed = True
        self._say(f"stopped watching ({type(exc).__name__}: {exc}); the script goes on")
        self.close()

    def _say(self, message: str) -> None:
        sys.stderr.write(f"gradtap watch: {message}\n")

    def close(self) -> None:
        """Close the Monitors (status ``failed`` after an uncaught exception) and the hooks."""
        if os.getpid() != self.pid:
            return
        error = getattr(sys, "last_value", None)
        status = "failed" if error is not None else "finished"
        self.hooks.remove()
        opened, self.open = self.open, []
        for watched in opened:
            try:
                watched.close(status)
                if error is not None and watched.monitor.rank == 0 and watched.path.is_dir():
                    # why it failed, for the report (the exit code is added by the launcher)
                    set_run_meta(watched.path, error=f"{type(error).__name__}: {error}"[:500])
            except Exception as exc:
                self._say(f"could not close the run in {watched.path} ({exc})")


def _holds(optimizer: torch.optim.Optimizer, ids: frozenset[int]) -> bool:
    return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])


class _Names(list):
    """Select the parameters of one optimizer by their names (shown as such in the run's
    metadata)."""

    def __init__(self, names: list[str], glob: str, index: int) -> None:
        super().__init__(names)
        self.text = f"{glob!r} among the parameters of optimizer {index}"

    def __repr__(self) -> str:
        return self.text


def owner_model(params: list[torch.Tensor]) -> tuple[nn.Module | None, int]:
    """The module whose ``named_parameters()`` name ``params``, and how many of ``params``
    no live module holds.

    The live modules are found once (``gc``); the candidates are the outermost ones (no other
    live module has them as a child), with wrappers taken off (DDP's ``module.``, a compiled
    model's ``_orig_mod.``). The fewest that hold all of ``params`` are kept, largest first:
    one is returned as it is; several are gathered under a module whose children are named
    by their class names.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> model, missing = owner_model(list(net.parameters()))
        >>> model is net, missing
        (True, 0)
    """
    wanted = {id(p) for p in params}
    modules = [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]
    inner = {id(c) for m in modules for c in m.children()}
    roots: dict[int, tuple[nn.Module, set[int]]] = {}
    for m in modules:
        if id(m) in inner:
            continue
        held = {id(p) for p in m.parameters()} & wanted
        if held:
            model = unwrap_model(m)
            roots.setdefault(id(model), (model, held))
    chosen: list[nn.Module] = []
    covered: set[int] = set()
    for model, held in sorted(roots.values(), key=lambda r: -len(r[1])):
        if held - covered:
            chosen.append(model)
            covered |= held
    missing = len(wanted - covered)
    if not chosen:
        return None, missing
    if len(chosen) == 1:
        return chosen[0], missing
    return _Owners(chosen), missing


class _Owners(nn.Module):
    """Several outermost modules under one, each named by its class name (``Encoder``,
    ``Encoder_1``, ...)."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        for m in models:
            name = base = type(m).__name__
            k = 0
            while name in self._modules:
                k += 1
                name = f"{base}_{k}"
            self.add_module(name, m)
