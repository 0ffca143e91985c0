"""The backward side of a call: node hooks that fill its slots and apply the listener's rewrites.

Each hook holds its tap's :class:`~gradtap.capture.state.Recorder` by weak reference and does
nothing unless it is live (the tap may be removed while its graph is alive, or a replay of
another consumer may run).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor

from gradtap.capture.boundary import Region
from gradtap.capture.graph import INPUT_REGION, PARAM
from gradtap.capture.state import Call, Recorder, accumulate

__all__ = ["ViewGroup", "ViewSlot", "base_prehook", "boundary_sink", "guard_sink", "node_posthook",
           "output_prehook", "view_node_prehook", "view_sink"]

RecorderRef = weakref.ref[Recorder]


def output_prehook(rec_ref: RecorderRef, call: Call, entries: list[tuple[int, str]]) -> Callable:
    """A pre-hook on a node that made outputs of ``call``: sees (and may rewrite) dL/d(output)."""

    def prehook(grad_outputs: tuple) -> tuple | None:
        rec = rec_ref()
        if rec is None or not rec.live():
            return None
        rec.touch(call)
        new = list(grad_outputs)
        for nr, path in entries:
            g = grad_outputs[nr]
            if g is not None:
                r = rec.rewrite_out(call.info.name, call.index, path, g)  # type: ignore[misc]
                if r is not None:
                    check_like(r, g, f"rewrite of grad_output {path!r} of {call.info.name!r}")
                    new[nr] = g = r
            call.grad_outputs[path] = accumulate(call.grad_outputs[path], g)
        rec.fired(call)
        return tuple(new)

    return prehook


def base_prehook(rec_ref: RecorderRef, call: Call, entries: list[tuple[int, str, Region]]
                 ) -> Callable:
    """A pre-hook on the node of the base of view outputs: each view's region of its gradient."""

    def prehook(grad_outputs: tuple) -> None:
        rec = rec_ref()
        if rec is None or not rec.live():
            return
        rec.touch(call)
        for nr, path, region in entries:
            g = grad_outputs[nr]
            if g is not None:
                call.grad_outputs[path] = accumulate(call.grad_outputs[path], region.of(g))
        rec.fired(call)

    return prehook


def boundary_sink(rec_ref: RecorderRef, call: Call, path: str, credit: Any
                  ) -> Callable[[Tensor], Tensor]:
    """The backward of a boundary node or alias of output ``path``. ``credit`` is what the
    call also sent that gradient to, as the node now stands in its way: an input key,
    ``(PARAM, name)``, or the bypassed nodes of the call's view ops (the first the view's
    own) with the input key of each edge of the last."""
    name = call.info.name

    def sink(g: Tensor) -> Tensor:
        rec = rec_ref()
        if rec is None or not rec.live():
            return g
        rec.touch(call)
        if rec.rewrite_out is not None:
            r = rec.rewrite_out(name, call.index, path, g)
            if r is not None:
                check_like(r, g, f"rewrite of grad_output {path!r} of {name!r}")
                g = r
        call.grad_outputs[path] = accumulate(call.grad_outputs[path], g)
        _credit(call, credit, g)
        rec.fired(call)
        return g

    return sink


def _credit(call: Call, credit: Any, g: Tensor) -> None:
    """Credit ``g`` (an output's gradient) to what the boundary node bypassed: an input key,
    ``(PARAM, name)``, or the call's view ops with the input key of each edge of the last."""
    if isinstance(credit, str):
        call.grad_inputs[credit] = accumulate(call.grad_inputs[credit], g)
    elif credit is not None and credit[0] == PARAM:
        call.param_grads[credit[1]] = accumulate(call.param_grads[credit[1]], g)
    elif credit is not None:
        nodes, keys = credit
        for key, gi in zip(keys, _through(nodes, g)):
            if key is not None:
                call.grad_inputs[key] = accumulate(call.grad_inputs[key], gi)


class ViewGroup:
    """View outputs of one base the call made, each with a boundary node: the base's own
    guard node (an in-place identity put on the base after theirs) sees every later gradient
    that does not come through the views' own nodes (later uses of the base, uses after an
    in-place op on it or on a view of it). ``exact`` is False where no guard could be put."""

    __slots__ = ("exact", "foreign")

    def __init__(self) -> None:
        self.exact = False
        self.foreign: Tensor | None = None


class ViewSlot:
    """One view output of a :class:`ViewGroup`: the gradient its own node (the node later uses
    of the view reach) received, and where it lies in the base."""

    __slots__ = ("group", "region", "direct")

    def __init__(self, group: ViewGroup, region: Region) -> None:
        self.group, self.region = group, region
        self.direct: Tensor | None = None

    def reset(self) -> None:
        self.direct = None
        self.group.foreign = None


