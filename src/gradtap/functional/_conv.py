"""Explicit convolution whose backward is written as convolutions, differentiable to any order.

The backward of a convolution is itself a pair of convolutions (see
``docs/convolution-backward.md`` for the derivation):

* the gradient w.r.t. the input is the *transposed* convolution of ``grad_output`` with the
  same weight (and, for a transposed convolution, the ordinary convolution), with an
  ``output_padding`` chosen so the result has the input's shape exactly;
* the gradient w.r.t. the weight is a convolution of the input with ``grad_output`` used as
  the kernel, where the roles of stride and dilation swap: the forward stride becomes the
  dilation and the forward dilation becomes the stride.

:func:`conv` runs the native convolution forward inside a custom autograd function whose
``backward`` computes these two convolutions (the same code as :func:`conv_input_grad` and
:func:`conv_weight_grad`, minus their argument checks). The input gradient is again that
autograd function (with ``transposed`` flipped); the weight gradient is a second one, whose
value is the library's weight-gradient kernel (``functional._weight_grad``, shared with the
per-sample gradients of convolution layers) and whose own backward is the forward
convolution and the input gradient. The three operations close
under differentiation, so every order of derivative goes through these explicit formulas.
Both functions define their forward-mode derivative and a vmap rule, so ``torch.func.jvp``,
``vmap`` and ``grad`` compose through them (``jvp(grad(f))`` gives forward-over-reverse
Hessian-vector products).

Shape letters follow ``gradtap._types``: N batch, G groups, S spatial.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor

from gradtap.functional._weight_grad import weight_grad, weight_grad_problem

__all__ = ["conv", "conv_input_grad", "conv_weight_grad"]

IntOrTuple: TypeAlias = int | Sequence[int]
Padding: TypeAlias = int | Sequence[int] | Literal["same", "valid"]

_DIMS = (1, 2, 3)


# --------------------------------------------------------------------------------------------
# argument normalisation (done once, at the public boundary)
# --------------------------------------------------------------------------------------------


def _spatial_dims(weight_ndim: int, where: str) -> int:
    d = weight_ndim - 2
    if d not in _DIMS:
        raise ValueError(
            f"{where}: weight must have 3, 4 or 5 dims ([out, in/groups, *kernel] or, transposed, "
            f"[in, out/groups, *kernel]) for a 1d, 2d or 3d convolution; got {weight_ndim} dims"
        )
    return d


def _tuple(value: IntOrTuple, d: int, name: str, minimum: int) -> tuple[int, ...]:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a sequence of {d} ints, got {value!r}")
    if isinstance(value, int):
        out = (value,) * d
    elif isinstance(value, Sequence) and not isinstance(value, str):
        out = tuple(value)
        if len(out) == 1:
            out = out * d
        if len(out) != d or not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
            raise ValueError(
                f"{name} must be an int or a sequence of {d} ints for a {d}d convolution, "
                f"got {value!r}"
            )
    else:
        raise TypeError(f"{name} must be an int or a sequence of {d} ints, got {value!r}")
    if any(v < minimum for v in out):
        raise ValueError(f"{name} must be >= {minimum} in every dimension, got {value!r}")
    return out


def _resolve_padding(
    padding: Padding,
    kernel: Sequence[int],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    transposed: bool,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return (symmetric padding, extra padding on the high side) per spatial dim."""
    d = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * d, (0,) * d
        if padding != "same":
            raise ValueError(
                f"padding must be an int, a tuple of ints, 'same' or 'valid'; got {padding!r}"
            )
        if transposed:
            raise ValueError(
                "padding='same' is not defined for a transposed convolution (as in "
                "F.conv_transpose*d); pass integer padding and output_padding instead"
            )
        if any(s != 1 for s in stride):
            raise ValueError(f"padding='same' needs stride 1 (as in F.conv*d), got stride={stride}")
        total = tuple(dil * (k - 1) for dil, k in zip(dilation, kernel, strict=True))
        low = tuple(t // 2 for t in total)
        # Like aten's same mode: an odd total puts the extra zero on the high (right) side.
        return low, tuple(t - 2 * lo for t, lo in zip(total, low, strict=True))
    return _tuple(padding, d, "padding", 0), (0,) * d


class _Options:
    """Normalised convolution options: what every internal helper takes."""

    __slots__ = (
        "d",
        "kernel",
        "stride",
        "padding",
        "extra",
        "dilation",
        "groups",
        "transposed",
        "output_padding",
    )

    def __init__(
        self,
        weight_shape: Sequence[int],
        stride: IntOrTuple,
        padding: Padding,
        dilation: IntOrTuple,
        groups: int,
        transposed: bool,
        output_padding: IntOrTuple,
        where: str,
    ) -> None:
        d = _spatial_dims(len(weight_shape), where)
        self.d = d
        self.kernel = tuple(weight_shape[2:])
        self.stride = _tuple(stride, d, "stride", 1)
        self.dilation = _tuple(dilation, d, "dilation", 1)
        self.padding, self.extra = _resolve_padding(
            padding, self.kernel, self.stride, self.dilation, bool(transposed)
        )
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"{where}: groups must be a positive int, got {groups!r}")
        self.groups = groups
        self.transposed = bool(transposed)
        self.output_padding = _tuple(output_padding, d, "output_padding", 0)
        if not self.transposed and any(self.output_padding):
            raise ValueError(
                f"{where}: output_padding={self.output_padding} applies only to transposed "
                "convolutions (transposed=True)"
            )
        for op, s, dil in zip(self.output_padding, self.stride, self.dilation, strict=True):
            if op >= max(s, dil):
                raise ValueError(
                    f"{where}: output_padding must be smaller than max(stride, dilation) in every "
                    f"dimension; got output_padding={self.output_padding}, stride={self.stride}, "
                    f"dilation={self.dilation}"
                )
        if weight_shape[0] % groups:
            role = "in_channels" if self.transposed else "out_channels"
            raise ValueError(
                f"{where}: weight.shape[0] ({role}) = {weight_shape[0]} is not divisible by "
                f"groups={groups}"
            )

    def in_channels(self, weight_shape: Sequence[int]) -> int:
        return weight_shape[0] if self.transposed else weight_shape[1] * self.groups

    def out_channels(self, weight_shape: Sequence[int]) -> int:
        return weight_shape[1] * self.groups if self.transposed else weight_shape[0]


