"""gt.poisson_batches: each example in each step independently with probability q, checked
statistically; empty batches reach the training loop through a DataLoader; seeded draws repeat.

Each statistical check, run on a correct sampler with a random seed, fails with probability
at most 1e-6 (its threshold is that two-sided tail of a binomial's normal approximation or of
the chi-square distribution); the seed is fixed, so the test itself is deterministic."""

from __future__ import annotations

import math
import pickle
from collections import namedtuple

import numpy as np
import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader, Dataset, TensorDataset

import gradtap as gt

P_FAIL = 1e-6
Z = stats.norm.isf(P_FAIL / 2)  # two-sided


def _indicators(n: int, q: float, epochs: int, seed: int) -> np.ndarray:
    """The (steps, n) 0/1 matrix of who was in each step's batch."""
    batches = gt.poisson_batches(n, q, generator=torch.Generator().manual_seed(seed))
    rows = []
    for _ in range(epochs):
        for batch in batches:
            row = np.zeros(n, dtype=np.int64)
            row[batch] = 1
            rows.append(row)
    return np.stack(rows)


def _binomial_z(successes: int, trials: int, p: float) -> float:
    return (successes - trials * p) / math.sqrt(trials * p * (1 - p))


@pytest.fixture(scope="module")
def draws() -> tuple[np.ndarray, float]:
    q = 0.05
    return _indicators(400, q, epochs=150, seed=0), q  # 3000 steps


def test_inclusion_frequencies_match_the_sample_rate(draws):
    m, q = draws
    steps, n = m.shape
    assert abs(_binomial_z(int(m.sum()), steps * n, q)) < Z
    # each example's count of steps ~ Binomial(steps, q), independent across examples
    counts = m.sum(axis=0)
    chi2 = float(((counts - steps * q) ** 2).sum() / (steps * q * (1 - q)))
    assert stats.chi2.sf(chi2, df=n) > P_FAIL / 2 and stats.chi2.cdf(chi2, df=n) > P_FAIL / 2


def test_examples_and_steps_are_independent(draws):
    m, q = draws
    steps, n = m.shape
    # two distinct examples together in one step: q^2 (disjoint pairs, so the count is binomial)
    both = int((m[:, 0::2] & m[:, 1::2]).sum())
    assert abs(_binomial_z(both, steps * (n // 2), q * q)) < Z
    # one example in two steps: q^2
    both = int((m[0::2] & m[1::2]).sum())
    assert abs(_binomial_z(both, (steps // 2) * n, q * q)) < Z
    # batch sizes ~ Binomial(n, q): their spread is that of independent draws
    sizes = m.sum(axis=1)
    chi2 = float(((sizes - n * q) ** 2).sum() / (n * q * (1 - q)))
    assert stats.chi2.sf(chi2, df=steps) > P_FAIL / 2
    assert stats.chi2.cdf(chi2, df=steps) > P_FAIL / 2


def test_an_epoch_is_floor_of_one_over_the_rate():
    for q, steps in [(1.0, 1), (0.7, 1), (0.5, 2), (1 / 3, 3), (0.3, 3), (0.1, 10),
                     (0.01, 100), (0.04, 25), (1 / 49, 49)]:
        batches = gt.poisson_batches(10, q)
        assert len(batches) == steps == len(list(batches)), q
    assert list(gt.poisson_batches(5, 1.0)) == [[0, 1, 2, 3, 4]]
    assert list(gt.poisson_batches(0, 0.5)) == [[], []]


def test_seeded_draws_repeat_and_each_epoch_is_fresh():
    def epochs(seed: int, count: int = 3) -> list[list[list[int]]]:
        batches = gt.poisson_batches(50, 0.2, generator=torch.Generator().manual_seed(seed))
        return [list(batches) for _ in range(count)]

    first = epochs(1)
    assert first == epochs(1)
    assert first[0] != first[1] != first[2]
    assert first != epochs(2)
    for epoch in first:
        for batch in epoch:
            assert batch == sorted(set(batch)) and all(0 <= i < 50 for i in batch)
    torch.manual_seed(3)
    unseeded = list(gt.poisson_batches(50, 0.2))
    torch.manual_seed(3)
    assert list(gt.poisson_batches(50, 0.2)) == unseeded  # torch's default generator


def test_a_dataloader_yields_the_empty_batches_as_steps():
    x, y = torch.randn(20, 3, dtype=torch.float64), torch.arange(20)
    data = TensorDataset(x, y)
    batches = gt.poisson_batches(len(data), 0.02, generator=torch.Generator().manual_seed(0))
    expected = list(gt.poisson_batches(20, 0.02, generator=torch.Generator().manual_seed(0)))
    loader = DataLoader(data, batch_sampler=batches, collate_fn=batches.collate(data))
    assert len(loader) == 50
    got = list(loader)
    assert len(got) == 50
    assert sum(1 for b in expected if not b) >= 10  # the case this test is about
    for (bx, by), idx in zip(got, expected, strict=True):
        assert by.tolist() == idx
        assert bx.shape == (len(idx), 3) and bx.dtype == torch.float64
        torch.testing.assert_close(bx, x[idx], rtol=0, atol=0)
        assert by.dtype == torch.int64


class _Records(Dataset):
    Pair = namedtuple("Pair", "a b")

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict:
        return {"image": torch.full((2, 2), float(i)), "label": i, "name": f"n{i}",
                "pair": self.Pair(torch.tensor([i, i]), 0.5)}


def test_an_empty_batch_keeps_every_field_with_zero_rows():
    data = _Records()
    batches = gt.poisson_batches(len(data), 0.5)
    collate = batches.collate(data)
    empty = collate([])
    assert empty["image"].shape == (0, 2, 2) and empty["image"].dtype == torch.float32
    assert empty["label"].shape == (0,) and empty["label"].dtype == torch.int64
    assert empty["name"] == []
    assert isinstance(empty["pair"], _Records.Pair)
    assert empty["pair"].a.shape == (0, 2) and empty["pair"].b.shape == (0,)
    full = collate([data[1], data[4]])
    assert full["label"].tolist() == [1, 4] and full["name"] == ["n1", "n4"]
    own = batches.collate(data, collate_fn=lambda items: [d["label"] for d in items])
    assert own([data[2]]) == [2] and own([]) == []
    # a DataLoader's worker processes get the collate_fn pickled
    tensors = TensorDataset(torch.arange(6.0))
    copy = pickle.loads(pickle.dumps(gt.poisson_batches(6, 0.5).collate(tensors)))
    assert copy([])[0].shape == (0,) and copy([tensors[2]])[0].tolist() == [2.0]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"n \(the number of examples\) must be >= 0, got -1"):
        gt.poisson_batches(-1, 0.1)
    with pytest.raises(TypeError, match="n .* must be an int, got float"):
        gt.poisson_batches(10.0, 0.1)  # type: ignore[arg-type]
    for q in (0, 0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"sample_rate .* must be in \(0, 1\]"):
            gt.poisson_batches(10, q)
    with pytest.raises(TypeError, match="sample_rate .* must be a number, got bool"):
        gt.poisson_batches(10, True)
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int"):
        gt.poisson_batches(10, 0.5, generator=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the dataset has 4 examples but .* n=10"):
        gt.poisson_batches(10, 0.5).collate(TensorDataset(torch.zeros(4)))
