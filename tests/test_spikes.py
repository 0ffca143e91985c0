"""The gradient-spike detector against a plain float64 loop over steps written from its
definition (docs/semantics.md, "Gradient spikes"), its online form against its offline one,
and ``Run.spikes()`` on stores written by a real Monitor."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradtap as gt
from gradtap._monitor.history import MemoryRun
from gradtap._tensorops.spikes import (
    _CHUNK,
    MIN_COMMON,
    NEIGHBOURS,
    PAIR_GATE,
    PAIR_REFRESH,
    SCALE_FLOOR,
    THRESHOLD,
    WARMUP,
    WINDOW,
    OnlineScores,
    _middle,
    scores,
    series_scores,
)


def _spread(values: list[float]) -> float:
    return 1.4826 * statistics.median(abs(v) for v in values)


def _held(c: int, every: int = 1) -> int:
    """How many of a history's values its statistics are taken from, when ``c`` precede the
    value: all while fewer than ``2 * WINDOW``, else those up to the last multiple of
    ``every``."""
    return c if c < 2 * WINDOW else c - c % every


def _baseline(h: list[float]) -> float:
    """The baseline of the value after the history ``h`` (>= 2 values)."""
    r = _held(len(h))
    w = h[:r][-WINDOW:]
    k, m = len(w), len(w) // 2
    slope = statistics.median(w[m + j] - w[j] for j in range(k - m)) / m
    return statistics.median(w) + slope * ((k + 1) / 2 + (len(h) - r))


def _held_spread(h: list[float], every: int = 1) -> float:
    return _spread(h[:_held(len(h), every)][-WINDOW:])


def _reference(table: list[list[float]], warmup: int) -> list[list[float]]:
    """The score of each norm ([steps][tensors], NaN: none), from the definition, one step
    and one tensor at a time."""
    n = len(table[0]) if table else 0
    xs: list[list[float]] = [[] for _ in range(n)]  # each tensor's log-norms
    owns: list[list[float]] = [[] for _ in range(n)]
    commons: list[float] = []
    pairs: dict[tuple[int, int], list[float]] = {}  # (i, j), i < j: dev_i - dev_j
    out = []
    for row in table:
        dev = [math.nan] * n
        for i, v in enumerate(row):
            if math.isfinite(v) and v > 0 and len(xs[i]) >= 2:
                dev[i] = math.log(v) - _baseline(xs[i])
        have = [d for d in dev if not math.isnan(d)]
        common = statistics.median(have) if len(have) >= MIN_COMMON else 0.0
        c_score = -math.inf
        if len(have) >= MIN_COMMON and len(commons) >= max(warmup, 3):
            c_score = common / max(SCALE_FLOOR, _held_spread(commons))
        scored = []
        for i in range(n):
            if math.isnan(dev[i]) or len(xs[i]) < max(warmup, 3):
                scored.append(math.nan)
                continue
            s = max(SCALE_FLOOR, _held_spread(owns[i]))
            own = dev[i] - common
            score = max(own / s, min(c_score, dev[i] / s))
            # the partner: the neighbour whose difference has the least spread so far
            partner = None
            for j in sorted(range(n), key=lambda j: (abs(i - j), j)):
                if j == i or abs(i - j) > NEIGHBOURS or math.isnan(dev[j]):
                    continue
                h = pairs.get((min(i, j), max(i, j)), [])
                if len(h) >= max(max(warmup, 3) // 2, 1):
                    p = _held_spread(h, PAIR_REFRESH)
                    if partner is None or p < partner[1]:
                        partner = (j, p)
            if partner is not None and own / s > PAIR_GATE:
                score = max(score, (dev[i] - dev[partner[0]]) / max(SCALE_FLOOR, partner[1]))
            scored.append(score)
        out.append(scored)
        for i in range(n):
            for j in range(i + 1, min(n, i + NEIGHBOURS + 1)):
                if not (math.isnan(dev[i]) or math.isnan(dev[j])):
                    pairs.setdefault((i, j), []).append(dev[i] - dev[j])
        for i, v in enumerate(row):
            if math.isfinite(v) and v > 0:
                xs[i].append(math.log(v))
            if not math.isnan(dev[i]):
                owns[i].append(dev[i] - common)
        if len(have) >= MIN_COMMON:
            commons.append(common)
    return out


_norm = st.one_of(
    st.floats(1e-6, 1e6),
    st.sampled_from([0.0, -1.0, math.nan, math.inf, 1.0, 10.0]),
)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), steps=st.integers(0, 3 * WINDOW),
       warmup=st.integers(3, WINDOW + 5), every=st.booleans())
def test_scores_equal_the_loop_over_steps_and_the_online_scores(data, n, steps, warmup, every):
    # every: a valid norm of every tensor at every step (the table's usual shape)
    norm = st.floats(1e-3, 1e3) if every else _norm
    table = data.draw(st.lists(st.lists(norm, min_size=n, max_size=n), min_size=steps,
                               max_size=steps))
    values = np.array(table, dtype=np.float64).reshape(steps, n)
    want = np.array(_reference(table, warmup), dtype=np.float64).reshape(steps, n)
    got = scores(values, warmup)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, equal_nan=True)
    online = OnlineScores(n, warmup)
    step_by_step = np.empty_like(values)
    for t in range(steps):
        step_by_step[t] = online.score(values[t])
        online.push(values[t])
    np.testing.assert_array_equal(step_by_step, got)  # exactly the same numbers


def test_medians_in_chunks_are_those_of_np_median_and_a_long_table_those_of_the_loop():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(_CHUNK + 5, WINDOW))
    rows[:, :8] = np.round(rows[:, :8])  # ties
    assert np.array_equal(_middle(rows), np.median(rows, axis=1))
    assert np.array_equal(_middle(rows[:, 1:], absolute=True),
                          np.median(np.abs(rows[:, 1:]), axis=1))
    steps = _CHUNK + 2 * WINDOW  # full histories in two chunks
    values = np.exp(rng.normal(0, 0.1, (steps, 3)) - np.arange(steps)[:, None] / steps)
    values[steps // 2, 1] *= 10
    want = np.array(_reference(values.tolist(), WARMUP), dtype=np.float64).reshape(steps, 3)
    np.testing.assert_allclose(scores(values), want, rtol=1e-9, atol=1e-9, equal_nan=True)


def test_a_trend_and_a_step_decay_score_low_and_a_x10_spike_scores_high():
    rng = np.random.default_rng(0)
    t = np.arange(1000)
    log_norm = -3 * t / 1000 + np.where(t > 500, -1.0, 0.0) * 0 + rng.normal(0, 0.1, 1000)
    log_norm += np.log(np.minimum(1.0, (t + 1) / 100))  # a warm-up ramp
    scores = series_scores(np.exp(log_norm))
    assert np.nanmax(scores[WARMUP:]) < THRESHOLD
    spiked = np.exp(log_norm)
    spiked[[300, 301, 700]] *= 10  # two in a row: the first does not mask the second
    scores = series_scores(spiked)
    assert np.flatnonzero(scores > THRESHOLD).tolist() == [300, 301, 700]


def test_bad_arguments_are_named():
    run = MemoryRun({})
    with pytest.raises(ValueError, match="threshold must be a finite number > 0"):
        run.spikes(threshold=0)
    with pytest.raises(ValueError, match="warmup must be an int >= 3"):
        run.spikes(warmup=2)
    assert run.spikes() == []  # no norm stored


def _train(run_dir, inject: tuple[int, str] | None, steps: int = 80) -> list[str]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(512, 6)
    y = torch.sin(x[:, :3]) + 2.0  # an offset the biases learn slowly: steady bias gradients
    params = dict(net.named_parameters())
    with gt.Monitor(net, store=run_dir) as mon:
        for step in range(steps):
            i = torch.randint(0, 512, (32,))
            opt.zero_grad()
            nn.functional.mse_loss(net(x[i]), y[i]).backward()
            if inject is not None and step == inject[0]:
                params[inject[1]].grad.mul_(10.0)  # after backward, as a bad batch would
            mon.step()
            opt.step()
    return list(params)


@pytest.mark.parametrize("name", ["2.bias", "0.weight"])
def test_run_spikes_of_a_monitor_store_name_the_injected_tensor(tmp_path, name):
    params = _train(tmp_path, (50, name))
    run = gt.open_run(tmp_path)
    spikes = run.spikes()
    assert [(s.step, s.name, s.kind, s.first) for s in spikes] == [(50, name, "param_grad", True)]
    steps, norms = run.series(name, "norm")
    assert spikes[0].value == norms[steps.tolist().index(50)]
    # the score is the table's: every tensor's norms, in the model's parameter order
    table = np.stack([run.series(p, "norm")[1] for p in params], axis=1)
    assert spikes[0].score == scores(table)[50, params.index(name)]
    assert isinstance(spikes[0], gt.Spike)


def test_run_spikes_of_a_healthy_run_are_none_and_the_memory_run_agrees(tmp_path):
    _train(tmp_path / "a", None)
    assert gt.open_run(tmp_path / "a").spikes() == []
    _train(tmp_path / "b", (60, "0.bias"))
    stored = gt.open_run(tmp_path / "b")
    memory = MemoryRun(stored.meta)
    steps, ids, values, series = stored.arrays()
    for s in np.unique(steps):
        at = steps == s
        memory.write_step(int(s), [(i, *k) for i, k in enumerate(series)] if s == steps[0]
                          else [], ids[at], values[at])
    assert memory.spikes() == stored.spikes() != []


def test_first_is_the_earliest_in_backward_order():
    run = MemoryRun({"selected": {"parameters": ["a", "b", "c"]}})
    series = [(i, n, "param_grad", "norm") for i, n in enumerate("abc")]
    for step in range(40):
        norms = 1.0 + 0.01 * np.array([step % 3, step % 2, step % 5])
        if step == 30:
            norms[[0, 1]] *= 10  # a and b spike; b's gradient is computed before a's
        run.write_step(step, series if step == 0 else [], np.arange(3), norms)
    got = [(s.step, s.name, s.first) for s in run.spikes()]
    assert got == [(30, "b", True), (30, "a", False)]
    assert [s.name for s in run.spikes(threshold=1e6)] == []


def _detect_run(inject: dict[int, str], steps: int = 120) -> list[gt.Anomaly]:
    """Train a small regression with a decaying learning rate under ``detect(spike=True)``;
    at each step of ``inject`` the named parameter's gradient is multiplied by 10 in that
    step's backward."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.99)
    x = torch.randn(512, 6)
    y = torch.sin(x[:, :3]) + 2.0
    params = dict(net.named_parameters())
    with gt.detect(net, spike=True, action="record") as det:
        for step in range(steps):
            i = torch.randint(0, 512, (32,))
            opt.zero_grad()
            hook = params[inject[step]].register_hook(lambda g: g * 10) if step in inject else None
            nn.functional.mse_loss(net(x[i]), y[i]).backward()
            if hook is not None:
                hook.remove()
            det.should_skip()
            det.step()
            opt.step()
            sched.step()
    return det.anomalies


