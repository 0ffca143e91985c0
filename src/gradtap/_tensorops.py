"""Tensor kernels shared by the consumers: EWMA updates and batched reductions.

Everything here works on plain tensors and knows nothing about modules or hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "MAX_FIELDS",
    "STAT_NAMES",
    "SUM_FIELDS",
    "HostCopy",
    "Needs",
    "Scratch",
    "centered_moments",
    "check_stats",
    "combine_parts",
    "complete_fields",
    "ewma_init",
    "ewma_update_",
    "finish_stats",
    "group_by_device_dtype",
    "hist_edges",
    "host_moments",
    "needs_for",
    "refine_fields",
    "tensor_moments",
    "unreliable_m2",
]


def ewma_init(value: Tensor) -> tuple[Tensor, Tensor]:
    """Return the EWMA state ``(mean, var)`` after its first step: ``mean = g``, ``var = 0``.

    The state is detached, float32 or wider, and owned by the caller (never aliases ``value``).
    """
    dtype = torch.promote_types(value.dtype, torch.float32)
    mean = value.detach().to(dtype=dtype, copy=True)
    return mean, torch.zeros_like(mean)


def ewma_update_(mean: Tensor, var: Tensor, value: Tensor, beta: float) -> None:
    """Advance an elementwise EWMA of mean and variance by one step, in place.

    DESIGN.md's definition: ``d = g - m_prev; m = m_prev + (1 - beta) * d;
    v = beta * (v_prev + (1 - beta) * d * d)``.
    """
    delta = value.detach().to(mean.dtype) - mean
    mean.add_(delta, alpha=1.0 - beta)
    var.addcmul_(delta, delta, value=1.0 - beta).mul_(beta)


# -- batched statistics ----------------------------------------------------------------------
#
# Statistics are finished from per-tensor *sufficient statistics* ("moment fields") that can be
# combined across parts (several calls of a module within a step, several ranks):
#
#   SUM fields   sum        sum of the elements (a cascade/tree sum: accurate to ~1e-8)
#                sumsq      sum of squares, accurate too (see ``_sumsq``)
#                m2         sum of squared deviations from the tensor's mean (host side)
#                nonfinite  count of NaN and +-Inf elements
#                nonzero    count of elements != 0 (NaN counts as nonzero)
#                hist       [B] counts of finite elements per bin (outliers in the end bins)
#   MAX fields   max, negmin (= -min); NaN propagates through both.
#
# ``m2 = sumsq - sum**2 / n``, evaluated in float64, is exact to ~1e-8 * sumsq, which is fine
# unless the mean dominates (mean**2 > 99% of the mean square). Those rows (found on the host
# after the step's one transfer, see :func:`unreliable_m2`) get the two-pass value from
# :func:`centered_moments`: the tensor centred on its float32 mean ``shift`` gives
# ``csum = sum(x - shift)`` and ``m2c = sum((x - shift)**2)``, and ``m2 = m2c - csum**2 / n``
# (the corrected two-pass algorithm), so a constant tensor has std 0 exactly.
#
# Combining parts i with counts n_i (host): Chan's exact update, see :func:`combine_parts`.
# Across ranks only sums travel: M2 = sum m2_i + (sum s_i**2 / n_i - S**2 / N) with the
# bracket (``between``) in float64.

STAT_NAMES: tuple[str, ...] = (
    "norm", "mean", "std", "absmax", "min", "max", "nonfinite", "zero_frac",
)  # fmt: skip
SUM_FIELDS: tuple[str, ...] = ("sum", "sumsq", "m2", "nonfinite", "nonzero")
MAX_FIELDS: tuple[str, ...] = ("max", "negmin")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# torch's CPU norm kernels accumulate in one float32 pass per lane (relative error 4e-5 at
# 2.4M elements, 1e-3 at 16M); rows of _BLOCK elements keep each partial sum short.
_BLOCK = 1024
_SMALL = _BLOCK
# Above this share of the mean square taken by mean**2, m2 comes from a second, centred pass.
_EXACT_SHARE = 0.99


@dataclass(frozen=True)
class Needs:
    """Which moment fields a set of statistics needs (see :func:`needs_for`)."""

    sum: bool = False
    sumsq: bool = False
    std: bool = False
    minmax: bool = False
    nonfinite: bool = False
    nonzero: bool = False
    lazy_nonfinite: bool = False

    def fields(self) -> tuple[str, ...]:
        """Names of the fields computed on the device, in a fixed order."""
        out = [f for f in ("sum", "sumsq") if getattr(self, f)]
        out += ["max", "negmin"] if self.minmax else []
        return (*out, *(f for f in ("nonfinite", "nonzero") if getattr(self, f)))


def check_stats(stats: Iterable[str]) -> tuple[str, ...]:
    """Return ``stats`` as a tuple, or raise ``ValueError`` listing the valid names."""
    stats = (stats,) if isinstance(stats, str) else tuple(stats)
    unknown = [s for s in stats if s not in STAT_NAMES]
    if unknown:
        raise ValueError(
            f"unknown stat name(s) {', '.join(map(repr, unknown))}; valid stats are: "
            f"{', '.join(STAT_NAMES)}"
        )
    if len(set(stats)) != len(stats):
        raise ValueError(f"stats lists a name twice: {list(stats)}")
    return stats


def needs_for(stats: Iterable[str], *, exact_nonfinite: bool = False) -> Needs:
    """Return the moment fields needed to finish ``stats``.

    With ``exact_nonfinite=False`` the non-finite count is left to a lazy pass over only the
    tensors whose min/max show a non-finite element (:func:`complete_fields`).
    """
    s = set(check_stats(stats))
    std = "std" in s
    return Needs(
        sum="mean" in s or std,
        sumsq="norm" in s or std,
        std=std,
        minmax=bool(s & {"absmax", "min", "max"}) or ("nonfinite" in s and not exact_nonfinite),
        nonfinite="nonfinite" in s and exact_nonfinite,
        nonzero="zero_frac" in s,
        lazy_nonfinite="nonfinite" in s and not exact_nonfinite,
    )


def group_by_device_dtype(tensors: Sequence[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Group tensor indices by ``(device, dtype)``, keeping the original order inside a group."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def hist_edges(
    bins: int,
    scale: str = "symlog",
    range: tuple[float, float] | None = None,  # noqa: A002 (numpy's name for it)
    linthresh: float = 1e-8,
) -> Tensor:
    """Return ``bins + 1`` float64 bin edges, each exactly representable in float32.

    ``scale="linear"``: equal bins over ``range`` (default ``(-1, 1)``). ``scale="symlog"``:
    equal bins in ``t(x) = sign(x) * log10(1 + |x| / linthresh)`` over ``range`` (default
    ``(-10, 10)``), i.e. logarithmic in magnitude above ``linthresh`` and symmetric about 0.
    Edges are rounded to float32 so that float32 and float64 comparisons bin alike.
    """
    if not isinstance(bins, int) or isinstance(bins, bool) or bins < 1:
        raise ValueError(f"hist_bins must be a positive int; got {bins!r}")
    if scale not in ("linear", "symlog"):
        raise ValueError(f"hist_scale must be 'linear' or 'symlog'; got {scale!r}")
    lo, hi = range if range is not None else ((-1.0, 1.0) if scale == "linear" else (-10.0, 10.0))
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"hist_range must be two finite numbers lo < hi; got {range!r}")
    if scale == "linear":
        edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    else:
        if not (math.isfinite(linthresh) and linthresh > 0):
            raise ValueError(f"hist_linthresh must be a positive number; got {linthresh!r}")

        def fwd(x: float) -> float:
            return math.copysign(math.log10(1.0 + abs(x) / linthresh), x)

        u = torch.linspace(fwd(lo), fwd(hi), bins + 1, dtype=torch.float64)
        edges = torch.sign(u) * linthresh * torch.expm1(u.abs() * math.log(10.0))
        edges[0], edges[-1] = lo, hi
    edges = edges.to(torch.float32).to(torch.float64)
    if not bool((edges[1:] > edges[:-1]).all()):
        raise ValueError(
            f"{bins} bins over {range!r} give edges that collide in float32; use fewer bins"
        )
    return edges


class Scratch:
    """Reusable work buffers, one per ``(device, dtype)``, grown on demand.

    Allocating a fresh centred copy every step costs page faults on CPU that dwarf the
    arithmetic; a persistent buffer does not. Not shared between threads of one device.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def get(self, n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """A 1-D buffer of at least ``n`` elements (contents undefined)."""
        buf = self._bufs.get((device, dtype))
        if buf is None or buf.numel() < n:
            buf = self._bufs[(device, dtype)] = torch.empty(n, device=device, dtype=dtype)
        return buf[:n]


def tensor_moments(
    tensors: Sequence[Tensor],
    needs: Needs,
    *,
    edges: Tensor | None = None,
    batched: bool = True,
    exact_m2: bool = False,
    scratch: Scratch | None = None,
) -> list[tuple[list[int], dict[str, Tensor]]]:
    """Compute per-tensor moment fields on the tensors' own devices, without a host sync.

    Tensors are grouped by ``(device, dtype)``. Each group is reduced with ``torch._foreach_*``
    kernels, blocked reductions and one stack per field (``batched=True``), or by a plain
    per-tensor loop (``batched=False``, the reference the fast path is tested against).

    Args:
        tensors: non-empty floating-point tensors (any shapes).
        needs: the fields to compute (:func:`needs_for`).
        edges: float64 bin edges [B+1] for a histogram of finite elements, or ``None``.
        batched: use the grouped fast path.
        exact_m2: with ``needs.std``, also compute the two-pass fields of
            :func:`centered_moments` for every tensor (paths that cannot fix rows later).
        scratch: work buffers for the centred pass.

    Returns:
        One ``(indices, fields)`` per group: ``fields[f]`` is a float64 [len(indices)] tensor
        (``"hist"``: [len(indices), B]) on the group's device, rows in ``indices`` order.
    """
    out = []
    for (_device, dtype), idx in group_by_device_dtype(tensors).items():
        if not dtype.is_floating_point:
            raise TypeError(f"statistics need floating-point tensors; got {dtype}")
        group = [tensors[i].detach() for i in idx]
        acc = torch.promote_types(dtype, torch.float32)
        fields = (_group_moments if batched else _loop_moments)(group, needs, acc)
        if exact_m2 and needs.std:
            fields.update(_centered(group, acc, scratch, batched))
        if edges is not None:
            fields["hist"] = _histogram(group, edges, batched)
        out.append((idx, fields))
    return out


def centered_moments(
    tensors: Sequence[Tensor], *, scratch: Scratch | None = None, batched: bool = True
) -> list[tuple[list[int], dict[str, Tensor]]]:
    """Two-pass fields ``shift`` (float32 mean), ``csum`` and ``m2c`` (sums of ``x - shift``
    and of its square) per tensor, grouped like :func:`tensor_moments`."""
    out = []
    for (_device, dtype), idx in group_by_device_dtype(tensors).items():
        group = [tensors[i].detach() for i in idx]
        out.append((idx, _centered(group, torch.promote_types(dtype, torch.float32), scratch,
                                   batched)))
    return out


def _group_moments(ts: list[Tensor], needs: Needs, acc: torch.dtype) -> dict[str, Tensor]:
    f64 = torch.float64
    fields: dict[str, Tensor] = {}
    if needs.sum:
        # There is no foreach sum; a per-tensor sum is one vectorised (cascade) kernel each.
        fields["sum"] = torch.stack([t.sum(dtype=acc) for t in ts]).to(f64)
    if needs.sumsq:
        fields["sumsq"] = _sumsq(ts, acc)
    if needs.minmax:
        mm = [torch.aminmax(t) for t in ts]
        fields["max"] = torch.stack([m.max for m in mm]).to(f64)
        fields["negmin"] = torch.stack([m.min for m in mm]).to(f64).neg()
    if needs.nonfinite:
        # x * 0 is 0 for finite x and NaN for NaN/Inf, and count_nonzero counts NaN.
        fields["nonfinite"] = torch.stack([(t * 0).count_nonzero() for t in ts]).to(f64)
    if needs.nonzero:
        fields["nonzero"] = torch.stack([t.count_nonzero() for t in ts]).to(f64)
    return fields


def _loop_moments(ts: list[Tensor], needs: Needs, acc: torch.dtype) -> dict[str, Tensor]:
    cols: dict[str, list[Tensor]] = {f: [] for f in needs.fields()}
    for t in ts:
        x = t.to(acc)
        if needs.sum:
            cols["sum"].append(x.sum())
        if needs.sumsq:
            cols["sumsq"].append((x * x).sum())
        if needs.minmax:
            cols["max"].append(x.max())
            cols["negmin"].append(-x.min())
        if needs.nonfinite:
            cols["nonfinite"].append((~torch.isfinite(x)).sum())
        if needs.nonzero:
            cols["nonzero"].append((x != 0).sum())
    return {f: torch.stack(v).to(torch.float64) for f, v in cols.items()}


def _sumsq(ts: list[Tensor], acc: torch.dtype) -> Tensor:
    """Accurate sums of squares [n] (float64) of same-device, same-dtype tensors."""
    f64 = torch.float64
    kw = {"dtype": acc} if acc != ts[0].dtype else {}
    if ts[0].device.type != "cpu":  # tree reductions: accurate as they are
        return torch.stack(torch._foreach_norm(ts, 2, **kw)).to(f64).square()
    # Tensors longer than a block are viewed as rows of _BLOCK elements (one norm kernel per
    # tensor); short tensors and the tails go through one foreach norm. Every piece's square
    # is then added to its tensor's total in float64 (index_add_ over a cached index).
    rows: list[Tensor] = []
    short: list[Tensor] = []
    for t in ts:
        n = t.numel()
        if n <= _BLOCK:
            short.append(t)
            continue
        flat = t.reshape(-1)
        q = n // _BLOCK
        rows.append(torch.linalg.vector_norm(flat[: q * _BLOCK].view(q, _BLOCK), dim=1, **kw))
        if n % _BLOCK:
            short.append(flat[q * _BLOCK:])
    if short:
        rows.append(torch.stack(torch._foreach_norm(short, 2, **kw)))
    pieces = torch.cat(rows) if len(rows) > 1 else rows[0]
    index = _piece_index(tuple(t.numel() for t in ts), ts[0].device)
    return torch.zeros(len(ts), dtype=f64).index_add_(0, index, pieces.to(f64).square())


@lru_cache(maxsize=256)
def _piece_index(numels: tuple[int, ...], device: torch.device) -> Tensor:
    """Tensor index of each piece ``_sumsq`` produces (rows first, then short pieces)."""
    rows: list[int] = []
    short: list[int] = []
    for j, n in enumerate(numels):
        if n <= _BLOCK:
            short.append(j)
        else:
            rows += [j] * (n // _BLOCK)
            if n % _BLOCK:
                short.append(j)
    return torch.tensor(rows + short, dtype=torch.int64, device=device)


def _centered(ts: list[Tensor], acc: torch.dtype, scratch: Scratch | None,
              batched: bool) -> dict[str, Tensor]:
    f64 = torch.float64
    shifts, csums, m2s = [], [], []
    for t in ts:
        x = t.to(acc) if not batched else t
        shift = x.sum(dtype=acc) / x.numel()
        if batched:
            buf = (scratch or Scratch()).get(t.numel(), t.device, acc).view(t.shape)
            c = buf.copy_(t).sub_(shift)
            m2s.append(_sumsq([c], acc)[0])
        else:
            c = x - shift
            m2s.append((c * c).sum().to(f64))
        shifts.append(shift)
        csums.append(c.sum())
    return {"shift": torch.stack(shifts).to(f64), "csum": torch.stack(csums).to(f64),
            "m2c": torch.stack(m2s).to(f64)}


def _histogram(ts: list[Tensor], edges: Tensor, batched: bool) -> Tensor:
    bins = edges.numel() - 1
    acc = torch.promote_types(ts[0].dtype, torch.float32)
    inner = edges[1:-1].to(device=ts[0].device, dtype=acc)
    if not batched:
        rows = []
        for t in ts:
            x = t.reshape(-1).to(acc)
            x = x[torch.isfinite(x)]
            idx = torch.bucketize(x, inner, right=True)
            rows.append(torch.bincount(idx, minlength=bins))
        return torch.stack(rows).to(torch.float64)
    flat = torch.cat([t.reshape(-1) for t in ts]).to(acc)
    idx = torch.bucketize(flat, inner, right=True)
    idx.masked_fill_(~torch.isfinite(flat), bins)  # non-finite elements go to a dropped bin
    width = bins + 1
    if len(ts) > 1:
        torch._foreach_add_(list(idx.split([t.numel() for t in ts])),
                            [i * width for i in range(len(ts))])
    if idx.device.type == "cpu":
        counts = torch.bincount(idx, minlength=len(ts) * width)
    else:  # bincount reads max(idx) on the host; index_add_ never syncs
        counts = torch.zeros(len(ts) * width, dtype=torch.int64, device=idx.device)
        counts.index_add_(0, idx, torch.ones((), dtype=torch.int64, device=idx.device).expand(idx.numel()))
    return counts.view(len(ts), width)[:, :bins].to(torch.float64)


class HostCopy:
    """Collect device tensors during a step and copy them to the host once per device.

    ``add`` returns a handle; after :meth:`run`, ``get(handle)`` is a float64 numpy array of
    the tensor's shape. Every tensor of one device goes through one ``torch.cat`` and a single
    ``.cpu()``, so a step costs one device-to-host transfer, not one per tensor.
    """

    def __init__(self) -> None:
        self._items: list[Tensor] = []
        self._out: list[np.ndarray] = []
        self.transfers = 0

    def add(self, t: Tensor) -> int:
        """Queue ``t`` (any float or int dtype); return its handle."""
        self._items.append(t.detach())
        return len(self._items) - 1

    def run(self) -> None:
        """Copy everything queued to the host (one transfer per device)."""
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(self._items):
            by_device.setdefault(t.device, []).append(i)
        out: list[np.ndarray | None] = [None] * len(self._items)
        for device, idx in by_device.items():
            parts = [self._items[i].reshape(-1).to(torch.float64) for i in idx]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0]
            if device.type == "cpu" and len(parts) == 1:
                flat = flat.clone()  # never hand out numpy views of a caller's tensor
            if device.type != "cpu":
                self.transfers += 1
            host = flat.cpu().numpy()
            offset = 0
            for i in idx:
                n = self._items[i].numel()
                out[i] = host[offset:offset + n].reshape(self._items[i].shape)
                offset += n
        self._out = out  # type: ignore[assignment]
        self._items = []

    def get(self, handle: int) -> np.ndarray:
        """The host copy of the tensor behind ``handle`` (after :meth:`run`)."""
        return self._out[handle]


def host_moments(
    groups: list[tuple[list[int], dict[str, Tensor]]], n: int, copy: HostCopy
) -> Callable[[], dict[str, np.ndarray]]:
    """Queue grouped fields (:func:`tensor_moments`, :func:`centered_moments`) on ``copy``.

    Returns a function that, after ``copy.run()``, gives each field as a float64 numpy array
    [n] (``"hist"``: [n, B]) in the original tensor order.
    """
    handles = [(idx, {f: copy.add(t) for f, t in fields.items()}) for idx, fields in groups]

    def gather() -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for idx, hs in handles:
            for f, h in hs.items():
                v = copy.get(h)
                if f not in out:
                    out[f] = np.zeros((n, *v.shape[1:]), dtype=np.float64)
                out[f][idx] = v
        return out

    return gather


# -- finishing (host, float64; the distributed path runs refine_fields on the device) -------


def refine_fields(
    count: Any, fields: dict[str, Any], exact: tuple[Any, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Add ``m2`` (squared deviations from the mean) to moment fields, numpy or torch.

    ``m2 = sumsq - sum**2 / n``; rows with two-pass fields (``shift``/``csum``/``m2c`` inside
    ``fields``, or ``exact = (rows, fields_of_those_rows)``) use ``m2c - csum**2 / n`` instead.
    Inf/NaN elements make ``m2`` NaN, as they make numpy's ``std`` NaN.
    """
    out = dict(fields)
    cs = (out.pop("shift", None), out.pop("csum", None), out.pop("m2c", None))
    if "sum" not in out or "sumsq" not in out:
        return out
    is_np = isinstance(out["sum"], np.ndarray)
    with np.errstate(all="ignore"):
        m2 = out["sumsq"] - out["sum"] * out["sum"] / count
        if cs[1] is not None:
            m2 = cs[2] - cs[1] * cs[1] / count
        m2 = np.maximum(m2, 0.0) if is_np else m2.clamp_min(0.0)
        if exact is not None and len(exact[0]):
            rows, ef = exact
            m2[rows] = np.maximum(ef["m2c"] - ef["csum"] ** 2 / count[rows], 0.0)
    out["m2"] = m2
    return out


def unreliable_m2(count: np.ndarray, fields: dict[str, np.ndarray]) -> np.ndarray:
    """Rows whose ``sumsq - sum**2 / n`` may have lost digits (mean**2 > 99% of the mean
    square, finite, more than one element): they need :func:`centered_moments`."""
    s, q = fields["sum"], fields["sumsq"]
    # Written without division: Inf and NaN rows compare False and raise no warning.
    return np.flatnonzero((count > 1) & (s * s > _EXACT_SHARE * q * count))


def complete_fields(
    tensors: Sequence[Tensor],
    count: np.ndarray,
    fields: dict[str, np.ndarray],
    needs: Needs,
    *,
    exact: tuple[np.ndarray, dict[str, np.ndarray]] | None = None,
    scratch: Scratch | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Finish the host side of one step's fields for ``tensors`` (still alive).

    Takes exact non-finite counts where min/max show a NaN/Inf (when ``needs`` left them
    lazy) and two-pass ``m2`` for rows :func:`unreliable_m2` flags and ``exact`` lacks; both
    are rare and share one extra, small transfer. Then refines (:func:`refine_fields`).

    Args:
        tensors: the tensors the fields came from [n].
        count: their element counts [n].
        fields: raw fields from :func:`host_moments`.
        needs: what was computed.
        exact: ``(rows, fields)`` of two-pass fields already computed for some rows.
        scratch: work buffers for the centred pass.

    Returns:
        ``(refined fields, unreliable rows)``; the latter are worth computing exactly up front
        next step.
    """
    fields = dict(fields)
    later = HostCopy()
    lazy_nf = None
    if needs.lazy_nonfinite:
        flagged = np.flatnonzero(~np.isfinite(fields["max"]) | ~np.isfinite(fields["negmin"]))
        fields["nonfinite"] = np.zeros(len(count))
        if len(flagged):
            lazy_nf = (flagged, later.add(torch.stack(
                [(~torch.isfinite(tensors[i].detach())).sum() for i in flagged])))
    unreliable = unreliable_m2(count, fields) if needs.std else np.zeros(0, dtype=np.int64)
    rows, ef = exact if exact is not None else (np.zeros(0, dtype=np.int64), {})
    missing = np.setdiff1d(unreliable, rows) if len(unreliable) else unreliable
    gather = None
    if len(missing):
        groups = centered_moments([tensors[i] for i in missing], scratch=scratch)
        gather = host_moments(groups, len(missing), later)
    if lazy_nf is not None or gather is not None:
        later.run()  # only steps with NaN/Inf or a dominant mean pay for this transfer
    if lazy_nf is not None:
        fields["nonfinite"][lazy_nf[0]] = later.get(lazy_nf[1])
    if gather is not None:
        extra = gather()
        rows = np.concatenate([rows, missing])
        ef = {f: np.concatenate([ef[f], extra[f]]) if f in ef else extra[f] for f in extra}
    return refine_fields(count, fields, (rows, ef) if len(rows) else None), unreliable


def combine_parts(
    count: np.ndarray, fields: dict[str, np.ndarray], group: np.ndarray, n_groups: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Combine refined moment rows that belong to the same tensor (e.g. several calls).

    ``m2`` is combined exactly (Chan et al.): ``sum m2_i + sum n_i * (mean_i - mean)**2``.

    Args:
        count: element count of each row [P].
        fields: refined moment fields [P] (``"hist"`` [P, B]), see :func:`refine_fields`.
        group: the output row of each input row [P], values in ``range(n_groups)``.
        n_groups: number of output rows.

    Returns:
        ``(count [G], fields [G])``, ready for :func:`finish_stats`.
    """
    out: dict[str, np.ndarray] = {}
    total = np.bincount(group, weights=count, minlength=n_groups)
    with np.errstate(all="ignore"):
        for f, v in fields.items():
            if f in MAX_FIELDS:
                r = np.full(n_groups, -np.inf)
                np.maximum.at(r, group, v)  # NaN propagates, as in numpy's max
            else:
                r = np.zeros((n_groups, *v.shape[1:]))
                np.add.at(r, group, v)
            out[f] = r
        if "m2" in fields:
            mean = out["sum"] / total
            dev = count * (fields["sum"] / count - mean[group]) ** 2
            out["m2"] = out["m2"] + np.bincount(group, weights=dev, minlength=n_groups)
    return total, out


def finish_stats(
    count: np.ndarray, fields: dict[str, np.ndarray], stats: Sequence[str]
) -> dict[str, np.ndarray]:
    """Turn (refined, combined) moment fields into the named statistics (DESIGN.md).

    ``std`` is the population standard deviation, ``norm`` the L2 norm, ``nonfinite`` the count
    of NaN/Inf elements; NaN propagates into mean/std/norm/absmax/min/max, Inf into mean/norm.
    A ``between`` field (sum of s_i**2 / n_i over reduced ranks) completes ``m2`` across ranks.
    ``fields["nonfinite"]`` must hold exact counts wherever there is a non-finite element.
    """
    n = count.astype(np.float64)
    out: dict[str, np.ndarray] = {}
    with np.errstate(all="ignore"):
        nan = None
        if "max" in fields:
            nan = np.isnan(fields["max"]) | np.isnan(fields["negmin"])
        for stat in stats:
            if stat == "mean":
                out[stat] = fields["sum"] / n
            elif stat == "std":
                m2 = fields["m2"]
                if "between" in fields:
                    s = fields["sum"]
                    m2 = m2 + np.maximum(fields["between"] - s * s / n, 0.0)
                out[stat] = np.sqrt(m2 / n)
            elif stat == "norm":
                out[stat] = np.sqrt(fields["sumsq"])
            elif stat == "absmax":
                out[stat] = np.where(nan, np.nan, np.maximum(fields["max"], fields["negmin"]))
            elif stat == "max":
                out[stat] = np.where(nan, np.nan, fields["max"])
            elif stat == "min":
                out[stat] = np.where(nan, np.nan, -fields["negmin"])
            elif stat == "nonfinite":
                out[stat] = fields["nonfinite"]
            elif stat == "zero_frac":
                out[stat] = (n - fields["nonzero"]) / n
            else:  # pragma: no cover - check_stats rejects it first
                raise ValueError(f"unknown stat {stat!r}")
    return out
