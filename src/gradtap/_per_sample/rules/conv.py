"""Per-sample rules for ``Conv1d/2d/3d`` and ``ConvTranspose1d/2d/3d``, one N-d implementation.

Sample n's weight gradient of a convolution correlates its (padded) input with its output
gradient: ``dW[o, c, k] = sum_s go[o, s] * x_pad[c, s * stride + k * dilation]`` within each
group. Two formulations compute it for all samples at once:

* ``"unfold"``: cut the padded input into windows ``U [N*G, C/G*K, L]`` and multiply,
  ``bmm(go, U^T)``;
* ``"conv"``: the weight gradient as a convolution of the input with ``grad_out`` (the
  forward stride acting as its dilation), for all samples in one call of the convolution
  library's weight-gradient kernel: samples are folded into the channels and the groups
  (``[1, N*C, *S]``, ``N*G`` groups), so that batch-of-one gradient holds every sample's.

:func:`choose_method` picks one per shape from a cost estimate (see its docstring).

A padding mode other than zeros is applied to the input first (``F.pad`` with the module's
mode), exactly as the module's forward does, so reflect/replicate/circular need no special
case. A transposed convolution is the adjoint of an ordinary one with the same weight,
``<conv_transpose(x, W), go> = <x, conv(go, W)>``, so its weight gradient is the ordinary one
with the roles of input and grad_out exchanged; ``output_padding`` only adds windows that are
cut away.

Squared norms: direct (per-sample gradients a chunk at a time) or Gram ("ghost") form
``sum_{l,l'} (U^T U)_{ll'} (go^T go)_{ll'}``, whichever costs fewer flops.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradtap._per_sample.table import BATCH_DIM, GRAD, NORM, batch_first, budget, chunks

__all__ = ["choose_method", "grad_conv", "norm_conv", "weight_grad_per_sample"]

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
               nn.ConvTranspose3d)

Method = Literal["unfold", "conv"]
Form = Literal["direct", "ghost"]

BATCH_DIM.register(*_CONV_TYPES)(batch_first)


class _Problem(NamedTuple):
    """An ordinary convolution's per-sample weight gradient: input ``x``, grad_out ``g``."""

    x: Tensor  # [N, C, *S], padded already unless ``padding`` says otherwise
    g: Tensor  # [N, O, *L]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    kernel: tuple[int, ...]
    padding: tuple[int, ...]  # symmetric zero padding still to apply


def _problem(module: nn.Module, inp: Tensor, grad_out: Tensor) -> _Problem:
    d = len(module.kernel_size)
    if inp.dim() != d + 2:
        raise ValueError(
            f"{type(module).__name__}: per-sample gradients need a batched input "
            f"[N, C, *spatial] with {d + 2} dims, got shape {tuple(inp.shape)}"
        )
    none = (0,) * d
    if module.transposed:
        pad = tuple(p for p in reversed(module.padding) for _ in range(2))
        x, g = grad_out, inp
    else:
        pad = tuple(module._reversed_padding_repeated_twice)
        x, g = inp, grad_out
        if module.padding_mode == "zeros" and pad[0::2] == pad[1::2]:
            # Symmetric zero padding: the kernels below pad on the fly, no padded copy.
            return _Problem(x, g, tuple(module.stride), tuple(module.dilation), module.groups,
                            tuple(module.kernel_size), tuple(reversed(pad[0::2])))
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
    return _Problem(x, g, tuple(module.stride), tuple(module.dilation), module.groups,
                    tuple(module.kernel_size), none)


def _crop(p: _Problem) -> Tensor:
    """The padded input without trailing positions that no window of ``g``'s extent reaches.

    Only a transposed convolution has such positions beyond the stride remainder (its
    grad_out can have more windows than its input has positions); the kernels below ignore
    a stride remainder themselves, which is the only surplus when ``padding`` is pending.
    """
    if any(p.padding):
        return p.x
    need = [(o - 1) * s + dl * (k - 1) + 1
            for o, s, dl, k in zip(p.g.shape[2:], p.stride, p.dilation, p.kernel, strict=True)]
    return p.x[(slice(None), slice(None), *(slice(0, m) for m in need))]


