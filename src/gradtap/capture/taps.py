"""``gt.tap``: per-call gradient records of selected modules, and the hooks on those modules.

In backward the node hooks of :mod:`gradtap.capture.forward` see exactly "the gradient this
call sent to that input or parameter" and "the gradient w.r.t. the output as produced", even
when an in-place op later rewrote the output, when the module is itself in place, or when the
module is called twice. A call's record is finished when all its hooked nodes ran, or at the
end of the backward.

Nothing is written onto modules or parameters, and removing the tap leaves no hook behind.
Node hooks already attached to a recorded graph check an ``enabled`` flag, because they can
still fire after removal while that graph is alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from gradtap._types import KeepLiteral, Selector
from gradtap.capture import compat
from gradtap.capture.compiled import run_eagerly
from gradtap.capture.forward import alias_repeated, note_inputs, note_outputs
from gradtap.capture.hookset import HookSet
from gradtap.capture.listener import Listener
from gradtap.capture.modhooks import subscribe
from gradtap.capture.naming import ModuleInfo
from gradtap.capture.replay import in_recomputation, stands_aside
from gradtap.capture.sessions import session
from gradtap.capture.state import Call, Recorder
from gradtap.record import GradRecord

__all__ = ["Tap", "tap"]

RecordCallback = Callable[[GradRecord], None]


class Tap:
    """Live capture of per-call gradient records; see :func:`tap`."""

    def __init__(
        self,
        model: nn.Module,
        select: Selector = "*",
        *,
        keep: Iterable[KeepLiteral] = (),
        to: torch.device | str | None = None,
        on_record: RecordCallback | None = None,
        store: bool = True,
        listener: Listener | None = None,
    ) -> None:
        kept = (keep,) if isinstance(keep, str) else tuple(keep)
        unknown = sorted(set(kept) - {"inputs", "outputs"})
        if unknown:
            raise ValueError(f"keep= accepts 'inputs' and 'outputs'; got {unknown}")
        if listener is not None and not isinstance(listener, Listener):
            raise TypeError("tap(listener=...) needs a gradtap.capture.Listener; got "
                            f"{type(listener).__name__}")
        self._recorder = Recorder(listener, on_record, store, "inputs" in kept,
                                  "outputs" in kept, torch.device(to) if to is not None else None)
        self._hooks = HookSet()
        self._infos: list[ModuleInfo] = []
        sess = session(model, "tap()").attach()
        self._hooks.add_cleanup(sess.detach)
        try:
            self.modules = sess.modules(select)
            for name, module in self.modules:
                self._attach(name, module)
            release = run_eagerly(model, sess.root, self.modules)
            if release is not None:
                self._hooks.add_cleanup(release)
        except BaseException:
            self.remove()
            raise

    # -- public -----------------------------------------------------------------------------

    @property
    def records(self) -> list[GradRecord]:
        """The finished records (with ``store=True``), in the order their backward completed."""
        return self._recorder.records

    @property
    def names(self) -> list[str]:
        """Qualified names of the tapped modules, in ``named_modules()`` order."""
        return [name for name, _ in self.modules]

    def find(self, name: str) -> list[GradRecord]:
        """Return the records of module ``name``, one per call, in call order."""
        if name not in self.names:
            raise KeyError(_unknown_name(name, self.names))
        return sorted((r for r in self.records if r.module_name == name), key=lambda r: r.call)

    def clear(self) -> None:
        """Drop the records and restart every module's call count at 0."""
        self._recorder.records = []
        for info in self._infos:
            info.calls = 0

    def remove(self) -> None:
        """Remove every hook; the model is left exactly as it was. Safe to call twice."""
        self._recorder.enabled = False
        self._hooks.remove()

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self._recorder.enabled else "removed"
        return f"<Tap {state}: {len(self.modules)} modules, {len(self.records)} records>"

    # -- forward hooks ----------------------------------------------------------------------

    def _attach(self, name: str, module: nn.Module) -> None:
        info = ModuleInfo(name, module)
        self._infos.append(info)
        rec = self._recorder
        open_calls: list[Call | None] = []  # a stack: a module may call itself recursively

        def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
            # Cheapest guards first.
            if not (rec.enabled and torch.is_grad_enabled()) or stands_aside(rec.listener):
                open_calls.append(None)
                return None
            if in_recomputation():
                # An activation checkpoint's recomputation: nothing to record (its graph only
                # refills saved tensors), but it must compute as the forward did, aliases
                # included, or the checkpoint finds other tensors saved.
                open_calls.append(None)
                return alias_repeated(info, args, kwargs)
            call = Call(info, info.calls)
            info.calls += 1
            if info.sharded:  # FSDP2 has swapped its unsharded parameters in by now
                call.param_ids = {id(p): n for n, p in mod.named_parameters()}
            replaced = note_inputs(rec, call, args, kwargs)
            call.start = compat.sequence_nr()
            open_calls.append(call)
            return replaced

        def forward_hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            call = open_calls.pop() if open_calls else None
            if call is None:
                return None
            return note_outputs(rec, call, mod, output)

        self._hooks.add(subscribe(module, pre_hook, forward_hook, always=True))


def tap(
    model: nn.Module,
    select: Selector = "*",
    *,
    keep: Iterable[KeepLiteral] = (),
    to: torch.device | str | None = None,
    on_record: RecordCallback | None = None,
    store: bool = True,
    listener: Listener | None = None,
) -> Tap:
    """Record, per module call, every gradient its backward touched, under readable names.

    Gradients are always kept; forward tensors only when ``keep`` asks. The graph and every
    gradient are left unchanged (bit for bit), in-place ops before or after the module are
    fine, and activation-checkpoint recomputations add no records.

    Args:
        model: the model to tap.
        select: which modules (see :mod:`gradtap.select`); ``"*"`` is every submodule.
        keep: ``"inputs"`` and/or ``"outputs"`` to keep forward tensors in the records.
        to: a device to move everything the records hold to (e.g. ``"cpu"``).
        on_record: called with each record as it completes (possibly inside backward).
        store: keep records in ``.records``; ``False`` only passes them to ``on_record``
            (and the listener).
        listener: a :class:`~gradtap.capture.Listener` told of each forward call and record,
            which may also rewrite gradients as the backward runs (how gradtap's own
            consumers use a tap).

    A compiled model (``torch.compile(model)``, ``model.compile()``) is accepted and named as
    the model it compiles; while the tap is active its compiled code runs eagerly (the
    per-call hooks run only in eager code), which a :class:`UserWarning` says once.

    Returns:
        A :class:`Tap`; use it as a context manager or call ``.remove()``.

    Raises:
        SelectionError: ``select`` matched no module.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        >>> with gt.tap(net) as t:
        ...     net(torch.randn(2, 3)).sum().backward()
        >>> [(r.module_name, sorted(r.param_grads)) for r in t.records]
        [('2', ['bias', 'weight']), ('1', []), ('0', ['bias', 'weight'])]
    """
    return Tap(model, select, keep=keep, to=to, on_record=on_record, store=store, listener=listener)


def _unknown_name(name: str, names: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, names, n=5)
    hint = f"; closest tapped modules: {', '.join(close)}" if close else ""
    return f"{name!r} is not a tapped module{hint}"
