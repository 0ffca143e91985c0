"""Turn a user's selector into (qualified name, module) or (qualified name, parameter) pairs.

Accepted selectors (everywhere a ``select=`` appears):

* a glob on qualified names, matched with :func:`fnmatch.fnmatchcase` (``*`` crosses dots):
  ``"features.*"``, ``"layer?.*.conv*"``; ``"*"`` is every submodule, and the root module
  (whose name is ``""``) is selected only by ``""``;
* a list or tuple of globs (each must match something, so a typo cannot pass silently);
* a module class or a tuple of module classes (``isinstance``);
* a predicate ``(qualified_name, module) -> bool``.

A selector that matches nothing raises :class:`~gradtap.errors.SelectionError` naming the
closest real names.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar, cast

from torch import nn

from gradtap._types import Selector
from gradtap.errors import SelectionError

__all__ = ["clean_name", "select_modules", "select_parameters", "unwrap_model", "wrapper_chain"]

#: Wrapper classes (by name, anywhere in the class's MRO) and the attribute holding the model
#: they wrap: DDP, DataParallel, torch.compile, FSDP1, activation checkpointing.
_WRAPPERS = {
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "OptimizedModule": "_orig_mod",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
    "_LightningModuleWrapperBase": "module",
    "_FabricModule": "module",
}
#: Name components that only wrappers add; :func:`clean_name` drops them.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

T = TypeVar("T")


def select_modules(model: nn.Module, selector: Selector) -> list[tuple[str, nn.Module]]:
    """Return the ``(qualified_name, module)`` pairs of ``model`` that ``selector`` picks.

    Args:
        model: the model whose ``named_modules()`` are searched.
        selector: a glob, a list of globs, a module class or tuple of classes, or a predicate
            ``(name, module) -> bool``.

    Returns:
        The selected pairs, in ``named_modules()`` order, each module once.

    Raises:
        SelectionError: nothing matched (the message lists the closest names).
        TypeError: ``selector`` is not one of the accepted kinds.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> [name for name, _ in select_modules(net, "*")]
        ['0', '1', '2']
        >>> [name for name, _ in select_modules(net, nn.Linear)]
        ['0', '2']
    """
    named = list(unwrap_model(model).named_modules())
    return _select(named, selector, what="module", type_of=lambda m: m)


def select_parameters(model: nn.Module, selector: Selector) -> list[tuple[str, nn.Parameter]]:
    """Return the ``(qualified_name, parameter)`` pairs of ``model`` that ``selector`` picks:
    the one meaning of ``select=`` wherever parameters are meant.

    A module selector (as in :func:`select_modules`: a glob on module names, a list of globs,
    a module class or tuple of classes, a predicate ``(name, module) -> bool``) selects every
    parameter under each module it picks. A glob also selects the parameters whose own name
    (from ``named_parameters()``) it matches, so ``"fc"``, ``"fc.*"`` and ``"fc.weight"`` all
    work (``"*"`` is every parameter). Each glob must match a module or a parameter. A
    parameter held by several modules (tied weights) is named once, by its
    ``named_parameters()`` name, whichever module selected it.

    Returns:
        ``(qualified_name, parameter)`` pairs in ``named_parameters()`` order, each once.

    Raises:
        SelectionError: nothing matched (the message lists the closest names).
        TypeError: ``selector`` is not one of the accepted kinds.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> [name for name, _ in select_parameters(net, "*.bias")]
        ['0.bias', '2.bias']
        >>> [name for name, _ in select_parameters(net, "0")]
        ['0.weight', '0.bias']
        >>> [name for name, _ in select_parameters(net, ["2", "*.bias"])]
        ['0.bias', '2.weight', '2.bias']
        >>> [name for name, _ in select_parameters(net, nn.Linear)][:2]
        ['0.weight', '0.bias']
    """
    model = unwrap_model(model)
    named_params = list(model.named_parameters())
    picked: set[int] = set()
    globs: list[str] | None = None
    if isinstance(selector, str):
        globs = [selector]
    elif isinstance(selector, Sequence) and all(isinstance(s, str) for s in selector):
        globs = [str(s) for s in selector]
    if globs is not None:
        if not globs:
            raise SelectionError("empty list of globs selects no module or parameter")
        modules = list(model.named_modules())
        for glob in globs:
            hit_modules = [m for n, m in modules if _glob_match(n, glob)]
            hit_params = [p for n, p in named_params if _glob_match(n, glob)]
            if not hit_modules and not hit_params:
                raise SelectionError(_no_match_either(glob, [n for n, _ in modules],
                                                      [n for n, _ in named_params]))
            picked.update(id(p) for p in hit_params)
            picked.update(id(p) for m in hit_modules for p in m.parameters())
    else:
        picked.update(id(p) for _, m in select_modules(model, selector) for p in m.parameters())
    return [(n, p) for n, p in named_params if id(p) in picked]


def _select(
    named: list[tuple[str, T]],
    selector: Selector,
    *,
    what: str,
    type_of: Callable[..., object] | None,
) -> list[tuple[str, T]]:
    names = [name for name, _ in named]
    if isinstance(selector, str):
        return _by_globs(named, [selector], what)
    if isinstance(selector, type) or (
        isinstance(selector, tuple) and selector and all(isinstance(s, type) for s in selector)
    ):
        classes = selector if isinstance(selector, tuple) else (selector,)
        if type_of is None:
            raise TypeError(f"a module class selects modules, not {what}s")
        if what == "module":
            picked = [(n, o) for n, o in named if n and isinstance(o, classes)]
        else:
            picked = [(n, o) for n, o in named if isinstance(type_of(n), classes)]
        if not picked:
            present = sorted({type(o).__name__ for _, o in named}) if what == "module" else []
            wanted = ", ".join(c.__name__ for c in classes)
            hint = f"; module types present: {', '.join(present)}" if present else ""
            raise SelectionError(f"no {what} of type {wanted} in the model{hint}")
        return picked
    if isinstance(selector, Sequence) and all(isinstance(s, str) for s in selector):
        if not selector:
            raise SelectionError(f"empty list of globs selects no {what}")
        return _by_globs(named, [str(s) for s in selector], what)
    if callable(selector):
        accepts = cast(Callable[[str, object], bool], selector)  # modules or parameters
        picked = [(n, o) for n, o in named if accepts(n, o)]
        if not picked:
            raise SelectionError(
                f"the predicate {getattr(selector, '__name__', selector)!r} selected no {what} "
                f"among {len(names)} {what}s ({_preview(names)})"
            )
        return picked
    raise TypeError(
        f"select= must be a glob string, a list of globs, a module class or tuple of classes, "
        f"or a callable (name, {what}) -> bool; got {type(selector).__name__}"
    )


def _by_globs(named: list[tuple[str, T]], globs: list[str], what: str) -> list[tuple[str, T]]:
    picked: dict[str, T] = {}
    for glob in globs:
        if not isinstance(glob, str):
            raise TypeError(f"globs must be strings; got {type(glob).__name__}")
        hits = [(n, o) for n, o in named if _glob_match(n, glob)]
        if not hits:
            raise SelectionError(_no_match_message(glob, [n for n, _ in named], what))
        for n, o in hits:
            picked.setdefault(n, o)
    order = {n: i for i, (n, _) in enumerate(named)}
    return sorted(picked.items(), key=lambda item: order[item[0]])


def _glob_match(name: str, glob: str) -> bool:
    # The root module's name is "", which fnmatch("*") would match: only "" selects it.
    if name == "":
        return glob == ""
    return fnmatch.fnmatchcase(name, glob)


def _no_match_message(glob: str, names: Iterable[str], what: str) -> str:
    real = [n for n in names if n]
    close = difflib.get_close_matches(glob, real, n=5, cutoff=0.5)
    if not close:
        # Globs like "layer9.*" are far from every name by edit distance; their literal prefix
        # is a better key.
        stem = glob.split("*")[0].split("?")[0].split("[")[0]
        close = [n for n in real if stem and n.startswith(stem.rsplit(".", 1)[0])][:5]
    hint = f"closest {what} names: {', '.join(close)}" if close else f"{what} names: {_preview(real)}"
    if not real and what == "module":
        hint = "the model has no submodules; the root module is selected by select=''"
    return f"select={glob!r} matches no {what}; {hint}"


def _no_match_either(glob: str, modules: list[str], params: list[str]) -> str:
    """The message for a glob that matches neither a module nor a parameter, naming the
    closest parameter names, or the closest names of either kind when a module is close."""
    close_params = difflib.get_close_matches(glob, [n for n in params if n], n=5, cutoff=0.5)
    close_modules = difflib.get_close_matches(glob, [n for n in modules if n], n=5, cutoff=0.5)
    if close_params and not close_modules:
        return (f"select={glob!r} matches no parameter; closest parameter names: "
                f"{', '.join(close_params)}")
    if close_modules:
        return _no_match_message(glob, [*modules, *params], "module or parameter")
    return (f"select={glob!r} matches no module or parameter: it matches no parameter name and "
            f"no module name (parameter names: {_preview(params)})")


def _preview(names: list[str], limit: int = 8) -> str:
    shown = [n for n in names if n][:limit]
    more = len([n for n in names if n]) - len(shown)
    return ", ".join(shown) + (f", ... ({more} more)" if more > 0 else "") if shown else "(none)"


def wrapper_chain(model: nn.Module) -> list[nn.Module]:
    """``model`` and every training wrapper inside it, outermost first, ending with the user's
    model (see :func:`unwrap_model`).

    Example:
        >>> from torch import nn
        >>> net = nn.Linear(2, 1)
        >>> [type(m).__name__ for m in wrapper_chain(nn.DataParallel(net))]
        ['DataParallel', 'Linear']
    """
    chain = [model]
    seen = {id(model)}
    while True:
        inner = None
        for cls in type(model).__mro__:
            attr = _WRAPPERS.get(cls.__name__)
            found = getattr(model, attr, None) if attr else None
            if isinstance(found, nn.Module):
                inner = found
                break
        if inner is None or id(inner) in seen:
            return chain
        seen.add(id(inner))
        chain.append(inner)
        model = inner


def unwrap_model(model: nn.Module, *, keep_compiled: bool = False) -> nn.Module:
    """The user's model inside training wrappers: ``DistributedDataParallel`` and
    ``DataParallel`` (``.module``), ``torch.compile`` (``._orig_mod``), FSDP1
    (``._fsdp_wrapped_module``), checkpoint wrappers and Lightning's and Fabric's module
    wrappers, however deeply nested at the root. FSDP2's ``fully_shard`` does not wrap (the
    model is returned as it is). With ``keep_compiled=True`` it stops at the outermost
    ``torch.compile`` wrapper, whose hooks run outside compiled code.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Linear(2, 1)
        >>> unwrap_model(nn.DataParallel(net)) is net
        True
        >>> unwrap_model(torch.compile(net, backend="eager")) is net
        True
    """
    chain = wrapper_chain(model)
    if keep_compiled:
        return next((m for m in chain if "_orig_mod" in m._modules), chain[-1])
    return chain[-1]


def clean_name(name: str) -> str:
    """``name`` without the components wrappers insert inside a model (``_orig_mod``,
    ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``).

    Example:
        >>> clean_name("layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.attn.weight")
        'layers.0.attn.weight'
    """
    if "_" not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)