def _unfold(p: _Problem) -> Tensor:
    """Windows of the padded input, ``[N*G, C/G*K, L]`` (channel outer, kernel inner)."""
    n, c = p.x.shape[:2]
    d = len(p.kernel)
    x = _crop(p)
    rows = (c // p.groups) * math.prod(p.kernel)
    if d <= 2:
        # im2col is several times faster than a strided gather of the same windows.
        one = (1,) * (2 - d)
        cols = F.unfold(x.reshape(n, c, *one, *x.shape[2:]), one + p.kernel,
                        dilation=one + p.dilation, padding=(0,) * (2 - d) + p.padding,
                        stride=one + p.stride)
        return cols.reshape(n * p.groups, rows, -1)
    if any(p.padding):
        x = F.pad(x, tuple(q for q in reversed(p.padding) for _ in range(2)))
    w = x
    for i, (k, s, dl) in enumerate(zip(p.kernel, p.stride, p.dilation, strict=True)):
        w = w.unfold(2 + i, dl * (k - 1) + 1, s)
    # [N, C, *L, *extents]: keep every dilation-th tap of each extent.
    w = w[(..., *(slice(None, None, dl) for dl in p.dilation))]
    perm = (0, 1, *range(2 + d, 2 + 2 * d), *range(2, 2 + d))
    return w.permute(perm).reshape(n * p.groups, rows, -1)


def _grad_unfold(p: _Problem) -> Tensor:
    n, o = p.g.shape[:2]
    u = _unfold(p)
    g = p.g.reshape(n * p.groups, o // p.groups, -1)
    return torch.bmm(g, u.transpose(1, 2))


_WEIGHT_GRAD = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight,
                3: torch.nn.grad.conv3d_weight}


def _grad_conv(p: _Problem) -> Tensor:
    # Samples folded into the channels, [1, N*C, *S], and into the groups (N*G): the batch
    # weight gradient of that grouped convolution is every sample's weight gradient at once.
    n, c = p.x.shape[:2]
    o = p.g.shape[1]
    x = _crop(p)
    shape = (n * o, c // p.groups, *p.kernel)
    out = _WEIGHT_GRAD[len(p.kernel)](
        x.reshape(1, n * c, *x.shape[2:]), shape, p.g.reshape(1, n * o, *p.g.shape[2:]),
        stride=p.stride, padding=p.padding, dilation=p.dilation, groups=n * p.groups,
    )
    return out.reshape(n * p.groups, o // p.groups, -1)


def choose_method(p: _Problem) -> Method:
    """Pick ``"unfold"`` or ``"conv"`` for one shape.

    Both do the same multiply-adds. The ``"conv"`` form hands everything to the convolution
    library's weight-gradient kernel, which needs no copy of the input but runs ``N*G``
    groups whose cost grows with the weights per group, ``(O/G) (C/G)``. The ``"unfold"``
    form copies the input ``K`` times and runs one batched matrix product, which is
    efficient when each window is reused for many weights. Measured on CPU
    (``benchmarks/per_sample.py --methods``), the unfold form wins once
    ``(O/G) (C/G) > 96 L`` (``L`` output positions): deep layers with few positions.
    """
    c_per_group = p.x.shape[1] // p.groups
    o_per_group = p.g.shape[1] // p.groups
    positions = math.prod(p.g.shape[2:])
    return "unfold" if o_per_group * c_per_group > 96 * positions else "conv"


def weight_grad_per_sample(p: _Problem, method: Method | None = None) -> Tensor:
    """Per-sample weight gradients ``[N*G, O/G, C/G*K]`` of the ordinary convolution ``p``."""
    method = method or choose_method(p)
    return _grad_unfold(p) if method == "unfold" else _grad_conv(p)


def _bias(module: nn.Module, grad_out: Tensor) -> Tensor:
    return grad_out.flatten(2).sum(2)


@GRAD.register(*_CONV_TYPES)
def grad_conv(
    module: nn.Module,
    inp: Tensor,
    grad_out: Tensor,
    names: frozenset[str],
    method: Method | None = None,
) -> dict[str, Tensor]:
    """Per-sample gradients ``weight: [N, *weight.shape]``, ``bias: [N, out_channels]``.

    ``method`` forces ``"unfold"`` or ``"conv"`` (default: :func:`choose_method`).
    """
    out: dict[str, Tensor] = {}
    if "weight" in names:
        p = _problem(module, inp, grad_out)
        w = weight_grad_per_sample(p, method)
        out["weight"] = w.reshape(inp.shape[0], *module.weight.shape)
    if "bias" in names:
        out["bias"] = _bias(module, grad_out)
    return out


@NORM.register(*_CONV_TYPES)
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
        direct = o * (c // p.groups) * k * length
        ghost = length * length * (c * k + o)
        limit = budget(p.x, p.g)
        parts = []
        if (form or ("ghost" if ghost < direct else "direct")) == "ghost":
            per_sample = c * k * length + 2 * p.groups * length * length
            for sl in chunks(n, per_sample, limit):
                q = p._replace(x=p.x[sl], g=p.g[sl])
                u = _unfold(q)
                g = q.g.reshape(u.shape[0], o // p.groups, -1)
                gram = torch.bmm(u.transpose(1, 2), u).mul_(torch.bmm(g.transpose(1, 2), g))
                parts.append(gram.reshape(sl.stop - sl.start, -1).sum(1))
        else:
            method = choose_method(p)
            per_sample = o * (c // p.groups) * k + (c * k * length if method == "unfold" else c)
            for sl in chunks(n, per_sample, limit):
                w = weight_grad_per_sample(p._replace(x=p.x[sl], g=p.g[sl]), method)
                parts.append(w.reshape(sl.stop - sl.start, -1).square().sum(1))
        out["weight"] = torch.cat(parts)
    if "bias" in names:
        out["bias"] = _bias(module, grad_out).square().sum(1)
    return out
