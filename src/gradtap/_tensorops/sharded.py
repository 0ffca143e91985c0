"""Tensors split across ranks: the local part of a sharded tensor (a ``DTensor``, as FSDP2
leaves gradients), sums of squares of whole tensors over all ranks and shards, and the one
flag all ranks agree on.

A ``DTensor`` placed ``Shard(d)`` on a mesh dimension holds a slice of the tensor on each rank
of that dimension, ``Replicate()`` the whole (a copy: counted once, never summed across it).
Sums of squares of the local parts are summed across the sharding dimensions only, in one
collective per distinct sharding (FSDP2: one for all gradients). A plain tensor is whole on
every rank: nothing is communicated for it. Without a process group nothing is communicated.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from gradtap._tensorops.groups import group_by_device_dtype
from gradtap._tensorops.l2 import group_sumsq

_T = TypeVar("_T", bound=Tensor | None)

__all__ = ["all_ranks_max", "centered_rows", "is_distributed", "is_sharded", "local", "rebuild",
           "row_norms", "sumsq_whole", "world"]


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (no DTensor exists unless its module was imported).

    Example:
        >>> import torch
        >>> is_sharded(torch.ones(2))
        False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: _T) -> _T:
    """This rank's part of ``t``: the local shard of a ``DTensor``, else ``t`` itself (None
    stays None)."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[union-attr]


def rebuild(like: Tensor, part: Tensor) -> Tensor:
    """``part`` (a new local part of ``like``) as a tensor placed like ``like``.

    Example:
        >>> import torch
        >>> rebuild(torch.ones(2), torch.zeros(2))
        tensor([0., 0.])
    """
    if not is_sharded(like):
        return part
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(part, like.device_mesh, like.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=like.shape, stride=like.stride())


def is_distributed() -> bool:
    """True when a default process group is initialised and has more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sharded_dims(t: Tensor, what: str) -> tuple[int, ...]:
    """Mesh dimensions ``t`` is sharded over; raise for a partial (unreduced) placement."""
    dims = []
    for i, p in enumerate(t.placements):  # type: ignore[attr-defined]
        if p.is_partial():
            raise ValueError(f"{what}: a gradient is a DTensor with a partial placement "
                             f"{tuple(t.placements)} (not yet reduced across ranks); expected "  # type: ignore[attr-defined]
                             "Shard or Replicate placements, as FSDP2 leaves gradients")
        if p.is_shard():
            dims.append(i)
    return tuple(dims)


def _all_reduce(buf: Tensor, op: Any, group: Any = None) -> Tensor:
    import torch.distributed as dist

    device = buf.device
    if dist.get_backend(group) == "gloo" and device.type != "cpu":
        buf = buf.cpu()
    buf = buf.contiguous()
    dist.all_reduce(buf, op=op, group=group)
    return buf.to(device)


def sumsq_whole(tensors: Sequence[Tensor], what: str = "gradtap") -> Tensor:
    """Sum of squares of each whole tensor, float64 [len(tensors)] on the first one's device.

    Local parts are summed on each rank, then across the sharding mesh dimensions (one
    all-reduce of a vector per distinct sharding); replicated dimensions are not summed.

    Example:
        >>> import torch
        >>> sumsq_whole([torch.tensor([3.0, 4.0]), torch.tensor([0.0, 2.0])]).tolist()
        [25.0, 4.0]
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    parts = [local(t).detach() for t in tensors]
    device = parts[0].device
    # Values are gathered and put back in order by views and stacks, never through an index
    # tensor made from a Python list (a host-to-device copy, which waits for the device).
    out: list[Any] = [None] * len(parts)
    for idx in group_by_device_dtype(parts).values():
        sums = group_sumsq([parts[i] for i in idx]).to(device)
        for j, i in enumerate(idx):
            out[i] = sums[j]
    by_sharding: dict[tuple[int, tuple[int, ...]], tuple[Any, list[int]]] = {}
    for i, t in enumerate(tensors):
        if is_sharded(t):
            dims = _sharded_dims(t, what)
            if dims:
                mesh = t.device_mesh  # type: ignore[attr-defined]
                by_sharding.setdefault((id(mesh), dims), (mesh, []))[1].append(i)
    import torch.distributed as dist

    for (_, dims), (mesh, idx) in by_sharding.items():
        vec = torch.stack([out[i] for i in idx])
        for d in dims:
            vec = _all_reduce(vec, dist.ReduceOp.SUM, mesh.get_group(d))
        for j, i in enumerate(idx):
            out[i] = vec[j]
    return torch.stack(out)


