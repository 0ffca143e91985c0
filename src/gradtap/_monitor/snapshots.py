"""Kinds ``update`` and ``grad_cosine``: what the next step compares against, and the comparison.

After each step due to be followed by a computed one, the parameters (``update``) and the
gradients (``grad_cosine``) are copied into buffers kept from step to step. The next computed
step then takes the change of each parameter, its norm over the parameter's norm (stat
``ratio``), and the cosine between this step's and the previous step's gradient.

Sharded parameters (DTensors) keep this rank's local shard only; their norms and dot products
are then sums of squares and products over the shards, reduced with the step's other
statistics (:class:`~gradtap.distributed.Reduction`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradtap._tensorops import HostCopy, group_by_device_dtype, norms
from gradtap.distributed import Reduction, local_tensor

__all__ = ["Snapshots"]


class Snapshots:
    """Copies of the parameters and gradients of the last snapshot step.

    Args:
        params: ``(name, parameter)`` of the selected parameters.
        update: keep parameters (kind ``update``).
        cosine: keep gradients (kind ``grad_cosine``).
    """

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]], *, update: bool,
                 cosine: bool) -> None:
        self._params = list(params)
        self.update = update
        self.cosine = cosine
        self._prev_param: dict[str, Tensor] = {}
        self._prev_grad: dict[str, Tensor] = {}
        self._grads: set[str] = set()
        self._step = -1

    def take(self, step: int) -> None:
        """Keep what the step after ``step`` compares against."""
        if self.update:
            names = [n for n, p in self._params if p.numel()]
            cur = [local_tensor(p.detach()) for n, p in self._params if p.numel()]
            if not self._prev_param:
                self._prev_param = {n: torch.empty_like(p) for n, p in zip(names, cur)}
            if names:
                torch._foreach_copy_([self._prev_param[n] for n in names], cur)
        if self.cosine:
            self._grads = set()
            for n, p in self._params:
                g = p.grad
                if g is None or not g.numel():
                    continue
                g = local_tensor(g)
                buf = self._prev_grad.get(n)
                if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
                    self._prev_grad[n] = buf = torch.empty_like(g, memory_format=torch.contiguous_format)
                buf.copy_(g)
                self._grads.add(n)
        self._step = step

    def state_dict(self) -> dict[str, Any]:
        """The snapshots as plain tensors and numbers, for :meth:`load_state_dict`."""
        return {"step": self._step,
                "param": {n: t.clone() for n, t in self._prev_param.items()},
                "grad": {n: t.clone() for n, t in self._prev_grad.items() if n in self._grads}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, on each parameter's device."""
        devices = {n: p.device for n, p in self._params}
        self._step = int(state["step"])
        self._prev_param = {n: t.to(devices[n]) for n, t in state["param"].items()
                            if n in devices} if self.update else {}
        self._prev_grad = {n: t.to(devices[n]) for n, t in state["grad"].items()
                           if n in devices} if self.cosine else {}
        self._grads = set(self._prev_grad)

    def updates(self, step: int, params: Sequence[tuple[str, Tensor]]
                ) -> tuple[list[str], list[Tensor], list[Tensor]] | None:
        """``(names, current values, changes)`` since the snapshot just before ``step``, or
        ``None`` when there is none."""
        if not self.update or self._step != step - 1 or not self._prev_param:
            return None
        names = [n for n, _ in params if n in self._prev_param]
        cur = [p for n, p in params if n in self._prev_param]
        return names, cur, list(torch._foreach_sub(cur, [self._prev_param[n] for n in names]))

    def queue_ratio(self, cur: Sequence[Tensor], diffs: Sequence[Tensor], copy: HostCopy,
                    reduction: Reduction | None = None, counts: Sequence[bool] = ()
                    ) -> Callable[[], np.ndarray]:
        """Queue stat ``ratio`` = update norm / parameter norm (0 when the update is zero).

        With ``reduction``, ``cur`` and ``diffs`` are shards: their squared norms (of the rows
        whose ``counts`` is true) are summed over ranks first."""
        if reduction is not None:
            n = len(cur)
            h = reduction.add_sums(torch.cat([_sumsq(diffs, counts), _sumsq(cur, counts)]),
                                   "ratio")

            def un() -> np.ndarray:
                return np.sqrt(reduction.host_sums(h)[:n])

            def pn() -> np.ndarray:
                return np.sqrt(reduction.host_sums(h)[n:])
        else:
            un = copy.add_rows(norms(diffs), len(diffs))
            pn = copy.add_rows(norms(cur), len(cur))

        def ratio() -> np.ndarray:
            u, p = un(), pn()
            with np.errstate(all="ignore"):  # no update is ratio 0, even of a zero param
                return np.where(u == 0, 0.0, u / p)

        return ratio

    def queue_cosine(self, step: int, grads: Mapping[str, Tensor], copy: HostCopy,
                     reduction: Reduction | None = None, counts: Mapping[str, bool] | None = None
                     ) -> tuple[list[str], Callable[[], np.ndarray]] | None:
        """Queue stat ``cosine`` between each gradient and its snapshot (0 when either is all
        zeros): ``(names, values)``, or ``None`` when there is nothing to compare.

        With ``reduction``, ``grads`` are shards: dot products and squared norms (of the names
        whose ``counts`` is true) are summed over ranks first."""
        if not self.cosine or self._step != step - 1:
            return None
        names = [n for n in grads if n in self._grads]
        if not names:
            return None
        g = [grads[n] for n in names]
        h = [self._prev_grad[n] for n in names]
        if reduction is not None:
            keep = [bool(counts and counts.get(n)) for n in names]
            k = len(names)
            hs = reduction.add_sums(torch.cat([_dot_rows(g, h, keep), _sumsq(g, keep),
                                               _sumsq(h, keep)]), "cosine")

            def dot() -> np.ndarray:
                return reduction.host_sums(hs)[:k]

            def ng() -> np.ndarray:
                return np.sqrt(reduction.host_sums(hs)[k:2 * k])

            def nh() -> np.ndarray:
                return np.sqrt(reduction.host_sums(hs)[2 * k:])
        else:
            dot = copy.add_rows(_dots(g, h), len(g))
            ng = copy.add_rows(norms(g), len(g))
            nh = copy.add_rows(norms(h), len(h))

        def cosine() -> np.ndarray:
            denom = ng() * nh()
            with np.errstate(all="ignore"):
                return np.where(denom == 0, 0.0, dot() / np.where(denom == 0, 1.0, denom))

        return names, cosine


