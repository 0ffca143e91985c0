"""Histogram counts (exact up to HIST_SAMPLE elements, sampled above) and the CPU path of
kind grad_output, against plain numpy / float64 oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap import _tensorops as ops
from gradtap._tensorops import histograms as hist
from tests.test_tensorops import oracle, oracle_hist

SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0]


def positions_oracle(n: int, size: int) -> np.ndarray:
    """floor(frac(j * phi) * n) in Python floats, sorted."""
    phi = (math.sqrt(5.0) - 1.0) / 2.0
    return np.sort([math.floor(((j * phi) % 1.0) * n) for j in range(size)])


def tensor_with_specials(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(int(np.prod(shape))) * 10.0 ** rng.integers(-4, 2, int(np.prod(shape)))
    x[rng.choice(x.size, 5, replace=False)] = SPECIAL
    x[:3] = [-0.5, 0.0, 0.5]  # elements on edges of the linear bins below
    return torch.tensor(x.reshape(shape), dtype=dtype)


PATHS = {"cpu sort": hist._sorted_counts, "device": hist._device_counts, "loop": hist._loop_counts}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("scale", ["linear", "symlog"])
def test_every_path_counts_like_the_float64_oracle(path, dtype, scale):
    edges = ops.hist_edges(8, scale, (-1.0, 1.0) if scale == "linear" else (-10.0, 10.0))
    ts = [tensor_with_specials((40, 25), dtype, 0), tensor_with_specials((7,), dtype, 1)]
    acc = torch.promote_types(dtype, torch.float32)
    got = PATHS[path]([t.reshape(-1) for t in ts], edges, acc)
    for row, t in zip(got.numpy(), ts):
        np.testing.assert_array_equal(row, oracle_hist(t.double().numpy(), edges.numpy()))


def test_sample_positions_are_the_golden_ratio_sequence():
    for n, size in [(10, 4), (100_003, 1000), (2**31 + 5, 300)]:
        got = hist.sample_positions(n, size, torch.device("cpu"))
        np.testing.assert_array_equal(got.numpy(), positions_oracle(n, size))
        assert got.dtype == torch.int64 and int(got.max()) < n
    a = hist.sample_positions(5000, 64, torch.device("cpu"))
    assert a is hist.sample_positions(5000, 64, torch.device("cpu"))  # made once


def test_tensors_up_to_the_sample_size_are_exact_larger_ones_sampled_and_scaled():
    edges = ops.hist_edges(16)
    small = tensor_with_specials((hist.HIST_SAMPLE,), torch.float32, 2)
    big = tensor_with_specials((3, 50_000), torch.float32, 3).t()  # not contiguous
    got = ops.histogram_counts([small, big], edges).numpy()
    np.testing.assert_array_equal(got[0], oracle_hist(small.numpy(), edges.numpy()))
    flat = big.contiguous().reshape(-1).numpy()  # torch.take reads the logical order
    sample = flat[positions_oracle(flat.size, hist.HIST_SAMPLE)]
    want = np.round(oracle_hist(sample, edges.numpy()) * (flat.size / hist.HIST_SAMPLE))
    np.testing.assert_array_equal(got[1], want)
    exact = ops.histogram_counts([big], edges, sample=None).numpy()[0]
    np.testing.assert_array_equal(exact, oracle_hist(flat, edges.numpy()))
    # the same sample and scale whichever path counts it
    loop = ops.histogram_counts([small, big], edges, batched=False).numpy()
    np.testing.assert_array_equal(loop, got)


def test_a_sampled_histogram_estimates_the_exact_one():
    edges = ops.hist_edges(12, "linear", (-3.0, 3.0))
    g = torch.Generator().manual_seed(0)
    # a layout with structure along every dim: channels of different scales, a ramp in space
    x = (torch.randn(32, 16, 24, 24, generator=g) * torch.linspace(0.2, 2.0, 16).view(1, 16, 1, 1)
         + torch.linspace(-0.5, 0.5, 24).view(1, 1, 1, 24))
    exact = ops.histogram_counts([x], edges, sample=None)[0].numpy()
    est = ops.histogram_counts([x], edges)[0].numpy()
    assert abs(est.sum() - x.numel()) <= len(est) / 2  # each bin rounded
    share = exact / exact.sum()
    big = share > 0.02
    # HIST_SAMPLE samples: a bin holding a share p is off by about sqrt(p (1 - p) / HIST_SAMPLE)
    np.testing.assert_allclose(est[big] / exact.sum(), share[big],
                               atol=4 * np.sqrt(0.25 / hist.HIST_SAMPLE))


class Scaled(nn.Module):
    """Output gradient = the fixed tensor ``w`` (loss = sum(out * w))."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(1, n, dtype=torch.float64)

    def forward(self, x):
        return self.lin(x)


def test_grad_output_on_the_cpu_matches_float64_oracles_with_nan_and_a_dominant_mean():
    torch.manual_seed(0)
    model = Scaled(hist.HIST_SAMPLE + 4000)
    x = torch.ones(3, 1, dtype=torch.float64)
    rng = np.random.default_rng(4)
    ws = [1000.0 + 1e-3 * rng.standard_normal((3, model.lin.out_features)),  # mean >> std
          rng.standard_normal((3, model.lin.out_features))]
    ws[1][0, :4] = [math.nan, math.inf, 0.0, 0.0]
    ws[1][1, :50] = 0.0
    with gt.Monitor(model, select="lin", kinds=["grad_output"], stats=ops.STAT_NAMES,
                    hist_bins=10, hist_scale="linear", hist_range=(-2.0, 2.0)) as mon:
        for w in ws:
            (model(x) * torch.tensor(w)).sum().backward()
            mon.step()
    df = mon.frame()
    for step, w in enumerate(ws):
        want = oracle(w)
        for stat in ops.STAT_NAMES:
            got = float(df[(df.step == step) & (df.stat == stat)]["value"].iloc[0])
            if math.isnan(want[stat]):
                assert math.isnan(got), stat
            else:
                assert got == pytest.approx(want[stat], rel=1e-9, abs=1e-12), (step, stat)
    edges, counts = mon.histogram("lin:output", kind="grad_output")
    flat = ws[1].reshape(-1)
    sample = flat[positions_oracle(flat.size, hist.HIST_SAMPLE)]
    want = np.round(oracle_hist(sample, edges) * (flat.size / hist.HIST_SAMPLE))
    np.testing.assert_array_equal(counts[1], want)
    np.testing.assert_array_equal(counts[0], [0] * 9 + [flat.size])  # all above 2: the end bin
