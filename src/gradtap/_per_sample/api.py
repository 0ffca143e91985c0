"""``gt.per_sample``: per-sample gradients, their norms and their batch statistics.

How it works: one :func:`gradtap.capture.tap` on the modules that directly own a selected
parameter (each module holding a tied parameter owns it too; ``owners``), keeping their
forward inputs. As each call's record completes in backward, the module type's rule entry
(``rules/``; the ``torch.func`` fallback for other types) turns ``(module, input,
grad_output)`` into exactly the quantities asked for (``compute``), the record is dropped,
and only small accumulators stay.
When only norms or statistics are asked, ``[N, *shape]`` is never built for layers with a
closed form (Linear, convolutions, Embedding) and is built a chunk of samples at a time for
the others. A parameter used by several calls (a module called several times, tied weights)
has per-sample gradients summed over its uses; it is materialized, because norms of a sum do
not add up.

Parameters that no call of their own module can split into samples (an input shared by all
samples, samples folded with other rows, a call per sample, an output gradient that cannot be
trusted) get theirs from a replay of an enclosing call (``_per_sample.units``), with a warning
naming the module. After each backward, every parameter's per-sample gradients are checked to
reduce to that backward's increment of its ``.grad``; a parameter that fails is replayed too.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor, nn

from gradtap._per_sample.accumulate import Step, Totals
from gradtap._per_sample.check import check_sums, sums
from gradtap._per_sample.compute import Compute, PiecesCompute, compute_for
from gradtap._per_sample.fallback import CannotReplay
from gradtap._per_sample.layout import sample_count
from gradtap._per_sample.owners import (
    Owner,
    batch_size_of,
    check_module,
    classify_call,
    describe,
    enclosing_modules,
    rows,
)
from gradtap._per_sample.replays import Replays
from gradtap._per_sample.sketch import Sketches
from gradtap._per_sample.spec import LossReduction, Quantity, Spec
from gradtap._per_sample.units import (
    MAX_OUTER_CALLS,
    Frame,
    innermost_around,
    watch_outputs,
)
from gradtap._types import Selector
from gradtap.capture import (
    HookSet,
    Listener,
    at_end_of_backward,
    compiled_feature,
    current_backward,
    in_recomputation,
    tap,
)
from gradtap.errors import GradtapError
from gradtap.record import GradRecord, flatten_tensors

__all__ = ["PerSample", "Quantity", "per_sample"]

class PerSample:
    """Per-sample gradients and statistics of one model; see :func:`per_sample`.

    Results are read after backward, inside or after the ``with`` block, and cover every
    backward since the start or the last :meth:`clear`, like ``.grad`` accumulates.
    """

    def __init__(
        self,
        model: nn.Module,
        select: Selector = "*",
        *,
        loss_reduction: LossReduction = "mean",
        batch_dim: int = 0,
        quantities: Iterable[Quantity] = ("grad", "norm"),
        fallback: bool = True,
        own_grad: bool = False,
    ) -> None:
        self._spec = spec = Spec(model, select, loss_reduction, batch_dim, quantities, fallback)
        self.loss_reduction = spec.loss_reduction
        self.batch_dim = spec.batch_dim
        self.quantities: tuple[Quantity, ...] = spec.quantities
        self._replays = Replays(spec)
        self.own_grad = bool(own_grad)
        self._ownable = self._find_ownable() if own_grad else {}
        self._swapped: list[tuple[str, list[tuple[nn.Module, str, Tensor]]]] = []
        self._forwards: list[nn.Module] = []
        self._replaying = False
        self._queued = False
        self.batch_size: int | None = None
        self._reset()
        owners = set(spec.owners)
        # Hooks must not keep this object alive: a reference cycle would hold every result
        # (hundreds of MB of per-sample gradients) until the cyclic garbage collector runs.
        me = weakref.ref(self)
        self._hooks = HookSet()
        # A compiled model's taps go through its wrapper (they run eagerly).
        with compiled_feature("per_sample"):
            self._tap = tap(
                model,
                select=lambda name, _module: name in owners,
                keep=("inputs",),
                store=False,
                listener=_Forward(me),
            )
        try:
            for name, module in enclosing_modules(spec.model, spec.owners):
                self._hooks.module_calls(
                    module,
                    functools.partial(_call_kw, me, "_before", name, module),
                    functools.partial(_call, me, "_after", name),
                )
            for name in self._ownable:
                module = self._spec.owners[name].module
                entry = self._spec.owners[name].entry
                assert entry is not None
                if entry.own_forward is not None:
                    if "forward" in vars(module):  # a forward set on the instance: leave it
                        continue
                    module.forward = functools.partial(_own_forward, me, name, module,
                                                       entry.own_forward)
                    self._forwards.append(module)
                    before = None
                else:
                    before = functools.partial(_call_kw, me, "_own_before", name, module)
                self._hooks.module_calls(module, before,
                                         functools.partial(_call, me, "_own_after", name),
                                         always=True)
            for qual, p in self._spec.params.items():
                handle = self._hooks.gradient(p, functools.partial(_call, me, "_on_increment",
                                                                   qual))
                if handle is not None:
                    self._hooks.add(handle)
        except BaseException:
            self.remove()
            raise

    # -- setup ------------------------------------------------------------------------------

    @property
    def _sketches(self) -> Sketches:
        return self._spec.sketches

    def _find_ownable(self) -> dict[str, frozenset[str]]:
        """Owner name -> the parameters (relative names) its calls use detached, when
        ``own_grad``: every module that holds them has a rule (not a parametrization, not
        inside a module without a rule, whose replay would cover them)."""
        ruleless = [o.name for o in self._spec.owners.values() if o.entry is None]

        def has_rule(name: str) -> bool:
            owner = self._spec.owners[name]
            return (owner.entry is not None and not owner.parametrized
                    and not any(r == "" or name.startswith(r + ".") for r in ruleless))

        ownable: dict[str, frozenset[str]] = {}
        for name, owner in self._spec.owners.items():
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
                    if all(has_rule(o) for o in self._spec.owners_of.get(q, ()))}
            if rels:
                ownable[name] = frozenset(rels)
        return ownable

    def _reset(self) -> None:
        self.batch_size = None
        self._totals = Totals(self._spec)
        self._stack: list[tuple[str, Frame | None]] = []
        for owner in self._spec.owners.values():
            owner.calls = 0
            owner.seen = set()
        self._frames: list[Frame] = []
        self._own_pending: dict[str, object] = {}  # owner -> its call now running, owned
        self._new_group()
        self._new_backward()

    def _new_group(self) -> None:
        """Start a forward group: the forwards whose graph the next backward goes through."""
        for frame in getattr(self, "_frames", []):
            frame.drop()
        self._frames = []
        self._outer_calls = 0
        # (owner, call) -> what an owned call read; a call no backward reached is dropped
        self._own_calls: dict[tuple[str, int], object] = {}
        self._enclosing: dict[str, list[tuple[Frame, ...]]] = {}  # qual -> frames per use
        self._flagged: dict[str, tuple[str, str]] = {}  # qual -> (repr of module, reason)
        self._flagged_calls: set[tuple[str, int]] = set()
        self._covered: dict[tuple[str, int], set[str]] = {}
        # (owner, call) -> the call's own frame, for an owner without a rule (its replay takes
        # every argument as passed, non-tensors included)
        self._own_frames: dict[tuple[str, int], Frame] = {}
        self._group_done = False

    def _new_backward(self) -> None:
        """Forget what the last backward computed (merged already) and its increments."""
        self._own_grad: dict[str, Tensor] = {}  # own_grad: what this backward adds to .grad
        self._own_lost: dict[str, str] = {}  # own_grad: qual -> why its share is unknown
        self._autograd_seen: set[str] = set()  # own_grad: got a gradient from autograd too
        self._step = Step(self._spec)

    @contextmanager
    def _replay(self) -> Iterator[None]:
        """per_sample's own computations run: their hooks and backward are not new uses."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    # -- forward side -----------------------------------------------------------------------

    def _before(self, name: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if name == "":  # a new call of the model: leftovers are from a forward that raised
            self._stack.clear()
        # Calls inside a backward are checkpoint recomputations or replays, not new uses.
        if not torch.is_grad_enabled() or current_backward() is not None or self._replaying:
            self._stack.append((name, None))
            return
        outer = not any(f is not None for _, f in self._stack)
        if outer:
            self._forward_starts()
            self._set_batch_size(describe(name, module), args, kwargs, module)
            self._outer_calls += 1
        frame = Frame(name, module, args, kwargs, outer,
                      tuple(f for _, f in self._stack if f is not None))
        self._stack.append((name, frame))
        self._frames.append(frame)

    def _after(self, name: str, output: Any) -> None:
        frame = None
        while self._stack:
            popped, frame = self._stack.pop()
            if popped == name:
                break
        else:
            return
        if frame is None:
            return
        watch_outputs(frame, output, self._hooks,
                      functools.partial(_call, weakref.ref(self), "_on_frame_grad"))
        if not any(f is not None for _, f in self._stack):
            self._settle()

    def _may_own(self, name: str, args: tuple, kwargs: dict[str, Any]) -> bool:
        """Whether this call's selected parameters are used detached (``own_grad``): a
        forward that builds a graph, one row per sample in the first tensor argument, and a
        tensor argument that requires grad (so that the output still does). A checkpoint's
        recomputation in backward repeats the forward's choice (it must save the same
        tensors): a call of a module whose owned calls are still pending is owned again."""
        if self._replaying or not self.batch_size or not torch.is_grad_enabled():
            return False
        if current_backward() is not None and not (
                in_recomputation() and any(n == name for n, _ in self._own_calls)):
            return False
        tensors = [t for _, t in flatten_tensors((args, kwargs), "a")]
        return (bool(tensors) and rows(tensors[0], self.batch_dim) == self.batch_size
                and any(t.requires_grad for t in tensors))

    def _own_before(self, name: str, module: nn.Module, args: tuple,
                    kwargs: dict[str, Any]) -> None:
        swaps: list[tuple[nn.Module, str, Tensor]] = []
        if self._may_own(name, args, kwargs):
            held = cast(dict[str, Any], module._parameters)
            for rel in self._ownable[name]:
                p = held.get(rel)
                if p is not None:
                    swaps.append((module, rel, p))
                    held[rel] = p.detach()
            self._own_pending[name] = frozenset(rel for _, rel, _ in swaps)
        self._swapped.append((name, swaps))

    def _own_after(self, name: str, _output: Any) -> None:
        self._own_pending.pop(name, None)  # not seen by the tap: not owned
        if self._swapped and self._swapped[-1][0] == name:
            _put_back(self._swapped.pop()[1])

    def _own_forward_call(self, name: str, module: nn.Module, forward: Any, args: tuple,
                          kwargs: dict[str, Any]) -> Any:
        if self._may_own(name, args, kwargs):
            call = _OwnCall(self._hooks, self._ownable[name])
            out = forward(module, args, kwargs, call)
            if out is not None:
                self._own_pending[name] = call
                return out
        return type(module).forward(module, *args, **kwargs)

    def _forward_starts(self) -> None:
        if self._group_done or self._outer_calls >= MAX_OUTER_CALLS:
            self._new_group()

    def _set_batch_size(self, who: str, args: tuple, kwargs: dict[str, Any],
                        module: nn.Module) -> None:
        n = sample_count(module, args, kwargs)
        if n is None:
            n = batch_size_of(who, args, kwargs, self.batch_dim)
        if self.batch_size is None:
            self.batch_size = n
        elif n != self.batch_size:
            raise ValueError(
                f"per_sample: {who} got {n} samples along batch_dim={self.batch_dim}, but an "
                f"earlier call had {self.batch_size}; call ps.clear() between batches"
            )

    def _settle(self) -> None:
        """The outermost call returned: keep the calls a replay may need, drop the others."""
        needed = {id(f) for q in self._flagged for frames in self._enclosing.get(q, ())
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

    def _on_forward(self, name: str, call: int, module: nn.Module, inputs: dict[str, Tensor],
                    outputs: dict[str, Tensor]) -> None:
        if self._replaying:
            return
        owner = self._spec.owners[name]
        owner.calls += 1
        check_module(name, module, self.batch_dim, owner.entry is None)
        # The calls around this one (its own too, when it is one: a replay of it with every
        # argument as passed is the first thing to try for a module without a rule).
        frames = tuple(f for _, f in self._stack if f is not None)
        if not frames:  # called outside the model's own call
            self._forward_starts()
            if self.batch_size is None:
                first = next(iter(inputs.values()), None)
                if first is None or first.dim() <= self.batch_dim:
                    got = "no tensor argument" if first is None else f"shape {tuple(first.shape)}"
                    raise ValueError(
                        f"per_sample: module {name!r} was called with {got}; its input needs the "
                        f"sample dim batch_dim={self.batch_dim}"
                    )
                self.batch_size = first.shape[self.batch_dim]
        if self._own_pending:
            own = self._own_pending.pop(name, None)
            if own is not None:
                self._own_calls[(name, call)] = own
        quals = owner.quals
        for q in quals:
            self._enclosing.setdefault(q, []).append(frames)
        own = frames[-1] if frames and frames[-1].module is module else None
        if owner.entry is None and own is not None:
            self._own_frames[(name, call)] = own
        # A parameter also held by an enclosing module without a rule (a tied decoder bias
        # held by the head and by its Linear) is covered by that module's own replay, which
        # sees every use inside its call: counting this call too would count it twice.
        covered = {q for f in frames if f.module is not module and f.name in self._spec.owners
                   and self._spec.owners[f.name].entry is None
                   for q in self._spec.owners[f.name].direct.values()}
        if covered & set(quals):
            self._covered[(name, call)] = covered
        reason = classify_call(owner, inputs, outputs, self.batch_size, self.batch_dim,
                               None if own is None or owner.entry is not None
                               or self.batch_size is None
                               else own.split(self.batch_size, self.batch_dim))
        if reason is not None:
            self._flagged_calls.add((name, call))
            for q in quals:
                self._flagged.setdefault(q, (repr(name), reason))

    # -- backward side ----------------------------------------------------------------------

    def _queue_end(self) -> None:
        if self._queued:
            return
        self._queued = True
        me = weakref.ref(self)
        # Queued twice, so it runs after capture's own end-of-backward step, which delivers
        # the records still pending.
        at_end_of_backward(lambda: at_end_of_backward(lambda: _call(me, "_end_of_backward")))

    def _on_frame_grad(self, frame: Frame, path: str, grad: Tensor) -> None:
        if self._replaying or not frame.keep:
            return
        frame.grads[path] = grad if path not in frame.grads else frame.grads[path] + grad
        self._queue_end()

    def _on_increment(self, qual: str, grad: Tensor) -> None:
        if self._replaying:
            return
        self._queue_end()
        self._autograd_seen.add(qual)
        self._step.increment(qual, grad)

    def _on_record(self, rec: GradRecord) -> None:
        if self._replaying:
            return
        owner = self._spec.owners[rec.module_name]
        self._queue_end()
        if self.batch_size == 0:
            return  # an empty batch: nothing to split (_end_of_backward)
        if self._own_calls:
            own = self._own_calls.pop((rec.module_name, rec.call), None)
            if own is not None:
                self._own_record(owner, rec, own)
                return
        if (rec.module_name, rec.call) in self._flagged_calls:
            return
        covered = self._covered.get((rec.module_name, rec.call), set())
        names = {rel: q for rel, q in owner.direct.items()
                 if q not in self._flagged and q not in covered}
        if owner.rule is None:
            # A descendant that owns selected parameters but was never called (e.g.
            # MultiheadAttention's out_proj) has them used by this call: cover them here
            # (pieces rules and the fallback see the whole subtree).
            for rel, (qual, sub) in owner.nested.items():
                if (self._spec.owners[sub].calls == 0 and rec.param_grads.get(rel) is not None
                        and qual not in self._flagged):
                    names[rel] = qual
        if not names:
            return
        frame = self._own_frames.get((rec.module_name, rec.call))
        call = (None if frame is None or frame.changed() or frame.kwargs is None
                else (cast(tuple, frame.args), frame.kwargs))
        with self._replay():  # a fallback's own backward must not count as an increment
            self._step.add_call(owner, rec, names, self.batch_size, call)  # type: ignore[arg-type]

    def _own_record(self, owner: Owner, rec: GradRecord, own: object) -> None:
        """A call whose parameters were used detached: its per-sample results, and its share
        of ``.grad`` (their sum), which autograd did not compute."""
        if isinstance(own, _OwnCall):
            rels: frozenset[str] = own.detach
        else:
            rels = cast(frozenset, own)
        names = {rel: q for rel, q in {**owner.direct, **{r: q for r, (q, _) in
                                                           owner.nested.items()}}.items()
                 if rel in rels}
        if not names:
            return
        if all(g is None for g in rec.grad_inputs.values()) and not isinstance(own, _OwnCall):
            return  # no gradient went through the call
        if rec.notes:
            self._own_lost.update({q: f"{rec.module_name!r}: {'; '.join(rec.notes)}"
                                   for q in names.values()})
            return
        n = self.batch_size
        assert n is not None
        scale, c = self._spec.scale(n), self._spec.share(n)
        materialize = self._spec.materialize(owner, names)
        self._replaying = True
        try:
            with torch.no_grad():
                compute: Compute
                if isinstance(own, _OwnCall):
                    entry = owner.entry
                    assert entry is not None and entry.own_pieces is not None
                    pieces = entry.own_pieces(owner.module, own, rec.grad_outputs, scale)
                    if pieces is None:
                        if all(g is None for g in rec.grad_outputs.values()):
                            return
                        raise CannotReplay("a gradient the call's own forward waited for "
                                           "was not computed")
                    compute = PiecesCompute(pieces, frozenset(names))
                else:
                    if all(g is None for g in rec.grad_outputs.values()):
                        raise CannotReplay("its output gradient was not recorded")
                    compute = compute_for(owner, rec, scale, frozenset(names), materialize,
                                          n, self.batch_dim)
                if materialize:
                    grads = compute.grads()
                    totals = sums(compute, grads)
                    self._step.add_grads(names, grads, {
                        rel: self._spec.sketches.project(names[rel], t) for rel, t in totals.items()})
                else:
                    totals = compute.total()
                shares = {}
                for rel, g in totals.items():
                    q = names[rel]
                    g = (g * c).to(self._spec.params[q].dtype)
                    shares[q] = g
                    self._own_grad[q] = g if q not in self._own_grad else self._own_grad[q] + g
                    self._step.add_increment(q, g)
                if not materialize:
                    self._step.add_reduced(names, compute, rec, scale, shares)
        except CannotReplay as err:
            self._own_lost.update({q: f"{rec.module_name!r}: {err}" for q in names.values()})
            return
        finally:
            self._replaying = False
            if isinstance(own, _OwnCall):
                own.release()
        owner.seen.update(names)

    # -- end of backward: check, replay, merge ------------------------------------------------

    def _write_own(self) -> None:
        """Add this backward's owned shares to ``.grad`` (as autograd accumulates)."""
        with torch.no_grad():
            for q, g in self._own_grad.items():
                p = self._spec.params[q]
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)

    def _end_of_backward(self) -> None:
        self._queued = False
        step, n = self._step, self.batch_size
        lost = dict(self._own_lost)
        self._write_own()
        try:
            if n == 0:  # an empty batch: [0, *shape] for every parameter
                step.grad = {q: p.new_zeros((0, *p.shape)) for q, p in self._spec.params.items()}
            elif n is not None and step.increments:
                # A parameter whose every use this backward was owned has .grad increments
                # that are the sums of its per-sample gradients by construction.
                late = check_sums(self._spec, step, n, set(self._own_grad) - self._autograd_seen,
                                  set(self._flagged) | set(step.late))
                suspects = {**self._flagged, **step.late, **late}
                bad = {q: why for q, why in suspects.items() if q in step.increments}
                for q in suspects:
                    step.discard(q)
                if bad:
                    with self._replay():
                        self._replays.run(bad, n, step, self._totals, self._uses)
            self._totals.merge(step)
        finally:
            self._new_backward()
            for frame in self._frames:
                frame.grads = {}
            self._group_done = True
        if lost:
            raise GradtapError(
                "per_sample(own_grad=True): the gradients of "
                + "; ".join(f"{q} (module {why})" for q, why in lost.items())
                + " could not be computed from their calls, so their .grad misses those "
                "calls' share; use own_grad=False for this model")

    def _uses(self, qual: str) -> list[tuple[Frame, ...]]:
        """The enclosing calls of each call that used ``qual``; the model's own calls when no
        call of a module holding it was seen (a use outside them)."""
        if qual in self._enclosing:
            return self._enclosing[qual]
        around = innermost_around(self._spec.owners_of.get(qual, []), self._frames)
        return [f.chain for f in around] or [(f,) for f in self._frames if f.outer]

    # -- results ----------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Qualified names of the selected parameters (the keys of every result dict)."""
        return list(self._spec.params)

    @property
    def grad(self) -> dict[str, Tensor]:
        """``{name: [N, *param.shape]}``: ``d s_n / d param`` for each sample n."""
        return self._get("grad")  # type: ignore[return-value]

    @property
    def norm(self) -> Tensor:
        """``[N]``: per-sample gradient norm over all selected parameters."""
        return self._get("norm")  # type: ignore[return-value]

    @property
    def norms(self) -> dict[str, Tensor]:
        """``{name: [N]}``: per-sample gradient norm of each parameter."""
        return self._get("norms", "norm")  # type: ignore[return-value]

    @property
    def second_moment(self) -> dict[str, Tensor]:
        """``{name: param.shape}``: ``mean_n g_n**2``, elementwise."""
        return self._get("second_moment")  # type: ignore[return-value]

    @property
    def variance(self) -> dict[str, Tensor]:
        """``{name: param.shape}``: ``second_moment - mean_n(g_n)**2`` (ddof=0), elementwise."""
        return self._get("variance")  # type: ignore[return-value]

    @property
    def snr(self) -> dict[str, Tensor]:
        """``{name: param.shape}``: ``mean_n(g_n)**2 / (variance + 1e-12)``, elementwise."""
        return self._get("snr")  # type: ignore[return-value]

    def _get(self, key: str, quantity: str | None = None) -> object:
        quantity = quantity or key
        if quantity not in self.quantities:
            raise GradtapError(
                f"per_sample: {key!r} was not requested; pass quantities=(..., {quantity!r}) "
                f"(requested: {', '.join(self.quantities)})"
            )
        return self._totals.results(self.batch_size)[key]

    # -- lifecycle --------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every result and call count, ready for the next batch."""
        self._tap.clear()
        self._reset()

    def remove(self) -> None:
        """Remove every hook; results stay readable. Safe to call twice."""
        self._tap.remove()
        self._hooks.remove()
        for module in self._forwards:
            vars(module).pop("forward", None)
        self._forwards = []
        while self._swapped:
            _put_back(self._swapped.pop()[1])

    def __enter__(self) -> PerSample:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (f"<PerSample {len(self._spec.params)} parameters in {len(self._spec.owners)} modules, "
                f"quantities={self.quantities}>")


def _put_back(swaps: list[tuple[nn.Module, str, Tensor]]) -> None:
    """Undo ``_own_before``: the modules hold their parameters again."""
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

    def release(self) -> None:
        """Drop what was read (the hooks on the graph outlive the call's record)."""
        self._kept.clear()
        self._grads.clear()

    @property
    def grads(self) -> dict[str, Tensor]:
        return self._grads


def _own_forward(ref: weakref.ref[PerSample], name: str, module: nn.Module, forward: Any,
                 *args: Any, **kwargs: Any) -> Any:
    obj = ref()
    if obj is None:
        return type(module).forward(module, *args, **kwargs)
    return obj._own_forward_call(name, module, forward, args, kwargs)


class _Forward(Listener):
    """Hands the tap's calls and records on to a PerSample without keeping it alive."""

    def __init__(self, ref: weakref.ref[PerSample]) -> None:
        self._ref = ref

    def on_forward(self, name: str, call: int, module: nn.Module, inputs: dict[str, Tensor],
                   outputs: dict[str, Tensor]) -> None:
        _call(self._ref, "_on_forward", name, call, module, inputs, outputs)

    def on_record(self, record: GradRecord) -> None:
        _call(self._ref, "_on_record", record)


def _call(ref: weakref.ref[PerSample], method: str, *args: object) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)(*args)


