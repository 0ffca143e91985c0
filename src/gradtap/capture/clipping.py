"""The gradient clips of a process: ``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_``
and ``clip_grads_with_norm_`` (and their names in ``torch.nn.utils.clip_grad``), seen around
each call.

A consumer that must see the gradients *before* a script clips them (``gradtap watch``, the
framework callbacks) subscribes ``around(clip)``: it is called instead of the clip with a
:class:`Clip` that says what the call was asked (which tensors, ``max_norm`` or
``clip_value``) and whose :meth:`Clip.run` runs the real clip once. Whatever ``around`` does,
the script's call runs exactly once with the arguments it was given and returns (or raises)
what it would have: if ``around`` fails before running it, it runs afterwards; an error of
``around`` itself never reaches the script (it is given to ``on_error``). A clip called
inside another (``clip_grad_norm`` calling ``clip_grad_norm_``) is not seen again. Libraries
that clip through these functions are seen too: Lightning's ``gradient_clip_val`` and
Accelerate's ``Accelerator.clip_grad_norm_`` (what the Hugging Face Trainer calls).
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["Clip", "around_any_clip"]

# (module, attribute name, what the clip does)
_TARGETS = (
    ("torch.nn.utils", "clip_grad_norm_", "norm"),
    ("torch.nn.utils", "clip_grad_norm", "norm"),
    ("torch.nn.utils", "clip_grad_value_", "value"),
    ("torch.nn.utils", "clip_grads_with_norm_", "with_norm"),
    ("torch.nn.utils.clip_grad", "clip_grad_norm_", "norm"),
    ("torch.nn.utils.clip_grad", "clip_grad_norm", "norm"),
    ("torch.nn.utils.clip_grad", "clip_grad_value_", "value"),
)

_inside = threading.local()


@dataclass
class Clip:
    """One call of a gradient clip, as :func:`around_any_clip` shows it.

    Attributes:
        kind: ``"norm"`` (``clip_grad_norm_``: the total norm of all the gradients, scaled by
            ``min(1, max_norm / (total + 1e-6))``), ``"with_norm"`` (``clip_grads_with_norm_``:
            the same with the caller's ``total_norm``) or ``"value"`` (``clip_grad_value_``:
            each element clamped to ``[-clip_value, clip_value]``).
        parameters: the tensors passed (their ``.grad`` is clipped).
        max_norm, norm_type, clip_value: the call's arguments (``None`` where not given).
        total_norm: the caller's ``total_norm`` (``"with_norm"``).
        result: what the clip returned, once :meth:`run` ran (the total norm for ``"norm"``).
    """

    kind: str
    parameters: list[Tensor]
    max_norm: float | None = None
    norm_type: float = 2.0
    clip_value: float | None = None
    total_norm: Tensor | None = None
    result: Any = None
    _run: Callable[[], Any] | None = field(default=None, repr=False)
    ran: bool = False
    error: BaseException | None = field(default=None, repr=False)

    def run(self) -> Any:
        """Run the real clip (once; a second call returns the first result)."""
        if not self.ran:
            self.ran = True
            assert self._run is not None
            try:
                self.result = self._run()
            except BaseException as exc:
                self.error = exc
                raise
        elif self.error is not None:
            raise self.error
        return self.result

    def factor(self) -> Tensor | None:
        """The factor the clip multiplied every gradient by (0-dim tensor, no host sync), as
        torch computes it: ``min(1, max_norm / (total + 1e-6))``; ``None`` for ``"value"`` or
        before :meth:`run`."""
        total = self.norm()
        if not self.ran or total is None:
            return None
        assert self.max_norm is not None
        return torch.clamp(self.max_norm / (total + 1e-6), max=1.0)

    def norm(self) -> Tensor | None:
        """The total norm the clip scaled by (``None`` for ``"value"``); a DTensor's (FSDP2)
        as one whole tensor."""
        total = self.result if self.kind == "norm" else self.total_norm
        if not isinstance(total, Tensor):
            return None
        full = getattr(total, "full_tensor", None)  # every rank clips: a symmetric collective
        return (full() if callable(full) else total).detach()


def _tensors(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    return [parameters] if isinstance(parameters, Tensor) else list(parameters)


class _Subscriber:
    __slots__ = ("around", "live", "on_error")

    def __init__(self, around: Callable[[Clip], None], live: Callable[[], bool],
                 on_error: Callable[[BaseException], None]) -> None:
        self.around = around
        self.live = live
        self.on_error = on_error


# Every subscriber of the process, in order; the wrappers are on while there is one.
_SUBSCRIBERS: list[_Subscriber] = []
_ORIGINALS: list[tuple[Any, str, Callable[..., Any], Callable[..., Any]]] = []


def _through(sub: _Subscriber, call: Clip) -> Any:
    """Run ``call`` through one subscriber: its ``around``, then the clip if it did not."""
    try:
        sub.around(call)
    except BaseException as exc:
        if call.error is not None or not isinstance(exc, Exception):
            raise  # the clip's own error (or an interrupt), as without the wrapper
        sub.on_error(exc)
    return call.run()


def _wrap(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def clip(*args: Any, **kwargs: Any) -> Any:
        subs = [] if getattr(_inside, "on", False) else [s for s in _SUBSCRIBERS if s.live()]
        if not subs:
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # torch says what is wrong
        values = bound.arguments
        params = _tensors(values["parameters"])
        values["parameters"] = params  # a generator is read once, here
        args, kwargs = bound.args, bound.kwargs

        def level(i: int) -> Any:
            if i == len(subs):
                return original(*args, **kwargs)
            call = Clip(kind, params, _number(values.get("max_norm")),
                        float(values.get("norm_type", 2.0)), _number(values.get("clip_value")),
                        values.get("total_norm") if kind == "with_norm" else None,
                        _run=lambda: level(i + 1))
            return _through(subs[i], call)

        _inside.on = True
        try:
            return level(0)
        finally:
            _inside.on = False

    clip.__wrapped__ = original  # type: ignore[attr-defined]
    clip.__doc__ = original.__doc__
    clip.__name__ = getattr(original, "__name__", "clip")
    clip.__qualname__ = getattr(original, "__qualname__", clip.__name__)
    return clip


def _number(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _install() -> None:
    import importlib

    for module_name, attr, kind in _TARGETS:
        module = importlib.import_module(module_name)
        original = getattr(module, attr, None)
        if original is not None:
            wrapped = _wrap(original, kind)
            setattr(module, attr, wrapped)
            _ORIGINALS.append((module, attr, original, wrapped))


def _uninstall() -> None:
    for module, attr, original, wrapped in reversed(_ORIGINALS):
        if getattr(module, attr, None) is wrapped:  # not replaced since by someone else
            setattr(module, attr, original)
    _ORIGINALS.clear()


def around_any_clip(around: Callable[[Clip], None], live: Callable[[], bool],
                    on_error: Callable[[BaseException], None]) -> Callable[[], None]:
    """Call ``around(clip)`` in place of every gradient clip of the process while ``live()``
    (see the module docstring); returns the function that ends the subscription. Several
    subscribers nest: the first one's ``clip.run()`` goes through the next, the last one's
    runs the real clip. The functions are wrapped while there is a subscriber.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(4))
        >>> w.grad = torch.full((4,), 2.0)
        >>> seen = []
        >>> def around(clip):
        ...     seen.append(float(clip.parameters[0].grad.norm()))  # before the clip
        ...     clip.run()
        >>> stop = around_any_clip(around, lambda: True, print)
        >>> float(torch.nn.utils.clip_grad_norm_([w], 1.0)), seen
        (4.0, [4.0])
        >>> stop()
    """
    sub = _Subscriber(around, live, on_error)
    if not _SUBSCRIBERS:
        _install()
    _SUBSCRIBERS.append(sub)

    def stop() -> None:
        if sub in _SUBSCRIBERS:
            _SUBSCRIBERS.remove(sub)
            if not _SUBSCRIBERS:
                _uninstall()

    return stop
