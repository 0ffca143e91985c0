"""Batched statistics of _tensorops against a naive float64 numpy oracle and the loop fallback.

Tolerances: float64 tensors rtol 1e-9, float32 rtol 2e-5 (bf16/fp16 2e-2). ``mean`` and ``std``
are compared with an absolute slack of rtol * max|x| as well, since their error is a rounding
of the elements' scale (a mean that cancels to ~0 has no relative accuracy in any precision).
NaN must match NaN and Inf must match Inf exactly; counts must match exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradtap import _tensorops as ops

ALL_STATS = ops.STAT_NAMES


# -- the oracle: the definitions of docs/semantics.md, written naively in float64 -------------


def oracle(x: np.ndarray) -> dict[str, float]:
    """Every statistic of one tensor, a plain float64 loop over its elements."""
    v = [float(e) for e in np.asarray(x, dtype=np.float64).reshape(-1)]
    n = len(v)
    total = 0.0
    for e in v:
        total += e
    mean = total / n
    sq = 0.0
    dev = 0.0
    for e in v:
        sq += e * e
        dev += (e - mean) ** 2
    has_nan = any(math.isnan(e) for e in v)
    return {
        "norm": math.sqrt(sq),
        "mean": mean,
        "std": math.sqrt(dev / n),
        "absmax": math.nan if has_nan else max(abs(e) for e in v),
        "min": math.nan if has_nan else min(v),
        "max": math.nan if has_nan else max(v),
        "nonfinite": float(sum(1 for e in v if not math.isfinite(e))),
        "zero_frac": sum(1 for e in v if e == 0) / n,
        "rms": math.sqrt(sq / n),
    }


def oracle_hist(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Counts of finite elements per bin [edges[i], edges[i+1]); outliers go to the end bins."""
    counts = np.zeros(len(edges) - 1, dtype=np.int64)
    for e in np.asarray(x, dtype=np.float64).reshape(-1):
        if not math.isfinite(e):
            continue
        i = 0
        while i < len(counts) - 1 and e >= edges[i + 1]:
            i += 1
        counts[i] += 1
    return counts


def assert_stat_close(actual: float, expected: float, what: str, scale: float, rtol: float) -> None:
    """NaN matches NaN, Inf matches Inf, finite values within rtol * (|expected| + scale)."""
    if math.isnan(expected) or math.isinf(expected):
        assert (math.isnan(actual) and math.isnan(expected)) or actual == expected, (
            f"{what}: {actual} != {expected}"
        )
        return
    assert math.isfinite(actual), f"{what}: {actual} != {expected}"
    assert abs(actual - expected) <= rtol * (abs(expected) + scale), (
        f"{what}: {actual} != {expected}"
    )


def compute(tensors, stats, *, batched=True, exact=False, edges=None, exact_m2=False):
    """Run the Monitor's pipeline: device moments, one host copy, lazy fixes, finish."""
    needs = ops.needs_for(stats, exact_nonfinite=exact)
    groups = ops.tensor_moments(tensors, needs, edges=edges, batched=batched,
                                exact_m2=exact_m2 or not batched)
    count = np.array([t.numel() for t in tensors], dtype=np.float64)
    copy = ops.HostCopy()
    gather = ops.host_moments(groups, len(tensors), copy)
    copy.run()
    raw = gather()
    if batched:
        fields, _ = ops.complete_fields(tensors, count, raw, needs)
    else:  # the reference: every count and every m2 the plain way
        if needs.lazy_nonfinite:
            raw["nonfinite"] = np.array([float((~torch.isfinite(t)).sum()) for t in tensors])
        fields = ops.refine_fields(count, raw)
    return ops.finish_stats(count, fields, stats), fields


# -- strategies ------------------------------------------------------------------------------

SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0])


