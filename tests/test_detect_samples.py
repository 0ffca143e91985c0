"""``gt.detect(..., samples=True)``: the samples behind a NaN, an Inf or a spike, checked
against a per-sample oracle (a loop over the batch, one sample's loss term at a time)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import Tensor, nn

import gradtap as gt
from gradtap import report
from gradtap._detect._culprits import FAR, MIN_SPREAD
from gradtap._samples.calls import BatchSplitError

N = 8


class Sqrt(nn.Module):
    def forward(self, h: Tensor) -> Tensor:
        return torch.sqrt(h)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def terms(net: nn.Module, x: Tensor, y: Tensor, w: Tensor, bonus: Tensor | None = None) -> Tensor:
    """Each sample's term of the mean loss (weighted squared error, plus a constant)."""
    t = w * (net(x) - y).squeeze(1) ** 2 / len(x)
    return t if bonus is None else t + bonus


def oracle_norms(net: nn.Module, params: list[str], x: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """Per-sample gradient norms over ``params``, one backward per sample's term."""
    every = dict(net.named_parameters())
    out = []
    for i in range(len(x)):
        gs = torch.autograd.grad(terms(net, x, y, w)[i], [every[p] for p in params])
        out.append(torch.sqrt(sum(g.double().square().sum() for g in gs)))
    return torch.stack(out)


def expected_far(norms: Tensor) -> list[int]:
    """The definition of docs/semantics.md, written out independently."""
    a = norms.double()
    m = a.median()
    s = max(1.4826 * float((a - m).abs().median()), MIN_SPREAD * float(m))
    named = [i for i in range(len(a)) if (float(a[i]) - float(m)) / s > FAR]
    return sorted(named, key=lambda i: -float(a[i]))


def spike_run(net: nn.Module, weights: Tensor, *, bonus: Tensor | None = None,
              samples: bool = True, ids: bool = True) -> tuple[gt.Detector, tuple]:
    """Healthy steps, then one step with per-sample weights ``weights``; the last batch."""
    det = gt.detect(net, action="record", spike=True, warmup=5, samples=samples)
    gen = torch.Generator().manual_seed(1)
    for step in range(10):
        x, y = torch.randn(N, 4, generator=gen), torch.randn(N, 1, generator=gen)
        w = weights if step == 9 else torch.ones(N)
        terms(net, x, y, w, bonus if step == 9 else None).sum().backward()
        det.step(sample_ids=[f"s{step}-{i}" for i in range(N)] if ids and samples else None)
        net.zero_grad()
    det.remove()
    return det, (x, y, w)


def test_a_nan_in_one_input_row_names_that_row():
    net = mlp()
    x = torch.randn(N, 4)
    x[3, 1] = float("nan")
    expected = torch.isnan(x).any(1).nonzero().flatten().tolist()
    with gt.detect(net, action="record", samples=True) as det:
        net(x).sum().backward()
        det.step(sample_ids=list(range(100, 100 + N)))
    (a,) = det.anomalies
    assert (a.where, a.samples, a.sample_ids) == ("forward", tuple(expected), (103,))
    assert "samples (batch positions, worst first): 3" in a.message


def test_a_nan_born_mid_network_for_one_sample_names_it_worst_first():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), Sqrt(), nn.Linear(4, 1))
    x = torch.randn(N, 4)
    with torch.no_grad():
        net[0].weight.copy_(torch.eye(4))
        net[0].bias.zero_()
    x = x.abs() + 0.1
    x[2, :3] = -1.0  # three NaN in sample 2's sqrt
    x[6, 0] = -1.0   # one in sample 6's
    # Oracle: each sample's forward alone, the NaN counts of the sqrt's output.
    counts = [int(torch.isnan(net[1](net[0](x[i:i + 1]))).sum()) for i in range(N)]
    expected = sorted((i for i in range(N) if counts[i]), key=lambda i: -counts[i])
    with gt.detect(net, action="record", samples=True) as det:
        net(x).sum().backward()
        det.step()
    (a,) = det.anomalies
    assert (a.module_name, a.where, a.kind) == ("1", "forward", "nan")
    assert list(a.samples) == expected == [2, 6]
    assert a.sample_ids is None


def test_a_backward_only_inf_for_one_sample_names_the_sample_whose_own_gradient_breaks():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), Sqrt(), nn.Linear(4, 1))
    with torch.no_grad():
        net[0].weight.copy_(torch.eye(4))
        net[0].bias.zero_()
    x = torch.rand(N, 4) + 0.1
    x[5, 2] = 0.0  # sqrt(0) = 0 is finite; its gradient is not
    y = torch.randn(N, 1)
    assert torch.isfinite(net(x)).all()
    bad = []
    for i in range(N):  # oracle: each sample alone, its own gradient of the first layer
        term = ((net(x[i:i + 1]) - y[i:i + 1]) ** 2).sum() / N
        gs = torch.autograd.grad(term, list(net[0].parameters()))
        if not all(torch.isfinite(g).all() for g in gs):
            bad.append(i)
    with gt.detect(net, action="record", samples=True) as det:
        ((net(x) - y) ** 2).mean().backward()
        det.step(sample_ids=torch.arange(10, 10 + N))
    (a,) = det.anomalies
    assert (a.module_name, a.where) == ("1", "grad_input")
    assert list(a.samples) == bad == [5]
    assert a.sample_ids == (15,)


