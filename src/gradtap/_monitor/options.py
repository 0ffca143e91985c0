"""The Monitor's options: the kinds of tensors and default statistics, and their checks.

Every argument of :class:`~gradtap.Monitor` that can be wrong on its own, or together with
another, is checked here once, at construction, before anything is hooked or stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor

from gradtap import _tensorops as ops
from gradtap._monitor.spikes import DERIVED_STATS
from gradtap._types import is_int
from gradtap.store import KIND_NAMES

__all__ = ["DEFAULT_STATS", "KINDS", "PARAM_KINDS", "check_options"]

KINDS = KIND_NAMES
DEFAULT_STATS = ("norm", "mean", "std", "absmax", "nonfinite")
#: The kinds read from the parameters at ``step()``, with no hook.
PARAM_KINDS = ("param_grad", "param", "update", "grad_cosine")


def check_options(stats: Sequence[str], kinds: Sequence[str], *, ewma: float | None,
                  every: int, local_grads: bool, hist_bins: int | None, hist_scale: str,
                  hist_range: tuple[float, float] | None, hist_linthresh: float,
                  ) -> tuple[tuple[str, ...], tuple[str, ...], Tensor | None]:
    """``(stats, kinds, histogram bin edges or None)``, or a ``ValueError`` for a bad option.

    ``stats`` may hold the stats the Monitor derives on the host (:data:`DERIVED_STATS`)
    beside the moments of a tensor."""
    stats = (stats,) if isinstance(stats, str) else tuple(stats)
    valid = (*ops.STAT_NAMES, *DERIVED_STATS)
    unknown = [s for s in stats if s not in valid]
    if unknown:
        raise ValueError(f"unknown stat name(s) {', '.join(map(repr, unknown))}; valid stats "
                         f"are: {', '.join(valid)}")
    if len(set(stats)) != len(stats):
        raise ValueError(f"stats lists a name twice: {list(stats)}")
    kinds = _check_kinds(kinds)
    if ewma is not None and not (isinstance(ewma, (int, float)) and 0.0 <= ewma < 1.0):
        raise ValueError(f"ewma must be None or a factor beta with 0 <= beta < 1; got {ewma!r}")
    if not is_int(every) or every < 1:
        raise ValueError(f"every must be a positive int; got {every!r}")
    if local_grads and "param_grad" not in kinds:
        raise ValueError("local_grads=True watches param_grad; add 'param_grad' to kinds")
    edges = None if hist_bins is None else ops.hist_edges(
        hist_bins, hist_scale, hist_range, hist_linthresh)
    if not stats and edges is None and ewma is None and not (
            {"update", "grad_cosine"} & set(kinds)):
        raise ValueError("nothing to compute: stats is empty and there are no histograms, "
                         "EWMA, update ratio or grad_cosine")
    return stats, kinds, edges


def _check_kinds(kinds: str | Iterable[str]) -> tuple[str, ...]:
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown kind(s) {', '.join(map(repr, bad))}; valid kinds are: "
                         f"{', '.join(KINDS)}")
    if not kinds:
        raise ValueError(f"kinds is empty; choose from: {', '.join(KINDS)}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"kinds lists a kind twice: {list(kinds)}")
    return kinds
