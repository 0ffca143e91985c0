"""The selected parameters and their owners, resolved once per model and reused while it is unchanged.

A training loop that opens ``with gt.per_sample(model) as ps:`` around every step (as the
README does) would otherwise select the parameters and resolve their owners (``owners``)
anew each step, a walk over every module and parameter. :func:`resolved_for` keeps the last
resolution of each model (per ``select``, ``batch_dim`` and ``fallback``) and gives it back
while the model is the same: the same modules and parameters under the same names, of the
same types, with the same ``requires_grad``, shapes, dtypes and devices, and the same rule
entries registered for the owners' types. Anything else resolves again. Each call gets its
own :class:`~gradtap._samples.owners.Owner` objects (their per-handle state is fresh),
and the checks that depend on a module's mode (BatchNorm in training mode, the layout a
rule requires of ``batch_dim``) run every time. A selector that is a predicate is resolved
every time: it may read anything.

The cache holds no reference to a module or a parameter (only weak ones and names), so it
never keeps a model alive.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from torch import nn

from gradtap._samples.owners import Owner, _rule_for, check_module, resolve_owners
from gradtap._samples.sketch import Sketches
from gradtap._types import Selector
from gradtap.errors import SelectionError
from gradtap.select import select_parameters

__all__ = ["Resolved", "resolved_for"]

#: Resolutions kept per model (distinct ``select``/``batch_dim``/``fallback``).
_PER_MODEL = 8


@dataclass
class Resolved:
    """The parameters a ``per_sample`` selects and what depends only on them."""

    params: dict[str, nn.Parameter]
    owners: dict[str, Owner]
    sketches: Sketches
    use_count: dict[str, int]  # qualified name -> how many owners hold it
    owners_of: dict[str, list[str]]  # qualified name -> names of its owners


@dataclass
class _Kept:
    """One resolution, without strong references to the model's modules or parameters."""

    fingerprint: tuple
    alive: list[weakref.ref]  # every module and parameter the fingerprint names by id
    params: dict[str, weakref.ref[nn.Parameter]]
    owners: dict[str, dict[str, Any]]  # owner name -> Owner's fields but the module
    sketches: Sketches
    use_count: dict[str, int]
    owners_of: dict[str, list[str]]


_KEPT: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, _Kept]] = weakref.WeakKeyDictionary()

# Owner fields that describe the model (kept); the others are per-handle state (fresh).
_STRUCTURE = ("name", "direct", "nested", "entry", "parametrized")


def _select_key(select: Selector) -> Hashable | None:
    """``select`` as a key, or ``None`` for a predicate (never cached)."""
    if isinstance(select, str):
        return ("glob", select)
    if isinstance(select, type):
        return ("types", (select,))
    if isinstance(select, (list, tuple)) and all(isinstance(s, str) for s in select):
        return ("globs", tuple(select))
    if isinstance(select, tuple) and all(isinstance(s, type) for s in select):
        return ("types", select)
    return None


def _fingerprint(model: nn.Module) -> tuple[tuple, list[Any]]:
    """What the resolution read of ``model``, and the objects it names by id."""
    modules = list(model.named_modules(remove_duplicate=False))
    params = list(model.named_parameters(remove_duplicate=False))
    mods = tuple((n, id(m), type(m)) for n, m in modules)
    prms = tuple((n, id(p), p.requires_grad, p.shape, p.dtype, p.device) for n, p in params)
    return (mods, prms), [m for _, m in modules] + [p for _, p in params]


def _resolve(model: nn.Module, select: Selector, batch_dim: int,
             fallback: bool) -> Resolved:
    selected = select_parameters(model, select)
    params = {n: p for n, p in selected if p.requires_grad}
    if not params:
        raise SelectionError(
            f"select={select!r} matches only parameters that do not require grad: "
            f"{', '.join(n for n, _ in selected)}"
        )
    owners = resolve_owners(model, params, batch_dim, fallback)
    use_count = {q: sum(q in o.direct.values() for o in owners.values()) for q in params}
    owners_of: dict[str, list[str]] = {}
    for owner in owners.values():
        for qual in owner.direct.values():
            owners_of.setdefault(qual, []).append(owner.name)
    return Resolved(params, owners, Sketches(params, owners), use_count, owners_of)


def _reused(kept: _Kept, model: nn.Module, fingerprint: tuple,
            batch_dim: int) -> Resolved | None:
    """``kept`` for ``model`` as it is now, or ``None`` when the model changed."""
    if kept.fingerprint != fingerprint or any(r() is None for r in kept.alive):
        return None
    modules = dict(model.named_modules())
    owners: dict[str, Owner] = {}
    for name, fields in kept.owners.items():
        module = modules.get(name)
        if module is None or _rule_for(module) is not fields["entry"]:
            return None  # a rule registered since for the owner's type
        owners[name] = Owner(module=module, name=name, entry=fields["entry"],
                             direct=dict(fields["direct"]), nested=dict(fields["nested"]),
                             parametrized={t: list(rels)
                                           for t, rels in fields["parametrized"].items()})
    params: dict[str, nn.Parameter] = {}
    for q, ref in kept.params.items():
        p = ref()
        if p is None:
            return None
        params[q] = p
    for owner in owners.values():  # modes may have changed (train / eval)
        check_module(owner.name, owner.module, batch_dim, owner.entry is None)
    return Resolved(params, owners, kept.sketches, kept.use_count, kept.owners_of)


def _keep(resolved: Resolved, fingerprint: tuple, objects: list[Any]) -> _Kept:
    return _Kept(
        fingerprint=fingerprint,
        alive=[weakref.ref(o) for o in objects],
        params={q: weakref.ref(p) for q, p in resolved.params.items()},
        owners={name: {f.name: getattr(o, f.name) for f in dataclasses.fields(o)
                       if f.name in _STRUCTURE}
                for name, o in resolved.owners.items()},
        sketches=resolved.sketches, use_count=resolved.use_count,
        owners_of=resolved.owners_of,
    )


def resolved_for(model: nn.Module, select: Selector, batch_dim: int,
                 fallback: bool) -> Resolved:
    """The parameters ``select`` picks in ``model`` that require grad, their owners, sketches
    and use counts: the kept resolution when the model is unchanged, else resolved again.

    Raises:
        SelectionError: ``select`` matches nothing, or only parameters that do not require
            grad.
        UnsupportedModuleError: an owner couples its samples, or has no rule and
            ``fallback=False``.
        ValueError: an owner's layout contradicts ``batch_dim``.
    """
    key = _select_key(select)
    if key is None:
        return _resolve(model, select, batch_dim, fallback)
    key = (key, batch_dim, bool(fallback))
    fingerprint, objects = _fingerprint(model)
    per_model = _KEPT.get(model)
    kept = per_model.get(key) if per_model is not None else None
    if kept is not None:
        reused = _reused(kept, model, fingerprint, batch_dim)
        if reused is not None:
            return reused
    resolved = _resolve(model, select, batch_dim, fallback)
    per_model = _KEPT.setdefault(model, {})
    per_model.pop(key, None)
    per_model[key] = _keep(resolved, fingerprint, objects)
    while len(per_model) > _PER_MODEL:
        del per_model[next(iter(per_model))]
    return resolved
