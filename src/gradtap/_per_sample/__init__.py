"""Per-sample gradients, their norms and batch statistics: :func:`per_sample`.

``api`` holds the verb; the engine behind it (:class:`PerSample`, the per-layer rules, the
``torch.func`` fallback) is :mod:`gradtap._samples`, which other consumers share.
"""

from gradtap._per_sample.api import PerSample, Quantity, per_sample

__all__ = ["PerSample", "Quantity", "per_sample"]
