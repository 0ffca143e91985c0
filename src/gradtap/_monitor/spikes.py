"""The Monitor's view of gradient spikes: stat ``zscore`` and stat ``clip_factor``.

* ``zscore`` (asked for in ``stats=``, kind ``param_grad``): each tensor's gradient norm
  against its own history, ``(norm - mean) / std`` with ``mean`` and ``std`` the
  exponentially weighted mean and standard deviation of the norms of the previous steps
  (factor ``beta``: the Monitor's ``ewma=``, else :data:`ZSCORE_BETA`). The first norm starts
  the history (``mean`` = that norm, variance 0); the score is NaN until two norms are in it,
  and a non-finite norm is scored (``inf``/NaN) but never enters the history.
* ``clip_factor`` (stored, never asked for): at every step a spike-control transform on the
  same model ran, the factor it multiplied each selected gradient by, as the transform
  publishes it through the model's session (topic ``"clip_factor"``), stored with the step
  whose gradient it scaled: a rule that runs inside ``optimizer.step()`` (``when="step"``)
  after the Monitor's step names its tensors under topic ``"clip_factor_pending"`` until it
  ran, and the Monitor keeps that step's rows until then (:func:`late_factor_names`).

Example:
    >>> import numpy as np
    >>> z = ZScores(beta=0.5)
    >>> [round(float(z(["w"], np.array([x]))[0]), 3) for x in (1.0, 3.0, 2.0, 20.0)]
    [nan, nan, 0.0, 25.456]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from gradtap import _tensorops as ops
from gradtap.capture import Session

__all__ = ["DERIVED_STATS", "ZSCORE_BETA", "ZScores", "late_factor_names", "queue_clip_factors"]

#: Stats the Monitor derives from others on the host (not moments of a tensor).
DERIVED_STATS = ("zscore",)
#: The EWMA factor of ``zscore`` when the Monitor has no ``ewma=`` (ZClip's default ``alpha``).
ZSCORE_BETA = 0.97


class ZScores:
    """Each name's score against the exponentially weighted moments of its previous values."""

    def __init__(self, beta: float) -> None:
        self.beta = float(beta)
        self._mean: dict[str, float] = {}
        self._var: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def __call__(self, names: Sequence[str], values: np.ndarray) -> np.ndarray:
        """Score this step's ``values`` (one per name), then take the finite ones in."""
        out = np.full(len(names), np.nan)
        b = self.beta
        for i, (name, x) in enumerate(zip(names, values.tolist(), strict=True)):
            count = self._count.get(name, 0)
            if count >= 2:
                dev = x - self._mean[name]
                std = math.sqrt(self._var[name])
                if std > 0 or math.isnan(dev):
                    out[i] = dev / std if std > 0 else math.nan
                else:  # a flat history: any change is infinitely far from it
                    out[i] = 0.0 if dev == 0 else math.copysign(math.inf, dev)
            if not math.isfinite(x):
                continue  # a spike's NaN/Inf never enters the history
            if count == 0:
                self._mean[name], self._var[name] = x, 0.0
            else:  # the exponentially weighted mean and variance (West, 1979)
                dev = x - self._mean[name]
                self._mean[name] += (1 - b) * dev
                self._var[name] = b * (self._var[name] + (1 - b) * dev * dev)
            self._count[name] = count + 1
        return out


def queue_clip_factors(session: Session, names: Sequence[str], copy: ops.HostCopy
                       ) -> tuple[list[str], Callable[[], np.ndarray]] | None:
    """Queue, on ``copy``, the factors the spike rules on ``session``'s model published for
    ``names`` at their last run (not those still to come, :func:`late_factor_names`);
    ``None`` when no rule published any of them."""
    factors = session.published("clip_factor")
    late = session.published("clip_factor_pending")
    picked = [n for n in names if n in factors and n not in late]
    if not picked:
        return None
    device = factors[picked[0]].device
    stacked = torch.stack([factors[n].detach().to(device, torch.float64).reshape(())
                           for n in picked])
    handle = copy.add(stacked)
    return picked, lambda: copy.get(handle)


def late_factor_names(session: Session, names: Sequence[str]) -> list[str]:
    """Those of ``names`` whose factor for the current gradient a rule has yet to apply
    (it runs inside the coming ``optimizer.step()``)."""
    late = session.published("clip_factor_pending")
    return [n for n in names if n in late] if late else []
