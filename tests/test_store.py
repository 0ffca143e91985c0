"""The run store: round trip, crash safety (SIGKILL), schema checks, filters, TensorBoard."""

from __future__ import annotations

import json
import math
import sqlite3
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap import _tensorops as ops
from gradtap.errors import StoreError
from gradtap.export import export_tensorboard
from gradtap.store import DB_NAME, SCHEMA_VERSION
from gradtap.store._common import VALUES_NAME
from tests._killed import printed_until_killed

ALL_STATS = ops.STAT_NAMES
KINDS = ("param_grad", "param", "update", "grad_cosine", "grad_output")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def run_monitor(store=None, steps=4, **kwargs):
    """Train a tiny net with a fixed seed; a NaN and an Inf appear in the gradients at step 2."""
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    mon = gt.Monitor(model, store=store, **kwargs)
    for step in range(steps):
        model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        if step == 2:
            model.fc1.weight.grad[0, 0] = math.nan
            model.fc2.bias.grad[1] = -math.inf
        mon.step()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * torch.nan_to_num(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
                p.grad = None
    return mon


FULL = {"stats": ALL_STATS, "kinds": KINDS, "ewma": 0.9, "hist_bins": 8,
        "meta": {"experiment": "round trip"}}


# -- round trip ------------------------------------------------------------------------------


def test_store_round_trip_equals_the_in_memory_monitor(tmp_path):
    memory = run_monitor(**FULL)
    memory.close()
    stored = run_monitor(store=tmp_path / "run", **FULL)
    live = stored.frame()  # read back while the run is open
    stored.close()
    run = gt.open_run(tmp_path / "run")
    expected = memory.frame()
    assert len(expected) > 100 and expected["value"].isna().any()
    assert np.isinf(expected["value"]).any()
    pd.testing.assert_frame_equal(run.frame(), expected)
    pd.testing.assert_frame_equal(stored.frame(), expected)
    pd.testing.assert_frame_equal(live, expected)
    assert run.steps == [0, 1, 2, 3]
    assert run.names == sorted(set(expected["name"]))
    assert run.kinds == sorted(KINDS)
    assert run.stats == sorted([*ALL_STATS, "ratio", "cosine"])
    for kind, name in run.histogram_names():
        edges, counts = run.histogram(name, kind)
        m_edges, m_counts = memory.histogram(name, kind)
        np.testing.assert_array_equal(edges, m_edges)
        np.testing.assert_array_equal(counts, m_counts)
        np.testing.assert_array_equal(run.histogram(name, kind).steps,
                                      memory.histogram(name, kind).steps)
    assert {k for k, _ in run.histogram_names()} == {"param_grad", "param", "update", "grad_output"}
    steps, values = run.series("fc1.weight", "nonfinite")
    assert steps.tolist() == [0, 1, 2, 3] and values.tolist() == [0, 0, 1, 0]


def test_meta_and_ewma_summaries(tmp_path):
    mon = run_monitor(store=tmp_path / "run", **FULL)
    mean, var = mon.ewma_mean("fc2.weight"), mon.ewma_var("fc2.weight")
    fc1 = mon.ewma_mean("fc1.weight")
    mon.close()
    run = gt.open_run(tmp_path / "run")
    meta = run.meta
    assert meta["status"] == "finished" and run.status == "finished"
    assert meta["schema_version"] == SCHEMA_VERSION
    assert meta["gradtap_version"] == gt.__version__ and meta["torch_version"] == torch.__version__
    assert meta["experiment"] == "round trip"
    assert meta["config"]["stats"] == list(ALL_STATS) and meta["config"]["ewma"] == 0.9
    assert meta["selected"]["parameters"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert meta["selected"]["modules"] == ["fc1", "fc2"]
    assert meta["model"]["class"] == "Net" and meta["model"]["num_parameters"] == 44
    assert meta["start_time"] <= meta["end_time"]
    assert len(meta["histogram"]["edges"]) == 9
    ewma = run.ewma["fc2.weight"]
    assert ewma["shape"] == [2, 6] and ewma["updates"] == 4 and ewma["beta"] == 0.9
    assert ewma["mean_norm"] == pytest.approx(float(mean.norm()), rel=1e-6)
    assert ewma["var_max"] == pytest.approx(float(var.max()), rel=1e-6)
    # The NaN gradient of one step left its elements' EWMA as it was: still finite.
    assert torch.isfinite(fc1).all()
    assert run.ewma["fc1.weight"]["mean_norm"] == pytest.approx(float(fc1.norm()), rel=1e-6)


def test_frame_filters_and_their_errors(tmp_path):
    run_monitor(store=tmp_path / "run", **FULL).close()
    run = gt.open_run(tmp_path / "run")
    df = run.frame(names="fc1.*", stats=["norm", "mean"], kinds="param_grad")
    assert set(df["name"]) == {"fc1.weight", "fc1.bias"} and set(df["stat"]) == {"norm", "mean"}
    assert set(df["kind"]) == {"param_grad"} and len(df) == 4 * 2 * 2
    assert set(run.frame(names=["fc2:output"])["kind"]) == {"grad_output"}
    assert run.frame(stats="cosine", kinds="param").empty
    with pytest.raises(ValueError, match="unknown stat name.*'nrom'.*valid stats are: norm"):
        run.frame(stats="nrom")
    with pytest.raises(ValueError, match="unknown kind name.*valid kinds are: param_grad"):
        run.frame(kinds="grads")
    with pytest.raises(gt.SelectionError, match="names='fc3.*' matches no recorded name"):
        run.frame(names="fc3.*")
    with pytest.raises(KeyError, match="close names: fc1.weight"):
        run.series("fc1.weigth", "norm")


def test_histogram_of_a_run_without_histograms(tmp_path):
    run_monitor(store=tmp_path / "run").close()
    with pytest.raises(KeyError, match=r"no histograms \(hist_bins=None\)"):
        gt.open_run(tmp_path / "run").histogram("fc1.weight")


def test_only_completed_steps_and_wall_times(tmp_path):
    mon = run_monitor(store=tmp_path / "run", every=2, steps=5)
    run = gt.open_run(tmp_path / "run")
    assert run.steps == [0, 2, 4] and run.status == "running"
    assert sorted(run.wall_times()) == [0, 2, 4]
    mon.close()
    assert run.status == "finished"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [DB_NAME, VALUES_NAME]


# -- crash safety ----------------------------------------------------------------------------

TRAIN = textwrap.dedent("""
    import sys
    import torch
    import gradtap as gt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    mon = gt.Monitor(model, store=sys.argv[1], hist_bins=8, kinds=("param_grad", "grad_output"))
    step = 0
    while True:
        model(torch.randn(64, 8)).pow(2).mean().backward()
        mon.step()
        print(step, flush=True)  # step is committed
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
""")


def test_sigkill_mid_training_loses_no_completed_step(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    printed = printed_until_killed(script, tmp_path / "run", 30)
    run = gt.open_run(tmp_path / "run")
    assert run.meta["status"] == "running"  # never closed ...
    assert run.status == "killed"  # ... and its writer is gone
    steps = run.steps
    assert steps[: len(printed)] == printed  # every completed step is there ...
    assert steps == list(range(len(steps)))  # ... with no gap, at most one more than printed
    assert len(steps) <= len(printed) + 1
    df = run.frame()
    per_step = df.groupby("step").size()
    assert (per_step == per_step.iloc[0]).all()  # and each stored step is whole
    assert per_step.iloc[0] == (4 + 3) * 5  # 4 parameters + 3 module outputs, 5 stats
    edges, counts = run.histogram("0.weight")
    assert counts.shape == (len(steps), 8)


# -- store errors ----------------------------------------------------------------------------


def test_open_run_errors(tmp_path):
    with pytest.raises(StoreError, match="no run store at .* does not exist"):
        gt.open_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match=f"holds no {DB_NAME}"):
        gt.open_run(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    conn = sqlite3.connect(tmp_path / "other" / DB_NAME)
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    with pytest.raises(StoreError, match="not a gradtap run store"):
        gt.open_run(tmp_path / "other")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / DB_NAME).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="not a readable SQLite database|cannot open"):
        gt.open_run(tmp_path / "junk")


def test_unknown_schema_version_is_a_clear_error(tmp_path):
    run_monitor(store=tmp_path / "run").close()
    conn = sqlite3.connect(tmp_path / "run" / DB_NAME)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(StoreError, match=r"schema version 99, but this gradtap reads versions 1 to 2; "
                                         r"open it with the gradtap version that wrote it \(a "
                                         r"newer one\)"):
        gt.open_run(tmp_path / "run")
    assert isinstance(StoreError("x"), ValueError)


def test_existing_store_is_never_clobbered_unless_asked(tmp_path):
    run_monitor(store=tmp_path / "run", steps=3).close()
    model = Net()
    with pytest.raises(StoreError, match="already holds a run store.*overwrite=True"):
        gt.Monitor(model, store=tmp_path / "run")
    assert gt.open_run(tmp_path / "run").steps == [0, 1, 2]
    run_monitor(store=tmp_path / "run", steps=2, overwrite=True).close()
    assert gt.open_run(tmp_path / "run").steps == [0, 1]
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="is not a directory"):
        gt.Monitor(model, store=tmp_path / "file")


