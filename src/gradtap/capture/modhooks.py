"""One forward pre-hook and one forward hook per module, however many consumers listen.

Every consumer that needs a module's calls (a tap's per-call records, per-sample frames,
detect's screen) subscribes here instead of registering its own hooks: the first subscriber
of a module registers the module's two hooks, the last one to leave removes them, and each
call runs the subscribers in the order they subscribed, as separate hooks would (so the
model runs the same code whether one consumer or five watch it).

A subscriber's ``before(module, args, kwargs)`` may return ``(args, kwargs)`` to replace the
call's arguments (later subscribers and the call see the replacement) and its
``after(module, args, kwargs, output)`` may return a replacement output. ``always=True``
subscribers also run when the call raised (with ``output=None``), as
``register_forward_hook(always_call=True)`` hooks do; the others do not.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["Subscription", "hook_counts", "subscribe"]

Before = Callable[[nn.Module, tuple, dict], Any]
After = Callable[[nn.Module, tuple, dict, Any], Any]


class Subscription:
    """One subscriber's pair of functions on one module; :meth:`remove` unsubscribes."""

    __slots__ = ("after", "always", "before", "_hub")

    def __init__(self, hub: _Hub, before: Before | None, after: After | None,
                 always: bool) -> None:
        self._hub: _Hub | None = hub
        self.before, self.after, self.always = before, after, always

    def remove(self) -> None:
        """Unsubscribe (the module's hooks go with the last subscriber); safe to call twice."""
        hub, self._hub = self._hub, None
        if hub is not None:
            hub.discard(self)


class _Hub:
    """The two hooks of one module and its subscribers, in subscription order."""

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)
        self.subs: tuple[Subscription, ...] = ()
        self.handles: list[RemovableHandle] = [
            module.register_forward_pre_hook(self.pre, with_kwargs=True),
            module.register_forward_hook(self.post, with_kwargs=True, always_call=True),
        ]

    def pre(self, mod: nn.Module, args: tuple, kwargs: dict) -> Any:
        replaced = False
        for sub in self.subs:
            if sub.before is not None:
                out = sub.before(mod, args, kwargs)
                if out is not None:
                    args, kwargs = out
                    replaced = True
        return (args, kwargs) if replaced else None

    def post(self, mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        # torch calls always_call hooks from its exception handler when the call raised (with
        # the output still None); only "always" subscribers run then.
        raised = output is None and sys.exc_info()[1] is not None
        replaced = False
        for sub in self.subs:
            if sub.after is not None and (sub.always or not raised):
                out = sub.after(mod, args, kwargs, output)
                if out is not None:
                    output, replaced = out, True
        return output if replaced else None

    def discard(self, sub: Subscription) -> None:
        self.subs = tuple(s for s in self.subs if s is not sub)
        if not self.subs:
            for handle in self.handles:
                handle.remove()
            module = self.module()
            if module is not None and _HUBS.get(module) is self:
                del _HUBS[module]


_HUBS: weakref.WeakKeyDictionary[nn.Module, _Hub] = weakref.WeakKeyDictionary()


def subscribe(module: nn.Module, before: Before | None, after: After | None, *,
              always: bool = False) -> Subscription:
    """Run ``before`` and ``after`` around each call of ``module`` (see the module docstring).

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> a = subscribe(lin, None, lambda m, args, kwargs, out: print("a"))
        >>> b = subscribe(lin, None, lambda m, args, kwargs, out: print("b"))
        >>> _ = lin(torch.ones(2))
        a
        b
        >>> hook_counts(lin)
        (1, 1)
        >>> a.remove(); b.remove(); hook_counts(lin)
        (0, 0)
    """
    hub = _HUBS.get(module)
    if hub is None:
        hub = _HUBS[module] = _Hub(module)
    sub = Subscription(hub, before, after, always)
    hub.subs = (*hub.subs, sub)
    return sub


def hook_counts(module: nn.Module) -> tuple[int, int]:
    """The number of forward pre-hooks and forward hooks on ``module`` (gradtap's and any
    other's)."""
    return len(module._forward_pre_hooks), len(module._forward_hooks)
