"""Differentially private training's parts that stand on their own: Poisson batches
(``sampling``, public as :func:`gradtap.poisson_batches`), the privacy accountant over
``dp-accounting`` (``accounting``) and the Gaussian noise of a step (``noise``)."""

from gradtap._privacy.sampling import PoissonBatches, poisson_batches

__all__ = ["PoissonBatches", "poisson_batches"]
