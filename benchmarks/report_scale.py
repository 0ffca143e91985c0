"""The report at scale: ``gradtap report`` on a generated store of many tensors and steps.

Run: .venv/bin/python benchmarks/report_scale.py [--tensors 1000] [--steps 100000]
     [--stats norm,nonfinite] [--keep DIR] [--in-memory] [--quick]

Writes a run store with :class:`gradtap.store.RunWriter` (the Monitor's writer), as a Monitor
with ``stats=`` would: one ``norm`` per tensor and step (log-normal noise around a trend that
falls over the run, a different scale per tensor), ``nonfinite`` counts, and any other stat
asked for; planted in it: a one-step spike of 1000x in one tensor, a NaN in another and a
tensor ten times larger than the rest. Then it times ``gradtap report`` (a fresh process), the
page's size, and headless Chromium loading and laying out the page (when installed: the time
from navigation to the load event and a full layout), and checks that the planted tensors
lead the page.

``--in-memory`` times the report's own work at any size without writing the store: the
series are made in memory and handed to the report in place of ``Run.series`` (``gradtap
report``'s time is then the report's alone, in this process; the store's reads come on top).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import machine  # noqa: E402
from gradtap.store import RunWriter  # noqa: E402

#: Where the generator plants its anomalies (tensor index, step as a fraction of the run).
SPIKE = (7, 0.61)
NAN = (3, 0.37)
LARGE = 11


def tensor_names(n: int) -> list[str]:
    """Parameter names of a deep model: ``layers.{i}.{attn.qkv,...,mlp.fc2}.{weight,bias}``."""
    parts = ("attn.qkv.weight", "attn.qkv.bias", "attn.out.weight", "attn.out.bias",
             "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")
    return [f"layers.{i // len(parts)}.{parts[i % len(parts)]}" for i in range(n)]


def make_store(path: str | os.PathLike[str], tensors: int, steps: int, *,
               stats: tuple[str, ...] = ("norm", "nonfinite"), seed: int = 0) -> dict:
    """Write a run store of ``tensors`` x ``steps`` and return where its anomalies are.

    Returns:
        ``{"spike": (name, step), "nan": (name, step), "large": name, "names": [...]}``.
    """
    rng = np.random.default_rng(seed)
    names = tensor_names(tensors)
    spike = (names[SPIKE[0] % tensors], int(SPIKE[1] * (steps - 1)))
    nan = (names[NAN[0] % tensors], int(NAN[1] * (steps - 1)))
    large = names[LARGE % tensors]
    meta = {"config": {"stats": list(stats), "kinds": ["param_grad"]},
            "selected": {"parameters": names, "modules": []},
            "model": {"class": "Generated", "num_parameters": tensors * 1000,
                      "parameters": [[n, [1000], "torch.float32", True] for n in names]},
            "start_time": "2026-01-01T00:00:00+00:00"}
    writer = RunWriter(path, meta, overwrite=True)
    series = [(i * len(stats) + j, name, "param_grad", stat)
              for i, name in enumerate(names) for j, stat in enumerate(stats)]
    ids = np.arange(len(series), dtype=np.int64)
    scale = np.exp(rng.normal(0.0, 1.0, tensors))
    scale[LARGE % tensors] = scale.max() * 10.0
    trend = np.exp(-np.linspace(0.0, 1.5, steps))
    i_spike, i_nan = names.index(spike[0]), names.index(nan[0])
    norm_at = {s: stats.index(s) for s in stats}
    for step in range(steps):
        norms = scale * trend[step] * np.exp(rng.normal(0.0, 0.2, tensors))
        if step == spike[1]:
            norms[i_spike] *= 1000.0
        bad = np.zeros(tensors)
        if step == nan[1]:
            norms[i_nan] = np.nan
            bad[i_nan] = 3.0
        values = np.empty((tensors, len(stats)))
        for stat, j in norm_at.items():
            values[:, j] = (norms if stat == "norm" else bad if stat == "nonfinite"
                            else norms * rng.uniform(0.01, 0.1, tensors))
        writer.write_step(step, series if step == 0 else (), ids, values.reshape(-1),
                          wall_time=1.7e9 + step)
    writer.close()
    return {"spike": spike, "nan": nan, "large": large, "names": names}


def chromium_render_seconds(page: Path) -> float | None:
    """Seconds from navigation to a laid-out page in headless Chromium, or ``None``."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    try:
        from test_report import Chromium, _chromium  # the browser driver of the tests
    except ImportError:
        return None
    exe = _chromium()
    if exe is None:
        return None
    b = Chromium(exe)
    try:
        b.open("about:blank")
        t0 = time.perf_counter()
        b.send("Page.navigate", {"url": page.resolve().as_uri()})
        b.events = [e for e in b.events if e.get("method") != "Page.loadEventFired"]
        b.wait_for("Page.loadEventFired", timeout=600)
        b.eval("document.body.getBoundingClientRect().height")  # a full layout
        return time.perf_counter() - t0
    finally:
        b.close()