def _call_kw(ref: weakref.ref[PerSample], method: str, name: str, module: nn.Module,
             args: tuple, kwargs: dict[str, Any]) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)(name, module, args, kwargs)


def per_sample(
    model: nn.Module,
    select: Selector = "*",
    *,
    loss_reduction: LossReduction = "mean",
    batch_dim: int = 0,
    quantities: Iterable[Quantity] = ("grad", "norm"),
    fallback: bool = True,
    own_grad: bool = False,
) -> PerSample:
    """Compute per-sample gradients, their norms and batch statistics during backward.

    Args:
        model: the model; its forward and backward run as usual inside the block.
        select: which parameters. A module selector (as for ``gt.tap``: a glob on module
            names, a list of globs, a module class or tuple of classes, a predicate
            ``(name, module) -> bool``) selects every parameter under the modules it picks;
            a glob also matches parameter names (``"fc.weight"``, ``"*.bias"``). ``"*"`` is
            every parameter. Parameters that do not require grad are skipped.
        loss_reduction: ``"mean"`` if the loss is ``(1/N) sum_n s_n``, ``"sum"`` if it is
            ``sum_n s_n``. Either way ``ps.grad[p].mean(0)`` (or ``.sum(0)``) equals ``p.grad``.
        batch_dim: the dim of every input tensor that indexes samples. An input whose size
            there is 1 while the batch has more samples, or that has fewer dims, is shared
            by all samples (position ids ``[1, T]``, a broadcast mask). The batch size is the
            size most of the model's tensor arguments have there.
        quantities: any of ``"grad"`` (``ps.grad``), ``"norm"`` (``ps.norm``, ``ps.norms``),
            ``"variance"``, ``"second_moment"``, ``"snr"``. Without ``"grad"``,
            ``[N, *shape]`` is not built where a closed form exists.
        fallback: replay calls under ``torch.func`` where no rule applies: a module without
            a rule (its own call), and parameters whose module's call cannot be split into
            samples (a shared input, samples folded with other rows, one call per sample,
            an output gradient that cannot be trusted, a use outside the module, per-sample
            gradients that do not add up to ``.grad``), which get theirs from the innermost
            enclosing call that can be replayed, with a warning naming the module. ``False``
            raises ``UnsupportedModuleError`` for modules without a rule, and makes the
            results name the other parameters in a ``GradtapError`` instead.
        own_grad: compute ``.grad`` here instead of in autograd, for the selected parameters
            whose every holding module has a rule. Their modules' calls that have one row
            per sample and an argument that requires grad use them detached (so autograd
            skips their batch weight gradients; ``MultiheadAttention`` then runs a forward of
            its own that reads its projections' gradients instead of replaying its core), and
            at the end of each backward the sum of those calls' per-sample gradients (times
            ``1/N`` for ``"mean"``) is added to ``.grad``, or set where it is ``None``. Other
            uses keep autograd's path and add to the same ``.grad``. Tensor hooks and
            post-accumulate-grad hooks of those parameters see only autograd's part; the
            added part carries no graph under ``create_graph=True`` (docs/semantics.md).

    Returns:
        A :class:`PerSample`, to use as a context manager; read its results after backward.

    Raises:
        SelectionError: ``select`` matches no parameter that requires grad.
        UnsupportedModuleError: a module couples its samples (BatchNorm in training mode),
            or has no rule and ``fallback=False``; in backward, a replay that draws random
            numbers (dropout in training mode).
        ValueError: a bad argument.
        GradtapError: when results are read, for parameters that no rule and no replay could
            give per-sample gradients (the message names each one, its module and why); with
            ``own_grad``, from backward, when an owned call's share of ``.grad`` could not be
            computed.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> with gt.per_sample(net, quantities=("grad", "norm", "variance")) as ps:
        ...     torch.nn.functional.cross_entropy(net(x), y).backward()
        >>> ps.grad["0.weight"].shape, ps.norm.shape
        (torch.Size([5, 4, 3]), torch.Size([5]))
        >>> torch.allclose(ps.grad["0.weight"].mean(0), net[0].weight.grad, atol=1e-6)
        True
        >>> expected = net[2].weight.grad.clone()
        >>> net.zero_grad()
        >>> with gt.per_sample(net, own_grad=True) as ps:   # .grad from the per-sample sums
        ...     torch.nn.functional.cross_entropy(net(x), y).backward()
        >>> torch.allclose(net[2].weight.grad, expected, atol=1e-6)
        True
    """
    return PerSample(model, select, loss_reduction=loss_reduction, batch_dim=batch_dim,
                     quantities=quantities, fallback=fallback, own_grad=own_grad)
