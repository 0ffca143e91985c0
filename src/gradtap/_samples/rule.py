"""The per-sample rule entry, the table of entries, and the helpers rules share.

One :class:`PerSampleRule` per layer family holds everything ``gt.per_sample`` needs for
that family's module types, registered in :data:`PER_SAMPLE` (looked up through the class
hierarchy, ``gradtap._registry.TypeTable``). Rules are pure functions of one module call.
They see the forward input and the gradient of the loss w.r.t. the output, both with the
sample index at dim 0 and the gradient already scaled so that sample ``n``'s slice is
``d s_n / d output`` (docs/semantics.md, "Per-sample gradients"), and return results keyed
by parameter name relative to the module, for the names asked:

* ``grad(module, inp, grad_out, names) -> {name: [N, *param.shape]}``: per-sample gradients;
* ``norm_sq(...) -> {name: [N]}``: squared per-sample gradient norms, without building
  ``[N, *param.shape]`` where a cheaper formulation exists;
* ``sum_sq(...) -> {name: param.shape}``: ``sum_n g_n**2`` (elementwise), likewise.

* ``total(...) -> {name: param.shape}``: ``sum_n g_n``, the batch gradient (what autograd
  would accumulate, times the scale), used when ``per_sample(own_grad=True)`` fills ``.grad``.

* ``total_sketch(module, inp, grad_out, names, r) -> {name: (sum_n g_n).flatten(1) @ r}``
  for the names it covers: the batch gradient times a random matrix ``r``
  (``[param.shape[1:].numel(), k]``) without building the batch gradient, for the check at the
  end of backward (``gradtap._samples.sketch``).

``norm_sq``, ``sum_sq`` and ``total`` are optional fast paths: without them the quantity is
reduced from ``grad`` chunk by chunk over samples (:meth:`PerSampleRule.norm_sq_of`,
:meth:`PerSampleRule.sum_sq_of`, :meth:`PerSampleRule.total_of`), so the temporary stays
within :func:`budget`. ``total_sketch`` is optional too: without it the check uses ``total``.

A module whose parameters all act as linear maps inside a more complex call (attention) can
instead give ``pieces``, a function of the whole call,
``(module, inputs, grad_outputs, scale) -> list[Piece] | None``, that replays the call once
for the whole batch and returns each linear map's input and output gradient; the Linear
formulas then give gradients, norms (ghost or direct) and sums of squares. ``None`` means
"cannot replay this call": the ``torch.func`` fallback takes it.

A pieces rule may also give ``own_forward(module, args, kwargs, call) -> output | None``, the
module's forward computed with its selected parameters detached (``call.detached(name, p)``)
and its linear maps' inputs and output gradients read as they happen (``call.keep``,
``call.watch``), and ``own_pieces(module, call, grad_outputs, scale) -> list[Piece] | None``
from what it read and the call's output gradients: with ``own_grad=True`` the call is then never replayed. ``None`` from ``own_forward``
means "not this call" (the module's own forward runs, autograd keeps its path).

``check(module) -> str | None`` names a reason why a module couples its samples (BatchNorm in
training mode). ``batch_dim`` is the sample dim a type's forward requires (0 for convolutions
and GroupNorm; for attention a function of the module, ``batch_first``); ``None`` accepts any.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from gradtap._registry import TypeTable

__all__ = [
    "MIN_BUDGET",
    "PER_SAMPLE",
    "GradRule",
    "OwnCall",
    "PerSampleRule",
    "Piece",
    "PiecesRule",
    "budget",
    "chunks",
]


class GradRule(Protocol):
    """``(module, inp [N, ...], grad_out [N, ...], names) -> {name: tensor}``."""

    def __call__(
        self, module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
    ) -> dict[str, Tensor]: ...


class Piece(NamedTuple):
    """One linear map ``y = x W^T (+ b)`` inside a module call, for all samples at once.

    ``name`` is the parameter (relative to the module); several pieces with one name are
    consecutive blocks of its rows, in order (``in_proj_weight``'s query, key and value
    parts). ``inp`` ``[N, T, I]`` is the map's input, ``None`` for a bias; ``grad_out``
    ``[N, T, O]`` the per-sample gradient w.r.t. the map's output.
    """

    name: str
    inp: Tensor | None
    grad_out: Tensor


class OwnCall(Protocol):
    """What an ``own_forward`` reads during one call (see the module doc)."""

    def detached(self, name: str, p: Tensor) -> Tensor:
        """``p`` (the parameter ``name``, relative to the module) as the call should use it:
        detached when per_sample computes its gradient, else ``p`` itself."""
        ...

    def keep(self, key: str, t: Tensor) -> None:
        """Keep a forward tensor of the call (detached) under ``key``."""
        ...

    def watch(self, key: str, t: Tensor) -> None:
        """Keep the gradient w.r.t. ``t`` under ``key`` when backward computes it."""
        ...

    @property
    def kept(self) -> dict[str, Tensor]: ...

    @property
    def grads(self) -> dict[str, Tensor]: ...


class PiecesRule(Protocol):
    """``(module, inputs, grad_outputs, scale) -> list[Piece] | None`` (see module doc)."""

    def __call__(
        self,
        module: nn.Module,
        inputs: dict[str, Tensor],
        grad_outputs: dict[str, Tensor | None],
        scale: float,
    ) -> list[Piece] | None: ...


@dataclass(frozen=True)
class PerSampleRule:
    """What ``gt.per_sample`` needs for one layer family (see the module doc for each field).

    Args:
        grad: per-sample gradients of one call.
        norm_sq: optional fast path for the squared per-sample norms.
        sum_sq: optional fast path for ``sum_n g_n**2``.
        total: optional fast path for ``sum_n g_n`` (the batch gradient).
        total_cost: ``(inp, grad_out) -> int``, what ``total`` costs in multiply-adds: when
            per-sample gradients are built anyway, their sum costs their size, and the
            cheaper of the two is taken. Without it they are summed.
        norm_builds: ``(module, inp, grad_out) -> bool``: whether ``norm_sq`` builds
            per-sample gradients for this call (a direct form, chunk by chunk); a clipped
            sum then takes them rather than a closed form (``_samples.clipped``).
        total_sketch: optional ``total`` times a random matrix, for the end-of-backward
            check when ``total`` costs as much as autograd's own batch gradient.
        pieces: the call's linear maps, for types without ``grad``.
        own_forward: the forward with selected parameters detached, reading the linear
            maps' inputs and output gradients (``own_grad=True``).
        own_pieces: the pieces from what ``own_forward`` read.
        check: a reason why a module couples its samples, or ``None``.
        batch_dim: the sample dim the type's forward requires (an int, or a function of the
            module), or ``None`` for any.

    Raises:
        TypeError: neither ``grad`` nor ``pieces`` is given.
    """

    grad: GradRule | None = None
    norm_sq: GradRule | None = None
    sum_sq: GradRule | None = None
    total: GradRule | None = None
    total_cost: Callable[[Tensor, Tensor], int] | None = None
    norm_builds: Callable[[nn.Module, Tensor, Tensor], bool] | None = None
    total_sketch: Callable[[nn.Module | None, Tensor, Tensor, frozenset[str], Tensor],
                           dict[str, Tensor]] | None = None
    pieces: PiecesRule | None = None
    own_forward: Callable[[nn.Module, tuple, dict, OwnCall], Any] | None = None
    own_pieces: Callable[[nn.Module, OwnCall, dict[str, Tensor | None], float],
                         list[Piece] | None] | None = None
    check: Callable[[nn.Module], str | None] | None = None
    batch_dim: int | Callable[[nn.Module], int] | None = None

    def __post_init__(self) -> None:
        if self.grad is None and self.pieces is None:
            raise TypeError("PerSampleRule needs grad= (per-sample gradients of one call) or "
                            "pieces= (the call's linear maps)")

    def required_batch_dim(self, module: nn.Module) -> int | None:
        """The sample dim ``module``'s forward requires, or ``None`` for any."""
        return self.batch_dim(module) if callable(self.batch_dim) else self.batch_dim

    def norm_sq_of(self, module: nn.Module, inp: Tensor, grad_out: Tensor,
                   names: frozenset[str]) -> dict[str, Tensor]:
        """Squared per-sample norms: the fast path, or ``grad`` a chunk of samples at a time."""
        if self.norm_sq is not None:
            return self.norm_sq(module, inp, grad_out, names)
        assert self.grad is not None
        parts: dict[str, list[Tensor]] = {}
        for sl in chunks(inp.shape[0], _numel(module, names), budget(inp, grad_out)):
            for k, g in self.grad(module, inp[sl], grad_out[sl], names).items():
                parts.setdefault(k, []).append((g.flatten(1) if g.dim() > 1 else g.unsqueeze(1)).square().sum(1))
        return {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}

    def sum_sq_of(self, module: nn.Module, inp: Tensor, grad_out: Tensor,
                  names: frozenset[str]) -> dict[str, Tensor]:
        """``sum_n g_n**2``: the fast path, or ``grad`` a chunk of samples at a time."""
        if self.sum_sq is not None:
            return self.sum_sq(module, inp, grad_out, names)
        return self._summed(module, inp, grad_out, names, lambda g: g.square().sum(0))

    def total_of(self, module: nn.Module, inp: Tensor, grad_out: Tensor,
                 names: frozenset[str]) -> dict[str, Tensor]:
        """``sum_n g_n``: the fast path, or ``grad`` a chunk of samples at a time."""
        if self.total is not None:
            return self.total(module, inp, grad_out, names)
        return self._summed(module, inp, grad_out, names, lambda g: g.sum(0))

    def _summed(self, module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str],
                reduce: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
        """``sum`` over chunks of samples of ``reduce`` (a sum over dim 0) of ``grad``'s."""
        assert self.grad is not None
        out: dict[str, Tensor] = {}
        for sl in chunks(inp.shape[0], _numel(module, names), budget(inp, grad_out)):
            for k, g in self.grad(module, inp[sl], grad_out[sl], names).items():
                s = reduce(g)
                out[k] = s if k not in out else out[k].add_(s)
        return out


#: The rule entry of every supported module type (and, through the MRO, its subclasses).
PER_SAMPLE: TypeTable[PerSampleRule] = TypeTable("per-sample gradient")

#: Temporaries of at least this many elements are always allowed (16 MiB of float32).
MIN_BUDGET = 1 << 22


def budget(*tensors: Tensor) -> int:
    """Element budget for a rule's temporaries: the size of the tensors it was given.

    Those tensors are alive anyway (autograd saved them), so a temporary of the same size
    at most doubles the layer's footprint; small layers get :data:`MIN_BUDGET`.
    """
    return max(MIN_BUDGET, sum(t.numel() for t in tensors))


def chunks(n: int, per_sample: int, limit: int) -> Iterator[slice]:
    """Split ``range(n)`` into slices whose temporaries (``per_sample`` each) fit ``limit``."""
    size = max(1, limit // max(1, per_sample))
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def _numel(module: nn.Module, names: frozenset[str]) -> int:
    params = dict(module.named_parameters(recurse=False))
    return sum(params[k].numel() for k in names if k in params)
