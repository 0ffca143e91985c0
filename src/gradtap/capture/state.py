"""The per-call state machine: a call's slots fill as its hooked nodes run, then make a record.

A :class:`Call` is opened by the forward pre-hook, learns its inputs, outputs and the number
of node hooks it got in the forward hook, collects gradients as those hooks fire in
backward, and is finished (made into a :class:`~gradtap.GradRecord`) when the last of them
fired, or at the end of the backward for a call whose hooked nodes did not all run (an
unused output, a branch cut by the loss). A :class:`Recorder` holds what one tap shares
between its calls: its settings, its listener and the calls touched by the running backward.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gradtap.capture.boundary import Region
from gradtap.capture.engine import OncePerBackward
from gradtap.capture.listener import Listener, overrides
from gradtap.capture.naming import ModuleInfo
from gradtap.capture.replay import stands_aside
from gradtap.record import GradRecord

__all__ = ["Call", "Recorder", "accumulate"]


class Call:
    """Mutable state of one module call until its record is finished."""

    __slots__ = ("info", "index", "grad_inputs", "grad_outputs", "param_grads", "inputs",
                 "outputs", "input_edges", "input_bases", "input_ids", "start", "expected",
                 "remaining", "touched", "last_fire", "out_versions", "fwd_inputs", "param_ids",
                 "view_slots")

    def __init__(self, info: ModuleInfo, index: int) -> None:
        self.info = info
        self.index = index
        self.grad_inputs: dict[str, Tensor | None] = {}
        self.grad_outputs: dict[str, Tensor | None] = {}
        self.param_grads: dict[str, Tensor | None] = info.empty_param_grads.copy()
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.input_edges: dict[tuple[Any, int], str] = {}
        # Edge of the base of a view argument -> (argument key, where the view lies in it).
        self.input_bases: dict[tuple[Any, int], tuple[str, Region]] = {}
        self.input_ids: dict[int, str] = {}  # id of each argument tensor -> its key
        self.start = 0
        self.expected = 0
        self.remaining = 0
        self.touched = False
        self.last_fire = 0
        self.out_versions: list[tuple[str, weakref.ref[Tensor], int]] = []
        self.fwd_inputs: dict[str, Tensor] = {}
        # The parameters the module held when the call began, by id, when they are swapped
        # in for the forward (FSDP2's unsharded parameters); None otherwise.
        self.param_ids: dict[int, str] | None = None
        # View outputs of a base made by the call, read at their own nodes (capture.backward).
        self.view_slots: list[Any] = []


class Recorder:
    """One tap's settings, its listener, and the calls the running backward touched.

    Node hooks hold it by weak reference and check :meth:`live` first: hooks already attached
    to a recorded graph still fire after the tap was removed.
    """

    def __init__(self, listener: Listener | None, on_record: Callable[[GradRecord], None] | None,
                 store: bool, keep_inputs: bool, keep_outputs: bool,
                 to: torch.device | None) -> None:
        self.enabled = True
        self.listener = listener
        self.keep_inputs, self.keep_outputs, self.to = keep_inputs, keep_outputs, to
        self.store = store
        self.records: list[GradRecord] = []
        # The listener's methods, bound once; None where it does not override them.
        bound = {m: getattr(listener, m) if overrides(listener, m) else None
                 for m in ("on_forward", "rewrite_grad_output", "rewrite_grad_input",
                           "rewrite_param_grad", "on_record")}
        self.on_forward = bound["on_forward"]
        self.rewrite_out = bound["rewrite_grad_output"]
        self.rewrite_in = bound["rewrite_grad_input"]
        self.rewrite_param = bound["rewrite_param_grad"]
        self.sinks = [fn for fn in (on_record, bound["on_record"]) if fn is not None]
        self._touched: list[Call] = []
        self._end = OncePerBackward(self._end_of_backward)
        self._fires = itertools.count()

    def live(self) -> bool:
        """Whether hooks must act now: the tap is on and no replay asks it to stand aside."""
        return self.enabled and not stands_aside(self.listener)

    def touch(self, call: Call) -> None:
        """Note that ``call``'s backward started in the running backward."""
        if call.touched:
            return
        call.touched = True
        self._touched.append(call)
        # Calls whose hooked nodes do not all run in this backward (an unused output, a
        # branch cut by the loss) are finished when the backward ends.
        self._end.arm()

    def fired(self, call: Call) -> None:
        """One of ``call``'s hooked nodes ran; finish it if that was the last."""
        call.last_fire = next(self._fires)
        call.remaining -= 1
        if call.remaining <= 0:
            self.finish(call)

    def _end_of_backward(self) -> None:
        pending = sorted((c for c in self._touched if c.touched), key=lambda c: c.last_fire)
        self._touched = []
        for call in pending:
            self.finish(call)

    def finish(self, call: Call) -> None:
        """Make ``call``'s record, hand it on, and make the call ready for another backward."""
        if not call.touched:
            return
        notes: list[str] = []
        for path, ref, version in call.out_versions:
            t = ref()
            if t is not None and t._version != version and t._base is not None:
                notes.append(
                    f"output {path!r} is a view that was modified in place after the call; "
                    "gradient that reached it through that change bypassed this record")
        to = self.to
        rec = GradRecord(
            module_name=call.info.name,
            module_type=call.info.type_name,
            call=call.index,
            grad_inputs=_moved(call.grad_inputs, to),
            grad_outputs=_moved(call.grad_outputs, to),
            param_grads=_moved(call.param_grads, to),
            inputs=call.inputs,
            outputs=call.outputs,
            notes=tuple(notes),
        )
        # Ready for another backward through the same graph (retain_graph=True); the record
        # owns the old slot dicts.
        call.touched = False
        call.remaining = call.expected
        call.grad_inputs = dict.fromkeys(call.grad_inputs)
        call.grad_outputs = dict.fromkeys(call.grad_outputs)
        call.param_grads = call.info.empty_param_grads.copy()
        for slot in call.view_slots:
            slot.reset()
        if self.store:
            self.records.append(rec)
        for sink in self.sinks:
            sink(rec)


def accumulate(current: Tensor | None, grad: Tensor | None) -> Tensor | None:
    """``current + grad`` where both are there (a slot reached twice)."""
    if grad is None:
        return current
    # Keep the very tensor autograd passed (not a detached alias): holding it stops autograd
    # from stealing its storage into .grad and accumulating into it in place later.
    if grad.requires_grad:
        grad = grad.detach()
    return grad if current is None else current + grad


def _moved(slots: dict[str, Tensor | None], to: torch.device | None) -> dict[str, Tensor | None]:
    if to is None:
        return slots
    return {k: (v.to(to) if v is not None else None) for k, v in slots.items()}
