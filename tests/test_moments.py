"""The typed moments of _tensorops field by field against float64 numpy, and its flat-name view;
the norm helper and the host copy that the consumers share."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradtap import _tensorops as ops
from gradtap import distributed
from gradtap._tensorops import Centered, Moments
from tests.test_tensorops import data_scale, rtol_for, tensor_values

ALL_STATS = ops.STAT_NAMES


def numpy_moments(x: np.ndarray, edges: np.ndarray | None = None) -> dict[str, float | np.ndarray]:
    """Every field of one tensor, naively in float64."""
    v = np.asarray(x, dtype=np.float64).reshape(-1)
    finite = v[np.isfinite(v)]
    with np.errstate(all="ignore"):
        out = {
            "sum": float(np.sum(v)), "sumsq": float(np.sum(v * v)),
            "max": float(np.max(v)), "negmin": float(-np.min(v)),
            "nonfinite": float(np.sum(~np.isfinite(v))), "nonzero": float(np.sum(v != 0)),
            "m2": float(np.sum((v - np.mean(v)) ** 2)),
        }
    if edges is not None:
        idx = np.clip(np.searchsorted(edges, finite, side="right") - 1, 0, len(edges) - 2)
        out["hist"] = np.bincount(idx, minlength=len(edges) - 1).astype(np.float64)
    return out


def close(actual: float, expected: float, tol: float, what: str) -> None:
    if math.isnan(expected) or math.isinf(expected):
        assert (math.isnan(actual) and math.isnan(expected)) or actual == expected, what
    else:
        assert abs(actual - expected) <= tol, f"{what}: {actual} != {expected}"


def host(groups, n):
    copy = ops.HostCopy()
    gather = ops.host_moments(groups, n, copy)
    copy.run()
    return gather()


@settings(max_examples=50, deadline=None)
@given(tensors=st.lists(tensor_values(), min_size=1, max_size=4), batched=st.booleans())
def test_every_field_of_tensor_moments_matches_float64(tensors, batched):
    edges = ops.hist_edges(5, "linear", (-3.0, 3.0))
    needs = ops.needs_for(ALL_STATS, exact_nonfinite=True)
    raw = host(ops.tensor_moments(tensors, needs, edges=edges, batched=batched, exact_m2=True),
               len(tensors))
    assert isinstance(raw, Moments) and isinstance(raw.centered, Centered)
    assert raw.m2 is None and raw.between is None  # raw stage: no refined fields yet
    count = np.array([t.numel() for t in tensors], dtype=np.float64)
    refined = ops.refine_fields(count, raw)
    assert refined.centered is None and refined.m2 is not None
    for i, t in enumerate(tensors):
        x = t.double().numpy()
        want = numpy_moments(x, edges.numpy())
        scale, rtol = data_scale(x), rtol_for(t)
        n = x.size
        # Exact: extremes and counts. The sum carries the tolerance of the mean (rtol, plus
        # rtol * max|x|) times n, sumsq that of the norm squared, m2 that of the std squared.
        tols = {"max": 0.0, "negmin": 0.0, "nonfinite": 0.0, "nonzero": 0.0,
                "sum": rtol * (abs(want["sum"]) + n * scale), "sumsq": 2 * rtol * want["sumsq"],
                "m2": 2 * rtol * (want["m2"] + n * scale * (math.sqrt(want["m2"] / n) + scale))
                if math.isfinite(want["m2"]) else 0.0}
        for f, tol in tols.items():
            close(float(getattr(refined, f)[i]), want[f], tol, f"{f}[{i}] {t.dtype}")
        np.testing.assert_array_equal(refined.hist[i], want["hist"])
        if np.isfinite(x).all():
            shift = float(raw.centered.shift[i])
            close(shift, float(np.mean(x)), rtol * scale * 4, "shift")
            close(float(raw.centered.csum[i]), float(np.sum(x - shift)), rtol * scale * n, "csum")
            close(float(raw.centered.m2c[i]), float(np.sum((x - shift) ** 2)),
                  rtol * (float(np.sum((x - shift) ** 2)) + n * scale ** 2), "m2c")


@settings(max_examples=30, deadline=None)
@given(t=tensor_values(dtype=torch.float64), cuts=st.lists(st.integers(0, 60), max_size=3))
def test_parts_reduced_like_ranks_give_the_moments_of_the_whole(t, cuts):
    """``between`` completes m2 across parts exactly as the whole tensor's float64 m2."""
    flat = t.reshape(-1)
    points = sorted({0, flat.numel(), *[c % (flat.numel() + 1) for c in cuts]})
    parts = [flat[a:b] for a, b in zip(points, points[1:]) if b > a]
    needs = ops.needs_for(ALL_STATS, exact_nonfinite=True)
    groups = ops.tensor_moments(parts, needs, exact_m2=True)
    (idx, fields), = groups
    assert idx == list(range(len(parts)))
    count = np.array([p.numel() for p in parts], dtype=np.float64)
    total, reduced, _ = distributed.reduce_parts(count, fields, np.zeros(len(parts), np.int64),
                                                 ["t"])
    assert isinstance(reduced, Moments) and reduced.between is not None
    want = numpy_moments(flat.numpy())
    x = flat.numpy()
    scale = data_scale(x)
    assert float(total[0]) == x.size
    for f in ("sum", "sumsq", "max", "negmin", "nonfinite", "nonzero"):
        close(float(getattr(reduced, f)[0]), want[f],
              1e-9 * (abs(want[f]) + x.size * max(scale, scale ** 2)), f)
    std = ops.finish_stats(total.numpy(), reduced.map(lambda v: v.numpy()), ["std"])["std"][0]
    # between - S**2 / N cancels in float64: the std of a constant tensor split in parts is
    # ~sqrt(eps) * max|x|, not 0 as on one rank, whence the absolute slack.
    want_std = math.sqrt(want["m2"] / x.size)
    close(float(std), want_std, 1e-9 * want_std + 1e-7 * scale, "std")


