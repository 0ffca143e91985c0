"""The stateful transform type: ``Transform(init, update)``, ``stateless`` and ``chain``.

A transform is a pair of pure functions on one tensor (optax's shape, applied per tensor):

* ``init(param) -> state`` builds the state for one parameter (or, for activation
  gradients, for one module output/input slot, from the first gradient seen there);
* ``update(grad, state, param, **extra) -> (new_grad, new_state)`` returns the transformed
  gradient and the next state.

Transforms know nothing about modules, names or hooks: :func:`gradtap.transform` does that.
They never modify ``grad`` in place (they return a new tensor) but may update their own state
tensors in place. State holds only tensors, numbers, strings, ``None`` and tuples/lists/dicts
of them, so ``torch.save`` followed by ``torch.load(weights_only=True)`` restores it.

A transform may also offer ``update_many(grads, states, params, **extra) -> (new_grads,
new_states)`` over every tensor one rule matched (lists, in plan order).
:func:`gradtap.transform` uses it with ``when="step"``, where all those gradients are known at
once. A transform whose per-tensor ``update`` cannot be meaningful (``clip_global_norm``) is
*group-only*: it can only run through ``update_many``, which :func:`gradtap.transform` also
calls at the end of each backward with ``when="accumulate"``.

Built-in transforms may carry three more marks on their ``update`` (``chain`` combines them):
the factor their state reports (:func:`factor_fn`, read by ``TransformHandle.last_factors``),
the keyword extras they need from the driver (:func:`needs`: ``"optimizer"``, ``"param"``),
and whether, with ``when="accumulate"``, the driver should run them through ``update_many``
over the parameters each backward reached (:func:`is_batched`) rather than one by one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from torch import Tensor

__all__ = ["Transform", "chain", "factor_fn", "group_only_name", "is_batched", "is_group_only",
           "needs", "stateless"]

#: A transform's state: tensors, numbers, strings, None, and tuples/lists/dicts of them.
State = Any

# Marker set on the per-tensor ``update`` of group-only transforms (and of chains holding one),
# so gradtap.transform can refuse them before any backward runs. Its value names the transform.
_GROUP_ONLY = "_gradtap_group_only"
# ``state -> 0-dim factor`` of transforms that report what they multiplied the gradient by.
_FACTOR = "_gradtap_factor"
# Keyword extras a transform needs from the driver (a frozenset of names).
_NEEDS = "_gradtap_needs"
# Run through update_many over the parameters a backward reached (when="accumulate").
_BATCHED = "_gradtap_batched"


class InitFn(Protocol):
    """``init(param) -> state``."""

    def __call__(self, param: Tensor, /) -> State: ...


class UpdateFn(Protocol):
    """``update(grad, state, param, **extra) -> (new_grad, new_state)``."""

    def __call__(
        self, grad: Tensor, state: State, param: Tensor | None, /, **extra: Any
    ) -> tuple[Tensor, State]: ...


class UpdateManyFn(Protocol):
    """``update_many(grads, states, params, **extra) -> (new_grads, new_states)``."""

    def __call__(
        self,
        grads: Sequence[Tensor],
        states: Sequence[State],
        params: Sequence[Tensor | None],
        /,
        **extra: Any,
    ) -> tuple[list[Tensor], list[State]]: ...


class Transform(NamedTuple):
    """A stateful gradient transform: ``init(param) -> state`` and ``update``.

    ``update(grad, state, param, **extra)`` returns ``(new_grad, new_state)``. It must not
    modify ``grad`` in place; it may update its own state tensors in place. Extra context is
    keyword-only: :func:`gradtap.transform` passes ``optimizer=`` to a transform that needs it
    (:func:`needs`), and :func:`chain` passes each member only the keywords its ``update``
    (or ``update_many``) accepts, so ``update(grad, state, param)`` without ``**extra`` is fine. For activation gradients there is no parameter:
    ``init`` receives the first gradient seen at that slot and ``update`` receives
    ``param=None``.

    Args:
        init: ``param -> state``. State holds only tensors, numbers and tuples/dicts of them.
        update: ``(grad, state, param, **extra) -> (new_grad, new_state)``.
        update_many: optional; the same over every tensor one rule matched (lists in plan
            order). Used by :func:`gradtap.transform` with ``when="step"`` when present,
            and at the end of each backward with ``when="accumulate"`` for group-only
            transforms.

    Example:
        >>> import torch
        >>> import gradtap as gt
        >>> halve = gt.Transform(init=lambda p: (), update=lambda g, s, p: (g / 2, s))
        >>> g, s = halve.update(torch.ones(2), halve.init(torch.zeros(2)), None)
        >>> g
        tensor([0.5000, 0.5000])
    """

    init: InitFn
    update: UpdateFn
    update_many: UpdateManyFn | None = None


def is_group_only(t: Transform) -> bool:
    """Return True when ``t`` needs every tensor of its rule at once (``update_many`` only)."""
    return bool(getattr(t.update, _GROUP_ONLY, False))


def group_only_name(t: Transform) -> str:
    """The name of the group-only transform in ``t`` (for messages), e.g. ``"clip_global_norm"``."""
    name = getattr(t.update, _GROUP_ONLY, None)
    return name if isinstance(name, str) else "this transform"


def factor_fn(t: Transform) -> Callable[[State], Tensor] | None:
    """``state -> 0-dim factor`` the gradient was last multiplied by, or None when ``t`` does
    not report one."""
    return getattr(t.update, _FACTOR, None)


def needs(t: Transform) -> frozenset[str]:
    """Keyword extras ``t`` needs from the driver: ``"optimizer"`` (passed as ``optimizer=``),
    ``"param"`` (a parameter, so no activation gradients)."""
    return getattr(t.update, _NEEDS, frozenset())


def is_batched(t: Transform) -> bool:
    """Whether ``when="accumulate"`` runs ``t`` through ``update_many`` at the end of a backward."""
    return bool(getattr(t.update, _BATCHED, False))


def _mark_group_only(fn: Callable[..., Any], name: str = "clip_global_norm") -> Callable[..., Any]:
    setattr(fn, _GROUP_ONLY, name)
    return fn


def _mark(fn: Callable[..., Any], *, factor: Callable[[State], Tensor] | None = None,
          needs: frozenset[str] = frozenset(), batched: bool = False) -> Callable[..., Any]:
    """Set the marks of :func:`factor_fn`, :func:`needs` and :func:`is_batched` on ``fn``."""
    if factor is not None:
        setattr(fn, _FACTOR, factor)
    if needs:
        setattr(fn, _NEEDS, frozenset(needs))
    if batched:
        setattr(fn, _BATCHED, True)
    return fn


def _empty_init(param: Tensor) -> tuple[()]:
    return ()


def stateless(fn: Callable[[Tensor, Tensor | None], Tensor]) -> Transform:
    """Make a transform without state from ``fn(grad, param) -> new_grad``.

    The state is the empty tuple ``()``. ``fn`` must return a new tensor, not modify ``grad``.

    Args:
        fn: ``(grad, param) -> new_grad``; ``param`` is None for activation gradients.

    Returns:
        A :class:`Transform`.

    Raises:
        TypeError: ``fn`` is not callable.

    Example:
        >>> import torch
        >>> import gradtap as gt
        >>> sign = gt.stateless(lambda g, p: g.sign())
        >>> sign.update(torch.tensor([-2.0, 3.0]), (), None)[0]
        tensor([-1.,  1.])
    """
    if not callable(fn):
        raise TypeError(f"stateless(fn): fn must be callable (grad, param) -> grad; got {type(fn).__name__}")

    def update(grad: Tensor, state: State, param: Tensor | None, /, **extra: Any) -> tuple[Tensor, State]:
        return fn(grad, param), state

    return Transform(_empty_init, update)


def chain(*parts: Transform) -> Transform:
    """Compose transforms: the gradient goes through ``parts`` in order, left to right.

    The state is the tuple of the members' states. Keyword extras are forwarded to every
    member that accepts them (a ``**extra`` parameter, or a parameter of that name; a user
    transform written ``update(grad, state, param)`` gets none). If any member offers ``update_many`` the chain does too (members without it run
    per tensor inside it); if any member is group-only (``clip_global_norm``) the chain is too.

    Args:
        *parts: the transforms, applied first to last.

    Returns:
        A :class:`Transform` whose state is ``tuple(member states)``.

    Raises:
        TypeError: a part is not a :class:`Transform`.

    Example:
        >>> import torch
        >>> import gradtap as gt
        >>> t = gt.chain(gt.scale(2.0), gt.clip_value(1.0))
        >>> t.update(torch.tensor([0.25, 3.0]), t.init(torch.zeros(2)), None)[0]
        tensor([0.5000, 1.0000])
    """
    for i, part in enumerate(parts):
        if not isinstance(part, Transform):
            raise TypeError(
                f"chain(): argument {i} must be a gradtap Transform (init, update); "
                f"got {type(part).__name__}"
            )
    members = tuple(parts)
    # The keywords each member's functions accept (None: any), read once here.
    takes = [_accepted(part.update) for part in members]
    takes_many = [None if part.update_many is None else _accepted(part.update_many)
                  for part in members]

    def init(param: Tensor) -> tuple[State, ...]:
        return tuple(part.init(param) for part in members)

    def update(
        grad: Tensor, state: tuple[State, ...], param: Tensor | None, /, **extra: Any
    ) -> tuple[Tensor, tuple[State, ...]]:
        new_states = []
        for part, sub, names in zip(members, state, takes, strict=True):
            grad, sub = part.update(grad, sub, param, **_only(extra, names))
            new_states.append(sub)
        return grad, tuple(new_states)

    group_only = [part for part in members if is_group_only(part)]
    if group_only:
        _mark_group_only(update, group_only_name(group_only[0]))
    _mark(update, factor=_chain_factor(members),
          needs=frozenset().union(*(needs(part) for part in members)),
          batched=any(is_batched(part) for part in members))

    if not any(part.update_many is not None for part in members):
        return Transform(init, update)

    def update_many(
        grads: Sequence[Tensor],
        states: Sequence[tuple[State, ...]],
        params: Sequence[Tensor | None],
        /,
        **extra: Any,
    ) -> tuple[list[Tensor], list[tuple[State, ...]]]:
        grads = list(grads)
        per_member: list[list[State]] = []
        for k, part in enumerate(members):
            subs = [state[k] for state in states]
            if part.update_many is not None:
                grads, subs = part.update_many(grads, subs, params,
                                               **_only(extra, takes_many[k]))
                grads, subs = list(grads), list(subs)
            else:
                kw = _only(extra, takes[k])
                outs = [part.update(g, s, p, **kw) for g, s, p in zip(grads, subs, params, strict=True)]
                grads = [o[0] for o in outs]
                subs = [o[1] for o in outs]
            per_member.append(subs)
        new_states = [tuple(m[i] for m in per_member) for i in range(len(grads))]
        return grads, new_states

    return Transform(init, update, update_many)


def _accepted(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword extras ``fn`` (an ``update`` or ``update_many``) accepts after its three
    positional parameters; None when it takes ``**extra`` (or has no signature to read)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params[3:]
                     if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                   inspect.Parameter.KEYWORD_ONLY))


def _only(extra: Mapping[str, Any], names: frozenset[str] | None) -> dict[str, Any]:
    """The entries of ``extra`` a member accepts (``names``; None: all)."""
    if names is None or not extra:
        return dict(extra)
    return {k: v for k, v in extra.items() if k in names}


def _chain_factor(members: tuple[Transform, ...]) -> Callable[[State], Tensor] | None:
    """The product of the factors the members of a chain report (None when none does)."""
    parts = [(k, fn) for k, part in enumerate(members) if (fn := factor_fn(part)) is not None]
    if not parts:
        return None
    if len(parts) == 1:
        k, fn = parts[0]
        return lambda state: fn(state[k])

    def product(state: State) -> Tensor:
        out = parts[0][1](state[parts[0][0]])
        for k, fn in parts[1:]:
            out = out * fn(state[k]).to(out.device)
        return out

    return product
