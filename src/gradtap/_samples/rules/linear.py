"""Per-sample rules for ``nn.Linear`` with any number of leading (sequence) dims.

With ``a = inp`` flattened to ``[N, T, I]`` and ``b = grad_out`` to ``[N, T, O]``, sample n's
weight gradient is ``b_n^T a_n`` ``[O, I]`` and its bias gradient ``sum_t b_nt`` ``[O]``.

Squared norms: without sequence dims ``||b_n a_n^T||^2 = ||a_n||^2 ||b_n||^2``; with them
either the direct product (cost ``N T O I``) or the Gram ("ghost") form
``sum_{t,t'} (a_n a_n^T)_{tt'} (b_n b_n^T)_{tt'}`` (cost ``N T^2 (I + O)``), the cheaper by
flop count. The sum of squares over samples has the closed form ``(b^2)^T (a^2)`` when there
are no sequence dims; with them it is reduced from per-sample gradients in chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeAlias

import torch
from torch import Tensor, nn

from gradtap._samples.buffers import pooled
from gradtap._samples.rule import PerSampleRule, Piece, budget, chunks

__all__ = ["LINEAR", "grad_linear", "grad_pieces", "norm_builds_linear", "norm_linear",
           "norm_sq_pieces",
           "sketch_linear", "sum_sq_linear", "sum_sq_pieces", "total_linear", "total_pieces"]


def _flat(inp: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
    n = inp.shape[0]
    return inp.reshape(n, -1, inp.shape[-1]), grad_out.reshape(n, -1, grad_out.shape[-1])


def grad_linear(
    module: nn.Module | None, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Per-sample gradients ``weight: [N, O, I]``, ``bias: [N, O]``."""
    a, b = _flat(inp, grad_out)
    out: dict[str, Tensor] = {}
    if "weight" in names:
        g = pooled((a.shape[0], b.shape[2], a.shape[2]), b,
                   torch.promote_types(a.dtype, b.dtype))
        if a.shape[1] == 1:
            bn, an = b[:, 0, :, None], a[:, 0, None, :]
            out["weight"] = bn * an if g is None else torch.mul(bn, an, out=g)
        else:
            bt = b.transpose(1, 2)
            out["weight"] = torch.bmm(bt, a) if g is None else torch.bmm(bt, a, out=g)
    if "bias" in names:
        out["bias"] = b.sum(1)
    return out


def norm_linear(
    module: nn.Module | None,
    inp: Tensor,
    grad_out: Tensor,
    names: frozenset[str],
    form: Literal["direct", "ghost"] | None = None,
) -> dict[str, Tensor]:
    """Squared per-sample norms ``[N]``, direct or Gram form, whichever costs fewer flops.

    ``form`` forces ``"direct"`` or ``"ghost"`` for inputs with sequence dims (for tests and
    benchmarks).
    """
    a, b = _flat(inp, grad_out)
    n, t, i = a.shape
    o = b.shape[2]
    out: dict[str, Tensor] = {}
    if "weight" in names:
        if t == 1:
            out["weight"] = a.square().sum((1, 2)) * b.square().sum((1, 2))
        elif (form or ("ghost" if _ghost_cheaper(t, i, o) else "direct")) == "ghost":
            parts = []
            for sl in chunks(n, 2 * t * t, budget(a, b)):
                gram_a = torch.bmm(a[sl], a[sl].transpose(1, 2))
                gram_b = torch.bmm(b[sl], b[sl].transpose(1, 2))
                parts.append((gram_a * gram_b).sum((1, 2)))
            out["weight"] = torch.cat(parts)
        else:
            parts = [
                torch.bmm(b[sl].transpose(1, 2), a[sl]).square().sum((1, 2))
                for sl in chunks(n, o * i, budget(a, b))
            ]
            out["weight"] = torch.cat(parts)
    if "bias" in names:
        out["bias"] = b.sum(1).square().sum(1)
    return out


def _ghost_cheaper(t: int, i: int, o: int) -> bool:
    return t * (i + o) <= o * i


def norm_builds_linear(module: nn.Module | None, inp: Tensor, grad_out: Tensor) -> bool:
    """Whether :func:`norm_linear` builds per-sample gradients (the direct form)."""
    t = inp.reshape(inp.shape[0], -1, inp.shape[-1]).shape[1] if inp.shape[0] else 1
    return t > 1 and not _ghost_cheaper(t, inp.shape[-1], grad_out.shape[-1])


