"""tap, per_sample, detect and transform under DDP and FSDP2: two gloo ranks on CPU, each
checked against one process (the same rank's samples on the unwrapped model for records and
per-sample gradients, the concatenated batch for transforms). One spawn per wrapper; each
runs several checks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import gradtap as gt
from tests._dist import gloo_available
from tests._dist_monitor import wrap
from tests._dist_shared import ranks_once

needs_gloo = pytest.mark.skipif(not gloo_available(),
                                reason="torch.distributed with gloo is not in this torch build")

BATCH = 4  # samples per rank


class Sqrt(nn.Module):
    """NaN in the forward where its input is negative: a NaN planted by the data."""

    def forward(self, x):
        return torch.sqrt(x)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    # 7 and 3 rows: uneven shards over two ranks under FSDP2.
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _data(world: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(world * BATCH, 5, generator=g),
            torch.randn(world * BATCH, 3, generator=g))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _local_oracle(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, list]:
    """Per-module parameter gradients and grad_output of this rank's samples, unwrapped."""
    out = {}
    acts = {}
    handles = [m.register_forward_hook(lambda m, a, o, n=n: acts.__setitem__(n, o))
               for n, m in net.named_children()]
    loss = _loss(net(x), y)
    for h in handles:
        h.remove()
    names = [n for n, _ in net.named_children()]
    grads = torch.autograd.grad(loss, [*net.parameters(), *(acts[n] for n in names)])
    params = [n for n, _ in net.named_parameters()]
    for n, g in zip(params, grads[:len(params)]):
        out[n] = g
    for n, g in zip(names, grads[len(params):]):
        out[f"{n}:output"] = g
    return out


def _compare_records(t: gt.Tap, oracle: dict[str, torch.Tensor]) -> dict:
    """Largest error of each record's slots against the oracle, and the shapes seen."""
    errors, shapes = {}, {}
    for r in t.records:
        for p, g in r.param_grads.items():
            key = f"{r.module_name}.{p}"
            shapes[key] = None if g is None else list(g.shape)
            errors[key] = None if g is None else float((g - oracle[key]).abs().max())
        errors[f"{r.module_name}:output"] = float(
            (r.grad_outputs["output"] - oracle[f"{r.module_name}:output"]).abs().max())
    return {"names": sorted({r.module_name for r in t.records}), "errors": errors,
            "shapes": shapes, "types": sorted({r.module_type for r in t.records})}


def _per_sample_error(model: nn.Module, plain: nn.Module, x, y) -> dict:
    """per_sample on the wrapped model against a loop over this rank's samples, unwrapped."""
    with gt.per_sample(model, quantities=("grad",)) as p:
        _loss(model(x), y).backward()
    errors = {}
    for i in range(len(x)):
        grads = torch.autograd.grad(_loss(plain(x[i:i + 1]), y[i:i + 1]),
                                    list(plain.parameters()))
        for (n, _), g in zip(plain.named_parameters(), grads):
            errors[n] = max(errors.get(n, 0.0), float((p.grad[n][i] - g).abs().max()))
    return errors


def _count_all_reduce(fn):
    """Run ``fn()`` and count the all-reduces it issued."""
    import torch.distributed as dist

    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(args[0].numel())
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        value = fn()
    finally:
        dist.all_reduce = real
    return value, calls


def _settle(*wrapped) -> None:
    """Free the wrappers and wait for every rank before the process group goes."""
    import gc

    import torch.distributed as dist

    del wrapped
    gc.collect()
    dist.barrier()


# -- DDP ------------------------------------------------------------------------------------------

