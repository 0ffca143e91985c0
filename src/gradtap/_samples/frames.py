"""The forward side: the calls kept for a replay, the uses that need one, and the batch size.

Calls of the modules that enclose an owner (``owners.enclosing_modules``) are followed on a
stack as they run; each one the model makes for a new use (not a checkpoint's recomputation,
not one of per_sample's own replays) becomes a :class:`~gradtap._samples.units.Frame`.
A forward group is the forwards whose graph the next backward goes through: it starts at the
first outermost call after a backward (or after ``MAX_OUTER_CALLS`` outermost calls without
one) and holds, for each selected parameter, the frames around each call that used it, and
the uses whose own call cannot be split into samples (``owners.classify_call``). When the
outermost call returns, only the frames a replay may need are kept (``units``). The batch
size comes from the outermost calls' arguments (:func:`samples_of`).
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor, nn

from gradtap._samples.layout import KeptCall, leaves, sample_count
from gradtap._samples.membership import Membership
from gradtap._samples.owners import Owner, batch_size_of, classify_call
from gradtap._samples.spec import Spec
from gradtap._samples.units import MAX_OUTER_CALLS, Frame, innermost_around
from gradtap.record import GradRecord

__all__ = ["Calls", "samples_in", "samples_of"]


def samples_of(who: str, module: nn.Module, args: tuple, kwargs: dict[str, Any],
               batch_dim: int) -> int:
    """The number of samples in an outermost call: what its layout says, else the size most
    of its tensor arguments have along ``batch_dim`` (``owners.batch_size_of``)."""
    n = sample_count(module, args, kwargs)
    return batch_size_of(who, args, kwargs, batch_dim) if n is None else n


def samples_in(name: str, inputs: dict[str, Tensor], batch_dim: int) -> int:
    """The number of samples in a call of owner ``name`` made outside the model's own call:
    the rows of its first input."""
    first = next(iter(inputs.values()), None)
    if first is None or first.dim() <= batch_dim:
        got = "no tensor argument" if first is None else f"shape {tuple(first.shape)}"
        raise ValueError(
            f"per_sample: module {name!r} was called with {got}; its input needs the "
            f"sample dim batch_dim={batch_dim}"
        )
    return first.shape[batch_dim]


class Calls:
    """The running calls (kept from the start or the last clear) and one forward group's
    kept calls and flagged uses."""

    def __init__(self, spec: Spec, membership: Membership) -> None:
        self._spec = spec
        self._membership = membership
        self._stack: list[tuple[str, Frame | None]] = []
        self._frames: list[Frame] = []
        self.new_group()

    def new_group(self) -> None:
        """Start a forward group: the forwards whose graph the next backward goes through."""
        for frame in self._frames:
            frame.drop()
        self._frames = []
        self._outer_calls = 0
        self._enclosing: dict[str, list[tuple[Frame, ...]]] = {}  # qual -> frames per use
        self._direct: dict[str, int] = {}  # qual -> calls of a module holding it directly
        self.flagged: dict[str, tuple[str, str]] = {}  # qual -> (repr of module, reason)
        self._flagged_calls: set[tuple[str, int]] = set()
        self._covered: dict[tuple[str, int], set[str]] = {}
        # (owner, call) -> the call's own frame, for an owner without a rule (its replay takes
        # every argument as passed, non-tensors included)
        self._own_frames: dict[tuple[str, int], Frame] = {}
        self._done = False
        self._used = False  # a call of the model or of an owner ran in this group

    def group_over(self) -> bool:
        """Whether the next forward starts a new group (a backward went through this one)."""
        return self._done or self._outer_calls >= MAX_OUTER_CALLS

    def pending(self) -> bool:
        """Whether a forward ran in this group and no backward went through it yet."""
        return self._used and not self._done

    def end_backward(self) -> None:
        """A backward went through the group: drop the output gradients it left."""
        for frame in self._frames:
            frame.grads = {}
        self._done = True

    # -- calls as they run ------------------------------------------------------------------

    def running(self) -> tuple[Frame, ...]:
        """The kept calls now running, outermost first."""
        return tuple(f for _, f in self._stack if f is not None)

    def outside(self) -> bool:
        """Whether no kept call is running (the next one is an outermost call)."""
        return not any(f is not None for _, f in self._stack)

    def restart(self) -> None:
        """A new call of the model: what is on the stack is from a forward that raised."""
        self._stack.clear()

    def enter(self, name: str, module: nn.Module, args: tuple, kwargs: dict[str, Any],
              new_use: bool) -> None:
        """A call of ``name`` starts; ``new_use``: the model's own call, kept for a replay
        (calls inside a backward are checkpoint recomputations or replays)."""
        if not new_use:
            self._stack.append((name, None))
            return
        self._used = True
        outer = self.outside()
        if outer:
            self._outer_calls += 1
        m = self._membership
        members = ([m.holds_samples(leaf) for leaf in leaves((args, kwargs))]
                   if m.following else None)
        frame = Frame(name, module, args, kwargs, outer, self.running(), members)
        self._stack.append((name, frame))
        self._frames.append(frame)

    def leave(self, name: str) -> Frame | None:
        """A call of ``name`` returned: its frame, if it was kept."""
        frame = None
        while self._stack:
            popped, frame = self._stack.pop()
            if popped == name:
                return frame
        return None

    def settle(self) -> None:
        """The outermost call returned: keep the calls a replay may need, drop the others."""
        needed = {id(f) for q in self.flagged for frames in self._enclosing.get(q, ())
                  for f in frames}
        needed.update(id(f) for f in self._own_frames.values())
        for q in self._spec.params:
            if q not in self._enclosing:  # no call of its modules: a read through .weight
                needed.update(id(f) for f in innermost_around(self._spec.owners_of.get(q, []),
                                                              self._frames))
        kept = []
        for frame in self._frames:
            if not frame.settled:
                frame.settled = True
                frame.keep = frame.outer or id(frame) in needed
                if not frame.keep:
                    frame.drop()
                    continue
            if frame.keep:
                kept.append(frame)
        self._frames = kept

    def on_forward(self, owner: Owner, call: int, module: nn.Module,
                   frames: tuple[Frame, ...], inputs: dict[str, Tensor],
                   outputs: dict[str, Tensor], n: int | None) -> None:
        """Call ``call`` of ``owner`` ran inside ``frames``: note its uses, and flag them when
        its own record cannot split them into samples."""
        name, spec = owner.name, self._spec
        self._used = True
        quals = owner.quals
        for q in quals:
            self._enclosing.setdefault(q, []).append(frames)
        for q in owner.direct.values():
            self._direct[q] = self._direct.get(q, 0) + 1
        # The calls around this one (its own too, when it is one: a replay of it with every
        # argument as passed is the first thing to try for a module without a rule).
        own = frames[-1] if frames and frames[-1].module is module else None
        if owner.entry is None and own is not None:
            self._own_frames[(name, call)] = own
        # A parameter also held by an enclosing module without a rule (a tied decoder bias
        # held by the head and by its Linear) is covered by that module's own replay, which
        # sees every use inside its call: counting this call too would count it twice.
        covered = {q for f in frames if f.module is not module and f.name in spec.owners
                   and spec.owners[f.name].entry is None
                   for q in spec.owners[f.name].direct.values()}
        if covered & set(quals):
            self._covered[(name, call)] = covered
        m = self._membership
        reason = classify_call(owner, inputs, outputs, n, spec.batch_dim,
                               None if own is None or owner.entry is not None or n is None
                               else own.split(n, spec.batch_dim, outputs),
                               m.holds_samples if m.following else None)
        if reason is not None:
            self._flagged_calls.add((name, call))
            for q in quals:
                self.flagged.setdefault(q, (repr(name), reason))

    # -- backward side ----------------------------------------------------------------------

    def names_for(self, owner: Owner, rec: GradRecord) -> dict[str, str]:
        """The parameters (relative -> qualified name) one call's record gives per-sample
        gradients to: none for a flagged call, and none that a replay or an enclosing
        module's own record covers."""
        if (rec.module_name, rec.call) in self._flagged_calls:
            return {}
        covered = self._covered.get((rec.module_name, rec.call), set())
        names = {rel: q for rel, q in owner.direct.items()
                 if q not in self.flagged and q not in covered}
        if owner.rule is None:
            # A descendant that owns selected parameters but was never called (e.g.
            # MultiheadAttention's out_proj) has them used by this call: cover them here
            # (pieces rules and the fallback see the whole subtree).
            for rel, (qual, sub) in owner.nested.items():
                if (self._spec.owners[sub].calls == 0 and rec.param_grads.get(rel) is not None
                        and qual not in self.flagged):
                    names[rel] = qual
        return names

    def direct_calls(self, qual: str) -> int:
        """How many calls of the modules holding ``qual`` this forward group made."""
        return self._direct.get(qual, 0)

    def shared_names(self, owner: Owner, rec: GradRecord) -> dict[str, str]:
        """The parameters a flagged call of ``owner`` gives per-sample gradients to in
        closed form (``shared``): its own, but none an enclosing module's replay covers."""
        if (rec.module_name, rec.call) not in self._flagged_calls:
            return {}
        covered = self._covered.get((rec.module_name, rec.call), set())
        return {rel: q for rel, q in owner.direct.items() if q not in covered}

    def arguments(self, rec: GradRecord) -> KeptCall | None:
        """The arguments of the record's call as passed, when it was kept as its own frame
        and nothing changed since (the fallback then replays it with them), and its integer
        outputs by path."""
        frame = self._own_frames.get((rec.module_name, rec.call))
        return (None if frame is None or frame.changed() or frame.kwargs is None
                else (cast(tuple, frame.args), frame.kwargs, frame.index_outputs,
                      frame.members))

    def uses(self, qual: str) -> list[tuple[Frame, ...]]:
        """The enclosing calls of each call that used ``qual``; the model's own calls when no
        call of a module holding it was seen (a use outside them)."""
        if qual in self._enclosing:
            return self._enclosing[qual]
        around = innermost_around(self._spec.owners_of.get(qual, []), self._frames)
        return [f.chain for f in around] or [(f,) for f in self._frames if f.outer]
