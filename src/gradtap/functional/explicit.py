"""Route a model's convolutions through :func:`gradtap.functional.conv`, without touching the model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from gradtap.functional._conv import conv

__all__ = ["explicit_conv"]


def _bind(transposed: bool) -> Callable[..., Tensor]:
    """Wrap ``conv`` with the positional signature of a native ``F.conv*d`` function."""
    if transposed:

        def call(
            input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1
        ):  # type: ignore[no-untyped-def]
            return conv(
                input, weight, bias, stride, padding, dilation, groups, True, output_padding
            )

    else:

        def call(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # type: ignore[no-untyped-def]
            return conv(input, weight, bias, stride, padding, dilation, groups)

    return call


# torch.nn.functional.conv2d *is* torch.conv2d (and likewise for the others), so one table
# covers both spellings and the calls nn.Conv*d / nn.ConvTranspose*d make.
_ROUTES: dict[Callable[..., Any], Callable[..., Tensor]] = {
    torch.conv1d: _bind(False),
    torch.conv2d: _bind(False),
    torch.conv3d: _bind(False),
    torch.conv_transpose1d: _bind(True),
    torch.conv_transpose2d: _bind(True),
    torch.conv_transpose3d: _bind(True),
}


class _ExplicitConvMode(TorchFunctionMode):
    def __init__(self, weight_ids: frozenset[int] | None) -> None:
        super().__init__()
        self._weight_ids = weight_ids

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if self._weight_ids is None or id(weight) in self._weight_ids:
                return route(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def explicit_conv(model: nn.Module | None = None) -> Iterator[None]:
    """Run the model's convolutions through :func:`gradtap.functional.conv` inside the block.

    Every ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d`` of ``model`` (and any direct
    ``F.conv*d`` / ``F.conv_transpose*d`` / ``torch.conv*d`` call whose weight is one of the
    model's parameters) computes the same numbers as natively, but its derivatives of every
    order, forward mode included, become the explicit convolutions of
    ``gt.functional.conv_input_grad`` / ``conv_weight_grad``. Convolutions whose weight is not
    a parameter of ``model`` are left alone. Nothing is written onto the model and no hook is
    installed: a ``torch.overrides.TorchFunctionMode`` reroutes the calls while the block runs.
    A ``padding_mode`` other than ``"zeros"`` works as is, since the module pads with ``F.pad``
    before calling the convolution.

    Backward passes of graphs built inside the block use the explicit formulas even when they
    run after it (``create_graph`` included). Weights are recognised by identity, so under
    ``torch.func.functional_call`` with substituted parameters pass ``model=None``.

    Args:
        model: the module whose convolutions to reroute; ``None`` reroutes every convolution.

    Yields:
        None.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, groups=1), torch.nn.Tanh())
        >>> x = torch.randn(2, 1, 8, 8)
        >>> with gt.explicit_conv(net):
        ...     out = net(x)
        >>> torch.allclose(out, net(x))
        True
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"explicit_conv expects an nn.Module or None, got {type(model).__name__}")
    weight_ids = None if model is None else frozenset(id(p) for p in model.parameters())
    with _ExplicitConvMode(weight_ids):
        yield
