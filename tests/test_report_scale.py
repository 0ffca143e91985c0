"""The report at scale: min/max-per-pixel-column downsampling, the layers that matter, tick
labels, and a large generated store in headless Chromium (DOM, search, screenshot, size)."""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtap.report as report
from gradtap.report import svg
from gradtap.report.layers import TOP_K, LayerSummary, top_layers
from gradtap.report.reduce import band_envelope, column_max, envelope
from tests.test_report import browser  # noqa: F401  (the headless Chromium fixture)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import report_scale  # noqa: E402

# -- downsampling --------------------------------------------------------------------------------


def _brute_columns(x, y, n):
    """Oracle: each column's values by a plain loop over the points."""
    lo, hi = x[0], x[-1]
    cols: dict[int, list[tuple[int, float]]] = {}
    for i, (a, b) in enumerate(zip(x.tolist(), y.tolist(), strict=True)):
        c = min(int(math.floor((a - lo) / (hi - lo) * n)), n - 1)
        cols.setdefault(c, []).append((i, b))
    return cols


@settings(max_examples=60, deadline=None)
@given(st.integers(20, 3000), st.integers(1, 400), st.integers(0, 2**31 - 1))
def test_envelope_keeps_each_columns_extremes_and_first_nonfinite(length, n, seed):
    rng = np.random.default_rng(seed)
    x = np.cumsum(rng.integers(1, 4, length)).astype(float)
    y = np.exp(rng.normal(0, 2, length))
    y[rng.random(length) < 0.02] = np.nan
    y[rng.random(length) < 0.01] = np.inf
    xs, ys = envelope(x, y, n)
    if length <= n:
        np.testing.assert_array_equal(xs, x)
        return
    assert len(xs) <= 3 * n and np.all(np.diff(xs) > 0)  # step order, no point twice
    want: list[int] = []
    for pts in _brute_columns(x, y, n).values():
        fin = [(i, v) for i, v in pts if math.isfinite(v)]
        bad = [i for i, v in pts if not math.isfinite(v)]
        if fin:
            want += [min(fin, key=lambda t: (t[1], t[0]))[0], max(fin, key=lambda t: (t[1], -t[0]))[0]]
        if bad:
            want.append(bad[0])
    idx = sorted(set(want))
    np.testing.assert_array_equal(xs, x[idx])
    np.testing.assert_array_equal(ys, y[idx])


