"""The weight gradient of a convolution, summed over the batch or kept per sample.

One N-d core for 1d, 2d and 3d, ordinary and transposed convolutions. It computes

    dW[o, c, k] = sum_{(n), s} g[n, o, s] * x_pad[n, c, s * stride + k * dilation]

within each group, either summed over the samples n (:func:`gradtap.functional.conv_weight_grad`
and the backward of :func:`gradtap.functional.conv`) or with the samples kept apart (the
per-sample gradients of convolution layers). A transposed convolution is the adjoint of an
ordinary one with the same weight, so its weight gradient is the ordinary one with the roles
of input and ``grad_output`` exchanged (``docs/convolution-backward.md``);
:func:`weight_grad_problem` does that exchange once, and everything below sees an ordinary
convolution.

Two formulations:

* ``"conv"``: the convolution library's weight-gradient kernel. With the batch kept, the
  samples are folded into the channels and the groups (``[1, N*C, *S]``, ``N*G`` groups),
  so that batch-of-one gradient holds every sample's;
* ``"unfold"`` (batch kept only): cut the padded input into windows ``[N*G, C/G*K, L]``
  (:func:`windows`) and multiply them with the output gradient in one batched matrix
  product.

:func:`choose_method` picks one per shape from a cost estimate. Shape letters follow
``gradtap._types``: N batch, C input and O output channels of the ordinary convolution, G
groups, K kernel positions, L output positions, S spatial.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Method", "WeightGradProblem", "choose_method", "weight_grad", "weight_grad_problem",
           "windows"]

Method = Literal["unfold", "conv"]


class WeightGradProblem(NamedTuple):
    """The weight gradient of an ordinary convolution: input ``x``, output gradient ``g``.

    Every window of ``g``'s extent fits the padded input, with less than one stride left
    over: that is what the kernels below require.
    """

    x: Tensor  # [N, C, *S], before the pending symmetric zero padding
    g: Tensor  # [N, O, *L]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    kernel: tuple[int, ...]
    padding: tuple[int, ...]  # symmetric zero padding still to apply

    def weight_shape(self) -> tuple[int, ...]:
        """``[O, C/G, *K]``: the ordinary convolution's weight (a transposed one's layout)."""
        return (self.g.shape[1], self.x.shape[1] // self.groups, *self.kernel)


def weight_grad_problem(
    input: Tensor,
    grad_output: Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    transposed: bool,
) -> WeightGradProblem:
    """The problem of one convolution call, with symmetric integer ``padding``.

    A transposed convolution exchanges the roles of ``input`` and ``grad_output``. Its
    ``output_padding`` adds positions no window reaches; where they amount to a stride or
    more (``output_padding >= stride``, allowed when ``dilation > stride``), the padding is
    applied and the surplus cut away.
    """
    x, g = (grad_output, input) if transposed else (input, grad_output)
    p = WeightGradProblem(x, g, tuple(stride), tuple(dilation), groups, tuple(kernel),
                          tuple(padding))
    need = [(o - 1) * s + dl * (k - 1) + 1
            for o, s, dl, k in zip(g.shape[2:], p.stride, p.dilation, p.kernel, strict=True)]
    padded = [n + 2 * q for n, q in zip(x.shape[2:], p.padding, strict=True)]
    if all(have - m < s for have, m, s in zip(padded, need, p.stride, strict=True)):
        return p
    if any(p.padding):
        x = F.pad(x, tuple(q for q in reversed(p.padding) for _ in range(2)))
    x = x[(slice(None), slice(None)) + tuple(slice(0, m) for m in need)]
    return p._replace(x=x, padding=(0,) * len(p.kernel))


def windows(p: WeightGradProblem) -> Tensor:
    """Windows of the padded input, ``[N*G, C/G*K, L]`` (channel outer, kernel inner)."""
    n, c = p.x.shape[:2]
    d = len(p.kernel)
    rows = (c // p.groups) * math.prod(p.kernel)
    if d <= 2:
        # im2col is several times faster than a strided gather of the same windows.
        one = (1,) * (2 - d)
        cols = F.unfold(p.x.reshape(n, c, *one, *p.x.shape[2:]), one + p.kernel,
                        dilation=one + p.dilation, padding=(0,) * (2 - d) + p.padding,
                        stride=one + p.stride)
        return cols.reshape(n * p.groups, rows, -1)
    x = p.x
    if any(p.padding):
        x = F.pad(x, tuple(q for q in reversed(p.padding) for _ in range(2)))
    w = x
    for i, (k, s, dl) in enumerate(zip(p.kernel, p.stride, p.dilation, strict=True)):
        w = w.unfold(2 + i, dl * (k - 1) + 1, s)
    # [N, C, *L, *extents]: keep every dilation-th tap of each extent.
    taps: tuple[Any, ...] = (..., *(slice(None, None, dl) for dl in p.dilation))
    w = w[taps]
    perm = (0, 1, *range(2 + d, 2 + 2 * d), *range(2, 2 + d))
    return w.permute(perm).reshape(n * p.groups, rows, -1)


def choose_method(p: WeightGradProblem) -> Method:
    """Pick ``"unfold"`` or ``"conv"`` for the per-sample weight gradient of one shape.

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


def _kernel(x: Tensor, g: Tensor, weight_shape: Sequence[int], p: WeightGradProblem,
            groups: int) -> Tensor:
    """The library's weight-gradient kernel; ``weight`` only lends its shape."""
    weight = torch.empty(1, dtype=g.dtype, device=g.device).expand(*weight_shape)
    return torch.ops.aten.convolution_backward(
        g, x, weight, None, p.stride, p.padding, p.dilation, False, (0,) * len(p.kernel),
        groups, (False, True, False),
    )[1]


def weight_grad(p: WeightGradProblem, *, keep_batch: bool = False,
                method: Method | None = None) -> Tensor:
    """The weight gradient ``[O, C/G, *K]``, or with ``keep_batch`` ``[N, O, C/G, *K]``.

    ``method`` applies to ``keep_batch`` only: ``"unfold"`` or ``"conv"`` (default:
    :func:`choose_method`); the sum over the batch always runs the library's kernel.
    """
    shape = p.weight_shape()
    if not keep_batch:
        return _kernel(p.x, p.g, shape, p, p.groups)
    n = p.x.shape[0]
    if (method or choose_method(p)) == "unfold":
        g = p.g.reshape(n * p.groups, shape[0] // p.groups, -1)
        out = torch.bmm(g, windows(p).transpose(1, 2))
    else:
        # Samples folded into the channels and the groups: the weight gradient of that
        # batch-of-one grouped convolution is every sample's weight gradient at once.
        out = _kernel(p.x.reshape(1, -1, *p.x.shape[2:]), p.g.reshape(1, -1, *p.g.shape[2:]),
                      (n * shape[0], *shape[1:]), p, n * p.groups)
    return out.reshape(n, *shape)
