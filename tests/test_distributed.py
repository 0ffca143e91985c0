"""Statistics across ranks: two gloo processes on CPU against one process on the whole batch."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap import _tensorops as ops
from gradtap import distributed
from tests._dist import RankError, gloo_available, run_ranks
from tests.test_monitor import ewma_oracle
from tests.test_tensorops import assert_stat_close, oracle, oracle_hist, slack

ALL_STATS = ops.STAT_NAMES


def test_world_without_a_process_group():
    assert distributed.world() == (0, 1)
    assert not distributed.is_distributed()


@pytest.mark.parametrize("seed", range(4))
def test_reduce_parts_without_process_group_matches_the_host_combination(seed):
    """The distributed path (refine and combine on the device, ``between`` for m2) agrees
    with the exact host path, NaN/Inf included."""
    rng = np.random.default_rng(seed)
    parts, group = [], []
    for g in range(3):
        for _ in range(rng.integers(1, 4)):
            x = rng.standard_normal(rng.integers(1, 40)) * 10.0 ** rng.integers(-3, 3) + g
            if rng.random() < 0.3:
                x[rng.integers(0, x.size)] = rng.choice([np.nan, np.inf, -np.inf])
            parts.append(torch.tensor(x))
            group.append(g)
    group_arr = np.array(group)
    edges = ops.hist_edges(5, "linear", (-2.0, 2.0))
    needs = ops.needs_for(ALL_STATS, exact_nonfinite=True)
    fields = _assemble(ops.tensor_moments(parts, needs, edges=edges, exact_m2=True), len(parts))
    count = np.array([p.numel() for p in parts], dtype=np.float64)
    rcount, rfields, check = distributed.reduce_parts(count, fields, group_arr, ["a", "b", "c"])
    assert not distributed.layout_mismatch(check.numpy())
    got = ops.finish_stats(rcount.numpy(), {k: v.numpy() for k, v in rfields.items()}, ALL_STATS)
    for g in range(3):
        whole = torch.cat([p for p, k in zip(parts, group) if k == g]).numpy()
        expected = oracle(whole)
        for stat in ALL_STATS:
            assert_stat_close(float(got[stat][g]), expected[stat], f"{stat}[{g}]",
                              slack(stat, whole), 1e-9)
        np.testing.assert_array_equal(rfields["hist"][g].numpy(), oracle_hist(whole, edges.numpy()))


def _assemble(groups, n):
    fields = {}
    for idx, f in groups:
        for k, v in f.items():
            out = fields.setdefault(k, torch.zeros((n, *v.shape[1:]), dtype=v.dtype))
            out[idx] = v
    return fields


def test_layout_mismatch_detects_different_keys():
    assert distributed.layout_mismatch([5.0, -5.0]) is False
    assert distributed.layout_mismatch([7.0, -5.0]) is True


def test_ranks_without_rows_take_part_with_empty_fields():
    fields = {f: torch.zeros(0, dtype=torch.float64) for f in ("sum", "sumsq", "max", "negmin")}
    count, out, _ = distributed.reduce_parts(np.zeros(0), fields, np.zeros(0, dtype=np.int64),
                                             ["x", "y"])
    assert count.tolist() == [0.0, 0.0] and set(out) >= {"sum", "between", "max"}


# -- the multi-process harness ----------------------------------------------------------------

needs_gloo = pytest.mark.skipif(not gloo_available(),
                                reason="torch.distributed with gloo is not in this torch build")


def _harness_worker(rank, world, fail_rank=-1):
    import torch.distributed as dist

    if rank == fail_rank:
        raise ValueError(f"planted failure on rank {rank}")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": t, "pid": os.getpid()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_gloo
def test_harness_runs_ranks_reports_failures_and_leaves_no_process(tmp_path):
    out = run_ranks(_harness_worker, 2, timeout=60)
    assert [(r["rank"], r["world"], r["sum"]) for r in out] == [(0, 2, [3.0]), (1, 2, [3.0])]
    assert not any(_alive(r["pid"]) for r in out)
    # A rank that raises: the other is blocked in all_reduce, is killed after the grace time.
    with pytest.raises(RankError, match="planted failure on rank 1"):
        run_ranks(_harness_worker, 2, kwargs={"fail_rank": 1}, timeout=60, grace=1,
                  outdir=tmp_path / "fail")
    # A rank that never returns: the hard timeout kills both.
    script = tmp_path / "hang.py"
    script.write_text("import os, sys, threading\n"
                      "open(os.path.join(sys.argv[1], f'pid{os.environ[\"RANK\"]}'), 'w')"
                      ".write(str(os.getpid()))\n"
                      "threading.Event().wait()\n")
    with pytest.raises(RankError, match="timed out"):
        run_ranks(script, 2, timeout=3, outdir=tmp_path / "hang")
    pids = [int((tmp_path / "hang" / f"pid{r}").read_text()) for r in range(2)]
    assert not any(_alive(p) for p in pids)


# -- two processes ---------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import gradtap as gt

    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []
    real_all_reduce = dist.all_reduce
    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = counting  # DDP's own buckets go through C++, not through here

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model = model.double()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, 5, generator=g, dtype=torch.float64)
    y = torch.randn(3, 8, 3, generator=g, dtype=torch.float64)
    x[1, 6, 2] = float("nan") if rank == 1 else x[1, 6, 2]  # one rank sees a NaN at step 1
    stats = %(stats)r
    glob = gt.Monitor(model, stats=stats, kinds=("param_grad", "grad_output"), ewma=0.9,
                      hist_bins=6, hist_scale="linear", hist_range=(-0.5, 0.5),
                      store=os.path.join(out, "run"))
    local = gt.Monitor(model, stats=stats, local_grads=True)
    per_step = []
    for step in range(3):
        xs, ys = x[step, 4 * rank:4 * rank + 4], y[step, 4 * rank:4 * rank + 4]
        loss = ((ddp(xs) - ys) ** 2).sum() * world / 8  # DDP averages: global mean over 8
        loss.backward()
        before = len(calls)
        glob.step()
        local.step()
        per_step.append(len(calls) - before)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * torch.nan_to_num(p.grad)
                p.grad = None
    glob.close()
    local.close()
    glob.frame().to_pickle(os.path.join(out, f"glob{rank}.pkl"))
    local.frame().to_pickle(os.path.join(out, f"local{rank}.pkl"))
    torch.save({n: (glob.ewma_mean(n), glob.ewma_var(n)) for n, _ in model.named_parameters()},
               os.path.join(out, f"ewma{rank}.pt"))
    with open(os.path.join(out, f"info{rank}.json"), "w") as f:
        json.dump({"collectives": per_step, "writes": glob.run is not None}, f)
    dist.destroy_process_group()
""")


