"""Training health statistics of the Monitor against direct computation and float64 oracles:
``rms`` of every kind, the loss, kind ``grad_output``'s ``gain`` (``torch.autograd.grad`` at the
module boundary), ``split=`` slices, and the gradient noise scale from micro-batches and from
samples (explicit per-sample gradients, a loop over steps), plus its convergence to the
``B_simple`` of a linear regression's population covariance."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtap as gt
from tests._models import assert_no_hooks

# -- helpers -----------------------------------------------------------------------------------


def values(mon_or_run, stat: str, kind: str = "param_grad") -> dict[tuple[int, str], float]:
    df = mon_or_run.frame(stats=stat, kinds=kind)
    return {(int(r.step), r.name): float(r.value) for r in df.itertuples()}


def mlp64(seed: int = 0, out: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(),
                         nn.Linear(5, out)).double()


def rms(t: torch.Tensor) -> float:
    return math.sqrt(float((t.detach().double() ** 2).mean()))


# -- rms of every kind ---------------------------------------------------------------------------


def test_rms_of_every_kind_equals_direct_computation():
    net = mlp64()
    outputs: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(mod, args, out):
            out.register_hook(lambda g: outputs.__setitem__(name, g))
        return hook

    for name in ("0", "2", "4"):
        net.get_submodule(name).register_forward_hook(keep(name))
    mon = gt.Monitor(net, stats=("rms", "norm"),
                     kinds=("param_grad", "grad_output", "param", "update"))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    for step in range(2):
        x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
        F.cross_entropy(net(x), y).backward()
        mon.step()
        got = {k: values(mon, "rms", k) for k in ("param_grad", "grad_output", "param",
                                                      "update")}
        for n, p in net.named_parameters():
            assert got["param_grad"][(step, n)] == pytest.approx(rms(p.grad), rel=1e-12)
            assert got["param"][(step, n)] == pytest.approx(rms(p), rel=1e-12)
            if step == 1:
                assert got["update"][(step, n)] == pytest.approx(rms(p - before[n]), rel=1e-9)
        for name, g in outputs.items():
            assert got["grad_output"][(step, f"{name}:output")] == pytest.approx(rms(g), rel=1e-12)
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
    mon.close()


def test_rms_is_norm_over_the_square_root_of_the_count_with_nonfinite_values():
    w = nn.Parameter(torch.zeros(4))
    mon = gt.Monitor(nn.ParameterList([w]), stats=("rms", "norm"))
    w.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    mon.step()
    w.grad = torch.tensor([math.inf, 1.0, 0.0, 0.0])
    mon.step()
    r = values(mon, "rms")
    assert r[(0, "0")] == pytest.approx(2.5)
    assert r[(1, "0")] == math.inf


# -- the loss ------------------------------------------------------------------------------------


def test_loss_is_stored_and_read_back_from_the_store(tmp_path):
    net = mlp64()
    losses = []
    with gt.Monitor(net, store=tmp_path / "run", every=2) as mon:
        for step in range(4):
            x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            losses.append(loss.item())
            mon.step(loss=loss if step % 3 else loss.item())  # a tensor or a number
            net.zero_grad()
    run = gt.open_run(tmp_path / "run")
    steps, vals = run.series("<loss>", "value")
    assert steps.tolist() == [0, 2]  # computed steps only (every=2)
    assert vals.tolist() == pytest.approx([losses[0], losses[2]], rel=1e-15)
    assert values(mon, "value", "health")[(2, "<loss>")] == pytest.approx(losses[2], rel=1e-15)
    # the loss has a kind of its own: no statistic of a gradient
    assert "<loss>" not in set(run.frame(kinds="param_grad").name)
    assert set(run.frame(kinds="health").name) == {"<loss>"}


@pytest.mark.parametrize(("loss", "error", "match"), [
    (torch.ones(2), ValueError, r"scalar loss; got a tensor of shape \(2,\)"),
    ("1.0", TypeError, "takes a tensor or a number; got str"),
    (True, TypeError, "got bool"),
])
def test_a_bad_loss_is_refused(loss, error, match):
    net = mlp64()
    mon = gt.Monitor(net)
    net(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(error, match=match):
        mon.step(loss=loss)
    mon.close()


# -- gain ----------------------------------------------------------------------------------------


class Twice(nn.Module):
    """A block called twice, so its gain combines two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(self.block(self.pre(x))))