def test_open_run_accepts_the_database_path_and_is_read_only(tmp_path):
    run_monitor(store=tmp_path / "run").close()
    before = (tmp_path / "run" / DB_NAME).read_bytes()
    run = gt.open_run(tmp_path / "run" / DB_NAME)
    run.frame(), run.meta, run.steps, run.ewma, repr(run)
    assert (tmp_path / "run" / DB_NAME).read_bytes() == before


def test_meta_must_be_json(tmp_path):
    with pytest.raises(StoreError, match="JSON-serialisable"):
        gt.Monitor(Net(), store=tmp_path / "run", meta={"when": object()})


def test_missing_pandas_names_the_extra(tmp_path, monkeypatch):
    mon = run_monitor(store=tmp_path / "run", steps=1)
    mon.close()
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r'needs pandas.*pip install "gradtap\[pandas\]" \(from a clone: pip install -c constraints.txt "\.\[pandas\]"\)'):
        gt.open_run(tmp_path / "run").frame()
    with pytest.raises(ImportError, match=r'pip install "gradtap\[pandas\]"'):
        mon.frame()
    steps, ids, values, series = gt.open_run(tmp_path / "run").arrays()  # no pandas needed
    assert len(steps) == len(ids) == len(values) == 4 * 5 and len(series) == 20


