"""Compiled models: the per-call hooks of a tap run only in eager code.

Dynamo compiles a module's forward with the hooks it had then, and does not notice hooks
added later, so per-call records cannot come from compiled code. A tap on a compiled model
(``torch.compile(model)``, or ``module.compile()`` on the model or a submodule holding a
tapped module) therefore runs that compiled code eagerly while the tap is active, and says so
once, in a :class:`UserWarning`. Removing the tap restores the compiled call.

Features that need no per-call hook (the parameter kinds of ``Monitor``, ``transform``'s
``when="accumulate"``/``"step"``, ``detect``'s default screen) never come here: they keep the
compiled forward as it is.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import nn

from gradtap.capture import compat
from gradtap.select import wrapper_chain

__all__ = ["around_compiled_call", "compiled_feature", "compiled_in_place", "compiled_parts",
           "run_eagerly"]

# Which feature a tap made now serves, for the warning (None: say nothing).
_FEATURE: ContextVar[str | None] = ContextVar("gradtap_compiled_feature", default="gt.tap")


@contextmanager
def compiled_feature(name: str | None) -> Iterator[None]:
    """Name the feature the taps made in this block serve, for the warning on a compiled
    model; ``None`` makes them silent (a replay, or a one-off such as ``explain``)."""
    token = _FEATURE.set(name)
    try:
        yield
    finally:
        _FEATURE.reset(token)


def compiled_parts(model: nn.Module, root: nn.Module,
                   modules: list[nn.Module]) -> list[nn.Module]:
    """The compiled wrappers or compiled modules whose compiled call would hide ``modules``:
    ``model`` itself when it is (or wraps) a ``torch.compile`` wrapper, and every module of ``root``
    compiled in place (``module.compile()``) that is or holds one of ``modules``."""
    parts: list[nn.Module] = []
    # the compile wrapper, also inside a DDP wrapper
    parts.extend(m for m in wrapper_chain(model) if compat.is_compile_wrapper(m))
    wanted = {id(m) for m in modules}
    for module in root.modules():
        if compiled_in_place(module) and any(
                id(m) in wanted for m in module.modules()):
            parts.append(module)
    return parts


class _Hold:
    """What gradtap changed on one compiled part, and what it called before (put back when
    nothing is held any more)."""

    def __init__(self, part: nn.Module) -> None:
        self.part = part
        self.eager = 0  # taps that need the part's code to run eagerly
        self.outer: list[tuple[OuterBefore, OuterAfter]] = []  # calls around the compiled call
        self.wrapper = "_orig_mod" in part.__dict__["_modules"]  # torch.compile's wrapper
        self.saved: Any = part.__dict__["forward"] if self.wrapper else compat.compiled_call(part)

    def install(self) -> None:
        part = self.part
        if self.wrapper:  # hooks on the wrapper run outside compiled code already
            orig = part.__dict__["_modules"]["_orig_mod"]
            part.forward = orig.__call__ if self.eager else self.saved
            return
        inner = None if self.eager else self.saved
        if not self.outer:
            compat.set_compiled_call(part, inner)
            return
        outer = list(self.outer)
        run = inner if inner is not None else part._call_impl

        def call(*args: Any, **kwargs: Any) -> Any:
            for before, _ in outer:
                if before is not None:
                    before(args, kwargs)
            output = run(*args, **kwargs)
            for _, after in outer:
                after(output)
            return output

        compat.set_compiled_call(part, call)

    def idle(self) -> bool:
        return self.eager == 0 and not self.outer


_HOLDS: weakref.WeakKeyDictionary[nn.Module, _Hold] = weakref.WeakKeyDictionary()
OuterBefore = Callable[[tuple, dict], None] | None
OuterAfter = Callable[[Any], None]


def _change(part: nn.Module, change: Callable[[_Hold], None]) -> None:
    hold = _HOLDS.get(part)
    if hold is None:
        hold = _HOLDS[part] = _Hold(part)
    change(hold)
    hold.install()
    if hold.idle():
        del _HOLDS[part]


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` compiled ``module``'s call (hooks included)."""
    hold = _HOLDS.get(module)
    if hold is not None:
        return not hold.wrapper
    return compat.compiled_call(module) is not None


def around_compiled_call(module: nn.Module, before: OuterBefore, after: OuterAfter
                         ) -> Callable[[], None]:
    """Run ``before(args, kwargs)`` and ``after(output)`` around each call of ``module``, a
    module compiled in place, outside its compiled code (as hooks on a ``torch.compile``
    wrapper run): no graph break. Returns the removal."""
    entry = (before, after)
    _change(module, lambda h: h.outer.append(entry))
    removed = False

    def remove() -> None:
        nonlocal removed
        if not removed:
            removed = True
            _change(module, lambda h: h.outer.remove(entry))

    return remove


def run_eagerly(model: nn.Module, root: nn.Module, modules: list[tuple[str, nn.Module]]
                ) -> Callable[[], None] | None:
    """Run the compiled code around ``modules`` eagerly until the returned release is called
    (``None``: nothing around them is compiled). Warns once, naming the feature, unless the
    feature was set to ``None`` by :func:`compiled_feature`."""
    parts = compiled_parts(model, root, [m for _, m in modules])
    if not parts:
        return None

    def more(h: _Hold) -> None:
        h.eager += 1

    def fewer(h: _Hold) -> None:
        h.eager -= 1

    for part in parts:
        _change(part, more)
    feature = _FEATURE.get()
    if feature is not None:
        warnings.warn(_message(feature, model, root, parts, modules), UserWarning,
                      stacklevel=_caller_level())
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            for part in parts:
                _change(part, fewer)

    return release


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside gradtap (and contextlib): the user's
    line that made the feature."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)  # run_eagerly, stacklevel 1
    level = 1
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(here)
                                        or frame.f_code.co_filename == contextlib.__file__):
        frame = frame.f_back
        level += 1
    return level


def _message(feature: str, model: nn.Module, root: nn.Module, parts: list[nn.Module],
             modules: list[tuple[str, nn.Module]]) -> str:
    names = {id(m): n for n, m in root.named_modules()}
    where = []
    for part in parts:
        if part is model and part is not root:
            where.append(f"the compiled model ({type(root).__name__})")
        else:
            name = names.get(id(part), "")
            where.append("the model" if name == "" else f"module {name!r}")
    shown = [repr(n) if n else "the model's own call" for n, _ in modules[:4]]
    more = f" and {len(modules) - 4} more" if len(modules) > 4 else ""
    return (f"gradtap: {feature} on a compiled model runs {', '.join(where)} eagerly while it "
            f"is active: its per-call records need forward hooks on {', '.join(shown)}{more}, "
            "which compiled code does not run. The compiled code is used again once it is "
            "removed. Monitor's parameter kinds, transform(when='accumulate' or 'step') and "
            "detect's default screen keep the compiled forward.")
