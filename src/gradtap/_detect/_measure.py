"""What the per-call watch measures: forward min/max on the device, and each backward's gradients."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from gradtap._detect import _host
from gradtap.record import GradRecord

__all__ = ["Backward", "FwdCall", "Measured", "Plan", "innermost", "on_cpu"]

T = TypeVar("T")


class FwdCall:
    """One selected forward call: its measured input and output slots (ids into Measured)."""

    __slots__ = ("name", "call", "ins", "outs", "kept", "nodes")

    def __init__(self, name: str, call: int, ins: list[tuple[str, int]],
                 outs: list[tuple[str, int]], kept: dict[str, dict[str, Tensor]] | None,
                 nodes: list[Any]) -> None:
        self.name, self.call, self.ins, self.outs, self.kept = name, call, ins, outs, kept
        # The outputs' autograd nodes (capture.graph_nodes), until the forward check: an op
        # that saved its result (sqrt, exp, tanh, ...) still holds the output when the tensor
        # object is gone.
        self.nodes = nodes


class Measured:
    """Device-side min/max of the forward tensors measured since the last forward check."""

    def __init__(self) -> None:
        # (dtype, device index) -> ([min0, max0, min1, max1, ...], [slot id, ...])
        self.groups: dict[tuple[torch.dtype, int], tuple[list[Tensor], list[int]]] = {}
        self.meta: list[tuple[torch.dtype, torch.Size, int, weakref.ref[Tensor], int]] = []
        self.seen: dict[int, tuple[weakref.ref[Tensor], int, int]] = {}
        self.calls: list[FwdCall] = []
        self.losses: list[tuple[int, Tensor]] = []
        self.saved: dict[int, list[Tensor]] | None = None  # capture.saved_tensors, when needed

    def measure(self, t: Tensor) -> int:
        lo, hi = torch.aminmax(t)  # grad mode is off (see the watch's on_forward / add_loss)
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


class Backward:
    """What one backward collected: a plan per record and the norms of its gradients.

    Gradient ``j`` has ``norms[j]``/``finite[j]`` once measured; until then (deferred to the
    end of the backward) ``tensors[j]`` holds it.
    """

    __slots__ = ("cpu", "plans", "tensors", "index", "norms", "finite", "partial", "n")

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu
        self.plans: list[Plan] = []
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


class Plan:
    """Where one record's gradients are in its backward's norms; the record if kept."""

    __slots__ = ("name", "type_name", "call", "outs", "ins", "params", "direct", "rec")

    def __init__(self, rec: GradRecord, back: Backward, new: list[Tensor]) -> None:
        self.name, self.type_name, self.call = rec.module_name, rec.module_type, rec.call
        self.rec: GradRecord | None = rec
        self.outs = back.slots(rec.grad_outputs, new)
        self.ins = back.slots(rec.grad_inputs, new)
        self.params = back.slots(rec.param_grads, new)
        # The module's own parameters (no "." in the name) are what a spike compares.
        self.direct = [j for k, j in self.params if "." not in k]


def on_cpu(rec: GradRecord) -> bool:
    """Whether the record's gradients are on the CPU (judged by its first one)."""
    for slots in (rec.grad_outputs, rec.param_grads, rec.grad_inputs):
        for g in slots.values():
            if g is not None:
                return g.is_cpu
    return True


def innermost(items: Sequence[T], name_of: Callable[[T], str]) -> list[T]:
    """Drop items whose module is an ancestor of another item's module (order kept): the
    origin of an event is the innermost module that saw it."""
    names = {name_of(x) for x in items}
    if len(names) < 2:
        return list(items)

    def ancestor(name: str) -> bool:
        prefix = name + "."
        return any(n != name and (name == "" or n.startswith(prefix)) for n in names)

    return [x for x in items if not ancestor(name_of(x))]