def test_gain_equals_autograd_grad_at_the_module_boundary_over_all_calls():
    torch.manual_seed(0)
    net = Twice().double()
    x = torch.randn(6, 3, dtype=torch.float64)
    mon = gt.Monitor(net, select=["block", "head"], stats=("gain",), kinds=("grad_output",))
    loss = net(x).pow(2).sum()
    loss.backward()
    mon.step()
    got = values(mon, "gain", "grad_output")

    # The oracle: the same forward with the boundary tensors kept, differentiated directly.
    h0 = net.pre(x)
    h1 = net.block(h0)
    h2 = net.block(h1)
    out = net.head(h2)
    g0, g1, g2, gout = torch.autograd.grad(out.pow(2).sum(), [h0, h1, h2, out])
    sq = lambda t: float((t ** 2).sum())  # noqa: E731
    block = math.sqrt((sq(g0) + sq(g1)) / (sq(g1) + sq(g2)))  # both calls together
    head = math.sqrt(sq(g2) / sq(gout))
    assert got == pytest.approx({(0, "block:output"): block, (0, "head:output"): head},
                                rel=1e-12)
    mon.close()


def test_gain_leaves_out_a_module_whose_input_has_no_gradient():
    net = mlp64()
    mon = gt.Monitor(net, stats=("gain", "norm"), kinds=("grad_output",))
    net(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    mon.step()
    names = {n for _, n in values(mon, "gain", "grad_output")}
    assert "0:output" not in names and "2:output" in names  # 0 is fed the data
    assert (0, "0:output") in values(mon, "norm", "grad_output")
    mon.close()


def test_gain_needs_kind_grad_output():
    with pytest.raises(ValueError, match="'gain' is a statistic of kind 'grad_output'"):
        gt.Monitor(mlp64(), stats=("gain",))


# -- split ---------------------------------------------------------------------------------------


class Experts(nn.Module):
    def __init__(self, e: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(4, e)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.randn(e, 5, 4))
        self.experts.w2 = nn.Parameter(torch.randn(e, 4, 5))

    def forward(self, x):
        gate = self.router(x).softmax(-1)  # [N, E]
        h = torch.einsum("ni,eoi->neo", x, self.experts.w1).relu()
        y = torch.einsum("neo,eio->nei", h, self.experts.w2)
        return (gate[..., None] * y).sum(1)


@pytest.mark.parametrize("dim", [0, -2])
def test_split_gives_each_slice_its_statistics(dim):
    torch.manual_seed(0)
    net = Experts().double()
    mon = gt.Monitor(net, stats=("norm", "mean", "rms"), kinds=("param_grad", "param"),
                     split={"experts.*": dim})
    net(torch.randn(8, 4, dtype=torch.float64)).pow(2).mean().backward()
    mon.step()
    for kind in ("param_grad", "param"):
        for stat, fn in (("norm", lambda t: float(t.norm())), ("mean", lambda t: float(t.mean())),
                         ("rms", rms)):
            got = values(mon, stat, kind)
            for name in ("experts.w1", "experts.w2"):
                p = net.get_parameter(name)
                t = p.grad if kind == "param_grad" else p.detach()
                assert got[(0, name)] == pytest.approx(fn(t), rel=1e-12, abs=1e-15)
                parts = t.unbind(dim)
                for i, part in enumerate(parts):
                    assert got[(0, f"{name}[{i}]")] == pytest.approx(fn(part), rel=1e-12,
                                                                     abs=1e-15)
                assert (0, f"{name}[{len(parts)}]") not in got
            assert not any(n.startswith("router.weight[") for _, n in got)
    mon.close()


@pytest.mark.parametrize(("split", "error", "match"), [
    ({"decoder.*": 0}, gt.SelectionError, "matches no parameter"),
    ({"experts.*": 3}, ValueError, r"has 3 dimension\(s\)"),
    ({"experts.*": "0"}, TypeError, "must be a dimension"),
    ({"experts.*": 0, "experts.w1": 1}, ValueError, "split along dim 0 .* and along dim 1"),
    (["experts.*"], TypeError, r"takes a dict \{glob: dim\}"),
])
def test_bad_split_options(split, error, match):
    with pytest.raises(error, match=match):
        gt.Monitor(Experts(), split=split)


# -- the gradient noise scale: float64 oracles -----------------------------------------------------


def fresh(net: nn.Module) -> nn.Module:
    """A hook-free copy of ``mlp64()`` with ``net``'s values (the oracle's own backwards)."""
    clone = mlp64()
    clone.load_state_dict(net.state_dict())
    return clone


def per_sample_grads(net: nn.Module, x, y) -> dict[str, np.ndarray]:
    """``{name: [N, numel]}``: the gradient of each sample's own loss term (a loop of
    ``torch.autograd.grad``; cross-entropy per sample, the term a mean or a sum is made of)."""
    names = [n for n, _ in net.named_parameters()]
    rows: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for n in range(len(x)):
        loss = F.cross_entropy(net(x[n:n + 1]), y[n:n + 1])
        for name, g in zip(names, torch.autograd.grad(loss, list(net.parameters()))):
            rows[name].append(g.reshape(-1).numpy().astype(np.float64))
    return {n: np.stack(r) for n, r in rows.items()}


def gns_oracle(steps: list[tuple[dict[str, np.ndarray], list[list[int]]]], beta: float
               ) -> list[dict[str, tuple[float, float, float]]]:
    """Per step, ``{name: (gns, ewma trace, ewma sqnorm)}`` from explicit per-sample gradients
    and the pieces (lists of sample indices) of one process: the mean gradient of each piece and
    of the whole batch, the unbiased estimates, EMAs (first value starts them), their ratio."""
    ema: dict[str, tuple[float, float]] = {}
    out = []
    for grads, pieces in steps:
        batch = sum(len(p) for p in pieces)
        inv_b = float(np.mean([1.0 / len(p) for p in pieces]))
        inv_big = 1.0 / batch
        est = {}
        for name, g in grads.items():
            small = float(np.mean([np.sum(g[p].mean(0) ** 2) for p in pieces]))
            big = float(np.sum(g.mean(0) ** 2))
            est[name] = ((small - big) / (inv_b - inv_big),
                         (inv_b * big - inv_big * small) / (inv_b - inv_big))
        est["<all>"] = (sum(v[0] for v in est.values()), sum(v[1] for v in est.values()))
        row = {}
        for name, (trace, sq) in est.items():
            if name in ema:
                t0, s0 = ema[name]
                trace, sq = t0 + (1 - beta) * (trace - t0), s0 + (1 - beta) * (sq - s0)
            ema[name] = (trace, sq)
            row[name] = (trace / sq, trace, sq)
        out.append(row)
    return out


def assert_gns(mon, expected, rel=1e-9):
    got = {stat: values(mon, stat) for stat in ("gns", "gns_trace", "gns_sqnorm")}
    for step, row in enumerate(expected):
        for name, triple in row.items():
            for stat, want in zip(("gns", "gns_trace", "gns_sqnorm"), triple):
                assert got[stat][(step, name)] == pytest.approx(want, rel=rel), (step, name, stat)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("sizes", [[4, 4, 4], [3, 6, 2]])
def test_gns_from_microbatches_equals_the_oracle(reduction, sizes):
    net = mlp64()
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    beta = 0.7
    mon = gt.Monitor(net, stats=("gns", "gns_trace", "gns_sqnorm"), gns_from="microbatches",
                     gns_beta=beta, loss_reduction=reduction)
    steps = []
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(sum(sizes), 4, dtype=torch.float64, generator=g)
        y = torch.randint(0, 3, (sum(sizes),), generator=g)
        pieces, start = [], 0
        for b in sizes:
            pieces.append(list(range(start, start + b)))
            start += b
        steps.append((per_sample_grads(fresh(net), x, y), pieces))
        for idx in pieces:  # each rank's step gradient is the mean (sum) over its samples
            loss = F.cross_entropy(net(x[idx]), y[idx], reduction="sum")
            (loss / len(x) if reduction == "mean" else loss).backward()
        mon.step(batch_size=sizes if len(set(sizes)) > 1 else sizes[0])
        opt.step()
        opt.zero_grad()
    assert_gns(mon, gns_oracle(steps, beta))
    mon.close()
    assert_no_hooks(net)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gns_from_samples_equals_the_oracle(reduction):
    net = mlp64()
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    beta = 0.5
    ps = gt.per_sample(net, loss_reduction=reduction, quantities=("norm",))
    mon = gt.Monitor(net, stats=("gns", "gns_trace", "gns_sqnorm"), gns_from="samples",
                     gns_beta=beta, per_sample=ps)
    steps = []
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(9, 4, dtype=torch.float64, generator=g)
        y = torch.randint(0, 3, (9,), generator=g)
        steps.append((per_sample_grads(fresh(net), x, y), [[i] for i in range(9)]))
        F.cross_entropy(net(x), y, reduction=reduction).backward()
        mon.step()
        opt.step()
        opt.zero_grad()
    assert_gns(mon, gns_oracle(steps, beta))
    mon.close()
    ps.remove()


def test_a_backward_that_accumulates_nothing_is_no_microbatch():
    """``torch.autograd.grad`` inside a step (a gradient penalty) adds no piece: the same
    numbers as without it."""
    def run(extra: bool) -> list[float]:
        net = mlp64()
        mon = gt.Monitor(net, stats=("gns",), gns_from="microbatches")
        g = torch.Generator().manual_seed(6)
        for _ in range(2):
            for _ in range(3):
                x = torch.randn(4, 4, dtype=torch.float64, generator=g)
                F.cross_entropy(net(x), torch.randint(0, 3, (4,), generator=g)).backward()
                if extra:
                    torch.autograd.grad(net(x).sum(), list(net.parameters()))
            mon.step(batch_size=4)
            net.zero_grad()
        return [v for _, v in sorted(values(mon, "gns").items())]

    assert run(True) == run(False)


@pytest.mark.parametrize("source", ["microbatches", "samples"])
def test_gns_under_a_grad_scaler_is_that_of_the_unscaled_gradients(source):
    """The same batches with and without a GradScaler (scale 2^10, parameters fixed): the
    EMAs are those of the unscaled gradients."""
    def run(scaled: bool) -> dict[tuple[int, str], float]:
        net = mlp64().float()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
        ps = gt.per_sample(net, quantities=("norm",)) if source == "samples" else None
        mon = gt.Monitor(net, stats=("gns_trace", "gns_sqnorm"), gns_from=source,
                         per_sample=ps, scaler=scaler, gns_beta=0.5)
        g = torch.Generator().manual_seed(7)
        for _ in range(3):
            for _ in range(2 if source == "microbatches" else 1):
                x = torch.randn(6, 4, generator=g)
                loss = F.cross_entropy(net(x), torch.randint(0, 3, (6,), generator=g))
                (scaler.scale(loss) if scaler is not None else loss).backward()
            mon.step(batch_size=6 if source == "microbatches" else None)
            net.zero_grad()
        out = {**values(mon, "gns_trace"), **{(s, n + "/sq"): v
                                             for (s, n), v in values(mon, "gns_sqnorm").items()}}
        mon.close()
        return out

    plain, scaled = run(False), run(True)
    assert scaled.keys() == plain.keys()
    for key, value in plain.items():
        assert scaled[key] == pytest.approx(value, rel=1e-4, abs=1e-9), key


def test_gns_state_dict_resumes_the_emas():
    def run(split_at: int | None):
        net = mlp64()
        mon = gt.Monitor(net, stats=("gns",), gns_from="microbatches", gns_beta=0.8)
        g = torch.Generator().manual_seed(5)
        out = []
        for step in range(4):
            if step == split_at:
                state = mon.state_dict()
                mon = gt.Monitor(net, stats=("gns",), gns_from="microbatches", gns_beta=0.8)
                mon.load_state_dict(state)
            for _ in range(2):
                x = torch.randn(4, 4, dtype=torch.float64, generator=g)
                F.cross_entropy(net(x), torch.randint(0, 3, (4,), generator=g)).backward()
            mon.step(batch_size=4)
            out.append(values(mon, "gns")[(step, "<all>")])
            net.zero_grad()
        return out

    whole, resumed = run(None), run(2)
    assert resumed == pytest.approx(whole, rel=1e-12)
    assert len(set(whole)) == 4


# -- convergence to the population's B_simple ------------------------------------------------------


@pytest.mark.parametrize("source", ["microbatches", "samples"])
def test_gns_converges_to_b_simple_of_a_linear_regression(source):
    """``g_n = x_n (x_n . w - y_n)`` with ``x ~ N(0, I_d)``, ``y = x . w* + sigma eps``: at
    ``delta = w - w*`` the population has ``G = delta`` and
    ``Sigma = (|delta|^2 + sigma^2) I + delta delta^T``, so
    ``B_simple = (d (|delta|^2 + sigma^2) + |delta|^2) / |delta|^2``."""
    d, sigma = 10, 1.0
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(d, dtype=torch.float64, generator=g)
    delta = torch.randn(d, dtype=torch.float64, generator=g)
    delta = delta / delta.norm()  # |delta| = 1
    net = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        net.weight.copy_(w_star + delta)
    true = (d * (1 + sigma ** 2) + 1) / 1.0
    ps = gt.per_sample(net, quantities=("norm",)) if source == "samples" else None
    mon = gt.Monitor(net, stats=("gns",), gns_from=source, gns_beta=0.99, per_sample=ps)
    for _ in range(400):
        x = torch.randn(32, d, dtype=torch.float64, generator=g)
        y = x @ w_star + sigma * torch.randn(32, dtype=torch.float64, generator=g)
        chunks = x.split(8) if source == "microbatches" else [x]
        for xs, ys in zip(chunks, y.split(len(chunks[0]))):
            (0.5 * (net(xs).squeeze(1) - ys).pow(2).sum() / len(x)).backward()
        mon.step(batch_size=len(chunks[0]) if source == "microbatches" else None)
        net.zero_grad()
    est = values(mon, "gns")[(399, "<all>")]
    assert est == pytest.approx(true, rel=0.2), (est, true)
    mon.close()


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"stats": ("gns",)}, ValueError, "needs both a stat .* and gns_from="),
    ({"gns_from": "microbatches"}, ValueError, "needs both a stat"),
    ({"stats": ("gns",), "gns_from": "batches"}, ValueError, "gns_from must be one of"),
    ({"stats": ("gns",), "gns_from": "ranks"}, ValueError, "needs a process group"),
    ({"stats": ("gns",), "gns_from": "samples"}, ValueError, "pass per_sample=gt.per_sample"),
    ({"stats": ("gns",), "gns_from": "microbatches", "gns_beta": 1.0}, ValueError,
     "gns_beta must be"),
    ({"stats": ("gns",), "gns_from": "microbatches", "loss_reduction": "avg"}, ValueError,
     "loss_reduction must be"),
    ({"loss_reduction": "sum"}, ValueError, "need gns_from="),
    ({"stats": ("gns",), "gns_from": "microbatches", "per_sample": object()}, ValueError,
     "per_sample= feeds gns_from='samples'"),
])
def test_bad_noise_scale_options(kwargs, error, match):
    net = mlp64()
    with pytest.raises(error, match=match):
        gt.Monitor(net, **kwargs)
    assert_no_hooks(net)