def _check_input(
    input_shape: Sequence[int], weight_shape: Sequence[int], o: _Options, where: str
) -> None:
    if len(input_shape) != o.d + 2:
        raise ValueError(
            f"{where}: input must have shape [N, C_in, *S] with {o.d} spatial dims for weight of "
            f"shape {tuple(weight_shape)}; got shape {tuple(input_shape)}"
        )
    expected = o.in_channels(weight_shape)
    if input_shape[1] != expected:
        layout = "[in, out/groups, *kernel]" if o.transposed else "[out, in/groups, *kernel]"
        raise ValueError(
            f"{where}: input has {input_shape[1]} channels but weight of shape "
            f"{tuple(weight_shape)} (layout {layout}, groups={o.groups}) expects {expected}"
        )


def _output_size(input_size: Sequence[int], kernel: Sequence[int], o: _Options) -> tuple[int, ...]:
    """Spatial output size of the convolution described by ``o`` (padding already symmetric)."""
    if o.transposed:
        return tuple(
            (n - 1) * s - 2 * p + dil * (k - 1) + op + 1
            for n, k, s, p, dil, op in zip(
                input_size, kernel, o.stride, o.padding, o.dilation, o.output_padding, strict=True
            )
        )
    return tuple(
        (n + 2 * p - dil * (k - 1) - 1) // s + 1
        for n, k, s, p, dil in zip(input_size, kernel, o.stride, o.padding, o.dilation, strict=True)
    )


def _pad_high(x: Tensor, extra: Sequence[int]) -> Tensor:
    if not any(extra):
        return x
    pads: list[int] = []
    for e in reversed(extra):  # F.pad lists the last dim first
        pads += [0, e]
    return F.pad(x, pads)


def _narrow_spatial(x: Tensor, size: Sequence[int]) -> Tensor:
    for i, n in enumerate(size):
        if x.shape[2 + i] != n:
            x = x.narrow(2 + i, 0, n)
    return x


# --------------------------------------------------------------------------------------------
# the autograd function: forward is native, backward and jvp are explicit convolutions
# --------------------------------------------------------------------------------------------


