"""Poisson sampling of batches: :func:`poisson_batches`, the batch sampler whose steps the
privacy accountant assumes (each example in each step independently with probability q)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from gradtap._privacy.checks import check_rate

__all__ = ["PoissonBatches", "epoch_steps", "poisson_batches"]


def epoch_steps(sample_rate: float) -> int:
    """The steps of one epoch of Poisson batches: ``floor(1 / sample_rate)`` (a quotient within
    1e-9 of a whole number counts as that number, so ``0.1`` gives 10), at least one. An epoch
    then holds ``sample_rate * n * steps <= n`` examples in expectation: the dataset once, as
    Opacus's ``UniformWithReplacementSampler`` counts an epoch."""
    return max(1, math.floor(1.0 / check_rate(sample_rate) + 1e-9))


class PoissonBatches:
    """A batch sampler of Poisson batches over ``range(n)``: made by :func:`poisson_batches`.

    Each iteration is one epoch of :func:`epoch_steps` steps (``len(batches)``); each step
    yields the list of indices, in increasing order, of the examples its draw included, each
    example independently with probability ``sample_rate``. An empty list is a step too.
    Steps draw ``n`` uniforms from ``generator`` (torch's default generator when ``None``), so
    a generator seeded alike gives the same batches, epoch after epoch.
    """

    def __init__(self, n: int, sample_rate: float,
                 generator: torch.Generator | None = None) -> None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n (the number of examples) must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"n (the number of examples) must be >= 0, got {n}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, "
                            f"got {type(generator).__name__}")
        if generator is not None and generator.device.type != "cpu":
            raise ValueError(f"generator must be a CPU torch.Generator (the draws are made "
                             f"on the host), got one on {generator.device}")
        self.n = n
        self.sample_rate = check_rate(sample_rate)
        self.generator = generator
        self.steps = epoch_steps(self.sample_rate)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            yield self.draw()

    def draw(self) -> list[int]:
        """One step's batch: each index of ``range(n)`` independently with probability
        ``sample_rate``."""
        if self.sample_rate == 1.0:
            return list(range(self.n))
        included = torch.rand(self.n, generator=self.generator) < self.sample_rate
        return included.nonzero().flatten().tolist()

    def collate(self, dataset: Any,
                collate_fn: Callable[[list[Any]], Any] | None = None) -> Callable[[list[Any]], Any]:
        """A ``collate_fn`` for the ``DataLoader`` that also collates an empty batch.

        A non-empty batch goes to ``collate_fn`` (``torch.utils.data.default_collate`` when
        ``None``). An empty one becomes what ``collate_fn([dataset[0]])`` gives with every
        tensor cut to zero rows (and every list or tuple of non-tensors emptied), so the
        training step sees a batch of size 0 of the right shapes and dtypes.
        """
        if len(dataset) != self.n:
            raise ValueError(f"the dataset has {len(dataset)} examples but the batches are "
                             f"drawn over n={self.n}")
        return _CollateWithEmpty(dataset, collate_fn)

    def __repr__(self) -> str:
        return f"PoissonBatches(n={self.n}, sample_rate={self.sample_rate}, steps={self.steps})"


class _CollateWithEmpty:
    """:meth:`PoissonBatches.collate`'s function: a class, so that it pickles (to the
    ``DataLoader``'s worker processes) whenever the dataset and ``collate_fn`` do."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __call__(self, batch: list[Any]) -> Any:
        inner = self.collate_fn or torch.utils.data.default_collate
        if batch:
            return inner(batch)
        if not len(self.dataset):
            raise ValueError("an empty batch of an empty dataset has no shapes to take: "
                             "collate it with a collate_fn of your own")
        return _empty_like(inner([self.dataset[0]]))


def _empty_like(value: Any) -> Any:
    """``value`` (one collated example) with every tensor cut to zero rows."""
    if isinstance(value, torch.Tensor):
        return value[:0] if value.dim() else value.new_empty((0,))
    if isinstance(value, Mapping):
        return type(value)({k: _empty_like(v) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_empty_like(v) for v in value))
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = [_empty_like(v) for v in value]
        if not any(isinstance(v, torch.Tensor) for v in value):
            items = []  # a list of non-tensor fields: one entry per example
        return type(value)(items) if isinstance(value, tuple) else items
    return value


def poisson_batches(n: int, sample_rate: float,
                    generator: torch.Generator | None = None) -> PoissonBatches:
    """A batch sampler of Poisson batches, for ``DataLoader(dataset, batch_sampler=...)``.

    Each step includes each of the ``n`` examples independently with probability
    ``sample_rate`` (so a batch holds ``sample_rate * n`` examples on average, and may be
    empty: an empty batch is a step too); an epoch is ``floor(1 / sample_rate)`` steps
    (``len()``). This is the sampling the privacy accountant of DP-SGD assumes. The draws
    come from ``generator`` (a CPU ``torch.Generator``; torch's default when ``None``): the
    same seed gives the same batches. ``batches.collate(dataset)`` is a ``collate_fn`` that
    also turns an empty batch into tensors of zero rows.

    >>> import torch, gradtap as gt
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> data = TensorDataset(torch.randn(100, 3), torch.arange(100))
    >>> batches = gt.poisson_batches(len(data), 0.1, generator=torch.Generator().manual_seed(0))
    >>> len(batches)
    10
    >>> loader = DataLoader(data, batch_sampler=batches, collate_fn=batches.collate(data))
    >>> sizes = [len(y) for x, y in loader]
    >>> len(sizes), all(0 <= s <= 100 for s in sizes)
    (10, True)
    """
    return PoissonBatches(n, sample_rate, generator)
