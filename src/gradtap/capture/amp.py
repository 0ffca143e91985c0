"""What a ``torch.amp.GradScaler`` did to the gradients of this step: a :class:`ScalerWatch`.

Under mixed precision the gradients a backward leaves in ``p.grad`` are ``scale * g``;
``scaler.unscale_(opt)`` (called by the user, or by ``scaler.step(opt)`` for an optimizer
that does not take the scale itself) divides the gradients of ``opt`` by the scale in place,
and a fused optimizer (``_step_supports_amp_scaling``) receives ``grad_scale``/``found_inf``:
its gradients are still scaled when its ``step()`` starts (what a pre-step hook sees), and
torch's fused optimizers write the unscaled gradient back as they step (a skipped step leaves
them scaled). The watch follows those calls on one scaler, so a consumer
can ask, at any point of a step, which factor a parameter's ``.grad`` still carries
(:meth:`ScalerWatch.factor`), the scale of the step (:meth:`ScalerWatch.step_scale`) and
whether the scaler found an inf/NaN and skipped the optimizer step
(:meth:`ScalerWatch.found_inf`).

The scaler's ``scale``, ``unscale_``, ``step`` and ``update`` are wrapped on the instance
(one wrapper per scaler, shared by every watch on it) and restored when the last watch is
removed. A step starts at the first ``scaler.scale(...)`` after ``scaler.update()``; what a
step recorded stays readable after ``update()`` until then, so a consumer may run before or
after ``unscale_``, ``step`` and ``update``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gradtap.capture import compat

__all__ = ["ScalerWatch", "around_any_scaler_step", "check_scaler", "unscale"]

_METHODS = ("scale", "unscale_", "step", "update")


def check_scaler(scaler: Any, owner: str) -> None:
    """Raise ``TypeError`` unless ``scaler`` is ``None`` or a ``torch.amp.GradScaler``."""
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"{owner}: scaler= must be a torch.amp.GradScaler (or None); got "
                        f"{type(scaler).__name__}")


class _Tracker:
    """The shared state of one scaler: the wrappers and what the current step recorded."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.watches = 0
        self.scale: Tensor | None = None  # the scale the step's gradients were multiplied by
        self.unscaled: set[int] = set()  # ids of parameters whose .grad was unscaled
        self.found: dict[int, Tensor] = {}  # found_inf per optimizer id, this step
        self.fused: dict[int, Tensor] = {}  # parameter id -> factor left by a fused step
        self.updated = False  # update() ran: the next scale() starts a new step
        self._saved: dict[str, Any] = {}
        for name in _METHODS:
            if name in vars(scaler):
                self._saved[name] = original = vars(scaler)[name]
            else:  # bound late: a wrapper of the class's method made later still runs
                original = functools.partial(_class_method, scaler, name)
            wrapped = getattr(self, f"_wrap_{name.rstrip('_')}")(original)
            setattr(scaler, name, _Wrapper(wrapped, scaler, name))

    def restore(self) -> None:
        for name in _METHODS:
            if name in self._saved:
                setattr(self.scaler, name, self._saved[name])
            else:
                vars(self.scaler).pop(name, None)

    # -- wrappers -------------------------------------------------------------------------

    def _wrap_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def scale(outputs: Any) -> Any:
            out = original(outputs)
            if not self.scaler.is_enabled():  # a disabled scaler keeps no state
                return out
            if self.updated or self.scale is None:
                self.updated = False
                self.unscaled = set()
                self.found = {}
                self.fused = {}
            self.scale = compat.scaler_scale(self.scaler).clone()
            return out

        return scale

    def _wrap_unscale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def unscale_(optimizer: torch.optim.Optimizer) -> None:
            original(optimizer)
            if not self.scaler.is_enabled():
                return
            self._note_found(optimizer)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    self.unscaled.add(id(p))

        return unscale_

    def _wrap_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            out = original(optimizer, *args, **kwargs)
            if not self.scaler.is_enabled():
                return out
            self._note_found(optimizer)
            found = self.found.get(id(optimizer))
            if (compat.steps_with_scale(optimizer) and found is not None
                    and self.scale is not None):
                # The fused step unscaled the gradients it did not unscale before, unless
                # it was skipped: the factor left is scale on a skipped step, else 1.
                left = torch.where(found > 0, self.scale, torch.ones_like(self.scale))
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if id(p) not in self.unscaled:
                            self.fused[id(p)] = left
            return out

        return step

    def _wrap_update(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def update(new_scale: Any = None) -> None:
            if not self.scaler.is_enabled():
                original(new_scale)
                return
            # update() sums the found_inf tensors in place: keep copies first.
            for key, found in compat.scaler_found_infs(self.scaler).items():
                if found:
                    self.found[key] = _total(found)
            original(new_scale)
            self.updated = True

        return update

    def _note_found(self, optimizer: torch.optim.Optimizer) -> None:
        state = compat.scaler_optimizer_state(self.scaler, optimizer)
        if state is not None and state[0]:
            self.found[id(optimizer)] = _total(state[0])


class _Wrapper:
    """A scaler method as wrapped; pickled (with the scaler, e.g. by ``torch.save``) as the
    scaler's own method, so a copy is a plain scaler."""

    __slots__ = ("fn", "scaler", "name")

    def __init__(self, fn: Callable[..., Any], scaler: torch.amp.GradScaler, name: str) -> None:
        self.fn, self.scaler, self.name = fn, scaler, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _own_method, (self.scaler, self.name)


def _own_method(scaler: torch.amp.GradScaler, name: str) -> Any:
    return getattr(type(scaler), name).__get__(scaler)


def _class_method(scaler: torch.amp.GradScaler, name: str, *args: Any, **kwargs: Any) -> Any:
    return getattr(type(scaler), name)(scaler, *args, **kwargs)


def _total(found: list[Tensor]) -> Tensor:
    out = found[0].detach().to(torch.float32).clone()
    for f in found[1:]:
        out += f.to(out.device, torch.float32)
    return out.reshape(())


def around_any_scaler_step(before: Callable[[Any, Any], None], after: Callable[[Any, Any], None],
                           live: Callable[[], bool]) -> Callable[[], None]:
    """Run ``before(scaler, optimizer)`` and ``after(scaler, optimizer)`` around every
    ``torch.amp.GradScaler.step(optimizer)`` of the process while ``live()``; returns the
    function that takes the wrapper off again.

    A step the scaler skips for an inf/NaN never calls ``optimizer.step()``: this is where a
    consumer that follows every optimizer of a process still sees it. The class's ``step`` is
    wrapped (instances watched by :class:`ScalerWatch` call through it).
    """
    cls = torch.amp.GradScaler
    original = cls.step

    def step(self: torch.amp.GradScaler, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not live():
            return original(self, optimizer, *args, **kwargs)
        before(self, optimizer)
        out = original(self, optimizer, *args, **kwargs)
        after(self, optimizer)
        return out

    step.__wrapped__ = original  # type: ignore[attr-defined]
    step.__doc__ = original.__doc__
    cls.step = step  # type: ignore[method-assign]

    def restore() -> None:
        if cls.__dict__.get("step") is step:
            cls.step = original  # type: ignore[method-assign]

    return restore


_TRACKERS: weakref.WeakKeyDictionary[torch.amp.GradScaler, _Tracker] = weakref.WeakKeyDictionary()


def unscale(value: Tensor, factor: Tensor | None) -> Tensor:
    """``value`` divided by a loss scale ``factor`` (``None``: returned as it is), in float32
    at least (a float16 gradient times its scale may not be representable) and on ``value``'s
    device, with no host synchronisation: the one unscaling formula of every consumer.

    Example:
        >>> import torch
        >>> unscale(torch.tensor([8.0], dtype=torch.float16), torch.tensor(8.0))
        tensor([1.])
    """
    if factor is None:
        return value
    dtype = torch.promote_types(value.dtype, torch.float32)
    return value.to(dtype) / factor.to(value.device, dtype)


class ScalerWatch:
    """A consumer's view of one scaler's step (see the module docstring); :meth:`remove` it.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        >>> watch = ScalerWatch(scaler)
        >>> scaler.scale(w.sum()).backward()
        >>> float(watch.factor(w)), float(w.grad[0])
        (8.0, 8.0)
        >>> scaler.unscale_(opt)
        >>> watch.factor(w) is None, float(w.grad[0])
        (True, 1.0)
        >>> watch.remove()
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        tracker = _TRACKERS.get(scaler)
        if tracker is None:
            tracker = _TRACKERS[scaler] = _Tracker(scaler)
        tracker.watches += 1
        self._tracker: _Tracker | None = tracker
        self.scaler = scaler

    @property
    def enabled(self) -> bool:
        """Whether the scaler scales at all (a disabled scaler leaves gradients as they are)."""
        return self.scaler.is_enabled()

    def step_scale(self) -> Tensor | None:
        """The scale this step's gradients were multiplied by (a 0-dim float32 tensor on the
        scaler's device), or ``None`` when the scaler is disabled."""
        if not self.enabled:
            return None
        t = self._tracker
        if t is not None and t.scale is not None:
            return t.scale
        return compat.scaler_scale(self.scaler).clone()

    def factor(self, param: Tensor) -> Tensor | None:
        """The factor ``param.grad`` still carries (0-dim float32: the step's scale; after a
        fused optimizer's step, 1 unless the step was skipped), or ``None`` when it was
        unscaled already (or the scaler is disabled)."""
        t = self._tracker
        if not self.enabled or (t is not None and id(param) in t.unscaled):
            return None
        if t is not None and id(param) in t.fused:
            return t.fused[id(param)]
        return self.step_scale()

    def sync(self, optimizer: torch.optim.Optimizer) -> None:
        """Take in what the scaler already did in this step to ``optimizer``'s gradients
        before the first watch on it started (an ``unscale_``), so :meth:`factor` is right
        for a watch made in the middle of a step."""
        t = self._tracker
        if t is None or not self.enabled:
            return
        state = compat.scaler_optimizer_state(self.scaler, optimizer)
        if state is None or not state[1]:
            return
        t._note_found(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                t.unscaled.add(id(p))

    def unscaled(self, value: Tensor, param: Tensor | None = None) -> Tensor:
        """``value`` (a gradient of ``param``, or its norm) without the factor the scaler left
        on ``param.grad`` (:meth:`factor`; without ``param``, the step's scale, which every
        gradient of the step's backward carries): see :func:`unscale`."""
        return unscale(value, self.step_scale() if param is None else self.factor(param))

    def found_inf(self) -> Tensor | None:
        """The number of optimizers (0-dim float32) whose gradients the scaler found inf/NaN in
        this step, or ``None`` when it has checked none yet (before ``unscale_``/``step``)."""
        t = self._tracker
        if t is None or not t.found:
            return None
        vals = list(t.found.values())
        return _total(vals)

    def remove(self) -> None:
        """Stop watching; the scaler's own methods are back once no watch is left."""
        t, self._tracker = self._tracker, None
        if t is None:
            return
        t.watches -= 1
        if t.watches == 0:
            t.restore()
            _TRACKERS.pop(t.scaler, None)
