"""Monitor(log_to=...): each tracker's own files, read back by its own package, hold the run
store's values under the contract's keys; the summary stays within 64 keys; a slow tracker
never stalls training; logging adds no host sync to a step that is not logged."""

from __future__ import annotations

import fnmatch
import math
import time
import warnings

import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap._tensorops import HostCopy
from tests._trackers import tensorboard_scalars, tensorboard_texts, wandb_history

PREFIX = {"param_grad": "grad"}


def contract_key(name: str, kind: str, stat: str) -> str:
    """The contract's key of a series whose name needs no cleaning."""
    if name == "<loss>":
        return "loss"
    return f"{PREFIX.get(kind, kind)}/{stat}/{name}"


def train(mon, net, steps, *, seed=0, poison=None):
    g = torch.Generator().manual_seed(seed)
    for s in range(steps):
        x = torch.randn(8, net[0].in_features, generator=g)
        loss = net(x).pow(2).mean()
        loss.backward()
        if poison == s:
            net[0].weight.grad[0, 0] = float("nan")
        mon.step(loss=loss)
        net.zero_grad()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def wide(n_layers=300):
    """600 tensors: ``n_layers`` x Linear(2, 2)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(n_layers)])


def store_values(run) -> dict[str, dict[int, float]]:
    out = {}
    for name, kind, stat in run.series_keys():
        steps, values = run.series(name, stat, kind)
        out[contract_key(name, kind, stat)] = dict(zip(steps.tolist(), values.tolist()))
    return out


def test_tensorboard_event_file_holds_every_value_of_the_store(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    net = mlp()
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    with gt.Monitor(net, store=tmp_path / "run", log_to=writer, log_keys="all",
                    kinds=("param_grad", "update")) as mon:
        train(mon, net, 5)
    writer.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    expected = store_values(gt.open_run(tmp_path / "run"))
    assert len(expected) == 4 * 5 + 4 * 6 + 1  # 4 tensors: grad and update stats (+ratio), loss
    for key, by_step in expected.items():
        assert set(scalars[key]) == set(by_step), key
        for step, value in by_step.items():
            assert scalars[key][step] == pytest.approx(value, rel=1e-6, abs=1e-12), (key, step)
    assert sorted(scalars["grad/norm/0.weight"]) == [0, 1, 2, 3, 4]
    # the summary beside the rows: the global norm from the stored per-tensor norms
    for s in range(5):
        total = math.sqrt(sum(expected[f"grad/norm/{n}"][s] ** 2
                              for n, _ in net.named_parameters()))
        assert scalars["grad/global_norm"][s] == pytest.approx(total, rel=1e-6)
    texts = tensorboard_texts(tmp_path / "tb")
    norms = {n: expected[f"grad/norm/{n}"][2] for n, _ in net.named_parameters()}
    assert texts["grad/max_norm_tensor/text_summary"][2] == max(norms, key=norms.get)


# MLflow's SQLAlchemy store uses a loader strategy SQLAlchemy 2.1 deprecates (not our code).
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_mlflow_store_holds_the_values_also_of_600_tensors_with_log_keys_all(tmp_path,
                                                                            monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # the run's artifact folder
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    old = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        net = wide()
        with mlflow.start_run() as active, gt.Monitor(
                net, store=tmp_path / "run", log_to=mlflow, log_keys="all",
                stats=("norm", "absmax")) as mon:
            train(mon, net, 1)
        run_id = active.info.run_id
    finally:
        mlflow.set_tracking_uri(old)
    client = MlflowClient(tracking_uri=uri)
    expected = store_values(gt.open_run(tmp_path / "run"))
    assert len(expected) == 600 * 2 + 1  # more than one batch of 1,000 metrics in the step
    logged = client.get_run(run_id).data.metrics
    assert set(expected) <= set(logged)
    for key in ["grad/norm/0.weight", "grad/absmax/299.bias", "loss", "grad/norm/150.bias"]:
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert history == pytest.approx(expected[key], rel=1e-12)
    total = math.sqrt(sum(expected[f"grad/norm/{n}"][0] ** 2 for n, _ in net.named_parameters()))
    history = client.get_metric_history(run_id, "grad/global_norm")
    assert {m.step: m.value for m in history} == {0: pytest.approx(total, rel=1e-12)}


def test_wandb_offline_run_file_holds_the_summary(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                 "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
                 "WANDB_DISABLE_CODE": "true"}.items():
        monkeypatch.setenv(k, v)
    net = mlp()
    run = wandb.init(project="gradtap-test", settings=wandb.Settings(
        x_disable_stats=True, x_disable_meta=True, disable_job_creation=True))
    try:
        with gt.Monitor(net, store=tmp_path / "run", log_to=wandb, log_every=2) as mon:
            train(mon, net, 5, poison=2)
            wandb.log({"mine": 1.0})  # the script's own logging is unaffected
    finally:
        run.finish()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = [r for r in wandb_history(run_file) if "gradtap/step" in r]
    assert [r["gradtap/step"] for r in rows] == [0, 2, 4]
    expected = store_values(gt.open_run(tmp_path / "run"))
    for r in rows:
        s = r["gradtap/step"]
        assert r["loss"] == pytest.approx(expected["loss"][s], rel=1e-12)
        norms = {n: expected[f"grad/norm/{n}"][s] for n, _ in net.named_parameters()}
        if s == 2:  # a NaN gradient: the largest norm is NaN, and its tensor is named
            assert r["grad/max_norm"] == "NaN" or math.isnan(r["grad/max_norm"])
            assert r["grad/max_norm_tensor"] == "0.weight"
            assert r["grad/max_nonfinite"] == 1.0
        else:
            assert r["grad/max_norm"] == pytest.approx(max(norms.values()), rel=1e-12)
            assert r["grad/max_norm_tensor"] == max(norms, key=norms.get)
            assert r["grad/global_norm"] == pytest.approx(
                math.sqrt(sum(v ** 2 for v in norms.values())), rel=1e-12)
    assert any(r.get("mine") == 1.0 for r in wandb_history(run_file))


def test_summary_stays_within_64_keys_on_a_wide_model_with_its_global_and_block_norms():
    net = wide()
    got = []
    with pytest.warns(UserWarning, match=r"the tracker summary keeps 64 keys: the largest value "
                                         r"of update/nonfinite, .* is not sent") as caught:
        with gt.Monitor(net, stats=("norm", "mean", "std", "absmax", "nonfinite", "min", "max",
                                    "zero_frac", "rms"),
                        kinds=("param_grad", "update", "param"),
                        log_to=lambda metrics, step: got.append((step, metrics))) as mon:
            train(mon, net, 3)
    assert len(caught) == 1
    assert [s for s, _ in got] == [0, 1, 2]
    for _, metrics in got:
        assert len(metrics) <= 64
    # oracle: the gradients of the last step, recomputed by autograd
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 2, generator=g) for _ in range(3)]
    grads = torch.autograd.grad(net(xs[2]).pow(2).mean(), list(net.parameters()))
    metrics = got[2][1]
    total = torch.linalg.vector_norm(torch.cat([gr.reshape(-1) for gr in grads]))
    assert metrics["grad/global_norm"] == pytest.approx(total.item(), rel=1e-5)
    groups = {k: v for k, v in metrics.items() if k.startswith("grad/group_norm/")}
    assert len(groups) == 16 and "grad/group_norm/0-18" in groups  # runs of the 300 blocks
    first = torch.linalg.vector_norm(torch.cat([gr.reshape(-1) for gr in grads[:38]]))
    assert groups["grad/group_norm/0-18"] == pytest.approx(first.item(), rel=1e-5)
    assert metrics["grad/max_norm"] == pytest.approx(
        max(torch.linalg.vector_norm(gr).item() for gr in grads), rel=1e-5)
    assert metrics["loss"] > 0 and metrics["grad/spikes"] == 0


def test_log_groups_name_the_group_norms():
    net = mlp()
    got = []
    with gt.Monitor(net, log_groups={"0.*": "input", "*": "rest"},
                    log_to=lambda m, s: got.append(m)) as mon:
        train(mon, net, 1)
    (m,) = got
    g = torch.Generator().manual_seed(0)
    grads = dict(zip([n for n, _ in net.named_parameters()], torch.autograd.grad(
        net(torch.randn(8, 4, generator=g)).pow(2).mean(), list(net.parameters()))))
    for label, glob in (("input", "0.*"), ("rest", "2.*")):
        parts = [v.reshape(-1) for n, v in grads.items() if fnmatch.fnmatchcase(n, glob)]
        assert m[f"grad/group_norm/{label}"] == pytest.approx(
            torch.linalg.vector_norm(torch.cat(parts)).item(), rel=1e-5)


def test_a_spike_is_counted_where_the_run_store_finds_it(tmp_path):
    net = mlp()
    got = {}
    with gt.Monitor(net, stats=("norm",), store=tmp_path / "run",
                    log_to=lambda m, s: got.update({s: m})) as mon:
        g = torch.Generator().manual_seed(0)
        for s in range(40):
            net(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            if s == 30:
                net[2].weight.grad *= 10.0  # one tensor's gradient at one step
            mon.step()
            net.zero_grad()
    spikes = {sp.step for sp in gt.open_run(tmp_path / "run").spikes()}
    assert 30 in spikes and got[30]["grad/spikes"] >= 1
    assert all(got[s]["grad/spikes"] == 0 for s in range(21, 40) if s not in spikes)


def test_the_tensors_a_spike_rule_clipped_are_counted(tmp_path):
    net = mlp()
    got = {}
    rule = gt.transform(net, {"*": gt.zclip(z=1.0, warmup=3)}, when="accumulate")
    with gt.Monitor(net, stats=("norm",), store=tmp_path / "run",
                    log_to=lambda m, s: got.update({s: m})) as mon:
        g = torch.Generator().manual_seed(0)
        for s in range(20):
            scale = 20.0 if s in (10, 15) else 1.0
            net(torch.randn(8, 4, generator=g)).pow(2).mean().mul(scale).backward()
            mon.step()
            net.zero_grad()
    rule.remove()
    frame = gt.open_run(tmp_path / "run").frame(stats="clip_factor")
    clipped = (frame[frame.value < 1.0].groupby("step").size()).to_dict()
    assert clipped.get(10, 0) >= 1
    assert {s: int(m["grad/clipped"]) for s, m in got.items()} == {
        s: clipped.get(s, 0) for s in range(20)}


def test_a_slow_tracker_never_stalls_training_and_its_drops_are_warned_once(monkeypatch):
    from gradtap._monitor.trackers import queue

    monkeypatch.setattr(queue, "QUEUE_SIZE", 4)  # what close() drains: 2 s, not 32 s
    net = mlp()
    calls = []

    def slow(metrics, step):
        time.sleep(0.5)
        calls.append(step)

    def run(log_to):
        mon = gt.Monitor(net, log_to=log_to)
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(mon, net, 20)
        took = time.perf_counter() - start
        mon.close()
        return took, mon, [w for w in caught if "could not log step" in str(w.message)]

    base, _, _ = run(None)
    took, mon, drops = run(slow)
    assert took - base < 2.0
    assert len(drops) == 1
    dropped = mon._pipeline.sinks[1].dropped
    assert dropped and f"step {dropped[0]}" in str(drops[0].message)
    assert calls == [s for s in range(20) if s not in dropped]  # close() drained the rest


@pytest.mark.parametrize("every", [1, 5])
def test_no_host_sync_added_on_a_step_that_is_not_logged(monkeypatch, every):
    net = mlp()
    runs = []
    real = HostCopy.run
    monkeypatch.setattr(HostCopy, "run", lambda self: (runs.append(1), real(self))[1])
    counts = []
    for log_to in (None, lambda m, s: None):
        runs.clear()
        with gt.Monitor(net, every=every, log_to=log_to,
                        log_every=None if log_to is None else 5) as mon:
            train(mon, net, 10)
        counts.append(len(runs))
    assert counts[0] == counts[1] == 10 // every


def test_bad_logging_options_fail_at_construction_naming_what_was_expected():
    net = mlp()
    with pytest.raises(ValueError, match="log_every=5 without log_to="):
        gt.Monitor(net, log_every=5)
    with pytest.raises(ValueError, match="multiple of every=2"):
        gt.Monitor(net, every=2, log_every=3, log_to=print)
    with pytest.raises(ValueError, match="log_keys must be one of 'summary', 'all'"):
        gt.Monitor(net, log_to=print, log_keys="some")
    with pytest.raises(TypeError, match=r"cannot log to 3 \(a builtins.int\); expected a "
                                        r"torch.utils.tensorboard.SummaryWriter"):
        gt.Monitor(net, log_to=3)
    with pytest.raises(ValueError, match="glob 'enc.*' matches no selected parameter"):
        gt.Monitor(net, log_to=print, log_groups={"enc.*": "encoder"})
    mlflow = pytest.importorskip("mlflow")
    assert mlflow.active_run() is None
    with pytest.raises(ValueError, match=r"MLflow has no active run; call mlflow.start_run"):
        gt.Monitor(net, log_to=mlflow)


@pytest.mark.skipif(not __import__("tests._dist", fromlist=["x"]).gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_under_ddp_and_fsdp2_only_rank_zero_logs_the_global_values():
    from tests import _dist_monitor as W
    from tests._dist import run_ranks
    from tests._dist_trackers import logged

    results = run_ranks(logged, 2, kwargs={"modes": ["ddp", "fsdp"]}, timeout=240)
    ref = W.reference()  # one process on the concatenated batch: the global gradients
    for mode in ("ddp", "fsdp"):
        assert results[1][mode] == []  # rank 1 logs nothing
        steps = results[0][mode]
        assert [s for s, _ in steps] == list(range(W.STEPS))
        for s, metrics in steps:
            grads = ref["grad"][s]
            for name, g in grads.items():
                assert metrics[f"grad/norm/{name}"] == pytest.approx(g.norm().item(), rel=1e-9)
                assert metrics[f"grad/absmax/{name}"] == pytest.approx(
                    g.abs().max().item(), rel=1e-9)
            total = torch.cat([g.reshape(-1) for g in grads.values()]).norm().item()
            assert metrics["grad/global_norm"] == pytest.approx(total, rel=1e-9)


def test_a_tracker_that_raises_is_named_once_and_training_goes_on():
    net = mlp()
    calls = []

    def broken(metrics, step):
        calls.append(step)
        raise RuntimeError("disk full")

    with pytest.warns(UserWarning, match=r"stopped logging to .*broken: it raised at step 0: "
                                         r"RuntimeError: disk full") as caught:
        with gt.Monitor(net, log_to=broken, store=None) as mon:
            train(mon, net, 5)
    assert calls == [0] and len(caught) == 1 and mon.frame().step.nunique() == 5


def test_keys_of_module_outputs_and_slices_are_valid_mlflow_names():
    from mlflow.utils.validation import _validate_metric_name

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    got = []
    with gt.Monitor(net, kinds=("param_grad", "grad_output"), stats=("norm", "gain"),
                    split={"0.weight": 0}, log_keys="all",
                    log_to=lambda m, s: got.append(m)) as mon:
        train(mon, net, 1)
    (m,) = got
    assert "grad_output/norm/0" in m and "health/gain/2" in m and "grad/norm/0.weight.5" in m
    for key in m:
        _validate_metric_name(key)  # MLflow's own check of a metric name
    frame = mon.frame()
    value = frame[(frame.name == "0.weight[5]") & (frame.stat == "norm")].value.item()
    assert m["grad/norm/0.weight.5"] == value


def test_spikes_between_logged_steps_are_counted_at_the_next_one(tmp_path):
    net = mlp()
    got = {}
    with gt.Monitor(net, stats=("norm",), store=tmp_path / "run", log_every=10,
                    log_to=lambda m, s: got.update({s: m})) as mon:
        g = torch.Generator().manual_seed(0)
        for s in range(41):
            net(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            if s == 33:  # a step that is not logged
                net[2].weight.grad *= 10.0
            mon.step()
            net.zero_grad()
    spikes = gt.open_run(tmp_path / "run").spikes()
    assert sorted(got) == [0, 10, 20, 30, 40] and 33 in {sp.step for sp in spikes}
    assert got[40]["grad/spikes"] == sum(1 for sp in spikes if 30 < sp.step <= 40) >= 1
    assert got[30]["grad/spikes"] == sum(1 for sp in spikes if 20 < sp.step <= 30)