def view_node_prehook(rec_ref: RecorderRef, slot: ViewSlot) -> Callable:
    """A pre-hook on the node later uses of a view output reach: dL/d(view) from those uses."""

    def prehook(grad_outputs: tuple) -> None:
        rec = rec_ref()
        if rec is not None and rec.live():
            slot.direct = accumulate(slot.direct, grad_outputs[0])

    return prehook


def guard_sink(rec_ref: RecorderRef, group: ViewGroup) -> Callable[[Tensor], Tensor]:
    """The backward of a :class:`ViewGroup`'s guard node: notes the gradient w.r.t. the base."""

    def sink(g: Tensor) -> Tensor:
        rec = rec_ref()
        if rec is not None and rec.live():
            group.foreign = accumulate(group.foreign, g)
        return g

    return sink


def view_sink(rec_ref: RecorderRef, call: Call, path: str, slot: ViewSlot, credit: Any
              ) -> Callable[[Tensor], Tensor]:
    """The backward of the boundary node of view output ``path`` of a :class:`ViewGroup`.

    Its base's ``CopySlices`` node calls it with the view's region of every gradient that
    reached the base after the view's boundary, also when the view itself was never used (a
    region of zeros) and including its siblings' overlapping uses. The slot is instead what
    the view's own node received, plus its region of what the guard saw (None when neither);
    without a guard, the region as given. ``credit`` is as for :func:`boundary_sink` (the
    bypassed view ops of a view of a tensor made before the call).
    """

    def sink(g: Tensor) -> Tensor:
        rec = rec_ref()
        if rec is None or not rec.live():
            return g
        rec.touch(call)
        if slot.group.exact:
            foreign = slot.group.foreign
            value = accumulate(slot.direct, None if foreign is None else slot.region.of(foreign))
            slot.direct = None
        else:
            value = g
        call.grad_outputs[path] = accumulate(call.grad_outputs[path], value)
        if value is not None:
            _credit(call, credit, value)
        rec.fired(call)
        return g

    return sink


def node_posthook(rec_ref: RecorderRef, call: Call, out_entries: tuple, edge_entries: tuple
                  ) -> Callable:
    """A post-hook on a node of ``call``: the gradients it sends into the call's inputs and
    parameters (rewritten if asked), and the outputs it made (``out_entries``)."""
    name = call.info.name

    def posthook(grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
        rec = rec_ref()
        if rec is None or not rec.live():
            return None
        rec.touch(call)
        for nr, path in out_entries:
            call.grad_outputs[path] = accumulate(call.grad_outputs[path], grad_outputs[nr])
        new = None
        for i, kind, key in edge_entries:
            g = grad_inputs[i]
            if g is None:
                continue
            if kind == PARAM:
                if rec.rewrite_param is not None:
                    r = rec.rewrite_param(name, call.index, key, g)
                    if r is not None:
                        check_like(r, g, f"rewrite of parameter {key!r} of {name!r}")
                        new = new or list(grad_inputs)
                        new[i] = g = r
                call.param_grads[key] = accumulate(call.param_grads[key], g)
                continue
            region = None
            if kind == INPUT_REGION:  # the base of a view argument modified in place
                key, region = key
                part = region.of(g)
            else:
                part = g
            if rec.rewrite_in is not None:
                r = rec.rewrite_in(name, call.index, key, part)
                if r is not None:
                    check_like(r, part, f"rewrite of grad_input {key!r} of {name!r}")
                    new = new or list(grad_inputs)
                    new[i] = r if region is None else region.replaced(g, r)
                    part = r
            call.grad_inputs[key] = accumulate(call.grad_inputs[key], part)
        rec.fired(call)
        return tuple(new) if new is not None else None

    return posthook


def _through(nodes: Any, g: Tensor) -> tuple:
    """``g`` carried back through ``nodes`` (each called on the first gradient the one before
    returned): the last one's gradients, one per edge."""
    grads: tuple = (g,)
    for node in nodes:
        out = node(grads[0])
        grads = (out,) if isinstance(out, Tensor) else tuple(out)
    return grads


def check_like(new: Any, old: Tensor, what: str) -> None:
    """Raise unless a rewrite returned a tensor like the gradient it replaces."""
    if not isinstance(new, Tensor):
        raise TypeError(f"{what} returned {type(new).__name__}; expected a Tensor or None")
    if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
        raise ValueError(
            f"{what} returned shape {tuple(new.shape)}, {new.dtype}, {new.device}; expected "
            f"shape {tuple(old.shape)}, {old.dtype}, {old.device} like the gradient it replaces"
        )
