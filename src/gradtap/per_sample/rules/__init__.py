"""Per-layer rules; importing this package registers every rule in ``per_sample.table``."""

from gradtap.per_sample.rules import attention, conv, embedding, linear, norm

__all__ = ["attention", "conv", "embedding", "linear", "norm"]
