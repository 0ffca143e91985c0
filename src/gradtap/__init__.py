"""gradtap: see, understand and shape the gradients flowing backward through a PyTorch model."""

from gradtap import functional
from gradtap._detect import Anomaly, Detector, detect, load_dump
from gradtap._explain import Explanation, explain
from gradtap._monitor import Monitor
from gradtap._monitor.run_spikes import Spike
from gradtap._per_sample import PerSample, per_sample
from gradtap._privacy import dp_sgd, poisson_batches
from gradtap._transform import (
    Transform,
    TransformHandle,
    adagc,
    adagn,
    add_noise,
    agc,
    centralize,
    chain,
    clip_global_norm,
    clip_norm,
    clip_value,
    ewma,
    flip,
    normalize,
    scale,
    spam_clip,
    stateless,
    transform,
    zclip,
    zero,
)
from gradtap._version import __version__ as __version__
from gradtap.capture import Tap, tap
from gradtap.curvature import hessian_trace, hvp, top_eigenvalue
from gradtap.errors import (
    GradientAnomaly,
    GradtapError,
    SelectionError,
    StoreError,
    UnsupportedModuleError,
)
from gradtap.export import to_tensorboard
from gradtap.functional.explicit import explicit_conv
from gradtap.record import GradRecord
from gradtap.select import select_modules, select_parameters
from gradtap.store import Run, open_run

__all__ = [
    "Anomaly",
    "Detector",
    "Explanation",
    "GradRecord",
    "GradientAnomaly",
    "GradtapError",
    "Monitor",
    "PerSample",
    "Run",
    "SelectionError",
    "Spike",
    "StoreError",
    "Tap",
    "Transform",
    "TransformHandle",
    "UnsupportedModuleError",
    "adagc",
    "adagn",
    "add_noise",
    "agc",
    "centralize",
    "chain",
    "clip_global_norm",
    "clip_norm",
    "clip_value",
    "detect",
    "dp_sgd",
    "ewma",
    "explain",
    "explicit_conv",
    "flip",
    "functional",
    "hessian_trace",
    "hvp",
    "load_dump",
    "normalize",
    "open_run",
    "per_sample",
    "poisson_batches",
    "scale",
    "select_modules",
    "select_parameters",
    "spam_clip",
    "stateless",
    "tap",
    "to_tensorboard",
    "top_eigenvalue",
    "transform",
    "zclip",
    "zero",
]
