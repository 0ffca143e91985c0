"""Find where gradients break: the origin of NaN, Inf and gradient spikes, with dumps.

``gt.detect(model)`` screens every step cheaply (``_screen.Screen``: the model's outputs,
the gradients at its boundary and every parameter gradient; each selected call's outputs and
their gradients too with ``screen="modules"``), replays a step found non-finite
(``_replay.replay``) under a per-call watch of every selected call (``_watch.CallWatch``,
what ``replay=False`` uses every step), with ``spike=`` also a step whose parameter-gradient
norms spike (``_spikes.ParamSpikes``, read with the screen's check), and reports, per event, the innermost
module where a non-finite value first appeared (or the loss, as ``"<loss>"``), the slot,
NaN/Inf counts, the ranges of the module's forward tensors and parameters against their
dtype, and a hint. See :func:`detect`.

Layout: ``_detector`` (the Detector composing the parts below, and ``detect``), ``_options``
(detect's options checked), ``_screen`` (the light screen), ``_params`` (the parameter
gradients it reads), ``_localize`` (naming the origin by a replay), ``_replay`` (rerunning a
step), ``_watch`` (the per-call watch), ``_measure`` (what the watch measures), ``_spikes``
(the spike trackers), ``_messages`` (the report of each kind of anomaly), ``_anomaly`` (the
Anomaly type and report helpers), ``_culprits`` (with ``samples=True``, the samples behind
an anomaly, in the replay of its step), ``_ranks`` (what ranks tell each other of a step's
anomalies), ``_host`` (batched reductions and host copies), ``_dump`` (dump files).
"""

from __future__ import annotations

from gradtap._detect._anomaly import LOSS, Anomaly, AnomalyWarning
from gradtap._detect._detector import Detector, detect
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
