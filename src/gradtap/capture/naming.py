"""Names of a call's slots: arguments by the forward signature's names, parameters as named."""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterable

from torch import Tensor, nn

from gradtap.record import flatten_tensors

__all__ = ["ModuleInfo", "argument_tensors", "flat_arguments"]


class ModuleInfo:
    """What a tap needs to know about one selected module, resolved once."""

    __slots__ = ("name", "type_name", "param_names", "param_by_id", "positional", "varargs",
                 "clone_inputs", "calls", "module_ref", "empty_param_grads", "sharded")

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module_ref = weakref.ref(module)
        self.type_name = user_class(module).__name__
        named = list(module.named_parameters())
        self.param_names = [n for n, _ in named]
        self.param_by_id = {id(p): n for n, p in named}
        self.empty_param_grads: dict[str, Tensor | None] = dict.fromkeys(self.param_names)
        # Sharded parameters (FSDP2's DTensors) are swapped for unsharded ones during the
        # forward: a call notes the parameters the module holds when it begins.
        self.sharded = _has_dtensor(p for _, p in named)
        self.positional, self.varargs = _argument_names(module)
        # An in-place module overwrites its input: a kept input must be copied before the call.
        self.clone_inputs = bool(getattr(module, "inplace", False))
        self.calls = 0

    def arg_name(self, index: int) -> str:
        if index < len(self.positional):
            return self.positional[index]
        return f"{self.varargs or 'args'}.{index - len(self.positional)}"


def user_class(module: nn.Module) -> type:
    """The module's own class, not the subclass ``fully_shard`` (``FSDPLinear``) or the
    composable ``replicate`` made of it at run time.

    Example:
        >>> import torch
        >>> user_class(torch.nn.Linear(2, 2)).__name__
        'Linear'
    """
    cls = type(module)
    bases = cls.__bases__
    if (len(bases) == 2 and cls.__name__.endswith(bases[1].__name__)
            and bases[0].__name__ in ("FSDPModule", "ReplicateModule", "DDP")):
        return bases[1]
    return cls


def _has_dtensor(params: Iterable[Tensor]) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists unless imported
    return dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in params)


def _argument_names(module: nn.Module) -> tuple[tuple[str, ...], str | None]:
    forward = module.forward
    func = getattr(forward, "__func__", None)
    if func is not None and getattr(forward, "__self__", None) is not None:
        return _cached(func, bound=True)  # a bound method: its function's names, once
    return _cached(forward, bound=False)


#: A function -> its names as (unbound, bound), held weakly: a forward assigned to one
#: module (a closure over it) is not kept alive by the cache after the module is gone.
_NAMES: weakref.WeakKeyDictionary[Callable, dict[bool, tuple[tuple[str, ...], str | None]]] = \
    weakref.WeakKeyDictionary()


def _cached(function: Callable, bound: bool) -> tuple[tuple[str, ...], str | None]:
    try:
        per = _NAMES.setdefault(function, {})
    except TypeError:  # not weakly referenceable, or not hashable: read each time
        return _names_of(function, bound)
    if bound not in per:
        per[bound] = _names_of(function, bound)
    return per[bound]


def _names_of(function: Callable, bound: bool) -> tuple[tuple[str, ...], str | None]:
    """The positional argument names and the ``*args`` name of ``function`` (its first
    positional one, ``self``, left out when ``bound``)."""
    try:
        sig = inspect.signature(function)
    except (TypeError, ValueError):
        return (), "args"
    params = list(sig.parameters.values())
    if bound and params and params[0].kind in (params[0].POSITIONAL_ONLY,
                                               params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]
    positional: list[str] = []
    varargs = None
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            varargs = p.name
    return tuple(positional), varargs


def argument_tensors(module: nn.Module) -> Callable[[tuple, dict], list[tuple[str, Tensor]]]:
    """A function of a call's ``(args, kwargs)`` to ``module`` giving ``(name, tensor)`` for
    every tensor argument, named as the records name them (the forward signature's names).

    Example:
        >>> import torch
        >>> names = argument_tensors(torch.nn.Bilinear(2, 2, 1))
        >>> [k for k, _ in names((torch.ones(1, 2),), {"input2": torch.ones(1, 2)})]
        ['input1', 'input2']
    """
    return functools.partial(flat_arguments, ModuleInfo("", module))


def flat_arguments(info: ModuleInfo, args: tuple, kwargs: dict) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` for every tensor in a call's arguments, named as in the records."""
    if not kwargs and all(isinstance(a, Tensor) for a in args):  # the common case, fast
        return [(info.arg_name(i), a) for i, a in enumerate(args)]
    flat = [(path, t) for i, a in enumerate(args)
            for path, t in flatten_tensors(a, info.arg_name(i), under_prefix=True)]
    flat += [(path, t) for k, v in kwargs.items()
             for path, t in flatten_tensors(v, k, under_prefix=True)]
    return flat
