"""The closed form of a shared call: a lookup or a table read without the batch, met by it later.

A call of an owner with a rule whose input is not computed from the batch (``membership``:
positions ``arange(T)`` looked up in an Embedding, a parameter or buffer table read by a norm
or a Linear) has an output gradient summed over the samples, so its own record cannot split
it. But its output ``o`` is shared only until it meets the batch: at a broadcasting ``add``,
``sub`` or ``mul`` with a tensor computed from the batch, ``r = x + o`` has one row per
sample, and sample n's gradient of ``o`` is ``r``'s output gradient at row n (times the
other factor for a ``mul``), summed over the other broadcast dims. A view of ``o`` that only
adds leading dims of size 1 (``o[None]``) meets the batch as ``o`` would. That is what a hook on
``r`` keeps (:meth:`Shared.meet`); the rule then gets it as the output gradient of the call,
with the call's input expanded along the batch dim, instead of a replay of an enclosing call.

Nothing of the forward changes: ``r`` is computed as it was, and the hook only reads its
gradient. The answer is used only when it is the whole gradient: where every meeting of
``o`` was seen, the kept gradients summed over the samples equal the call's recorded output
gradient (compared at the end of the backward, :meth:`Shared.incomplete`); a use of ``o``
elsewhere (another op, a view of it, a shared op before the meeting) fails that, and the
parameters are replayed as before.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from gradtap._samples.membership import MULS, SUBS, Membership
from gradtap._samples.owners import Owner
from gradtap._samples.units import mismatches
from gradtap.capture import HookSet
from gradtap.record import GradRecord

__all__ = ["Shared"]



@dataclass(eq=False)
class _Watch:
    """One shared call's output, waiting to meet the batch."""

    key: tuple[str, int]  # (owner name, call)
    n: int  # the batch size
    shape: tuple[int, ...] | None = None  # o padded with leading 1s, N at batch_dim
    grads: list[Tensor] = field(default_factory=list)  # this backward's, one per meeting seen


