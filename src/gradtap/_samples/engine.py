"""The per-sample engine: per-sample gradients, their norms and their batch statistics.

:class:`PerSample` is what ``gt.per_sample`` returns (``gradtap._per_sample.api``).

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
trusted) get theirs from a replay of an enclosing call (``replays``, ``units``), with a warning
naming the module. After each backward, every parameter's per-sample gradients are checked to
reduce to that backward's increment of its ``.grad``; a parameter that fails is replayed too.

:class:`PerSample` installs the hooks and hands each event to the collaborator that owns
the state it touches (``spec``, ``frames``, ``own_grad``, ``accumulate``, ``check``,
``replays``: see the package docstring).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from gradtap._samples.accumulate import Step, Totals
from gradtap._samples.buffers import computing, pool_for
from gradtap._samples.check import check_sums
from gradtap._samples.clipped import Book, Clipped
from gradtap._samples.frames import Calls, samples_in, samples_of
from gradtap._samples.layout import split_call
from gradtap._samples.membership import Membership
from gradtap._samples.own_grad import OwnForward, OwnGrad, lost_error
from gradtap._samples.owners import check_module, describe, enclosing_modules
from gradtap._samples.replays import Replays
from gradtap._samples.shared import Shared
from gradtap._samples.sketch import Sketches
from gradtap._samples.spec import LossReduction, Quantity, Spec
from gradtap._samples.units import Frame, watch_outputs
from gradtap._types import Selector
from gradtap.capture import (
    HookSet,
    Listener,
    at_end_of_backward,
    compiled_feature,
    current_backward,
    tap,
)
from gradtap.errors import GradtapError
from gradtap.record import GradRecord

__all__ = ["PerSample", "Quantity"]


class PerSample:
    """Per-sample gradients and statistics of one model; see :func:`gradtap.per_sample`.

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
        book: Book | None = None,
    ) -> None:
        self._spec = spec = Spec(model, select, loss_reduction, batch_dim, quantities, fallback)
        self.loss_reduction = spec.loss_reduction
        self.batch_dim = spec.batch_dim
        self.quantities: tuple[Quantity, ...] = spec.quantities
        self.own_grad = bool(own_grad)
        self._hooks = HookSet()
        self._hooks.add_cleanup(spec.session.attach().detach)
        self._membership = Membership()
        self._hooks.add_cleanup(self._membership.end)
        if book is not None and not (own_grad and "grad" in spec.quantities):
            raise ValueError("per_sample: a book (clipped sums) needs own_grad=True and "
                             "quantities with 'grad'")
        self._book = spec.book = book
        self._own = OwnGrad(spec, self._hooks, self.own_grad, self._membership)
        self._replays = Replays(spec)
        self._pool = pool_for(spec.model)
        self._shared = Shared(self._membership, self._hooks, spec.batch_dim)
        self._busy = False  # per_sample computes: see _computing
        self._queued = False
        self.batch_size: int | None = None
        self._reset()
        owners = set(spec.owners)
        # Hooks must not keep this object alive: a reference cycle would hold every result
        # (hundreds of MB of per-sample gradients) until the cyclic garbage collector runs.
        me = weakref.ref(self)
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
            self._install(me)
        except BaseException:
            self.remove()
            raise

    def _install(self, me: weakref.ref[PerSample]) -> None:
        for name, module in enclosing_modules(self._spec.model, self._spec.owners):
            self._hooks.module_calls(
                module,
                functools.partial(_call, me, "_before", name, module),
                functools.partial(_call, me, "_after", name),
            )
            # Always, so that a forward that raises stops being followed.
            self._hooks.module_calls(module, None,
                                     functools.partial(_call, me, "_leave", name), always=True)
        for name, module, forward in self._own.claim():
            if forward is not None:
                self._own.replace_forward(module, functools.partial(_own_forward, me, name,
                                                                    module, forward))
                before = None
            else:
                before = functools.partial(_call, me, "_own_before", name, module)
            self._hooks.module_calls(module, before,
                                     functools.partial(_call, me, "_own_after", name),
                                     always=True)
        for qual, p in self._spec.params.items():
            handle = self._hooks.gradient(p, functools.partial(_call, me, "_on_increment", qual))
            if handle is not None:
                self._hooks.add(handle)

    @property
    def _sketches(self) -> Sketches:
        return self._spec.sketches

    @property
    def _ownable(self) -> dict[str, frozenset[str]]:
        return self._own.ownable

    def _reset(self) -> None:
        self.batch_size = None
        self._totals = Totals(self._spec)
        for owner in self._spec.owners.values():
            owner.calls = 0
            owner.seen = set()
        self._calls = Calls(self._spec, self._membership)
        self._shared.new_group()
        self._shared.new_backward()
        self._own.clear()
        if self._book is not None:
            self._book.clear()
        self._step = Step(self._spec)

    def _new_backward(self) -> None:
        """Forget what the last backward computed (merged already) and its increments."""
        self._step = Step(self._spec)
        self._own.new_backward()
        self._shared.new_backward()

    @contextmanager
    def _computing(self) -> Iterator[None]:
        """per_sample computes or replays: the calls and gradients its hooks see meanwhile (a
        replay's forward, a fallback's own backward) are not the model's."""
        self._busy = True
        try:
            with computing(self._pool):
                yield
        finally:
            self._busy = False

    # -- forward side -----------------------------------------------------------------------

    def _before(self, name: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        calls = self._calls
        if name == "":  # a new call of the model: leftovers are from a forward that raised
            calls.restart()
        # Calls inside a backward are checkpoint recomputations or replays, not new uses.
        new_use = (torch.is_grad_enabled() and current_backward() is None
                   and not self._busy)
        if new_use and calls.outside():
            self._forward_starts()
            who = describe(name, module)
            n = samples_of(who, module, args, kwargs, self.batch_dim)
            self._set_batch_size(who, n)
            self._membership.begin(name, split_call(module, args, kwargs, n,
                                                    self.batch_dim).batched())
        else:
            self._membership.enter(name)
        calls.enter(name, module, args, kwargs, new_use)

    def _after(self, name: str, output: Any) -> None:
        frame = self._calls.leave(name)
        if frame is None:
            return
        watch_outputs(frame, output, self._hooks,
                      functools.partial(_call, weakref.ref(self), "_on_frame_grad"))
        if self._calls.outside():
            self._calls.settle()

    def _leave(self, name: str, _output: Any) -> None:
        self._membership.leave(name)

    def _own_before(self, name: str, module: nn.Module, args: tuple,
                    kwargs: dict[str, Any]) -> None:
        self._own.before(name, module, args, kwargs, None if self._busy else self.batch_size)

    def _own_after(self, name: str, _output: Any) -> None:
        self._own.after(name)

    def _own_forward_call(self, name: str, module: nn.Module, forward: OwnForward,
                          args: tuple, kwargs: dict[str, Any]) -> Any:
        return self._own.forward_call(name, module, forward, args, kwargs,
                                      None if self._busy else self.batch_size)

    def _forward_starts(self) -> None:
        if self._calls.group_over():
            self._calls.new_group()
            self._own.new_group()
            self._shared.new_group()

    def _set_batch_size(self, who: str, n: int) -> None:
        if self.batch_size is None:
            self.batch_size = n
        elif n != self.batch_size:
            raise ValueError(
                f"per_sample: {who} got {n} samples along batch_dim={self.batch_dim}, but an "
                f"earlier call had {self.batch_size}; call ps.clear() between batches"
            )

    def _on_forward(self, name: str, call: int, module: nn.Module, inputs: dict[str, Tensor],
                    outputs: dict[str, Tensor]) -> None:
        if self._busy:
            return
        owner = self._spec.owners[name]
        owner.calls += 1
        check_module(name, module, self.batch_dim, owner.entry is None)
        frames = self._calls.running()
        if not frames:  # called outside the model's own call
            self._forward_starts()
            if self.batch_size is None:
                self.batch_size = samples_in(name, inputs, self.batch_dim)
        self._own.called(name, call)
        self._calls.on_forward(owner, call, module, frames, inputs, outputs, self.batch_size)
        self._shared.watch(owner, call, inputs, outputs, self.batch_size)

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
        if self._busy or not frame.keep:
            return
        frame.grads[path] = grad if path not in frame.grads else frame.grads[path] + grad
        self._queue_end()

    def _on_increment(self, qual: str, grad: Tensor) -> None:
        if self._busy:
            return
        self._queue_end()
        self._own.autograd_added(qual)
        self._step.increment(qual, grad)

    def _on_record(self, rec: GradRecord) -> None:
        if self._busy:
            return
        owner = self._spec.owners[rec.module_name]
        self._queue_end()
        n = self.batch_size
        if n == 0:
            return  # an empty batch: nothing to split (_end_of_backward)
        own = self._own.take(rec.module_name, rec.call)
        if own is not None:
            assert n is not None
            with self._computing():
                self._own.record(owner, rec, own, n, self._step)
            return
        names = self._calls.names_for(owner, rec)
        if names:
            call = self._calls.arguments(rec)
            with self._computing():
                self._step.add_call(owner, rec, names, n, call)  # type: ignore[arg-type]
            return
        shared = self._shared.record(owner, rec)
        names = self._calls.shared_names(owner, rec) if shared is not None else {}
        if names:
            assert n is not None
            with self._computing():
                self._step.add_call(owner, shared, names, n, None)  # type: ignore[arg-type]
            self._shared.answered(list(names.values()))

    def _end_of_backward(self) -> None:
        self._queued = False
        step, n = self._step, self.batch_size
        lost = self._own.write()
        try:
            if n == 0:  # an empty batch: [0, *shape] for every parameter
                step.grad = {q: p.new_zeros((0, *p.shape)) for q, p in self._spec.params.items()}
            elif n is not None and step.increments:
                # Shared calls answered in closed form at every use are checked like the
                # others; those whose meetings missed part of their gradient are replayed.
                closed = self._shared.closed(self._calls.direct_calls)
                flagged = {q: why for q, why in self._calls.flagged.items() if q not in closed}
                for q in closed & self._shared.incomplete(step.largest):
                    step.late.setdefault(q, (self._calls.flagged[q][0], "its shared output "
                                             "met the batch outside an add, sub or mul"))
                late = check_sums(self._spec, step, n, self._own.owned_only(),
                                  set(flagged) | set(step.late))
                suspects = {**flagged, **step.late, **late}
                bad = {q: why for q, why in suspects.items() if q in step.increments}
                for q in suspects:
                    step.discard(q)
                    if self._book is not None:  # the replay gives it
                        self._book.drop(q)
                if bad:
                    with self._computing():
                        self._replays.run(bad, n, step, self._totals, self._calls.uses)
            self._totals.merge(step)
        finally:
            self._new_backward()
            self._calls.end_backward()
            self._pool.settle()
        if lost:
            raise lost_error(lost)

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

    @property
    def clipped(self) -> Clipped:
        """The squared per-sample norms and the weighted sums ``sum_n c_n g_n`` of every
        parameter, from closed forms where the calls were booked (``book=``), else from
        per-sample gradients (``_samples.clipped``); ``[N, *shape]`` is built only for the
        parameters that are not booked.

        Raises:
            GradtapError: no backward yet, or a parameter got no per-sample gradients.
        """
        if self._book is None:
            raise GradtapError("per_sample: clipped sums need a book (book=Book())")
        if self.batch_size is None:
            self._totals.raise_failed()
            raise GradtapError("per_sample: no per-sample gradient was computed yet")
        self._totals.raise_failed()
        return Clipped(self._book, self._totals.grad, self._spec.params, self.batch_size)

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
        """Forget every result and call count, ready for the next batch.

        A forward made before and not yet through a backward stays pending: the results
        after its backward are that backward's alone (and with ``own_grad`` its calls' share
        of ``.grad`` is still written), as if the forward had come after the clear.
        """
        if self._calls.pending():
            self._totals = Totals(self._spec)
            self._step = Step(self._spec)
            return
        self._tap.clear()
        self._reset()

    def remove(self) -> None:
        """Remove every hook; results stay readable. Safe to call twice."""
        self._tap.remove()
        self._hooks.remove()
        self._own.remove()

    def __enter__(self) -> PerSample:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        spec = self._spec
        return (f"<PerSample {len(spec.params)} parameters in {len(spec.owners)} modules, "
                f"quantities={self.quantities}>")


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
