"""The per-call watch: device-side flags per selected call, one host check per forward and backward.

It is a :class:`~gradtap.capture.Listener` of its own tap (``gt.detect(..., replay=False)``,
with ``spike=``, and on a replay of a step the screen found bad):

* Forward: after each selected call, ``torch.aminmax`` of every new floating tensor (outputs,
  and inputs not already measured as an earlier call's output) is appended to a list, kept on
  the device. Nothing is synced and no forward tensor is kept (unless ``keep_forward``).
* The *forward check* runs at ``det.check_loss(loss)``, or else when the first record of a
  backward arrives: one stack and one host copy of every min/max of the forward(s) since the
  last check. A forward anomaly found at the start of a backward is emitted (raised) at its
  end, because raising inside a capture hook would leave the capture half-way.
* Backward: each finished :class:`~gradtap.GradRecord` is kept in a list. At the end of the
  backward the *backward check* takes one grouped ``torch._foreach_norm`` over every gradient
  the records hold and copies it to the host once. The L2 norms say which tensors are
  non-finite and feed the spike tracker. Exception (``WatchOptions.eager_on_cpu``): a record
  with large CPU gradients is measured as it arrives (reading a CPU tensor is no device sync)
  and kept only if it may be reported, because keeping every activation gradient alive until
  the end makes the CPU allocator fetch fresh memory for each later one, which costs more
  than the check.
* Only if something is non-finite or spiked are exact counts, ranges and messages made (from
  tensors still alive, kept, or still saved in the autograd graph), as :class:`Found` items
  in :attr:`CallWatch.found` for the detector to emit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from gradtap._detect import _host
from gradtap._detect._anomaly import TensorStat, Where, exact_stat
from gradtap._detect._measure import Backward, FwdCall, Measured, Plan, innermost, on_cpu
from gradtap._detect._messages import (
    Found,
    backward_anomaly,
    forward_anomaly,
    loss_anomaly,
    loss_gradient_anomaly,
    record_stats,
    spike_anomaly,
)
from gradtap._detect._spikes import SpikeTracker
from gradtap.capture import (
    Listener,
    OncePerBackward,
    compat,
    graph_nodes,
    saved_tensors,
    session,
    tap,
)
from gradtap.record import GradRecord

__all__ = ["CallWatch", "WatchOptions"]


@dataclass(frozen=True)
class WatchOptions:
    """How the per-call watch measures records (defaults suit training; tests vary them).

    Attributes:
        eager_on_cpu: measure a record as it arrives when its gradients are on the CPU and
            hold at least ``eager_min_elements`` new elements, so that only records that may
            be reported keep their gradients alive. Other records are kept until the end of
            the backward and reduced there, all together (one host copy per device).
        eager_min_elements: see ``eager_on_cpu``.
    """

    eager_on_cpu: bool = True
    eager_min_elements: int = 1 << 15


class CallWatch(Listener):
    """The per-call watch of ``selected`` (plus the model itself: its grad_outputs are the
    loss's gradient, and it catches what unselected code does); see the module docstring."""

    def __init__(self, model: nn.Module, selected: list[tuple[str, nn.Module]], *,
                 nonfinite: bool = True, keep_forward: bool = False,
                 spikes: SpikeTracker | None = None, options: WatchOptions | None = None,
                 step: int = 0) -> None:
        self.nonfinite, self.keep_forward, self.spikes = nonfinite, keep_forward, spikes
        self.options = options or WatchOptions()
        self.step = step
        self.found: list[Found] = []
        #: When a list: every backward's plans are appended to it (a spike replay reads them).
        self.plans: list[Plan] | None = None
        #: Called at the end of each backward, after its check (the detector emits there).
        self.on_backward_end: Callable[[], None] | None = None
        self.selected = {name for name, _ in selected}
        self._modules: dict[str, nn.Module] = dict(session(model).root.named_modules())
        self._measured = Measured()
        self._back: Backward | None = None  # what the running backward collected
        self._end = OncePerBackward(self._end_of_backward)
        self._forward_bad = False
        self._error: BaseException | None = None
        # Host-side min/max of recent forwards, for the report of a backward anomaly.
        self._forward_batches: deque[tuple[list[FwdCall], np.ndarray, Measured]] = deque(
            maxlen=16)
        names = self.selected | {""}
        self._tap = tap(model, lambda name, module: name in names,
                        keep=("inputs", "outputs") if keep_forward else (), store=False,
                        listener=self)

    # -- what the detector calls --------------------------------------------------------------

    def add_loss(self, loss: Tensor) -> None:
        """Check ``loss`` with the forward (before the forward check)."""
        if loss.is_floating_point() and loss.numel():
            m = self._measured
            with torch.no_grad():
                m.losses.append((m.measure(loss), loss.detach()))

    def pending_forward(self) -> bool:
        """Whether measured forward tensors wait for a check."""
        return bool(self._measured.calls or self._measured.losses)

    def new_step(self, step: int) -> None:
        """Forget the closed step (``det.step()``); ``step`` is the new one."""
        self._forward_batches.clear()
        self._back = None
        self._end.reset()
        self._forward_bad = False
        self._tap.clear()
        self.step = step

    def remove(self) -> None:
        self._tap.remove()
        self._back = None
        self._measured = Measured()

    # -- the listener (no host sync here) -------------------------------------------------------

    def on_forward(self, name: str, call: int, module: nn.Module, inputs: dict[str, Tensor],
                   outputs: dict[str, Tensor]) -> None:
        if not self.nonfinite:
            return
        m = self._measured
        seen = m.seen
        ins: list[tuple[str, int]] = []
        grad_mode = torch.is_grad_enabled()
        compat.set_grad_enabled(False)  # the measurements must not enter the graph
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
            compat.set_grad_enabled(grad_mode)
        kept = None
        if self.keep_forward:
            kept = {"inputs": {k: t.detach() for k, t in inputs.items()},
                    "outputs": {k: t.detach() for k, t in outputs.items()}}
        m.calls.append(FwdCall(name, call, ins, outs, kept, graph_nodes(outputs.values())))

    def on_record(self, record: GradRecord) -> None:
        if self._end.arm():
            # The first record of a backward.
            self._back = Backward(cpu=self.options.eager_on_cpu and on_cpu(record))
            try:
                # The forward is complete, and most of its tensors are still alive (saved
                # for backward), so exact counts are usually still possible.
                self.check_forward()
            except BaseException as err:  # noqa: BLE001 - re-raised at the end of the backward
                self._error = err
        back = self._back
        if back is None:
            return
        try:
            self._add_record(record, back)
        except BaseException as err:  # noqa: BLE001 - re-raised at the end of the backward
            self._error = self._error or err

    def _add_record(self, rec: GradRecord, back: Backward) -> None:
        new: list[Tensor] = []
        plan = Plan(rec, back, new)
        back.plans.append(plan)
        if not (back.cpu and sum(t.numel() for t in new) >= self.options.eager_min_elements):
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
        if self.spikes is not None and self.spikes.might_spike(plan, back):
            return
        plan.rec = None

    def _end_of_backward(self) -> None:
        back, self._back = self._back, None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if back is not None:
            self.check_backward(back)
        if self.on_backward_end is not None:
            self.on_backward_end()

    # -- the forward check --------------------------------------------------------------------

    def check_forward(self) -> None:
        """Check the forward tensors (and losses) measured since the last check: one host copy."""
        m = self._measured
        if not m.calls and not m.losses:
            return
        self._measured = Measured()
        with torch.no_grad():
            groups = list(m.groups.values())
            host = _host.to_host([torch.stack(vals) for vals, _ in groups])  # this forward's one sync
        m.groups = {}
        mm = np.empty((len(m.meta), 2))
        for (_, sids), arr in zip(groups, host):
            mm[sids] = arr.reshape(-1, 2)
        finite = cast(np.ndarray, np.isfinite(mm).all(axis=1))
        self._forward_batches.append((m.calls, mm, m))
        if finite.all():
            for c in m.calls:
                c.kept = None
                c.nodes = []
            return
        found = self._forward_origin(m, mm, finite)
        if found is None and m.losses:
            found = self._loss_origin(finite, m)
        if found is not None:
            self.found.append(found)
            self._forward_bad = True
        for c in m.calls:
            c.kept = None  # only the bad call's forward tensors outlive the check
            c.nodes = []

    def _forward_origin(self, m: Measured, mm: np.ndarray, finite: np.ndarray) -> Found | None:
        calls = m.calls
        cands = [c for c in calls
                 if all(finite[s] for _, s in c.ins) and not all(finite[s] for _, s in c.outs)]
        cands = innermost(cands, lambda c: c.name)
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
        preferred = [c for c in arrived if c.name in self.selected] or arrived
        c = preferred[0]
        key, sid = next((k, s) for k, s in c.ins if not finite[s])
        params = [exact_stat(p, "param", n) for n, p in self._modules[c.name].named_parameters()]
        return self._forward_found(m, mm, c, self._slot_stat(m, mm, sid, "input", key, c),
                                   params, "input")

    def _forward_found(self, m: Measured, mm: np.ndarray, c: FwdCall, bad: TensorStat,
                       params: list[TensorStat], role: str) -> Found:
        module = self._modules[c.name]
        ins = [self._slot_stat(m, mm, s, "input", k, c) for k, s in c.ins]
        outs = [self._slot_stat(m, mm, s, "output", k, c) for k, s in c.outs]
        anomaly = forward_anomaly(self.step, c.name, c.call, type(module).__name__,
                                  c.name in self.selected, bad, ins, outs, params, role)
        return Found(anomaly, (c.name, c.call), module, c.kept)

    def _loss_origin(self, finite: np.ndarray, m: Measured) -> Found | None:
        for sid, loss in m.losses:
            if not finite[sid]:
                return Found(loss_anomaly(self.step, loss, outputs_finite=bool(m.calls)),
                             None, None)
        return None

    def _slot_stat(self, m: Measured, mm: np.ndarray, sid: int, role: str, key: str,
                   c: FwdCall) -> TensorStat:
        """Exact stats if the tensor is still alive (or kept), else the min/max measured."""
        dtype, shape, version, ref, ptr = m.meta[sid]
        t = ref()
        if t is None and c.kept is not None:
            t = c.kept["inputs" if role == "input" else "outputs"].get(key)
        if t is None and any(c.nodes for c in m.calls):
            # Gone from Python, but often still held by the graph (saved for backward).
            if m.saved is None:
                m.saved = saved_tensors([n for c in m.calls for n in c.nodes])
            t = next((x for x in m.saved.get(ptr, ()) if x.shape == shape and x.dtype == dtype),
                     None)
        # Exact only if it still holds the values measured (not changed in place since).
        if t is not None and t.shape == shape and t._version == version:
            return exact_stat(t, role, key)
        lo, hi = float(mm[sid, 0]), float(mm[sid, 1])
        zero = 0 if math.isfinite(lo) and math.isfinite(hi) else None  # finite: counts known
        return TensorStat(role, key, dtype, tuple(shape), lo, hi, zero, zero)

    # -- the backward check -------------------------------------------------------------------

    def check_backward(self, back: Backward) -> None:
        """Check what one backward collected: one host copy of the norms not measured yet."""
        if self._forward_bad:
            # A forward (or loss) anomaly: this backward's non-finite values are its
            # consequence. Attach the records to it if not emitted yet; check nothing.
            self._forward_bad = False
            by_key: dict[Any, GradRecord | None] = {
                (p.name, p.call): p.rec for p in back.plans if p.rec is not None}
            self.found = [Found(replace(f.anomaly, record=by_key.get(f.key, f.anomaly.record)),
                                f.key, f.module, f.kept) for f in self.found]
            return
        pending = [j for j, t in enumerate(back.tensors) if t is not None]
        if pending:
            tensors = [t for t in back.tensors if t is not None]  # in the order of pending
            with torch.no_grad():
                norms = _host.norms(tensors)  # this backward's one sync
            fin = np.isfinite(norms)
            for i in np.flatnonzero(~fin):  # an L2 norm can overflow: look at the tensor
                fin[i] = bool(torch.isfinite(tensors[i]).all())
            for j, v, f in zip(pending, norms.tolist(), fin.tolist()):
                back.norms[j], back.finite[j] = v, f
        back.tensors = []
        if self.plans is not None:
            self.plans += back.plans
        if not back.plans or not back.norms:
            return
        norms = np.array(back.norms)
        finite = np.array(back.finite, dtype=bool)
        if self.nonfinite and not finite.all():
            found = self._backward_origin(back.plans, finite)
            if found is not None:
                self.found.append(found)
                return
        if self.spikes is not None:
            hit = self.spikes.check(back.plans, norms, finite, self.selected)
            if hit is not None:
                self.found.append(self._spike_found(back.plans, *hit))

    def _backward_origin(self, plans: list[Plan], finite: np.ndarray) -> Found | None:
        bad_out: list[Plan] = []
        bad_in: list[Plan] = []
        for p in plans:
            if not all(finite[j] for _, j in p.outs):
                bad_out.append(p)
            elif not all(finite[j] for _, j in p.ins) or not all(finite[j] for _, j in p.params):
                bad_in.append(p)
        root = [p for p in bad_out if p.name == ""]
        if root:
            rec = root[0].rec
            assert rec is not None  # kept: it holds a non-finite gradient
            _, fwd_out = self._forward_stats(rec.module_name, rec.call)
            return Found(loss_gradient_anomaly(self.step, rec, fwd_out), None, None)
        cands = innermost(bad_in, lambda p: p.name)
        if cands:
            p = cands[0]
            key = next((k for k, j in p.ins if not finite[j]), None)
            if key is not None:
                return self._backward_found(p, "grad_input", key, arrived=False)
            key = next(k for k, j in p.params if not finite[j])
            return self._backward_found(p, "param_grad", key, arrived=False)
        if bad_out:
            p = next((p for p in bad_out if p.name in self.selected), bad_out[0])
            key = next(k for k, j in p.outs if not finite[j])
            return self._backward_found(p, "grad_output", key, arrived=True)
        return None

    def _backward_found(self, plan: Plan, where: Where, key: str, arrived: bool) -> Found:
        rec = plan.rec
        assert rec is not None  # kept: it holds a non-finite gradient
        module = self._modules[rec.module_name]
        fwd_in, fwd_out = self._forward_stats(rec.module_name, rec.call)
        params = [exact_stat(p, "param", n) for n, p in module.named_parameters()][:20]
        anomaly = backward_anomaly(self.step, rec, rec.module_name in self.selected, where, key,
                                   arrived, record_stats(rec), fwd_in, fwd_out, params)
        return Found(anomaly, (rec.module_name, rec.call), module)

    def _spike_found(self, plans: list[Plan], index: int, kinds: list) -> Found:
        assert self.spikes is not None and self.spikes.spike is not None
        name, kind = kinds[0][1], kinds[0][2]
        # The report shows the module's last kept record of this backward.
        held = [p for p in plans if p.name == name and p.rec is not None]
        plan = held[-1] if held else plans[index]
        anomaly = spike_anomaly(self.step, plan, kinds, self.spikes.baseline(name, kind),
                                self.spikes.spike)
        return Found(anomaly, (name, plan.call), self._modules[name])

    def _forward_stats(self, name: str, call: int) -> tuple[list[TensorStat], list[TensorStat]]:
        for calls, mm, m in reversed(self._forward_batches):
            for c in calls:
                if c.name == name and c.call == call:
                    return ([self._slot_stat(m, mm, s, "input", k, c) for k, s in c.ins],
                            [self._slot_stat(m, mm, s, "output", k, c) for k, s in c.outs])
        return [], []
