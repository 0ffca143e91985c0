"""The parameter gradients the screen checks (``_screen.py``), and how it reads them.

The model's floating parameters are read once, when the screen is made (cheaper per check).
Small ones are grouped by device and dtype as their gradients will be, one fused pass a group
at the check; a large one's gradient is reduced as soon as it is accumulated, while it is
still in cache, and that reduction is used at the check if the gradient has not changed
since. The usual model (one group, nothing large, sparse or sharded) has a fast path that
reads each ``.grad`` as it is. In norms mode (``spike=``) each gradient is reduced to its L2
norm, small CPU gradients of one shape stacked into one norm.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from gradtap import _tensorops as ops
from gradtap._detect import _host
from gradtap._tensorops.sharded import is_sharded, local

__all__ = ["HALF", "STACKED", "ParamGrads"]

#: In norms mode on CPU, parameter gradients of one shape with at most this many elements each
#: are stacked and reduced in one norm.
STACKED = 1 << 14
#: Low-precision dtypes, reduced in float32.
HALF = (torch.float16, torch.bfloat16)


class ParamGrads:
    """The floating parameters of ``root``, grouped for the screen's check (see the module
    docstring); ``norms_mode`` is set through the screen's."""

    def __init__(self, root: nn.Module) -> None:
        self.norms_mode = False
        # Sparse gradients (nn.Embedding(sparse=True)) are left out of the norms.
        self.maybe_sparse = any(getattr(m, "sparse", False) is True for m in root.modules())
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, Tensor]]] = {}
        self.large: list[tuple[str, Tensor]] = []
        for name, p in root.named_parameters():
            if p.is_floating_point() and p.numel():
                if p.numel() >= _host.BIG and not self.maybe_sparse:
                    self.large.append((name, p))
                else:
                    groups.setdefault((p.device, p.dtype), []).append((name, p))
        self.groups = list(groups.values())
        # Norms mode on CPU: the one group's order and runs (see _norm_plan; () when none),
        # and the gradients last listed in that order.
        self._plan: tuple[list[tuple[str, Tensor]], list[Tensor],
                          list[tuple[int, int, tuple[int, ...]]]] | tuple[()] | None = None
        self._planned: list[Tensor] | None = None
        # The usual model's fast path reads .grad as it is; a sharded one's goes through local().
        self._one_group = ([p for _, p in self.groups[0]]
                           if len(self.groups) == 1 and not self.large
                           and not self.maybe_sparse
                           and not any(is_sharded(p) for _, p in self.groups[0])
                           else None)
        # id(param) -> (its .grad then, as a weak reference, its version then, its sum)
        self._sums: dict[int, tuple[weakref.ref[Tensor], int, Tensor]] = {}

    def any_grad(self) -> bool:
        """Whether a parameter has a gradient now."""
        return any(p.grad is not None for group in self.groups for _, p in group) or any(
            p.grad is not None for _, p in self.large)

    def sum_grad(self, p: Tensor) -> None:
        """Reduce ``p.grad`` as soon as it is accumulated (a large parameter's hook)."""
        grad = p.grad
        if grad is None:
            return
        g = grad
        if g.requires_grad:  # create_graph=True: no graph for the check
            g = g.detach()
        if self.norms_mode:
            total = torch.linalg.vector_norm(g, dtype=torch.float32 if g.dtype in HALF else None)
        else:
            total = g.sum(dtype=torch.float32) if g.dtype in HALF else g.sum()
        self._sums[id(p)] = (weakref.ref(grad), g._version, total)

    def listed(self) -> tuple[list[tuple[str, Tensor]], list[list[Tensor]],
                              list[tuple[Tensor, Tensor]]]:
        """The parameters with a gradient to check, in the order of their values: those whose
        gradients are to be reduced, by device and dtype, then those whose gradient was summed
        in backward and is unchanged since, as ``(grad, sum)``."""
        if self._one_group is not None:  # the usual model: every gradient there, one group
            plan = self._norm_plan() if self.norms_mode else None
            every: list[Any] = [p.grad for p in (self._one_group if plan is None else plan[1])]
            for g in every:
                if g is None:
                    break
            else:
                if plan is None:
                    return self.groups[0], [every], []
                self._planned = every
                return plan[0], [every], []
        params: list[tuple[str, Tensor]] = []
        groups: list[list[Tensor]] = []
        for group in self.groups:
            # A sharded gradient (FSDP2) is checked, and its norm taken, on this rank's shard.
            grads: list[Any] = [local(p.grad) for _, p in group]
            if not self.maybe_sparse and not any(g is None for g in grads):
                params += group
                groups.append(grads)
                continue
            keep = [i for i, g in enumerate(grads) if g is not None and _host.measurable(g)]
            params += [group[i] for i in keep]
            groups.append([grads[i] for i in keep])
        summed_params: list[tuple[str, Tensor]] = []
        summed: list[tuple[Tensor, Tensor]] = []
        stale: dict[tuple[torch.device, torch.dtype], list[tuple[str, Tensor, Tensor]]] = {}
        for name, p in self.large:
            g = local(p.grad)
            if g is None or not _host.measurable(g):
                continue
            entry = self._sums.get(id(p))
            if entry is not None and entry[0]() is g and entry[1] == g._version:
                summed_params.append((name, p))
                summed.append((g, entry[2]))
            else:  # changed since its backward (or no hook saw it): reduced at the check
                stale.setdefault((g.device, g.dtype), []).append((name, p, g))
        for items in stale.values():
            params += [(name, p) for name, p, _ in items]
            groups.append([g for _, _, g in items])
        return params + summed_params, groups, summed

    def _norm_plan(self) -> tuple[list[tuple[str, Tensor]], list[Tensor],
                                  list[tuple[int, int, tuple[int, ...]]]] | None:
        """How norms mode reduces the one group of small CPU parameter gradients: the group
        reordered so that parameters of one shape come together, and the ``(start, stop,
        dims)`` of each run of two or more, whose gradients are stacked and reduced in one
        norm (on CPU a foreach norm costs a kernel per tensor); the rest follow, reduced by
        one foreach norm. None when not worth it (not on CPU, nothing to stack)."""
        if self._plan is None:
            group = self.groups[0]
            by_shape: dict[tuple[int, ...], list[int]] = {}
            for i, (_, p) in enumerate(group):
                if p.device.type == "cpu" and 0 < p.dim() and p.numel() <= STACKED:
                    by_shape.setdefault(tuple(p.shape), []).append(i)
            runs = [idx for idx in by_shape.values() if len(idx) > 1]
            order = [i for idx in runs for i in idx]
            stacked = set(order)
            order += [i for i in range(len(group)) if i not in stacked]
            spans, at = [], 0
            for idx in runs:
                spans.append((at, at + len(idx), tuple(range(1, group[idx[0]][1].dim() + 1))))
                at += len(idx)
            named = [group[i] for i in order]
            self._plan = (named, [p for _, p in named], spans) if spans else ()
        return self._plan or None

    def norms(self, grads: list[Tensor]) -> Tensor:
        """The L2 norm of each of ``grads`` (one device and dtype), as one vector."""
        plan = self._plan
        if not plan or grads is not self._planned:
            return ops.group_norms(grads)
        self._planned = None
        parts = []
        low = grads[0].dtype in HALF
        for start, stop, dims in plan[2]:
            parts.append(torch.linalg.vector_norm(torch.stack(grads[start:stop]), dim=dims,
                                                  dtype=torch.float32 if low else None))
        rest = plan[2][-1][1]
        if rest < len(grads):
            parts.append(ops.group_norms(grads[rest:]))
        return torch.cat(parts)

    def new_step(self) -> None:
        """Forget the sums of this step's backwards."""
        if self._sums:
            self._sums = {}
