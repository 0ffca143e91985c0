"""Stateful, composable gradient transforms and the driver that applies them to a model."""

from gradtap._transform.base import Transform, chain, stateless
from gradtap._transform.driver import TransformHandle, transform
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
