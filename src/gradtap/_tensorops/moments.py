"""Per-tensor moments: the typed sufficient statistics and the device kernels that fill them.

Statistics are finished from per-tensor *sufficient statistics* (:class:`Moments`) that can be
combined across parts (several calls of a module within a step, several ranks). Each field
holds one row per tensor:

* ``sum``        sum of the elements (a cascade/tree sum: accurate to ~1e-8)
* ``sumsq``      sum of squares, accurate too (``norms.group_sumsq``)
* ``max``, ``negmin`` the largest element and minus the smallest; NaN propagates through both
* ``nonfinite``  count of NaN and +-Inf elements
* ``nonzero``    count of elements != 0 (NaN counts as nonzero)
* ``hist``       [B] counts of finite elements per bin (outliers in the end bins)

and, by stage:

* raw (device, then host after the step's one copy): optionally ``centered``, the two-pass
  fields of :class:`Centered`;
* refined (:func:`~gradtap._tensorops.finish.refine_fields`): ``m2``, the sum of squared
  deviations from the tensor's mean, and no ``centered``;
* reduced across ranks (``gradtap.distributed``): ``between``, the sum over ranks of
  ``sum_i**2 / n_i``, which completes ``m2`` (``M2 = sum m2_i + between - S**2 / N``).

``m2 = sumsq - sum**2 / n``, evaluated in float64, is exact to ~1e-8 * sumsq, which is fine
unless the mean dominates (mean**2 > 99% of the mean square). Those rows get the two-pass
value from :func:`centered_moments`: the tensor centred on its float32 mean ``shift`` gives
``csum = sum(x - shift)`` and ``m2c = sum((x - shift)**2)``, and ``m2 = m2c - csum**2 / n``
(the corrected two-pass algorithm), so a constant tensor has std 0 exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch
from torch import Tensor

from gradtap import _types
from gradtap._tensorops.groups import Scratch, group_by_device_dtype
from gradtap._tensorops.histograms import histogram_counts
from gradtap._tensorops.host import HostCopy
from gradtap._tensorops.l2 import BLOCK, group_sumsq

__all__ = [
    "MAX_FIELDS",
    "STAT_NAMES",
    "SUM_FIELDS",
    "Centered",
    "Moments",
    "Needs",
    "centered_moments",
    "check_stats",
    "host_moments",
    "needs_for",
    "tensor_moments",
]

STAT_NAMES = _types.STAT_NAMES  # the moments' statistics, named once in gradtap._types
#: Fields combined across parts by summing (``hist`` too) and by taking the maximum.
SUM_FIELDS: tuple[str, ...] = ("sum", "sumsq", "m2", "nonfinite", "nonzero")
MAX_FIELDS: tuple[str, ...] = ("max", "negmin")

#: Arrays of one :class:`Moments`: numpy on the host, torch tensors on a device.
A = TypeVar("A", np.ndarray, Tensor)


@dataclass
class Centered(Generic[A]):
    """Two-pass fields of each tensor: ``shift`` (its float32 mean), ``csum = sum(x - shift)``
    and ``m2c = sum((x - shift)**2)``; together exact for ``m2`` however large the mean."""

    shift: A
    csum: A
    m2c: A


@dataclass
class Moments(Generic[A]):
    """Sufficient statistics of a list of tensors, one row per tensor (see the module text).

    Every field is a float64 array [n] (``hist`` [n, B]), numpy or torch, or ``None`` when it
    was not computed. For code that moves fields by name (packing buffers, tests) a
    ``Moments`` also reads and writes as a mapping over the flat names in :attr:`NAMES` that
    are present (``"shift"``, ``"csum"``, ``"m2c"`` reach into ``centered``).

    Example:
        >>> import numpy as np
        >>> m = Moments(sum=np.array([6.0]), sumsq=np.array([14.0]))
        >>> list(m), m["sumsq"].tolist()
        (['sum', 'sumsq'], [14.0])
    """

    sum: A | None = None
    sumsq: A | None = None
    max: A | None = None
    negmin: A | None = None
    nonfinite: A | None = None
    nonzero: A | None = None
    hist: A | None = None
    centered: Centered[A] | None = None
    m2: A | None = None
    between: A | None = None

    NAMES: ClassVar[tuple[str, ...]] = (
        "sum", "sumsq", "max", "negmin", "nonfinite", "nonzero", "hist",
        "shift", "csum", "m2c", "m2", "between",
    )  # fmt: skip
    _CENTERED: ClassVar[tuple[str, ...]] = ("shift", "csum", "m2c")
    _KNOWN: ClassVar[frozenset[str]] = frozenset(NAMES)

    # -- the flat-name view ------------------------------------------------------------------

    @classmethod
    def coerce(cls, fields: Moments[A] | Mapping[str, A]) -> Moments[A]:
        """``fields`` itself if it is a ``Moments``, else one built from a name -> array map
        (``shift``, ``csum`` and ``m2c`` must come together)."""
        if isinstance(fields, Moments):
            return fields
        if not cls._KNOWN.issuperset(fields):
            unknown = sorted(set(fields) - cls._KNOWN)
            raise KeyError(f"unknown moment field(s) {unknown}; fields are {cls.NAMES}")
        if "shift" not in fields and "csum" not in fields and "m2c" not in fields:
            plain: dict[str, Any] = dict(fields)  # only plain fields here: checked above
            return cls(**plain)
        parts = [f for f in cls._CENTERED if f in fields]
        if len(parts) != 3:
            raise KeyError(f"centered fields come together (shift, csum, m2c); got {parts}")
        plain = {f: v for f, v in fields.items() if f not in cls._CENTERED}
        return cls(**plain, centered=Centered(fields["shift"], fields["csum"], fields["m2c"]))

    def __getitem__(self, name: str) -> A:
        value = (getattr(self.centered, name, None) if name in self._CENTERED
                 else getattr(self, name, None) if name in self.NAMES else None)
        if value is None:
            raise KeyError(name)
        return value

    def __setitem__(self, name: str, value: A) -> None:
        if name in self._CENTERED:
            if self.centered is None:
                raise KeyError(f"{name!r} is a centered field; set centered=Centered(...)")
            setattr(self.centered, name, value)
        elif name in self.NAMES:
            setattr(self, name, value)
        else:
            raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.NAMES and self._get(name) is not None

    def __iter__(self) -> Iterator[str]:
        return (f for f in self.NAMES if self._get(f) is not None)

    def keys(self) -> list[str]:
        """Flat names of the fields present, in :attr:`NAMES` order."""
        return list(self)

    def items(self) -> list[tuple[str, A]]:
        """``(flat name, array)`` of the fields present."""
        return [(f, self[f]) for f in self]

    def _get(self, name: str) -> A | None:
        if name in self._CENTERED:
            return None if self.centered is None else getattr(self.centered, name)
        return getattr(self, name)

    # -- whole-row operations ----------------------------------------------------------------

    def map(self, fn: Callable[[A], Any]) -> Moments[Any]:
        """A new ``Moments`` with ``fn`` applied to every field present (rows, devices)."""
        return Moments.coerce({f: fn(v) for f, v in self.items()})

    def copy(self) -> Moments[A]:
        """A shallow copy: fields may be replaced on it without touching this one."""
        c = self.centered
        return Moments(self.sum, self.sumsq, self.max, self.negmin, self.nonfinite, self.nonzero,
                       self.hist, None if c is None else Centered(c.shift, c.csum, c.m2c),
                       self.m2, self.between)

    @staticmethod
    def cat(parts: Sequence[Moments[A]]) -> Moments[A]:
        """Rows of ``parts`` one after the other (torch parts move to the first's device)."""
        first = parts[0]
        if len(parts) == 1:
            return first
        out: dict[str, Any] = {}
        for f, v in first.items():
            if isinstance(v, np.ndarray):
                out[f] = np.concatenate([p[f] for p in parts])
            else:
                out[f] = torch.cat([p[f].to(v.device) for p in parts])
        return Moments.coerce(out)


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
    lazy_nonzero: bool = False

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
    tensors whose min/max show a non-finite element, and on the CPU the nonzero count of a
    tensor with a NaN to a pass over it alone (``complete_fields``).
    """
    s = set(check_stats(stats))
    std = "std" in s
    return Needs(
        sum="mean" in s or std,
        sumsq=bool(s & {"norm", "rms"}) or std,
        std=std,
        minmax=bool(s & {"absmax", "min", "max"}) or ("nonfinite" in s and not exact_nonfinite),
        nonfinite="nonfinite" in s and exact_nonfinite,
        nonzero="zero_frac" in s,
        lazy_nonfinite="nonfinite" in s and not exact_nonfinite,
        lazy_nonzero="zero_frac" in s and not exact_nonfinite,
    )


# -- device kernels --------------------------------------------------------------------------


def tensor_moments(
    tensors: Sequence[Tensor],
    needs: Needs,
    *,
    edges: Tensor | None = None,
    batched: bool = True,
    exact_m2: bool = False,
    scratch: Scratch | None = None,
) -> list[tuple[list[int], Moments[Tensor]]]:
    """Compute per-tensor moments on the tensors' own devices, without a host sync.

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
        One ``(indices, moments)`` per group: each field a float64 [len(indices)] tensor
        (``hist``: [len(indices), B]) on the group's device, rows in ``indices`` order.

    Example:
        >>> import torch
        >>> [(idx, m.sum.tolist()) for idx, m in tensor_moments([torch.ones(3)], needs_for(["mean"]))]
        [([0], [3.0])]
    """
    out = []
    for (_device, dtype), idx in group_by_device_dtype(tensors).items():
        if not dtype.is_floating_point:
            raise TypeError(f"statistics need floating-point tensors; got {dtype}")
        group = [tensors[i].detach() for i in idx]
        acc = torch.promote_types(dtype, torch.float32)
        moments = (_group_moments if batched else _loop_moments)(group, needs, acc)
        if exact_m2 and needs.std:
            moments.centered = _centered(group, acc, scratch, batched)
        if edges is not None:
            moments.hist = histogram_counts(group, edges, batched)
        out.append((idx, moments))
    return out


def centered_moments(
    tensors: Sequence[Tensor], *, scratch: Scratch | None = None, batched: bool = True
) -> list[tuple[list[int], Moments[Tensor]]]:
    """Two-pass fields (:class:`Centered`, nothing else) per tensor, grouped like
    :func:`tensor_moments`."""
    out = []
    for (_device, dtype), idx in group_by_device_dtype(tensors).items():
        group = [tensors[i].detach() for i in idx]
        centered = _centered(group, torch.promote_types(dtype, torch.float32), scratch, batched)
        out.append((idx, Moments(centered=centered)))
    return out


def host_moments(
    groups: list[tuple[list[int], Moments[Tensor]]], n: int, copy: HostCopy
) -> Callable[[], Moments[np.ndarray]]:
    """Queue grouped moments (:func:`tensor_moments`, :func:`centered_moments`) on ``copy``.

    Returns a function that, after ``copy.run()``, gives the moments as float64 numpy arrays
    [n] (``hist``: [n, B]) in the original tensor order.
    """
    names = list(groups[0][1]) if groups else []
    gathers = {f: copy.add_rows([(idx, m[f]) for idx, m in groups], n) for f in names}

    def gather() -> Moments[np.ndarray]:
        return Moments.coerce({f: g() for f, g in gathers.items()})

    return gather


def _group_moments(ts: list[Tensor], needs: Needs, acc: torch.dtype) -> Moments[Tensor]:
    layout = _layout(tuple(t.numel() for t in ts), needs, ts[0].device.type == "cpu")
    return layout.device_fields(layout.launch(ts, acc))


class _Layout:
    """Where each field of one ``(device, dtype)`` group of tensors lies in its flat buffer.

    :meth:`launch` runs every reduction kernel the fields need and puts their results in one
    float64 tensor: the per-tensor scalars (``sum``, the norms of short tensors and of long
    tensors' tails, ``max``, ``min``) in one stack, then the blocked row norms of long CPU
    tensors (:func:`~gradtap._tensorops.l2.group_sumsq`), then the counts. The fields are then
    read back by index, on the device (:meth:`device_fields`) or on the host after the step's
    one copy (:meth:`host_fields`), with a fixed number of operations whatever the number of
    tensors.
    """

    def __init__(self, numels: tuple[int, ...], needs: Needs, cpu: bool) -> None:
        k = len(numels)
        self.k = k
        self.needs = needs
        self.cpu = cpu
        # blocks of each tensor (long CPU tensors only) and which tensors leave a short piece
        self.blocks = [n // BLOCK if cpu and n > BLOCK else 0 for n in numels]
        self.short = [not q or bool(n % BLOCK) for q, n in zip(self.blocks, numels)]
        pos = 0
        self.slices: dict[str, slice] = {}
        if needs.sum:
            self.slices["sum"], pos = slice(pos, pos + k), pos + k
        n_short = sum(self.short) if needs.sumsq else 0
        short_at, pos = pos, pos + n_short
        if needs.minmax:
            self.slices["max"], pos = slice(pos, pos + k), pos + k
            self.slices["min"], pos = slice(pos, pos + k), pos + k
        self.n_scalars = pos
        sq_pos: list[int] = []
        sq_index: list[int] = []
        if needs.sumsq:  # rows first, then short pieces: group_sumsq's order of summation
            for j, q in enumerate(self.blocks):
                sq_pos += range(pos, pos + q)
                sq_index += [j] * q
                pos += q
            sq_pos += range(short_at, short_at + n_short)
            sq_index += [j for j, s in enumerate(self.short) if s]
        self.sq_pos = np.array(sq_pos, dtype=np.int64)
        self.sq_index = np.array(sq_index, dtype=np.int64)
        for f in ("nonfinite", "nonzero"):
            if getattr(needs, f):
                self.slices[f], pos = slice(pos, pos + k), pos + k
        self.size = pos
        # positions of the plain fields, one row per field [F, k]: one take on the host
        self.take = np.array([np.arange(sl.start, sl.stop) for sl in self.slices.values()],
                             dtype=np.int64).reshape(len(self.slices), k)
        self._device_index: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def launch(self, ts: Sequence[Tensor], acc: torch.dtype, extra: Sequence[Tensor] = (),
               scratch: Scratch | None = None) -> Tensor:
        """Run the kernels over ``ts`` (this layout's tensors): the flat float64 buffer of
        :attr:`size` elements, followed by the elements of ``extra`` (1-d) if any.
        ``scratch``: work buffers for the passes that need a temporary (CPU nonzero counts)."""
        needs = self.needs
        scalars: list[Tensor] = []
        rows: list[Tensor] = []
        counts: list[Tensor] = []
        if needs.sum:
            # There is no foreach sum; a per-tensor sum is one vectorised (cascade) kernel each.
            scalars += [t.sum(dtype=acc) for t in ts]
        if needs.sumsq:
            kw = {"dtype": acc} if acc != ts[0].dtype else {}
            short: list[Tensor] = []
            for t, q, s in zip(ts, self.blocks, self.short):
                if not q:
                    short.append(t)
                    continue
                if t.is_contiguous():  # rows of BLOCK elements, one view
                    blocks = t.as_strided((q, BLOCK), (BLOCK, 1))
                else:
                    blocks = t.reshape(-1)[: q * BLOCK].view(q, BLOCK)
                rows.append(torch.linalg.vector_norm(blocks, dim=1, **kw))
                if s:
                    short.append(t.reshape(-1)[q * BLOCK:])
            if short:
                scalars += torch._foreach_norm(short, 2, **kw)
        if needs.minmax:
            mm = [torch.aminmax(t) for t in ts]
            scalars += [m.max for m in mm]
            scalars += [m.min for m in mm]
        if needs.nonfinite:
            # x * 0 is 0 for finite x and NaN for NaN/Inf, and count_nonzero counts NaN.
            counts += [(t * 0).count_nonzero() for t in ts]
        if needs.nonzero:
            counts += [_nonzero(t, self.cpu and needs.lazy_nonzero, scratch) for t in ts]
        parts = [torch.stack(scalars)] if scalars else []
        parts += rows
        if counts:  # exact in float64 (float32 would round counts above 2**24)
            parts.append(torch.stack(counts).to(torch.float64))
        parts += extra
        if not parts:
            return torch.zeros(0, dtype=torch.float64, device=ts[0].device)
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        return flat.to(torch.float64)

    def device_fields(self, flat: Tensor) -> Moments[Tensor]:
        """The fields of a :meth:`launch` buffer as tensors on its device."""
        sl = self.slices
        out: Moments[Tensor] = Moments()
        if "sum" in sl:
            out.sum = flat[sl["sum"]]
        if self.needs.sumsq:
            index = self._device_index.get(flat.device)
            if index is None:
                index = self._device_index[flat.device] = (
                    torch.from_numpy(self.sq_pos).to(flat.device),
                    torch.from_numpy(self.sq_index).to(flat.device))
            out.sumsq = torch.zeros(self.k, dtype=flat.dtype, device=flat.device).index_add_(
                0, index[1], flat[index[0]].square())
        if "max" in sl:
            out.max = flat[sl["max"]]
            out.negmin = flat[sl["min"]].neg()
        if "nonfinite" in sl:
            out.nonfinite = flat[sl["nonfinite"]]
        if "nonzero" in sl:
            out.nonzero = flat[sl["nonzero"]]
        return out

    def host_fields(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The fields of a :meth:`launch` buffer copied to the host, as float64 arrays."""
        out = dict(zip(self.slices, flat[self.take]))
        if "min" in out:
            out["negmin"] = -out.pop("min")
        if self.needs.sumsq:
            pieces = flat[self.sq_pos]
            out["sumsq"] = np.bincount(self.sq_index, weights=pieces * pieces, minlength=self.k)
        return out


#: Counts of 0/1 values summed in float32 are exact up to this many elements.
_F32_EXACT = 1 << 24


def _nonzero(t: Tensor, lazy: bool, scratch: Scratch | None = None) -> Tensor:
    """The count of elements != 0. ``lazy`` (CPU): ``count_nonzero`` is a scalar loop there,
    far slower than vectorised passes summing ``ceil(min(|x|, 1))`` (1 for every nonzero,
    exact for float32/float64 tensors of up to 2**24 elements); that sum is NaN where ``t``
    holds a NaN, and ``complete_fields`` then counts the tensor exactly. The temporary is
    a ``scratch`` buffer when one is given (a fresh one costs page faults)."""
    if lazy and t.dtype in (torch.float32, torch.float64) and t.numel() <= _F32_EXACT:
        out = None if scratch is None else scratch.get(t.numel(), t.device, t.dtype).view(t.shape)
        return torch.abs(t, out=out).clamp_(max=1.0).ceil_().sum()
    return t.count_nonzero()


@lru_cache(maxsize=256)
def _layout(numels: tuple[int, ...], needs: Needs, cpu: bool) -> _Layout:
    return _Layout(numels, needs, cpu)


def _loop_moments(ts: list[Tensor], needs: Needs, acc: torch.dtype) -> Moments[Tensor]:
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
    return Moments.coerce({f: torch.stack(v).to(torch.float64) for f, v in cols.items()})


def _centered(ts: list[Tensor], acc: torch.dtype, scratch: Scratch | None,
              batched: bool) -> Centered[Tensor]:
    f64 = torch.float64
    shifts, csums, m2s = [], [], []
    for t in ts:
        x = t.to(acc) if not batched else t
        shift = x.sum(dtype=acc) / x.numel()
        if batched:
            buf = (scratch or Scratch()).get(t.numel(), t.device, acc).view(t.shape)
            c = buf.copy_(t).sub_(shift)
            m2s.append(group_sumsq([c], acc)[0])
        else:
            c = x - shift
            m2s.append((c * c).sum().to(f64))
        shifts.append(shift)
        csums.append(c.sum())
    return Centered(torch.stack(shifts).to(f64), torch.stack(csums).to(f64),
                    torch.stack(m2s).to(f64))
