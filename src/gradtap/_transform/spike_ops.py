"""What the spike-control transforms share: argument checks, per-tensor statistics kept as
0-dim tensors and batched across a rule's tensors, whole-tensor norms, and scaling by factors.

Statistics live on the device, in float64 (float32 on MPS, which has no float64), one 0-dim
tensor per parameter and statistic. A batched update stacks them into one vector per
statistic, computes on it, and gives each parameter back a view of the result, so a step costs
the same few kernels whatever the number of tensors. Steps are counted in Python (``count``
in each state): the warm-up decision is made on the host, every other one on the device.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from gradtap._tensorops import group_by_device_dtype, group_norms
from gradtap._tensorops.sharded import is_sharded, local, rebuild, sumsq_whole
from gradtap._transform.base import State

__all__ = ["by_count", "count_of", "factor_of", "ones", "scale_by", "split", "stack",
           "stat_dtype", "warmup_steps", "whole_norms"]


def stat_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the statistics on ``device``: float64, float32 on MPS."""
    return torch.float32 if device.type == "mps" else torch.float64


def ones(like: Tensor) -> Tensor:
    """A 0-dim 1.0 in the statistics dtype on ``like``'s device."""
    return torch.ones((), dtype=stat_dtype(like.device), device=like.device)


def warmup_steps(factory: str, value: Any, least: int) -> int:
    """``value`` checked as an int ``>= least``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{factory}: warmup must be an int; got {type(value).__name__} {value!r}")
    if value < least:
        raise ValueError(f"{factory}: warmup must be >= {least}; got {value!r}")
    return int(value)


def factor_of(state: State) -> Tensor:
    """The factor a spike rule's state reports (its ``"factor"``)."""
    return state["factor"]  # type: ignore[no-any-return]


def count_of(state: State) -> int:
    return int(state["count"])


def by_count(states: Sequence[State]) -> list[list[int]]:
    """Indices of ``states`` grouped by ``(count, device of the statistics)``: one batched
    update each (one group unless some tensors missed steps or live on other devices)."""
    groups: dict[tuple[int, torch.device], list[int]] = {}
    for i, s in enumerate(states):
        groups.setdefault((count_of(s), s["factor"].device), []).append(i)
    return list(groups.values())


def stack(states: Sequence[State], key: str, device: torch.device) -> Tensor:
    """The 0-dim statistic ``key`` of each state, as one vector on ``device``."""
    return torch.stack([s[key] for s in states]).to(device)


def whole_norms(grads: Sequence[Tensor], what: str, device: torch.device) -> Tensor:
    """L2 norm of each whole gradient, a vector in the statistics dtype on ``device``.

    Plain tensors: one ``torch._foreach_norm`` per device and dtype (accumulating in float32
    at least). Sharded ones (FSDP2's DTensors): each local shard's sum of squares, summed over
    the ranks that shard it (:func:`gradtap._tensorops.sharded.sumsq_whole`, one all-reduce).
    """
    dtype = stat_dtype(device)
    if any(is_sharded(g) for g in grads):
        return sumsq_whole(grads, what).to(device=device, dtype=dtype).sqrt()
    groups = group_by_device_dtype(grads)
    if len(groups) == 1:
        return group_norms(list(grads)).to(device=device, dtype=dtype)
    # Put the groups' norms back in order by views and one stack: an index tensor built
    # from a Python list would be a host-to-device copy, which waits for the device.
    out: list[Any] = [None] * len(grads)
    for idx in groups.values():
        norms = group_norms([grads[i] for i in idx]).to(device=device, dtype=dtype)
        for j, i in enumerate(idx):
            out[i] = norms[j]
    return torch.stack(out)


def scale_by(grads: Sequence[Tensor], factors: Tensor) -> list[Tensor]:
    """New gradients: ``grads[i] * factors[i]`` (``factors`` a vector), or each times the one
    0-dim ``factors``. The factor is applied in float32 or wider; the result keeps each
    gradient's dtype, and a sharded gradient stays sharded. One ``torch._foreach_mul`` per
    device and dtype."""
    sharded = any(is_sharded(g) for g in grads)
    parts = [local(g) for g in grads] if sharded else list(grads)
    groups = group_by_device_dtype(parts)
    out: list[Any] = [None] * len(parts)
    for (device, dtype), idx in groups.items():
        f = factors.to(device=device, dtype=torch.promote_types(dtype, torch.float32))
        group = parts if len(groups) == 1 else [parts[i] for i in idx]
        if f.dim() == 0:
            new = torch._foreach_mul(group, f)
        else:
            new = torch._foreach_mul(group, list(f.unbind()) if len(groups) == 1
                                     else [f[i] for i in idx])
        for i, t in zip(idx, new, strict=True):
            out[i] = rebuild(grads[i], t) if sharded else t
    return out


def split(n: int, groups: list[list[int]], fn: Callable[[list[int]], tuple[list[Tensor], list[State]]]
          ) -> tuple[list[Tensor], list[State]]:
    """Run ``fn(indices)`` per group and put its gradients and states back in order."""
    grads: list[Any] = [None] * n
    states: list[Any] = [None] * n
    for idx in groups:
        g, s = fn(idx)
        for j, i in enumerate(idx):
            grads[i], states[i] = g[j], s[j]
    return grads, states