def sum_sq_linear(
    module: nn.Module | None, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """``sum_n g_n**2``: one matrix product ``(b^2)^T (a^2)`` without sequence dims."""
    a, b = _flat(inp, grad_out)
    out: dict[str, Tensor] = {}
    if "bias" in names:
        out["bias"] = b.sum(1).square().sum(0)
    if "weight" in names:
        if a.shape[1] == 1:
            out["weight"] = b[:, 0].square().T @ a[:, 0].square()
        else:
            total = a.new_zeros(b.shape[2], a.shape[2])
            for sl in chunks(a.shape[0], b.shape[2] * a.shape[2], budget(a, b)):
                total += torch.bmm(b[sl].transpose(1, 2), a[sl]).square_().sum(0)
            out["weight"] = total
    return out


def total_linear(
    module: nn.Module | None, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """``sum_n g_n``: the batch gradient, one matrix product over all rows."""
    a = inp.reshape(-1, inp.shape[-1])
    b = grad_out.reshape(-1, grad_out.shape[-1])
    out: dict[str, Tensor] = {}
    if "weight" in names:
        out["weight"] = b.T @ a
    if "bias" in names:
        out["bias"] = b.sum(0)
    return out


def sketch_linear(
    module: nn.Module | None, inp: Tensor, grad_out: Tensor, names: frozenset[str], r: Tensor
) -> dict[str, Tensor]:
    """``(sum_n g_n) @ r`` for the weight, as ``b^T (a r)``: ``k`` multiply-adds per element
    of the input and of the output gradient, instead of the matrix product ``b^T a``."""
    if "weight" not in names:
        return {}
    a = inp.reshape(-1, inp.shape[-1]).to(r.dtype)
    b = grad_out.reshape(-1, grad_out.shape[-1]).to(r.dtype)
    return {"weight": b.T @ (a @ r)}


#: ``nn.Linear``: closed forms for every quantity.
LINEAR = PerSampleRule(grad=grad_linear, norm_sq=norm_linear, sum_sq=sum_sq_linear,
                       total=total_linear, total_sketch=sketch_linear,
                       norm_builds=norm_builds_linear,
                       total_cost=lambda inp, go: go.numel() * inp.shape[-1])


def _by_name(pieces: list[Piece], names: frozenset[str]) -> dict[str, list[Piece]]:
    grouped: dict[str, list[Piece]] = {}
    for piece in pieces:
        if piece.name in names:
            grouped.setdefault(piece.name, []).append(piece)
    return grouped


#: A linear rule's signature as the pieces call it: the module is not needed (None).
_LinearRule: TypeAlias = Callable[[nn.Module | None, Tensor, Tensor, frozenset[str]], dict[str, Tensor]]


def _piece(rule: _LinearRule, piece: Piece) -> Tensor:
    if piece.inp is None:  # a bias: the map's input is a constant 1
        n, o = piece.grad_out.shape[0], piece.grad_out.shape[-1]
        ones = piece.grad_out.new_ones(n, 1, 1)
        return rule(None, ones, piece.grad_out.reshape(n, -1, o).sum(1, keepdim=True),
                    frozenset({"bias"}))["bias"]
    return rule(None, piece.inp, piece.grad_out, frozenset({"weight"}))["weight"]


def grad_pieces(pieces: list[Piece], names: frozenset[str]) -> dict[str, Tensor]:
    """Per-sample gradients ``[N, *param.shape]`` of the parameters the pieces use."""
    return {k: _cat([_piece(grad_linear, p) for p in ps], 1)
            for k, ps in _by_name(pieces, names).items()}


def norm_sq_pieces(pieces: list[Piece], names: frozenset[str]) -> dict[str, Tensor]:
    """Squared per-sample norms ``[N]``: row blocks add up."""
    out = {}
    for k, ps in _by_name(pieces, names).items():
        parts = [_piece(norm_linear, p) for p in ps]
        out[k] = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
    return out


def sum_sq_pieces(pieces: list[Piece], names: frozenset[str]) -> dict[str, Tensor]:
    """``sum_n g_n**2`` ``param.shape``, row blocks concatenated."""
    return {k: _cat([_piece(sum_sq_linear, p) for p in ps], 0)
            for k, ps in _by_name(pieces, names).items()}


def total_pieces(pieces: list[Piece], names: frozenset[str]) -> dict[str, Tensor]:
    """``sum_n g_n`` ``param.shape``, row blocks concatenated."""
    return {k: _cat([_piece(total_linear, p) for p in ps], 0)
            for k, ps in _by_name(pieces, names).items()}


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    """``torch.cat`` without the copy of a lone part."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