def test_a_one_step_spike_survives_any_length():
    for steps in (1_000, 100_000):
        x = np.arange(steps, dtype=float)
        y = np.ones(steps)
        y[steps // 3] = 1e4
        y[steps // 2] = np.nan
        y[2 * steps // 3] = 1e-4
        xs, ys = envelope(x, y, 880)
        assert ys[np.nanargmax(ys)] == 1e4 and xs[np.nanargmax(ys)] == steps // 3
        assert np.nanmin(ys) == 1e-4 and xs[np.isnan(ys)].tolist() == [steps // 2]
        chart = svg.line_chart([svg.Line("a", x, y)], plot_id="p", log_y=True)
        assert chart.count('class="gt-nonfinite"') == 1
        n = int(re.search(r'data-n="(\d+)"', chart).group(1))
        assert n <= 2 * 880  # drawn points: at most the min and max of each pixel column


def test_column_max_and_band_envelope_against_loops():
    rng = np.random.default_rng(1)
    x = np.sort(rng.choice(5000, 700, replace=False)).astype(float)
    y = rng.random(700)
    y[[5, 300]] = [np.nan, -np.inf]
    got = column_max(x, y, 50, 0.0, 4999.0)
    for c in range(50):
        inside = [(a, b) for a, b in zip(x, y, strict=True)
                  if min(int((a - 0) / 4999.0 * 50), 49) == c]
        if not inside:
            assert got[c] == -1.0
        elif any(not math.isfinite(b) for _, b in inside):
            assert math.isnan(got[c])
        else:
            assert got[c] == max(b for _, b in inside)
    lo, hi = y - 0.5, y + 0.5
    bx, blo, bhi = band_envelope(x, lo, hi, 40)
    for pts in _brute_columns(x, np.arange(len(x), dtype=float), 40).values():
        ids = [int(v) for _, v in pts]
        ok = [i for i in ids if np.isfinite(lo[i]) and np.isfinite(hi[i])]
        j = int(np.flatnonzero(bx == x[ids[0]])[0])
        assert blo[j] == min(lo[ok]) and bhi[j] == max(hi[ok])


# -- the layers that matter ----------------------------------------------------------------------


def _layer(name, max_norm=1.0, peak=1.5, nonfinite=0, clipped=0):
    return LayerSummary(name, "param_grad", None, 100, 1.0, 1.0, max_norm / peak, max_norm,
                        nonfinite, None, None, peak=peak, clipped_steps=clipped)


def test_top_layers_leads_with_nonfinite_spiking_clipped_and_largest():
    layers = [_layer(f"l{i}", max_norm=1.0 + i * 1e-3) for i in range(100)]
    layers[40] = _layer("nan", nonfinite=2)
    layers[50] = _layer("spike", peak=1000.0, max_norm=5.0)
    layers[60] = _layer("clip", clipped=30)
    layers[70] = _layer("big", max_norm=1e6)
    chosen = top_layers(layers, k=6)
    assert len(chosen) == 6 and {"nan", "spike", "clip", "big"} <= set(chosen)
    assert chosen == sorted(chosen, key=[ly.name for ly in layers].index)  # model order
    why = {ly.name: ly.why for ly in layers if ly.why}
    assert why["nan"] == ["non-finite"] and why["clip"] == ["clipped"] and why["big"] == ["largest"]
    assert "spiking" in why["spike"]
    small = [_layer(f"s{i}") for i in range(5)]
    # the spike factor: a norm over both its neighbours, blind to a trend
    from gradtap.report.layers import _spike_factor
    trend = np.exp(-np.linspace(0, 5, 1000))
    assert _spike_factor(trend) == pytest.approx(1.0, abs=0.01)
    trend[500] *= 10.0
    trend[600] = np.nan
    assert _spike_factor(trend) == pytest.approx(10.0, rel=0.01)
    assert top_layers(small, k=6) == [f"s{i}" for i in range(5)]
    assert not any(ly.why for ly in small)


# -- tick labels ---------------------------------------------------------------------------------


def test_tick_labels_read_back_as_their_values():
    cases = {1.5e-4: "1.5e-4", 2.5e-5: "2.5e-5", 7.5e-3: "7.5e-3", 15000: "1.5e4",
             25000: "2.5e4", 0.25: "0.25", 1e-4: "1e-4", 100000: "1e5", 0: "0", 1234: "1234",
             -0.05: "-0.05", 5e-5: "5e-5"}
    assert {v: svg._tick_label(v) for v in cases} == cases
    assert svg.tick_labels([0, 5e-5, 1e-4, 1.5e-4]) == ["0", "5e-5", "1e-4", "1.5e-4"]


def _precision(label: str) -> float:
    """Half a unit in the last digit a label shows."""
    mant, _, exp = label.partition("e")
    decimals = len(mant.partition(".")[2])
    return 0.5 * 10.0 ** (-decimals + (int(exp) if exp else 0))


@settings(max_examples=300, deadline=None)
@given(st.floats(-1e7, 1e7, allow_nan=False), st.floats(1e-7, 1e7), st.integers(2, 12),
       st.booleans())
def test_ticks_of_any_range_have_distinct_labels_that_parse_back(lo, span, n, integer):
    if integer:
        lo, span = round(lo), max(round(span), 1)
    ticks = svg._nice_ticks(lo, lo + span, n, integer=integer)
    labels = [svg._tick_label(t) for t in ticks]
    assert len(set(labels)) == len(ticks), (ticks, labels)
    for t, label in zip(ticks, labels, strict=True):
        assert abs(float(label) - t) <= _precision(label) + 1e-12 * abs(t), (t, label)


@settings(max_examples=200, deadline=None)
@given(st.floats(-30, 30), st.floats(0.05, 20))
def test_log_ticks_have_distinct_labels_that_parse_back(lo_exp, decades):
    scale = svg._Scale(10.0 ** lo_exp, 10.0 ** (lo_exp + decades), 0, 100, log=True)
    ticks = scale.ticks()
    labels = [svg._tick_label(t) for t in ticks]
    assert len(set(labels)) == len(ticks)
    for t, label in zip(ticks, labels, strict=True):
        assert abs(float(label) - t) <= _precision(label) + 1e-12 * t


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=8))
def test_tick_labels_of_any_values_are_distinct(values):
    labels = svg.tick_labels(values)
    assert len(set(labels)) == len(set(values))
    # each is its value rounded to one number of significant digits, the fewest that work
    fits = [d for d in range(1, 18)
            if all(float(label) == float(f"{v:.{d - 1}e}") for v, label in zip(values, labels))]
    assert fits
    if fits[0] > 1:  # one digit fewer would make two labels alike
        assert len({float(f"{v:.{fits[0] - 2}e}") for v in values}) < len(set(values))


# -- a large store in the browser ----------------------------------------------------------------

TENSORS, STEPS = 256, 600


@pytest.fixture(scope="module")
def large_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("large") / "run"
    planted = report_scale.make_store(run_dir, TENSORS, STEPS, stats=("norm", "nonfinite"))
    return run_dir, planted


def test_large_store_in_headless_chromium(large_run, browser, tmp_path):  # noqa: F811
    run_dir, planted = large_run
    t0 = time.perf_counter()
    page = report.write_report(run_dir, tmp_path / "large.html")
    elapsed = time.perf_counter() - t0
    size = page.stat().st_size
    assert size < 4e6, size  # bounded: 256 tensors, yet only the charted ones have series
    t0 = time.perf_counter()
    browser.open(page.resolve().as_uri())
    dom = browser.eval(r"""(() => {
      const rows = sel => [...document.querySelectorAll(sel + " tbody tr")];
      const heat = document.querySelector('svg[data-plot="heatmap-param_grad"]');
      const norms = document.querySelector('svg[data-plot="norms-param_grad"]');
      return {ready: document.documentElement.getAttribute("data-gt-ready"),
              top: rows("#top-table").map(r => r.cells[0].textContent),
              why: rows("#top-table").map(r => r.cells[2].textContent),
              layers: rows("#layer-table").length,
              lines: [...norms.querySelectorAll("path.gt-line")].map(p => p.getAttribute("data-series")),
              nonfinite: [...norms.querySelectorAll("path.gt-nonfinite")].map(m => m.textContent),
              norms_box: norms.getBoundingClientRect().height,
              y1: +norms.getAttribute("data-y1"),
              heat_rows: +heat.getAttribute("data-rows"), heat_cols: +heat.getAttribute("data-cols"),
              cells: heat.querySelectorAll("g.gt-row rect").length,
              red: heat.querySelectorAll("rect.gt-cell-nonfinite").length,
              nav: [...document.querySelectorAll("nav a")].map(a => a.textContent)};
    })()""")
    render = time.perf_counter() - t0
    shot = tmp_path / "large.png"
    browser.screenshot(shot)
    if os.environ.get("GRADTAP_ARTIFACTS"):
        Path(os.environ["GRADTAP_ARTIFACTS"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(os.environ["GRADTAP_ARTIFACTS"]) / "report-large.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
    assert browser.problems() == [] and dom["ready"] == "1"

    spike, nan, large = planted["spike"][0], planted["nan"][0], planted["large"]
    # the page leads with the layers that matter, and only they are drawn
    assert dom["nav"][:2] == ["Overview", "Layers that matter"]
    assert len(dom["top"]) == TOP_K and {spike, nan, large} <= set(dom["top"])
    assert dom["why"][dom["top"].index(nan)] == "non-finite"
    assert "spiking" in dom["why"][dom["top"].index(spike)]
    assert sorted(dom["lines"]) == sorted(dom["top"]) and dom["norms_box"] > 100
    assert [m.split(":")[0] for m in dom["nonfinite"]] == [f"step {planted['nan'][1]}"]
    assert dom["y1"] >= 1e3 * 0.5  # the one-step spike of 1000x is inside the norm chart
    # every tensor is in the heatmap, in bounded cells, and in the table
    assert dom["heat_rows"] <= 40 and dom["heat_cols"] <= 200
    assert dom["cells"] == dom["heat_rows"] * dom["heat_cols"] and dom["red"] == 1
    assert dom["layers"] == TENSORS
    # the search finds a layer that is not charted, by name
    hidden = planted["names"][150]  # layers.18.mlp.fc2.bias
    assert hidden not in dom["top"]
    found = browser.eval(f"""(() => {{
      const box = document.getElementById("layer-search");
      box.value = {hidden!r}; box.dispatchEvent(new Event("input"));
      const shown = [...document.querySelectorAll("#layer-table tbody tr")]
          .filter(r => r.style.display !== "none").map(r => r.cells[0].textContent);
      return {{shown, count: document.getElementById("layer-count").textContent}};
    }})()""")
    assert found["shown"] == [hidden] and found["count"] == f"1 of {TENSORS} tensors"
    # a click on a row draws that tensor's norm over the whole run, from the page's data
    spark = browser.eval(f"""(() => {{
      const pick = name => [...document.querySelectorAll("#layer-table tbody tr")]
          .find(r => r.cells[0].textContent === name);
      const box = document.getElementById("layer-search");
      box.value = ""; box.dispatchEvent(new Event("input"));
      const out = {{}};
      for (const name of [{hidden!r}, {nan!r}]) {{
        pick(name).click();
        const tr = pick(name).nextElementSibling;
        const path = tr.querySelector("svg.gt-spark path");
        out[name] = {{spark: tr.classList.contains("spark"),
                     points: (path.getAttribute("d").match(/[ML]/g) || []).length,
                     red: tr.querySelectorAll(".gt-spark-nonfinite").length,
                     height: tr.getBoundingClientRect().height}};
      }}
      return out;
    }})()""")
    cols = min(STEPS, 200)
    assert spark[hidden] == {"spark": True, "points": cols, "red": 0, "height": spark[hidden]["height"]}
    assert spark[hidden]["height"] > 50
    assert spark[nan]["red"] == 1 and spark[nan]["points"] == cols - 1
    assert browser.problems() == []
    assert elapsed < 60 and render < 20  # generous: a loaded machine; the benchmark measures


def test_report_scale_benchmark_quick(capsys):
    """The benchmark script runs end to end at tiny sizes, its planted tensors on top."""
    table = report_scale.main(["--quick"])
    row = table.splitlines()[-1]
    assert row.startswith("| 40 | 300 |") and row.endswith("| spike, nan, large |"), row


def test_the_report_lists_series_without_reading_values(large_run):
    """The report learns which (name, kind, stat) series exist from ``Run.arrays(names=[])``:
    no values, the whole series table. Were that to read every value, a 10^8-value store
    would be read whole before the report starts."""
    from gradtap.store import open_run

    run_dir, planted = large_run
    steps, ids, values, series = open_run(run_dir).arrays(names=[])
    assert len(steps) == len(ids) == len(values) == 0
    assert sorted(series) == sorted((n, "param_grad", s) for n in planted["names"]
                                    for s in ("norm", "nonfinite"))
