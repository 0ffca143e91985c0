"""Tensor kernels shared by the consumers: EWMA updates and batched reductions.

Everything here works on plain tensors and knows nothing about modules or hooks.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ewma_init", "ewma_update_"]


def ewma_init(value: Tensor) -> tuple[Tensor, Tensor]:
    """Return the EWMA state ``(mean, var)`` after its first step: ``mean = g``, ``var = 0``.

    The state is detached, float32 or wider, and owned by the caller (never aliases ``value``).
    """
    dtype = torch.promote_types(value.dtype, torch.float32)
    mean = value.detach().to(dtype=dtype, copy=True)
    return mean, torch.zeros_like(mean)


def ewma_update_(mean: Tensor, var: Tensor, value: Tensor, beta: float) -> None:
    """Advance an elementwise EWMA of mean and variance by one step, in place.

    DESIGN.md's definition: ``d = g - m_prev; m = m_prev + (1 - beta) * d;
    v = beta * (v_prev + (1 - beta) * d * d)``.
    """
    delta = value.detach().to(mean.dtype) - mean
    mean.add_(delta, alpha=1.0 - beta)
    var.addcmul_(delta, delta, value=1.0 - beta).mul_(beta)
