"""The run store at scale: does ``mon.step()`` cost the same at step 100,000 as at step 1,000?

For each tensor count, a parameter-only model (``--numel`` elements per tensor) gets its
``p.grad`` from a pool of pre-drawn gradients (scaled by a factor per step), so ``mon.step()`` (default stats, a store) is
all that is timed, one thread. Printed per tensor count:

* the median ``mon.step()`` over an early window (steps 1,000-2,000, or the run's second
  tenth when shorter) and over the run's last 1,000 steps (or last tenth), and the median
  extrapolated to step 100,000 from a straight line through the medians of ten equal windows
  (how much the cost grows per 1,000 steps);
* the ratio of a step at the run's end (steps ``--steps`` on) to a step of a fresh Monitor on
  the same model (steps 0 on), the two alternating for ``--paired`` steps each, the order
  swapped every step: median and quartiles of the paired ratios (drift of a loaded machine
  cancels; 1.0 is flat);
* bytes per stored value (the run directory's size after ``close()`` over the values stored);
* write amplification: bytes the process wrote over the ``--steps`` steps (``/proc/self/io``:
  ``wchar``, the bytes handed to ``write``; ``write_bytes``, those sent to the block layer)
  over the store's size after them;
* the time to read one series (``Run.series``) and the run's steps (``Run.steps``);
* the same values appended again by ``RunWriter.write_step`` alone (the store's share of a
  step, read back from the store, over every step), and written per step to TensorBoard (``SummaryWriter.add_scalar``, one call per
  value, over the first ``--compare-steps`` steps) and to Parquet (``pyarrow``, long format
  ``step, series, value``, one row group per ``--row-group`` steps, over every step): the cost
  per step and the bytes per value.

``--read-store`` also writes a store of ``--read-tensors`` x 5 stats x ``--read-steps`` values
with ``RunWriter`` (no Monitor: it only has to exist) and times one series, ``Run.steps``,
``Run.names`` and ``gradtap runs`` on it.

Run: ``python benchmarks/store_scale.py --tensors 50,300,1000 --steps 20000 --read-store``
(short: ``--tensors 50 --steps 3000 --compare-steps 200``; ``--quick``: seconds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import gradtap as gt
from gradtap.store import DB_NAME, RunWriter

STATS = 5  # the Monitor's default stats: norm, mean, std, absmax, nonfinite


def io_counters() -> dict[str, int]:
    """``wchar`` and ``write_bytes`` of this process."""
    with open("/proc/self/io") as f:
        rows = dict(line.split(": ") for line in f.read().splitlines())
    return {"wchar": int(rows["wchar"]), "write_bytes": int(rows["write_bytes"])}


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Params(nn.Module):
    """``n`` parameter tensors of ``numel`` elements, no forward: gradients are set by hand."""

    def __init__(self, n: int, numel: int) -> None:
        super().__init__()
        self.p = nn.ParameterList(nn.Parameter(torch.zeros(numel)) for _ in range(n))


def windows(times: np.ndarray) -> tuple[tuple[int, int], tuple[int, int]]:
    n = len(times)
    early = (1000, 2000) if n >= 4000 else (n // 10, 2 * n // 10)
    late = (n - 1000, n) if n >= 4000 else (n - n // 10, n)
    return early, late


def extrapolate(times: np.ndarray, at: int = 100_000) -> tuple[float, float]:
    """(growth of the median per 1,000 steps, the median extrapolated to step ``at``), from a
    least-squares line through the medians of ten equal windows after the first tenth."""
    n = len(times)
    edges = np.linspace(n // 10, n, 11).astype(int)
    mids = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    meds = [float(np.median(times[a:b])) for a, b in zip(edges[:-1], edges[1:])]
    slope, icept = np.polyfit(mids, meds, 1)
    return float(slope * 1000), float(icept + slope * at)


def stored_values(run_dir: Path) -> int:
    with sqlite3.connect(run_dir / DB_NAME) as conn:
        sizes = {i: len(b) // 4 for i, b in conn.execute("SELECT id, series_ids FROM layouts")}
        return sum(n * sizes[lid] for n, lid in conn.execute("SELECT n_steps, layout_id FROM chunks"))


def bench_monitor(n: int, steps: int, numel: int, work: Path, paired: int,
                  pool: int = 8) -> dict:
    torch.manual_seed(0)
    model = Params(n, numel)
    params = list(model.parameters())
    grads = [[torch.randn(numel) for _ in params] for _ in range(pool)]
    # a scale per step (outside the timed call), so no two steps store the same values
    scales = np.exp(np.random.default_rng(0).standard_normal(steps) * 0.1).tolist()
    run_dir = work / f"gradtap-{n}"
    times = np.empty(steps)
    before = io_counters()
    mon = gt.Monitor(model, store=run_dir)

    def step(m: gt.Monitor, ps: list[nn.Parameter], s: int) -> float:
        for p, g in zip(ps, torch._foreach_mul(grads[s % pool], scales[s % steps])):
            p.grad = g
        t0 = time.perf_counter()
        m.step()
        return time.perf_counter() - t0

    for s in range(steps):
        times[s] = step(mon, params, s)
    after = io_counters()
    size_then = du(run_dir)
    # The same model at step `steps` beside a fresh one at step 0, steps alternating (the order
    # swapped every step): drift of a shared machine hits both alike.
    fresh = Params(n, numel)
    fresh_params = list(fresh.parameters())
    fresh_mon = gt.Monitor(fresh, store=work / f"fresh-{n}")
    old_t, new_t = [], []
    for s in range(paired):
        if s % 2:
            old_t.append(step(mon, params, steps + s))
            new_t.append(step(fresh_mon, fresh_params, s))
        else:
            new_t.append(step(fresh_mon, fresh_params, s))
            old_t.append(step(mon, params, steps + s))
    fresh_mon.close()
    shutil.rmtree(work / f"fresh-{n}")
    mon.close()
    size = du(run_dir)
    values = stored_values(run_dir)
    ratio = np.array(old_t) / np.array(new_t)
    q1, q3 = np.percentile(ratio, [25, 75])
    early, late = windows(times)
    growth, at_100k = extrapolate(times)
    run = gt.open_run(run_dir)
    t0 = time.perf_counter()
    s, v = run.series(f"p.{n // 2}", "norm")
    t_series = time.perf_counter() - t0
    assert len(s) == steps + paired
    t0 = time.perf_counter()
    assert len(run.steps) == steps + paired
    t_steps = time.perf_counter() - t0
    return {
        "early": early, "late": late, "early_ms": 1e3 * float(np.median(times[slice(*early)])),
        "late_ms": 1e3 * float(np.median(times[slice(*late)])),
        "growth_ms": 1e3 * growth, "at_100k_ms": 1e3 * at_100k,
        "mean_ms": 1e3 * float(times.mean()), "bytes_per_value": size / values,
        "wchar_x": (after["wchar"] - before["wchar"]) / size_then,
        "write_bytes_x": (after["write_bytes"] - before["write_bytes"]) / size_then,
        "paired": f"{float(np.median(ratio)):.3f} [{q1:.2f}, {q3:.2f}]",
        "size_mb": size / 2**20, "values": values, "series_ms": 1e3 * t_series,
        "steps_ms": 1e3 * t_steps, "run_dir": run_dir,
    }


def step_values(run_dir: Path, steps: int):
    """``(step, series ids, values)`` of the first ``steps`` stored steps, read back from the
    store, and the series' TensorBoard tags by id."""
    run = gt.open_run(run_dir)
    tags = np.array([f"{k}/{n}/{s}" for n, k, s in run.series_keys()], dtype=object)
    done = 0
    for st, ids, vals in run.iter_arrays():
        cuts = np.flatnonzero(np.diff(st)) + 1
        for a, b in zip([0, *cuts], [*cuts, len(st)]):
            yield int(st[a]), tags[ids[a:b]], ids[a:b], vals[a:b]
            done += 1
            if done == steps:
                return