def _reference():
    """One process, the concatenated batch of both ranks, statistics by the numpy oracle."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, 5, generator=g, dtype=torch.float64)
    y = torch.randn(3, 8, 3, generator=g, dtype=torch.float64)
    x[1, 6, 2] = float("nan")
    glob, local, outs = {}, {}, {}
    ewma_hist: dict[str, list[np.ndarray]] = {n: [] for n, _ in model.named_parameters()}
    for step in range(3):
        w0, b0, w2, b2 = model[0].weight, model[0].bias, model[2].weight, model[2].bias
        o0 = x[step] @ w0.T + b0
        o1 = torch.tanh(o0)
        o2 = o1 @ w2.T + b2
        per_sample = ((o2 - y[step]) ** 2).sum(1)
        # Each rank's loss is (its half's sum) * world / 8, so its dL/d(output) rows are
        # those of 2 * mean-loss over the whole batch.
        scaled = 2 * per_sample.sum() / 8
        g0, g1, g2 = torch.autograd.grad(scaled, [o0, o1, o2], retain_graph=True)
        outs[step] = {"0:output": g0, "1:output": g1, "2:output": g2}
        params = list(model.parameters())
        grads = torch.autograd.grad(per_sample.sum() / 8, params, retain_graph=True)
        # Rank r's own gradient, from its own forward (rank 0 never sees rank 1's NaN input).
        halves = [torch.autograd.grad((((model(x[step, 4 * r:4 * r + 4]) - y[step, 4 * r:4 * r + 4])
                                        ** 2).sum() * 2 / 8), params) for r in range(2)]
        names = [n for n, _ in model.named_parameters()]
        for i, name in enumerate(names):
            glob[(step, name)] = grads[i].numpy()
            local[(step, name)] = torch.cat([halves[0][i].reshape(-1),
                                             halves[1][i].reshape(-1)]).numpy()
            ewma_hist[name].append(grads[i].numpy())
        with torch.no_grad():
            for p, gr in zip(params, grads):
                p -= 0.1 * torch.nan_to_num(gr)
    return glob, local, outs, ewma_hist


def _frame_dict(df):
    return {(int(r.step), r.name, r.kind, r.stat): float(r.value) for r in df.itertuples()}


@needs_gloo
def test_two_gloo_ranks_match_one_process_on_the_concatenated_batch(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER % {"stats": ALL_STATS})
    run_ranks(script, 2, outdir=tmp_path, timeout=180)

    glob_ref, local_ref, outs_ref, ewma_hist = _reference()
    frames = [pd.read_pickle(tmp_path / f"glob{r}.pkl") for r in range(2)]
    pd.testing.assert_frame_equal(frames[0], frames[1])  # every rank sees the same statistics
    pd.testing.assert_frame_equal(frames[0], gt.open_run(tmp_path / "run").frame())
    got = _frame_dict(frames[0])
    expected = {}
    for (step, name), g in glob_ref.items():
        expected.update({(step, name, "param_grad", s): (v, g) for s, v in oracle(g).items()})
    for step, per_module in outs_ref.items():
        for name, g in per_module.items():
            g = g.numpy()
            expected.update({(step, name, "grad_output", s): (v, g) for s, v in oracle(g).items()})
    assert set(got) == set(expected)
    for key, (value, data) in expected.items():
        assert_stat_close(got[key], value, str(key), slack(key[3], data), 1e-7)
    run = gt.open_run(tmp_path / "run")
    edges, counts = run.histogram("1:output", kind="grad_output")
    for i, step in enumerate(run.histogram("1:output", kind="grad_output").steps):
        np.testing.assert_array_equal(counts[i], oracle_hist(outs_ref[step]["1:output"], edges))

    local = [_frame_dict(pd.read_pickle(tmp_path / f"local{r}.pkl")) for r in range(2)]
    assert local[0] == pytest.approx(local[1], nan_ok=True)
    for (step, name), g in local_ref.items():
        for stat, value in oracle(g).items():
            assert_stat_close(local[0][(step, name, "param_grad", stat)], value,
                              f"local {step} {name} {stat}", slack(stat, g), 1e-7)

    ewma = [torch.load(tmp_path / f"ewma{r}.pt", weights_only=True) for r in range(2)]
    for name, seq in ewma_hist.items():
        m, v = ewma_oracle(seq, 0.9)
        for r in range(2):
            for i in range(2):  # identical on every rank, bit for bit (NaN where NaN)
                torch.testing.assert_close(ewma[r][name][i], ewma[0][name][i], rtol=0, atol=0,
                                           equal_nan=True)
            np.testing.assert_allclose(ewma[r][name][0].numpy(), m, rtol=1e-9)
            np.testing.assert_allclose(ewma[r][name][1].numpy(), v, rtol=1e-9)

    info = [json.loads((tmp_path / f"info{r}.json").read_text()) for r in range(2)]
    assert [i["writes"] for i in info] == [True, False]  # only rank 0 writes the store
    for i in info:
        # glob reduces grad_output (2 collectives), local reduces param grads (2 more)
        assert i["collectives"] == [4, 4, 4]


# -- Monitor under DDP, FSDP2 and HSDP against one process on the concatenated batch ---------


def _expected_rows(ref, world):
    """``(step, name, kind, stat) -> (value, data)`` of every row the Monitor should write."""
    from tests import _dist_monitor as W

    exp = {}

    def add(step, name, kind, data):
        data = np.asarray(data, dtype=np.float64)
        exp.update({(step, name, kind, s): (v, data) for s, v in oracle(data).items()})

    for s in range(W.STEPS):
        for n, g in ref["grad"][s].items():
            add(s, n, "param_grad", g.numpy())
            add(s, n, "param", ref["param"][s][n].numpy())
            if s:
                diff = (ref["param"][s][n] - ref["param"][s - 1][n]).numpy()
                add(s, n, "update", diff)
                ratio = np.linalg.norm(diff) / np.linalg.norm(ref["param"][s][n].numpy())
                exp[(s, n, "update", "ratio")] = (ratio, diff)
                a, b = g.numpy().ravel(), ref["grad"][s - 1][n].numpy().ravel()
                cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
                exp[(s, n, "grad_cosine", "cosine")] = (cos, a)
        for k, g in ref["grad_output"][s].items():
            add(s, k, "grad_output", world * g.numpy())  # each rank's loss is world * its share
    return exp


def _check_monitor(results, mode, world, ref):
    """Every rank's Monitor of ``mode`` against the one-process reference."""
    from tests import _dist_monitor as W

    runs = [r[mode] for r in results]
    got = {(s, n, k, st): v for s, n, k, st, v in runs[0]["rows"]}
    for other in runs[1:]:  # every rank computes the same statistics
        theirs = {(s, n, k, st): v for s, n, k, st, v in other["rows"]}
        assert theirs.keys() == got.keys()
        for key, v in theirs.items():
            assert_stat_close(v, got[key], f"{mode} rank vs rank 0 {key}", 1e-12, 1e-12)
    expected = _expected_rows(ref, world)
    assert set(got) == set(expected), (mode, set(got) ^ set(expected))
    for key, (value, data) in expected.items():
        assert_stat_close(got[key], value, f"{mode} {key}", slack(key[3], data), 1e-7)

    edges = None
    for r in runs:
        assert set(r["hists"]) == {f"param_grad/{n}" for n in ref["grad"][0]} | {
            f"grad_output/{k}" for k in ref["grad_output"][0]}
        for key, h in r["hists"].items():
            kind, name = key.split("/")
            edges = np.asarray(h["edges"])
            assert h["steps"] == list(range(W.STEPS))
            for s in range(W.STEPS):
                data = (ref["grad"][s][name] if kind == "param_grad"
                        else world * ref["grad_output"][s][name]).numpy()
                np.testing.assert_array_equal(h["counts"][s], oracle_hist(data, edges),
                                              err_msg=f"{mode} {key} step {s}")

    for n in ref["grad"][0]:
        m, v = ewma_oracle([ref["grad"][s][n].numpy() for s in range(W.STEPS)], W.EWMA)
        for r in runs:
            e = r["ewma"][n]
            assert e["dtensor"] == (mode != "ddp"), mode  # sharded: laid out like the grad
            np.testing.assert_allclose(e["mean"], m, rtol=1e-9, atol=1e-12, err_msg=f"{mode} {n}")
            np.testing.assert_allclose(e["var"], v, rtol=1e-9, atol=1e-12, err_msg=f"{mode} {n}")
        summary = runs[0]["ewma_store"][n]
        assert summary["numel"] == m.size and summary["shape"] == list(m.shape)
        np.testing.assert_allclose(
            [summary["mean_norm"], summary["mean_absmax"], summary["var_mean"],
             summary["var_max"]],
            [np.linalg.norm(m), np.abs(m).max(), v.mean(), v.max()], rtol=1e-9, atol=1e-15)

    # One writer: rank 0 writes the store, the same rows as its frame; no other rank writes.
    assert [r["writes"] for r in runs] == [True] + [False] * (world - 1)
    assert runs[0]["store_exists"] and runs[0]["store_rows"] == len(runs[0]["rows"])

    # At most two collectives per step, both all_reduce of packed statistics, never a gather
    # (counted at the Python API and by torch's CommDebugMode, which sees DTensor's too).
    for r in runs:
        for s in r["steps"]:
            assert [c for c, _ in s["calls"]] == ["all_reduce", "all_reduce"], (mode, s)
            assert s["comm"] == 2, (mode, s)


