"""gradtap: see, understand and shape the gradients flowing backward through a PyTorch model."""

from gradtap.errors import GradientAnomaly, GradtapError, SelectionError, UnsupportedModuleError

__version__ = "0.1.0"

__all__ = [
    "GradientAnomaly",
    "GradtapError",
    "SelectionError",
    "UnsupportedModuleError",
]