def test_a_spike_from_one_sample_weighted_1000x_names_it_by_its_gradient_norm():
    net = mlp()
    w = torch.ones(N)
    w[5] = 1000.0
    det, (x, y, w) = spike_run(net, w)
    (a,) = det.anomalies
    assert (a.kind, a.step) == ("spike", 9)
    params = a.slot.split(",")
    norms = oracle_norms(net, [f"{a.module_name}.{p}" for p in params], x, y, w)
    assert list(a.samples) == expected_far(norms) == [5]
    assert a.sample_ids == ("s9-5",)
    shown = float(a.message.split("5 (norm ")[1].split(")")[0])
    assert shown == pytest.approx(float(norms[5]), rel=1e-3)


def test_two_culprits_are_ranked_by_their_per_sample_gradient_norms():
    net = mlp()
    w = torch.ones(N)
    w[2], w[6] = 400.0, 1500.0
    det, (x, y, w) = spike_run(net, w)
    (a,) = det.anomalies
    norms = oracle_norms(net, [f"{a.module_name}.{p}" for p in a.slot.split(",")], x, y, w)
    assert list(a.samples) == expected_far(norms)
    assert set(a.samples) == {2, 6}
    assert list(a.samples) == sorted([2, 6], key=lambda i: -float(norms[i]))
    assert a.sample_ids == tuple(f"s9-{i}" for i in a.samples)


def test_a_huge_loss_with_a_tiny_gradient_is_not_named_over_the_real_culprit():
    net = mlp()
    w = torch.ones(N)
    w[4] = 1000.0
    bonus = torch.zeros(N)
    bonus[1] = 1e7  # sample 1's loss is by far the largest, and has no gradient
    det, (x, y, w) = spike_run(net, w, bonus=bonus)
    (a,) = det.anomalies
    losses = terms(net, x, y, w, bonus).detach()
    assert int(losses.argmax()) == 1
    norms = oracle_norms(net, [f"{a.module_name}.{p}" for p in a.slot.split(",")], x, y, w)
    assert int(norms.argmax()) == 4
    assert a.samples[0] == 4 and 1 not in a.samples


def test_samples_do_not_change_what_is_found():
    w = torch.ones(N)
    w[3] = 1000.0
    found = []
    for samples in (False, True):
        det, _ = spike_run(mlp(), w, samples=samples)
        found.append([(a.step, a.module_name, a.kind, a.slot) for a in det.anomalies])
        assert all((a.samples is None) != samples for a in det.anomalies)
    assert found[0] == found[1] != []


def test_batch_dim_names_samples_of_a_time_major_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, N, 4)  # [T, N, F]
    x[:, 2, 0] = float("nan")
    x[4, 7, 1] = float("nan")
    with gt.detect(net, action="record", samples=True, batch_dim=1) as det:
        net(x).sum().backward()
        det.step(sample_ids=list("abcdefgh"))
    (a,) = det.anomalies
    assert a.samples == (2, 7)  # sample 2 has five NaN, sample 7 one
    assert a.sample_ids == ("c", "h")