def bench_tensorboard(run_dir: Path, steps: int, work: Path) -> dict:
    from torch.utils.tensorboard import SummaryWriter

    log_dir = work / f"tb-{run_dir.name}"
    writer = SummaryWriter(str(log_dir))
    times, count = [], 0
    before = io_counters()
    for step, tags, _, vals in step_values(run_dir, steps):
        t0 = time.perf_counter()
        for tag, v in zip(tags.tolist(), vals.tolist()):
            writer.add_scalar(tag, v, step)
        times.append(time.perf_counter() - t0)
        count += len(vals)
    t0 = time.perf_counter()
    writer.close()
    close_s = time.perf_counter() - t0
    after = io_counters()
    size = du(log_dir)
    return {"step_ms": 1e3 * statistics.median(times),
            "mean_ms": 1e3 * (sum(times) + close_s) / len(times), "bytes_per_value": size / count,
            "write_bytes_x": (after["write_bytes"] - before["write_bytes"]) / size,
            "steps": len(times)}


def bench_runwriter(run_dir: Path, steps: int, work: Path) -> dict:
    """The same values appended again with ``RunWriter.write_step`` (the store's own cost)."""
    out = RunWriter(work / f"again-{run_dir.name}", {})
    keys = gt.open_run(run_dir).series_keys()
    times, seen = [], 0
    for step, _, ids, vals in step_values(run_dir, steps):
        top = int(ids.max()) + 1
        new = [(i, *keys[i]) for i in range(seen, top)] if top > seen else []
        seen = max(seen, top)
        t0 = time.perf_counter()
        out.write_step(step, new, ids, vals)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out.close()
    close_s = time.perf_counter() - t0
    shutil.rmtree(work / f"again-{run_dir.name}")
    return {"step_ms": 1e3 * statistics.median(times),
            "mean_ms": 1e3 * (sum(times) + close_s) / len(times)}


