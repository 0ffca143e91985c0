"""Kinds ``update`` and ``grad_cosine``: what the next step compares against, and the comparison.

After each step due to be followed by a computed one, the parameters (``update``) and the
gradients (``grad_cosine``) are copied into buffers kept from step to step. The next computed
step then takes the change of each parameter, its norm over the parameter's norm (stat
``ratio``), and the cosine between this step's and the previous step's gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradtap._tensorops import HostCopy, group_by_device_dtype, norms

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
            cur = [p.detach() for n, p in self._params if p.numel()]
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

    def queue_ratio(self, cur: Sequence[Tensor], diffs: Sequence[Tensor],
                    copy: HostCopy) -> Callable[[], np.ndarray]:
        """Queue stat ``ratio`` = update norm / parameter norm (0 when the update is zero)."""
        un = copy.add_rows(norms(diffs), len(diffs))
        pn = copy.add_rows(norms(cur), len(cur))

        def ratio() -> np.ndarray:
            u, p = un(), pn()
            with np.errstate(all="ignore"):  # no update is ratio 0, even of a zero param
                return np.where(u == 0, 0.0, u / p)

        return ratio

    def queue_cosine(self, step: int, grads: Mapping[str, Tensor], copy: HostCopy
                     ) -> tuple[list[str], Callable[[], np.ndarray]] | None:
        """Queue stat ``cosine`` between each gradient and its snapshot (0 when either is all
        zeros): ``(names, values)``, or ``None`` when there is nothing to compare."""
        if not self.cosine or self._step != step - 1:
            return None
        names = [n for n in grads if n in self._grads]
        if not names:
            return None
        g = [grads[n] for n in names]
        h = [self._prev_grad[n] for n in names]
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