def centered_rows(t: Tensor) -> Tensor:
    """``t`` minus its mean over every dimension but the first, the mean over the whole
    tensor's rows (a sharded tensor's row sums are summed across the mesh dimensions that
    shard a dimension other than the first; sharded by rows only, nothing is communicated).

    Example:
        >>> import torch
        >>> centered_rows(torch.tensor([[1.0, 3.0], [0.0, 4.0]]))
        tensor([[-1.,  1.],
                [-2.,  2.]])
    """
    dims = tuple(range(1, t.dim()))
    if not is_sharded(t):
        return t - t.mean(dim=dims, keepdim=True)
    import torch.distributed as dist

    part = local(t)
    across = [i for i, p in enumerate(t.placements)  # type: ignore[attr-defined]
              if p.is_shard() and p.dim % t.dim() != 0]
    if not across:
        return rebuild(t, part - part.mean(dim=dims, keepdim=True))
    acc = torch.promote_types(part.dtype, torch.float32)
    sums = part.sum(dim=dims, keepdim=True, dtype=acc)
    for d in across:
        sums = _all_reduce(sums, dist.ReduceOp.SUM, t.device_mesh.get_group(d))  # type: ignore[attr-defined]
    count = math.prod(t.shape[1:])
    return rebuild(t, part - (sums / count).to(part.dtype))


def row_norms(t: Tensor, acc: torch.dtype) -> Tensor:
    """L2 norm of each row (over every dimension but the first) of the whole tensor, in
    ``acc``, shaped like this rank's rows with size-1 trailing dimensions (``keepdim``). A
    sharded tensor's squares are summed across the mesh dimensions that shard a dimension
    other than the first (sharded by rows only, FSDP2's default, nothing is communicated).

    Example:
        >>> import torch
        >>> row_norms(torch.tensor([[3.0, 4.0], [0.0, 2.0]]), torch.float32)
        tensor([[5.],
                [2.]])
    """
    dims = tuple(range(1, t.dim()))
    if not is_sharded(t):
        return torch.linalg.vector_norm(t, dim=dims, keepdim=True, dtype=acc)
    import torch.distributed as dist

    part = local(t)
    across = [i for i, p in enumerate(t.placements)  # type: ignore[attr-defined]
              if p.is_shard() and p.dim % t.dim() != 0]
    if not across:
        return torch.linalg.vector_norm(part, dim=dims, keepdim=True, dtype=acc)
    sums = part.to(acc).square().sum(dim=dims, keepdim=True)
    for d in across:
        sums = _all_reduce(sums, dist.ReduceOp.SUM, t.device_mesh.get_group(d))  # type: ignore[attr-defined]
    return sums.sqrt()


def all_ranks_max(values: Tensor) -> Tensor:
    """Elementwise max of ``values`` over all ranks of the default group (one all-reduce);
    ``values`` itself without a process group.

    Example:
        >>> import torch
        >>> all_ranks_max(torch.tensor([0.0, 2.0])).tolist()
        [0.0, 2.0]
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return values
    buf = values.clone()
    if "nccl" in str(dist.get_backend()).lower() and buf.device.type == "cpu":
        buf = buf.to(torch.device("cuda", torch.cuda.current_device()))  # NCCL: CUDA only
    return _all_reduce(buf, dist.ReduceOp.MAX).to(values.device)