class Folded(nn.Module):
    """Folds the whole batch into one row before a square root: no row per sample there."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.root, self.head = nn.Linear(4, 4), Sqrt(), nn.Linear(4 * N, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.root(self.pre(x).reshape(1, -1))).expand(len(x), 1)


def test_a_batch_that_does_not_split_is_a_clear_error_and_the_anomaly_is_kept():
    torch.manual_seed(0)
    net = Folded()
    with torch.no_grad():
        net.pre.weight.copy_(torch.eye(4))
        net.pre.bias.zero_()
    x = torch.rand(N, 4) + 0.1
    x[5, 2] = 0.0  # an Inf gradient at the folded square root
    with gt.detect(net, action="record", samples=True) as det:
        with pytest.raises(BatchSplitError, match=r"\(1, 32\) has no row per sample along "
                           r"batch_dim=0 \(8 samples\).*batch_dim= \(1 for a time-major"):
            net(x).sum().backward()
        det.step()
    (a,) = det.anomalies
    assert (a.module_name, a.where, a.samples) == ("root", "grad_input", ())
    assert "samples: not named" in a.message


def test_sample_ids_are_checked():
    net = mlp()
    with pytest.raises(ValueError, match="samples=True names the samples in the replay"):
        gt.detect(net, samples=True, replay=False)
    with pytest.raises(ValueError, match="batch_dim must be an int >= 0"):
        gt.detect(net, samples=True, batch_dim=-1)
    with gt.detect(net, action="record") as det:
        net(torch.randn(N, 4)).sum().backward()
        with pytest.raises(ValueError, match="pass samples=True"):
            det.step(sample_ids=list(range(N)))
    bad = torch.randn(N, 4)
    bad[0, 0] = float("nan")
    with gt.detect(net, action="record", samples=True) as det:
        net(torch.randn(N, 4)).sum().backward()
        det.step(sample_ids=[1, 2, 3])  # a healthy step does not read them
        for step, (ids, error, match) in enumerate([
                ([1, 2, 3], ValueError, r"has 3 ids, but this step's batch has 8"),
                ([1.5] * N, TypeError, "ints or strs"),
                ("abcdefgh", TypeError, "a sequence of ids")], start=1):
            net(bad).sum().backward()
            with pytest.raises(error, match=match):
                det.step(sample_ids=ids)
            assert det.steps_done == step + 1  # the step is closed all the same
        assert [a.sample_ids for a in det.anomalies] == [None] * 3


def test_samples_and_their_ids_round_trip_through_the_run_store_and_show_in_the_report(tmp_path):
    net = mlp()
    run_dir = tmp_path / "run"
    with gt.Monitor(net, store=run_dir) as mon, \
            gt.detect(net, action="record", samples=True) as det:
        for step in range(3):
            x = torch.randn(N, 4)
            if step == 2:
                x[6, 0] = float("inf")
            net(x).sum().backward()
            mon.step()
            det.step(sample_ids=[f"img_{step}_{i}.png" for i in range(N)])
            net.zero_grad()
    report.write_anomalies(run_dir, det.anomalies)
    stored = json.loads((run_dir / "anomalies.json").read_text())["anomalies"]
    assert [(a["samples"], a["sample_ids"]) for a in stored] == [([6], ["img_2_6.png"])]
    read, _ = report.read_anomalies(run_dir)
    assert read[0]["sample_ids"] == ["img_2_6.png"]
    page = report.write_report(run_dir).read_text()
    assert "<th>samples</th>" in page
    assert 'img_2_6.png <span class="muted">(row 6)</span>' in page


class Twice(nn.Module):
    """One Linear called twice in a forward: its per-sample gradients add over the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def test_a_module_called_twice_is_ranked_by_its_summed_per_sample_gradient():
    torch.manual_seed(0)
    net = Twice()
    w = torch.ones(N)
    w[1], w[7] = 2000.0, 600.0
    det, (x, y, w) = spike_run(net, w)
    (a,) = det.anomalies
    norms = oracle_norms(net, [f"{a.module_name}.{p}" for p in a.slot.split(",")], x, y, w)
    assert list(a.samples) == expected_far(norms) and set(a.samples) == {1, 7}


@pytest.mark.parametrize("module", [nn.Linear(3, 2), nn.Sequential(nn.Linear(3, 2), nn.Tanh())])
def test_the_engine_gives_one_recorded_calls_per_sample_gradients_and_norms(module):
    """``_samples.calls.call_compute`` (a rule; the ``torch.func`` fallback for a module
    without one) against a loop over samples."""
    from gradtap._samples.calls import call_compute

    torch.manual_seed(0)
    x = torch.randn(5, 3)
    params = [n for n, _ in module.named_parameters()]
    with gt.tap(module, select=lambda name, _m: name == "", keep=("inputs",)) as t:
        module(x).pow(2).sum().backward()
    comp = call_compute(module, "", t.records[0], params, n=5, batch_dim=0)
    grads, norm_sq = comp.grads(), comp.norm_sq()
    for i in range(5):
        expected = torch.autograd.grad(module(x[i:i + 1]).pow(2).sum(),
                                       list(module.parameters()))
        for p, g in zip(params, expected):
            torch.testing.assert_close(grads[p][i], g)
            torch.testing.assert_close(norm_sq[p][i], g.square().sum())


def test_the_dump_carries_the_samples(tmp_path):
    net = mlp()
    x = torch.randn(N, 4)
    x[[1, 4], 0] = float("nan")
    x[4, 3] = float("nan")
    with gt.detect(net, action="record", samples=True, dump_dir=tmp_path) as det:
        net(x).sum().backward()
        det.step()
    (a,) = det.anomalies
    assert a.samples == (4, 1)  # two NaN in row 4, one in row 1
    assert a.dump_path is not None
    assert gt.load_dump(a.dump_path)["anomaly"]["samples"] == [4, 1]


def test_benchmark_script_runs_quick(capsys):
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        table = importlib.import_module("detect_samples").main(["--quick"])
    finally:
        sys.path.pop(0)
    assert table.count("\n") == 2 and "samples=True (x gt.detect)" in table