@st.composite
def tensor_values(draw, dtype=None):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    n = math.prod(shape)
    style = draw(st.sampled_from(["normal", "offset", "constant", "special"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    scale = 10.0 ** draw(st.integers(-6, 3))
    if style == "constant":
        # float32 squares underflow below ~1e-19: gradients that small are out of scope
        value = draw(st.floats(-1e3, 1e3).filter(lambda v: v == 0 or abs(v) > 1e-12))
        x = np.full(n, value)
    else:
        x = rng.standard_normal(n) * scale
        if style == "offset":  # mean >> std: where a sumsq formula cancels catastrophically
            x = x * 1e-3 + scale
        if style == "special":
            k = draw(st.integers(1, n))
            x[rng.choice(n, size=k, replace=False)] = [draw(SPECIAL) for _ in range(k)]
    dtype = dtype or draw(st.sampled_from([torch.float32, torch.float64]))
    return torch.tensor(x.reshape(shape), dtype=dtype)


def rtol_for(t: torch.Tensor) -> float:
    return {torch.float64: 1e-9, torch.float32: 2e-5}.get(t.dtype, 2e-2)


def data_scale(x) -> float:
    """max |x| over the finite elements (0 if none)."""
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    a = a[np.isfinite(a)]
    return float(np.abs(a).max()) if a.size else 0.0


def slack(stat: str, x) -> float:
    """The absolute part of the tolerance: the data's scale for mean and std, else 0."""
    return data_scale(x) if stat in ("mean", "std") else 0.0


def check_against_oracle(tensors, stats, result) -> None:
    for i, t in enumerate(tensors):
        x = t.double().numpy()
        expected = oracle(x)
        for stat in stats:
            assert_stat_close(float(result[stat][i]), expected[stat], f"{stat} of tensor {i} "
                              f"{t.dtype}", slack(stat, x), rtol_for(t))


# -- tests -----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    tensors=st.lists(tensor_values(), min_size=1, max_size=4),
    stats=st.lists(st.sampled_from(ALL_STATS), min_size=1, max_size=8, unique=True),
    exact=st.booleans(),
)
def test_stats_match_float64_oracle(tensors, stats, exact):
    result, _ = compute(tensors, stats, exact=exact)
    check_against_oracle(tensors, stats, result)


def test_std_of_constant_and_offset_tensors_is_exact():
    # A sumsq - n*mean**2 formula in float32 gets these wrong by orders of magnitude.
    ones = torch.ones(1000)
    offset = 1000.0 + torch.linspace(-1e-3, 1e-3, 1001)
    result, _ = compute([ones, offset], ("std", "norm", "mean"))
    assert result["std"][0] == 0.0
    expected = oracle(offset.double().numpy())
    assert abs(result["std"][1] - expected["std"]) < 1e-3 * expected["std"]
    assert abs(result["norm"][1] - expected["norm"]) < 1e-6 * expected["norm"]


@settings(max_examples=40, deadline=None)
@given(
    tensors=st.lists(tensor_values(), min_size=1, max_size=5),
    exact=st.booleans(),
    bins=st.integers(1, 9),
    scale=st.sampled_from(["linear", "symlog"]),
)
def test_batched_path_agrees_with_loop_fallback(tensors, exact, bins, scale):
    edges = ops.hist_edges(
        bins, scale, (-2.0, 2.0) if scale == "linear" else (-100.0, 100.0), linthresh=1e-3
    )
    fast, fast_fields = compute(tensors, ALL_STATS, batched=True, exact=exact, edges=edges)
    slow, slow_fields = compute(tensors, ALL_STATS, batched=False, exact=exact, edges=edges)
    np.testing.assert_array_equal(fast_fields["hist"], slow_fields["hist"])
    for stat in ALL_STATS:
        for i, t in enumerate(tensors):
            assert_stat_close(
                float(fast[stat][i]),
                float(slow[stat][i]),
                f"{stat}[{i}]",
                slack(stat, t.double().numpy()),
                rtol_for(t),
            )


@settings(max_examples=30, deadline=None)
@given(t=tensor_values(), bins=st.integers(1, 12), scale=st.sampled_from(["linear", "symlog"]))
def test_histogram_matches_oracle(t, bins, scale):
    edges = ops.hist_edges(bins, scale, (-1.5, 0.5) if scale == "linear" else (-50.0, 50.0))
    _, fields = compute([t], ("norm",), edges=edges)
    np.testing.assert_array_equal(fields["hist"][0], oracle_hist(t.double().numpy(), edges.numpy()))


def test_histogram_bins_elements_on_edges_like_float64():
    edges = ops.hist_edges(4, "linear", (-1.0, 1.0))
    x = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0, 7.0, -7.0, math.nan, math.inf])
    _, fields = compute([x], ("norm",), edges=edges)
    np.testing.assert_array_equal(fields["hist"][0], oracle_hist(x.numpy(), edges.numpy()))
    assert fields["hist"][0].sum() == 7  # NaN and Inf are left to `nonfinite`


