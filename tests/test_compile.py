"""Compiled models: every feature accepts ``torch.compile(model)`` and ``model.compile()``,
names things as the original model, gives the numbers of an eager run, and the parameter
kinds add no graph break; per-call features run the compiled code eagerly and say so once."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import gradtap as gt
from gradtap.select import unwrap_model

MODES = ("wrapper", "inplace")  # torch.compile(model) / model.compile()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled(net: nn.Module, mode: str, backend: Any = "aot_eager") -> nn.Module:
    if mode == "eager":
        return net
    if mode == "wrapper":
        return torch.compile(net, backend=backend)
    net.compile(backend=backend)
    return net


def train(mode: str, feature: Callable[[nn.Module, torch.optim.Optimizer], Any] | None,
          after_backward: Callable[[Any], None] = lambda obj: None, *, steps: int = 3,
          backend: Any = "aot_eager", data: list[torch.Tensor] | None = None,
          cls: type[Net] = Net) -> tuple[Net, Any, list[dict[str, torch.Tensor]]]:
    """A few SGD steps of a fresh Net (seed 0) on seeded data, ``feature`` made on the model as
    ``mode`` compiles it; returns the net, the feature and each step's gradients."""
    torch.manual_seed(0)
    net = cls()
    model = compiled(net, mode, backend)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    obj = feature(model, opt) if feature is not None else None
    torch.manual_seed(1)
    grads = []
    for s in range(steps):
        x = data[s] if data is not None else torch.randn(6, 4)
        F.mse_loss(model(x), torch.randn(6, 3)).backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        after_backward(obj)
        opt.step()
        opt.zero_grad()
    return net, obj, grads


def no_eager_warning(caught: list[warnings.WarningMessage]) -> bool:
    return not [w for w in caught if "eagerly" in str(w.message)]


# -- names ----------------------------------------------------------------------------------


def test_unwrap_gives_the_original_model_and_leaves_others_alone():
    net = Net()
    assert unwrap_model(torch.compile(net, backend="eager")) is net
    assert unwrap_model(net) is net
    net.compile(backend="eager")
    assert unwrap_model(net) is net
    # A compiled wrapper names its modules with _orig_mod.; every feature does not.
    assert "_orig_mod.a" in dict(torch.compile(Net(), backend="eager").named_modules())


@pytest.mark.parametrize("mode", MODES)
def test_every_feature_names_things_as_the_original_model(mode):
    torch.manual_seed(0)
    net = Net()
    model = compiled(net, mode)
    names = ["a.weight", "a.bias", "b.weight", "b.bias"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gt.tap(model) as t:
            assert t.names == ["a", "b"]
        ex = gt.explain(model, torch.randn(2, 4))
        assert {r.module_name for r in ex.records} == {"a", "b"}
        with gt.Monitor(model, kinds=("param_grad", "grad_output")) as mon:
            model(torch.randn(2, 4)).sum().backward()
            mon.step()
        assert set(mon.frame()["name"]) == set(names) | {"a:output", "b:output"}
        with gt.transform(model, {"a.*": gt.scale(1.0)}) as h:
            assert list(h.plan()) == ["a.weight", "a.bias"]
        with gt.per_sample(model) as ps:
            model(torch.randn(2, 4)).sum().backward()
        assert sorted(ps.grad) == sorted(names)
        with gt.detect(model, spike=10.0):
            pass


# -- graph breaks ---------------------------------------------------------------------------

_NO_BREAK: dict[str, Callable[[nn.Module, torch.optim.Optimizer], Any]] = {
    "monitor": lambda m, opt: gt.Monitor(
        m, kinds=("param_grad", "param", "update", "grad_cosine"), ewma=0.9, hist_bins=8,
        stats=("norm", "mean", "std", "absmax", "min", "max", "nonfinite", "zero_frac")),
    "transform_accumulate": lambda m, opt: gt.transform(
        m, {"a.*": gt.clip_norm(1.0), "*": gt.ewma(0.9)}, when="accumulate"),
    "transform_step": lambda m, opt: gt.transform(
        m, {"*": gt.clip_global_norm(0.5)}, when="step", optimizer=opt),
    "detect": lambda m, opt: gt.detect(m),
    "detect_spike": lambda m, opt: gt.detect(m, spike=True, warmup=3),
}


def _step(obj: Any) -> None:
    if hasattr(obj, "step"):
        obj.step()


def _compiled_run(mode: str, feature: Any) -> tuple[int, int, int]:
    """(frames compiled, ops in the graphs, graph breaks) of three training steps."""
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounter()
    train(mode, feature, _step, backend=cnt)
    return cnt.frame_count, cnt.op_count, sum(counters["graph_break"].values())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(_NO_BREAK))
