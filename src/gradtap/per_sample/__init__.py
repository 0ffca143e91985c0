"""Per-sample gradients, their norms and batch statistics: :func:`per_sample`.

Per-layer rules live in ``per_sample.rules`` (one module per layer family) and are registered
in the tables of ``per_sample.table``; modules without a rule go through ``per_sample.fallback``.
"""

from gradtap.per_sample.api import PerSample, Quantity, per_sample

__all__ = ["PerSample", "Quantity", "per_sample"]
