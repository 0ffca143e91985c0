"""Differentially private training: DP-SGD (``dpsgd``, public as :func:`gradtap.dp_sgd`), on
the per-sample engine, and its parts that stand on their own: Poisson batches (``sampling``,
public as :func:`gradtap.poisson_batches`), the privacy accountant over ``dp-accounting``
(``accounting``) and the Gaussian noise of a step (``noise``); where people train: gradient
accumulation (``accumulate``), loss scaling (``amp``) and DDP (``distributed``)."""

from gradtap._privacy.dpsgd import DPSGD, dp_sgd
from gradtap._privacy.sampling import PoissonBatches, poisson_batches

__all__ = ["DPSGD", "PoissonBatches", "dp_sgd", "poisson_batches"]
