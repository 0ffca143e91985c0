"""The per-sample rule tables and the helpers rules share.

Rules are pure functions of one module call. They see the forward input and the gradient of
the loss w.r.t. the output, both with the sample index at dim 0 and the gradient already
scaled so that sample ``n``'s slice is ``d s_n / d output`` (docs/semantics.md, "Per-sample gradients"):

* ``GRAD[type](module, inp, grad_out, names) -> {name: [N, *param.shape]}``: per-sample
  gradients of the module's own parameters listed in ``names``;
* ``NORM[type](...) -> {name: [N]}``: squared per-sample gradient norms, without building
  ``[N, *param.shape]`` where a cheaper formulation exists;
* ``SUM_SQ[type](...) -> {name: param.shape}``: ``sum_n g_n**2`` (elementwise), likewise.

``NORM`` and ``SUM_SQ`` are optional: without them the quantity is reduced from ``GRAD``
chunk by chunk over samples (:func:`norm_sq_from_grad`, :func:`sum_sq_from_grad`), so the
temporary stays within :func:`budget`.

A module whose parameters all act as linear maps inside a more complex call (attention) can
instead register in ``PIECES`` a function of the whole call,
``(module, inputs, grad_outputs, scale) -> list[Piece] | None``, that replays the call once
for the whole batch and returns each linear map's input and output gradient; the Linear
formulas then give gradients, norms (ghost or direct) and sums of squares. ``None`` means
"cannot replay this call": the ``torch.func`` fallback takes it.

``CHECK[type](module) -> str | None`` names a reason why a module couples its samples
(BatchNorm in training mode). ``BATCH_DIM[type](module) -> int`` is the sample dim a type's
forward requires (0 for convolutions and GroupNorm, ``batch_first`` for attention).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn

from gradtap._registry import TypeTable

__all__ = [
    "BATCH_DIM",
    "CHECK",
    "GRAD",
    "NORM",
    "PIECES",
    "SUM_SQ",
    "Piece",
    "PiecesRule",
    "Rule",
    "batch_first",
    "budget",
    "chunks",
    "norm_sq_from_grad",
    "sum_sq_from_grad",
]


class Rule(Protocol):
    """A per-sample rule: ``(module, inp [N, ...], grad_out [N, ...], names) -> {name: T}``."""

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


class PiecesRule(Protocol):
    """``(module, inputs, grad_outputs, scale) -> list[Piece] | None`` (see module doc)."""

    def __call__(
        self,
        module: nn.Module,
        inputs: dict[str, Tensor],
        grad_outputs: dict[str, Tensor | None],
        scale: float,
    ) -> list[Piece] | None: ...


GRAD: TypeTable[Rule] = TypeTable("per-sample gradient")
NORM: TypeTable[Rule] = TypeTable("per-sample squared norm")
SUM_SQ: TypeTable[Rule] = TypeTable("per-sample sum of squares")
PIECES: TypeTable[PiecesRule] = TypeTable("per-sample linear pieces")
CHECK: TypeTable[Callable[[nn.Module], str | None]] = TypeTable("per-sample validity check")
BATCH_DIM: TypeTable[Callable[[nn.Module], int]] = TypeTable("per-sample batch dim")


def batch_first(module: nn.Module) -> int:
    """``BATCH_DIM`` entry of types whose forward takes ``[N, C, ...]``."""
    return 0

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


def _per_sample_numel(module: nn.Module, names: frozenset[str]) -> int:
    params = dict(module.named_parameters(recurse=False))
    return sum(params[k].numel() for k in names if k in params)


def norm_sq_from_grad(
    rule: Rule, module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Squared per-sample norms from a ``GRAD`` rule, a chunk of samples at a time."""
    n = inp.shape[0]
    parts: dict[str, list[Tensor]] = {}
    limit = budget(inp, grad_out)
    for sl in chunks(n, _per_sample_numel(module, names), limit):
        for k, g in rule(module, inp[sl], grad_out[sl], names).items():
            parts.setdefault(k, []).append(g.flatten(1).square().sum(1))
    return {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}


def sum_sq_from_grad(
    rule: Rule, module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """``sum_n g_n**2`` from a ``GRAD`` rule, a chunk of samples at a time."""
    n = inp.shape[0]
    out: dict[str, Tensor] = {}
    limit = budget(inp, grad_out)
    for sl in chunks(n, _per_sample_numel(module, names), limit):
        for k, g in rule(module, inp[sl], grad_out[sl], names).items():
            s = g.square().sum(0)
            out[k] = s if k not in out else out[k].add_(s)
    return out
