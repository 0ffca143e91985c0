"""From moments to statistics: refine ``m2``, fix rare rows, combine parts, finish (host).

Runs on the host in float64, after the step's one copy; the distributed path runs
:func:`refine_fields` on the device. Combining parts i with counts n_i uses Chan's exact
update (:func:`combine_parts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtap._tensorops import moments as _moments
from gradtap._tensorops.groups import Scratch
from gradtap._tensorops.host import HostCopy
from gradtap._tensorops.moments import MAX_FIELDS, Moments, Needs, host_moments

__all__ = ["combine_parts", "complete_fields", "finish_stats", "refine_fields", "unreliable_m2"]

# Above this share of the mean square taken by mean**2, m2 comes from a second, centred pass.
_EXACT_SHARE = 0.99

Fields = Moments[Any] | Mapping[str, Any]


def refine_fields(
    count: Any, fields: Fields, exact: tuple[Any, Fields] | None = None
) -> Moments[Any]:
    """Add ``m2`` (squared deviations from the mean) to raw moments, numpy or torch.

    ``m2 = sumsq - sum**2 / n``; rows with two-pass fields (``centered``, or
    ``exact = (rows, moments_of_those_rows)``) use ``m2c - csum**2 / n`` instead.
    Inf/NaN elements make ``m2`` NaN, as they make numpy's ``std`` NaN. The result has no
    ``centered`` fields.
    """
    raw = Moments.coerce(fields)
    out = raw.copy()
    out.centered = None
    if raw.sum is None or raw.sumsq is None:
        return out
    is_np = isinstance(raw.sum, np.ndarray)
    with np.errstate(all="ignore"):
        if raw.centered is not None:
            m2 = raw.centered.m2c - raw.centered.csum * raw.centered.csum / count
        else:
            m2 = raw.sumsq - raw.sum * raw.sum / count
        m2 = np.maximum(m2, 0.0) if is_np else m2.clamp_min(0.0)
        if exact is not None and len(exact[0]):
            rows, ef = exact[0], Moments.coerce(exact[1]).centered
            assert ef is not None, "exact rows need centered fields"
            m2[rows] = np.maximum(ef.m2c - ef.csum ** 2 / count[rows], 0.0)
    out.m2 = m2
    return out


def unreliable_m2(count: np.ndarray, fields: Fields) -> np.ndarray:
    """Rows whose ``sumsq - sum**2 / n`` may have lost digits (mean**2 > 99% of the mean
    square, finite, more than one element): they need ``centered_moments``."""
    m = Moments.coerce(fields)
    s, q = m["sum"], m["sumsq"]
    # Written without division: Inf and NaN rows compare False and raise no warning.
    share = s * s > q * (_EXACT_SHARE * count)
    if not share.any():
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero((count > 1) & share)


def complete_fields(
    tensors: Sequence[Tensor],
    count: np.ndarray,
    fields: Fields,
    needs: Needs,
    *,
    exact: tuple[np.ndarray, Fields] | None = None,
    scratch: Scratch | None = None,
) -> tuple[Moments[np.ndarray], np.ndarray]:
    """Finish the host side of one step's moments for ``tensors`` (still alive).

    Takes exact non-finite counts where min/max show a NaN/Inf (when ``needs`` left them
    lazy), exact nonzero counts where the lazy one is NaN, and two-pass ``m2`` for rows :func:`unreliable_m2` flags and ``exact`` lacks; both
    are rare and share one extra, small transfer. Then refines (:func:`refine_fields`).

    Args:
        tensors: the tensors the moments came from [n].
        count: their element counts [n].
        fields: raw moments from ``host_moments``.
        needs: what was computed.
        exact: ``(rows, moments)`` of two-pass fields already computed for some rows.
        scratch: work buffers for the centred pass.

    Returns:
        ``(refined moments, unreliable rows)``; the latter are worth computing exactly up
        front next step.
    """
    m = Moments.coerce(fields)
    if m is fields:  # coerce made a new one from a mapping; a Moments is the caller's
        m = m.copy()
    later: HostCopy | None = None
    lazy_nf = None
    if needs.lazy_nonfinite:
        m.nonfinite = _zeros(len(count))
        # max(max, -min) is finite exactly when both are: NaN and Inf reach it either way
        finite = np.isfinite(np.maximum(m["max"], m["negmin"]))
        if not finite.all():
            m.nonfinite = np.zeros(len(count))
            flagged = np.flatnonzero(~finite)
            later = HostCopy()
            lazy_nf = (flagged, later.add(torch.stack(
                [(~torch.isfinite(tensors[int(i)].detach())).sum() for i in flagged])))
    lazy_nz = None
    if needs.lazy_nonzero and np.isnan(m["nonzero"]).any():  # a NaN element (see _nonzero)
        m.nonzero = m["nonzero"].copy()
        flagged = np.flatnonzero(np.isnan(m.nonzero))
        later = later or HostCopy()
        lazy_nz = (flagged, later.add(torch.stack(
            [tensors[int(i)].detach().count_nonzero() for i in flagged])))
    unreliable = unreliable_m2(count, m) if needs.std else np.zeros(0, dtype=np.int64)
    rows = exact[0] if exact is not None else np.zeros(0, dtype=np.int64)
    ef = Moments.coerce(exact[1]) if exact is not None else None
    missing = np.setdiff1d(unreliable, rows) if len(unreliable) else unreliable
    gather = None
    if len(missing):
        # Looked up on the module at call time, like every caller of centered_moments.
        groups = _moments.centered_moments([tensors[int(i)] for i in missing], scratch=scratch)
        later = later or HostCopy()
        gather = host_moments(groups, len(missing), later)
    if later is not None:
        later.run()  # only steps with NaN/Inf or a dominant mean pay for this transfer
    if lazy_nf is not None:
        assert later is not None
        m["nonfinite"][lazy_nf[0]] = later.get(lazy_nf[1])
    if lazy_nz is not None:
        assert later is not None
        m["nonzero"][lazy_nz[0]] = later.get(lazy_nz[1])
    if gather is not None:
        extra = gather()
        rows = np.concatenate([rows, missing])
        ef = extra if ef is None else Moments.cat([ef, extra])
    return refine_fields(count, m, (rows, ef) if len(rows) and ef is not None else None), unreliable


@lru_cache(maxsize=64)
def _zeros(n: int) -> np.ndarray:
    """A shared, read-only float64 array of ``n`` zeros."""
    out = np.zeros(n)
    out.setflags(write=False)
    return out


def combine_parts(
    count: np.ndarray, fields: Fields, group: np.ndarray, n_groups: int
) -> tuple[np.ndarray, Moments[np.ndarray]]:
    """Combine refined moment rows that belong to the same tensor (e.g. several calls).

    ``m2`` is combined exactly (Chan et al.): ``sum m2_i + sum n_i * (mean_i - mean)**2``.

    Args:
        count: element count of each row [P].
        fields: refined moments [P] (``hist`` [P, B]), see :func:`refine_fields`.
        group: the output row of each input row [P], values in ``range(n_groups)``.
        n_groups: number of output rows.

    Returns:
        ``(count [G], moments [G])``, ready for :func:`finish_stats`.
    """
    m = Moments.coerce(fields)
    out: dict[str, np.ndarray] = {}
    total = np.bincount(group, weights=count, minlength=n_groups)
    with np.errstate(all="ignore"):
        for f, v in m.items():
            if f in MAX_FIELDS:
                r = np.full(n_groups, -np.inf)
                np.maximum.at(r, group, v)  # NaN propagates, as in numpy's max
            else:
                r = np.zeros((n_groups, *v.shape[1:]))
                np.add.at(r, group, v)
            out[f] = r
        if m.m2 is not None:
            mean = out["sum"] / total
            dev = count * (m.sum / count - mean[group]) ** 2
            out["m2"] = out["m2"] + np.bincount(group, weights=dev, minlength=n_groups)
    return total, Moments.coerce(out)


def finish_stats(
    count: np.ndarray, fields: Fields, stats: Sequence[str]
) -> dict[str, np.ndarray]:
    """Turn (refined, combined) moments into the named statistics, one array [n] per name.

    ``std`` is the population standard deviation, ``norm`` the L2 norm, ``rms`` the root mean
    square ``sqrt(mean(x**2))`` (``norm / sqrt(n)``), ``nonfinite`` the count
    of NaN/Inf elements; NaN propagates into mean/std/norm/absmax/min/max, Inf into mean/norm.
    A ``between`` field (sum of s_i**2 / n_i over reduced ranks) completes ``m2`` across ranks.
    ``nonfinite`` must hold exact counts wherever there is a non-finite element.

    Example:
        >>> import numpy as np
        >>> m = refine_fields(np.array([4.0]), {"sum": np.array([4.0]), "sumsq": np.array([8.0])})
        >>> {k: v.tolist() for k, v in finish_stats(np.array([4.0]), m, ["mean", "std"]).items()}
        {'mean': [1.0], 'std': [1.0]}
    """
    m = Moments.coerce(fields)
    n = np.asarray(count, dtype=np.float64)
    out: dict[str, np.ndarray] = {}
    nan: Any = None
    with np.errstate(all="ignore"):
        for stat in stats:
            if stat == "mean":
                out[stat] = m["sum"] / n
            elif stat == "std":
                m2 = m["m2"]
                if m.between is not None:
                    m2 = m2 + np.maximum(m.between - m["sum"] * m["sum"] / n, 0.0)
                out[stat] = np.sqrt(m2 / n)
            elif stat == "norm":
                out[stat] = np.sqrt(m["sumsq"])
            elif stat == "rms":
                out[stat] = np.sqrt(m["sumsq"] / n)
            elif stat == "absmax":  # np.maximum propagates NaN from either side
                out[stat] = np.maximum(m["max"], m["negmin"])
            elif stat in ("max", "min"):
                if nan is None:
                    nan = np.isnan(m["max"]) | np.isnan(m["negmin"])
                out[stat] = np.where(nan, np.nan, m["max"] if stat == "max" else -m["negmin"])
            elif stat == "nonfinite":
                out[stat] = m["nonfinite"]
            elif stat == "zero_frac":
                out[stat] = (n - m["nonzero"]) / n
            else:  # pragma: no cover - check_stats rejects it first
                raise ValueError(f"unknown stat {stat!r}")
    return out
