"""Tensors autograd saved for backward, read back for a report once something went wrong.

A consumer keeps :func:`graph_nodes` of some tensors (opaque handles that keep their part of
the graph alive) and later asks :func:`saved_tensors` for what that graph saved: a forward
tensor gone from Python is often still there, saved for backward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from gradtap.capture import compat

__all__ = ["behind_unpack_hook", "graph_nodes", "saved_tensors"]


def graph_nodes(tensors: Iterable[Tensor]) -> list[Any]:
    """The autograd nodes that made ``tensors`` (leaves and tensors without grad have none);
    opaque handles for :func:`saved_tensors`."""
    return [fn for fn in (t.grad_fn for t in tensors) if fn is not None]


def saved_tensors(roots: list[Any], limit: int = 5000) -> dict[int, list[Tensor]]:
    """Tensors saved for backward by the graph behind ``roots`` (from :func:`graph_nodes`), by
    ``data_ptr()``.

    Only used to report exact counts once something is wrong. A saved tensor behind an unpack
    hook is left out: what its hook returns is a new tensor, not the one measured (an
    activation checkpoint recomputes it, an offload copies it back), and reading it can use up
    what the backward needs (a non-reentrant checkpoint unpacks each saved tensor once per
    backward).

    Example:
        >>> import torch
        >>> x = torch.randn(3, requires_grad=True)
        >>> y = x.exp()  # exp saves its result
        >>> found = saved_tensors(graph_nodes([y]))
        >>> list(found) == ([y.data_ptr()] if compat.saved_tensors_readable() else [])
        True
    """
    found: dict[int, list[Tensor]] = {}
    if not compat.saved_tensors_readable():
        return found
    seen: set[Any] = set()
    stack = list(roots)
    while stack and len(seen) < limit:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                if behind_unpack_hook(node, attr):
                    continue
                value = getattr(node, attr)
            except Exception:  # noqa: BLE001 - freed, or modified in place since
                continue
            for x in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(x, Tensor) and x.layout == torch.strided:
                    found.setdefault(x.data_ptr(), []).append(x)
        try:
            stack.extend(n for n, _ in node.next_functions if n is not None)
        except RuntimeError:  # a custom Function's node, released after its backward
            continue
    return found


def behind_unpack_hook(node: Any, attr: str) -> bool:
    """Whether reading ``node.<attr>`` (a ``_saved_*`` attribute) would run an unpack hook.

    True where this torch's saved tensors do not say (no ``SavedTensor.unpack_hook``): reading
    one could run a hook (an activation checkpoint's recomputation), so none is read.
    """
    raw = getattr(node, "_raw" + attr, None)
    if raw is None:  # not a saved tensor (a size, a scalar), or freed
        return False
    for r in raw if isinstance(raw, (tuple, list)) else (raw,):
        if compat.saved_tensor_hook_known(r) is not False:  # hooked, or this torch cannot say
            return True
    return False
