"""The grad scaler in the Monitor (``scaler=``): unscaled gradients, the step's scale and overflow.

Every statistic, histogram, EWMA and snapshot sees ``g / scale``: the Monitor divides each
parameter gradient by the factor the scaler left on it (none after ``scaler.unscale_``) and
activation gradients, always those of the scaled loss, by the step's scale, both with
capture's one formula (:meth:`~gradtap.capture.ScalerWatch.unscaled`). Each step also
stores, on name :data:`SCALER_NAME`, the step's scale and whether the scaler found an inf/NaN
(:func:`queue_amp`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from gradtap import _tensorops as ops
from gradtap import distributed
from gradtap.capture import ScalerWatch

__all__ = ["SCALER_NAME", "queue_amp"]

#: The name under which the grad scaler's statistics of a step are stored.
SCALER_NAME = "<scaler>"


def queue_amp(amp: ScalerWatch, grads: dict[str, Tensor], copy: ops.HostCopy,
              reduction: distributed.Reduction | None = None,
              counts: dict[str, bool] | None = None,
              ) -> tuple[Callable[[], np.ndarray], Callable[[], np.ndarray]]:
    """Queue the step's scale and its overflow flag (see ``scaler=``) on ``copy``.

    With ``reduction``, ``grads`` are shards: the count of non-finite elements is summed over
    the shards whose ``counts`` is true, and the scaler's own flag over ranks (set if any
    rank's is), in that reduction."""
    scale = amp.step_scale()
    if scale is None:
        scale = torch.ones((), dtype=torch.float32)
    found = amp.found_inf()
    flag = found is not None
    if found is None:
        # The scaler has not checked yet: count what it will find.
        found = torch.zeros((), dtype=torch.float32, device=scale.device)
        for n, g in grads.items():
            if reduction is None or (counts and counts.get(n)):
                found = found + (~torch.isfinite(g)).sum().to(found.device, torch.float32)
    else:
        found = (found > 0).to(torch.float32)
    hs = copy.add(scale.to(torch.float64))
    if reduction is not None:
        hr = reduction.add_sums(found.reshape(1), "amp")

        def found_host() -> np.ndarray:
            total = reduction.host_sums(hr)
            return (total > 0).astype(np.float64) if flag else total
    else:
        hf = copy.add(found.to(torch.float64))

        def found_host() -> np.ndarray:
            return copy.get(hf)

    return lambda: copy.get(hs), found_host
