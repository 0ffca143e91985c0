"""Stateful, composable gradient transforms and ``transform``, which applies them to a model.

* :mod:`~gradtap._transform.base`    the ``Transform`` type, ``stateless`` and ``chain``
* :mod:`~gradtap._transform.library` the built-in transforms (``scale``, ``clip_norm``, ...)
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

__all__ = [
    "Transform",
    "TransformHandle",
    "add_noise",
    "centralize",
    "chain",
    "clip_global_norm",
    "clip_norm",
    "clip_value",
    "ewma",
    "flip",
    "normalize",
    "scale",
    "stateless",
    "transform",
    "zero",
]
