"""Statistics of the global gradient from rank-local tensors and shards (DDP, FSDP2, HSDP).

Finished statistics (mean, std, ...) cannot be averaged across ranks; their sufficient
statistics can. Every rank packs, for each tensor (row), the SUM-reducible fields (count, sum,
sum of ``s_i**2 / n_i``, squared deviations, sum of squares, non-finite and nonzero counts,
histogram counts, and plain sums such as squared norms and dot products) into one flat float64
buffer and the MAX-reducible fields (max, -min, a NaN flag, a layout checksum) into another:
one :class:`Reduction` per step, at most two collectives (two ``all_reduce``), whatever the
number of tensors and kinds. ``min`` travels as ``max(-x)`` so that one MAX collective serves
max, min and absmax. Mean and std are finished after the reduction, on the host. No gradient
is ever gathered.

What is local and what is reduced, per ``Monitor`` kind:

* DDP: ``p.grad`` is already the global (all-reduced) gradient on every rank, so
  ``param_grad``, ``param``, ``update``, ``grad_cosine`` and the EWMA cost no communication.
  ``grad_output`` (this rank's samples) and ``local_grads=True`` are reduced.
* FSDP2 (``fully_shard``; parameters and gradients are DTensors, ``Shard(0)``, uneven shards
  unpadded by ``to_local()``, possibly empty): every parameter kind is taken from this rank's
  shard (:func:`shard`) and reduced. ``update`` adds two squared norms per tensor (its
  ``ratio``), ``grad_cosine`` a dot product and two squared norms, all in the same SUM buffer.
  The EWMA is elementwise, so each rank keeps the EWMA of its own shard: no communication
  until ``Monitor.close()``, which reduces its summaries (two collectives, every rank).
* HSDP (``fully_shard`` on a 2-D mesh, replicate x shard): as FSDP2, with the shards of
  replica 0 only (coordinate 0 on each ``Replicate`` mesh dimension), so copies count once.

Bytes per step (float64): per tensor and moment kind, 8 bytes per SUM field (count, sum,
``between``, ``m2``, sumsq, nonfinite, nonzero: those the stats need) and per MAX field (max,
-min, NaN flag), plus 8 per histogram bin; 16 more per tensor for ``update``'s ratio and 24 for
``grad_cosine``. The default stats (norm, mean, std, absmax, nonfinite) are 6 SUM + 3 MAX
fields: 72 bytes per tensor.

On paper, a 70B-parameter Llama-style model (80 blocks of 9 tensors plus 3: 723 tensors) with
FSDP2 on 64 GPUs: the default Monitor sends 723 x 72 B = 52 KB per step in 2 all_reduces
(every stat, 32-bin histograms and the kinds ``param_grad``, ``param``, ``update``,
``grad_cosine``: about 0.76 MB, plus about 0.34 KB per selected module output for
``grad_output``). The step's own gradient reduce-scatter has a 141 GB buffer (70.6e9 bf16
gradients; 282 GB when reduced in float32), of which each rank sends 63/64 over the ring, in
about 81 collectives (one per FSDP unit), beside as many parameter all-gathers in the forward
and again in the backward. The Monitor's share is thus about 4e-7 of the bytes and 2 of about
240 collectives; two all_reduces of 52 KB are latency-bound (tens of microseconds each on
such a cluster). Its device work is a few passes over the local shard (1.1e9 elements per GPU),
and it reads the results on the host once per step.

Tensor and pipeline parallelism are out of scope. A DTensor whose mesh does not span the
default process group (a per-stage or per-TP-group mesh) makes ``Monitor(...)`` raise
``ValueError`` naming the parameter, and so does a ``Partial`` placement; Shard/Replicate
placements on a mesh spanning every rank (2-D FSDP2 + TP) are reduced correctly for the
parameter kinds, but ``grad_output`` counts each rank's local activation gradient, so
activations replicated across a TP group are counted once per TP rank. Pipeline stages hold
different parameters: their buffers differ in size, which the collective itself rejects (gloo)
or may hang on (NCCL); watch each stage with its own Monitor without a process group spanning
stages, or not at all.

With no process group (``not dist.is_available() or not dist.is_initialized()``) or one rank,
nothing is communicated.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from gradtap._tensorops import HostCopy, Moments, refine_fields
from gradtap._tensorops.sharded import is_distributed, world
from gradtap._tensorops.sharded import is_sharded as is_dtensor

__all__ = ["Reduction", "Shard", "is_distributed", "is_dtensor", "layout_mismatch",
           "local_tensor", "reduce_parts", "shard", "shard_offset", "world"]

_SUM_ORDER = ("sum", "between", "m2", "sumsq", "nonfinite", "nonzero")
_MAX_ORDER = ("max", "negmin")


class Shard(NamedTuple):
    """What one rank holds of a tensor, and whether it counts it (see :func:`shard`)."""

    local: Tensor
    #: this rank's elements enter the global statistics (sharded dimensions are summed;
    #: on replicated mesh dimensions only coordinate 0 contributes, so copies count once)
    counts: bool


def shard(t: Tensor, name: str = "tensor") -> Shard:
    """This rank's part of ``t`` and whether it counts toward the global statistics.

    A DTensor gives its local shard (``to_local()``: unpadded, possibly empty); it counts when
    this rank's coordinate is 0 on every mesh dimension where ``t`` is ``Replicate`` (the
    ``Shard`` dimensions are summed over). A plain tensor is taken as identical on every rank
    (DDP's reduced gradient, a replicated parameter): only rank 0 counts it.

    Raises:
        ValueError: a ``Partial`` placement (its local value is not a part of the tensor), or a
            device mesh that does not span the whole default process group.

    Example:
        >>> import torch
        >>> shard(torch.ones(2)).counts  # a plain tensor, no process group: rank 0 counts it
        True
    """
    if not is_dtensor(t):
        return Shard(t, world()[0] == 0)
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as ShardPlacement

    mesh = t.device_mesh  # type: ignore[attr-defined]
    placements = t.placements  # type: ignore[attr-defined]
    if mesh.size() != world()[1]:
        raise ValueError(
            f"{name}: its device mesh spans {mesh.size()} of the {world()[1]} ranks; gradtap "
            "reduces over the whole default process group (tensor/pipeline parallel meshes are "
            "not supported)")
    coord = mesh.get_coordinate()
    counts = coord is not None
    for dim, pl in enumerate(placements):
        if isinstance(pl, Replicate):
            counts = counts and coord[dim] == 0
        elif not isinstance(pl, ShardPlacement):
            raise ValueError(
                f"{name}: placement {type(pl).__name__} ({pl}) on mesh dimension {dim}; gradtap "
                "takes statistics of Shard and Replicate placements only (a Partial value must "
                "be reduced first)")
    return Shard(t.to_local(), counts)  # type: ignore[attr-defined]


def shard_offset(t: Tensor, dim: int, name: str = "tensor") -> int:
    """Where this rank's local shard of ``t`` starts along ``dim`` in the global tensor (0 for
    a plain tensor, or a dimension no mesh dimension shards).

    ``Shard(dim)`` splits as ``torch.chunk`` does (FSDP2's layout): chunks of
    ``ceil(size / n)``, the last ones shorter or empty.

    Raises:
        ValueError: ``dim`` is sharded over more than one mesh dimension, or the local shard is
            not where that layout puts it.

    Example:
        >>> import torch
        >>> shard_offset(torch.ones(4, 2), 0)
        0
    """
    if not is_dtensor(t):
        return 0
    from torch.distributed.tensor import Shard as ShardPlacement

    mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
    sharding = [m for m, pl in enumerate(placements)
                if isinstance(pl, ShardPlacement) and pl.dim == dim]
    if not sharding:
        return 0
    if len(sharding) > 1:
        raise ValueError(f"{name}: dimension {dim} is sharded over {len(sharding)} mesh "
                         "dimensions; split= handles one")
    m = sharding[0]
    size, n = t.shape[dim], mesh.size(m)
    chunk = -(-size // n)
    coord = mesh.get_coordinate()
    offset = min(coord[m] * chunk, size) if coord is not None else size
    local = t.to_local().shape[dim]  # type: ignore[attr-defined]
    if local != max(0, min(chunk, size - offset)):
        raise ValueError(f"{name}: this rank's shard has {local} of {size} rows along dim {dim}, "
                         f"not the {max(0, min(chunk, size - offset))} of an even chunking")
    return offset


def local_tensor(t: Tensor) -> Tensor:
    """``t.to_local()`` for a DTensor, ``t`` otherwise (no communication).

    Example:
        >>> import torch
        >>> t = torch.ones(2)
        >>> local_tensor(t) is t
        True
    """
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


class Reduction:
    """Sufficient statistics of one step from every rank, in at most two collectives.

    Blocks of moment rows (:meth:`add_moments`) and plain sums (:meth:`add_sums`: squared
    norms, dot products) are packed into one float64 SUM buffer and one MAX buffer, reduced by
    :meth:`run`, and read back per block. A checksum of every block's keys travels with the
    MAX buffer (:attr:`check`).

    Example:
        >>> import numpy as np, torch
        >>> red = Reduction()
        >>> h = red.add_sums(torch.tensor([1.0, 2.0]))
        >>> red.run()  # no process group: nothing is communicated
        >>> red.sums(h).tolist()
        [1.0, 2.0]
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self._sum: list[Tensor] = []
        self._max: list[Tensor] = []
        self._keys: list[str] = []
        # per block: ("moments", sum offset, n_groups, sum names, hist bins, max offset, max
        # names) or ("sums", offset, n)
        self._blocks: list[tuple[Any, ...]] = []
        self._sum_len = 0
        self._max_len = 0
        self._sum_out: Tensor | None = None
        self._max_out: Tensor | None = None
        self._copy: HostCopy | None = None
        self._handles: dict[str, int] = {}
        #: the reduced checksum pair (see :func:`layout_mismatch`), after :meth:`run`
        self.check: Tensor | None = None

    @property
    def empty(self) -> bool:
        """Whether nothing was queued yet."""
        return not self._blocks

    def add_moments(self, count: np.ndarray, fields: Moments[Tensor] | Mapping[str, Tensor],
                    group: np.ndarray, keys: Sequence[str]) -> int:
        """Queue rows combined by ``group`` into ``len(keys)`` outputs (see
        :func:`reduce_parts`); return the block's handle."""
        n_groups = len(keys)
        raw = Moments.coerce(fields)
        device = next(iter(raw.items()))[1].device
        self.device = self.device or device
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
        bins = 0
        if refined.hist is not None:
            bins = refined.hist.shape[1]
            rows = torch.cat([rows, refined.hist.to(f64)], dim=1)
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
        self._blocks.append(("moments", self._sum_len, n_groups, sum_names, bins,
                             self._max_len, max_names))
        self._sum.append(sum_buf.reshape(-1))
        self._max.append(max_buf.reshape(-1))
        self._sum_len += sum_buf.numel()
        self._max_len += max_buf.numel()
        self._keys.append("\x01".join([*keys, *sum_names, *max_names, str(bins)]))
        return len(self._blocks) - 1

    def add_sums(self, values: Tensor, key: str = "") -> int:
        """Queue a flat tensor to be summed over ranks (float64); return its handle."""
        v = values.detach().reshape(-1).to(torch.float64)
        self.device = self.device or v.device
        self._blocks.append(("sums", self._sum_len, v.numel()))
        self._sum.append(v)
        self._sum_len += v.numel()
        self._keys.append(f"{key}\x02{v.numel()}")
        return len(self._blocks) - 1

    def run(self, copy: HostCopy | None = None, *, reduce: bool = True) -> None:
        """Reduce across ranks (when ``reduce`` and a process group is initialised): one SUM
        and one MAX collective. With ``copy``, every result is queued on it for the step's one
        device-to-host copy (read them with :meth:`host_moments` / :meth:`host_sums`)."""
        device = self.device or torch.device("cpu")
        f64 = torch.float64
        checksum = float(zlib.crc32("\x00".join(self._keys).encode()))
        flat_sum = (torch.cat([b.to(device) for b in self._sum]) if self._sum
                    else torch.zeros(0, dtype=f64, device=device))
        flat_max = torch.cat([*(b.to(device) for b in self._max),
                              torch.tensor([checksum, -checksum], dtype=f64, device=device)])
        if reduce and is_distributed():
            if flat_sum.numel():
                flat_sum = _all_reduce(flat_sum, dist.ReduceOp.SUM)
            flat_max = _all_reduce(flat_max, dist.ReduceOp.MAX)
        self._sum_out, self._max_out = flat_sum, flat_max
        self.check = flat_max[-2:]
        if copy is not None:
            self._copy = copy
            self._handles = {"sum": copy.add(flat_sum), "max": copy.add(flat_max)}

    def moments(self, handle: int) -> tuple[Tensor, Moments[Tensor]]:
        """``(count [G], moments [G])`` of a moments block after :meth:`run` (on the device)."""
        assert self._sum_out is not None and self._max_out is not None, "run() first"
        return self._unpack(handle, self._sum_out, self._max_out, torch)

    def sums(self, handle: int) -> Tensor:
        """The summed values of an :meth:`add_sums` block after :meth:`run`."""
        assert self._sum_out is not None, "run() first"
        _, offset, n = self._blocks[handle]
        return self._sum_out[offset:offset + n]

    def host_moments(self, handle: int) -> tuple[np.ndarray, Moments[np.ndarray]]:
        """:meth:`moments` as numpy arrays, after the ``copy`` given to :meth:`run` ran."""
        assert self._copy is not None, "run(copy) first"
        return self._unpack(handle, self._copy.get(self._handles["sum"]),
                            self._copy.get(self._handles["max"]), np)

    def host_sums(self, handle: int) -> np.ndarray:
        """:meth:`sums` as a numpy array, after the ``copy`` given to :meth:`run` ran."""
        assert self._copy is not None, "run(copy) first"
        _, offset, n = self._blocks[handle]
        return self._copy.get(self._handles["sum"])[offset:offset + n]

    def host_mismatch(self) -> bool:
        """True when the ranks queued different blocks (after the copy ran)."""
        assert self._copy is not None, "run(copy) first"
        return layout_mismatch(self._copy.get(self._handles["max"])[-2:])

    def _unpack(self, handle: int, flat_sum: Any, flat_max: Any, xp: Any) -> Any:
        _, s_off, n_groups, sum_names, bins, m_off, max_names = self._blocks[handle]
        width = len(sum_names) + bins
        sum_buf = flat_sum[s_off:s_off + n_groups * width].reshape(n_groups, width)
        mw = len(max_names) + 1
        max_buf = flat_max[m_off:m_off + n_groups * mw].reshape(n_groups, mw)
        out: dict[str, Any] = {}
        for j, f in enumerate(sum_names):
            out[f] = sum_buf[:, j]
        if bins:
            out["hist"] = sum_buf[:, len(sum_names):]
        flag = max_buf[:, -1] > 0
        for j, f in enumerate(max_names):
            out[f] = xp.where(flag, xp.nan, max_buf[:, j])
        total = out.pop("count")
        return total, Moments.coerce(out)


def reduce_parts(
    count: np.ndarray,
    fields: Moments[Tensor] | Mapping[str, Tensor],
    group: np.ndarray,
    keys: Sequence[str],
    *,
    reduce: bool = True,
) -> tuple[Tensor, Moments[Tensor], Tensor]:
    """Combine rows of one rank by ``group``, then sum/max them across ranks.

    One :class:`Reduction` with one block: at most two collectives.

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
    red = Reduction()
    handle = red.add_moments(count, fields, group, keys)
    red.run(reduce=reduce)
    total, moments = red.moments(handle)
    assert red.check is not None
    return total, moments, red.check


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
