"""The one door to autograd: every hook gradtap installs, and all consumers need from autograd.

Consumers (Monitor, transform, per_sample, detect, explain) never touch autograd themselves;
they use these names:

* :func:`session` / :class:`Session`: the model's environment resolved once for every
  consumer (root and clean names, selection, distributed mode, the scaler's one watch);
  :mod:`~gradtap.capture.modhooks` gives each module one forward pre-hook and one forward
  hook however many consumers listen;

* :func:`tap` / :class:`Tap` with a :class:`Listener`: per-call records, forward calls and
  gradient rewrites (``taps.py``, with the per-call machinery in ``forward.py``,
  ``backward.py``, ``state.py``, ``graph.py``, ``boundary.py``, ``naming.py``);
* :class:`HookSet`: events not tied to a module call (a gradient accumulated, the end of a
  backward that accumulated, an optimizer step, a call of a module, a tensor's gradient);
* :mod:`~gradtap.capture.engine`: :func:`current_backward`, :func:`at_end_of_backward`,
  :class:`OncePerBackward`;
* :mod:`~gradtap.capture.replay`: :func:`replaying` a step for one listener (what others see
  then is defined there), :func:`in_recomputation`; and the replay kit, what a replayed call
  or step needs besides its arguments: :class:`AutocastState` (of every device in
  :data:`AUTOCAST_DEVICES`), :class:`RngState`, :func:`buffers_restored`;
* :mod:`~gradtap.capture.saved`: :func:`graph_nodes` and :func:`saved_tensors`, to read
  forward tensors back from the graph for a report;
* :class:`Clip` (``HookSet.around_any_clip``): a script's ``clip_grad_norm_`` /
  ``clip_grad_value_`` seen around its call, the gradients before it (``clipping.py``);
* :class:`ScalerWatch` (``HookSet.grad_scaler``): the factor a ``GradScaler`` left on each
  gradient of this step, and whether it found an inf/NaN (``amp.py``);
* :func:`compiled_feature`: which feature a tap on a compiled model serves, for the one
  warning saying that it runs eagerly; :func:`run_eagerly` for module hooks made without a
  tap; :func:`compiled_parts`: the compiled code that would hide given modules
  (``compiled.py``);
* :func:`sequence_mark` and :func:`made_since`: whether a tensor was made after a point;
* :func:`mark_boundary`: a node on a tensor that sees only the gradient of its later uses;
* :func:`argument_tensors`: a call's tensor arguments named as the records name them;
  :func:`legacy_backward_grads` for ``explain(legacy=True)``.
"""

from __future__ import annotations

from gradtap.capture.amp import ScalerWatch, check_scaler, unscale
from gradtap.capture.boundary import mark_boundary
from gradtap.capture.clipping import Clip
from gradtap.capture.compiled import compiled_feature, compiled_parts, run_eagerly
from gradtap.capture.engine import OncePerBackward, at_end_of_backward, current_backward
from gradtap.capture.graph import made_since, sequence_mark
from gradtap.capture.hookset import HookSet
from gradtap.capture.legacy import legacy_backward_grads
from gradtap.capture.listener import Listener
from gradtap.capture.naming import argument_tensors
from gradtap.capture.replay import (
    AUTOCAST_DEVICES,
    AutocastState,
    RngState,
    buffers_restored,
    in_recomputation,
    replaying,
)
from gradtap.capture.saved import graph_nodes, saved_tensors
from gradtap.capture.sessions import Distributed, Session, session
from gradtap.capture.taps import Tap, tap

__all__ = [
    "AUTOCAST_DEVICES",
    "AutocastState",
    "Clip",
    "Distributed",
    "HookSet",
    "Listener",
    "OncePerBackward",
    "RngState",
    "ScalerWatch",
    "Session",
    "Tap",
    "argument_tensors",
    "at_end_of_backward",
    "buffers_restored",
    "check_scaler",
    "compiled_feature",
    "compiled_parts",
    "current_backward",
    "graph_nodes",
    "in_recomputation",
    "legacy_backward_grads",
    "made_since",
    "mark_boundary",
    "replaying",
    "run_eagerly",
    "saved_tensors",
    "sequence_mark",
    "session",
    "tap",
    "unscale",
]