# -- TensorBoard -----------------------------------------------------------------------------


def test_to_tensorboard_writes_every_scalar_and_histogram(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_monitor(store=tmp_path / "run", **FULL).close()
    run = gt.open_run(tmp_path / "run")
    out = gt.to_tensorboard(run, tmp_path / "tb")
    assert out == tmp_path / "tb"
    acc = EventAccumulator(str(out), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    steps, ids, values, series = run.arrays()
    tags = set(acc.Tags()["scalars"])
    assert tags == {f"{k}/{n}/{s}" for n, k, s in series}
    walls = run.wall_times()
    for sid, (name, kind, stat) in enumerate(series):
        events = acc.Scalars(f"{kind}/{name}/{stat}")
        mask = ids == sid
        assert [e.step for e in events] == steps[mask].tolist()
        assert [e.wall_time for e in events] == pytest.approx([walls[s] for s in steps[mask]])
        np.testing.assert_allclose([e.value for e in events], values[mask].astype(np.float32),
                                   rtol=0, equal_nan=True)
    hist_tags = set(acc.Tags()["histograms"])
    assert hist_tags == {f"{k}/{n}" for k, n in run.histogram_names()}
    edges, counts = run.histogram("fc1.weight")
    events = acc.Histograms("param_grad/fc1.weight")
    assert [e.step for e in events] == [0, 1, 2, 3]
    for e, c in zip(events, counts):
        assert e.histogram_value.num == c.sum()
        assert list(e.histogram_value.bucket) == c.tolist()
        assert list(e.histogram_value.bucket_limit) == edges[1:].tolist()
    message = export_tensorboard(tmp_path / "run", tmp_path / "tb2")
    assert message.startswith("wrote 4 steps of ") and "tensorboard --logdir" in message


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch):
    run_monitor(store=tmp_path / "run", steps=1).close()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r'needs tensorboard.*pip install "gradtap\[tensorboard\]"'):
        gt.to_tensorboard(tmp_path / "run", tmp_path / "tb")


