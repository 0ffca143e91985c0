"""``own_grad=True``: calls that use the selected parameters detached, and their share of ``.grad``.

A selected parameter is ownable when every module that holds it has a rule (no
parametrization, not inside a module without a rule, whose replay would cover it):
:func:`find_ownable`. A call of such a module is owned when it builds a graph, has one row
per sample in its first tensor argument and an argument that requires grad: an
always-called forward pre-hook puts detached parameters into the module for the call (its
forward hook puts the parameters back), so autograd skips their batch weight gradients; a
rule with a forward of its own (``MultiheadAttention``) runs instead of the module's, with
an :class:`~gradtap._samples.rule.OwnCall` that keeps what it reads. When an owned call's
record comes in backward, its per-sample quantities are computed as for any record, and
their sum (times ``1/N`` for a mean loss) is the call's share of ``.grad``, added at the end
of the backward (:meth:`OwnGrad.write`). An owned call is remembered until the next forward
group, so every backward over one forward (``retain_graph=True``) adds its own share: a
rule's own forward keeps what it read until then, and the gradients it watches per backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from gradtap._samples.accumulate import Step
from gradtap._samples.check import sums
from gradtap._samples.compute import Compute, PiecesCompute, compute_for
from gradtap._samples.fallback import CannotReplay
from gradtap._samples.membership import Membership
from gradtap._samples.owners import Owner, describe, rows
from gradtap._samples.rule import OwnCall
from gradtap._samples.spec import Spec
from gradtap.capture import HookSet, current_backward, in_recomputation
from gradtap.errors import GradtapError
from gradtap.record import GradRecord, flatten_tensors

__all__ = ["OwnGrad", "find_ownable", "lost_error"]

#: A rule's own forward: ``(module, args, kwargs, call) -> output``, ``None`` to decline.
OwnForward = Callable[[nn.Module, tuple, dict, OwnCall], Any]

# Module -> the OwnGrad whose hooks may own its calls: one at a time, or a second one would
# detach the parameters the first put back, and both would add the module's share to .grad.
_CLAIMS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[OwnGrad]] = weakref.WeakKeyDictionary()
# Module -> every open per_sample whose parameters it holds (own_grad or not): a plain one
# beside an owning one on the same module would see the owned calls' parameters detached.
_USERS: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[OwnGrad]] = \
    weakref.WeakKeyDictionary()


def find_ownable(spec: Spec) -> dict[str, frozenset[str]]:
    """Owner name -> the parameters (relative names) its calls use detached: every module
    that holds them has a rule (not a parametrization, not inside a module without a rule,
    whose replay would cover them)."""
    owners = spec.owners
    ruleless = [o.name for o in owners.values() if o.entry is None]

    def has_rule(name: str) -> bool:
        owner = owners[name]
        return (owner.entry is not None and not owner.parametrized
                and not any(r == "" or name.startswith(r + ".") for r in ruleless))

    ownable: dict[str, frozenset[str]] = {}
    for name, owner in owners.items():
        if not has_rule(name):
            continue
        assert owner.entry is not None
        if owner.rule is not None:
            rels = dict(owner.direct)
        elif owner.entry.own_forward is not None:
            rels = {**owner.direct, **{rel: q for rel, (q, _) in owner.nested.items()}}
        else:
            continue
        rels = {rel: q for rel, q in rels.items()
                if all(has_rule(o) for o in spec.owners_of.get(q, ()))}
        if rels:
            ownable[name] = frozenset(rels)
    return ownable


class OwnGrad:
    """The owned calls of one ``per_sample`` and their shares of ``.grad`` (none without
    ``own_grad``)."""

    def __init__(self, spec: Spec, hooks: HookSet, enabled: bool,
                 membership: Membership | None = None) -> None:
        self._spec = spec
        self._membership = membership
        self._hooks = hooks
        self.enabled = enabled
        self.ownable = find_ownable(spec) if enabled else {}
        self._swapped: list[tuple[str, list[tuple[nn.Module, str, Tensor]]]] = []
        self._forwards: list[nn.Module] = []  # modules whose instance forward is a rule's
        self._claimed: list[nn.Module] = []  # modules in _CLAIMS for this one
        self.clear()

    # -- lifetimes --------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every call (``ps.clear()``)."""
        self._pending: dict[str, object] = {}  # owner -> its call now running, owned
        self.new_group()
        self.new_backward()

    def new_group(self) -> None:
        """A new forward group: an owned call no backward reached is dropped."""
        # (owner, call) -> what an owned call read
        self._calls: dict[tuple[str, int], object] = {}

    def new_backward(self) -> None:
        """Forget the last backward's shares (written already) and the gradients the owned
        calls' own forwards read in it (a next backward over the same forward reads its own)."""
        for own in self._calls.values():
            if isinstance(own, _OwnCall):
                own.new_backward()
        self._shares: dict[str, Tensor] = {}  # what this backward adds to .grad
        self._lost: dict[str, str] = {}  # qual -> why its share is unknown
        self._autograd_seen: set[str] = set()  # got a gradient from autograd too
        self._booked: set[str] = set()  # went to the book (clipped sums): no share

    # -- installing -------------------------------------------------------------------------

    def claim(self) -> list[tuple[str, nn.Module, OwnForward | None]]:
        """The modules whose calls may be owned, with their rule's own forward, claimed until
        :meth:`remove`; a module whose ``forward`` is set on the instance already is left
        alone.

        Raises:
            ValueError: another open ``per_sample(own_grad=True)`` owns calls of one of them
                (both would detach its parameters and add its share to ``.grad``).
        """
        self._check_neighbours()
        found = []
        for name in self.ownable:
            owner = self._spec.owners[name]
            other = _CLAIMS.get(owner.module)
            if other is not None and other() is not None:
                raise ValueError(
                    f"per_sample(own_grad=True): module {name!r} "
                    f"({type(owner.module).__name__}) already has its calls' share of .grad "
                    "computed by another open per_sample(own_grad=True); remove that one (leave "
                    "its with block) before opening this one"
                )
            assert owner.entry is not None
            forward = owner.entry.own_forward
            if forward is not None and "forward" in vars(owner.module):
                continue
            found.append((name, owner.module, forward))
        me = weakref.ref(self)
        for _, module, _ in found:
            _CLAIMS[module] = me
            self._claimed.append(module)
        return found

    def replace_forward(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        """Run ``forward`` for ``module``'s calls until :meth:`remove`."""
        module.forward = forward
        self._forwards.append(module)

    def _check_neighbours(self) -> None:
        """Register this per_sample as a user of its modules, after checking that none of
        them is shared with an open per_sample of the other kind (with and without
        ``own_grad``): the one without it would see the parameters of the owned calls
        detached, so neither could give right numbers.

        Raises:
            ValueError: naming the module and both per_samples.
        """
        mine = self.label
        self._users = [o.module for o in self._spec.owners.values()]
        for name, owner in self._spec.owners.items():
            users = _USERS.setdefault(owner.module, weakref.WeakSet())
            for other in list(users):
                if other is self or other.owning == self.owning:
                    continue
                raise ValueError(
                    f"per_sample: {describe(name, owner.module)} is used by this {mine} and by an open {other.label}; with own_grad=True its calls "
                    "use their parameters detached, so the one without it would get no "
                    "gradient for them. Use one per_sample for both (the one with own_grad="
                    "True gives the same per-sample results), or remove the other first "
                    f"(leave its with block or call .remove() on it)")
            users.add(self)

    @property
    def owning(self) -> bool:
        """Whether this per_sample owns calls (``own_grad=True`` with ownable parameters)."""
        return bool(self.ownable)

    @property
    def label(self) -> str:
        """``per_sample(own_grad=...)`` with its parameter count, for messages."""
        return (f"per_sample(own_grad={self.enabled}) of {len(self._spec.params)} "
                "parameter(s)")

    def remove(self) -> None:
        """The modules get back their forwards and their parameters, and are free to claim.
        Safe to call twice."""
        for module in getattr(self, "_users", []):
            users = _USERS.get(module)
            if users is not None:
                users.discard(self)
        self._users = []
        for module in self._claimed:
            ref = _CLAIMS.get(module)
            if ref is not None and ref() is self:
                del _CLAIMS[module]
        self._claimed = []
        for module in self._forwards:
            vars(module).pop("forward", None)
        self._forwards = []
        while self._swapped:
            _put_back(self._swapped.pop()[1])

    # -- forward side -----------------------------------------------------------------------

    def may_own(self, name: str, args: tuple, kwargs: dict[str, Any], n: int | None) -> bool:
        """Whether this call's selected parameters are used detached: a forward that builds a
        graph, one row per sample (``n``; ``None`` while per_sample replays) in the first
        tensor argument, computed from the batch where the forward is followed
        (``membership``: a shared table with ``N`` rows is not), and a tensor argument that requires grad (so that the output still
        does). A checkpoint's recomputation in backward repeats the forward's choice (it must
        save the same tensors): a call of a module whose owned calls are still pending is
        owned again."""
        if not n or not torch.is_grad_enabled():
            return False
        if current_backward() is not None and not (
                in_recomputation() and any(o == name for o, _ in self._calls)):
            return False
        tensors = [t for _, t in flatten_tensors((args, kwargs), "a")]
        m = self._membership
        return (bool(tensors) and rows(tensors[0], self._spec.batch_dim) == n
                and (m is None or not m.following or m.holds_samples(tensors[0]))
                and any(t.requires_grad for t in tensors))

    def before(self, name: str, module: nn.Module, args: tuple, kwargs: dict[str, Any],
               n: int | None) -> None:
        """A call of ``name`` starts: detach its parameters if it is owned."""
        swaps: list[tuple[nn.Module, str, Tensor]] = []
        if self.may_own(name, args, kwargs, n):
            held = cast(dict[str, Any], module._parameters)
            for rel in self.ownable[name]:
                p = held.get(rel)
                if p is not None:
                    swaps.append((module, rel, p))
                    held[rel] = p.detach()
            self._pending[name] = frozenset(rel for _, rel, _ in swaps)
        self._swapped.append((name, swaps))

    def after(self, name: str) -> None:
        """A call of ``name`` returned: its module holds its parameters again."""
        self._pending.pop(name, None)  # not seen by the tap: not owned
        if self._swapped and self._swapped[-1][0] == name:
            _put_back(self._swapped.pop()[1])

    def forward_call(self, name: str, module: nn.Module, forward: OwnForward, args: tuple,
                     kwargs: dict[str, Any], n: int | None) -> Any:
        """Run one call of ``module`` whose rule has a forward of its own: that one when the
        call is owned and the rule takes it, else the module's."""
        if self.may_own(name, args, kwargs, n):
            call = _OwnCall(self._hooks, self.ownable[name])
            out = forward(module, args, kwargs, call)
            if out is not None:
                self._pending[name] = call
                return out
        return type(module).forward(module, *args, **kwargs)

    def called(self, name: str, call: int) -> None:
        """The tap saw call ``call`` of ``name``: an owned one waits for its record."""
        if self._pending:
            own = self._pending.pop(name, None)
            if own is not None:
                self._calls[(name, call)] = own

    # -- backward side ----------------------------------------------------------------------

    def take(self, name: str, call: int) -> object | None:
        """What owned call ``call`` of ``name`` read, or ``None`` when it was not owned; kept
        for a next backward over the same forward until :meth:`new_group`."""
        return self._calls.get((name, call)) if self._calls else None

    def autograd_added(self, qual: str) -> None:
        """Autograd computed a gradient of ``qual`` too (a use outside the owned calls)."""
        self._autograd_seen.add(qual)

    def record(self, owner: Owner, rec: GradRecord, own: object, n: int, step: Step) -> None:
        """An owned call's record: its per-sample results into ``step``, and its share of
        ``.grad`` (their sum), which autograd did not compute."""
        rels: frozenset[str] = own.detach if isinstance(own, _OwnCall) else cast(frozenset, own)
        names = {rel: q for rel, q in {**owner.direct, **{r: q for r, (q, _) in
                                                           owner.nested.items()}}.items()
                 if rel in rels}
        if not names:
            return
        if all(g is None for g in rec.grad_inputs.values()) and not isinstance(own, _OwnCall):
            return  # no gradient went through the call
        if rec.notes:
            self._lost.update({q: f"{rec.module_name!r}: {'; '.join(rec.notes)}"
                               for q in names.values()})
            return
        spec = self._spec
        scale, c = spec.scale(n), spec.share(n)
        booked = spec.book is not None and spec.book.takes(spec.summed(owner, names))
        materialize = spec.materialize(owner, names) and not booked
        try:
            with torch.no_grad():
                compute = self._compute(owner, rec, own, names, scale, materialize, n)
                if compute is None:
                    return
                if booked and compute.closed_form:
                    # No share of .grad: the consumer reads the clipped sum instead.
                    assert spec.book is not None
                    spec.book.add(names, compute)
                    owner.seen.update(names)
                    self._booked.update(names.values())
                    return
                materialize = materialize or booked
                if materialize:
                    grads = compute.grads()
                    totals = sums(compute, grads)
                    # Not projected for the sum check (``sketch``): a parameter whose every
                    # use is owned skips the check, and the others are projected there.
                    step.add_grads(names, grads, totals)
                else:
                    totals = compute.total()
                shares = {}
                for rel, g in totals.items():
                    q = names[rel]
                    g = (g * c).to(spec.params[q].dtype)
                    shares[q] = g
                    self._shares[q] = g if q not in self._shares else self._shares[q] + g
                    step.add_increment(q, g)
                if not materialize:
                    step.add_reduced(names, compute, rec, scale, shares)
        except CannotReplay as err:
            self._lost.update({q: f"{rec.module_name!r}: {err}" for q in names.values()})
            return
        finally:
            if isinstance(own, _OwnCall):
                own.new_backward()
        owner.seen.update(names)

    def _compute(self, owner: Owner, rec: GradRecord, own: object, names: dict[str, str],
                 scale: float, materialize: bool, n: int) -> Compute | None:
        """How to compute an owned call's quantities; ``None`` when no gradient went
        through the call."""
        if isinstance(own, _OwnCall):
            entry = owner.entry
            assert entry is not None and entry.own_pieces is not None
            pieces = entry.own_pieces(owner.module, own, rec.grad_outputs, scale)
            if pieces is None:
                if all(g is None for g in rec.grad_outputs.values()):
                    return None
                raise CannotReplay("a gradient the call's own forward waited for "
                                   "was not computed")
            return PiecesCompute(pieces, frozenset(names))
        if all(g is None for g in rec.grad_outputs.values()):
            raise CannotReplay("its output gradient was not recorded")
        return compute_for(owner, rec, scale, frozenset(names), materialize, n,
                           self._spec.batch_dim)

    def owned_only(self) -> set[str]:
        """The parameters whose every use this backward was owned: their ``.grad``
        increments are the sums of their per-sample gradients by construction."""
        return (set(self._shares) | self._booked) - self._autograd_seen

    def write(self) -> dict[str, str]:
        """Add this backward's shares to ``.grad`` (as autograd accumulates); returns the
        parameters whose share could not be computed (qual -> module and why)."""
        with torch.no_grad():
            for q, g in self._shares.items():
                p = self._spec.params[q]
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        return dict(self._lost)


def lost_error(lost: dict[str, str]) -> GradtapError:
    """The error for shares of ``.grad`` that could not be computed (``write``)."""
    return GradtapError(
        "per_sample(own_grad=True): the gradients of "
        + "; ".join(f"{q} (module {why})" for q, why in lost.items())
        + " could not be computed from their calls, so their .grad misses those "
        "calls' share; use own_grad=False for this model")


def _put_back(swaps: list[tuple[nn.Module, str, Tensor]]) -> None:
    """Undo :meth:`OwnGrad.before`: the modules hold their parameters again."""
    for module, rel, p in swaps:
        cast(dict[str, Any], module._parameters)[rel] = p


class _OwnCall:
    """What a rule's own forward read during one call (``own_grad``): forward tensors and
    the gradients w.r.t. some of its intermediate tensors."""

    def __init__(self, hooks: HookSet, detach: frozenset[str]) -> None:
        self.detach = detach
        self._hooks = hooks
        self._kept: dict[str, Tensor] = {}
        self._grads: dict[str, Tensor] = {}

    def detached(self, name: str, p: Tensor) -> Tensor:
        return p.detach() if name in self.detach else p

    def keep(self, key: str, t: Tensor) -> None:
        self._kept[key] = t.detach()

    def watch(self, key: str, t: Tensor) -> None:
        grads = self._grads

        def seen(g: Tensor) -> None:
            grads[key] = g if key not in grads else grads[key] + g

        self._hooks.gradient(t, seen)

    @property
    def kept(self) -> dict[str, Tensor]:
        return self._kept

    def new_backward(self) -> None:
        """Forget the gradients read in this backward (the forward tensors stay, for a next
        backward over the same forward; they go with the call at the next forward group)."""
        self._grads.clear()

    @property
    def grads(self) -> dict[str, Tensor]:
        return self._grads
