"""The Monitor's spike stats: ``zscore`` against a float64 EWMA oracle, highest for the layer
whose gradient spiked; ``clip_factor`` equal to what a spike rule on the same model published."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradtap as gt
from gradtap._monitor.spikes import ZScores


def _oracle(values: list[float], beta: float) -> list[float]:
    """(x - mean) / std of the previous finite values' exponentially weighted mean and
    variance, in exact rational arithmetic from the definition: weight (1 - beta) beta**k on
    the value k steps back, the first value carrying the remaining mass beta**(n-1)."""
    b = Fraction(beta)
    out: list[float] = []
    seen: list[Fraction] = []
    for x in values:
        n = len(seen)
        if n < 2:
            out.append(math.nan)
        else:
            w = [b ** (n - 1)] + [(1 - b) * b ** (n - 1 - i) for i in range(1, n)]
            mean = sum((wi * v for wi, v in zip(w, seen)), Fraction(0))
            var = sum((wi * (v - mean) ** 2 for wi, v in zip(w, seen)), Fraction(0))
            if not math.isfinite(x):
                out.append(math.nan if math.isnan(x) else math.inf)
            elif var == 0:
                dev = Fraction(x) - mean
                out.append(0.0 if dev == 0 else math.copysign(math.inf, dev))
            else:
                out.append(float(Fraction(x) - mean) / math.sqrt(float(var)))
        if math.isfinite(x):
            seen.append(Fraction(x))
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 100.0), st.just(math.inf),
                          st.just(math.nan)),
                min_size=1, max_size=12),
       st.floats(0.1, 0.99))
def test_zscores_equal_the_ewma_oracle(values, beta):
    # Norms from 1e-6 up (and 0): a variance of subnormal norms is below float64's range.
    z = ZScores(beta)
    got = [float(z(["w"], np.array([x]))[0]) for x in values]
    want = _oracle(values, beta)
    for g, w in zip(got, want, strict=True):
        assert (math.isnan(g) and math.isnan(w)) or g == pytest.approx(w, rel=1e-6, abs=1e-6)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 2))


def test_the_monitor_scores_each_norm_and_the_spiked_layer_scores_highest():
    model = _model()
    gen = torch.Generator().manual_seed(3)
    norms: dict[str, list[float]] = {}
    with gt.Monitor(model, stats=("zscore",), ewma=0.9) as mon:
        for step in range(12):
            x = torch.randn(8, 4, generator=gen)
            nn.functional.mse_loss(model(x), torch.zeros(8, 2)).backward()
            if step == 10:
                model[2].weight.grad *= 50.0  # a spike in one layer
            for n, p in model.named_parameters():
                norms.setdefault(n, []).append(float(p.grad.double().norm()))
            mon.step()
            model.zero_grad()
        frame = mon.frame()
    assert set(frame.stat) == {"zscore"}  # the norm it needs is not stored
    at10 = frame[frame.step == 10].set_index("name").value
    assert at10.idxmax() == "2.weight" and at10["2.weight"] > 10
    for n, series in norms.items():
        got = frame[frame.name == n].sort_values("step").value.tolist()
        want = _oracle(series, 0.9)
        np.testing.assert_allclose(got, want, rtol=1e-4, equal_nan=True)


def test_clip_factor_is_what_the_spike_rule_on_the_same_model_did():
    model = _model()
    gen = torch.Generator().manual_seed(4)
    with gt.Monitor(model, stats=("norm",)) as mon, \
            gt.transform(model, {"*.weight": gt.adagc(warmup=2)}) as h:
        for step in range(8):
            x = torch.randn(8, 4, generator=gen) * (30.0 if step == 6 else 1.0)
            nn.functional.mse_loss(model(x), torch.zeros(8, 2)).backward()
            want = {n: float(f) for n, f in h.last_factors.items()}
            mon.step()
            model.zero_grad()
            got = mon.frame()
            got = got[(got.step == step) & (got.stat == "clip_factor")].set_index("name").value
            assert got.to_dict() == pytest.approx(want, rel=0, abs=0)
            assert sorted(want) == ["0.weight", "2.weight", "4.weight"]
            if step == 6:  # the spike: clipped
                assert min(want.values()) < 0.5


def test_the_report_shows_exactly_run_spikes_with_the_first_layer_in_backward_order(tmp_path):
    from gradtap.report import build_report_data, render_html

    model = _model()
    gen = torch.Generator().manual_seed(5)
    with gt.Monitor(model, store=tmp_path / "run") as mon:  # norm only: no stat asked for
        for step in range(40):
            nn.functional.mse_loss(model(torch.randn(8, 4, generator=gen)),
                                   torch.ones(8, 2)).backward()
            if step == 30:  # the spike starts in layer 2 and reaches layer 0
                model[2].weight.grad *= 40.0
                model[0].weight.grad *= 20.0
            mon.step()
            model.zero_grad()
    spikes = gt.open_run(tmp_path / "run").spikes()
    at30 = [s for s in spikes if s.step == 30]
    assert [(s.name, s.first) for s in at30][:1] == [("2.weight", True)]
    assert "0.weight" in [s.name for s in at30]
    data = build_report_data(tmp_path / "run")
    want = [{"step": s.step, "name": s.name, "z": s.score,
             "count": sum(t.step == s.step for t in spikes)} for s in spikes if s.first]
    assert data.spikes == want
    page = render_html(data)
    assert 'id="spike-table"' in page and "first layer to spike" in page
    assert "step 30: 2.weight spiked first" in page
