"""Per-layer rules; importing this package registers every rule in ``_per_sample.table``."""

from gradtap._per_sample.rules import attention, conv, embedding, linear, norm

__all__ = ["attention", "conv", "embedding", "linear", "norm"]