def test_schema_document_matches_the_database(tmp_path):
    """docs/run-store.md lists every table and column the writer creates."""
    from pathlib import Path

    run_monitor(store=tmp_path / "run", steps=1).close()
    conn = sqlite3.connect(tmp_path / "run" / DB_NAME)
    tables = {r[0]: [c[1] for c in conn.execute(f"PRAGMA table_info({r[0]})")]
              for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    meta_keys = [r[0] for r in conn.execute("SELECT key FROM meta")]
    conn.close()
    doc = (Path(__file__).resolve().parent.parent / "docs" / "run-store.md").read_text()
    for table, columns in tables.items():
        assert f"`{table}`" in doc, table
        for column in columns:
            assert f"`{column}`" in doc, f"{table}.{column}"
    for key in meta_keys:
        assert f"`{key}`" in doc, f"meta key {key}"
    assert json.dumps(SCHEMA_VERSION) in doc


def test_cli_export_tensorboard(tmp_path, capsys):
    from gradtap.cli import main

    pytest.importorskip("torch.utils.tensorboard")
    run_monitor(store=tmp_path / "run", steps=2).close()
    assert main(["export-tensorboard", str(tmp_path / "run"), str(tmp_path / "tb")]) == 0
    assert capsys.readouterr().out.startswith("wrote 2 steps of ")
    assert any((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert main(["export-tensorboard", str(tmp_path / "missing"), str(tmp_path / "tb3")]) == 2
    assert "gradtap export-tensorboard: error:" in capsys.readouterr().err


def test_runs_and_anomalies_show_as_html_in_notebooks(tmp_path):
    mon = run_monitor(store=tmp_path / "run", **FULL)
    mon.close()
    run = gt.open_run(tmp_path / "run")
    page = run._repr_html_()
    assert f"<th>steps</th><td>{len(run.steps)} ({run.steps[0]}-{run.steps[-1]})</td>" in page
    assert f"<th>tensors</th><td>{len(run.names)}</td>" in page
    anomaly = gt.Anomaly("fc1", "nan", "forward", 2, None, "NaN in 'fc1' <here>")
    assert anomaly._repr_html_() == "<pre>NaN in &#x27;fc1&#x27; &lt;here&gt;</pre>"


def test_gradtap_runs_shows_a_killed_run_as_killed_and_a_live_one_as_running(tmp_path, capsys):
    from gradtap.cli import main
    from gradtap.store import RunWriter

    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    printed_until_killed(script, tmp_path / "killed", 3)
    live = RunWriter(tmp_path / "live", {})  # this process: alive
    try:
        assert main(["runs", str(tmp_path)]) == 0
        out = {line.split()[0].rsplit("/", 1)[-1]: line.split()[-1]
               for line in capsys.readouterr().out.splitlines() if str(tmp_path) in line}
        assert out == {"killed": "killed", "live": "running"}
        assert gt.open_run(tmp_path / "live").status == "running"
    finally:
        live.close()
    assert gt.open_run(tmp_path / "live").status == "finished"


def test_a_run_written_on_another_host_or_by_an_older_writer_keeps_its_status():
    from gradtap.store._common import live_status, writer_identity

    me = writer_identity()
    assert live_status({"status": "running", "writer": me}) == "running"
    assert live_status({"status": "running"}) == "running"  # stored before the writer was
    other = {**me, "host": me["host"] + "-elsewhere", "pid": 2 ** 22 + 7}
    assert live_status({"status": "running", "writer": other}) == "running"
    gone = {**me, "pid": 2 ** 22 + 7}  # above the kernel's pid_max: no such process
    assert live_status({"status": "running", "writer": gone}) == "killed"
    reused = {**me, "started": "1"}  # this pid, started at another time: another process
    assert live_status({"status": "running", "writer": reused}) == ("killed" if me["started"]
                                                                     else "running")
    assert live_status({"status": "finished", "writer": gone}) == "finished"