def test_flat_view_round_trips_and_guards_its_names():
    a = np.arange(3.0)
    m = Moments.coerce({"sum": a, "shift": a + 1, "csum": a + 2, "m2c": a + 3, "hist": np.ones((3, 2))})
    assert list(m) == ["sum", "hist", "shift", "csum", "m2c"]
    assert m.centered is not None and m.centered.csum.tolist() == [2.0, 3.0, 4.0]
    assert "m2" not in m and "csum" in m and "bogus" not in m
    assert Moments.coerce(dict(m.items())) == m and Moments.coerce(m) is m
    m["nonzero"] = a
    m["m2c"] = a
    assert m.nonzero is a and m.centered.m2c is a
    with pytest.raises(KeyError):
        m["m2"]
    with pytest.raises(KeyError, match="unknown moment field"):
        Moments.coerce({"sums": a})
    with pytest.raises(KeyError, match="come together"):
        Moments.coerce({"shift": a})
    with pytest.raises(KeyError, match="centered field"):
        Moments(sum=a)["csum"] = a
    both = Moments.cat([m, m.map(lambda v: v * 10)])
    assert both.sum.tolist() == [0.0, 1.0, 2.0, 0.0, 10.0, 20.0] and both.hist.shape == (6, 2)
    c = m.copy()
    c.sum, c.centered.shift = None, None
    assert m.sum is a and m.centered.shift is not None


def test_moments_of_torch_tensors_cat_onto_the_first_device():
    m = Moments(sum=torch.ones(2), hist=torch.zeros(2, 3))
    out = Moments.cat([m, m])
    assert out.sum.shape == (4,) and out.hist.shape == (4, 3) and out.max is None


