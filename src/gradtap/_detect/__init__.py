"""Find where gradients break: the origin of NaN, Inf and gradient spikes, with dumps.

``gt.detect(model)`` screens every step cheaply (``_replay.Screen``: the model's outputs,
the gradients at its boundary and every parameter gradient; each selected call's outputs and
their gradients too with ``screen="modules"``), replays a step found
non-finite under a watch of every call (``_core.Detector`` with ``replay=False``), and
reports, per event, the innermost module where a non-finite value first appeared (or the
loss, as ``"<loss>"``), the slot, NaN/Inf counts, the ranges of the module's forward tensors
and parameters against their dtype, and a hint. See :func:`detect`.
"""

from __future__ import annotations

from gradtap._detect._anomaly import LOSS, Anomaly, AnomalyWarning
from gradtap._detect._core import Detector, detect
from gradtap._detect._dump import DumpError, format_dump, inspect_main, load_dump

__all__ = [
    "LOSS",
    "Anomaly",
    "AnomalyWarning",
    "Detector",
    "DumpError",
    "detect",
    "format_dump",
    "inspect_main",
    "load_dump",
]
