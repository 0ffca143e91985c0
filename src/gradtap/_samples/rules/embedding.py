"""Per-sample rules for ``nn.Embedding`` (with ``padding_idx``).

Sample n's weight gradient scatters its output gradients onto the rows it looked up:
``g_n[v] = sum_{t: idx_nt = v} go_nt``; tokens equal to ``padding_idx`` contribute nothing,
as in the module's own backward. Norms and the sum of squares need only the rows each sample
touched: the (sample, row) keys are sorted, equal keys summed into segments, and the
segments squared, so the cost is ``O(N T D)`` instead of ``O(N V D)``, without a host sync
(every size is known in advance).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from gradtap._samples.buffers import zeros
from gradtap._samples.rule import PerSampleRule

__all__ = ["EMBEDDING", "check_embedding", "grad_embedding", "norm_embedding",
           "sum_sq_embedding", "total_embedding"]


def check_embedding(module: nn.Module) -> str | None:
    """``scale_grad_by_freq`` divides by token counts over the whole batch: samples couple."""
    if module.scale_grad_by_freq:
        return (
            "scale_grad_by_freq=True scales each row's gradient by its frequency in the whole "
            "batch, so one sample's gradient depends on the others"
        )
    return None


def _flat(module: nn.Embedding, inp: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
    n = inp.shape[0]
    idx = inp.reshape(n, -1)
    b = grad_out.reshape(n, -1, grad_out.shape[-1])
    if module.padding_idx is not None:
        b = b.masked_fill(torch.eq(idx, module.padding_idx).unsqueeze(-1), 0)
    return idx, b


def _keys(module: nn.Embedding, idx: Tensor) -> Tensor:
    n = idx.shape[0]
    offsets = torch.arange(n, device=idx.device).mul_(module.num_embeddings)
    return (idx + offsets[:, None]).flatten()


def _rows_added(rows: int, keys: Tensor, b: Tensor, pooled: bool = False) -> Tensor:
    """``[rows, D]`` zeros with each row of ``b`` (``[..., D]``) added onto row ``keys[i]``
    (``pooled``: in a result buffer, ``buffers``)."""
    d = b.shape[-1]
    out = zeros((rows, d), b) if pooled else b.new_zeros(rows, d)
    return out.index_add_(0, keys, b.reshape(-1, d))


def grad_embedding(
    module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Per-sample gradients ``weight: [N, num_embeddings, embedding_dim]``."""
    if "weight" not in names:
        return {}
    module = cast(nn.Embedding, module)
    idx, b = _flat(module, inp, grad_out)
    n, _, d = b.shape
    g = _rows_added(n * module.num_embeddings, _keys(module, idx), b, pooled=True)
    return {"weight": g.view(n, module.num_embeddings, d)}


def _segments(module: nn.Embedding, inp: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
    """Per (sample, row) sums ``[N*T, D]`` and their keys ``sample * V + row`` ``[N*T]``.

    There are at most N*T distinct keys; rows past the last segment stay zero, so whatever
    key they carry adds nothing downstream.
    """
    idx, b = _flat(module, inp, grad_out)
    d = b.shape[2]
    key, order = _keys(module, idx).sort()
    starts = torch.ones_like(key, dtype=torch.bool)
    starts[1:] = key[1:] != key[:-1]
    segment = starts.cumsum(0).sub_(1)
    sums = b.new_zeros(key.shape[0], d).index_add_(0, segment, b.reshape(-1, d)[order])
    seg_key = torch.zeros_like(key).scatter_(0, segment, key)
    return sums, seg_key


def norm_embedding(
    module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Squared per-sample norms ``[N]`` from the touched rows only."""
    if "weight" not in names:
        return {}
    module = cast(nn.Embedding, module)
    sums, seg_key = _segments(module, inp, grad_out)
    sq = sums.square().sum(1)
    out = sq.new_zeros(inp.shape[0]).index_add_(0, seg_key // module.num_embeddings, sq)
    return {"weight": out}


def sum_sq_embedding(
    module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """``sum_n g_n**2`` ``[num_embeddings, embedding_dim]`` from the touched rows only."""
    if "weight" not in names:
        return {}
    module = cast(nn.Embedding, module)
    sums, seg_key = _segments(module, inp, grad_out)
    out = sums.new_zeros(module.num_embeddings, sums.shape[1])
    out.index_add_(0, seg_key % module.num_embeddings, sums.square())
    return {"weight": out}


def total_embedding(
    module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """``sum_n g_n``: every output gradient added onto the row it looked up."""
    if "weight" not in names:
        return {}
    module = cast(nn.Embedding, module)
    idx, b = _flat(module, inp, grad_out)
    return {"weight": _rows_added(module.num_embeddings, idx.flatten(), b)}


#: ``nn.Embedding``: norms and sums of squares from the touched rows only.
EMBEDDING = PerSampleRule(grad=grad_embedding, norm_sq=norm_embedding, sum_sq=sum_sq_embedding,
                          total=total_embedding, total_cost=lambda inp, go: go.numel(),
                          check=check_embedding)
