"""Per-sample rules for ``Conv1d/2d/3d`` and ``ConvTranspose1d/2d/3d``, one N-d implementation.

Per-sample weight gradients are the weight gradient with the batch kept: the rule hands the
call to the convolution weight-gradient core of ``gradtap.functional._weight_grad`` (the one
behind ``gt.functional.conv_weight_grad``), which picks per shape between the library's
weight-gradient kernel with the samples folded into the groups and unfolded windows times
``grad_out`` (:func:`~gradtap.functional._weight_grad.choose_method`). A padding mode other
than zeros (and asymmetric ``'same'`` padding) is applied to the input first (``F.pad`` with
the module's mode), exactly as the module's forward does, so reflect/replicate/circular need
no special case.

Squared norms: direct (per-sample gradients a chunk at a time) or Gram ("ghost") form
``sum_{l,l'} (U^T U)_{ll'} (go^T go)_{ll'}`` with ``U`` the windows, whichever costs fewer
flops.
"""

from __future__ import annotations

import math
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

from gradtap._samples.rule import PerSampleRule, budget, chunks
from gradtap.functional._weight_grad import (
    Method,
    WeightGradProblem,
    choose_method,
    weight_grad,
    weight_grad_problem,
    windows,
)

__all__ = ["CONV", "CONV_TYPES", "grad_conv", "norm_conv", "total_conv"]

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
              nn.ConvTranspose3d)

Form = Literal["direct", "ghost"]


def _problem(conv: nn.Module, inp: Tensor, grad_out: Tensor) -> WeightGradProblem:
    module = cast(_ConvNd, conv)
    d = len(module.kernel_size)
    if inp.dim() != d + 2:
        raise ValueError(
            f"{type(module).__name__}: per-sample gradients need a batched input "
            f"[N, C, *spatial] with {d + 2} dims, got shape {tuple(inp.shape)}"
        )
    padding: tuple[int, ...]
    if module.transposed:
        padding = tuple(cast(tuple[int, ...], module.padding))  # ints: 'same' is not allowed
    else:
        pad = tuple(module._reversed_padding_repeated_twice)
        if module.padding_mode != "zeros" or pad[0::2] != pad[1::2]:
            # Another padding mode, or asymmetric 'same' padding: pad as the forward does.
            mode = "constant" if module.padding_mode == "zeros" else str(module.padding_mode)
            inp, padding = F.pad(inp, pad, mode=mode), (0,) * d
        else:
            padding = tuple(reversed(pad[0::2]))
    return weight_grad_problem(inp, grad_out, module.kernel_size, module.stride, padding,
                               module.dilation, module.groups, module.transposed)


def _bias(module: nn.Module, grad_out: Tensor) -> Tensor:
    return grad_out.flatten(2).sum(2)


def grad_conv(
    module: nn.Module,
    inp: Tensor,
    grad_out: Tensor,
    names: frozenset[str],
    method: Method | None = None,
) -> dict[str, Tensor]:
    """Per-sample gradients ``weight: [N, *weight.shape]``, ``bias: [N, out_channels]``.

    ``method`` forces ``"unfold"`` or ``"conv"`` (default: ``choose_method``).
    """
    out: dict[str, Tensor] = {}
    if "weight" in names:
        out["weight"] = weight_grad(_problem(module, inp, grad_out), keep_batch=True,
                                    method=method)
    if "bias" in names:
        out["bias"] = _bias(module, grad_out)
    return out


def norm_conv(
    module: nn.Module,
    inp: Tensor,
    grad_out: Tensor,
    names: frozenset[str],
    form: Form | None = None,
) -> dict[str, Tensor]:
    """Squared per-sample norms ``[N]``, direct or Gram form, whichever costs fewer flops.

    ``form`` forces ``"direct"`` or ``"ghost"`` (for tests and benchmarks).
    """
    out: dict[str, Tensor] = {}
    if "weight" in names:
        p = _problem(module, inp, grad_out)
        n, c = p.x.shape[:2]
        o = p.g.shape[1]
        k = math.prod(p.kernel)
        length = math.prod(p.g.shape[2:])
        limit = budget(p.x, p.g)
        parts = []
        if (form or ("ghost" if _ghost_cheaper(p) else "direct")) == "ghost":
            per_sample = c * k * length + 2 * p.groups * length * length
            for sl in chunks(n, per_sample, limit):
                q = p._replace(x=p.x[sl], g=p.g[sl])
                u = windows(q)
                g = q.g.reshape(u.shape[0], o // p.groups, -1)
                gram = torch.bmm(u.transpose(1, 2), u).mul_(torch.bmm(g.transpose(1, 2), g))
                parts.append(gram.reshape(sl.stop - sl.start, -1).sum(1))
        else:
            method = choose_method(p)
            per_sample = o * (c // p.groups) * k + (c * k * length if method == "unfold" else c)
            for sl in chunks(n, per_sample, limit):
                w = weight_grad(p._replace(x=p.x[sl], g=p.g[sl]), keep_batch=True,
                                method=method)
                parts.append(w.flatten(1).square().sum(1))
        out["weight"] = torch.cat(parts)
    if "bias" in names:
        out["bias"] = _bias(module, grad_out).square().sum(1)
    return out


def _ghost_cheaper(p: WeightGradProblem) -> bool:
    c, o = p.x.shape[1], p.g.shape[1]
    k, length = math.prod(p.kernel), math.prod(p.g.shape[2:])
    return length * length * (c * k + o) < o * (c // p.groups) * k * length


def norm_builds_conv(module: nn.Module, inp: Tensor, grad_out: Tensor) -> bool:
    """Whether :func:`norm_conv` builds per-sample weight gradients (the direct form)."""
    return not _ghost_cheaper(_problem(module, inp, grad_out))


def total_conv(
    module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """``sum_n g_n``: the batch weight gradient (the library's kernel) and bias gradient."""
    out: dict[str, Tensor] = {}
    if "weight" in names:
        out["weight"] = weight_grad(_problem(module, inp, grad_out))
    if "bias" in names:
        out["bias"] = _bias(module, grad_out).sum(0)
    return out


#: ``CONV_TYPES``: inputs ``[N, C, *spatial]``; the sum of squares is reduced from ``grad``.
CONV = PerSampleRule(grad=grad_conv, norm_sq=norm_conv, total=total_conv,
                     norm_builds=norm_builds_conv, batch_dim=0)
