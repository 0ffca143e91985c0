"""Reduce sufficient statistics of rank-local tensors across ``torch.distributed`` ranks.

Finished statistics (mean, std, ...) cannot be averaged across ranks; their sufficient
statistics can. Every rank packs, for each tensor (row), the SUM-reducible fields (count, sum,
sum of ``s_i**2 / n_i``, squared deviations, sum of squares, non-finite and nonzero counts,
histogram counts) into one flat float64 buffer and the MAX-reducible fields (max, -min, a NaN
flag, a layout checksum) into another: at most two collectives per step, whatever the number of
tensors. ``min`` travels as ``max(-x)`` so that one MAX collective serves max, min and absmax.
Mean and std are finished after the reduction, on the host.

With no process group (``not dist.is_available() or not dist.is_initialized()``) nothing is
communicated.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from gradtap._tensorops import Moments, refine_fields

__all__ = ["is_distributed", "layout_mismatch", "reduce_parts", "world"]

_SUM_ORDER = ("sum", "between", "m2", "sumsq", "nonfinite", "nonzero")
_MAX_ORDER = ("max", "negmin")


def is_distributed() -> bool:
    """True when a default process group is initialised (and has more than one rank)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> tuple[int, int]:
    """Return ``(rank, world_size)``; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def reduce_parts(
    count: np.ndarray,
    fields: Moments[Tensor] | Mapping[str, Tensor],
    group: np.ndarray,
    keys: Sequence[str],
    *,
    reduce: bool = True,
) -> tuple[Tensor, Moments[Tensor], Tensor]:
    """Combine rows of one rank by ``group``, then sum/max them across ranks.

    Args:
        count: element count of each input row [P] (host).
        fields: raw moments [P] from ``tensor_moments`` (``hist`` [P, B]), all on one
            device, not yet refined.
        group: output row of each input row [P], values in ``range(len(keys))``.
        keys: one name per output row; every rank must pass the same keys in the same order
            (a checksum of them travels with the MAX buffer and a mismatch raises).
        reduce: communicate when a process group is initialised; ``False`` only combines.

    Returns:
        ``(count [G], moments [G], check [2])`` on the fields' device. ``moments`` has a
        ``between`` field and is ready for ``finish_stats`` once copied to the host;
        ``check[0] != -check[1]`` (see :func:`layout_mismatch`) means the ranks passed different
        ``keys``. At most two collectives are issued and nothing is read on the host.
    """
    n_groups = len(keys)
    raw = Moments.coerce(fields)
    device = next(iter(raw.items()))[1].device
    f64 = torch.float64
    count_t = torch.as_tensor(count, dtype=f64).to(device)
    refined = refine_fields(count_t, raw)
    index = torch.as_tensor(group, dtype=torch.int64).to(device)

    # Sum-reduced columns by name, in _SUM_ORDER; "between" is new at this stage.
    sums = {"count": count_t}
    if refined.sum is not None:
        sums["sum"] = refined.sum
        sums["between"] = refined.sum ** 2 / count_t
    for f in ("m2", "sumsq", "nonfinite", "nonzero"):
        if f in refined:
            sums[f] = refined[f]
    sum_names = [f for f in ("count", *_SUM_ORDER) if f in sums]
    rows = torch.stack([sums[f] for f in sum_names], dim=1)
    if refined.hist is not None:
        rows = torch.cat([rows, refined.hist], dim=1)
    sum_buf = torch.zeros(n_groups, rows.shape[1], dtype=f64, device=device)
    sum_buf.index_add_(0, index, rows)

    max_names = [f for f in _MAX_ORDER if f in refined]
    max_rows = [refined[f] for f in max_names]
    nan = torch.zeros(len(count), dtype=f64, device=device)
    for col in max_rows:
        nan = torch.maximum(nan, col.isnan().to(f64))
    # Collectives disagree about NaN in MAX: send a flag and put the NaN back afterwards.
    max_cols = [torch.nan_to_num(c, nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)
                for c in max_rows] + [nan]
    max_buf = torch.full((n_groups, len(max_cols)), -torch.inf, dtype=f64, device=device)
    max_buf.scatter_reduce_(0, index[:, None].expand(-1, len(max_cols)),
                            torch.stack(max_cols, dim=1), reduce="amax")
    checksum = float(zlib.crc32("\x00".join(keys).encode()))
    flat_max = torch.cat([max_buf.reshape(-1),
                          torch.tensor([checksum, -checksum], dtype=f64, device=device)])
    flat_sum = sum_buf.reshape(-1)

    if reduce and is_distributed():
        flat_sum = _all_reduce(flat_sum, dist.ReduceOp.SUM)
        flat_max = _all_reduce(flat_max, dist.ReduceOp.MAX)
        sum_buf = flat_sum.view(n_groups, -1)
        max_buf = flat_max[:-2].view(n_groups, -1)

    out: dict[str, Tensor] = {}
    for j, f in enumerate(sum_names):
        out[f] = sum_buf[:, j]
    if refined.hist is not None:
        out["hist"] = sum_buf[:, len(sum_names):]
    flag = max_buf[:, -1] > 0
    for j, f in enumerate(max_names):
        out[f] = torch.where(flag, torch.nan, max_buf[:, j])
    total = out.pop("count")
    return total, Moments.coerce(out), flat_max[-2:]


def layout_mismatch(check: Sequence[float] | np.ndarray) -> bool:
    """True when the reduced checksum pair of :func:`reduce_parts` shows differing keys."""
    return float(check[0]) != -float(check[1])


def _all_reduce(buf: Tensor, op: Any) -> Tensor:
    device = buf.device
    if dist.get_backend() == "gloo" and device.type != "cpu":
        buf = buf.cpu()
    buf = buf.contiguous()
    dist.all_reduce(buf, op=op)
    return buf.to(device)
