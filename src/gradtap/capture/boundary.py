"""Where a call's output gradient is seen when the output's own node cannot say it.

* :func:`mark_boundary` puts a boundary node on an output: an identity marked as an in-place
  op on the very tensor returned (its version counter put back, so saved tensors stay valid).
  Every later use, and every later in-place op, goes through it; uses inside the call do not.
  :func:`stands_for` says which edge such a node stands in front of, so that an enclosing
  call can credit its own uses of the tensor without the uses after it returned.
* :func:`alias` gives a second output path holding the same tensor (or a leaf returned as is)
  a view of its own, whose node sees that path's gradient.
* :class:`Region` says where a view lies in its base's storage, to cut a gradient w.r.t. the
  base down to the gradient w.r.t. the view (and to put a replacement back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gradtap.capture import compat

__all__ = ["Region", "alias", "mark_boundary", "overlaps_itself", "stands_for"]

#: Key in a node's ``metadata`` naming the edge a boundary node stands in front of.
_STANDS_FOR = "gradtap.stands_for"


class _Boundary(torch.autograd.Function):
    """An identity marked as an in-place op on its input: the tensor keeps its identity (and,
    put back by the caller, its version), while every later use goes through this node, whose
    backward hands the gradient to ``sink`` (which may return a replacement)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, sink: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.sink = sink
        ctx.mark_dirty(t)
        return t

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return ctx.sink(g), None


class _Alias(torch.autograd.Function):
    """A view of ``t`` for a second output path (or a leaf returned as is), whose backward
    hands the gradient to ``sink``. Made inside a Function, so autograd refuses in-place ops
    on it instead of routing their gradient around this node."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, sink: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.sink = sink
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return ctx.sink(g), None


def alias(t: Tensor, sink: Callable[[Tensor], Tensor]) -> Tensor:
    """A view of ``t`` whose backward hands the gradient to ``sink`` (see :class:`_Alias`)."""
    return _Alias.apply(t, sink)


def mark_boundary(t: Tensor, sink: Callable[[Tensor], Tensor]) -> bool:
    """Put a boundary node on ``t`` (the tensor itself, as an in-place identity) whose backward
    hands the gradient to ``sink``; False where autograd or the kernels do not allow an
    in-place op on it (then nothing changed, and the model cannot modify ``t`` in place
    either), or where this torch cannot put the version back (then the caller falls back to
    the tensor's own node).

    The node that later uses of ``t`` reach (the boundary node, or for a view the view's new
    node in front of its base's ``CopySlices``) notes the edge ``t`` had before, and for a
    view the ``CopySlices`` notes the edge its base had before, for :func:`stands_for`.
    """
    if not compat.available("torch._C._autograd._unsafe_set_version_counter"):
        compat.warn_fallback("torch._C._autograd._unsafe_set_version_counter")
        return False
    if overlaps_itself(t):
        # An in-place op on it is refused by the kernels; a CopySlices node of such a view
        # could not write its gradient back.
        return False
    before = (t.grad_fn, t.output_nr)
    base = t._base if t._is_view() else None
    base_before = None if base is None else (base.grad_fn, base.output_nr)
    version = t._version
    try:
        _Boundary.apply(t, sink)
    except RuntimeError:
        return False
    finally:
        compat.restore_version(t, version)
    # Read after the version is put back: the node later uses of ``t`` will have.
    node: Any = t.grad_fn
    node.metadata[_STANDS_FOR] = before
    if base is not None:
        copy: Any = base.grad_fn
        copy.metadata[_STANDS_FOR] = base_before
    return True


def stands_for(node: Any) -> tuple[Any, int] | None:
    """For a node :func:`mark_boundary` put in front of later uses, the edge it stands in
    front of: the gradient along an edge into ``node`` is the gradient w.r.t. the tensor at
    that edge. None for any other node."""
    return node.metadata.get(_STANDS_FOR)


def overlaps_itself(t: Tensor) -> bool:
    """Whether elements of ``t`` share memory by a stride of 0 (an expanded tensor): what
    the in-place kernels refuse."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


class Region:
    """Where a view lies in its base's storage, to cut a gradient w.r.t. the base to the
    gradient w.r.t. the view."""

    __slots__ = ("size", "stride", "offset", "base_size", "base_stride", "whole")

    def __init__(self, view: Tensor, base: Tensor) -> None:
        self.size, self.stride = view.shape, view.stride()
        self.offset = view.storage_offset() - base.storage_offset()
        self.base_size, self.base_stride = base.shape, base.stride()
        self.whole = view.numel() == base.numel()

    def of(self, g: Tensor) -> Tensor:
        """The view's part of ``g``, a gradient w.r.t. the base (copied out unless it is the
        whole of ``g``, so a small region does not keep a large gradient alive)."""
        if g.shape != self.base_size:
            g = g.expand(self.base_size)
        if g.stride() != self.base_stride:
            g = torch.empty_strided(self.base_size, self.base_stride, dtype=g.dtype,
                                    device=g.device).copy_(g)
        part = g.as_strided(self.size, self.stride, g.storage_offset() + self.offset)
        return part if self.whole else part.clone()

    def replaced(self, g: Tensor, part: Tensor) -> Tensor:
        """A copy of ``g`` (a gradient w.r.t. the base) with the view's region set to ``part``."""
        out = torch.empty_strided(self.base_size, self.base_stride, dtype=g.dtype,
                                  device=g.device).copy_(g)
        out.as_strided(self.size, self.stride, out.storage_offset() + self.offset).copy_(part)
        return out
