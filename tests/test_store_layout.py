"""The run store's layout: step records appended to a log, compacted into series-major chunks.

Oracle: the arrays handed to ``RunWriter.write_step``, kept beside the store in a dict.
"""

from __future__ import annotations

import json
import math
import sqlite3
import textwrap

import numpy as np
import pandas as pd
import pytest

import gradtap as gt
from gradtap.errors import StoreError
from gradtap.store import DB_NAME, RunWriter
from gradtap.store._common import VALUES_NAME, segment_name
from tests._killed import printed_until_killed

SERIES = [(i, f"layer{i // 2}.{'weight' if i % 2 == 0 else 'bias'}", "param_grad",
           ("norm", "absmax")[i // 10 % 2]) for i in range(20)]


def step_rows(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids and values of a step: the layout changes (series 12-19 join at step 5, series 3
    is missing at every 4th step), NaN with odd payloads, -NaN, +-Inf and -0.0 appear."""
    ids = [i for i in range(12 if step < 5 else 20) if not (i == 3 and step % 4 == 0)]
    ids = ids[::-1] if step % 2 else ids  # not in id order
    rng = np.random.default_rng(step)
    values = rng.standard_normal(len(ids)) * 10.0 ** rng.integers(-30, 30, len(ids))
    if step % 3 == 0:
        values[0] = math.nan
        values[1] = np.array([0x7FF8_0000_DEAD_BEEF], dtype=np.uint64).view(np.float64)[0]
        values[2] = -math.nan
    if step % 5 == 1:
        values[-1], values[-2], values[-3] = math.inf, -math.inf, -0.0
    return np.array(ids, dtype=np.int64), values


def write(path, steps, chunk_steps, close=True):
    w = RunWriter(path, {"note": "layout"}, chunk_steps=chunk_steps)
    oracle: dict[tuple[int, int], float] = {}
    seen: set[int] = set()
    for s in steps:
        ids, values = step_rows(s)
        new = [SERIES[i] for i in range(int(ids.max()) + 1) if i not in seen]  # ids in order
        seen.update(i for i, *_ in new)
        w.write_step(s, new, ids, values, wall_time=1000.0 + s)
        for i, v in zip(ids.tolist(), values.tolist()):
            oracle[(s, i)] = v
    if close:
        w.close()
    return w, oracle


def check(run, oracle, steps):
    assert run.steps == list(steps)
    assert run.wall_times() == {s: 1000.0 + s for s in steps}
    st, ids, values, series = run.arrays()
    assert run.series_keys() == series == [s[1:] for s in SERIES[: len(series)]]
    expected = sorted(oracle)
    assert list(zip(st.tolist(), ids.tolist())) == expected
    want = np.array([oracle[k] for k in expected])
    # exact: the same float64 bits, except that every NaN reads as a NaN
    nan = np.isnan(want)
    assert (np.isnan(values) == nan).all()
    np.testing.assert_array_equal(values[~nan].view(np.uint64), want[~nan].view(np.uint64))
    for sid, (name, kind, stat) in enumerate(series):
        s, v = run.series(name, stat, kind)
        mine = [(k[0], oracle[k]) for k in expected if k[1] == sid]
        assert s.tolist() == [k for k, _ in mine]
        np.testing.assert_array_equal(v, np.array([x for _, x in mine]))
    pieces_np = list(run.iter_arrays())
    for got, whole in zip(zip(*pieces_np), (st, ids, values)):
        np.testing.assert_array_equal(np.concatenate(got), whole)
    assert run.step_array().dtype == np.int64 and run.step_array().tolist() == list(steps)
    frame = run.frame()
    pieces = list(run.iter_frames())
    pd.testing.assert_frame_equal(pd.concat(pieces, ignore_index=True), frame)
    part = run.frame(names="layer1.*", stats="norm")
    assert set(part["name"]) <= {"layer1.weight", "layer1.bias"} and len(part)
    pd.testing.assert_frame_equal(
        part, frame[(frame["name"].str.startswith("layer1.")) & (frame["stat"] == "norm")]
        .reset_index(drop=True))


@pytest.mark.parametrize("n_steps", [1, 6, 7, 8, 23])
def test_values_round_trip_exactly_across_chunk_boundaries(tmp_path, n_steps):
    steps = range(0, 2 * n_steps, 2)
    w, oracle = write(tmp_path / "run", steps, chunk_steps=7, close=False)
    live = gt.open_run(tmp_path / "run")
    check(live, oracle, steps)  # chunks and the log of the last, partial chunk
    logs = sorted(p.name for p in (tmp_path / "run").glob("rows-*.log"))
    assert logs == ([segment_name(n_steps // 7)] if n_steps % 7 else [])
    w.close()
    check(live, oracle, steps)  # the same Run object, after compaction
    check(gt.open_run(tmp_path / "run"), oracle, steps)
    files = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert files == [DB_NAME, VALUES_NAME]
    size = (tmp_path / "run" / VALUES_NAME).stat().st_size
    with sqlite3.connect(tmp_path / "run" / DB_NAME) as conn:
        chunks = conn.execute("SELECT n_steps FROM chunks ORDER BY id").fetchall()
    assert [c[0] for c in chunks] == [7] * (n_steps // 7) + ([n_steps % 7] if n_steps % 7 else [])
    # a chunk is (its series) x (its steps) float64 values, nothing more
    chunked = [list(steps)[i:i + 7] for i in range(0, n_steps, 7)]
    expect = sum(8 * len(c) * len({i for s, i in oracle if s in c}) for c in chunked)
    assert size == expect


def test_default_chunks_of_a_generated_store_read_by_series(tmp_path):
    rng = np.random.default_rng(0)
    n, steps = 300, 5000  # 3,495 steps per chunk: one whole chunk, one partial
    table = rng.standard_normal((steps, n))
    w = RunWriter(tmp_path / "run", {})
    ids = np.arange(n)
    new = [(i, f"t{i:03d}", "param_grad", "norm") for i in range(n)]
    for s in range(steps):
        w.write_step(s, new if s == 0 else [], ids, table[s])
    w.close()
    run = gt.open_run(tmp_path / "run")
    for i in (0, 137, n - 1):
        s, v = run.series(f"t{i:03d}", "norm")
        assert s.tolist() == list(range(steps))
        np.testing.assert_array_equal(v, table[:, i])
    size = (tmp_path / "run" / VALUES_NAME).stat().st_size
    assert size == 8 * n * steps


def test_old_schema_store_opens(tmp_path):
    """A store of schema 1 (all in SQLite, one row per value), written as the old writer did."""
    (tmp_path / "old").mkdir()
    conn = sqlite3.connect(tmp_path / "old" / DB_NAME)
    conn.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE series (id INTEGER PRIMARY KEY, name TEXT NOT NULL, kind TEXT NOT NULL,
                             stat TEXT NOT NULL, UNIQUE (name, kind, stat));
        CREATE TABLE steps (step INTEGER PRIMARY KEY, wall_time REAL NOT NULL);
        CREATE TABLE scalars (step INTEGER NOT NULL, series_id INTEGER NOT NULL, value REAL,
                              PRIMARY KEY (step, series_id)) WITHOUT ROWID;
        CREATE INDEX scalars_by_series ON scalars (series_id, step);
        CREATE TABLE histograms (step INTEGER NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL,
                                 counts BLOB NOT NULL, PRIMARY KEY (step, kind, name)) WITHOUT ROWID;
        CREATE TABLE ewma (name TEXT PRIMARY KEY, beta REAL NOT NULL, updates INTEGER NOT NULL,
                           numel INTEGER NOT NULL, shape TEXT NOT NULL, mean_norm REAL,
                           mean_absmax REAL, var_mean REAL, var_max REAL);
        PRAGMA application_id = 1735684145;
        PRAGMA user_version = 1;
    """)
    meta = {"status": "finished", "schema_version": 1, "histogram": {"edges": [0.0, 1.0, 2.0]}}
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
    conn.executemany("INSERT INTO series VALUES (?, ?, ?, ?)",
                     [(0, "w", "param_grad", "norm"), (1, "b", "param_grad", "norm"),
                      (2, "w", "update", "ratio")])
    conn.executemany("INSERT INTO steps VALUES (?, ?)", [(0, 10.0), (1, 11.0), (2, 12.0)])
    conn.executemany("INSERT INTO scalars VALUES (?, ?, ?)",
                     [(0, 0, 1.5), (0, 1, 0.25), (1, 0, None), (1, 1, math.inf), (1, 2, 0.1),
                      (2, 0, 2.5), (2, 2, 0.2)])
    conn.executemany("INSERT INTO histograms VALUES (?, ?, ?, ?)",
                     [(s, "param_grad", "w", np.array([s, 1], dtype="<i8").tobytes())
                      for s in range(3)])
    conn.commit()
    conn.close()
    run = gt.open_run(tmp_path / "old")
    assert run.schema_version == 1 and run.status == "finished"
    assert run.steps == [0, 1, 2] and run.wall_times() == {0: 10.0, 1: 11.0, 2: 12.0}
    assert run.names == ["b", "w"] and run.kinds == ["param_grad", "update"]
    s, v = run.series("w", "norm")
    assert s.tolist() == [0, 1, 2] and v[0] == 1.5 and math.isnan(v[1]) and v[2] == 2.5
    steps, ids, values, series = run.arrays(stats="norm")
    assert steps.tolist() == [0, 0, 1, 1, 2] and ids.tolist() == [0, 1, 0, 1, 0]
    assert series[2] == ("w", "update", "ratio") and values[3] == math.inf
    assert len(run.frame()) == 7 and len(pd.concat(run.iter_frames())) == 7
    assert run.histogram("w").counts.tolist() == [[0, 1], [1, 1], [2, 1]]


def test_torn_and_leftover_files_are_read_as_a_kill_leaves_them(tmp_path, monkeypatch):
    steps = range(10)
    # a kill after a chunk's catalogue commit, before its log was removed: the log stays
    real_unlink = type(tmp_path).unlink
    monkeypatch.setattr(type(tmp_path), "unlink",
                        lambda self, missing_ok=False: None if self.suffix == ".log"
                        else real_unlink(self, missing_ok))
    w, oracle = write(tmp_path / "run", steps, chunk_steps=4, close=False)
    monkeypatch.undo()
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in run_dir.glob("*.log")) == [segment_name(i) for i in range(3)]
    check(gt.open_run(run_dir), oracle, steps)
    # a kill in the middle of a record: the torn record (and what follows) is not a step
    log = run_dir / segment_name(2)
    data = log.read_bytes()
    ids, values = step_rows(10)
    from gradtap.store._common import encode_record
    record = encode_record(10, 1010.0, ids, values)
    log.write_bytes(data + record[: len(record) // 2])
    check(gt.open_run(run_dir), oracle, steps)
    # a record whose bytes were damaged fails its CRC
    bad = bytearray(data + record)
    bad[len(data) + 40] ^= 0xFF
    log.write_bytes(bytes(bad))
    check(gt.open_run(run_dir), oracle, steps)
    # a kill after the chunk's bytes were written, before its catalogue row: nothing reads them
    with open(run_dir / VALUES_NAME, "ab") as f:
        f.write(b"\x00" * 1000)
    check(gt.open_run(run_dir), oracle, steps)
    w._conn.close()  # the "killed" writer


KILLED = textwrap.dedent("""
    import sys
    import numpy as np
    from gradtap.store import RunWriter

    w = RunWriter(sys.argv[1], {}, chunk_steps=7)
    ids = np.arange(50)
    new = [(i, f"t{i}", "param_grad", "norm") for i in range(50)]
    step = 0
    while True:
        w.write_step(step, new if step == 0 else [], ids, np.arange(50) * 1000.0 + step)
        print(step, flush=True)  # step is stored
        step += 1
""")


def test_sigkill_mid_chunk_loses_no_written_step(tmp_path):
    script = tmp_path / "write.py"
    script.write_text(KILLED)
    printed = printed_until_killed(script, tmp_path / "run", 200)
    run = gt.open_run(tmp_path / "run")
    steps = run.steps
    assert steps[: len(printed)] == printed and steps == list(range(len(steps)))
    assert len(steps) <= len(printed) + 1
    st, ids, values, _ = run.arrays()
    assert len(values) == 50 * len(steps)
    np.testing.assert_array_equal(values, ids * 1000.0 + st)


def test_write_step_errors(tmp_path):
    w = RunWriter(tmp_path / "run", {})
    w.write_step(3, [(0, "w", "param_grad", "norm")], np.array([0]), np.array([1.0]))
    with pytest.raises(StoreError, match="step 3 written after step 3: steps of a run store "
                                         "must increase"):
        w.write_step(3, [], np.array([0]), np.array([1.0]))
    with pytest.raises(StoreError, match="got 2 series ids for 1 values"):
        w.write_step(4, [], np.array([0, 1]), np.array([1.0]))
    with pytest.raises(StoreError, match="chunk_steps must be a positive int, got 0"):
        RunWriter(tmp_path / "other", {}, chunk_steps=0)
    w.close()
    with pytest.raises(StoreError, match="was closed"):
        w.write_step(5, [], np.array([0]), np.array([1.0]))
    assert gt.open_run(tmp_path / "run").steps == [3]


def test_cli_inspect_and_runs_on_a_run_directory(tmp_path, capsys):
    from gradtap.cli import main

    steps = range(0, 20, 2)
    write(tmp_path / "runs" / "a", steps, chunk_steps=4)
    assert main(["inspect", str(tmp_path / "runs" / "a")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "steps       10 (0-18)" in out and "tensors     20" in out
    assert "status      finished" in out and "stats       absmax, norm" in out
    (tmp_path / "plain").mkdir()
    assert main(["inspect", str(tmp_path / "plain")]) == 2
    err = capsys.readouterr().err
    assert "is a directory but not a run directory (it holds no run.db)" in err
    assert main(["runs", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[1:4] == ["10", "18", "-"] and lines[2].endswith("finished")