@needs_gloo
def test_monitor_under_ddp_and_fsdp2_matches_one_process(tmp_path):
    """Two ranks: DDP (Monitor given the wrapper), then FSDP2 with uneven shards (dims 7 and 3
    over 2 ranks): every kind, stat, histogram and the EWMA, and the collectives per step."""
    from tests import _dist_monitor as W

    results = run_ranks(W.modes, 2, kwargs={"modes": ["ddp", "fsdp"], "out": str(tmp_path)},
                        timeout=240)
    ref = W.reference()
    for mode in ("ddp", "fsdp"):
        _check_monitor(results, mode, 2, ref)
    for r in results:  # a Partial DTensor is refused by name, before any collective
        assert len(r["errors"]) == 1 and "layer.weight: placement Partial" in r["errors"][0]
        # Under a grad scaler, non-finite elements of every rank's shard are counted.
        assert r["amp"] == {"scaler_nonfinite": 2.0, "amp_scale": 4.0, "weight_nonfinite": 2.0}


@needs_gloo
def test_monitor_under_hsdp_and_fsdp2_on_four_ranks_matches_one_process(tmp_path):
    """Four ranks: HSDP (2 replicas x 2 shards: replicated copies counted once), then FSDP2
    over 4 (a 3-row and a 2-row layer leave some ranks an empty shard)."""
    from tests import _dist_monitor as W

    results = run_ranks(W.modes, 4, kwargs={"modes": ["hsdp", "fsdp"], "out": str(tmp_path)},
                        timeout=300)
    ref = W.reference()
    for mode in ("hsdp", "fsdp"):
        _check_monitor(results, mode, 4, ref)
    for r in results:  # a mesh of 2 of the 4 ranks (a TP or pipeline-stage group) is refused
        assert len(r["errors"]) == 2 and "spans 2 of the 4 ranks" in r["errors"][1]


