"""DP-SGD under ``DistributedDataParallel``: one clipped sum and one draw of noise for the job.

DDP all-reduces ``.grad`` as an average, and the private step needs a sum of every rank's
clipped sum with the noise added once. :class:`Ranks` therefore turns DDP's own gradient
all-reduce off for as long as ``dp_sgd`` is attached (``require_backward_grad_sync = False``,
what ``ddp.no_sync()`` does; restored on detach) and sums the ranks' clipped sums itself at
the step, in one all-reduce (``SUM``) of the flattened sums over DDP's process group. Rank
0 of the group adds the noise to its own clipped sum before that all-reduce, so the noise
is drawn once per step for the whole job, from rank 0's generator, and every rank receives
the same noisy sum (the all-reduce gives every rank the same result), hence the same
parameters after the step. Under a loss scaler the ranks also agree on which steps overflow
(:meth:`Ranks.agree_on_overflow`). The other ranks never know the noise. Every rank must take every
step (an empty local batch contributes zeros). A DDP model made with ``static_graph=True``
is refused (its reducer cannot stand aside). A plain model on one process is a job of one
rank: nothing is exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradtap.capture import HookSet
from gradtap.select import wrapper_chain

__all__ = ["Ranks"]


class Ranks:
    """The ranks of a DDP model (or this process alone for any other model)."""

    def __init__(self, hooks: HookSet, model: nn.Module) -> None:
        ddp = next((m for m in wrapper_chain(model)
                    if isinstance(m, nn.parallel.DistributedDataParallel)), None)
        self._ddp = ddp
        self._group = None if ddp is None else ddp.process_group
        if ddp is not None and getattr(ddp, "static_graph", False):
            raise NotImplementedError(
                "dp_sgd: a DistributedDataParallel model made with static_graph=True is not "
                "supported: dp_sgd turns DDP's own gradient all-reduce off (as no_sync() "
                "does), which DDP's static graph does not allow; make it with "
                "static_graph=False")
        if ddp is not None:
            was = ddp.require_backward_grad_sync
            ddp.require_backward_grad_sync = False

            def restore() -> None:
                ddp.require_backward_grad_sync = was

            hooks.add_cleanup(restore)

    @property
    def draws_noise(self) -> bool:
        """Whether this rank adds the step's noise (rank 0 of the group, or a lone process)."""
        if self._ddp is None:
            return True
        return dist.get_rank(self._group) == 0

    def sum(self, tensors: list[Tensor]) -> None:
        """Replace each of ``tensors`` by its sum over the ranks, in place (one all-reduce)."""
        if self._ddp is None or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def agree_on_overflow(self, params: list[Tensor]) -> None:
        """Before a loss scaler checks ``params``' gradients: when any rank's hold an inf or
        NaN, put a NaN into this rank's too (one all-reduce of a flag, no host read), so
        every rank's scaler skips the step. A missing ``.grad`` becomes zeros, so a rank
        without samples has one to mark."""
        if self._ddp is None:
            return
        floating = [p for p in params if p.is_floating_point() and p.requires_grad]
        if not floating:
            return
        for p in floating:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in floating if p.grad is not None]
        bad = torch.stack([g.isfinite().all().logical_not() for g in grads]).any()
        flag = bad.to(torch.float32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        first = grads[0].view(-1)[:1]
        first.copy_(torch.where(flag > 0, torch.full_like(first, float("nan")), first))