# -- one norm helper -------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(tensors=st.lists(tensor_values(), min_size=1, max_size=4), accurate=st.booleans())
def test_norms_match_float64_and_keep_the_order(tensors, accurate):
    mixed = [t if i % 2 else t.to(torch.bfloat16) for i, t in enumerate(tensors)]
    copy = ops.HostCopy()
    got = copy.add_rows(ops.norms(mixed, accurate=accurate), len(mixed))
    copy.run()
    for i, t in enumerate(mixed):
        x = t.double().numpy()
        with np.errstate(all="ignore"):
            want = float(np.sqrt(np.sum(x * x)))
        rtol = 2e-5 if t.dtype != torch.float64 else 1e-12
        close(float(got()[i]), want, rtol * (want if math.isfinite(want) else 0.0), f"norm[{i}]")


def test_group_norms_dtypes_and_accuracy_of_long_tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3_000_000, generator=g) + 0.5
    want = float(x.double().norm())
    assert group_norm_err(ops.group_norms([x], accurate=True), want) < 1e-9
    assert ops.group_norms([x]).dtype == torch.float32
    assert ops.group_norms([x.to(torch.float16)[:10]]).dtype == torch.float32
    assert ops.group_norms([x], accurate=True).dtype == torch.float64


def group_norm_err(norm: torch.Tensor, want: float) -> float:
    return abs(float(norm[0]) - want) / want


# -- one host copy ---------------------------------------------------------------------------


def test_host_copy_views_share_cpu_memory_and_keep_the_dtype():
    a = torch.arange(4.0)
    b = torch.tensor([1.5, 2.5], dtype=torch.bfloat16)
    c = torch.tensor([7], dtype=torch.int64)
    out = ops.to_host([a, b, c])
    assert out[0].dtype == np.float32 and np.shares_memory(out[0], a.numpy())
    assert out[1].dtype == np.float64 and out[1].tolist() == [1.5, 2.5]
    assert out[2].tolist() == [7]
    copies = ops.to_host([a], views=False)
    assert copies[0].dtype == np.float64 and not np.shares_memory(copies[0], a.numpy())