def bench_parquet(run_dir: Path, steps: int, row_group: int, work: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("step", pa.int64()), ("series", pa.int32()), ("value", pa.float64())])
    path = work / f"{run_dir.name}.parquet"
    writer = pq.ParquetWriter(path, schema)
    times, count = [], 0
    buf: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    before = io_counters()
    for step, _, ids, vals in step_values(run_dir, steps):
        sid = ids.astype(np.int32)
        t0 = time.perf_counter()
        buf.append((np.full(len(vals), step, dtype=np.int64), sid, np.asarray(vals)))
        if len(buf) == row_group:
            cols = [np.concatenate(c) for c in zip(*buf)]
            writer.write_table(pa.Table.from_arrays(cols, schema=schema))
            buf = []
        times.append(time.perf_counter() - t0)
        count += len(vals)
    t0 = time.perf_counter()
    if buf:
        writer.write_table(pa.Table.from_arrays([np.concatenate(c) for c in zip(*buf)],
                                                schema=schema))
    writer.close()
    close_s = time.perf_counter() - t0
    after = io_counters()
    size = path.stat().st_size
    return {"step_ms": 1e3 * statistics.median(times),
            "mean_ms": 1e3 * (sum(times) + close_s) / len(times), "bytes_per_value": size / count,
            "write_bytes_x": (after["write_bytes"] - before["write_bytes"]) / size,
            "steps": len(times)}