class Shared:
    """The shared calls of one forward group and their per-sample output gradients."""

    def __init__(self, membership: Membership, hooks: HookSet, batch_dim: int) -> None:
        self._membership, self._hooks, self._bd = membership, hooks, batch_dim
        self._attr = f"{membership.attr}_shared"
        self._watches: dict[tuple[str, int], _Watch] = {}
        self._answered: dict[str, int] = {}  # qual -> calls answered in this backward
        self._rows: dict[str, tuple[Tensor, Tensor, None]] = {}
        self._quals: dict[str, list[str]] = {}  # row key -> the quals it answered

    def new_group(self) -> None:
        """A new forward group: the watched outputs are from the last one."""
        self._watches = {}

    def new_backward(self) -> None:
        """Forget the gradients the last backward kept."""
        for w in self._watches.values():
            w.grads = []
        self._answered, self._rows, self._quals = {}, {}, {}

    # -- forward side -----------------------------------------------------------------------

    def watch(self, owner: Owner, call: int, inputs: dict[str, Tensor],
              outputs: dict[str, Tensor], n: int | None) -> None:
        """Call ``call`` of ``owner`` ran in a batch of ``n``: watch its output if its input
        is shared."""
        m = self._membership
        if (owner.rule is None or not m.following or not inputs or not outputs or not n
                or owner.parametrized):
            return
        inp, out = next(iter(inputs.values())), next(iter(outputs.values()))
        if m.holds_samples(inp) or m.holds_samples(out) or not out.requires_grad:
            return
        w = _Watch((owner.name, call), n)
        try:
            setattr(out, self._attr, w)
        except (AttributeError, RuntimeError):  # a tensor type without a __dict__
            return
        self._watches[w.key] = w
        m.report_meetings(self.meet, self.view)

    def view(self, args: tuple, out: Any) -> None:
        """An op that got no batched tensor ran: a view of a watched output with leading
        dims of size 1 added (``o[None]``, ``o.unsqueeze(0)``: the same elements in the same
        order) is watched as the output itself."""
        o = args[0]
        w = getattr(o, self._attr, None) if isinstance(o, Tensor) else None
        if not isinstance(w, _Watch) or not isinstance(out, Tensor) or out is o:
            return
        k = out.dim() - o.dim()
        if (k <= 0 or out.shape[k:] != o.shape or any(d != 1 for d in out.shape[:k])
                or out.stride()[k:] != o.stride() or out.data_ptr() != o.data_ptr()):
            return
        try:
            setattr(out, self._attr, w)
        except (AttributeError, RuntimeError):
            pass

    def meet(self, name: str, args: tuple, kwargs: dict[str, Any] | None, out: Any) -> None:
        """``name`` (one of ``membership.MEETS``) got a batched tensor: if the other operand is a
        watched output broadcast along the batch dim, keep its per-sample gradient."""
        if len(args) != 2 or not isinstance(out, Tensor):
            return
        attr = self._attr
        found = [(i, getattr(a, attr, None)) for i, a in enumerate(args) if isinstance(a, Tensor)]
        ws = [(i, w) for i, w in found if isinstance(w, _Watch)]
        if len(found) != 2 or len(ws) != 1:
            return
        i, w = ws[0]
        if self._watches.get(w.key) is not w or self._membership.holds_samples(args[i]):
            return
        n, bd, o = w.n, self._bd, args[i]
        in_place = name.endswith("_") and not name.startswith("__") or name.startswith("__i")
        if (out.dim() <= bd or out.shape[bd] != n or o.dim() > out.dim()
                or (in_place and (i == 0 or name in MULS))):
            return
        padded = (1,) * (out.dim() - o.dim()) + tuple(o.shape)
        if padded[bd] != 1 or (w.shape is not None and len(w.shape) != len(padded)):
            return
        shape = padded[:bd] + (n,) + padded[bd + 1:]
        factor = _factor(name, i, kwargs)
        if factor is None:
            return
        other = args[1 - i] if name in MULS else None
        w.shape = shape
        self._hooks.gradient(out, _keep, (w, shape, factor, other))

    # -- backward side ----------------------------------------------------------------------

    def record(self, owner: Owner, rec: GradRecord) -> GradRecord | None:
        """The record of a watched call with the per-sample output gradient its meetings
        kept (and its input expanded along the batch dim), or ``None``."""
        w = self._watches.get((rec.module_name, rec.call))
        if w is None or not w.grads or w.shape is None:
            return None
        go = rec.grad_outputs.get("output")
        key, inp = next(iter(rec.inputs.items()), (None, None))
        if go is None or inp is None or key is None:
            return None
        bd, shape = self._bd, w.shape
        lead = len(shape) - go.dim()
        padded = inp.reshape((1,) * lead + tuple(inp.shape))
        if padded.dim() <= bd or padded.shape[bd] != 1:
            return None
        grad = w.grads[0] if len(w.grads) == 1 else torch.stack(w.grads).sum(0)
        grad = grad.to(go.dtype)
        w.grads = []
        # The meetings' gradients summed over the samples must be the call's: checked at the
        # end of the backward, with the other sums (one host copy).
        row = f"{rec.module_name}#{rec.call}"
        self._rows[row] = (grad.sum(bd).reshape(go.shape), go, None)
        self._quals[row] = list(owner.direct.values())
        expanded = padded.expand(padded.shape[:bd] + (shape[bd],) + padded.shape[bd + 1:])
        return replace(rec, inputs={key: expanded}, grad_outputs={"output": grad})

    def answered(self, quals: list[str]) -> None:
        """A watched call's record gave ``quals`` their per-sample quantities."""
        for q in quals:
            self._answered[q] = self._answered.get(q, 0) + 1

    def closed(self, calls: Callable[[str], int]) -> set[str]:
        """The parameters every call of whose modules (``calls(qual)`` of them) this backward
        answered in closed form."""
        return {q for q, k in self._answered.items() if k == calls(q)}

    def incomplete(self, largest: Callable[[], float]) -> set[str]:
        """The parameters of the calls whose meetings did not carry their whole gradient."""
        if not self._rows:
            return set()
        wrong = mismatches(self._rows, {k: go for k, (_, go, _) in self._rows.items()}, 1.0,
                           largest)
        return {q for row in wrong for q in self._quals[row]}


def _factor(name: str, i: int, kwargs: dict[str, Any] | None) -> float | None:
    """What ``r``'s gradient is multiplied by for operand ``i`` of ``name``, or ``None``."""
    alpha: Any = 1
    if kwargs:
        if set(kwargs) != {"alpha"} or name in MULS:
            return None
        alpha = kwargs["alpha"]
        if not isinstance(alpha, numbers.Real):
            return None
    if name in MULS:
        return 1.0
    if name == "__rsub__":  # args[1] - args[0]
        return -1.0 if i == 0 else 1.0
    if i == 0:
        return 1.0
    return -float(alpha) if name in SUBS else float(alpha)


def _keep(w: _Watch, shape: tuple[int, ...], factor: float, other: Tensor | None,
          grad: Tensor) -> None:
    """The hook on a meeting's result: sample n's gradient of the shared output, ``shape``."""
    with torch.no_grad():
        g = grad if other is None else grad * other.conj()
        if factor != 1.0:
            g = g * factor
        w.grads.append(g.sum_to_size(shape))