def test_noise_scale_per_sample_handle_must_match():
    net = mlp64()
    with gt.per_sample(net, select="0", quantities=("norm",)) as ps:
        with pytest.raises(ValueError, match="does not cover 4 parameter"):
            gt.Monitor(net, stats=("gns",), gns_from="samples", per_sample=ps)
    with gt.per_sample(net, quantities=("grad",)) as ps:
        with pytest.raises(ValueError, match=r"needs its per-sample norms"):
            gt.Monitor(net, stats=("gns",), gns_from="samples", per_sample=ps)
    with gt.per_sample(net, quantities=("norm",), loss_reduction="sum") as ps:
        with pytest.raises(ValueError, match="loss_reduction='mean' but the per_sample"):
            gt.Monitor(net, stats=("gns",), gns_from="samples", per_sample=ps,
                       loss_reduction="mean")


def test_noise_scale_needs_batch_sizes_that_fit_the_step():
    net = mlp64()
    mon = gt.Monitor(net, stats=("gns",), gns_from="microbatches")
    for _ in range(2):
        net(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match=r"needs the number of samples of each micro-batch"):
        mon.step()
    for _ in range(2):
        net(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match=r"lists 3 micro-batch sizes, but this step had 2"):
        mon.step(batch_size=[3, 3, 3])
    net(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match="batch_size must be a positive number"):
        mon.step(batch_size=0)
    mon.close()


def test_a_run_stored_with_the_loss_and_scaler_as_param_grad_still_reads(tmp_path):
    # Runs stored before the health kind held "<loss>" and "<scaler>" as kind param_grad.
    from gradtap._monitor.history import MemoryRun
    from gradtap.report.data import build_report_data
    from gradtap.store import RunWriter

    new = [(0, "w", "param_grad", "norm"), (1, "<loss>", "param_grad", "value"),
           (2, "<scaler>", "param_grad", "amp_scale")]
    writer, memory = RunWriter(tmp_path / "old", {}), MemoryRun({})
    for sink in (writer, memory):
        for step in range(3):
            sink.write_step(step, new if step == 0 else [], np.arange(3),
                            np.array([1.0, 2.0 - step, 1024.0]))
        sink.close()
    for run in (gt.open_run(tmp_path / "old"), memory):
        assert run.series("<loss>", "value")[1].tolist() == [2.0, 1.0, 0.0]
        assert run.series("<scaler>", "amp_scale")[1].tolist() == [1024.0] * 3
    loss = build_report_data(tmp_path / "old").health.loss
    assert loss is not None and loss[1].tolist() == [2.0, 1.0, 0.0]
