"""The Monitor's options: the kinds of tensors and default statistics, and their checks.

Every argument of :class:`~gradtap.Monitor` that can be wrong on its own, or together with
another, is checked here once, at construction, before anything is hooked or stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor, nn

from gradtap import _tensorops as ops
from gradtap import distributed
from gradtap._monitor.spikes import DERIVED_STATS
from gradtap._types import Selector
from gradtap.errors import SelectionError
from gradtap.select import clean_name, select_parameters
from gradtap.store import KIND_NAMES

__all__ = ["DEFAULT_STATS", "GNS_STATS", "HEALTH_STATS", "KINDS", "LOG_KEYS", "MONITOR_STATS",
           "PARAM_KINDS", "STAT_NAMES", "check_logging", "check_options", "watched_parameters"]

KINDS = KIND_NAMES
DEFAULT_STATS = ("norm", "mean", "std", "absmax", "nonfinite")
#: The gradient noise scale and its two EMAs (:mod:`~gradtap._monitor.gns`).
GNS_STATS = ("gns", "gns_trace", "gns_sqnorm")
#: Statistics that are not moments of one tensor: kind ``grad_output``'s ``gain`` and the noise
#: scale (:mod:`~gradtap._monitor.health`).
HEALTH_STATS = ("gain", *GNS_STATS)
#: The statistics of one tensor's elements (moments, reduced by the step reducer).
STAT_NAMES = ops.STAT_NAMES
#: Every name ``stats=`` accepts (``zscore``: :mod:`~gradtap._monitor.spikes`).
MONITOR_STATS = (*ops.STAT_NAMES, *HEALTH_STATS, *DERIVED_STATS)
#: The kinds read from the parameters at ``step()``, with no hook.
PARAM_KINDS = ("param_grad", "param", "update", "grad_cosine")
#: What ``log_keys=`` takes: the summary of each logged step, or every row too.
LOG_KEYS = ("summary", "all")


def check_options(stats: Sequence[str], kinds: Sequence[str], *, ewma: float | None,
                  every: int, local_grads: bool, hist_bins: int | None, hist_scale: str,
                  hist_range: tuple[float, float] | None, hist_linthresh: float,
                  ) -> tuple[tuple[str, ...], tuple[str, ...], Tensor | None]:
    """``(stats, kinds, histogram bin edges or None)``, or a ``ValueError`` for a bad option."""
    stats = _check_stats(stats)
    kinds = _check_kinds(kinds)
    if "gain" in stats and "grad_output" not in kinds:
        raise ValueError("stat 'gain' is a statistic of kind 'grad_output' (|dL/d input| / "
                         "|dL/d output| of each module); add 'grad_output' to kinds")
    if ewma is not None and not (isinstance(ewma, (int, float)) and 0.0 <= ewma < 1.0):
        raise ValueError(f"ewma must be None or a factor beta with 0 <= beta < 1; got {ewma!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
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


def check_logging(log_to: object, log_every: int | None, log_keys: str, log_groups: object,
                  every: int) -> int:
    """The logging cadence (``log_every``, by default ``every``), or a ``ValueError`` for a
    logging option that is wrong alone or with the others (the trackers themselves are
    checked when they are resolved)."""
    if log_to is None:
        given = [f"{n}={v!r}" for n, v, d in (("log_every", log_every, None),
                                             ("log_keys", log_keys, "summary"),
                                             ("log_groups", log_groups, None)) if v != d]
        if given:
            raise ValueError(f"{', '.join(given)} without log_to=: say where to log (a "
                             "SummaryWriter, a wandb run, mlflow, a Lightning Logger, a callable)")
        return every
    if log_keys not in LOG_KEYS:
        raise ValueError(f"log_keys must be one of {', '.join(map(repr, LOG_KEYS))}; got "
                         f"{log_keys!r}")
    if log_every is None:
        return every
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"log_every must be a positive int; got {log_every!r}")
    if log_every % every:
        raise ValueError(f"log_every={log_every} must be a multiple of every={every}: only "
                         "computed steps can be logged")
    return log_every


def watched_parameters(model: nn.Module, select: Selector, kinds: Sequence[str], *,
                       gradients: bool, local_grads: bool, split: bool
                       ) -> tuple[list[tuple[str, nn.Parameter]], bool]:
    """``(selected (name, parameter) pairs, sharded)``: the parameters the Monitor reads (none
    when no kind, EWMA or noise scale needs them; ``gradients``: the EWMA or noise scale is
    on), and whether they are FSDP2 DTensors under a process group (every parameter kind is then
    taken from this rank's shards and reduced across ranks with the step's other statistics).

    Raises:
        SelectionError: the gradients are watched but no selected parameter requires grad.
        ValueError: ``local_grads`` under FSDP2 or with ``split``.
    """
    if not (set(kinds) & set(PARAM_KINDS) or gradients):
        return [], False
    params = [(clean_name(n), p) for n, p in select_parameters(model, select)]
    sharded = distributed.is_distributed() and any(distributed.is_dtensor(p) for _, p in params)
    if ({"param_grad", "grad_cosine"} & set(kinds) or gradients) and params and not any(
            p.requires_grad for _, p in params):
        names = [n for n, _ in params]
        raise SelectionError(
            f"select={select!r} matches only parameters that do not require grad "
            f"({', '.join(names[:5])}{' ...' if len(names) > 5 else ''}); they never get a "
            "gradient to monitor (kinds=('param',) watches their values)")
    if local_grads and sharded:
        raise ValueError("local_grads=True needs DDP: under FSDP2 (DTensor parameters) "
                         "p.grad is already reduce-scattered when gradtap can first read it")
    if split and local_grads:
        raise ValueError("split= slices the global gradient; it does not combine with "
                         "local_grads=True")
    return params, sharded


def _check_stats(stats: str | Iterable[str]) -> tuple[str, ...]:
    stats = (stats,) if isinstance(stats, str) else tuple(stats)
    unknown = [s for s in stats if s not in MONITOR_STATS]
    if unknown:
        raise ValueError(f"unknown stat name(s) {', '.join(map(repr, unknown))}; valid stats "
                         f"are: {', '.join(MONITOR_STATS)}")
    if len(set(stats)) != len(stats):
        raise ValueError(f"stats lists a name twice: {list(stats)}")
    return stats


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
