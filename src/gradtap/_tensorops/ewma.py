"""The elementwise exponentially weighted moving average of a mean and a variance.

The one implementation of the formula: ``m = g, v = 0`` at the first step, then
``d = g - m_prev; m = m_prev + (1 - beta) * d; v = beta * (v_prev + (1 - beta) * d * d)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ewma_init", "ewma_update_", "ewma_update_finite_"]


def ewma_init(value: Tensor) -> tuple[Tensor, Tensor]:
    """Return the EWMA state ``(mean, var)`` after its first step: ``mean = g``, ``var = 0``.

    The state is detached, float32 or wider, and owned by the caller (never aliases ``value``).

    Example:
        >>> import torch
        >>> mean, var = ewma_init(torch.tensor([1.0, 3.0], dtype=torch.float16))
        >>> mean.dtype, var.tolist()
        (torch.float32, [0.0, 0.0])
    """
    dtype = torch.promote_types(value.dtype, torch.float32)
    mean = value.detach().to(dtype=dtype, copy=True)
    return mean, torch.zeros_like(mean)


def ewma_update_(mean: Tensor, var: Tensor, value: Tensor, beta: float) -> None:
    """Advance an elementwise EWMA of mean and variance by one step, in place.

    ``d = g - m_prev; m = m_prev + (1 - beta) * d; v = beta * (v_prev + (1 - beta) * d * d)``.

    Example:
        >>> import torch
        >>> mean, var = ewma_init(torch.tensor([0.0]))
        >>> ewma_update_(mean, var, torch.tensor([2.0]), beta=0.5)
        >>> mean.tolist(), var.tolist()
        ([1.0], [1.0])
    """
    delta = value.detach().to(mean.dtype) - mean
    mean.add_(delta, alpha=1.0 - beta)
    var.addcmul_(delta, delta, value=1.0 - beta).mul_(beta)


def ewma_update_finite_(mean: Tensor, var: Tensor, value: Tensor, beta: float) -> None:
    """:func:`ewma_update_` for the elements where ``value`` is finite; where it is NaN or
    +-Inf, ``mean`` and ``var`` stay as they were (one bad step does not end the history).
    No host sync.

    Example:
        >>> import torch
        >>> mean, var = ewma_init(torch.tensor([0.0, 0.0]))
        >>> ewma_update_finite_(mean, var, torch.tensor([2.0, float("nan")]), beta=0.5)
        >>> mean.tolist(), var.tolist()
        ([1.0, 0.0], [1.0, 0.0])
    """
    delta = value.detach().to(mean.dtype) - mean
    finite = torch.isfinite(delta)
    delta = torch.where(finite, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
    mean.add_(delta, alpha=1.0 - beta)
    updated = torch.addcmul(var, delta, delta, value=1.0 - beta).mul_(beta)
    var.copy_(torch.where(finite, updated, var))