class _ExplicitConv(torch.autograd.Function):
    """Convolution with symmetric integer padding whose derivatives are explicit convolutions."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input: Tensor, weight: Tensor, bias: Tensor | None, o: _Options) -> Tensor:  # type: ignore[override]
        return torch.convolution(
            input,
            weight,
            bias,
            o.stride,
            o.padding,
            o.dilation,
            o.transposed,
            o.output_padding,
            o.groups,
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        input, weight, bias, o = inputs
        ctx.save_for_backward(input, weight)
        ctx.save_for_forward(input, weight)
        ctx.options = o
        ctx.has_bias = bias is not None
        ctx.output_shape = output.shape

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        input, weight = ctx.saved_tensors
        o: _Options = ctx.options
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_input = _input_grad(grad_output, weight, input.shape, o) if need_input else None
        grad_weight = _weight_grad(input, grad_output, o) if need_weight else None
        grad_bias = None
        if ctx.has_bias and need_bias:
            grad_bias = grad_output.sum(dim=(0, *range(2, grad_output.ndim)))
        return grad_input, grad_weight, grad_bias, None

    @staticmethod
    def jvp(
        ctx: Any, input_t: Tensor | None, weight_t: Tensor | None, bias_t: Tensor | None, _: None
    ) -> Tensor:  # type: ignore[override]
        # conv is bilinear in (input, weight) and affine in bias, so the tangent is exact.
        input, weight = ctx.saved_tensors
        o: _Options = ctx.options
        out_t: Tensor | None = None
        if input_t is not None:
            out_t = _ExplicitConv.apply(input_t, weight, None, o)
        if weight_t is not None:
            term = _ExplicitConv.apply(input, weight_t, None, o)
            out_t = term if out_t is None else out_t + term
        if bias_t is not None:
            b = bias_t.reshape(1, -1, *([1] * o.d))
            out_t = b.expand(ctx.output_shape) if out_t is None else out_t + b
        if out_t is None:  # no tangent at all: autograd still wants a tensor of the output's shape
            out_t = input.new_zeros(ctx.output_shape)
        return out_t


def _conv(input: Tensor, weight: Tensor, bias: Tensor | None, o: _Options) -> Tensor:
    return _ExplicitConv.apply(_pad_high(input, o.extra), weight, bias, _symmetric(o))


def _with_symmetric_padding(
    o: _Options, transposed: bool, output_padding: tuple[int, ...]
) -> _Options:
    new = copy.copy(o)
    new.extra = (0,) * o.d
    new.transposed = transposed
    new.output_padding = output_padding
    return new


def _symmetric(o: _Options) -> _Options:
    """Options for the already padded input: the high-side extra padding is done."""
    return _with_symmetric_padding(o, o.transposed, o.output_padding) if any(o.extra) else o


def _input_grad(
    grad_output: Tensor, weight: Tensor, input_shape: Sequence[int], o: _Options
) -> Tensor:
    input_shape = tuple(input_shape)
    padded = tuple(n + e for n, e in zip(input_shape[2:], o.extra, strict=True))
    if o.transposed:
        # The adjoint of a transposed convolution is the ordinary convolution with the same
        # weight; it is longer than the input by floor(output_padding / stride), never shorter.
        options = _with_symmetric_padding(o, False, (0,) * o.d)
    else:
        # Strided windows reach the input only up to a remainder of at most stride - 1
        # elements; the transposed convolution restores it as output_padding, so the shape
        # is exactly the input's.
        reach = tuple(
            (m - 1) * s - 2 * p + dil * (k - 1) + 1
            for m, k, s, p, dil in zip(
                grad_output.shape[2:],
                weight.shape[2:],
                o.stride,
                o.padding,
                o.dilation,
                strict=True,
            )
        )
        options = _with_symmetric_padding(
            o, True, tuple(n - r for n, r in zip(padded, reach, strict=True))
        )
    grad = _ExplicitConv.apply(grad_output, weight, None, options)
    return _narrow_spatial(grad, input_shape[2:])


class _WeightGrad(torch.autograd.Function):
    """Weight gradient ``W(input, grad_output)`` of the convolution described by the options.

    ``W`` is bilinear and ``<gg, W(x, gy)> = <gy, conv(x, gg)> = <conv_input_grad(gy, gg), x>``,
    so its own derivatives are the forward convolution and the input gradient with ``gg`` as
    the weight: the three explicit operations close under differentiation, at every order.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(input: Tensor, grad_output: Tensor, o: _Options) -> Tensor:  # type: ignore[override]
        p = weight_grad_problem(input, grad_output, o.kernel, o.stride, o.padding, o.dilation,
                                o.groups, o.transposed)
        return weight_grad(p)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        input, grad_output, o = inputs
        ctx.save_for_backward(input, grad_output)
        ctx.save_for_forward(input, grad_output)
        ctx.options = o
        ctx.weight_shape = output.shape

    @staticmethod
    def backward(ctx: Any, gg: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        input, grad_output = ctx.saved_tensors
        o: _Options = ctx.options
        need_input, need_grad_output = ctx.needs_input_grad[:2]
        grad_input = _input_grad(grad_output, gg, input.shape, o) if need_input else None
        grad_grad_output = _ExplicitConv.apply(input, gg, None, o) if need_grad_output else None
        return grad_input, grad_grad_output, None

    @staticmethod
    def jvp(ctx: Any, input_t: Tensor | None, grad_output_t: Tensor | None, _: None) -> Tensor:  # type: ignore[override]
        input, grad_output = ctx.saved_tensors
        o: _Options = ctx.options
        terms = []
        if input_t is not None:
            terms.append(_WeightGrad.apply(input_t, grad_output, o))
        if grad_output_t is not None:
            terms.append(_WeightGrad.apply(input, grad_output_t, o))
        if not terms:
            return input.new_zeros(ctx.weight_shape)
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _weight_grad(input: Tensor, grad_output: Tensor, o: _Options) -> Tensor:
    return _WeightGrad.apply(_pad_high(input, o.extra), grad_output, _symmetric(o))


# --------------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------------


def conv(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    transposed: bool = False,
    output_padding: IntOrTuple = 0,
) -> Tensor:
    """Convolve like ``F.conv*d`` / ``F.conv_transpose*d``, with explicit derivatives of any order.

    The dimension (1d, 2d, 3d) comes from ``weight.ndim``. The forward pass is the native
    convolution (same numbers); reverse-mode derivatives are the convolutions of
    :func:`conv_input_grad` and :func:`conv_weight_grad`, themselves differentiable through
    this function, and the forward-mode derivative is ``conv(dx, w) + conv(x, dw) + db``. It
    works under ``torch.func.grad``, ``jvp`` and ``vmap`` and their compositions.

    Args:
        input: ``[N, C_in, *S]`` (or ``[C_in, *S]`` without a batch dim).
        weight: ``[C_out, C_in/groups, *K]``, or ``[C_in, C_out/groups, *K]`` when transposed.
        bias: ``[C_out]`` or None.
        stride: int or one int per spatial dim.
        padding: int, one int per spatial dim, ``'valid'`` (no padding) or ``'same'`` (output
            size equals input size; stride 1 only, not for transposed convolutions; an odd
            total padding puts the extra zero on the high side, as PyTorch does).
        dilation: int or one int per spatial dim.
        groups: number of channel groups; ``C_in`` and ``C_out`` must both be divisible by it.
        transposed: compute a transposed convolution (the adjoint of the ordinary one).
        output_padding: extra size added on the high side of a transposed convolution's
            output; each entry smaller than ``max(stride, dilation)``.

    Returns:
        ``[N, C_out, *S_out]`` (``[C_out, *S_out]`` for an unbatched input).

    Raises:
        ValueError: the weight is not 3-5 dimensional, channels or groups do not match, or
            an option is out of range.

    Example:
        >>> import torch, gradtap as gt
        >>> x = torch.randn(2, 4, 8, 8, dtype=torch.float64, requires_grad=True)
        >>> w = torch.randn(6, 2, 3, 3, dtype=torch.float64, requires_grad=True)
        >>> y = gt.functional.conv(x, w, stride=2, padding=1, groups=2)
        >>> (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        >>> g.shape  # differentiable again: g.sum().backward() works
        torch.Size([2, 4, 8, 8])
    """
    o = _Options(
        weight.shape, stride, padding, dilation, groups, transposed, output_padding, "conv"
    )
    unbatched = input.ndim == o.d + 1
    if unbatched:
        input = input.unsqueeze(0)
    _check_input(input.shape, weight.shape, o, "conv")
    if bias is not None and tuple(bias.shape) != (o.out_channels(weight.shape),):
        raise ValueError(
            f"conv: bias must have shape [{o.out_channels(weight.shape)}] (one entry per output "
            f"channel), got {tuple(bias.shape)}"
        )
    padded = tuple(n + e for n, e in zip(input.shape[2:], o.extra, strict=True))
    if any(n < 1 for n in _output_size(padded, weight.shape[2:], o)):
        raise ValueError(
            f"conv: input of spatial size {tuple(input.shape[2:])} is smaller than the dilated "
            f"kernel {tuple(weight.shape[2:])} (dilation={o.dilation}, padding={o.padding})"
        )
    out = _conv(input, weight, bias, o)
    return out.squeeze(0) if unbatched else out


def conv_input_grad(
    grad_output: Tensor,
    weight: Tensor,
    input_shape: Sequence[int],
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    transposed: bool = False,
    output_padding: IntOrTuple = 0,
) -> Tensor:
    """Compute the gradient of a convolution w.r.t. its input, as a convolution.

    For an ordinary convolution this is the transposed convolution of ``grad_output`` with
    the same weight, with ``output_padding`` set to the part of the input the strided windows
    did not reach, so the shape equals ``input_shape``. For a transposed convolution it is
    the ordinary convolution of ``grad_output`` with the same weight. Both go through
    :func:`conv`, so the result is differentiable again to any order.

    Args:
        grad_output: ``[N, C_out, *S_out]``, the gradient w.r.t. the convolution's output.
        weight: the forward weight, ``[C_out, C_in/groups, *K]`` (transposed:
            ``[C_in, C_out/groups, *K]``).
        input_shape: the forward input's full shape ``[N, C_in, *S]``.
        stride, padding, dilation, groups, transposed, output_padding: the forward options,
            as in :func:`conv`.

    Returns:
        ``[N, C_in, *S]``: the gradient w.r.t. the input.

    Raises:
        ValueError: the shapes cannot belong to one convolution with these options.

    Example:
        >>> import torch, gradtap as gt
        >>> w, gy = torch.randn(3, 2, 3), torch.randn(1, 3, 4)
        >>> gt.functional.conv_input_grad(gy, w, (1, 2, 9), stride=2).shape
        torch.Size([1, 2, 9])
    """
    o = _Options(
        weight.shape,
        stride,
        padding,
        dilation,
        groups,
        transposed,
        output_padding,
        "conv_input_grad",
    )
    _check_input(tuple(input_shape), weight.shape, o, "conv_input_grad")
    _check_grad_output(grad_output, input_shape, weight.shape, o, "conv_input_grad")
    return _input_grad(grad_output, weight, input_shape, o)


def conv_weight_grad(
    input: Tensor,
    grad_output: Tensor,
    weight_shape: Sequence[int],
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    transposed: bool = False,
    output_padding: IntOrTuple = 0,
) -> Tensor:
    """Compute the gradient of a convolution w.r.t. its weight, differentiable to any order.

    The weight gradient is a convolution of the input with ``grad_output`` as the kernel,
    the forward stride as its dilation and the forward dilation as its stride; for a
    transposed convolution the roles of input and ``grad_output`` exchange. Its value comes
    from the convolution library's weight-gradient kernel; its derivatives are :func:`conv`
    and :func:`conv_input_grad`, so the result is differentiable again to any order.

    Args:
        input: the forward input ``[N, C_in, *S]``.
        grad_output: ``[N, C_out, *S_out]``, the gradient w.r.t. the convolution's output.
        weight_shape: the weight's shape, ``[C_out, C_in/groups, *K]`` (transposed:
            ``[C_in, C_out/groups, *K]``).
        stride, padding, dilation, groups, transposed, output_padding: the forward options,
            as in :func:`conv`.

    Returns:
        ``[*weight_shape]``: the gradient w.r.t. the weight, summed over the batch.

    Raises:
        ValueError: the shapes cannot belong to one convolution with these options.

    Example:
        >>> import torch, gradtap as gt
        >>> x, gy = torch.randn(2, 2, 9), torch.randn(2, 3, 4)
        >>> gt.functional.conv_weight_grad(x, gy, (3, 2, 3), stride=2).shape
        torch.Size([3, 2, 3])
    """
    weight_shape = tuple(weight_shape)
    o = _Options(
        weight_shape,
        stride,
        padding,
        dilation,
        groups,
        transposed,
        output_padding,
        "conv_weight_grad",
    )
    _check_input(input.shape, weight_shape, o, "conv_weight_grad")
    _check_grad_output(grad_output, input.shape, weight_shape, o, "conv_weight_grad")
    return _weight_grad(input, grad_output, o)


def _check_grad_output(
    grad_output: Tensor,
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    o: _Options,
    where: str,
) -> None:
    padded = tuple(n + e for n, e in zip(tuple(input_shape)[2:], o.extra, strict=True))
    expected = (
        input_shape[0],
        o.out_channels(weight_shape),
        *_output_size(padded, weight_shape[2:], o),
    )
    if tuple(grad_output.shape) != expected:
        raise ValueError(
            f"{where}: grad_output must have shape {list(expected)} for input shape "
            f"{list(input_shape)} and weight shape {list(weight_shape)} with these options; "
            f"got {list(grad_output.shape)}"
        )