def test_hist_edges_shapes_and_symmetry():
    lin = ops.hist_edges(10, "linear", (-1.0, 3.0))
    assert lin.shape == (11,) and lin[0] == -1 and lin[-1] == 3
    sym = ops.hist_edges(8, "symlog", (-10.0, 10.0), linthresh=1e-6)
    assert torch.equal(sym, -sym.flip(0)) and sym[4] == 0
    u = torch.sign(sym) * torch.log10(1 + sym.abs() / 1e-6)  # equal steps in symlog space
    steps = u[1:] - u[:-1]
    assert torch.allclose(steps, steps[0].expand_as(steps), rtol=1e-5)
    assert torch.equal(sym.float().double(), sym)  # exactly representable in float32


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bins": 0}, "hist_bins must be a positive int"),
        ({"bins": 4, "scale": "log"}, "hist_scale must be 'linear' or 'symlog'"),
        ({"bins": 4, "range": (1.0, 1.0)}, "lo < hi"),
        ({"bins": 4, "linthresh": 0.0}, "hist_linthresh must be a positive"),
    ],
)
def test_hist_edges_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.hist_edges(**kwargs)


@settings(max_examples=40, deadline=None)
@given(t=tensor_values(dtype=torch.float64), cuts=st.lists(st.integers(0, 10**6), max_size=3))
def test_combining_parts_equals_stats_of_the_whole(t, cuts):
    flat = t.reshape(-1)
    points = sorted({0, flat.numel(), *[c % (flat.numel() + 1) for c in cuts]})
    parts = [flat[a:b] for a, b in zip(points, points[1:]) if b > a]
    needs = ops.needs_for(ALL_STATS, exact_nonfinite=True)
    edges = ops.hist_edges(5, "linear", (-1.0, 1.0))
    count = np.array([p.numel() for p in parts], dtype=np.float64)
    copy = ops.HostCopy()
    groups = ops.tensor_moments(parts, needs, edges=edges, exact_m2=True)
    gather = ops.host_moments(groups, len(parts), copy)
    copy.run()
    fields = ops.refine_fields(count, gather())
    total, fields = ops.combine_parts(count, fields, np.zeros(len(parts), dtype=np.int64), 1)
    result = ops.finish_stats(total, fields, ALL_STATS)
    check_against_oracle([t], ALL_STATS, result)
    np.testing.assert_array_equal(fields["hist"][0], oracle_hist(t.numpy(), edges.numpy()))


def test_large_tensors_keep_float64_accuracy():
    # torch's CPU norm kernel alone is off by ~1e-4 here; blocked sums keep ~1e-8.
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2_000_003, generator=g) + 0.3, torch.randn(3000, 1500, generator=g)]
    result, _ = compute(tensors, ("norm", "mean", "std"))
    for i, t in enumerate(tensors):
        x = t.double()
        np.testing.assert_allclose(result["norm"][i], float(x.norm()), rtol=1e-6)
        np.testing.assert_allclose(result["std"][i], float(x.std(correction=0)), rtol=1e-6)
        np.testing.assert_allclose(result["mean"][i], float(x.mean()), rtol=1e-5)


@pytest.mark.parametrize("share", [0.5, 0.85, 0.985, 0.999])
def test_long_tensors_keep_float32_accuracy_at_any_mean_share(share):
    # A single float32 pass gives sumsq of 2**18 elements to ~2e-6; at a 98.5% mean share
    # that error becomes ~7e-5 of the std, which the blocked sums and the two-pass m2 avoid.
    g = torch.Generator().manual_seed(3)
    n = 1 << 18
    z = torch.randn(n, generator=g, dtype=torch.float64)
    z = (z - z.mean()) / z.std(correction=0)
    x = (z * math.sqrt(1 - share) + math.sqrt(share)).float()
    tensors = [x, x[: 7 * 37_000].reshape(-1, 7).clone(), x[:5000].clone()]
    result, _ = compute(tensors, ("norm", "mean", "std"))
    check_against_oracle(tensors, ("norm", "mean", "std"), result)
    for i, t in enumerate(tensors):
        # tighter than the documented tolerance, which adds a slack of 2e-5 * max|x|
        np.testing.assert_allclose(result["std"][i], float(t.double().std(correction=0)),
                                   rtol=2e-5)