def test_detect_finds_x10_spikes_in_one_tensor_a_linear_bias_included():
    inject = {40: "2.bias", 70: "0.weight", 90: "0.bias", 110: "2.weight"}
    got = [(a.step, a.module_name, a.slot, a.kind, a.where) for a in _detect_run(inject)]
    assert got == [(s, n.split(".")[0], n.split(".")[1], "spike", "param_grad")
                   for s, n in inject.items()]


def test_detect_reports_nothing_on_a_healthy_decaying_run():
    assert _detect_run({}) == []


def _shared_noise_table(steps: int = 200, seed: int = 3) -> np.ndarray:
    """Log-norms of six tensors: 0 and 1 (a layer's weight and bias) share a large
    step-to-step noise (0.5 in log units) and differ by little (0.05); 2-5 are steady."""
    rng = np.random.default_rng(seed)
    shared = rng.normal(0, 0.5, steps)
    logs = np.stack([shared + rng.normal(0, 0.05, steps), shared + rng.normal(0, 0.05, steps),
                     *(rng.normal(0, 0.1, steps) for _ in range(4))], axis=1)
    return np.exp(logs - np.arange(steps)[:, None] / 100)  # a falling trend


def test_a_x10_hidden_in_a_noisy_tensor_is_found_against_its_partner():
    table = _shared_noise_table()
    assert np.nanmax(scores(table)[WARMUP:]) < THRESHOLD  # healthy: nothing flagged
    hits = 0
    for t in range(100, 200, 5):
        spiked = table.copy()
        spiked[t, 1] *= 10
        z = scores(spiked)
        hits += bool(z[t, 1] > THRESHOLD)
        assert np.flatnonzero(z[t] > THRESHOLD).tolist() in ([], [1])
    assert hits == 20
    # the partner's dip is no spike of the tensor (the pair's jump counts only where the
    # tensor itself rose against the step)
    dipped = table.copy()
    dipped[150, 0] /= 10
    assert not (scores(dipped)[150] > THRESHOLD).any()


def test_without_the_partner_the_same_x10_is_mostly_missed():
    # What the pairing adds: the same trials scored with tensor 0 left out.
    table = _shared_noise_table()[:, 1:]
    missed = 0
    for t in range(100, 200, 5):
        spiked = table.copy()
        spiked[t, 0] *= 10
        missed += bool(scores(spiked)[t, 0] <= THRESHOLD)
    assert missed >= 15