def measure(tensors: int, steps: int, stats: tuple[str, ...], keep: Path | None) -> dict:
    """Generate, report, render; the figures as a dict."""
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="gradtap-report-scale-"))
    run_dir = work / "run"
    try:
        t0 = time.perf_counter()
        planted = make_store(run_dir, tensors, steps, stats=stats)
        t_write = time.perf_counter() - t0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "gradtap.cli", "report", str(run_dir)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        t_report = time.perf_counter() - t0
        page = run_dir / "report.html"
        text = page.read_text()
        top = text[text.index('id="top-table"'):text.index("</table>", text.index('id="top-table"'))]
        found = {k: f"<code>{planted[k][0] if k != 'large' else planted[k]}</code>" in top
                 for k in ("spike", "nan", "large")}
        return {"tensors": tensors, "steps": steps, "stats": ",".join(stats),
                "values": tensors * steps * len(stats),
                "store_mb": sum(f.stat().st_size for f in run_dir.iterdir()) / 1e6,
                "write_s": t_write, "report_s": t_report, "page_mb": page.stat().st_size / 1e6,
                "render_s": chromium_render_seconds(page), "planted_on_top": found}
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def measure_in_memory(tensors: int, steps: int, keep: Path | None) -> dict:
    """The report's own cost at full size, without the store's: a one-step store gives the
    run's metadata and names, and ``Run.series``/``Run.steps`` are replaced in this process
    by the generator's series, made in memory (norms as :func:`make_store` writes them, the
    same planted spike, NaN and large tensor)."""
    from gradtap.report import write_report
    from gradtap.store import Run

    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="gradtap-report-scale-"))
    run_dir = work / "run"
    planted = make_store(run_dir, tensors, 1)
    names = planted["names"]
    spike = (names[SPIKE[0] % tensors], int(SPIKE[1] * (steps - 1)))
    nan = (names[NAN[0] % tensors], int(NAN[1] * (steps - 1)))
    rng = np.random.default_rng(0)
    scale = np.exp(rng.normal(0.0, 1.0, tensors))
    scale[LARGE % tensors] = scale.max() * 10.0
    trend = np.exp(-np.linspace(0.0, 1.5, steps))
    all_steps = np.arange(steps, dtype=np.int64)
    index = {n: i for i, n in enumerate(names)}

    def series(self: Run, name: str, stat: str, kind: str = "param_grad"):
        i = index[name]
        norms = scale[i] * trend * np.exp(np.random.default_rng(i).normal(0.0, 0.2, steps))
        if name == spike[0]:
            norms[spike[1]] *= 1000.0
        if name == nan[0]:
            norms[nan[1]] = np.nan
        if stat == "nonfinite":
            return all_steps, np.where(np.isnan(norms), 3.0, 0.0)
        return all_steps, norms

    saved = Run.series, Run.steps
    Run.series = series  # type: ignore[method-assign]
    Run.steps = property(lambda self: all_steps.tolist())  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        page = write_report(run_dir)
        t_report = time.perf_counter() - t0
    finally:
        Run.series, Run.steps = saved  # type: ignore[method-assign]
    try:
        text = page.read_text()
        top = text[text.index('id="top-table"'):text.index("</table>", text.index('id="top-table"'))]
        found = {k: f"<code>{v}</code>" in top
                 for k, v in (("spike", spike[0]), ("nan", nan[0]), ("large", planted["large"]))}
        return {"tensors": tensors, "steps": steps, "stats": "norm,nonfinite (in memory)",
                "values": tensors * steps * 2, "store_mb": 0.0, "write_s": 0.0,
                "report_s": t_report, "page_mb": page.stat().st_size / 1e6,
                "render_s": chromium_render_seconds(page), "planted_on_top": found}
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--stats", default="norm,nonfinite")
    ap.add_argument("--keep", type=Path, default=None, help="keep the store and page here")
    ap.add_argument("--in-memory", action="store_true",
                    help="time the report's own work: series made in memory, not read")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tensors, args.steps = 40, 300
    r = (measure_in_memory(args.tensors, args.steps, args.keep) if args.in_memory
         else measure(args.tensors, args.steps, tuple(args.stats.split(",")), args.keep))
    render = "n/a (no Chromium)" if r["render_s"] is None else f"{r['render_s']:.2f} s"
    table = "\n".join([
        "| tensors | steps | stats | values | store | write (RunWriter) | `gradtap report` "
        "| page | Chromium load + layout | planted tensors on top |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {r['tensors']:,} | {r['steps']:,} | {r['stats']} | {r['values']:,} | "
        f"{r['store_mb']:.0f} MB | {r['write_s']:.0f} s | {r['report_s']:.1f} s | "
        f"{r['page_mb']:.2f} MB | {render} | "
        f"{', '.join(k for k, v in r['planted_on_top'].items() if v) or 'none'} |"])
    print(f"Machine: {machine()}.\n")
    print(table)
    print(json.dumps(r))
    return table


if __name__ == "__main__":
    main()
