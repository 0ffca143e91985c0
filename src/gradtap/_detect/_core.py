"""The detector: device-side flags in the hooks, one host check per forward and per backward.

By default (``replay=None`` and no ``spike``) a :class:`~gradtap._detect._replay.Screen` watches
each step and this per-call watch only runs on a replay of a step the screen found bad. The
per-call watch itself, used from the start with ``replay=False`` or ``spike=``:

* Forward: after each selected call, ``torch.aminmax`` of every new floating tensor (outputs,
  and inputs not already measured as an earlier call's output) is appended to a list, kept on
  the device. Nothing is synced and no forward tensor is kept (unless ``dump_dir``).
* The *forward check* runs at ``det.check_loss(loss)``, or else when the first record of a
  backward arrives: one stack and one host copy of every min/max of the forward(s) since the
  last check. A forward anomaly found at the start of a backward is emitted (raised) at its
  end, because raising inside a capture hook would leave the capture half-way.
* Backward: each finished :class:`~gradtap.GradRecord` is kept in a list. At the end of the
  backward (an engine callback queued by its first record) the *backward check* takes one
  grouped ``torch._foreach_norm`` over every gradient the records hold and copies it to the
  host once. The L2 norms say which tensors are non-finite and feed the spike EWMA.
  Exception: a record with large CPU gradients is measured as it arrives (reading a CPU
  tensor is no device sync) and kept only if it may be reported, because keeping every
  activation gradient alive until the end makes the CPU allocator fetch fresh memory for
  each later one, which costs more than the check.
* Only if something is non-finite or spiked are exact counts, ranges, messages and dumps made
  (from tensors still alive, kept by ``dump_dir``, or still saved in the autograd graph).

So a healthy step costs two host syncs (one per forward, one per backward), whatever the
number of modules.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from gradtap import _tensorops as ops
from gradtap._detect import _host
from gradtap._detect._anomaly import (
    LOSS,
    Anomaly,
    AnomalyWarning,
    TensorStat,
    Where,
    backward_hints,
    counts_phrase,
    describe_module,
    exact_stat,
    format_lines,
    forward_hints,
    kind_of,
    loss_hints,
    stats_table,
)
from gradtap._detect._dump import write_dump
from gradtap._detect._replay import RootCall, Screen, Suspect
from gradtap._types import Selector
from gradtap.capture import Tap, at_end_of_backward, tap
from gradtap.errors import GradientAnomaly
from gradtap.record import GradRecord, format_table
from gradtap.select import select_modules

__all__ = ["Detector", "detect"]

ActionLiteral = Literal["raise", "warn", "record"]
_ACTIONS = ("raise", "warn", "record")
ScreenLiteral = Literal["model", "modules"]
_SCREENS = ("model", "modules")
#: Measure a record as it arrives when its gradients are on the CPU (no device to sync with)
#: and hold at least ``EAGER_MIN_ELEMENTS`` new elements, so that only records that may be
#: reported keep their gradients alive. Other records are kept until the end of the backward
#: and reduced there, all together (one host copy per device).
EAGER_ON_CPU = True
EAGER_MIN_ELEMENTS = 1 << 15
#: ``replay=None`` means replay when ``spike`` is None (tests switch it off to run the per-call
#: watch on the same cases).
REPLAY_BY_DEFAULT = True
#: What the replay watch screens when ``screen=None`` (tests switch it to run both screens).
DEFAULT_SCREEN: ScreenLiteral = "model"
_graph_task_id = torch._C._current_graph_task_id
_ROLES = (("grad_output", "grad_outputs"), ("grad_input", "grad_inputs"),
          ("param_grad", "param_grads"))


class _FwdCall:
    """One selected forward call: its measured input and output slots (ids into _Measured)."""

    __slots__ = ("name", "call", "ins", "outs", "kept", "fns")

    def __init__(self, name: str, call: int, ins: list[tuple[str, int]],
                 outs: list[tuple[str, int]], kept: dict[str, dict[str, Tensor]] | None,
                 fns: dict[str, Any]) -> None:
        self.name, self.call, self.ins, self.outs, self.kept = name, call, ins, outs, kept
        # The outputs' autograd nodes, until the forward check: an op that saved its result
        # (sqrt, exp, tanh, ...) still holds the output when the tensor object is gone.
        self.fns = fns


class _Measured:
    """Device-side min/max of the forward tensors measured since the last forward check."""

    def __init__(self) -> None:
        # (dtype, device index) -> ([min0, max0, min1, max1, ...], [slot id, ...])
        self.groups: dict[tuple[torch.dtype, int], tuple[list[Tensor], list[int]]] = {}
        self.meta: list[tuple[torch.dtype, torch.Size, int, weakref.ref[Tensor], int]] = []
        self.seen: dict[int, tuple[weakref.ref[Tensor], int, int]] = {}
        self.calls: list[_FwdCall] = []
        self.losses: list[tuple[int, Tensor]] = []
        self.saved: dict[int, list[Tensor]] | None = None  # see _saved_tensors

    def measure(self, t: Tensor) -> int:
        lo, hi = torch.aminmax(t)  # grad mode is off (see _on_forward / check_loss)
        key = (t.dtype, t.get_device())
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = ([], [])
        sid = len(self.meta)
        group[0].extend((lo, hi))
        group[1].append(sid)
        ref = weakref.ref(t)
        version = t._version
        self.meta.append((t.dtype, t.shape, version, ref, t.data_ptr()))
        self.seen[id(t)] = (ref, version, sid)
        return sid


class _Found:
    """An anomaly waiting for its record (the end of the backward) before it is emitted."""

    __slots__ = ("anomaly", "key", "module", "kept")

    def __init__(self, anomaly: Anomaly, key: tuple[str, int] | None, module: nn.Module | None,
                 kept: dict[str, dict[str, Tensor]] | None = None) -> None:
        self.anomaly, self.key, self.module, self.kept = anomaly, key, module, kept


class Detector:
    """Finds where gradients break; see :func:`detect`. Use as a context manager."""

    def __init__(
        self,
        model: nn.Module,
        select: Selector = "*",
        nonfinite: bool = True,
        spike: float | None = None,
        warmup: int = 10,
        action: ActionLiteral = "raise",
        dump_dir: str | os.PathLike[str] | None = None,
        *,
        spike_beta: float = 0.9,
        replay: bool | None = None,
        screen: ScreenLiteral | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"detect() needs an nn.Module; got {type(model).__name__}")
        if action not in _ACTIONS:
            raise ValueError(f"action must be one of {', '.join(map(repr, _ACTIONS))}; "
                             f"got {action!r}")
        if spike is not None and (isinstance(spike, bool) or not isinstance(spike, (int, float))
                                  or not spike > 1.0 or math.isinf(spike)):
            raise ValueError("spike must be None or a finite factor > 1 over the EWMA of a norm "
                             f"(e.g. 10.0); got {spike!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0 (steps before spikes are checked); "
                             f"got {warmup!r}")
        if not (isinstance(spike_beta, (int, float)) and 0.0 <= spike_beta < 1.0):
            raise ValueError(f"spike_beta must be a factor with 0 <= beta < 1; got {spike_beta!r}")
        if not nonfinite and spike is None:
            raise ValueError("nothing to detect: nonfinite=False and spike=None; pass spike=10.0 "
                             "or leave nonfinite=True")
        if replay is not None and not isinstance(replay, bool):
            raise ValueError(f"replay must be None, True or False; got {replay!r}")
        if replay and spike is not None:
            raise ValueError("replay=True cannot watch spikes: a spike needs every module's norms "
                             "at every step; leave replay=None (per-call watch) or set spike=None")
        replays = replay if replay is not None else (spike is None and REPLAY_BY_DEFAULT)
        if screen is not None and screen not in _SCREENS:
            raise ValueError(f"screen must be None, 'model' or 'modules'; got {screen!r}")
        if screen is not None and not replays:
            raise ValueError("screen= chooses what the replay watch screens each step; the "
                             "per-call watch (replay=False, or spike=) checks every selected call "
                             "anyway: leave screen=None")
        self.dump_dir = None if dump_dir is None else os.fspath(dump_dir)
        if self.dump_dir is not None:
            if os.path.exists(self.dump_dir) and not os.path.isdir(self.dump_dir):
                raise ValueError(f"dump_dir={self.dump_dir!r} exists and is not a directory")
            os.makedirs(self.dump_dir, exist_ok=True)
        self.nonfinite = bool(nonfinite)
        self.spike = None if spike is None else float(spike)
        self.warmup = warmup
        self.spike_beta = float(spike_beta)
        self.action: ActionLiteral = action
        self.anomalies: list[Anomaly] = []

        selected = select_modules(model, select)  # raises SelectionError naming close names
        self._model, self._select = model, select
        self._selected = {name for name, _ in selected}
        # The model itself is always watched: its grad_outputs are dL/d(model output), the
        # gradient coming from the loss, and it catches what unselected code does.
        self._watch_root = "" not in self._selected
        self._modules: dict[str, nn.Module] = dict(model.named_modules())
        self._step = 0
        self._skip = False
        self._measured = _Measured()
        self._back: _Backward | None = None  # what the running backward collected
        self._queued_task: int | None = None
        self._found: list[_Found] = []
        self._forward_bad = False
        self._error: BaseException | None = None
        # Host-side min/max of recent forwards, for the report of a backward anomaly.
        self._forward_batches: deque[tuple[list[_FwdCall], np.ndarray, _Measured]] = deque(
            maxlen=16)
        # Spike state: per (module, kind) the step's sum of squared norms and an EWMA.
        self._totals: dict[tuple[str, str], float] = {}
        self._flagged: set[tuple[str, str]] = set()
        self._ewma_index: dict[tuple[str, str], int] = {}
        self._ewma_mean = torch.zeros(0, dtype=torch.float64)
        self._ewma_var = torch.zeros(0, dtype=torch.float64)
        self._ewma_count = np.zeros(0, dtype=np.int64)
        self._ready: list[Anomaly] = []  # found by a replay, dumped, not yet raised or warned
        self._screen: Screen | None = None
        self._tap: Tap | None = None
        if replays:
            by_module = (screen or DEFAULT_SCREEN) == "modules"
            self._screen = Screen(model, selected if by_module else [])
            self._screen.on_backward_end = self._screened_backward
            return
        names = self._selected | ({""} if self._watch_root else set())
        self._tap = tap(
            model, lambda name, module: name in names,
            keep=("inputs", "outputs") if self.dump_dir is not None else (),
            store=False, on_record=self._on_record,
            on_forward=self._on_forward if self.nonfinite else None)

    # -- public -------------------------------------------------------------------------------

    @property
    def steps_done(self) -> int:
        """Number of :meth:`step` calls so far (the current step's number)."""
        return self._step

    def check_loss(self, loss: Tensor) -> Tensor:
        """Have ``loss`` checked with the forward; returns ``loss``.

        A non-finite loss is reported as module ``"<loss>"`` (``where="forward"``) when the
        model's forward was finite. Without it, a non-finite loss is only seen if its gradient
        is non-finite too (``where="grad_output"``).

        The default (replay) watch adds the loss to the step's one check at the end of the
        backward (or at :meth:`step`, :meth:`should_skip`, :meth:`check` when no backward
        comes): no host sync here. The per-call watch (``replay=False``) checks the forward
        and the loss now, before the backward: the forward's one host sync, while every
        forward tensor saved for backward is still there.

        Raises:
            TypeError: ``loss`` is not a tensor.
            GradientAnomaly: with ``action="raise"``, if the forward or the loss is bad.
        """
        if not isinstance(loss, Tensor):
            raise TypeError(f"check_loss() needs a Tensor; got {type(loss).__name__}")
        if self._screen is not None:
            self._screen.add_loss(loss)
        elif self.nonfinite:
            if loss.is_floating_point() and loss.numel():
                m = self._measured
                with torch.no_grad():
                    m.losses.append((m.measure(loss), loss.detach()))
            self._check_forward()
            self._emit()
        return loss

    def should_skip(self) -> bool:
        """True when an anomaly was found since the last :meth:`step`: skip the optimizer step."""
        if self._pending_forward():
            self._check_forward()
            self._emit()
        return self._skip

    def check(self) -> list[Anomaly]:
        """Check now what ran since the last check (e.g. a forward with no backward yet).

        Returns:
            The anomalies found by this call (also appended to :attr:`anomalies`).

        Raises:
            GradientAnomaly: with ``action="raise"``, for the first one.
        """
        before = len(self.anomalies)
        self._check_forward()
        self._emit()
        return self.anomalies[before:]

    def _pending_forward(self) -> bool:
        if self._screen is not None:
            return self._screen.unchecked()
        return bool(self._measured.calls or self._measured.losses)

    def step(self) -> None:
        """Close the current step: check what is pending, update the spike EWMA, advance.

        Call it once per training step, after ``backward()``. Steps count from 0.

        Raises:
            GradientAnomaly: with ``action="raise"``, if a forward without backward was bad
                (the step still advances).
        """
        try:
            self._check_forward()
            screen = self._screen
            if screen is not None and screen.calls and not screen.backward_checked:
                # No backward reached a screened tensor (none ran, or only a loss on an
                # intermediate): the parameter gradients are still checked once.
                suspects = screen.check(backward=True, stale=True)
                if suspects:
                    self._localize(suspects, [])
            self._emit()
        finally:
            self._update_ewma()
            self._totals = {}
            self._flagged = set()
            self._forward_batches.clear()
            self._back = None
            self._queued_task = None
            self._forward_bad = False
            self._skip = False
            if self._tap is not None:
                self._tap.clear()
            if self._screen is not None:
                self._screen.new_step()
            self._step += 1

    def ewma(self, name: str, kind: Literal["param_grad", "grad_output"] = "param_grad"
             ) -> tuple[float, float]:
        """``(mean, var)`` of the spike EWMA of module ``name``'s ``kind`` norm.

        Raises:
            KeyError: no such module/kind has an EWMA yet (``spike=None``, or no step closed).
        """
        i = self._ewma_index.get((name, kind))
        if i is None:
            have = sorted(f"{n}:{k}" for n, k in self._ewma_index)
            raise KeyError(f"no spike EWMA for module {name!r} kind {kind!r}; have: "
                           f"{', '.join(have[:10]) or '(none: pass spike= and call step())'}")
        return float(self._ewma_mean[i]), float(self._ewma_var[i])

    def remove(self) -> None:
        """Remove every hook; the model is left as it was. Safe to call twice."""
        if self._tap is not None:
            self._tap.remove()
        if self._screen is not None:
            self._screen.remove()
        self._back = None
        self._measured = _Measured()

    def __enter__(self) -> Detector:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None:
                self._check_forward()
                self._emit()
        finally:
            self.remove()

    def __repr__(self) -> str:
        return (f"<Detector step={self._step} modules={len(self._selected)} "
                f"anomalies={len(self.anomalies)} action={self.action!r}>")

    # -- hooks (no host sync here) ------------------------------------------------------------

    def _on_forward(self, name: str, call: int, module: nn.Module, inputs: dict[str, Tensor],
                    outputs: dict[str, Tensor]) -> None:
        m = self._measured
        seen = m.seen
        ins: list[tuple[str, int]] = []
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # the measurements must not enter the graph
        try:
            for key, t in inputs.items():
                hit = seen.get(id(t))
                # Reuse an earlier call's measurement of this very tensor unless it changed
                # since; an in-place module changes its input, and the earlier value is the input's.
                if hit is not None and hit[0]() is t and (
                        hit[1] == t._version or any(o is t for o in outputs.values())):
                    ins.append((key, hit[2]))
                elif t.is_floating_point() and t.numel():
                    ins.append((key, m.measure(t)))
            outs = [(key, m.measure(t)) for key, t in outputs.items()
                    if t.is_floating_point() and t.numel()]
        finally:
            torch._C._set_grad_enabled(grad_mode)
        fns = {key: t.grad_fn for key, t in outputs.items()}
        kept = None
        if self.dump_dir is not None:
            kept = {"inputs": {k: t.detach() for k, t in inputs.items()},
                    "outputs": {k: t.detach() for k, t in outputs.items()}}
        m.calls.append(_FwdCall(name, call, ins, outs, kept, fns))

    def _on_record(self, rec: GradRecord) -> None:
        task = _graph_task_id()
        if task != self._queued_task and task != -1:
            # The first record of a backward.
            self._queued_task = task
            self._back = _Backward(cpu=EAGER_ON_CPU and _on_cpu(rec))
            at_end_of_backward(self._end_of_backward)
            try:
                # The forward is complete, and most of its tensors are still alive (saved
                # for backward), so exact counts are usually still possible.
                self._check_forward()
            except BaseException as err:  # noqa: BLE001 - re-raised at the end of the backward
                self._error = err
        back = self._back
        if back is None:
            return
        try:
            self._add_record(rec, back)
        except BaseException as err:  # noqa: BLE001 - re-raised at the end of the backward
            self._error = self._error or err

    def _add_record(self, rec: GradRecord, back: _Backward) -> None:
        new: list[Tensor] = []
        plan = _Plan(rec, back, new)
        back.plans.append(plan)
        if not (back.cpu and sum(t.numel() for t in new) >= EAGER_MIN_ELEMENTS):
            back.tensors += new  # reduced at the end of the backward
            back.norms += [math.nan] * len(new)
            back.finite += [True] * len(new)
            return
        # Large CPU gradients: measure them now (reading a CPU tensor is no device sync) and
        # keep the record only if it may be reported. Keeping every record would keep every
        # activation gradient alive until the end, and on CPU fresh memory for each later
        # gradient costs more than this check.
        with torch.no_grad():
            norms = _host.norms(new, host=True)
        fin = np.isfinite(norms)
        for i in np.flatnonzero(~fin):  # an L2 norm can overflow: look at the tensor
            fin[i] = bool(torch.isfinite(new[i]).all())
        back.tensors += [None] * len(new)
        back.norms += norms.tolist()
        back.finite += fin.tolist()
        idx = [j for _, j in (*plan.outs, *plan.ins, *plan.params)]
        if any(back.tensors[j] is not None or not back.finite[j] for j in idx):
            return  # holds a non-finite gradient, or one measured only at the end: keep
        if self.spike is not None and self._might_spike(plan, back):
            return
        plan.rec = None

    def _might_spike(self, plan: _Plan, back: _Backward) -> bool:
        """Whether this record pushes a norm of its module over the spike threshold."""
        hit = False
        for kind, idx in (("grad_output", [j for _, j in plan.outs]), ("param_grad", plan.direct)):
            if not idx:
                continue
            key = (plan.name, kind)
            add = sum(back.norms[j] ** 2 for j in idx)  # all measured: see _add_record
            back.partial[key] = back.partial.get(key, 0.0) + add
            j = self._ewma_index.get(key)
            if j is None or self._ewma_count[j] < max(self.warmup, 1):
                continue
            total = self._totals.get(key, 0.0) + back.partial[key]
            hit = hit or math.sqrt(total) > self.spike * float(self._ewma_mean[j])  # type: ignore[operator]
        return hit

    def _end_of_backward(self) -> None:
        back, self._back = self._back, None
        self._queued_task = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if back is not None:
            self._check_backward(back)
        self._emit()

    # -- the replay watch (see _replay.py) --------------------------------------------------

    def _screen_forward(self) -> None:
        assert self._screen is not None
        suspects = self._screen.check()
        if suspects:
            self._localize(suspects, [])

    def _screened_backward(self, backward: list[RootCall]) -> None:
        """End of a backward that reached a screened output: one check, a replay if bad."""
        assert self._screen is not None
        if not any(c.reported for c in backward):  # else: consequences of a reported forward
            suspects = self._screen.check(backward=True)
            if suspects:
                self._localize(suspects, backward)
        self._emit()

    def _localize(self, suspects: list[Suspect], backward: list[RootCall]) -> None:
        """Replay the step under a per-call watch to find where the suspects came from.

        A bad loss is checked after a replay of the forward alone: its gradient would only
        repeat it."""
        assert self._screen is not None
        loss = next((s.tensor for s in suspects if s.where == "loss"), None)
        if loss is not None:
            backward = []
        watch = Detector(self._model, self._select, warmup=self.warmup, action="record",
                         dump_dir=self.dump_dir, replay=False)
        watch._step = self._step
        watch.anomalies = list(self.anomalies)  # dump files keep counting
        start = len(watch.anomalies)
        failure: BaseException | None = None
        try:
            self._screen.replay(watch._tap, backward)  # type: ignore[arg-type]
            if loss is not None:
                watch.check_loss(loss)
            else:
                watch.check()
        except Exception as err:  # noqa: BLE001 - reported with the screen's evidence below
            failure = err
        finally:
            watch.remove()
        found = watch.anomalies[start:]
        first = suspects[0]
        if found and first.where == "forward" and (found[0].where != "forward"
                                                   or found[0].module_name == LOSS):
            # The screen saw a module's output go bad, the replay did not (state changed
            # since the call): the screen's evidence is the better report.
            for a in found:
                if a.dump_path is not None and os.path.exists(a.dump_path):
                    os.remove(a.dump_path)
            found = []
        # One event per step: later checks of this step would see its consequences.
        self._screen.quiet_params = True
        for call in self._screen.calls:
            call.reported = True
        if found:
            self.anomalies.extend(found)
            self._ready.extend(found)
        else:
            self._found.append(self._unreproduced(suspects, failure))

    def _unreproduced(self, suspects: list[Suspect], failure: BaseException | None) -> _Found:
        """An anomaly from the screen's own evidence, when the replay did not show its origin."""
        s = suspects[0]  # forward first, then the loss, gradients, parameter gradients
        if s.where == "param_grad":
            name, _, slot = s.key.rpartition(".")
            where: Where = "param_grad"
            what = f"the gradient of parameter {slot!r}"
        elif s.where == "loss":
            name, slot, where, what = LOSS, "loss", "forward", "the loss value"
        elif s.where == "grad_input":
            name, slot, where = s.module, s.key, "grad_input"
            what = f"dL/d(input {slot!r})"
        else:
            name, slot = s.module, s.key
            where = "forward" if s.where == "forward" else "grad_output"
            what = f"output {slot!r}" if where == "forward" else f"dL/d(output {slot!r})"
        module = None if name == LOSS else self._modules.get(name)
        type_name = "loss" if name == LOSS else type(module).__name__
        if s.tensor is not None:
            stat: TensorStat | None = exact_stat(s.tensor, s.where, slot)
            kind = kind_of(stat)  # type: ignore[arg-type]
        else:
            stat, kind = None, "nan" if s.nan else "inf"
        label = LOSS if name == LOSS else describe_module(name, type_name, None,
                                                          name in self._selected)
        why = (f"the replay failed ({type(failure).__name__}: {failure})" if failure is not None
               else "running the step's forward and backward again did not reproduce it")
        counts = f"it {counts_phrase(stat)}; " if stat is not None else ""
        if where == "forward" and name == "":
            seen = ("the model's output (the screen watches the model's outputs, not each "
                    "module's: gt.detect(..., screen='modules') screens every selected call)")
        else:
            seen = {"forward": "the first selected call, in the order calls finished, whose "
                               "output was non-finite (its inputs and parameters were not "
                               "checked: code of an enclosing module may have made the value "
                               "before this call)",
                    "grad_output": "the first gradient the screen saw non-finite, in backward "
                                   "order",
                    "grad_input": "the first gradient the screen saw non-finite, in backward "
                                  "order",
                    }.get(where, "what the screen saw after the backward")
        head = (f"{'NaN' if kind == 'nan' else 'Inf'} found at step {self._step} in {what} of "
                f"{label}: {counts}{why}, so this reports {seen}.")
        hint = ("the forward may depend on state other than buffers and the RNG, a kernel may "
                "not be deterministic, or the gradient entered the model other than through its "
                "outputs (a loss on an intermediate tensor, an earlier backward accumulated into "
                ".grad); gt.detect(..., replay=False) watches every selected call as it runs")
        body = [*(stats_table([stat]) if stat is not None else []), f"hint: {hint}"]
        anomaly = Anomaly(
            module_name=name, kind=kind, where=where, step=self._step, record=None,
            message=format_lines(head, body), module_type=type_name, slot=slot, call=None,
            nan=None if stat is None else stat.nan, inf=None if stat is None else stat.inf,
            numel=None if s.tensor is None else s.tensor.numel())
        return _Found(anomaly, None, module)

    # -- the forward check --------------------------------------------------------------------

    def _check_forward(self) -> None:
        if self._screen is not None:
            if self._screen.unchecked():
                self._screen_forward()
            return
        m = self._measured
        if not m.calls and not m.losses:
            return
        self._measured = _Measured()
        with torch.no_grad():
            groups = list(m.groups.values())
            host = _host.to_host([torch.stack(vals) for vals, _ in groups])  # this forward's one sync
        m.groups = {}
        mm = np.empty((len(m.meta), 2))
        for (_, sids), arr in zip(groups, host):
            mm[sids] = arr.reshape(-1, 2)
        finite = np.isfinite(mm).all(axis=1)
        self._forward_batches.append((m.calls, mm, m))
        if finite.all():
            for c in m.calls:
                c.kept = None
                c.fns = {}
            return
        found = self._forward_origin(m, mm, finite)
        if found is None and m.losses:
            found = self._loss_origin(m, mm, finite)
        if found is not None:
            self._found.append(found)
            self._forward_bad = True
        for c in m.calls:
            c.kept = None  # only the bad call's forward tensors outlive the check
            c.fns = {}

    def _forward_origin(self, m: _Measured, mm: np.ndarray, finite: np.ndarray) -> _Found | None:
        calls = m.calls
        cands = [c for c in calls
                 if all(finite[s] for _, s in c.ins) and not all(finite[s] for _, s in c.outs)]
        cands = _innermost(cands, lambda c: c.name)
        if cands:
            c = cands[0]
            module = self._modules[c.name]
            params = [exact_stat(p, "param", n) for n, p in module.named_parameters()]
            bad_params = [s for s in params if not s.finite]
            if bad_params:
                return self._forward_found(m, mm, c, bad_params[0], params, "param")
            key, sid = next((k, s) for k, s in c.outs if not finite[s])
            return self._forward_found(m, mm, c, self._slot_stat(m, mm, sid, "output", key, c),
                                       params, "output")
        arrived = [c for c in calls if not all(finite[s] for _, s in c.ins)]
        if not arrived:
            return None
        preferred = [c for c in arrived if c.name in self._selected] or arrived
        c = preferred[0]
        key, sid = next((k, s) for k, s in c.ins if not finite[s])
        params = [exact_stat(p, "param", n) for n, p in self._modules[c.name].named_parameters()]
        return self._forward_found(m, mm, c, self._slot_stat(m, mm, sid, "input", key, c),
                                   params, "input")

    def _forward_found(self, m: _Measured, mm: np.ndarray, c: _FwdCall, bad: TensorStat,
                       params: list[TensorStat], role: str) -> _Found:
        module = self._modules[c.name]
        type_name = type(module).__name__
        ins = [self._slot_stat(m, mm, s, "input", k, c) for k, s in c.ins]
        outs = [self._slot_stat(m, mm, s, "output", k, c) for k, s in c.outs]
        kind = kind_of(bad)
        label = describe_module(c.name, type_name, c.call, c.name in self._selected)
        what = "NaN" if kind == "nan" else "Inf"
        if role == "param":
            head = (f"{what} in parameter {bad.key!r} of {label} at step {self._step}: it "
                    f"{counts_phrase(bad)} before this forward.")
            hints = ["an earlier optimizer step applied a non-finite gradient (or the weights "
                     "were loaded that way): skip such steps with det.should_skip()"]
        elif role == "input":
            head = (f"{what} arrived in the forward of {label} at step {self._step}: input "
                    f"{bad.key!r} {counts_phrase(bad)} when it was called, and no selected module "
                    "before it made it.")
            hints = ["check the data (torch.isfinite(x).all()) and the code that runs before "
                     "this module outside the selected modules"]
        else:
            head = (f"{what} in the forward of {label} at step {self._step}: output "
                    f"{bad.key!r} {counts_phrase(bad)}, while all its inputs and parameters "
                    "were finite.")
            hints = forward_hints(kind, ins, outs, params)
        body = ["forward tensors and parameters (ranges of finite elements):",
                *stats_table([*ins, *outs, *params[:20]])]
        if len(params) > 20:
            body.append(f"  ... {len(params) - 20} more parameters")
        body += [f"hint: {h}" for h in hints]
        slot_key = bad.key
        anomaly = Anomaly(
            module_name=c.name, kind=kind, where="forward", step=self._step, record=None,
            message=format_lines(head, body), module_type=type_name, slot=slot_key,
            call=c.call, nan=bad.nan, inf=bad.inf, numel=math.prod(bad.shape))
        return _Found(anomaly, (c.name, c.call), module, c.kept)

    def _loss_origin(self, m: _Measured, mm: np.ndarray, finite: np.ndarray) -> _Found | None:
        for sid, loss in m.losses:
            if finite[sid]:
                continue
            stat = exact_stat(loss, "loss", "loss")
            kind = kind_of(stat)
            value = f" = {float(loss):.4g}" if loss.numel() == 1 else ""
            head = (f"{'NaN' if kind == 'nan' else 'Inf'} in the loss{value} at step "
                    f"{self._step}: it {counts_phrase(stat)}, while every selected module's "
                    "forward was finite.")
            body = [*stats_table([stat]),
                    *(f"hint: {h}" for h in loss_hints(outputs_finite=bool(m.calls)))]
            anomaly = Anomaly(
                module_name=LOSS, kind=kind, where="forward", step=self._step, record=None,
                message=format_lines(head, body), module_type="loss", slot="loss",
                call=None, nan=stat.nan, inf=stat.inf, numel=loss.numel())
            return _Found(anomaly, None, None)
        return None

    def _slot_stat(self, m: _Measured, mm: np.ndarray, sid: int, role: str, key: str,
                   c: _FwdCall) -> TensorStat:
        """Exact stats if the tensor is still alive (or kept), else the min/max measured."""
        dtype, shape, version, ref, ptr = m.meta[sid]
        t = ref()
        if t is None and c.kept is not None:
            t = c.kept["inputs" if role == "input" else "outputs"].get(key)
        if t is None and any(c.fns for c in m.calls):
            # Gone from Python, but often still held by the graph (saved for backward).
            if m.saved is None:
                m.saved = _saved_tensors(
                    [fn for c in m.calls for fn in c.fns.values() if fn is not None])
            t = next((x for x in m.saved.get(ptr, ()) if x.shape == shape and x.dtype == dtype),
                     None)
        # Exact only if it still holds the values measured (not changed in place since).
        if t is not None and t.shape == shape and t._version == version:
            return exact_stat(t, role, key)
        lo, hi = float(mm[sid, 0]), float(mm[sid, 1])
        zero = 0 if math.isfinite(lo) and math.isfinite(hi) else None  # finite: counts known
        return TensorStat(role, key, dtype, tuple(shape), lo, hi, zero, zero)

    # -- the backward check -------------------------------------------------------------------

    def _check_backward(self, back: _Backward) -> None:
        if self._forward_bad:
            # A forward (or loss) anomaly: this backward's non-finite values are its
            # consequence. Attach the records to it if not emitted yet; check nothing.
            self._forward_bad = False
            by_key = {(p.name, p.call): p.rec for p in back.plans if p.rec is not None}
            self._found = [_Found(replace(f.anomaly, record=by_key.get(f.key, f.anomaly.record)),
                                  f.key, f.module, f.kept) for f in self._found]
            return
        pending = [j for j, t in enumerate(back.tensors) if t is not None]
        if pending:
            tensors = [back.tensors[j] for j in pending]
            with torch.no_grad():
                norms = _host.norms(tensors)  # this backward's one sync
            fin = np.isfinite(norms)
            for i in np.flatnonzero(~fin):  # an L2 norm can overflow: look at the tensor
                fin[i] = bool(torch.isfinite(tensors[i]).all())
            for j, v, f in zip(pending, norms.tolist(), fin.tolist()):
                back.norms[j], back.finite[j] = v, f
        back.tensors = []
        if not back.plans or not back.norms:
            return
        norms = np.array(back.norms)
        finite = np.array(back.finite, dtype=bool)
        if self.nonfinite and not finite.all():
            found = self._backward_origin(back.plans, finite)
            if found is not None:
                self._found.append(found)
                return
        if self.spike is not None:
            self._spikes(back.plans, norms, finite)

    def _backward_origin(self, plans: list[_Plan], finite: np.ndarray) -> _Found | None:
        bad_out: list[_Plan] = []
        bad_in: list[_Plan] = []
        for p in plans:
            if not all(finite[j] for _, j in p.outs):
                bad_out.append(p)
            elif not all(finite[j] for _, j in p.ins) or not all(finite[j] for _, j in p.params):
                bad_in.append(p)
        root = [p for p in bad_out if p.name == ""]
        if root:
            return self._loss_gradient_found(root[0])
        cands = _innermost(bad_in, lambda p: p.name)
        if cands:
            p = cands[0]
            key = next((k for k, j in p.ins if not finite[j]), None)
            if key is not None:
                return self._backward_found(p, "grad_input", key, arrived=False)
            key = next(k for k, j in p.params if not finite[j])
            return self._backward_found(p, "param_grad", key, arrived=False)
        if bad_out:
            p = next((p for p in bad_out if p.name in self._selected), bad_out[0])
            key = next(k for k, j in p.outs if not finite[j])
            return self._backward_found(p, "grad_output", key, arrived=True)
        return None

    def _backward_found(self, plan: _Plan, where: Where, key: str, arrived: bool) -> _Found:
        rec = plan.rec
        assert rec is not None  # kept: it holds a non-finite gradient
        grads = _record_stats(rec)
        bad = next(s for s in grads if s.role == where and s.key == key)
        kind = kind_of(bad)
        module = self._modules[rec.module_name]
        label = describe_module(rec.module_name, rec.module_type, rec.call,
                                rec.module_name in self._selected)
        what = "NaN" if kind == "nan" else "Inf"
        slot_word = {"grad_input": "the gradient it sends to input",
                     "param_grad": "its gradient for parameter",
                     "grad_output": "dL/d(output)"}[where]
        fwd_in, fwd_out = self._forward_stats(rec.module_name, rec.call)
        if arrived:
            head = (f"{what} arrived in the backward of {label} at step {self._step}: "
                    f"{slot_word} {key!r} {counts_phrase(bad)}, and no selected module after it "
                    "made it: it comes from code between this module's output and the loss.")
            hints = ["look at the functional code after this module (outside the selected "
                     "modules), or select more modules"]
        else:
            head = (f"{what} in the backward of {label} at step {self._step}: {slot_word} "
                    f"{key!r} {counts_phrase(bad)}, while its grad_outputs were finite.")
            hints = backward_hints(kind, fwd_in, grads)
        params = [exact_stat(p, "param", n) for n, p in module.named_parameters()][:20]
        body = ["gradients of this call (ranges of finite elements):", *_grad_table(grads)]
        if fwd_in or fwd_out or params:
            body += ["forward tensors and parameters (ranges of finite elements):",
                     *stats_table([*fwd_in, *fwd_out, *params])]
        body += [f"hint: {h}" for h in hints]
        anomaly = Anomaly(
            module_name=rec.module_name, kind=kind, where=where, step=self._step, record=rec,
            message=format_lines(head, body), module_type=rec.module_type, slot=key,
            call=rec.call, nan=bad.nan, inf=bad.inf, numel=math.prod(bad.shape))
        return _Found(anomaly, (rec.module_name, rec.call), module)

    def _loss_gradient_found(self, plan: _Plan) -> _Found:
        rec = plan.rec
        assert rec is not None  # kept: it holds a non-finite gradient
        grads = [s for s in _record_stats(rec) if s.role == "grad_output"]
        bad = next(s for s in grads if not s.finite)
        kind = kind_of(bad)
        head = (f"{'NaN' if kind == 'nan' else 'Inf'} in the gradient of the loss at step "
                f"{self._step}: dL/d(model output {bad.key!r}) {counts_phrase(bad)} while the "
                "model's forward was finite: the loss function's backward made it.")
        fwd_in, fwd_out = self._forward_stats(rec.module_name, rec.call)
        body = ["gradient entering the model (range of finite elements):", *_grad_table(grads)]
        if fwd_out:
            body += ["model outputs:", *stats_table(fwd_out)]
        body.append("hint: the loss has an infinite derivative at these outputs (sqrt or pow "
                    "at 0, log at 0, a division by 0); add an epsilon or use a stable loss "
                    "(F.cross_entropy, F.binary_cross_entropy_with_logits); det.check_loss(loss) "
                    "also checks the loss value")
        anomaly = Anomaly(
            module_name=LOSS, kind=kind, where="grad_output", step=self._step, record=rec,
            message=format_lines(head, body), module_type="loss", slot=bad.key, call=None,
            nan=bad.nan, inf=bad.inf, numel=math.prod(bad.shape))
        return _Found(anomaly, None, None)

    def _forward_stats(self, name: str, call: int) -> tuple[list[TensorStat], list[TensorStat]]:
        for calls, mm, m in reversed(self._forward_batches):
            for c in calls:
                if c.name == name and c.call == call:
                    return ([self._slot_stat(m, mm, s, "input", k, c) for k, s in c.ins],
                            [self._slot_stat(m, mm, s, "output", k, c) for k, s in c.outs])
        return [], []

    # -- spikes -------------------------------------------------------------------------------

    def _spikes(self, plans: list[_Plan], norms: np.ndarray, finite: np.ndarray) -> None:
        sq = (np.where(finite, norms, 0.0) ** 2).tolist()
        fin = finite.tolist()
        totals, flagged, selected = self._totals, self._flagged, self._selected
        touched: list[tuple[int, str, str]] = []
        seen: set[tuple[str, str]] = set()
        for i, p in enumerate(plans):
            name = p.name
            if name not in selected:
                continue
            for kind, idx in (("grad_output", [j for _, j in p.outs]), ("param_grad", p.direct)):
                if not idx:
                    continue
                key = (name, kind)
                if not all(fin[j] for j in idx):
                    flagged.add(key)  # a non-finite norm never feeds the EWMA
                    continue
                if key not in seen:
                    seen.add(key)
                    touched.append((i, name, kind))
                total = totals.get(key, 0.0)
                for j in idx:
                    total += sq[j]
                totals[key] = total
        spiking: list[tuple[int, str, str, float, float]] = []
        for i, name, kind in touched:
            key = (name, kind)
            j = self._ewma_index.get(key)
            if j is None or key in self._flagged or self._ewma_count[j] < max(self.warmup, 1):
                continue
            value = math.sqrt(self._totals[key])
            limit = self.spike * float(self._ewma_mean[j])  # type: ignore[operator]
            if value > limit:
                spiking.append((i, name, kind, value, limit))
        if not spiking:
            return
        for _, name, kind, _, _ in spiking:
            self._flagged.add((name, kind))
        first = _innermost(spiking, lambda s: s[1])[0]
        kinds = [s for s in spiking if s[1] == first[1]]
        # The grad_output spike is the cause of a param_grad spike of the same module.
        kinds.sort(key=lambda s: s[2] != "grad_output")
        # The report shows the module's last kept record of this backward.
        held = [p for p in plans if p.name == first[1] and p.rec is not None]
        self._found.append(self._spike_found(held[-1] if held else plans[first[0]], kinds))

    def _spike_found(self, plan: _Plan, kinds: list[tuple[int, str, str, float, float]]
                     ) -> _Found:
        _, name, kind, value, limit = kinds[0]
        rec = plan.rec
        label = describe_module(name, plan.type_name, plan.call, True)
        if kind == "grad_output":
            slot = ",".join(k for k, _ in plan.outs)
            what = "output-gradient norm"
        else:
            slot = ",".join(k for k, _ in plan.params if "." not in k)
            what = "parameter-gradient norm"
        j = self._ewma_index[(name, kind)]
        mean = float(self._ewma_mean[j])
        head = (f"Gradient spike in {label} at step {self._step}: its {what} ({slot}) is "
                f"{value:.4g}, {value / mean if mean > 0 else math.inf:.3g}x its EWMA {mean:.4g} "
                f"(threshold spike={self.spike:g} x EWMA = {limit:.4g}).")
        body = [f"also: {'output-gradient' if k == 'grad_output' else 'parameter-gradient'} "
                f"norm {v:.4g} > {lim:.4g}" for _, _, k, v, lim in kinds[1:]]
        if rec is not None:
            body += ["gradients of this call (ranges of finite elements):",
                     *_grad_table(_record_stats(rec))]
        body.append("hint: a spike in dL/d(output) comes from the modules after this one (or the "
                    "loss); one in the parameter gradient alone from this module's inputs. "
                    "Skip the step (det.should_skip()), clip gradients, or lower the learning rate")
        anomaly = Anomaly(
            module_name=name, kind="spike", where=kind,  # type: ignore[arg-type]
            step=self._step, record=rec, message=format_lines(head, body),
            module_type=plan.type_name, slot=slot, call=plan.call, nan=0, inf=0,
            value=value, threshold=limit)
        return _Found(anomaly, (name, plan.call), self._modules[name])

    def _update_ewma(self) -> None:
        if self.spike is None or not self._totals:
            return
        values = np.full(len(self._ewma_index), np.nan)
        new: dict[tuple[str, str], float] = {}
        for key, total in self._totals.items():
            if key in self._flagged:
                continue  # spiking or non-finite values never feed the EWMA
            j = self._ewma_index.get(key)
            if j is None:
                new[key] = math.sqrt(total)
            else:
                values[j] = math.sqrt(total)
        present = np.flatnonzero(~np.isnan(values))
        if len(present) == len(values):  # the usual step: every norm is there, update in place
            ops.ewma_update_(self._ewma_mean, self._ewma_var, torch.from_numpy(values),
                             self.spike_beta)
            self._ewma_count += 1
        elif len(present):
            idx = torch.from_numpy(present)
            mean, var = self._ewma_mean[idx], self._ewma_var[idx]
            ops.ewma_update_(mean, var, torch.from_numpy(values[present]), self.spike_beta)
            self._ewma_mean[idx] = mean
            self._ewma_var[idx] = var
            self._ewma_count[present] += 1
        if new:
            mean, var = ops.ewma_init(torch.tensor(list(new.values()), dtype=torch.float64))
            for key in new:
                self._ewma_index[key] = len(self._ewma_index)
            self._ewma_mean = torch.cat([self._ewma_mean, mean])
            self._ewma_var = torch.cat([self._ewma_var, var])
            self._ewma_count = np.concatenate([self._ewma_count, np.ones(len(new), np.int64)])

    # -- emitting -----------------------------------------------------------------------------

    def _emit(self) -> None:
        found, self._found = self._found, []
        new, self._ready = self._ready, []  # a replay's: in self.anomalies and dumped already
        for f in found:
            anomaly = f.anomaly
            if self.dump_dir is not None:
                anomaly = write_dump(self.dump_dir, anomaly, len(self.anomalies), f.module, f.kept)
            self.anomalies.append(anomaly)
            new.append(anomaly)
        if not new:
            return
        self._skip = True
        if self.action == "raise":
            raise GradientAnomaly(new[0].message, new[0])
        if self.action == "warn":
            for a in new:
                warnings.warn(a.message, AnomalyWarning, stacklevel=3)


def detect(
    model: nn.Module,
    select: Selector = "*",
    nonfinite: bool = True,
    spike: float | None = None,
    warmup: int = 10,
    action: ActionLiteral = "raise",
    dump_dir: str | os.PathLike[str] | None = None,
    *,
    spike_beta: float = 0.9,
    replay: bool | None = None,
    screen: ScreenLiteral | None = None,
) -> Detector:
    """Find where gradients break: the module where a NaN/Inf first appears, and spikes.

    Lasts across steps: call ``det.step()`` once per training step, after ``backward()``.
    What is reported (one anomaly per event, at its origin, the innermost module):

    * forward: the first selected call, in the order calls finish, whose output holds
      NaN/Inf while all its floating inputs and parameters were finite (``where="forward"``,
      slot = output key). A parameter that is already non-finite is reported as the slot; a
      non-finite value arriving from outside the selected modules at the first module that
      received it (slot = input key).
    * the loss, as module ``"<loss>"``: with ``det.check_loss(loss)`` when its value is
      non-finite (``where="forward"``), and always when dL/d(model output) is non-finite
      (``where="grad_output"``).
    * backward (only if the forward and loss were finite): the first module, in backward
      order, whose ``grad_inputs`` or ``param_grads`` hold NaN/Inf while its ``grad_outputs``
      were finite.
    * spikes (``spike=``): a module's direct parameter-gradient norm or grad-output norm,
      over all its calls in the step, above ``spike`` times its EWMA (factor ``spike_beta``,
      DESIGN.md's formula) once that EWMA has ``warmup`` steps. Spiking, NaN and Inf values
      do not update the EWMA; after a spike, later modules in the same backward are not
      reported for it.

    Two ways to watch (``replay=``):

    * **replay** (the default when ``spike`` is None): a light screen, then a replay. Each
      step the screen reduces on the device the model's outputs, the loss given to
      ``check_loss``, the gradients reaching the model's outputs and leaving its inputs, and
      every parameter gradient, and reads them in one host copy at the end of the backward;
      nothing else is hooked and no record is made. ``screen="modules"`` also screens every
      selected call's outputs and the gradients reaching them (small tensors by reference, all
      at once): slower, but it also sees a NaN/Inf that vanishes before it reaches any
      parameter gradient, such as the Inf gradient of a sqrt at 0 that a ReLU before it masks
      (harmless to that step's update, so the default screen lets it pass). Only when
      something is non-finite is the step's forward and backward run again, with the same
      arguments, RNG and autocast state and the very gradients that reached the model's
      outputs, under the per-call watch below, which names the origin. The replay restores
      buffers and RNG state, leaves ``.grad`` alone, and other taps do not see it. It cannot
      replay a forward that depends on other state or a gradient entering the model other
      than through its outputs: such an anomaly is still reported, from what the screen saw,
      saying so.
    * **per-call watch** (``replay=False``, and always with ``spike``): every selected call
      is captured as it runs (device-side min/max of forward tensors, norms of every
      gradient of its record), with two host syncs per step: one for the forward (at
      ``det.check_loss(loss)``, else when the backward starts) and one when the backward
      ends. Slower, but the model never runs twice.

    Forward tensors are kept only with ``dump_dir``.

    Args:
        model: the model to watch (the model itself is always watched too, to see the loss's
            gradient and what unselected code does).
        select: which modules may be reported (glob, list, class, predicate).
        nonfinite: look for NaN/Inf.
        spike: factor over the EWMA that makes a spike (e.g. ``10.0``); ``None``: off.
        warmup: steps of EWMA before a norm is checked for spikes.
        action: ``"raise"`` :class:`~gradtap.GradientAnomaly` (from ``backward()`` or
            ``step()``), ``"warn"`` (:class:`AnomalyWarning`) or ``"record"`` silently.
        dump_dir: write one dump file per anomaly there (see :func:`load_dump`).
        spike_beta: EWMA factor for spikes.
        replay: ``None``: replay when ``spike`` is None, else the per-call watch; ``False``:
            the per-call watch (for a forward with side effects that must not run twice);
            ``True``: replay (not with ``spike``).
        screen: what the replay watch screens each step: ``"model"`` (the default) or
            ``"modules"`` (every selected call too); only with the replay watch.

    Returns:
        A :class:`Detector`: ``.anomalies``, ``.step()``, ``.should_skip()``,
        ``.check_loss(loss)``, ``.check()``, ``.ewma(name, kind)``, ``.remove()``.

    Raises:
        SelectionError: ``select`` matched no module.
        ValueError: a bad ``action``, ``spike``, ``warmup``, ``dump_dir``, ``replay`` or
            ``screen``, ``replay=True`` with ``spike``, or ``screen`` with the per-call watch.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> with gt.detect(net, action="record") as det:
        ...     net[0].bias.data[1] = float("nan")
        ...     net(torch.randn(2, 4)).sum().backward()
        ...     skip = det.should_skip()
        ...     det.step()
        >>> a = det.anomalies[0]
        >>> (a.module_name, a.kind, a.where, a.slot, skip)
        ('0', 'nan', 'forward', 'bias', True)
    """
    return Detector(model, select, nonfinite, spike, warmup, action, dump_dir,
                    spike_beta=spike_beta, replay=replay, screen=screen)


# -- helpers -------------------------------------------------------------------------------


def _innermost(items: Sequence[Any], name_of: Any) -> list[Any]:
    """Drop items whose module is an ancestor of another item's module (order kept)."""
    names = {name_of(x) for x in items}
    if len(names) < 2:
        return list(items)

    def ancestor(name: str) -> bool:
        prefix = name + "."
        return any(n != name and (name == "" or n.startswith(prefix)) for n in names)

    return [x for x in items if not ancestor(name_of(x))]


class _Backward:
    """What one backward collected: a plan per record and the norms of its gradients.

    Gradient ``j`` has ``norms[j]``/``finite[j]`` once measured; until then (deferred to the
    end of the backward) ``tensors[j]`` holds it.
    """

    __slots__ = ("cpu", "plans", "tensors", "index", "norms", "finite", "partial", "n")

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu
        self.plans: list[_Plan] = []
        self.tensors: list[Tensor | None] = []
        self.index: dict[int, tuple[weakref.ref[Tensor], int]] = {}
        self.norms: list[float] = []
        self.finite: list[bool] = []
        self.partial: dict[tuple[str, str], float] = {}  # squared norms so far (spikes)
        self.n = 0

    def slots(self, slots: dict[str, Tensor | None], new: list[Tensor]) -> list[tuple[str, int]]:
        """``(key, index)`` of each gradient; a tensor seen before keeps its index (one
        module's grad_input is often the next one's grad_output); new ones go to ``new``."""
        out = []
        for key, g in slots.items():
            if g is None:
                continue
            hit = self.index.get(id(g))
            if hit is not None and hit[0]() is g:
                out.append((key, hit[1]))
                continue
            if not _host.measurable(g):
                continue
            j = self.n
            self.n += 1
            self.index[id(g)] = (weakref.ref(g), j)
            new.append(g)
            out.append((key, j))
        return out


class _Plan:
    """Where one record's gradients are in its backward's norms; the record if kept."""

    __slots__ = ("name", "type_name", "call", "outs", "ins", "params", "direct", "rec")

    def __init__(self, rec: GradRecord, back: _Backward, new: list[Tensor]) -> None:
        self.name, self.type_name, self.call = rec.module_name, rec.module_type, rec.call
        self.rec: GradRecord | None = rec
        self.outs = back.slots(rec.grad_outputs, new)
        self.ins = back.slots(rec.grad_inputs, new)
        self.params = back.slots(rec.param_grads, new)
        # The module's own parameters (no "." in the name) are what a spike compares.
        self.direct = [j for k, j in self.params if "." not in k]


def _on_cpu(rec: GradRecord) -> bool:
    for slots in (rec.grad_outputs, rec.param_grads, rec.grad_inputs):
        for g in slots.values():
            if g is not None:
                return g.is_cpu
    return True


def _saved_tensors(roots: list[Any], limit: int = 5000) -> dict[int, list[Tensor]]:
    """Tensors saved for backward by the graph behind ``roots``, by ``data_ptr()``.

    Only used to report exact counts once something is wrong. A saved tensor behind an unpack
    hook is left out: what its hook returns is a new tensor, not the one measured (an
    activation checkpoint recomputes it, an offload copies it back), and reading it can use up
    what the backward needs (a non-reentrant checkpoint unpacks each saved tensor once per
    backward).
    """
    found: dict[int, list[Tensor]] = {}
    seen: set[Any] = set()
    stack = list(roots)
    while stack and len(seen) < limit:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                if _behind_unpack_hook(node, attr):
                    continue
                value = getattr(node, attr)
            except Exception:  # noqa: BLE001 - freed, or modified in place since
                continue
            for x in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(x, Tensor) and x.layout == torch.strided:
                    found.setdefault(x.data_ptr(), []).append(x)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


def _behind_unpack_hook(node: Any, attr: str) -> bool:
    """Whether reading ``node.<attr>`` (a ``_saved_*`` attribute) would run an unpack hook.

    A torch whose saved tensors do not tell (no ``unpack_hook``) is trusted only where an
    unpack cannot use up anything: outside a backward and outside a ``GraphExecGroup``.
    """
    raw = getattr(node, "_raw" + attr, None)
    if raw is None:  # not a saved tensor (a size, a scalar), or freed
        return False
    unknown = object()
    for r in raw if isinstance(raw, (tuple, list)) else (raw,):
        hook = getattr(r, "unpack_hook", unknown)
        if hook is unknown:
            group = getattr(torch._C, "_get_graph_exec_group", lambda: None)()
            return _graph_task_id() != -1 or group is not None
        if hook is not None:
            return True
    return False


def _record_stats(rec: GradRecord) -> list[TensorStat]:
    return [exact_stat(g, role, key) for role, attr in _ROLES
            for key, g in getattr(rec, attr).items() if g is not None]


def _grad_table(stats: Sequence[TensorStat]) -> list[str]:
    rows = []
    for s in stats:
        n = math.prod(s.shape)
        rows.append([s.role, repr(s.key), str(s.dtype).removeprefix("torch."),
                     "[" + ", ".join(map(str, s.shape)) + "]", f"{s.min:.4g}", f"{s.max:.4g}",
                     str(s.nan), str(s.inf), str(n)])
    header = ["gradient", "key", "dtype", "shape", "min", "max", "NaN", "Inf", "elements"]
    return ["  " + line for line in format_table(header, rows)]
