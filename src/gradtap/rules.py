"""Extension points: teach gradtap the layer types it does not know.

``gt.per_sample`` keeps one rule entry (:class:`PerSampleRule`) per module type in
:data:`PER_SAMPLE`, looked up through the class hierarchy (a subclass uses its base class's
entry unless it overrides ``forward``). A module type without an entry goes through the
``torch.func`` fallback (``fallback=True``) or is refused (``fallback=False``). Register an
entry for your own type with the :func:`per_sample_rule` decorator, or build a
:class:`PerSampleRule` (fast paths for norms and sums of squares, a validity check, the
required sample dim) and register it with ``PER_SAMPLE.register(MyLayer)(entry)``.
Registering a type that already has an entry raises ``ValueError`` unless ``replace=True``.

A rule is a pure function of one module call, ``(module, inp, grad_out, names) -> dict``:
``inp`` is the call's first tensor argument and ``grad_out`` the gradient of the loss w.r.t.
its output, both with the samples at dim 0 and the gradient scaled so that sample ``n``'s
slice is ``d s_n / d output`` (docs/semantics.md, "Per-sample gradients"); it returns
``{name: [N, *param.shape]}`` for the parameter names (relative to the module) in ``names``.
After each backward, gradtap checks that a rule's per-sample gradients add up to the
parameter's ``.grad`` and replays the call with ``torch.func`` (with a warning) where they do
not.

Example:
    >>> import torch, gradtap as gt
    >>> import gradtap.rules
    >>> class Scale(torch.nn.Module):                   # y = x * weight, elementwise
    ...     def __init__(self, features):
    ...         super().__init__()
    ...         self.weight = torch.nn.Parameter(torch.randn(features))
    ...     def forward(self, x):
    ...         return x * self.weight
    >>> @gradtap.rules.per_sample_rule(Scale)
    ... def grad_scale(module, inp, grad_out, names):
    ...     return {"weight": inp * grad_out}           # [N, features]
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), Scale(4))
    >>> with gt.per_sample(net, loss_reduction="sum", fallback=False) as ps:
    ...     net(torch.randn(5, 3)).square().sum().backward()
    >>> ps.grad["1.weight"].shape
    torch.Size([5, 4])
    >>> torch.allclose(ps.grad["1.weight"].sum(0), net[1].weight.grad)
    True
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from gradtap._samples.rule import PER_SAMPLE, GradRule, PerSampleRule, Piece, PiecesRule

__all__ = ["PER_SAMPLE", "GradRule", "PerSampleRule", "Piece", "PiecesRule", "per_sample_rule"]


def per_sample_rule(
    *types: type[nn.Module],
    norm_sq: GradRule | None = None,
    sum_sq: GradRule | None = None,
    total: GradRule | None = None,
    check: Callable[[nn.Module], str | None] | None = None,
    batch_dim: int | Callable[[nn.Module], int] | None = None,
    replace: bool = False,
) -> Callable[[GradRule], GradRule]:
    """Return a decorator that registers a per-sample gradient rule for ``types``.

    Args:
        *types: the ``nn.Module`` subclasses the rule serves (and their subclasses that keep
            its ``forward``).
        norm_sq: optional fast path, same signature, returning squared per-sample norms
            ``{name: [N]}``; without it they are reduced from the rule's gradients, a chunk
            of samples at a time.
        sum_sq: optional fast path returning ``{name: param.shape}``, ``sum_n g_n**2``.
        total: optional fast path returning ``{name: param.shape}``, ``sum_n g_n`` (the
            batch gradient), which ``gt.per_sample(own_grad=True)`` writes into ``.grad``
            when no per-sample gradients are built (norms or statistics only).
        check: ``module -> str | None``, a reason why a module couples its samples (its
            per-sample gradients are then refused with that reason), or ``None``.
        batch_dim: the sample dim the type's forward requires (an int or a function of the
            module); ``gt.per_sample`` refuses another ``batch_dim``. ``None`` accepts any.
        replace: override an existing entry for one of ``types``.

    Returns:
        A decorator that registers the gradient rule and returns it unchanged.

    Raises:
        TypeError: no type given, or one is not an ``nn.Module`` subclass.
        ValueError: a type already has an entry and ``replace`` is false.

    Example:
        >>> import torch, gradtap.rules
        >>> class Shift(torch.nn.Module):               # y = x + bias
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.bias = torch.nn.Parameter(torch.zeros(2))
        ...     def forward(self, x):
        ...         return x + self.bias
        >>> @gradtap.rules.per_sample_rule(Shift, batch_dim=0)
        ... def grad_shift(module, inp, grad_out, names):
        ...     return {"bias": grad_out.reshape(grad_out.shape[0], -1, 2).sum(1)}
        >>> gradtap.rules.PER_SAMPLE.lookup(Shift()).grad is grad_shift
        True
    """
    register = PER_SAMPLE.register(*types, replace=replace)  # checks the types now

    def decorator(grad: GradRule) -> GradRule:
        register(PerSampleRule(grad=grad, norm_sq=norm_sq, sum_sq=sum_sq, total=total,
                               check=check, batch_dim=batch_dim))
        return grad

    return decorator
