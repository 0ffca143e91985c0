"""Per-sample gradients, their norms and batch statistics: :func:`per_sample`.

Per-layer rules live in ``_per_sample.rules`` (one module per layer family) and are registered
in the tables of ``_per_sample.table``; modules without a rule go through ``_per_sample.fallback``.
"""

from gradtap._per_sample.api import PerSample, Quantity, per_sample

__all__ = ["PerSample", "Quantity", "per_sample"]
