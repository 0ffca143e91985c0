"""Run a rule's transform on gradients and check what it returns.

:func:`apply_one` runs ``update`` on one tensor's gradient, :func:`apply_group` runs a rule
over the accumulated ``.grad`` of its parameters (through ``update_many`` when the transform
has it). Both store the new state in the :class:`~gradtap._transform.state.Entry` and raise,
naming the rule and the tensor, when a transform returns something that cannot replace the
gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from gradtap._transform.base import State
from gradtap._transform.state import Entry

__all__ = ["apply_group", "apply_one"]

#: The factor a grad scaler left on a parameter's gradient (``None``: none).
FactorOf = Callable[[Tensor], "Tensor | None"]


def apply_one(entry: Entry, grad: Tensor, param: Tensor | None,
              factor: Tensor | None = None, extra: Mapping[str, Any] | None = None) -> Tensor:
    """Return ``entry``'s transform of ``grad`` and keep its new state.

    With ``factor`` (a 0-dim tensor: the grad scaler's scale still on ``grad``) the transform
    sees ``grad / factor`` and its result is scaled back, so the scaler's later unscale gives
    the transform of the true gradient.

    Example:
        >>> import torch, gradtap as gt
        >>> from gradtap._transform.plan import Rule
        >>> entry = Entry("w", "parameter 'w'", Rule("w", gt.scale(2.0)), ())
        >>> apply_one(entry, torch.ones(2), None)
        tensor([2., 2.])
    """
    if factor is not None:
        f = factor.to(grad.device)
        new = apply_one(entry, (grad / f).to(grad.dtype), param, extra=extra)
        return (new * f).to(grad.dtype)
    result = entry.transform.update(grad, entry.state, param, **(extra or {}))
    # Cheap metadata checks on the hot path; the message is built only on failure.
    if not (isinstance(result, tuple) and len(result) == 2):
        _unpack(result, entry.label, entry.where)
    new, state = result
    if not (
        isinstance(new, Tensor)
        and new.shape == grad.shape
        and new.dtype == grad.dtype
        and new.device == grad.device
    ):
        _check_output(new, grad, entry.label, entry.where)
    entry.state = state
    return new


def apply_group(targets: Sequence[tuple[Entry, Tensor]], factor_of: FactorOf | None = None,
                extra: Mapping[str, Any] | None = None) -> None:
    """Transform the ``.grad`` of every parameter of one rule that has one, in place.

    ``targets`` are ``(entry, parameter)`` pairs of one rule, in plan order. A transform
    with ``update_many`` gets them all at once; one without it runs per tensor. With
    ``factor_of``, each gradient is divided by the factor a grad scaler left on it before
    the transform and multiplied by it after (see :func:`apply_one`). ``extra`` holds the
    keyword extras the rule's transform needs (``optimizer=``).
    """
    extra = extra or {}
    live = [(e, p, g) for e, p in targets if (g := p.grad) is not None]
    if not live:
        return
    if factor_of is not None:
        factors = [factor_of(p) for _, p, _ in live]
        if any(f is not None for f in factors):
            _apply_group_scaled(live, factors, extra)
            return
    first = live[0][0]
    update_many = first.transform.update_many
    if update_many is None:
        for e, p, g in live:
            p.grad = apply_one(e, g, p, extra=extra)
        return
    label = first.label
    grads = [g for _, _, g in live]
    result = update_many(grads, [e.state for e, _, _ in live], [p for _, p, _ in live], **extra)
    new_grads, new_states = _unpack(result, label, "its parameters (update_many)")
    new_grads, new_states = list(new_grads), list(new_states)
    if len(new_grads) != len(live) or len(new_states) != len(live):
        raise ValueError(
            f"rule {label!r}: update_many returned {len(new_grads)} gradients and "
            f"{len(new_states)} states for {len(live)} parameters"
        )
    for (e, _, g), new, state in zip(live, new_grads, new_states, strict=True):
        _check_output(new, g, label, e.where)
        e.state = state
    for (_, p, _), new in zip(live, new_grads, strict=True):
        p.grad = new


def _apply_group_scaled(live: list[tuple[Entry, Tensor, Tensor]],
                        factors: list[Tensor | None], extra: Mapping[str, Any]) -> None:
    fs = [None if f is None else f.to(g.device) for (_, _, g), f in zip(live, factors)]
    for (_, p, g), f in zip(live, fs):
        if f is not None:
            p.grad = (g / f).to(g.dtype)
    apply_group([(e, p) for e, p, _ in live], extra=extra)
    for (_, p, g), f in zip(live, fs):
        new = p.grad
        if f is not None and new is not None:
            p.grad = (new * f).to(g.dtype)


def _unpack(result: Any, label: str, where: str) -> tuple[Any, State]:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"rule {label!r} on {where}: update must return a pair (new_grad, new_state); "
            f"got {type(result).__name__}"
        )
    return result


def _check_output(out: Any, grad: Tensor, label: str, where: str) -> Tensor:
    if not isinstance(out, Tensor):
        raise TypeError(
            f"rule {label!r} on {where}: the transform returned {type(out).__name__} as the new "
            "gradient; expected a Tensor (update must return (new_grad, new_state))"
        )
    if out.shape != grad.shape or out.dtype != grad.dtype or out.device != grad.device:
        raise ValueError(
            f"rule {label!r} on {where}: the transform returned shape {tuple(out.shape)}, "
            f"{out.dtype}, {out.device}; expected shape {tuple(grad.shape)}, {grad.dtype}, "
            f"{grad.device} like the gradient it replaces"
        )
    return out