def bench_read_store(n: int, steps: int, work: Path) -> dict:
    """A store of ``n`` tensors x 5 stats x ``steps`` written by RunWriter, then read."""
    from gradtap.report import list_runs

    run_dir = work / f"read-{n}x{steps}"
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((8, n * STATS))
    ids = np.arange(n * STATS)
    new = [(i, f"layer{i // STATS:04d}.weight", "param_grad",
            ("norm", "mean", "std", "absmax", "nonfinite")[i % STATS]) for i in ids.tolist()]
    t0 = time.perf_counter()
    w = RunWriter(run_dir, {})
    for s in range(steps):
        w.write_step(s, new if s == 0 else [], ids, pool[s % 8] + s)
    w.close()
    write_s = time.perf_counter() - t0
    out = {"write_s": write_s, "size_gb": du(run_dir) / 2**30}
    run = gt.open_run(run_dir)
    t0 = time.perf_counter()
    s, v = run.series(f"layer{n // 2:04d}.weight", "norm")
    out["series_s"] = time.perf_counter() - t0
    assert len(s) == steps and v[-1] == pool[(steps - 1) % 8][n // 2 * STATS] + steps - 1
    t0 = time.perf_counter()
    again = gt.open_run(run_dir).series(f"layer{n // 3:04d}.weight", "absmax")
    out["series_fresh_s"] = time.perf_counter() - t0
    assert len(again[0]) == steps
    for what, f in (("steps_s", lambda: gt.open_run(run_dir).steps),
                    ("names_s", lambda: gt.open_run(run_dir).names),
                    ("runs_s", lambda: list_runs(work))):
        t0 = time.perf_counter()
        f()
        out[what] = time.perf_counter() - t0
    shutil.rmtree(run_dir)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, to check the script works (20 tensors, 300 steps)")
    ap.add_argument("--tensors", default="50,300,1000", help="comma-separated tensor counts")
    ap.add_argument("--steps", type=int, default=20_000, help="Monitor steps per tensor count")
    ap.add_argument("--numel", type=int, default=64, help="elements per tensor")
    ap.add_argument("--paired", type=int, default=2000,
                    help="steps of the run's end alternated with a fresh Monitor's first ones")
    ap.add_argument("--compare-steps", type=int, default=300,
                    help="steps written to TensorBoard (one add_scalar per value)")
    ap.add_argument("--row-group", type=int, default=1000, help="steps per Parquet row group")
    ap.add_argument("--read-store", action="store_true",
                    help="also time reads of a generated --read-tensors x --read-steps store")
    ap.add_argument("--read-tensors", type=int, default=1000)
    ap.add_argument("--read-steps", type=int, default=100_000)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tensors, args.steps, args.compare_steps, args.row_group = "20", 300, 10, 100
        args.paired = 50
        args.read_store, args.read_tensors, args.read_steps = True, 20, 500
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="store-scale-", dir=args.dir))
    print(f"torch {torch.__version__}, gradtap {gt.__version__}, 1 thread, {os.cpu_count()} "
          f"CPUs, scratch {work}")
    try:
        print("\n| tensors | steps | `mon.step()` early (steps) | late (steps) | growth per 1,000 "
              "steps | extrapolated to step 100,000 | late / fresh, alternated: median [quartiles] | B/value | written / store (wchar, "
              "write_bytes) | one series | `Run.steps` | `RunWriter.write_step` per step (mean) | "
              "TensorBoard per step, B/value | Parquet per step (mean), B/value |")
        print("|" + "---|" * 14)
        for n in [int(x) for x in args.tensors.split(",")]:
            r = bench_monitor(n, args.steps, args.numel, work, args.paired)
            rw = bench_runwriter(r["run_dir"], args.steps, work)
            tb = bench_tensorboard(r["run_dir"], args.compare_steps, work)
            pq = bench_parquet(r["run_dir"], args.steps, args.row_group, work)
            print(f"| {n} | {args.steps} | {r['early_ms']:.2f} ms ({r['early'][0]}-{r['early'][1]}) "
                  f"| {r['late_ms']:.2f} ms ({r['late'][0]}-{r['late'][1]}) "
                  f"| {r['growth_ms']:+.3f} ms | {r['at_100k_ms']:.2f} ms | {r['paired']} "
                  f"| {r['bytes_per_value']:.2f} | {r['wchar_x']:.2f}x, {r['write_bytes_x']:.2f}x "
                  f"| {r['series_ms']:.1f} ms | {r['steps_ms']:.1f} ms "
                  f"| {rw['step_ms']:.3f} ms ({rw['mean_ms']:.3f} ms) "
                  f"| {tb['step_ms']:.1f} ms, {tb['bytes_per_value']:.1f} "
                  f"| {pq['step_ms']:.3f} ms ({pq['mean_ms']:.3f} ms), {pq['bytes_per_value']:.2f} |",
                  flush=True)
            shutil.rmtree(r["run_dir"])
        if args.read_store:
            r = bench_read_store(args.read_tensors, args.read_steps, work)
            print(f"\nread store: {args.read_tensors} tensors x {STATS} stats x {args.read_steps} "
                  f"steps, {r['size_gb']:.2f} GiB, written in {r['write_s']:.0f} s: one series "
                  f"{r['series_s']:.3f} s (a fresh Run: {r['series_fresh_s']:.3f} s), Run.steps "
                  f"{r['steps_s']:.3f} s, Run.names {r['names_s']:.3f} s, gradtap runs "
                  f"{r['runs_s']:.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
