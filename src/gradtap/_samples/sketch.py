"""The end-of-backward check on a random projection, where the exact sum costs a batch gradient.

After each backward, ``per_sample`` checks that every parameter's per-sample gradients add up
to what that backward added to its ``.grad`` (``units.mismatches``). For a Linear weight,
``sum_n g_n = B^T A`` costs as much as autograd's own weight gradient, a second matrix
product computed only to be compared. For such parameters (2-D, held by a module whose rule has ``total_sketch``) the check
compares ``(sum_n g_n) R`` with ``increment R`` instead, ``R`` a fixed
``[param.shape[1], K]`` Gaussian matrix scaled by ``1/sqrt(K)``, so that
``E |M R|^2 = |M|^2`` for every ``M``; ``B^T (A R)`` costs ``K`` multiply-adds per element of
``A`` and ``B``, and ``increment R`` one read of the increment.

A difference ``D`` (a use outside the calls, a wrong split) is seen as long as ``|D R|`` is
not far below ``|D|``. The worst case is a rank-1 ``D``, for which ``|D R|^2 / |D|^2`` is
``chi^2_K / K``: with ``K = 16`` it falls below 0.1 with probability about ``2e-6``, and the
check's tolerance (``1e-3`` of the gradient's size in float32) is far below the differences it
is for. ``R`` is drawn once from a generator with a fixed seed: results are reproducible.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch import Tensor

from gradtap._samples.owners import Owner

__all__ = ["K", "Sketches", "pair"]

#: Columns of the projection.
K = 16
_SEED = 0x5EED


class Sketches:
    """The projection of each parameter whose check is sketched, and the projecting itself."""

    def __init__(self, params: Mapping[str, Tensor], owners: Mapping[str, Owner]) -> None:
        sketchable = {q for o in owners.values()
                      if o.rule is not None and o.rule.total_sketch is not None
                      and not o.parametrized for q in o.direct.values()}
        self._shape: dict[str, tuple[int, torch.dtype, torch.device]] = {
            q: (p.shape[1], _compute_dtype(p.dtype), p.device) for q, p in params.items()
            if q in sketchable and p.dim() == 2 and p.shape[1] > 2 * K
        }
        for cols, _, _ in self._shape.values():  # drawn here, never inside a torch.func
            _gaussian(cols)                      # transform that runs the model

    def __contains__(self, qual: str) -> bool:
        return qual in self._shape

    def matrix(self, qual: str) -> Tensor:
        """``R`` of ``qual`` (one per width, dtype and device, made once per process)."""
        return _matrix(*self._shape[qual])

    def project(self, qual: str, t: Tensor) -> Tensor:
        """``t`` (``param.shape``) times ``R`` of ``qual``; ``t`` itself when not sketched or
        already projected (``[rows, K]``: a sketched parameter has more than ``2 K`` columns)."""
        if qual not in self._shape or (t.dim() == 2 and t.shape[1] == K):
            return t
        r = self.matrix(qual)
        dense = t if t.layout == torch.strided else t.to_dense()
        return dense.reshape(dense.shape[0], -1).to(r.dtype) @ r


@functools.lru_cache(maxsize=64)
def _gaussian(cols: int) -> Tensor:
    g = torch.Generator().manual_seed(_SEED)
    return torch.randn(cols, K, generator=g, dtype=torch.float64) / K**0.5


@functools.lru_cache(maxsize=64)
def _matrix(cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return _gaussian(cols).to(device=device, dtype=dtype)


def pair(sketches: Sketches, qual: str, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``a`` and ``b`` comparable: both projected when one of them is."""
    if a.shape == b.shape:
        return a, b
    return sketches.project(qual, a), sketches.project(qual, b)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
