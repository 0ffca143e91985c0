"""Every benchmark script runs (tiny --quick sizes), so none can rot unnoticed."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))


def test_tap_overhead_quick(capsys):
    tables = importlib.import_module("tap_overhead").main(["--quick"]).split("\n\n")
    assert len(tables) == 2  # the default allocator, and glibc without trimming in a child
    for table in tables:
        assert "gt.tap on every module" in table and "faults" in table
        assert table.count("\n") == 4  # header, rule, three models


def test_compile_overhead_quick(capsys):
    table = importlib.import_module("compile_overhead").main(["--quick"])
    assert "compiled monitor" in table and "eager monitor" in table
    assert table.count("\n") == 3  # header, rule, two models


def test_monitor_options_quick(capsys):
    """benchmarks/monitor_options.py: a row per option (every stat, kind and histogram, all
    options together) with time, ratio and spread on both models."""
    bench = importlib.import_module("monitor_options")
    table = bench.main(["--quick"])
    rows = table.splitlines()[2:]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == list(bench.options())
    from gradtap._monitor.options import KINDS, STAT_NAMES

    assert {f"stat {s}" for s in STAT_NAMES} | {f"kind {k}" for k in KINDS} <= set(bench.options())
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert len(cells) == 7 and "fails" not in row, row
        assert all(c.endswith(" ms") for c in cells[1::3]) and all(c.endswith("x") for c in cells[2::3])


def test_run_all_rejects_unknown(capsys):
    with pytest.raises(SystemExit):
        importlib.import_module("run_all").main(["no_such_benchmark"])
    assert "unknown benchmark" in capsys.readouterr().err


def test_docs_hold_one_block_per_benchmark():
    run_all = importlib.import_module("run_all")
    doc = run_all.DOCS.read_text()
    for name in run_all.ORDER:
        assert doc.count(f"<!-- begin {name} -->") == 1 and doc.count(f"<!-- end {name} -->") == 1
        assert doc.index(f"<!-- begin {name} -->") < doc.index(f"<!-- end {name} -->")


def test_a_full_run_rewrites_only_its_blocks(tmp_path, monkeypatch, capsys):
    run_all = importlib.import_module("run_all")
    (tmp_path / "fake_bench.py").write_text(
        "def main(argv):\n"
        "    print('machine line; ' + ' '.join(argv))\n"
        "    print('| a | b |')\n"
        "    print('|---|---|')\n"
        "    print('| 1 | 2 |')\n"
        "    return 0\n")
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nintro\n\n<!-- begin fake_bench -->\nold figures\n"
                    "<!-- end fake_bench -->\n\n<!-- begin other -->\nkept\n<!-- end other -->\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    monkeypatch.setattr(run_all, "ORDER", ["fake_bench"])
    monkeypatch.setattr(run_all, "DOCS", docs)
    before = docs.read_text()
    assert run_all.main(["--quick"]) == 0 and docs.read_text() == before  # quick: no docs
    assert run_all.main(["--no-docs"]) == 0 and docs.read_text() == before
    assert run_all.main([]) == 0
    text = docs.read_text()
    assert "old figures" not in text and "intro" in text and "kept" in text
    block = text[text.index("<!-- begin fake_bench -->"):text.index("<!-- end fake_bench -->")]
    assert "Command: `python benchmarks/fake_bench.py`" in block and "Machine: " in block
    assert "machine line;\n\n| a | b |\n|---|---|\n| 1 | 2 |\n" in block  # blank line before a table
    assert "machine line; --quick" in capsys.readouterr().out  # printed as it ran


def test_a_block_missing_from_the_docs_is_appended():
    run_all = importlib.import_module("run_all")
    out = run_all.replace_block("# B\n", "x", "<!-- begin x -->\nnew\n<!-- end x -->")
    assert out == "# B\n\n## x\n\n<!-- begin x -->\nnew\n<!-- end x -->\n"


def test_gns_overhead_quick(capsys):
    """benchmarks/gns_overhead.py on two gloo ranks: one row with every variant and the spread."""
    from tests._dist import gloo_available

    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not in this torch build")
    table = importlib.import_module("gns_overhead").main(["--quick"]).split("\n\n")[1]
    assert table.count("\n") == 2 and "+gns ranks / monitor" in table and "spread" in table


def test_distributed_quick(capsys):
    """benchmarks/distributed.py on two gloo ranks: a timing row and the collective counts
    (the Monitor's step: two all_reduce, however many kinds)."""
    from tests._dist import gloo_available

    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not in this torch build")
    out = importlib.import_module("distributed").main(["--quick"])
    timing, comm = out.split("\n\n")[1:]
    assert timing.count("\n") == 2 and "clip_grad_norm_" in timing
    monitor_rows = [r for r in comm.splitlines() if "Monitor.step()" in r]
    assert len(monitor_rows) == 3 and all("| 2 | all_reduce x2 |" in r for r in monitor_rows)
    assert "reduce_scatter" in comm  # FSDP2's own step, for comparison


def test_spike_control_quick(capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        assert importlib.import_module("spike_control").main(["--quick"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| variant | time / step | vs clip_grad_norm_(1.0) | vs zclip package |" in out
    assert "| clipping alone | time / call |" in out
    for row in ("gt.zclip(), when='step'", "gt.adagc()", "gt.agc()", "gt.adagn()",
                "gt.spam_clip()", "| zclip package: ZClip.step(model) |"):
        assert out.count(row) == 2, row


def test_session_overhead_quick(capsys):
    table = importlib.import_module("session_overhead").main(["--quick"])
    assert table in capsys.readouterr().out
    assert table.count("\n") == 3  # header, rule, two models
    assert "| small CNN" in table and "| Transformer encoder" in table
    assert "gradtap / by hand" in table and "plain again (floor)" in table


@pytest.mark.parametrize("global_clip", [False, True])
def test_session_by_hand_does_what_gradtap_does(global_clip):
    """The benchmark's hand-written side clips like gt.clip_norm (per tensor) or
    gt.clip_global_norm and computes the Monitor's default statistics of the clipped gradients."""
    import copy

    import torch
    import torch.nn.functional as F

    import gradtap as gt

    session = importlib.import_module("session_overhead")
    models = importlib.import_module("_models")
    model, x, y = models.small_cnn(batch=4)
    for p in model.parameters():  # norms both above and below the clipping bound of 1
        p.data.mul_(3.0 if p.dim() > 1 else 0.1)
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    loss = F.cross_entropy(ours(x), y)
    loss.backward()
    host = session.by_hand(list(ours.parameters()), global_clip)(loss)
    mon = gt.Monitor(theirs)
    handle = gt.transform(theirs, {"*": gt.clip_global_norm(1.0) if global_clip
                                   else gt.clip_norm(1.0)})
    F.cross_entropy(theirs(x), y).backward()
    mon.step()
    handle.remove()
    frame = mon.frame()
    mon.close()
    names = [n for n, _ in ours.named_parameters()]
    k = len(names)
    norms = host[1:k + 1]
    assert host[0] == 1.0
    if global_clip:
        assert abs(float((norms**2).sum()) ** 0.5 - 1.0) < 1e-4  # the joint norm was clipped
    else:  # some tensors were clipped to norm 1, some left alone
        assert (abs(norms - 1.0) < 1e-4).any() and (norms < 0.9).any()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    for j, stat in enumerate(("norm", "mean", "std", "absmax", "nonfinite")):
        want = frame[frame.stat == stat].set_index("name").loc[names, "value"].to_numpy()
        got = host[1 + j * k:1 + (j + 1) * k]
        assert abs(got - want).max() <= 1e-5 * max(1.0, abs(want).max()), stat


def test_per_sample_goal_rows_quick(capsys):
    """The per-sample goal rows: own_grad against vmap on the encoder, gradients against
    BackPACK and Opacus and norms only on the CNN, each beside the plain step timed twice (the
    floor), in every setting or in one."""
    import torch

    bench = importlib.import_module("per_sample")
    before = torch.get_default_dtype(), torch.get_num_threads()
    text = bench.main(["--quick", "--goals"])
    assert (torch.get_default_dtype(), torch.get_num_threads()) == before  # both restored
    for setting in ("float64, 1 thread,", "float32, 1 thread,", "float32, 2 threads,"):
        assert f"Goal rows, {setting}" in text
    for method, rows in (("plain step again", 6), ("gradtap grads, own_grad", 3),
                         ("gradtap grads, own_grad, made each step", 6),
                         ("gradtap grads, made each step", 3), ("torch.func vmap", 3),
                         ("gradtap norms only", 3), ("BackPACK BatchGrad", 3),
                         ("Opacus GradSampleModule", 3)):
        assert text.count(f"| {method} |") == rows, method  # per workload and setting
    vmap_rows = [r for r in text.splitlines() if "| torch.func vmap |" in r]
    assert all("| 1.000 [1.000, 1.000] |" in r for r in vmap_rows)  # its ratio to itself
    for anchor in ("BackPACK BatchGrad", "Opacus GradSampleModule"):
        rows = [r for r in text.splitlines() if f"| {anchor} |" in r]
        assert all(r.endswith("| not installed |") or "[" in r.split("|")[-2] for r in rows)
    one = bench.main(["--quick", "--goals", "--dtype", "float64", "--threads", "1"])
    assert one.count("Goal rows,") == 1 and "float64, 1 thread," in one


def test_per_sample_shared_quick(capsys):
    """The shared-position benchmark: gradtap equal to the loop of backwards, no replay (a
    replay's warning would raise inside it), every variant timed at both batch sizes."""
    text = importlib.import_module("per_sample_shared").main(["--quick"])
    rows = [r for r in text.splitlines() if "| gt.per_sample |" in r]
    assert len(rows) == 2 and text.count("| loop of backwards |") == 2
    assert all(float(r.strip(" |").split("|")[-1]) < 1e-5 for r in rows)


def test_store_scale_quick(capsys):
    assert importlib.import_module("store_scale").main(["--quick"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 20 | 300 |"))
    assert row.count("|") == 15 and "read store: 20 tensors x 5 stats x 500 steps" in out


def test_spike_signal_quick(capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        assert importlib.import_module("spike_signal").main(
            ["--quick", "--cases", "regression"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| regression | 6 | 100 |" in out and "x10 recall, detect (online)" in out
    assert importlib.import_module("spike_signal").main(["--cost", "20x300"]) == 0
    assert "| 20 | 300 |" in capsys.readouterr().out


def test_privacy_parts_quick():
    # --parts: each model's plain and private steps, timed per phase; the sum is the phases'.
    table = importlib.import_module("privacy").main(["--quick", "--parts"])
    rows = [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]
    assert [r[1] for r in rows] == ["plain", "gt.dp_sgd", "gt.dp_sgd per_layer"] * 3
    for r in rows:
        phases = [float(v.removesuffix(" ms")) for v in r[2:]]
        assert all(v > 0 for v in phases)
        assert abs(sum(phases[:3]) - phases[3]) <= 0.15  # each printed to 0.1 ms


def test_privacy_quick(capsys):
    table = importlib.import_module("privacy").main(["--quick"])
    rows = [line for line in table.splitlines()[2:]]
    assert len(rows) == 15  # three models x plain, gt.dp_sgd (two clippings), Opacus x2
    for name in ("| plain |", "| gt.dp_sgd |", "| gt.dp_sgd per_layer |", "| Opacus hooks |",
                 "| Opacus ghost |"):
        assert sum(name in row for row in rows) == 3
    measured = [r for r in rows if "not installed" not in r and "| fails: " not in r]
    assert all("MiB" in r for r in measured) and len(measured) >= 9  # plain and gt.dp_sgd
    assert all("| gt.dp_sgd | fails" not in r for r in rows)
    if importlib.util.find_spec("opacus") is None:  # make bench installs it
        assert sum("| not installed (opacus) |" in r for r in rows) == 6
    else:  # Opacus's ghost clipping cannot run the sequence-first LM (its embedding norm)
        assert len(measured) >= 14