def test_dominant_mean_rows_get_the_two_pass_m2():
    g = torch.Generator().manual_seed(2)
    t = [torch.randn(5000, generator=g) * 1e-4 + 7.0, torch.randn(5000, generator=g)]
    needs = ops.needs_for(["std"])
    count = np.array([5000.0, 5000.0])
    copy = ops.HostCopy()
    gather = ops.host_moments(ops.tensor_moments(t, needs), 2, copy)
    copy.run()
    raw = gather()
    np.testing.assert_array_equal(ops.unreliable_m2(count, raw), [0])
    fields, unreliable = ops.complete_fields(t, count, raw, needs)
    np.testing.assert_array_equal(unreliable, [0])
    std = ops.finish_stats(count, fields, ["std"])["std"]
    for i in range(2):
        assert abs(std[i] - float(t[i].double().std(correction=0))) < 1e-5 * std[i]
    # precomputed two-pass rows are used as given, with no second pass
    exact_groups = ops.centered_moments([t[0]])
    copy = ops.HostCopy()
    eg = ops.host_moments(exact_groups, 1, copy)
    copy.run()
    fields2, _ = ops.complete_fields(t, count, raw, needs, exact=(np.array([0]), eg()))
    np.testing.assert_allclose(fields2["m2"], fields["m2"], rtol=1e-12)


def test_low_precision_and_mixed_dtypes_are_grouped():
    g = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(50, generator=g).to(dt)
        for dt in (torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.bfloat16)
    ]
    groups = ops.tensor_moments(tensors, ops.needs_for(ALL_STATS))
    assert sorted(i for idx, _ in groups for i in idx) == list(range(5))
    assert len(groups) == 4
    result, _ = compute(tensors, ALL_STATS)
    check_against_oracle(tensors, ALL_STATS, result)


def test_host_copy_returns_shapes_and_counts_no_transfer_on_cpu():
    copy = ops.HostCopy()
    a = torch.arange(6.0).reshape(2, 3)
    b = torch.tensor([1, 2, 3])
    ha, hb = copy.add(a), copy.add(b)
    copy.run()
    np.testing.assert_array_equal(copy.get(ha), a.numpy())
    np.testing.assert_array_equal(copy.get(hb), [1.0, 2.0, 3.0])
    assert copy.transfers == 0
    single = ops.HostCopy()
    h = single.add(torch.ones(3, dtype=torch.float64))
    single.run()
    assert single.get(h).flags.owndata or single.get(h).base is not None


def test_unknown_stat_names_list_the_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown stat name\(s\) 'nrom'.*valid stats are: norm, "
        r"mean, std, absmax, min, max, nonfinite, zero_frac",
    ):
        ops.check_stats(["norm", "nrom"])
    with pytest.raises(ValueError, match="twice"):
        ops.check_stats(["norm", "norm"])


def test_integer_tensors_are_rejected():
    with pytest.raises(TypeError, match="floating-point"):
        ops.tensor_moments([torch.arange(3)], ops.needs_for(["mean"]))


def test_ewma_helpers_follow_the_formula():
    # Shared with transforms; checked here against the loop over steps in float64.
    rng = np.random.default_rng(0)
    seq = rng.standard_normal((6, 4))
    beta = 0.9
    mean, var = ops.ewma_init(torch.tensor(seq[0]))
    m, v = seq[0].copy(), np.zeros(4)
    for g in seq[1:]:
        ops.ewma_update_(mean, var, torch.tensor(g), beta)
        d = g - m
        m = m + (1 - beta) * d
        v = beta * (v + (1 - beta) * d * d)
    np.testing.assert_allclose(mean.numpy(), m, rtol=1e-12)
    np.testing.assert_allclose(var.numpy(), v, rtol=1e-12)
