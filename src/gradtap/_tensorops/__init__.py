"""Tensor kernels shared by the consumers: host copy, norms, EWMA, moments, histograms.

Everything here works on plain tensors and knows nothing about modules or hooks.

* :mod:`~gradtap._tensorops.groups`     grouping by device and dtype, reusable work buffers
* :mod:`~gradtap._tensorops.host`       the one device-to-host copy per step
* :mod:`~gradtap._tensorops.l2`         L2 norms and accurate sums of squares, batched
* :mod:`~gradtap._tensorops.ewma`       the elementwise EWMA of mean and variance
* :mod:`~gradtap._tensorops.histograms` bin edges and batched bin counts (sampled above a size)
* :mod:`~gradtap._tensorops.moments`    typed per-tensor moments and their device kernels
* :mod:`~gradtap._tensorops.plan`       a reduction plan kept from step to step (``MomentPlan``)
* :mod:`~gradtap._tensorops.finish`     moments to statistics on the host
"""

from gradtap._tensorops.ewma import ewma_init, ewma_update_, ewma_update_finite_
from gradtap._tensorops.finish import (
    combine_parts,
    complete_fields,
    finish_stats,
    refine_fields,
    unreliable_m2,
)
from gradtap._tensorops.groups import Scratch, group_by_device_dtype
from gradtap._tensorops.histograms import HIST_SAMPLE, hist_edges, histogram_counts
from gradtap._tensorops.host import HostCopy, to_host
from gradtap._tensorops.l2 import group_norms, group_sumsq, norms
from gradtap._tensorops.moments import (
    MAX_FIELDS,
    STAT_NAMES,
    SUM_FIELDS,
    Centered,
    Moments,
    Needs,
    centered_moments,
    check_stats,
    host_moments,
    needs_for,
    tensor_moments,
)
from gradtap._tensorops.plan import MomentPlan

__all__ = [
    "HIST_SAMPLE",
    "MAX_FIELDS",
    "STAT_NAMES",
    "SUM_FIELDS",
    "Centered",
    "HostCopy",
    "MomentPlan",
    "Moments",
    "Needs",
    "Scratch",
    "centered_moments",
    "check_stats",
    "combine_parts",
    "complete_fields",
    "ewma_init",
    "ewma_update_",
    "ewma_update_finite_",
    "finish_stats",
    "group_by_device_dtype",
    "group_norms",
    "group_sumsq",
    "hist_edges",
    "histogram_counts",
    "host_moments",
    "needs_for",
    "norms",
    "refine_fields",
    "tensor_moments",
    "to_host",
    "unreliable_m2",
]