def test_parameter_features_add_no_graph_break_and_no_recompile(mode, name):
    plain = _compiled_run(mode, None)
    assert plain[0] == 1 and plain[2] == 0  # one graph, no break: the baseline is meaningful
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _compiled_run(mode, _NO_BREAK[name]) == plain
    assert no_eager_warning(caught)


@pytest.mark.filterwarnings("ignore")  # Dynamo's own warnings while it handles the break
def test_the_graph_break_count_sees_a_hook_traced_by_dynamo():
    # The counter the test above relies on does count a break a hook body causes.
    torch.manual_seed(0)
    net = Net()
    net.a.register_forward_hook(lambda mod, args, out: torch._dynamo.graph_break())
    net.compile(backend=CompileCounter())
    net(torch.randn(2, 4))
    assert sum(counters["graph_break"].values()) > 0


# -- parity with eager ----------------------------------------------------------------------


def _frame(mon: gt.Monitor) -> dict[tuple, float]:
    df = mon.frame()
    return {(int(r.step), r.name, r.kind, r.stat): float(r.value) for r in df.itertuples()}


@pytest.mark.parametrize("mode", MODES)
def test_monitor_every_kind_matches_eager(mode):
    def make(m: nn.Module, opt: Any) -> gt.Monitor:
        return gt.Monitor(m, kinds=("param_grad", "param", "update", "grad_cosine",
                                    "grad_output"), ewma=0.9, hist_bins=6)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, eager, grads = train("eager", make, _step)
        _, comp, _ = train(mode, make, _step)
    said = [w for w in caught if "Monitor(kinds=['grad_output'])" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__
    want, got = _frame(eager), _frame(comp)
    assert sorted(got) == sorted(want)
    torch.testing.assert_close(torch.tensor([got[k] for k in sorted(want)]),
                               torch.tensor([want[k] for k in sorted(want)]))
    # Oracle: the stored gradient norms are those of the gradients the optimizer received.
    for s, g in enumerate(grads):
        for n, t in g.items():
            assert got[(s, n, "param_grad", "norm")] == pytest.approx(float(t.norm()), rel=1e-5)
    torch.testing.assert_close(comp.ewma_var("a.weight"), eager.ewma_var("a.weight"))
    torch.testing.assert_close(comp.histogram("b.weight").counts,
                               eager.histogram("b.weight").counts)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("when", ["accumulate", "step", "backward"])
def test_transform_matches_eager(mode, when):
    def make(m: nn.Module, opt: Any) -> Any:
        return gt.transform(m, {"a.weight": gt.clip_norm(0.05), "*": gt.ewma(0.5)},
                            when=when, optimizer=opt if when == "step" else None)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager_net, eager, _ = train("eager", make)
        comp_net, comp, _ = train(mode, make)
    assert (len([w for w in caught if "eagerly" in str(w.message)]) == 1) == (when == "backward")
    for (n, p), (_, q) in zip(comp_net.named_parameters(), eager_net.named_parameters()):
        torch.testing.assert_close(p, q, msg=n)
    torch.testing.assert_close(comp.state_dict()["state"]["b.bias"]["mean"],
                               eager.state_dict()["state"]["b.bias"]["mean"])


@pytest.mark.parametrize("mode", MODES)
def test_transform_of_activation_gradients_matches_eager(mode):
    def make(m: nn.Module, opt: Any) -> Any:
        return gt.transform(m, {"a": gt.scale(0.5)}, on="grad_output")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, eager = train("eager", make)
        _, _, comp = train(mode, make)
    for g, h in zip(comp, eager):
        for n in g:
            torch.testing.assert_close(g[n], h[n], msg=n)
    # The rule did act: a's gradients are half the plain ones, b's unchanged.
    _, _, plain = train("eager", None, steps=1)
    torch.testing.assert_close(eager[0]["a.weight"], 0.5 * plain[0]["a.weight"])
    torch.testing.assert_close(eager[0]["b.weight"], plain[0]["b.weight"])


@pytest.mark.parametrize("mode", MODES)
def test_tap_records_match_eager_and_the_warning_comes_once(mode):
    x = torch.randn(5, 4)
    results = {}
    for m in ("eager", mode):
        torch.manual_seed(0)
        net = Net()
        model = compiled(net, m)
        model(x)  # compiled before the tap: its hooks must not be skipped
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with gt.tap(model, keep=("inputs",)) as t:
                for _ in range(2):
                    model(x).pow(2).sum().backward()
        said = [w for w in caught if "eagerly" in str(w.message)]
        assert len(said) == (0 if m == "eager" else 1)
        if said:
            assert "gt.tap" in str(said[0].message) and "'a'" in str(said[0].message)
            assert said[0].filename == __file__  # points at the user's line
        results[m] = t.records
    assert len(results[mode]) == len(results["eager"]) == 4
    for r, e in zip(results[mode], results["eager"]):
        assert (r.module_name, r.call) == (e.module_name, e.call)
        for k in e.param_grads:
            torch.testing.assert_close(r.param_grads[k], e.param_grads[k])
        torch.testing.assert_close(r.grad_outputs["output"], e.grad_outputs["output"])
    # Oracle: module b's weight gradient at its boundary, from torch.autograd.grad.
    torch.manual_seed(0)
    net = Net()
    out = net(x).pow(2).sum()
    (gw,) = torch.autograd.grad(out, [net.b.weight])
    torch.testing.assert_close(results[mode][0].param_grads["weight"], gw)


@pytest.mark.parametrize("mode", MODES)
def test_the_compiled_code_comes_back_when_the_last_tap_goes(mode):
    torch.manual_seed(0)
    cnt = CompileCounter()
    net = Net()
    model = compiled(net, mode, cnt)
    x = torch.randn(3, 4)
    model(x)
    before = (model.__dict__["forward"] if mode == "wrapper" else net._compiled_call_impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = gt.tap(model, "a")
        second = gt.Monitor(model, kinds=("grad_output",))
    model(x).sum().backward()
    first.remove()
    model(x).sum().backward()  # the Monitor still needs the eager code
    assert [r.module_name for r in first.records] == ["a"]
    second.step()
    assert set(second.frame()["name"]) == {"a:output", "b:output"}
    second.close()
    now = (model.__dict__["forward"] if mode == "wrapper" else net._compiled_call_impl)
    assert now is before
    frames = cnt.frame_count
    model(x)
    assert cnt.frame_count == frames == 1  # the first compiled graph, reused


@pytest.mark.parametrize("mode", MODES)
def test_explain_matches_eager_and_says_nothing(mode):
    x = torch.randn(2, 4)
    torch.manual_seed(0)
    eager = gt.explain(Net(), x)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comp = gt.explain(compiled(Net(), mode), x)
    assert no_eager_warning(caught)
    assert str(comp) == str(eager)


@pytest.mark.parametrize("mode", MODES)
def test_per_sample_matches_eager_and_a_per_sample_loop(mode):
    torch.manual_seed(0)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    torch.manual_seed(0)
    net = Net()
    model = compiled(net, mode)
    with pytest.warns(UserWarning, match="per_sample on a compiled model runs"):
        ps = gt.per_sample(model, loss_reduction="sum", quantities=("grad", "norm"))
    with ps:
        F.mse_loss(model(x), y, reduction="sum").backward()
    torch.manual_seed(0)
    ref = Net()
    for i in range(5):
        loss = F.mse_loss(ref(x[i:i + 1]), y[i:i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, list(ref.parameters()))
        for (n, _), g in zip(ref.named_parameters(), grads):
            torch.testing.assert_close(ps.grad[n][i], g)


class SqrtNet(Net):
    """Net with sqrt in place of tanh: NaN where a's output is negative (positive weights and
    bias, so positive inputs are fine)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.a.weight.abs_()
            self.a.bias.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.sqrt(self.a(x)))


def _faulty_data() -> list[torch.Tensor]:
    torch.manual_seed(5)
    data = [torch.randn(6, 4).abs() for _ in range(4)]
    data[2] = -100 * data[2]  # a's output turns negative at step 2
    return data


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("replay", [True, False])
def test_detect_finds_the_same_origin_as_eager(mode, replay):
    def make(m: nn.Module, opt: Any) -> Any:
        return gt.detect(m, action="record", replay=replay)

    found = {}
    for m in ("eager", mode):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, det, _ = train(m, make, _step, steps=4, data=_faulty_data(), cls=SqrtNet)
        said = [w for w in caught if "eagerly" in str(w.message)]
        assert len(said) == (1 if m != "eager" and not replay else 0)
        if said:
            assert "detect(replay=False)" in str(said[0].message)
        found[m] = [(a.step, a.module_name, a.kind, a.where, a.slot) for a in det.anomalies]
    assert found[mode] == found["eager"]
    assert found["eager"][0][:4] == (2, "", "nan", "forward")  # sqrt in the model's forward


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_monitor_matches_eager():
    # One real compile (CPU inductor takes seconds): float tolerance, not bit equality.
    def make(m: nn.Module, opt: Any) -> gt.Monitor:
        return gt.Monitor(m, kinds=("param_grad", "update"))

    _, eager, _ = train("eager", make, _step, steps=2)
    _, comp, _ = train("wrapper", make, _step, steps=2, backend="inductor")
    want, got = _frame(eager), _frame(comp)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k


# Dynamo's tracing of the post-accumulate hook reads .grad of its fake parameter (torch's own).
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_autograd_parameter_features_match_the_plain_backward():
    # What the docs say works under compiled autograd: Monitor's parameter kinds (no hook),
    # transform on accumulate (per-parameter rules) and on step.
    from torch._dynamo import compiled_autograd

    def make(m: nn.Module, opt: Any) -> tuple[Any, ...]:
        return (gt.Monitor(m, kinds=("param_grad", "update"), ewma=0.9),
                gt.transform(m, {"a.*": gt.clip_norm(0.05)}),
                gt.transform(m, {"b.*": gt.scale(0.5)}, when="step", optimizer=opt))

    runs = {}
    for enabled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = Net()
        model = torch.compile(net, backend="aot_eager")
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        mon, *_ = make(model, opt)
        torch.manual_seed(1)
        for _ in range(2):
            loss = F.mse_loss(model(torch.randn(6, 4)), torch.randn(6, 3))
            if enabled:
                with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                    loss.backward()
            else:
                loss.backward()
            mon.step()
            opt.step()
            opt.zero_grad()
        runs[enabled] = (net, _frame(mon), mon.ewma_var("a.weight"))
    (plain, want, var), (comp, got, var_c) = runs[False], runs[True]
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
    torch.testing.assert_close(var_c, var)
    for (n, p), (_, q) in zip(comp.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, msg=n)
