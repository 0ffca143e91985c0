"""Stateful, composable gradient transforms and ``transform``, which applies them to a model.

* :mod:`~gradtap._transform.base`    the ``Transform`` type, ``stateless`` and ``chain``
* :mod:`~gradtap._transform.library` the built-in transforms (``scale``, ``clip_norm``, ...)
* :mod:`~gradtap._transform.spike`   spike control from a tensor's norm history (``zclip``,
  ``adagc``, ``adagn``)
* :mod:`~gradtap._transform.unit_clip` spike control per output unit and element (``agc``,
  ``spam_clip``); :mod:`~gradtap._transform.spike_ops` what the spike rules share
* :mod:`~gradtap._transform.plan`    which rule applies to which parameter or module
* :mod:`~gradtap._transform.state`   the per-tensor states and their checkpoint form
* :mod:`~gradtap._transform.update`  a rule's transform run on gradients, its output checked
* :mod:`~gradtap._transform.apply`   one capture subscription per ``when`` / ``on``
* :mod:`~gradtap._transform.handle`  ``transform()`` and the ``TransformHandle`` composing them
"""

from gradtap._transform.base import Transform, chain, stateless
from gradtap._transform.handle import TransformHandle, transform
from gradtap._transform.library import (
    add_noise,
    centralize,
    clip_global_norm,
    clip_norm,
    clip_value,
    ewma,
    flip,
    normalize,
    scale,
    zero,
)
from gradtap._transform.spike import adagc, adagn, zclip
from gradtap._transform.unit_clip import agc, spam_clip

__all__ = [
    "Transform",
    "TransformHandle",
    "adagc",
    "adagn",
    "add_noise",
    "agc",
    "centralize",
    "chain",
    "clip_global_norm",
    "clip_norm",
    "clip_value",
    "ewma",
    "flip",
    "normalize",
    "scale",
    "spam_clip",
    "stateless",
    "transform",
    "zclip",
    "zero",
]