def _dots(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[tuple[list[int], Tensor]]:
    """Dot products of pairs of same-shape tensors (float32 accumulation at least) as float64,
    grouped by device and dtype like ``norms``."""
    out = []
    for idx in group_by_device_dtype(a).values():
        acc = torch.promote_types(a[idx[0]].dtype, torch.float32)
        out.append((idx, torch.stack([torch.dot(a[i].reshape(-1).to(acc), b[i].reshape(-1).to(acc))
                                      for i in idx]).to(torch.float64)))
    return out


def _rows(ts: Sequence[Tensor], keep: Sequence[bool]) -> list[int]:
    """Indices of the tensors that count and have elements."""
    return [i for i, t in enumerate(ts) if keep[i] and t.numel()]


def _scatter(n: int, groups: list[tuple[list[int], Tensor]], rows: list[int],
             device: torch.device) -> Tensor:
    out = torch.zeros(n, dtype=torch.float64, device=device)
    for idx, v in groups:
        out[torch.tensor([rows[j] for j in idx], device=device)] = v.to(device, torch.float64)
    return out


def _sumsq(ts: Sequence[Tensor], keep: Sequence[bool]) -> Tensor:
    """Squared L2 norm of each tensor that counts (0 for the others), float64 [len(ts)]."""
    rows = _rows(ts, keep)
    device = ts[0].device if ts else torch.device("cpu")
    groups = norms([ts[i] for i in rows]) if rows else []
    return _scatter(len(ts), [(idx, v * v) for idx, v in groups], rows, device)


def _dot_rows(a: Sequence[Tensor], b: Sequence[Tensor], keep: Sequence[bool]) -> Tensor:
    """Dot product of each pair that counts (0 for the others), float64 [len(a)]."""
    rows = _rows(a, keep)
    device = a[0].device if a else torch.device("cpu")
    groups = _dots([a[i] for i in rows], [b[i] for i in rows]) if rows else []
    return _scatter(len(a), groups, rows, device)