# torch.compile imports torch's own deprecated jit helpers (not our code).
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_monitor_names_carry_no_wrapper_prefix():
    """Given DataParallel or torch.compile's wrapper, the Monitor watches and names the model
    inside: the same names and values as given the model itself (globs match those names)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    frames = []
    for wrapped in (net, nn.DataParallel(net), torch.compile(net), nn.DataParallel(
            torch.compile(net))):
        mon = gt.Monitor(wrapped, select="0.*", stats=("norm",), kinds=("param_grad", "param"))
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        mon.step()
        frames.append(mon.frame())
    for f in frames[1:]:
        pd.testing.assert_frame_equal(f, frames[0])
    assert sorted(frames[0].name.unique()) == ["0.bias", "0.weight"]
    assert gt.select.clean_name("a._orig_mod.b._checkpoint_wrapped_module.c") == "a.b.c"


def test_monitor_built_before_its_parameters_are_replaced_says_so():
    """fully_shard swaps every parameter for a DTensor one: a Monitor built before would watch
    parameters that never get a gradient; its first step says what happened."""
    net = nn.Sequential(nn.Linear(3, 2))
    mon = gt.Monitor(net)
    net[0].weight = nn.Parameter(net[0].weight.detach().clone())  # what fully_shard does
    net[0].bias = nn.Parameter(net[0].bias.detach().clone())
    net(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"no longer holds .*0\.weight and 1 more.*after"):
        mon.step()
    ok = gt.Monitor(net)  # built after: watches the new parameters
    ok.step()
    assert set(ok.frame().name) == {"0.weight", "0.bias"}
