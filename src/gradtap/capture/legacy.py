"""The legacy ``register_backward_hook``, installed only to show which index a slot had there."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable

from torch import nn

from gradtap.capture.hookset import HookSet

__all__ = ["legacy_backward_grads"]


def legacy_backward_grads(modules: Iterable[tuple[str, nn.Module]]
                          ) -> tuple[HookSet, dict[str, list[tuple]]]:
    """Install the legacy ``register_backward_hook`` on ``modules`` to see its ``grad_input``.

    Used by ``explain(legacy=True)`` to tell users which index each slot had in the old API.
    Returns the hook set (remove it when done) and ``{name: [grad_input tuple per firing]}``.
    """
    seen: dict[str, list[tuple]] = {}
    hooks = HookSet()
    for name, module in modules:
        seen[name] = []

        def hook(mod: nn.Module, grad_input: tuple, grad_output: tuple, _name: str = name) -> None:
            if hooks.enabled:
                seen[_name].append(tuple(g.detach() if g is not None else None for g in grad_input))

        previous = module._is_full_backward_hook
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hooks.add(module.register_backward_hook(hook))
        # register_backward_hook flips this flag; put it back so no trace is left.
        hooks.add_cleanup(functools.partial(setattr, module, "_is_full_backward_hook", previous))
    return hooks, seen