def _ddp_worker(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    result: dict = {}
    net = _mlp()
    plain = copy.deepcopy(net)
    ddp = DDP(net)
    result["session"] = list(gt.capture.session(ddp).distributed())
    x_all, y_all = _data(world)
    x, y = x_all[rank * BATCH:(rank + 1) * BATCH], y_all[rank * BATCH:(rank + 1) * BATCH]

    # Records: this rank's contribution, before DDP's all-reduce, names without "module.".
    with gt.tap(ddp, nn.Linear) as t:
        _loss(ddp(x), y).backward()
    result["tap"] = _compare_records(t, _local_oracle(plain, x, y))
    # .grad is the all-reduced mean: differs from the local contribution (the check can fail).
    result["grad_is_global"] = float((net[0].weight.grad - _local_oracle(plain, x, y)["0.weight"])
                                     .abs().max())
    ddp.zero_grad()
    result["per_sample"] = _per_sample_error(ddp, plain, x, y)

    # Transforms at when="step" on DDP's averaged gradients: no communication of their own.
    seen, calls = _count_all_reduce(
        lambda: _transform_steps(ddp, {"*": gt.clip_global_norm(0.05)}, world, rank, inner=net))
    result["clip_global_norm"], result["clip_global_norm_all_reduce"] = seen[0], calls
    seen = _transform_steps(ddp, {"*": gt.clip_norm(0.03)}, world, rank, inner=net)
    result["clip_norm"] = seen[0]
    try:
        gt.transform(ddp, {"*": gt.clip_norm(1.0)})
    except ValueError as err:
        result["accumulate_refused"] = str(err)

    # detect: a NaN planted on rank 1 only (a negative input of Sqrt), found by a replay of
    # the inner module (no DDP collectives in the replay); every rank skips.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 5), Sqrt(), nn.Linear(5, 3))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(5))
        model[0].bias.fill_(0.0)
    ddp2 = DDP(model)
    with gt.detect(ddp2, action="record") as det:
        # A healthy step: one all-reduce of world_size numbers for the agreement.
        ddp2.zero_grad()
        _loss(ddp2(x.abs() + 1), y).backward()
        skip, calls = _count_all_reduce(det.should_skip)
        det.step()
        result["healthy"] = {"skip": skip, "all_reduce": calls,
                             "anomalies": len(det.anomalies)}
        bad = x.abs() + 1
        if rank == 1:
            bad[0, 2] = -1.0
        ddp2.zero_grad()
        _loss(ddp2(bad), y).backward()
        result["skip"] = det.should_skip()
        det.step()
    result["anomalies"] = [a.to_dict() | {"has_record": a.record is not None}
                           for a in det.anomalies]

    # action="raise": no rank raises from its backward (the other would wait in the next
    # collective); every rank raises at the agreement, with the finding rank's anomaly first.
    raised = []
    with gt.detect(ddp2, action="raise") as det:
        ddp2.zero_grad()
        _loss(ddp2(bad), y).backward()
        try:
            det.should_skip()
        except gt.GradientAnomaly as err:
            raised.append(err.anomaly.rank)
        det.step()
    result["raised"] = raised
    _settle(ddp, ddp2)
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The DDP and the FSDP2 workers' results, from one start of two ranks."""
    return ranks_once(tmp_path_factory, "consumers", 2,
                      {"ddp": _ddp_worker, "fsdp": _fsdp_worker}, timeout=240)


@needs_gloo
def test_ddp_records_detect_agreement_and_replay(ranks):
    out = [r["ddp"] for r in ranks]
    for rank, r in enumerate(out):
        assert r["session"] == ["ddp", rank, 2]
        tap = r["tap"]
        assert tap["names"] == ["0", "2"]  # no "module." prefix
        assert tap["shapes"] == {"0.weight": [7, 5], "0.bias": [7], "2.weight": [3, 7],
                                 "2.bias": [3]}
        assert max(tap["errors"].values()) < 1e-6, (rank, tap["errors"])
        assert sorted(r["per_sample"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert max(r["per_sample"].values()) < 1e-6, r["per_sample"]
        assert r["grad_is_global"] > 1e-4  # .grad holds the mean over ranks, not the record
        assert r["healthy"] == {"skip": False, "all_reduce": [2], "anomalies": 0}
        _check_clipped(r, rank)
        assert r["clip_global_norm_all_reduce"] == []
        assert "when='step'" in r["accumulate_refused"]
        assert r["skip"] is True, rank
        found = [a for a in r["anomalies"] if a["rank"] == 1]
        assert len(found) == 1, r["anomalies"]
        assert found[0]["kind"] == "nan" and found[0]["where"] == "forward"
    assert [r["raised"] for r in out] == [[1], [1]]
    mine = [a for a in out[1]["anomalies"] if a["rank"] == 1][0]
    # Rank 1's replay of the inner module named the origin.
    assert (mine["module_name"], mine["slot"], mine["has_record"]) == ("1", "output", True)
    theirs = [a for a in out[0]["anomalies"] if a["rank"] == 1][0]
    # Rank 0, which writes the report, names the module rank 1 found (no record: it is there).
    assert (theirs["module_name"], theirs["module_type"], theirs["has_record"]) == (
        "1", mine["module_type"], False)


# -- FSDP2 ----------------------------------------------------------------------------------------

def _full_grads(net: nn.Module) -> dict[str, torch.Tensor]:
    """Whole gradients (a sharded one gathered: the test's own all-gather)."""
    return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            for n, p in net.named_parameters()}


def _transform_steps(net, handle_rules, world, rank, steps=1, opt_lr=0.0, inner=None):
    """Run ``steps`` steps under a when='step' transform; the full gradients after each."""
    inner = net if inner is None else inner
    opt = torch.optim.SGD(inner.parameters(), lr=opt_lr)
    seen = []
    with gt.transform(net, handle_rules, when="step", optimizer=opt):
        for s in range(steps):
            x_all, y_all = _data(world, s)
            x, y = x_all[rank * BATCH:(rank + 1) * BATCH], y_all[rank * BATCH:(rank + 1) * BATCH]
            opt.zero_grad()
            _loss(net(x), y).backward()
            opt.step()
            seen.append(_full_grads(inner))
    return seen


def _fsdp_worker(rank: int, world: int) -> dict:
    result: dict = {}
    plain = _mlp()
    net = wrap("fsdp", _mlp())
    result["session"] = list(gt.capture.session(net).distributed())
    x_all, y_all = _data(world)
    x, y = x_all[rank * BATCH:(rank + 1) * BATCH], y_all[rank * BATCH:(rank + 1) * BATCH]

    # Records: full unsharded shape, this rank's samples only.
    with gt.tap(net, nn.Linear) as t:
        _loss(net(x), y).backward()
    result["tap"] = _compare_records(t, _local_oracle(plain, x, y))
    net.zero_grad()
    result["per_sample"] = _per_sample_error(net, plain, x, y)
    net.zero_grad()

    # Transforms at when="step" on the sharded gradients.
    def global_clip():
        return _transform_steps(net, {"*": gt.clip_global_norm(0.05)}, world, rank)
    seen, calls = _count_all_reduce(global_clip)
    result["clip_global_norm"] = seen[0]
    result["clip_global_norm_all_reduce"] = calls
    seen, calls = _count_all_reduce(lambda: _transform_steps(net, {"*": gt.clip_norm(0.03)}, world, rank))
    result["clip_norm"] = seen[0]
    result["clip_norm_all_reduce"] = calls
    rules = {"*.weight": gt.centralize(), "*.bias": gt.normalize(beta=0.5)}
    result["centralize_normalize"] = _transform_steps(net, rules, world, rank, steps=2)
    try:
        gt.transform(net, {"*": gt.clip_norm(1.0)})
    except ValueError as err:
        result["accumulate_refused"] = str(err)

    result["placements"] = _placements(world)

    # detect: a NaN planted on rank 1 only; both skip; no replay (it would all-gather on one
    # rank), the report comes from the screen.
    with gt.detect(net, action="record") as det:
        net.zero_grad()
        xb = x.clone()
        if rank == 1:
            xb[0, 0] = float("nan")
        _loss(net(xb), y).backward()
        result["skip"] = det.should_skip()
        det.step()
    result["anomalies"] = [a.to_dict() for a in det.anomalies]

    # Spikes: norms of each rank's shard of the reduced gradient; a loss 1000x larger on
    # rank 1 at the last step spikes every rank's shard.
    skips = []
    with gt.detect(net, action="record", spike=5.0, warmup=3) as det:
        for s in range(7):
            x_all, y_all = _data(world, s)
            x, y = x_all[rank * BATCH:(rank + 1) * BATCH], y_all[rank * BATCH:(rank + 1) * BATCH]
            net.zero_grad()
            _loss(net(x), y * (1000.0 if s == 6 and rank == 1 else 1.0)).backward()
            skips.append(det.should_skip())
            det.step()
    result["spike_skips"] = skips
    result["spikes"] = [(a.kind, a.rank, a.step) for a in det.anomalies]
    _settle(net)
    return result


def _placements(world: int) -> dict:
    """Whole-tensor sums of squares and row means of DTensors placed otherwise than FSDP2's
    default: replicated x sharded (HSDP: the copy is not counted twice), sharded by columns
    (row means need the other ranks), against the plain tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gradtap._tensorops.sharded import centered_rows, sumsq_whole

    torch.manual_seed(3)
    t = torch.randn(7, 5)
    hsdp = distribute_tensor(t, init_device_mesh("cpu", (world, 1)), [Replicate(), Shard(0)])
    cols = distribute_tensor(t, init_device_mesh("cpu", (world,)), [Shard(1)])
    (clipped,), _ = gt.clip_global_norm(1.0).update_many([hsdp], [()], [None])
    return {"want_sumsq": float(t.double().square().sum()),
            "sumsq": sumsq_whole([hsdp, cols]).tolist(),
            "centered": float((centered_rows(cols).full_tensor()
                               - (t - t.mean(dim=1, keepdim=True))).abs().max()),
            "clipped": float((clipped.full_tensor() - t / t.norm()).abs().max())}


def _one_process_grads(step: int = 0) -> dict[str, torch.Tensor]:
    net = _mlp()
    x, y = _data(2, step)
    _loss(net(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in net.named_parameters()}


def _close(got, want, what):
    torch.testing.assert_close(torch.tensor(got), want.to(torch.float32), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


def _check_clipped(r: dict, rank: int) -> None:
    """clip_global_norm(0.05) and clip_norm(0.03) against one process on the whole batch."""
    ref = _one_process_grads()
    total = torch.sqrt(sum(g.double().square().sum() for g in ref.values()))
    assert float(total) > 0.05 and max(float(g.norm()) for g in ref.values()) > 0.03
    for n, g in ref.items():
        _close(r["clip_global_norm"][n], g * min(1.0, 0.05 / (float(total) + 1e-6)),
               f"clip_global_norm {n} rank {rank}")
        _close(r["clip_norm"][n], g * min(1.0, 0.03 / (float(g.norm()) + 1e-6)),
               f"clip_norm {n} rank {rank}")


@needs_gloo
def test_fsdp2_records_transforms_and_detect(ranks):
    out = [r["fsdp"] for r in ranks]
    ref = _one_process_grads()
    for rank, r in enumerate(out):
        assert r["session"] == ["fsdp2", rank, 2]
        tap = r["tap"]
        assert tap["names"] == ["0", "2"] and tap["types"] == ["Linear"]  # not FSDPLinear
        assert tap["shapes"] == {"0.weight": [7, 5], "0.bias": [7], "2.weight": [3, 7],
                                 "2.bias": [3]}
        assert max(tap["errors"].values()) < 1e-6, (rank, tap["errors"])
        assert sorted(r["per_sample"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert max(r["per_sample"].values()) < 1e-6, r["per_sample"]
        _check_clipped(r, rank)
        # One all-reduce for all the sums of squares (the test's own full_tensor() gathers
        # are all-gathers, and FSDP2's own are reduce-scatters).
        assert r["clip_global_norm_all_reduce"] == [4]
        assert r["clip_norm_all_reduce"] == [4]
        assert "when='step'" in r["accumulate_refused"]
        assert r["skip"] is True
        found = [a for a in r["anomalies"] if a["rank"] == 1]
        assert len(found) == 1 and found[0]["kind"] == "nan", r["anomalies"]
        assert r["spike_skips"] == [False] * 6 + [True]
        assert sorted(r["spikes"]) == [["spike", 0, 6], ["spike", 1, 6]]
        pl = r["placements"]
        assert pl["sumsq"] == pytest.approx([pl["want_sumsq"]] * 2, rel=1e-6)
        assert pl["centered"] < 1e-6 and pl["clipped"] < 1e-6
    # centralize (weights) and normalize's EWMA (biases, kept sharded) over two steps.
    steps = [_one_process_grads(0), _one_process_grads(1)]
    for n in ref:
        if n.endswith("weight"):
            want = [g[n] - g[n].mean(dim=1, keepdim=True) for g in steps]
        else:
            m, v = steps[0][n].double(), torch.zeros_like(steps[0][n], dtype=torch.float64)
            d = steps[1][n].double() - m
            v = 0.5 * (v + 0.5 * d * d) / (1 - 0.5)  # bias-corrected at step 2
            want = [steps[0][n], steps[1][n] / (v.sqrt() + 1e-8)]
        for rank, r in enumerate(out):
            for s in range(2):
                _close(r["centralize_normalize"][s][n], want[s], f"{n} step {s} rank {rank}")


def test_wrappers_add_no_prefix_to_names():
    """Selectors see the module inside DataParallel and a compiled model (one process)."""

    class OptimizedModule(nn.Module):  # torch.compile's wrapper, as its name and attribute
        # say (the real one needs torch._dynamo, slow to import)
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

        def forward(self, x):
            return self._orig_mod(x)

    net = _mlp()
    for wrapped in (nn.DataParallel(net), OptimizedModule(net)):
        with gt.tap(wrapped, nn.Linear) as t:
            assert t.names == ["0", "2"]
        h = gt.transform(wrapped, {"0.*": gt.scale(2.0)})
        assert list(h.plan()) == ["0.weight", "0.bias"]
        h.remove()
    with gt.detect(net, action="record") as det:
        net[0].bias.data[0] = float("nan")
        _loss(net(torch.randn(2, 5)), torch.zeros(2, 3)).backward()
        assert det.should_skip()
    assert [a.rank for a in det.anomalies] == [0]
