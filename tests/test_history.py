"""The in-memory run answers every query exactly as the SQLite run written with the same steps.

Random small runs (series appearing at any step, in any order, NaN/Inf values, histograms,
EWMA summaries, metadata) are written both to a ``RunWriter`` and to a ``MemoryRun``; then
every query of ``Run`` is asked of both, errors included.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradtap as gt
from gradtap._monitor.history import MemoryRun
from gradtap._monitor.rows import RowBuilder, SeriesTable
from gradtap.errors import SelectionError
from gradtap.store import KIND_NAMES, Run, RunWriter

NAMES = ("a", "b", "blk.0.w", "blk.1.w", "dec:output")
STATS = ("norm", "mean", "std", "nonfinite", "ratio", "cosine")
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64),
                   st.sampled_from([math.nan, math.inf, -math.inf, 0.0]))


@st.composite
def runs(draw):
    """Steps as the Monitor writes them: ids numbered in order of first appearance."""
    universe = [(n, k, s) for n in NAMES for k in KIND_NAMES[:3] for s in STATS]
    bins = draw(st.sampled_from([None, 1, 3]))
    meta = {"config": {"select": ("a", "b"), "every": 1}, "selected": {"parameters": ["a"]},
            "note": draw(st.sampled_from(["x", [1, 2], {"k": None}]))}
    if bins is not None:
        meta["histogram"] = {"edges": np.linspace(-1, 1, bins + 1).tolist()}
    table: dict[tuple[str, str, str], int] = {}
    steps = []
    step = -1
    for _ in range(draw(st.integers(0, 5))):
        step += draw(st.integers(1, 3))
        chosen = draw(st.lists(st.sampled_from(universe), max_size=8, unique=True))
        new = []
        for key in chosen:
            if key not in table:
                table[key] = len(table)
                new.append((table[key], *key))
        ids = np.array([table[k] for k in chosen], dtype=np.int64)
        values = np.array([draw(VALUES) for _ in chosen], dtype=np.float64)
        hists = []
        if bins is not None:
            for kind, name in draw(st.lists(st.sampled_from([(k, n) for k in KIND_NAMES[:2]
                                                             for n in NAMES[:3]]),
                                            max_size=3, unique=True)):
                counts = np.array(draw(st.lists(st.integers(0, 2**40), min_size=bins,
                                                max_size=bins)), dtype=np.int64)
                hists.append((kind, name, counts))
        steps.append((step, new, ids, values, hists, 1.7e9 + step))
    ewma = [(name, 0.9, draw(st.integers(1, 9)), 6, "[2, 3]", draw(VALUES), draw(VALUES),
             draw(VALUES), draw(VALUES)) for name in draw(st.lists(st.sampled_from(NAMES[:3]),
                                                                   unique=True))]
    return meta, steps, ewma, draw(st.sampled_from(["finished", "failed", None]))


def write_both(tmp: Path, meta, steps, ewma, status) -> tuple[Run, MemoryRun, RunWriter]:
    writer, memory = RunWriter(tmp / "run", meta), MemoryRun(meta)
    for sink in (writer, memory):
        for step, new, ids, values, hists, wall in steps:
            sink.write_step(step, new, ids, values, hists, wall_time=wall)
        if ewma:
            sink.write_ewma(ewma)
        if status is not None:
            sink.close(status)
    return Run(tmp / "run"), memory, writer  # a run still running is read while open


def same_answer(query, run, memory):
    """Both give equal results, or both raise the same error type."""
    outcomes = []
    for source in (run, memory):
        try:
            outcomes.append(("ok", query(source)))
        except (KeyError, ValueError, SelectionError) as err:
            outcomes.append(("error", type(err)))
    (kind_a, a), (kind_b, b) = outcomes
    assert kind_a == kind_b, (a, b)
    if kind_a == "error":
        assert a is b
    return a, b


def assert_equal(a, b):
    if isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b)
    elif isinstance(a, tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal(x, y)
        if hasattr(a, "steps"):
            assert_equal(a.steps, b.steps)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for k in a:
            assert_equal(a[k], b[k])
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
    else:
        assert a == b and type(a) is type(b)


@settings(max_examples=30, deadline=None)
@given(data=runs(), probe=st.sampled_from(NAMES + ("zz", "blk.*")),
       asked=st.lists(st.sampled_from(NAMES + ("zz",)), min_size=1, max_size=2, unique=True))
def test_memory_run_answers_every_query_like_the_store(data, probe, asked):
    meta, steps, ewma, status = data
    with tempfile.TemporaryDirectory() as tmp:
        run, memory, writer = write_both(Path(tmp), meta, steps, ewma, status)
        check_every_query(run, memory, probe, asked)
        writer.close()


def check_every_query(run, memory, probe, asked):
    for prop in ("steps", "names", "kinds", "stats", "status", "ewma", "histogram_names",
                 "wall_times"):
        assert_equal(*same_answer(lambda r, p=prop: getattr(r, p)() if callable(
            getattr(r, p)) else getattr(r, p), run, memory))
    m_run, m_mem = run.meta, memory.meta
    assert ("end_time" in m_run) == ("end_time" in m_mem)
    m_run.pop("end_time", None), m_mem.pop("end_time", None)
    assert_equal(m_run, m_mem)
    filters = [{}, {"names": probe}, {"names": [probe, "a"]}, {"stats": "norm"},
               {"kinds": ["param", "grad_output"]}, {"stats": ["mean", "cosine"], "names": "a"},
               {"stats": "nrom"}, {"kinds": "grads"}]
    for f in filters:
        assert_equal(*same_answer(lambda r, f=f: r.frame(**f), run, memory))
        assert_equal(*same_answer(lambda r, f=f: r.arrays(**f), run, memory))
    for name in asked:
        for kind in KIND_NAMES[:3]:
            assert_equal(*same_answer(lambda r, n=name, k=kind: r.histogram(n, k), run, memory))
            for stat in STATS:
                assert_equal(*same_answer(lambda r, n=name, s=stat, k=kind: r.series(n, s, k),
                                          run, memory))


def test_missing_names_and_histograms_give_the_same_messages_but_the_place():
    with tempfile.TemporaryDirectory() as tmp:
        meta = {"config": {}}
        new = [(0, "layer.weight", "param_grad", "norm")]
        run, memory, _ = write_both(Path(tmp), meta, [(0, new, np.array([0]), np.array([1.0]),
                                                       [], 1.0)], [], "finished")
        for r in (run, memory):
            with pytest.raises(KeyError, match="close names: layer.weight"):
                r.series("layer.weigth", "norm")
            with pytest.raises(KeyError, match=r"no histograms \(hist_bins=None\).*histograms are off"):
                r.histogram("layer.weight")
        with pytest.raises(KeyError, match="in memory"):
            memory.series("x", "norm")


def test_series_table_numbers_series_in_order_of_first_appearance():
    table = SeriesTable()
    first = table.layout("param_grad", ["b", "a"], ["norm", "mean"])
    again = table.layout("param_grad", ["b", "a"], ["norm", "mean"])
    assert first is again and first.tolist() == [0, 1, 2, 3]
    assert table.take_new() == [(0, "b", "param_grad", "norm"), (1, "b", "param_grad", "mean"),
                                (2, "a", "param_grad", "norm"), (3, "a", "param_grad", "mean")]
    other = table.layout("update", ["a"], ["norm"])
    assert other.tolist() == [4] and table.take_new() == [(4, "a", "update", "norm")]
    assert table.take_new() == []
    rows = RowBuilder(table)
    rows.add("param_grad", ["b", "a"], {"norm": np.array([1.0, 2.0]), "mean": np.array([3.0, 4.0])})
    rows.add("update", ["a"], {"norm": np.array([5.0])})
    rows.add("param", ["a"], {})  # nothing to add
    step = rows.finish(7)
    # each value goes with its series id (the order within a step is free)
    assert step.step == 7 and step.new_series == []
    assert sorted(zip(step.ids.tolist(), step.values.tolist())) == [
        (0, 1.0), (1, 3.0), (2, 2.0), (3, 4.0), (4, 5.0)]
    names, kinds, stats = step.labels()
    assert sorted(zip(names, kinds, stats, step.values.tolist())) == [
        ("a", "param_grad", "mean", 4.0), ("a", "param_grad", "norm", 2.0),
        ("a", "update", "norm", 5.0), ("b", "param_grad", "mean", 3.0),
        ("b", "param_grad", "norm", 1.0)]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("every", [1, 2])
def test_monitor_with_and_without_store_answer_alike(tmp_path, every):
    """End to end: the Monitor's queries give the same answers from memory and from disk."""
    kinds = ["param_grad", "grad_output", "param", "update", "grad_cosine"]
    monitors = []
    for store in (None, tmp_path / "run"):
        torch.manual_seed(0)
        model = _Net()
        mon = gt.Monitor(model, kinds=kinds, stats=("norm", "std", "min"), ewma=0.5,
                         hist_bins=4, every=every, store=store, meta={"tag": ("x", 1)})
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            model(torch.randn(3, 3, generator=g)).square().sum().backward()
            mon.step()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        mon.close()
        monitors.append(mon)
    memory, stored = monitors
    assert memory.run is None and stored.run is not None
    assert_equal(memory.frame(), stored.frame())
    assert_equal(memory.frame(names="fc1.*", kinds="update"), stored.frame(names="fc1.*", kinds="update"))
    history, run = memory._history(), stored.run
    for prop in ("steps", "names", "kinds", "stats", "status", "ewma", "histogram_names"):
        assert_equal(getattr(history, prop)() if prop == "histogram_names" else getattr(history, prop),
                     getattr(run, prop)() if prop == "histogram_names" else getattr(run, prop))
    for kind, name in run.histogram_names():
        assert_equal(memory.histogram(name, kind), stored.histogram(name, kind))
    a, b = history.meta, run.meta
    for key in ("start_time", "end_time"):
        a.pop(key), b.pop(key)
    assert_equal(a, b)
    assert run.meta["tag"] == ["x", 1]