def test_add_rows_puts_grouped_rows_back_in_order():
    copy = ops.HostCopy()
    gather = copy.add_rows([([2, 0], torch.tensor([[20.0], [0.0]])), ([1], torch.tensor([[10.0]]))], 3)
    copy.run()
    np.testing.assert_array_equal(gather(), [[0.0], [10.0], [20.0]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.cuda
def test_host_copy_one_transfer_per_device_on_gpu():
    copy = ops.HostCopy()
    handles = [copy.add(torch.full((3,), float(i), device="cuda")) for i in range(4)]
    handles.append(copy.add(torch.ones(2)))
    copy.run()
    assert copy.transfers == 1
    assert [copy.get(h).tolist() for h in handles[:2]] == [[0.0] * 3, [1.0] * 3]
    views = ops.to_host([torch.arange(3.0, device="cuda")])
    assert views[0].dtype == np.float64 and views[0].tolist() == [0.0, 1.0, 2.0]


def _plan_fields(plan: ops.MomentPlan, tensors: list[torch.Tensor]) -> dict[str, np.ndarray]:
    copy = ops.HostCopy()
    gather = plan.queue(tensors, copy)
    copy.run()
    return gather()


def test_moment_plan_reads_every_field_like_the_per_tensor_loop_step_after_step():
    """A plan made once gives, for new values of the same layout, the fields of the plain
    per-tensor loop: long CPU tensors with and without a tail (blocked norms), a
    non-contiguous one, mixed dtypes (so rows come back from several groups), NaN and Inf."""
    g = torch.Generator().manual_seed(0)

    def draw() -> list[torch.Tensor]:
        ts = [torch.randn(3000, generator=g) + 5.0,
              torch.randn(2048, generator=g, dtype=torch.float64),
              torch.randn(7, 300, generator=g).t(), torch.randn(5, generator=g).to(torch.bfloat16),
              torch.randn(1024, generator=g)]
        ts[2][0, 1] = float("nan")
        ts[4][3] = float("-inf")
        return ts

    needs = ops.needs_for(ALL_STATS, exact_nonfinite=True)
    first = draw()
    plan = ops.MomentPlan(first, needs)
    assert len(plan.groups) == 3
    for ts in (first, draw()):
        assert ops.MomentPlan.signature(ts) == ops.MomentPlan.signature(first)
        got = _plan_fields(plan, ts)
        want = host(ops.tensor_moments(ts, needs, batched=False), len(ts))
        assert sorted(got) == sorted(want.keys())
        for f in got:
            np.testing.assert_allclose(got[f], want[f], rtol=2e-6, err_msg=f)
            assert got[f].dtype == np.float64
        np.testing.assert_array_equal(got["nonfinite"], [0, 0, 1, 0, 1])
        np.testing.assert_array_equal(plan.count, [t.numel() for t in ts])


def test_moment_plan_counts_stay_exact_above_float32_integers():
    """Counts go to the host in float64: 2**24 + 1 is not rounded as float32 would."""
    t = torch.ones(2**24 + 1)
    got = _plan_fields(ops.MomentPlan([t], ops.needs_for(["zero_frac", "mean"])), [t])
    assert got["nonzero"].tolist() == [2**24 + 1]


def test_host_copy_hands_out_an_owned_buffer_without_copying_it():
    owned, theirs = torch.arange(3.0, dtype=torch.float64), torch.arange(3.0, dtype=torch.float64)
    copy = ops.HostCopy()
    h = copy.add(owned, owned=True)
    copy.run()
    owned[0] = 7.0
    assert copy.get(h)[0] == 7.0  # a view: nothing was copied
    copy = ops.HostCopy()
    h = copy.add(theirs)
    copy.run()
    theirs[0] = 7.0
    assert copy.get(h)[0] == 0.0  # the caller's tensor is copied


@pytest.mark.parametrize("exact", [True, False])
def test_moment_plan_reduces_small_cpu_tensors_on_the_host_like_the_per_tensor_loop(exact):
    """Small CPU tensors of a group are reduced on the host in float64 (they come last in the
    plan's order): the fields of the per-tensor loop, NaN and Inf included, in any dtype."""
    g = torch.Generator().manual_seed(3)

    def draw() -> list[torch.Tensor]:
        ts = [torch.randn(3000, generator=g) * 3, torch.randn(16, generator=g) + 100.0,
              torch.randn(7, 3, generator=g).t(), torch.randn(1024, generator=g),
              torch.randn(10, generator=g).to(torch.bfloat16), torch.randn(2048, generator=g),
              torch.randn(20, generator=g).to(torch.bfloat16), torch.randn(5, generator=g),
              torch.randn(8, generator=g)]
        ts[7][2] = float("nan")
        ts[8][0], ts[8][5] = float("inf"), float("-inf")
        return ts

    needs = ops.needs_for(ALL_STATS, exact_nonfinite=exact)
    first = draw()
    plan = ops.MomentPlan(first, needs)
    # float32: 3000 and 2048 by kernels, then 16, 7x3, 1024, 5, 8 on the host; bfloat16: both
    assert plan.order == [0, 5, 1, 2, 3, 7, 8, 4, 6]
    for ts in (first, draw()):
        ordered = [ts[i] for i in plan.order]
        got = _plan_fields(plan, ordered)
        want = host(ops.tensor_moments(ordered, needs, batched=False), len(ts))
        assert sorted(got) == sorted(want.keys())
        for f in got:
            np.testing.assert_allclose(got[f], want[f], rtol=2e-6, err_msg=f)
        np.testing.assert_array_equal(plan.count, [t.numel() for t in ordered])
        if exact:
            np.testing.assert_array_equal(got["nonfinite"], [0, 0, 0, 0, 0, 1, 2, 0, 0])
