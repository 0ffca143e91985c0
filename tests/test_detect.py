"""gt.detect: planted faults found at the exact module and slot, spikes against a naive float64
EWMA loop, dumps that load safely, cheapness (two host syncs per step, none in the hooks)."""

from __future__ import annotations

import copy
import doctest
import importlib
import inspect
import json
import math
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import gradtap as gt
from gradtap._detect import (
    AnomalyWarning,
    Detector,
    DumpError,
    _detector,
    _host,
    format_dump,
    inspect_main,
)
from gradtap._detect._screen import Screen
from gradtap._detect._watch import WatchOptions
from gradtap._tensorops.spikes import scores
from gradtap.capture import compat
from tests._models import _MODULE_HOOK_DICTS, assert_no_hooks

# -- planted faults ---------------------------------------------------------------------------


class SqrtOfInput(nn.Module):
    """A custom module: NaN for negative inputs in forward, Inf gradient at 0 in backward."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sqrt(x)


class _Times(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by ``factor`` in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        return g * ctx.factor, None


class _PlusInf(torch.autograd.Function):
    """Identity in forward; adds +Inf to the gradient in backward."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g + math.inf


class BadInputGrad(nn.Module):
    """Finite forward; its backward sends +Inf to its input."""

    def forward(self, x: Tensor) -> Tensor:
        return _PlusInf.apply(x) * 2.0


class ScaledLinear(nn.Linear):
    """A Linear whose weight gradient is multiplied by ``factor`` (1 = plain Linear)."""

    factor = 1.0

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, _Times.apply(self.weight, self.factor), self.bias)


class Square(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * x


def sqrt_at_zero_net() -> nn.Sequential:
    """Linear (no bias), x * x, sqrt, Linear: a zero input row is a sqrt at 0, whose Inf
    gradient the square turns into NaN (0 * Inf) on its way to the first Linear's weight."""
    net = nn.Sequential(nn.Linear(16, 16), Square(), SqrtOfInput(), nn.Linear(16, 4))
    with torch.no_grad():
        net[0].bias.zero_()
    return net


class GradScaler(nn.Module):
    """Identity whose backward multiplies the gradient by ``factor``."""

    factor = 1.0

    def forward(self, x: Tensor) -> Tensor:
        return _Times.apply(x, self.factor)


def twenty_layers(fault_at: int | None = 10, fault: type[nn.Module] = SqrtOfInput) -> nn.Sequential:
    """20 layers alternating Linear(16, 16) and Tanh, with ``fault()`` at index ``fault_at``."""
    layers: list[nn.Module] = []
    for i in range(20):
        if i == fault_at:
            layers.append(fault())
        else:
            layers.append(nn.Linear(16, 16) if i % 2 == 0 else nn.Tanh())
    return nn.Sequential(*layers)


def first_nonfinite_output(net: nn.Sequential, x: Tensor) -> tuple[int, Tensor]:
    """Oracle: run the layers one by one; index of the first non-finite output, and its input."""
    h = x
    with torch.no_grad():
        for i, layer in enumerate(net):
            out = layer(h)
            if not torch.isfinite(out).all():
                return i, h
            h = out
    raise AssertionError("the planted fault made nothing non-finite")


@pytest.fixture(params=["model", "modules", "eager", "deferred"])
def mode(request, monkeypatch):
    """Run a test with the default watch (a light screen of the model, or of every selected
    module, then a replay under the per-call watch), and with the per-call watch from the
    start: every record measured as it arrives (CPU records with large gradients), or every
    record kept and reduced once at the end of the backward (small CPU records, and all
    records on accelerators). ``gt.detect`` is wrapped to pass those choices on."""
    param = request.param
    options = WatchOptions(eager_on_cpu=param == "eager", eager_min_elements=0)
    signature = inspect.signature(_detector.detect)

    def detect(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if param in ("eager", "deferred") and a["replay"] is None:
            a["replay"] = False  # the per-call watch where the test leaves the choice open
        replays = a["replay"] if a["replay"] is not None else a["spike"] is None
        if param == "modules" and a["screen"] is None and replays:
            a["screen"] = "modules"
        return Detector(**a, options=options)

    monkeypatch.setattr(gt, "detect", detect)
    return param


def catch(fn) -> gt.Anomaly:
    with pytest.raises(gt.GradientAnomaly) as info:
        fn()
    assert isinstance(info.value, FloatingPointError)
    assert isinstance(info.value.anomaly, gt.Anomaly)
    assert str(info.value) == info.value.anomaly.message
    return info.value.anomaly


# -- forward origin ---------------------------------------------------------------------------


def test_sqrt_of_negative_in_the_middle_of_a_20_layer_net_is_the_forward_origin(device):
    torch.manual_seed(0)
    net = twenty_layers(10).to(device)
    x = torch.randn(8, 16).to(device)
    index, fault_input = first_nonfinite_output(net, x)
    assert index == 10
    with gt.detect(net) as det:
        a = catch(lambda: F.mse_loss(net(x), torch.zeros(8, 16, device=device)).backward())
    assert (a.module_name, a.module_type, a.kind, a.where, a.slot, a.step, a.call) == (
        "10", "SqrtOfInput", "nan", "forward", "output", 0, 0)
    assert det.anomalies == [a] and det.should_skip()
    # Exact counts: sqrt saved its result for backward, so the output is still there (read
    # back where torch says which saved tensors sit behind a hook; elsewhere none is read).
    counts = (int((fault_input < 0).sum()), 0) if compat.saved_tensors_readable() else (None, None)
    assert (a.nan, a.inf, a.numel) == (*counts, fault_input.numel())
    assert a.record is not None and a.record.module_name == "10"  # the backward still ran
    # The report: module path and type, slot, the input range and the hint.
    lo = float(fault_input.min())
    assert "'10' (SqrtOfInput, call 0)" in a.message and "output 'output'" in a.message
    assert f"{lo:.4g}" in a.message and "sqrt, log or a fractional pow" in a.message
    assert "float32" in a.message


def test_forward_origin_counts_are_exact_when_dumps_keep_forward_tensors(tmp_path):
    torch.manual_seed(1)
    net = twenty_layers(10)
    x = torch.randn(8, 16)
    _, fault_input = first_nonfinite_output(net, x)
    with gt.detect(net, action="record", dump_dir=tmp_path) as det:
        net(x).sum().backward()
    (a,) = det.anomalies
    assert (a.nan, a.inf, a.numel) == (int((fault_input < 0).sum()), 0, fault_input.numel())
    assert f"holds {a.nan} NaN and 0 Inf of {a.numel} elements" in a.message


def test_the_innermost_module_is_reported_not_its_ancestors():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh(), SqrtOfInput()))
    net = nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 2))
    with gt.detect(net, action="record") as det:
        net(torch.randn(16, 4)).sum().backward()
    assert [(a.module_name, a.where, a.slot) for a in det.anomalies] == [
        ("1.1.1", "forward", "output")]


@pytest.mark.parametrize("screen", ["model", "modules"])
@pytest.mark.parametrize(("value", "kind"),
                         [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "inf")])
def test_nan_or_inf_planted_by_a_forward_hook(value, kind, screen):
    torch.manual_seed(0)
    net = twenty_layers(None)

    def plant(module, args, out):
        out = out.clone()
        out[0, 3] = value
        return out

    net[6].register_forward_hook(plant)  # before detect: detect sees the planted output
    with gt.detect(net, action="record", screen=screen) as det:
        out = net(torch.randn(4, 16))
        out.sum().backward()
    if screen == "model" and kind == "inf":
        # The Tanh after it maps +-Inf to +-1 and its gradient there to 0: the output and
        # every gradient stay finite, and only a screen of each module sees the Inf.
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(p.grad).all() for p in net.parameters())
        assert det.anomalies == []
        return
    (a,) = det.anomalies
    assert (a.module_name, a.module_type, a.kind, a.where, a.slot) == (
        "6", "Linear", kind, "forward", "output")
    net[6]._forward_hooks.clear()


def test_a_non_finite_parameter_and_a_non_finite_input_are_named_as_such():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with gt.detect(net, action="record") as det:
        with torch.no_grad():
            net[2].weight[1, 0] = math.inf
        net(torch.randn(3, 4)).sum().backward()
        det.step()
        with torch.no_grad():
            net[2].weight[1, 0] = 0.5
        x = torch.randn(3, 4)
        x[1, 1] = math.nan
        net(x).sum().backward()
        det.step()
    assert [(a.module_name, a.kind, a.where, a.slot, a.step, a.nan, a.inf)
            for a in det.anomalies] == [("2", "inf", "forward", "weight", 0, 0, 1),
                                        ("0", "nan", "forward", "input", 1, 1, 0)]
    assert "optimizer step" in det.anomalies[0].message
    assert "check the data" in det.anomalies[1].message


def test_fp16_overflow_is_found_at_the_overflowing_layer():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 8), nn.Linear(8, 4)).half()
    with torch.no_grad():
        net[2].weight.fill_(20000.0)
        net[2].bias.zero_()
    x = torch.randn(4, 8).half()
    # Oracle: in float32 the same layer goes beyond float16's largest value; before it, all fits.
    h = torch.sigmoid(net[0](x))
    assert torch.isfinite(h).all()
    assert (F.linear(h.float(), net[2].weight.float()).abs().max() > torch.finfo(torch.float16).max)
    with gt.detect(net, action="record") as det:
        det.check_loss(net(x).float().sum()).backward()
    (a,) = det.anomalies
    assert (a.module_name, a.kind, a.where, a.slot, a.record) == (
        "2", "inf", "forward", "output", None)  # found by check_loss: before the backward
    assert "float16 overflow" in a.message and "largest finite number 65504" in a.message
    assert "overflow  " in a.message  # the output's "of dtype max" column
    # Exact counts: the next Linear saved this output for its backward, and check_loss looked
    # before the backward released it.
    expected = F.linear(h.float(), net[2].weight.float()).abs() > torch.finfo(torch.float16).max
    assert (a.nan, a.inf) == (0, int(expected.sum()))


def test_nan_made_by_unselected_code_in_the_models_own_forward_is_blamed_on_the_model():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc2(torch.log(self.fc1(x)))

    torch.manual_seed(0)
    net = Net()
    with gt.detect(net, action="record") as det:
        net(torch.randn(8, 4)).sum().backward()
    (a,) = det.anomalies
    assert (a.module_name, a.module_type, a.where, a.slot) == ("", "Net", "forward", "output")
    assert "the model itself" in a.message and "outside the selected modules" in a.message


# -- backward origin --------------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
def test_backward_only_inf_from_sqrt_at_zero(mode, masked):
    torch.manual_seed(0)
    if masked:  # a ReLU before the sqrt: its backward zeroes the Inf (a harmless step)
        net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), SqrtOfInput(), nn.Linear(16, 4))
        x = torch.randn(8, 16)
    else:
        net = sqrt_at_zero_net()
        x = torch.randn(8, 16)
        x[:3] = 0.0
    # Oracle: a finite forward, and the gradient the sqrt sends to its input, by autograd.grad.
    h = net[1](net[0](x)).detach().requires_grad_()
    out = net[3](net[2](h))
    assert torch.isfinite(out).all()
    (g,) = torch.autograd.grad(out.sum(), h)
    assert torch.isinf(g).any()
    with gt.detect(net, action="record") as det:
        net(x).sum().backward()
    grads_finite = all(torch.isfinite(p.grad).all() for p in net.parameters())
    assert grads_finite == masked
    if masked and mode == "model":
        assert det.anomalies == []  # the model's screen sees only what reaches a gradient
        return
    (a,) = det.anomalies
    assert (a.module_name, a.module_type, a.kind, a.where, a.slot) == (
        "2", "SqrtOfInput", "inf", "grad_input", "x")
    assert (a.nan, a.inf) == (int(torch.isnan(g).sum()), int(torch.isinf(g).sum()))
    assert torch.equal(a.record.grad_inputs["x"], g)
    assert "reaches 0" in a.message and "sqrt(x + eps)" in a.message


def test_custom_function_backward_faults_at_known_modules_and_slots(mode):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), BadInputGrad(), nn.Linear(4, 2))
    with gt.detect(net, action="record") as det:
        net(torch.randn(3, 4)).sum().backward()
    assert [(a.module_name, a.kind, a.where, a.slot) for a in det.anomalies] == [
        ("2", "inf", "grad_input", "x")]

    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), ScaledLinear(4, 4), nn.Linear(4, 2))
    net[2].factor = math.nan
    with gt.detect(net, action="record") as det:
        net(torch.randn(3, 4)).sum().backward()
    assert [(a.module_name, a.kind, a.where, a.slot) for a in det.anomalies] == [
        ("2", "nan", "param_grad", "weight")]


def test_backward_origin_is_the_innermost_module(mode):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), BadInputGrad())
    net = nn.Sequential(nn.Linear(4, 4), block, nn.Linear(4, 2))
    with gt.detect(net, action="record") as det:
        net(torch.randn(3, 4)).sum().backward()
    assert [(a.module_name, a.where) for a in det.anomalies] == [("1.1", "grad_input")]


# -- the loss ---------------------------------------------------------------------------------


def test_nan_loss_with_check_loss_is_reported_as_the_loss():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    assert (net(x) < 0).any()  # so log(output) is NaN somewhere: a NaN loss, finite gradients
    with gt.detect(net) as det:
        a = catch(lambda: det.check_loss(torch.log(net(x)).mean()).backward())
    assert (a.module_name, a.module_type, a.kind, a.where, a.slot, a.call) == (
        "<loss>", "loss", "nan", "forward", "loss", None)
    assert (a.nan, a.inf, a.numel) == (1, 0, 1) and len(det.anomalies) == 1
    assert "loss function" in a.message


def test_non_finite_loss_gradient_is_reported_as_the_loss_without_check_loss(mode):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with gt.detect(net, action="record") as det:
        out = net(torch.randn(16, 4))
        (out - out.detach()).sqrt().sum().backward()  # loss 0, dL/d(output) = +Inf
    (a,) = det.anomalies
    assert (a.module_name, a.kind, a.where, a.slot, a.inf) == (
        "<loss>", "inf", "grad_output", "output", 16)


# -- spikes -----------------------------------------------------------------------------------


def _spike_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), ScaledLinear(16, 16), nn.Tanh(),
                         GradScaler(), nn.Linear(16, 3))


def _oracle_spikes(norms: list[dict[tuple[str, str], float]], threshold: float,
                   warmup: int) -> list[tuple[int, str, str]]:
    """The (step, key) pairs the shared detector flags in the test's own float64 norms (the
    detector itself is checked against a plain loop in tests/test_spikes.py)."""
    keys = list(dict.fromkeys(k for values in norms for k in values))
    table = np.array([[values.get(k, np.nan) for k in keys] for values in norms])
    flagged = np.argwhere(scores(table, warmup) > threshold)
    return [(int(t), *keys[i]) for t, i in flagged]


def test_spike_in_one_layer_at_step_30_is_reported_for_that_layer_only(mode):
    net = _spike_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    norms = []
    skips = []
    per_call = mode in ("eager", "deferred")
    with gt.detect(net, spike=6.0, warmup=10, action="record") as det:
        for step in range(40):
            net[2].factor = 1000.0 if step == 30 else 1.0
            x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
            # Run the layers by hand to keep each output's gradient for the oracle.
            outs, h = [], x
            for layer in net:
                h = layer(h)
                h.retain_grad()
                outs.append(h)
            F.cross_entropy(h, y).backward()
            values = {}
            for i, layer in enumerate(net):
                own = {n: p.grad.double() for n, p in layer.named_parameters(recurse=False)}
                if per_call:  # a module's norms: grad_output, direct parameters together
                    values[(str(i), "grad_output")] = float(outs[i].grad.double().norm())
                    if own:
                        values[(str(i), "param_grad")] = float(torch.cat(
                            [v.reshape(-1) for v in own.values()]).norm())
                else:  # each direct parameter's own norm
                    values.update({(str(i), n): float(v.norm()) for n, v in own.items()})
            norms.append(values)
            skips.append(det.should_skip())
            if not skips[-1]:
                opt.step()
            opt.zero_grad()
            det.step()
    flagged = _oracle_spikes(norms, 6.0, 10)
    assert flagged == [(30, "2", "param_grad" if per_call else "weight")]
    assert [(a.step, a.module_name, a.kind, a.where, a.slot) for a in det.anomalies] == [
        (30, "2", "spike", "param_grad", "weight,bias" if per_call else "weight")]
    a = det.anomalies[0]
    assert a.value == pytest.approx(norms[30][flagged[0][1:]], rel=1e-5)
    assert a.threshold == 6.0
    assert skips == [step == 30 for step in range(40)]
    base = det.spike_baseline("2")
    assert base and all(v > 0 for v in base.values())
    if not per_call:
        # The default watch has no hook on the calls: parameter-gradient norms only.
        with pytest.raises(KeyError, match="parameter-gradient norms only"):
            det.spike_baseline("2", "grad_output")


def test_a_grad_output_spike_is_reported_once_where_it_enters(mode):
    net = _spike_net()
    g = torch.Generator().manual_seed(1)
    held: list[Tensor] = []
    handle = net[2].register_forward_hook(
        lambda m, i, o: (o.retain_grad(), held.append(o)) and None)
    with gt.detect(net, spike=10.0, warmup=5, action="record") as det:
        for step in range(12):
            net[4].factor = 500.0 if step == 8 else 1.0
            x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
            F.cross_entropy(net(x), y).backward()
            if step == 8:
                oracle = float(held[0].grad.double().norm())  # dL/d(output of '2')
            held.clear()
            net.zero_grad()
            det.step()
    handle.remove()
    if mode in ("eager", "deferred"):
        # The per-call watch keeps grad_output EWMAs: every module before the scaler sees the
        # spike; only the first in backward order is named.
        assert [(a.step, a.module_name, a.where) for a in det.anomalies] == [
            (8, "3", "grad_output")]
        return
    # The default watch compares parameter gradients only: '2' and '0' spike; the replay
    # names the first in backward order and shows the grad_output that reached it.
    assert [(a.step, a.module_name, a.where) for a in det.anomalies] == [(8, "2", "param_grad")]
    a = det.anomalies[0]
    assert a.record is not None and a.record.module_name == "2" and a.call == 0
    assert float(a.record.grad_outputs["output"].double().norm()) == pytest.approx(oracle,
                                                                                     rel=1e-5)
    assert f"has norm {oracle:.4g} in this step" in a.message


def test_no_anomaly_in_300_healthy_training_steps_with_spike_on(mode):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64),
                        nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 20, generator=g) * 2
    with gt.detect(net, spike=True) as det:
        for _ in range(300):
            y = torch.randint(0, 4, (32,), generator=g)
            x = centers[y] + torch.randn(32, 20, generator=g)
            det.check_loss(F.cross_entropy(net(x), y)).backward()
            assert not det.should_skip()
            opt.step()
            opt.zero_grad()
            det.step()
    assert det.anomalies == [] and det.steps_done == 300
    assert det.spike_baseline("2", "param_grad")
    if mode in ("eager", "deferred"):  # the per-call watch keeps grad_output histories too
        assert det.spike_baseline("3", "grad_output")


@pytest.mark.parametrize("fault", ["spike", "nan"])
def test_spikes_and_nans_in_a_large_parameter_gradient_under_the_default_watch(fault):
    # ScaledLinear(512, 512)'s weight is large enough to be reduced as soon as it is
    # accumulated (a norm, with spike=); '1' is summed with the small ones at the check.
    torch.manual_seed(0)
    net = nn.Sequential(ScaledLinear(8, 512), ScaledLinear(512, 512), nn.Tanh(), nn.Linear(512, 2))
    assert net[1].weight.numel() >= _host.BIG
    g = torch.Generator().manual_seed(0)
    norms = []
    with gt.detect(net, spike=10.0, warmup=5, action="record") as det:
        for step in range(10):
            net[1].factor = (float("nan") if fault == "nan" else 100.0) if step == 8 else 1.0
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
            F.cross_entropy(net(x), y).backward()
            norms.append({(str(i), n): float(p.grad.double().norm())
                          for i in (0, 1, 3) for n, p in net[i].named_parameters()})
            assert det.should_skip() == (step == 8)
            net.zero_grad()
            det.step()
    got = [(a.step, a.module_name, a.kind, a.where) for a in det.anomalies]
    if fault == "nan":
        assert got == [(8, "1", "nan", "param_grad")]
        norms[8] = {}  # a non-finite step enters no history
    else:
        assert _oracle_spikes(norms, 6.0, 5) == [(8, "1", "weight")]
        assert got == [(8, "1", "spike", "param_grad")]
        assert det.anomalies[0].value == pytest.approx(norms[8][("1", "weight")], rel=1e-5)


def test_healthy_steps_with_spike_install_no_per_module_hook_and_no_tap(monkeypatch):
    from gradtap.capture.taps import Tap

    taps: list[int] = []
    real_init = Tap.__init__

    def counted(self, *args, **kwargs):
        taps.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Tap, "__init__", counted)
    net = _spike_net()
    hooked: list[str] = []

    def inspect_hooks() -> None:  # while the step runs: what the detector put on submodules
        for name, module in net.named_modules():
            if name and any(getattr(module, attr) for attr in _MODULE_HOOK_DICTS):
                hooked.append(name)
        for name, p in net.named_parameters():
            if p._backward_hooks or p._post_accumulate_grad_hooks:
                hooked.append(name)

    g = torch.Generator().manual_seed(2)
    with gt.detect(net, spike=10.0, warmup=10, action="record") as det:
        for step in range(16):
            net[2].factor = 1000.0 if step == 15 else 1.0
            x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
            loss = det.check_loss(F.cross_entropy(net(x), y))
            inspect_hooks()
            loss.backward()
            if step < 15:
                assert taps == [] and hooked == [], (step, taps, hooked)
            net.zero_grad()
            det.step()
    # The spike at step 15 is named through a replay, which does capture the calls.
    assert taps and [(a.step, a.module_name, a.where) for a in det.anomalies] == [
        (15, "2", "param_grad")]


# -- actions, steps, skipping -----------------------------------------------------------------


def test_actions_warn_and_record_and_step_numbers():
    torch.manual_seed(0)
    net = twenty_layers(None)
    step_to_poison = 2

    def plant(module, args, out):
        return out * math.nan if det.steps_done == step_to_poison else out

    net[4].register_forward_hook(plant)
    with gt.detect(net, action="warn") as det:
        for step in range(4):
            loss = net(torch.randn(2, 16)).sum()
            if step == step_to_poison:
                with pytest.warns(AnomalyWarning, match=r"NaN in the forward of '4' \(Linear"):
                    loss.backward()
            else:
                loss.backward()
            assert det.should_skip() == (step == step_to_poison)
            det.step()
    assert [(a.step, a.module_name) for a in det.anomalies] == [(2, "4")]
    net[4]._forward_hooks.clear()


def test_forward_without_backward_is_checked_by_check_step_and_exit():
    torch.manual_seed(0)
    net = twenty_layers(10)
    x = torch.randn(2, 16)
    det = gt.detect(net, action="record")
    net(x)
    found = det.check()
    assert [(a.module_name, a.record) for a in found] == [("10", None)]
    assert det.check() == []
    net(x)
    det.step()
    assert [a.step for a in det.anomalies] == [0, 0]
    det.remove()
    with gt.detect(net) as det2:
        net(x)
        with pytest.raises(gt.GradientAnomaly, match="'10'"):
            det2.step()
    assert det2.steps_done == 1
    with pytest.raises(gt.GradientAnomaly, match="'10'"):
        with gt.detect(net):
            net(x)
    assert_no_hooks(net)


def test_gradient_accumulation_names_the_call_that_broke():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), SqrtOfInput(), nn.Linear(4, 1))
    with torch.no_grad():
        net[0].weight.fill_(0.1)
        net[0].bias.fill_(0.5)
    with gt.detect(net, action="record") as det:
        net(torch.rand(3, 4)).sum().backward()  # positive: finite (call 0)
        net(-torch.ones(3, 4) * 10).sum().backward()  # negative: call 1 breaks
        det.step()
    assert [(a.module_name, a.call, a.step) for a in det.anomalies] == [("2", 1, 0)]


# -- dumps ------------------------------------------------------------------------------------


class Evil:
    """Any class: pickled into a tampered dump."""


def test_dumps_hold_the_full_record_and_load_with_weights_only(tmp_path, mode):
    torch.manual_seed(0)
    net = sqrt_at_zero_net()
    with gt.detect(net, action="record", dump_dir=tmp_path / "dumps") as det:
        net(torch.randn(8, 16)).sum().backward()
        det.step()
        net(torch.zeros(2, 16)).sum().backward()  # sqrt at 0
    a = det.anomalies[0]
    files = sorted((tmp_path / "dumps").iterdir())
    assert [str(f) for f in files] == sorted(x.dump_path for x in det.anomalies)
    raw = torch.load(a.dump_path, weights_only=True)
    dump = gt.load_dump(a.dump_path)
    assert raw.keys() == dump.keys() and dump["report"] == a.message
    assert dump["anomaly"] == a.to_dict()
    rec = dump["record"]
    for part in ("grad_inputs", "grad_outputs", "param_grads", "inputs", "outputs"):
        mine = getattr(a.record, part)
        assert rec[part].keys() == mine.keys() and part
        for k, t in mine.items():
            assert (t is None and rec[part][k] is None) or torch.equal(rec[part][k], t)
    assert rec["inputs"]["x"].min() == 0  # the forward input that explains the Inf
    assert dump["module_state"] == {}  # SqrtOfInput has no state
    text = inspect_main(a.dump_path)
    assert text.startswith(a.message) and "record of '2' (SqrtOfInput, call 0)" in text
    assert format_dump(dump) == text
    assert "gradtap inspect" in a.message


def test_dump_of_a_forward_anomaly_has_forward_tensors_and_module_state(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        net[1].bias[0] = math.nan
    with gt.detect(net, action="record", dump_dir=tmp_path) as det:
        net(torch.randn(3, 4))
        det.step()  # forward only: no record, the kept forward tensors are dumped
    (a,) = det.anomalies
    dump = gt.load_dump(a.dump_path)
    assert (a.module_name, a.slot) == ("1", "bias")
    assert dump["record"]["grad_inputs"] == {} and dump["record"]["inputs"]["input"].shape == (3, 4)
    assert torch.isnan(dump["record"]["outputs"]["output"]).any()
    assert set(dump["module_state"]) == {"weight", "bias"}
    assert torch.isnan(dump["module_state"]["bias"][0])


def test_tampered_or_foreign_dumps_are_refused(tmp_path):
    tampered = tmp_path / "tampered.pt"
    torch.save({"format": "gradtap.detect.dump", "version": 1, "report": "x", "x": Evil()},
               tampered)
    with pytest.raises(DumpError, match=r"refusing to load .*tampered\.pt.*weights_only=True"):
        gt.load_dump(tampered)
    with pytest.raises(ValueError, match="Unsupported global"):
        gt.load_dump(tampered)  # DumpError is a ValueError, and names the offending global
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(2)}, foreign)
    with pytest.raises(DumpError, match="is not a gradtap detect dump"):
        gt.load_dump(foreign)
    future = tmp_path / "future.pt"
    torch.save({"format": "gradtap.detect.dump", "version": 99}, future)
    with pytest.raises(DumpError, match="version 99; this gradtap reads version 1"):
        gt.load_dump(future)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    with pytest.raises(DumpError, match="not a readable torch file"):
        gt.load_dump(garbage)
    with pytest.raises(FileNotFoundError):
        gt.load_dump(tmp_path / "missing.pt")


# -- contract details -------------------------------------------------------------------------


def test_anomaly_to_dict_is_plain_and_json_serialisable():
    torch.manual_seed(0)
    net = twenty_layers(10)
    with gt.detect(net, action="record") as det:
        net(torch.randn(4, 16)).sum().backward()
    d = det.anomalies[0].to_dict()
    assert json.loads(json.dumps(d)) == d
    assert {"module_name", "kind", "where", "step", "message", "slot", "module_type"} <= set(d)
    assert "record" not in d


def test_invalid_arguments_raise_clear_errors(tmp_path):
    net = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="detect\\(\\) needs an nn.Module; got str"):
        gt.detect("net")
    with pytest.raises(ValueError,
                       match="action must be one of 'raise', 'warn', 'record'; got 'log'"):
        gt.detect(net, action="log")
    for bad in (0.0, -1.0, math.inf, "10"):
        with pytest.raises(ValueError, match="spike must be None, True .* or a finite score"):
            gt.detect(net, spike=bad)
    for bad in (-1, 2, 1.5, True):
        with pytest.raises(ValueError, match="warmup must be None or an int >= 3"):
            gt.detect(net, warmup=bad)
    with pytest.raises(ValueError, match="nothing to detect: nonfinite=False and no spike="):
        gt.detect(net, nonfinite=False)
    gt.detect(net, spike=10.0, replay=True, screen="modules").remove()  # spikes need no hook
    with pytest.raises(ValueError, match="replay must be None, True or False; got 1"):
        gt.detect(net, replay=1)
    with pytest.raises(ValueError, match="screen must be None, 'model' or 'modules'; got 'all'"):
        gt.detect(net, screen="all")
    for kw in ({"replay": False}, {"replay": False, "spike": 10.0}):
        with pytest.raises(ValueError, match="screen= chooses what the replay watch screens"):
            gt.detect(net, screen="modules", **kw)
    with pytest.raises(gt.SelectionError, match="matches no module"):
        gt.detect(net, select="1*")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        gt.detect(net, dump_dir=tmp_path / "file")
    with gt.detect(net, spike=10.0) as det:
        with pytest.raises(TypeError, match="check_loss\\(\\) needs a Tensor; got float"):
            det.check_loss(1.0)
        with pytest.raises(KeyError, match="no spike baseline for module '0' kind 'param_grad'"):
            det.spike_baseline("0")
    assert_no_hooks(net)


def test_hooks_are_removed_and_the_model_is_unchanged():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    state = copy.deepcopy(net.state_dict())
    with gt.detect(net, spike=10.0) as det:
        net(torch.randn(5, 4)).sum().backward()
        det.step()
    assert_no_hooks(net)
    with pytest.raises(RuntimeError, match="boom"):
        with gt.detect(net):
            net(torch.randn(5, 4))
            raise RuntimeError("boom")
    assert_no_hooks(net)
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[k]) or k.startswith("1.")  # BatchNorm's running statistics
    pickle.dumps(net)
    det = gt.detect(net)
    det.remove()
    det.remove()
    assert_no_hooks(net)
    assert isinstance(det, Detector) and "Detector" in repr(det)


# -- cheapness --------------------------------------------------------------------------------


def _counted_tanh_net(monkeypatch, depth: int) -> tuple[nn.Module, Tensor, Tensor, list[int]]:
    """``depth`` x (Linear(8, 8) + Tanh), a batch, and a list that counts host copies."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    copies: list[int] = []
    real = _host.to_host
    monkeypatch.setattr(_host, "to_host", lambda parts: copies.append(len(parts)) or real(parts))
    return (nn.Sequential(*layers, nn.Linear(8, 2)), torch.randn(4, 8),
            torch.randint(0, 2, (4,)), copies)


@pytest.mark.parametrize("depth", [3, 30])
def test_a_healthy_step_costs_two_host_copies_and_no_sync_in_hooks(monkeypatch, depth, mode):
    net, x, y, copies = _counted_tanh_net(monkeypatch, depth)
    with gt.detect(net, spike=10.0) as det:
        det.check_loss(F.cross_entropy(net(x), y)).backward()
        det.step()
        # The default watch: one copy at the end of the backward (the screen's, with the
        # parameter-gradient norms). The per-call watch: one for the forward (at check_loss);
        # the deferred path adds one at the end of the backward, whatever the depth, the eager
        # path reads CPU norms directly.
        per_step = 2 if mode == "deferred" else 1
        assert len(copies) == per_step
        # Nothing may read a tensor value on the host while the step runs.
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(torch.Tensor, name, _forbidden(name))
        det.check_loss(F.cross_entropy(net(x), y)).backward()
        assert not det.should_skip()
        det.step()
        monkeypatch.undo()
    assert len(copies) == 2 * per_step


def test_cpu_records_are_not_kept_unless_they_may_be_reported():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), SqrtOfInput(), nn.Linear(4, 1))
    with torch.no_grad():
        net[0].weight.fill_(0.1)
        net[0].bias.fill_(0.5)
    kept = []
    with Detector(net, action="record", replay=False,
                  options=WatchOptions(eager_min_elements=0)) as det:
        watch = det._watch
        real = watch.check_backward
        watch.check_backward = lambda back: (kept.append(
            [p.name for p in back.plans if p.rec is not None]), real(back))[1]
        net(torch.rand(8, 4)).sum().backward()  # positive everywhere: healthy, nothing kept
        det.step()
        net(-10 * torch.ones(8, 4)).sum().backward()  # sqrt at 0: the Inf and what it reached
        det.step()
    assert kept[0] == []
    assert "2" in kept[1] and "3" not in kept[1]  # '3' ran before the Inf: finite, dropped
    assert [(a.module_name, a.where) for a in det.anomalies] == [("2", "grad_input")]


def _forbidden(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"Tensor.{name} called during a healthy step (a host sync)")

    return fail


@pytest.mark.parametrize("name", ["gradtap._detect._detector", "gradtap._detect._dump"])
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_benchmark_script_runs_quick():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import detect_overhead
    finally:
        sys.path.pop(0)
    table = detect_overhead.main(["--quick"])
    assert table.count("\n") == 3 and "gt.detect" in table and "detect_anomaly" in table


# -- the default watch: a light screen, then a replay ------------------------------------------


@pytest.mark.parametrize("screen", ["model", "modules"])
@pytest.mark.parametrize("depth", [3, 30])
def test_a_healthy_step_under_the_replay_watch_costs_one_host_copy_and_no_sync_in_hooks(
        monkeypatch, depth, screen):
    net, x, y, copies = _counted_tanh_net(monkeypatch, depth)
    with gt.detect(net, screen=screen) as det:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(torch.Tensor, name, _forbidden(name))
        for _ in range(2):
            det.check_loss(F.cross_entropy(net(x), y)).backward()  # one check, at the end
            net.zero_grad()
            det.step()
        monkeypatch.undo()
    assert copies and len(copies) == 2  # one per step, whatever the depth


def test_the_model_screen_sees_a_gradient_that_only_reaches_the_input():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), BadInputGrad(), nn.Linear(4, 2))
    net.requires_grad_(False)  # frozen: the input's gradient is all a backward makes
    x = torch.randn(3, 4, requires_grad=True)  # a leaf reused every step
    with gt.detect(net, action="record") as det:
        for _ in range(3):
            net(x).sum().backward()
            det.step()
            x.grad = None
    # Oracle: the input's gradient, by autograd.grad without detect.
    (g,) = torch.autograd.grad(net(x).sum(), x)
    assert not torch.isfinite(g).any()
    assert [(a.module_name, a.kind, a.where, a.slot, a.step) for a in det.anomalies] == [
        ("1", "inf", "grad_input", "x", s) for s in range(3)]
    assert not x._backward_hooks  # the screen's hook on the leaf went with its backward


class _Net(nn.Module):
    """BatchNorm (buffers), Dropout (RNG) and a sqrt at 0 after a ReLU: a backward-only Inf
    that the ReLU's backward hides from every parameter gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.drop = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5)
        self.relu, self.sqrt, self.fc2 = nn.ReLU(), SqrtOfInput(), nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.sqrt(self.relu(self.drop(self.bn(self.fc1(x))))))


def test_the_replay_reproduces_the_step_and_leaves_grads_buffers_rng_and_other_taps_alone():
    torch.manual_seed(0)
    net = _Net()
    ref = copy.deepcopy(net)
    x = torch.randn(8, 16)
    # Oracle: the same step without detect, keeping the gradient the sqrt sends to its input.
    torch.manual_seed(5)
    h = ref.relu(ref.drop(ref.bn(ref.fc1(x))))
    h.retain_grad()
    ref.fc2(ref.sqrt(h)).sum().backward()
    rng_after = torch.get_rng_state()
    assert torch.isinf(h.grad).any()
    assert all(torch.isfinite(p.grad).all() for p in ref.parameters())  # hidden from params
    torch.manual_seed(5)
    with gt.tap(net) as other, gt.detect(net, action="record", screen="modules") as det:
        net(x).sum().backward()
    (a,) = det.anomalies
    assert (a.module_name, a.kind, a.where, a.slot, a.call) == (
        "sqrt", "inf", "grad_input", "x", 0)
    assert torch.equal(a.record.grad_inputs["x"], h.grad)  # same dropout mask in the replay
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name  # .grad untouched by the replay
    for b, c in zip(net.buffers(), ref.buffers()):
        assert torch.equal(b, c)  # running statistics updated once, not twice
    assert torch.equal(torch.get_rng_state(), rng_after)
    assert sorted(r.module_name for r in other.records) == sorted(n for n, _ in net.named_children())
    assert_no_hooks(net)


class _OnlyInBf16(nn.Module):
    """NaN only when its input is bfloat16 (as under CPU autocast)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sqrt(x - 10.0) if x.dtype == torch.bfloat16 else x


def test_the_replay_runs_under_the_autocast_state_of_the_call():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), _OnlyInBf16(), nn.Linear(4, 2))
    with gt.detect(net, action="record") as det:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(torch.randn(3, 4))
        out.float().sum().backward()
    (a,) = det.anomalies
    assert (a.module_name, a.where, a.slot) == ("1", "forward", "output")
    assert "bfloat16" in a.message


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.block, self.fc2 = (nn.Linear(8, 8),
                                          nn.Sequential(nn.ReLU(), SqrtOfInput()), nn.Linear(8, 2))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, self.fc1(x), use_reentrant=False)
        return self.fc2(h)


def test_activation_checkpointing_replays_without_counting_recomputations():
    torch.manual_seed(0)
    net = _Checkpointed()
    with gt.detect(net, action="record", screen="modules") as det:  # ReLU: a masked Inf
        net(torch.randn(16, 8)).sum().backward()
    assert [(a.module_name, a.where, a.slot, a.call) for a in det.anomalies] == [
        ("block.1", "grad_input", "x", 0)]


class _CheckpointedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = ScaledLinear(4, 4), nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.fc(x))


class _CheckpointedBlocks(nn.Module):
    """Three blocks, each run under non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_CheckpointedBlock() for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x.sum()


def _plant_nan_in_column_0(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
    out = out.clone()
    out[:, 0] = math.nan
    return out


def test_non_reentrant_checkpointing_healthy_steps_report_nothing_and_keep_grads(mode):
    torch.manual_seed(0)
    net = _CheckpointedBlocks()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 4)
    ref(x).backward()  # oracle: the same step without detect
    with gt.detect(net) as det:
        for _ in range(2):
            net.zero_grad()
            net(x).backward()
            assert not det.should_skip()
            det.step()
    assert det.anomalies == []
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_nan_planted_inside_a_checkpointed_block_is_found_at_the_leaf_and_training_goes_on(
        mode):
    torch.manual_seed(0)
    net = _CheckpointedBlocks()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    planted = net.blocks[1].fc.register_forward_hook(_plant_nan_in_column_0)
    with gt.detect(net, action="record") as det:
        net(x).backward()
        assert det.should_skip()  # the planted step: skip the update
        opt.zero_grad()
        det.step()
        planted.remove()
        for _ in range(2):  # healthy steps after it: nothing new, updates applied
            net(x).backward()
            assert not det.should_skip()
            opt.step()
            opt.zero_grad()
            det.step()
    (a,) = det.anomalies
    assert (a.module_name, a.kind, a.where, a.slot, a.step) == (
        "blocks.1.fc", "nan", "forward", "output", 0)
    # Named by the per-call watch (a replay that ran to the end), with the call's record.
    assert "replay failed" not in a.message
    assert a.record is not None and a.record.module_name == "blocks.1.fc"
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_a_nan_parameter_gradient_inside_a_checkpointed_block_is_found_at_its_module(mode):
    torch.manual_seed(0)
    net = _CheckpointedBlocks()
    net.blocks[1].fc.factor = math.nan  # its backward makes the weight gradient NaN
    ref = copy.deepcopy(net)
    x = torch.randn(2, 4)
    ref(x).backward()  # oracle: the same step without detect
    bad = {n for n, p in ref.named_parameters() if not torch.isfinite(p.grad).all()}
    assert bad == {"blocks.1.fc.weight"}  # the weight alone: its input gradient is finite
    with gt.detect(net, action="record") as det:
        net(x).backward()
        det.step()
    (a,) = det.anomalies
    assert (a.module_name, a.kind, a.where, a.slot) == ("blocks.1.fc", "nan", "param_grad",
                                                        "weight")
    assert a.nan == int(torch.isnan(ref.blocks[1].fc.weight.grad).sum())


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("planted", [False, True])
def test_gpt2_with_gradient_checkpointing_reports_the_planted_module(mode, planted):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 50, (2, 8))
    if planted:
        model.transformer.h[1].mlp.c_fc.register_forward_hook(_plant_nan_in_column_0)
    with gt.detect(model, action="record") as det:
        model(ids, labels=ids).loss.backward()
        det.step()
    found = [(a.module_name, a.kind, a.where, a.slot) for a in det.anomalies]
    assert found == ([("transformer.h.1.mlp.c_fc", "nan", "forward", "output")] if planted
                     else [])
    assert all(a.record is not None for a in det.anomalies)  # not the screen's fallback


@pytest.mark.parametrize("screen", ["model", "modules"])
def test_a_gradient_entering_other_than_through_the_outputs_is_still_reported(screen):
    class Aux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x: Tensor) -> Tensor:
            self.hidden = self.fc1(x)
            return self.fc2(self.hidden)

    torch.manual_seed(0)
    net = Aux()
    with gt.detect(net, action="record", screen=screen) as det:
        out = net(torch.randn(3, 4))
        aux = (net.hidden - net.hidden.detach()).sqrt().sum()  # dL/d hidden = +Inf
        (out.sum() + aux).backward()
    (a,) = det.anomalies
    assert "did not reproduce it" in a.message and "replay=False" in a.message
    assert a.record is None
    if screen == "modules":  # the screen saw dL/d hidden itself
        assert (a.module_name, a.kind, a.where, a.slot) == (
            "fc1", "inf", "grad_output", "output")
        assert a.inf == 12
    else:  # the model's screen saw what it did to fc1's weight: Inf times inputs, summed
        g = net.fc1.weight.grad
        assert (a.module_name, a.kind, a.where, a.slot) == (
            "fc1", "nan" if torch.isnan(g).any() else "inf", "param_grad", "weight")
        assert (a.nan, a.inf) == (int(torch.isnan(g).sum()), int(torch.isinf(g).sum()))
        assert a.nan + a.inf == 16


def test_a_loss_on_an_intermediate_alone_is_checked_at_step():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with gt.detect(net, action="record") as det:
        net(torch.randn(3, 4))
        hidden = net[0](torch.randn(3, 4))  # a call of a submodule only: the model's screen
        (hidden - hidden.detach()).sqrt().sum().backward()  # sees no gradient of its own
        assert det.anomalies == []
        det.step()  # the parameter gradients are checked here
        (a,) = det.anomalies
        assert (a.module_name, a.where, a.slot, a.step) == ("0", "param_grad", "weight", 0)
        det.step()  # the same stale .grad is not reported again
        net(torch.randn(3, 4))
        det.step()
    assert len(det.anomalies) == 1


@pytest.mark.parametrize("screen", ["model", "modules"])
def test_a_forward_fault_gone_before_the_replay_is_reported_from_the_screen(screen):
    class Flaky(nn.Module):
        fault = False

        def forward(self, x: Tensor) -> Tensor:
            return x * math.nan if self.fault else x

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), Flaky(), nn.Linear(4, 2))
    with gt.detect(net, action="record", screen=screen) as det:
        net[1].fault = True
        loss = net(torch.randn(3, 4)).sum()
        net[1].fault = False  # state the replay cannot see
        det.check_loss(loss)
        assert det.should_skip()  # the check runs here (no backward came)
    (a,) = det.anomalies
    assert "did not reproduce it" in a.message
    if screen == "modules":
        assert (a.module_name, a.kind, a.where, a.slot, a.nan) == (
            "1", "nan", "forward", "output", 12)
    else:
        assert (a.module_name, a.kind, a.where, a.slot, a.nan) == (
            "", "nan", "forward", "output", 6)
        assert "screen='modules'" in a.message


def test_large_parameter_gradients_are_screened_by_their_sum_without_false_alarms():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1024, 256))
    assert net[0].weight.numel() >= _host.BIG  # reduced by its own sum, not the foreach norm
    x = torch.randn(2, 1024)
    with gt.detect(net, action="record") as det:
        # Finite gradients whose float32 sum overflows: re-checked element-wise, not reported.
        (net(x).sum() * 0 + (net[0].weight * 3e37).sum()).backward()
        assert torch.isfinite(net[0].weight.grad).all()
        assert not torch.isfinite(net[0].weight.grad.sum())
        net.zero_grad()
        det.step()
        assert det.anomalies == []
        scale = torch.ones(256, 1024)
        scale[3, 5] = math.nan  # one NaN element in the weight's gradient
        (net(x).sum() + (net[0].weight * scale).sum()).backward()
        det.step()
    (a,) = det.anomalies
    assert (a.module_name, a.kind, a.where, a.slot, a.step) == ("0", "nan", "param_grad",
                                                                 "weight", 1)
    assert (a.nan, a.inf) == (1, 0)


def test_a_large_gradient_changed_after_its_backward_is_reduced_again_at_the_check():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1024, 256), nn.Linear(256, 1))
    assert net[0].weight.numel() >= _host.BIG  # summed in backward, as soon as accumulated
    with gt.detect(net, action="record") as det:
        net(torch.randn(2, 1024))  # a call of the model: the step is checked at det.step()
        hidden = net[0](torch.randn(2, 1024))  # a loss on a submodule's output only: the
        hidden.sum().backward()  # screen sees no gradient of the model's own outputs
        assert torch.isfinite(net[0].weight.grad).all()
        with torch.no_grad():
            net[0].weight.grad[3, 5] = math.inf  # changed in place after that sum
        det.step()
    (a,) = det.anomalies
    assert (a.module_name, a.kind, a.where, a.slot, a.inf) == ("0", "inf", "param_grad",
                                                                "weight", 1)


# -- the fused finiteness flags of small parameter gradients ------------------------------------


def _bits(t: Tensor) -> Tensor:
    """The raw bits of a float tensor (NaN payloads included), for bit-for-bit comparison."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=8),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       plant=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 299),
                                st.sampled_from([math.nan, math.inf, -math.inf])), max_size=3),
       seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_nonfinite_flags_match_an_elementwise_check_and_leave_every_bit_and_version(
        sizes, dtype, plant, seed):
    g = torch.Generator().manual_seed(seed)
    group = [(torch.randn(n, generator=g) * 100).to(dtype) for n in sizes]
    for which, where, value in plant:
        if which < len(group):
            group[which][where % group[which].numel()] = value
    expected = any(not bool(torch.isfinite(t).all()) for t in group)  # the oracle
    bits = [_bits(t).clone() for t in group]
    versions = [t._version for t in group]
    (flag,) = _host.nonfinite_flags([group])
    assert flag.dtype == torch.float32 and flag.dim() == 0
    assert flag.item() == float(expected)
    assert all(torch.equal(_bits(t), b) for t, b in zip(group, bits, strict=True))
    assert [t._version for t in group] == versions


def test_nonfinite_flags_fall_back_to_norms_where_the_fused_kernel_refuses(monkeypatch):
    def refuse(*args: object) -> None:
        raise NotImplementedError("no such kernel in this build")

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", refuse)
    group = [torch.randn(4, 4), torch.randn(7)]
    assert _host.nonfinite_flags([group])[0].item() == 0.0
    group[1][3] = -math.inf
    assert _host.nonfinite_flags([group])[0].item() == 1.0
    assert _host.nonfinite_flags([[], group[:1]]) == [torch.tensor(0.0)]  # empty lists skipped


def test_the_screen_leaves_parameter_gradients_bit_for_bit_and_names_the_one_nan():
    def run(detect: bool, plant: bool) -> tuple[nn.Sequential, list[gt.Anomaly]]:
        torch.manual_seed(0)
        net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())])
        x = torch.randn(8, 16)
        if plant:  # a NaN reaching only the fourth Linear's bias gradient
            net[6].bias.register_hook(lambda grad: grad.index_fill(0, torch.tensor([2]), math.nan))
        if not detect:
            net(x).square().sum().backward()
            return net, []
        with gt.detect(net, action="record") as det:
            net(x).square().sum().backward()
            det.step()
        return net, det.anomalies

    plain, _ = run(detect=False, plant=False)
    watched, anomalies = run(detect=True, plant=False)
    assert anomalies == []
    for p, q in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(_bits(p.grad), _bits(q.grad))
        assert p.grad._version == q.grad._version
    _, anomalies = run(detect=True, plant=True)
    (a,) = anomalies
    assert (a.module_name, a.kind, a.where, a.slot, a.nan) == ("6", "nan", "param_grad",
                                                                "bias", 1)


def test_nonfinite_flags_of_a_list_with_a_cast_member_keep_its_nan_bits():
    # A group formed before part of the model was cast: the fused kernel would round-trip the
    # float16 member through float32, so the list goes to the norms.
    half = torch.tensor([1.0, math.nan, 2.0], dtype=torch.float16)
    half.view(torch.int16)[1] = 0x7C01  # a signaling NaN: a float32 round trip quiets it
    group = [torch.randn(5), half]
    bits = _bits(half).clone()
    assert _host.nonfinite_flags([group])[0].item() == 1.0
    assert torch.equal(_bits(half), bits)


class _Scale(nn.Module):
    """``x * s`` with a 0-d parameter ``s``."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s


@pytest.mark.parametrize("spike", [None, 10.0])
def test_every_planted_step_is_found_and_the_steps_between_stay_quiet(spike, monkeypatch):
    # The healthy step's check reads one kept flag: it must be reset after each anomaly, so
    # that back-to-back anomalies are each found and the steps after them pass it again.
    verdicts: list[tuple[int, bool]] = []
    real = Screen._all_finite
    monkeypatch.setattr(Screen, "_all_finite", lambda self, *args: verdicts.append(
        (step_now[0], real(self, *args))) or verdicts[-1][1])
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())],
                        nn.Linear(8, 2))
    plan = {2: ("2", "param_grad"), 3: ("2", "param_grad"), 5: ("8", "forward"),
            7: ("<loss>", "forward"), 8: ("6", "param_grad")}
    step_now = [0]
    net[2].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), math.nan)
                              if plan.get(step_now[0], ("",))[0] == "2" else g)
    net[6].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.inf)
                                if step_now[0] == 8 else g)
    net[8].register_forward_hook(lambda m, i, o: o.index_fill(1, torch.tensor([1]), math.inf)
                                 if step_now[0] == 5 else o)
    g = torch.Generator().manual_seed(0)
    skips = []
    with gt.detect(net, spike=spike, action="record") as det:
        for step in range(10):
            step_now[0] = step
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
            loss = F.cross_entropy(net(x), y)
            if step == 7:
                loss = loss * math.nan
            det.check_loss(loss).backward()
            skips.append(det.should_skip())
            net.zero_grad()
            det.step()
    assert [(a.step, a.module_name, a.where) for a in det.anomalies] == [
        (s, name, where) for s, (name, where) in plan.items()]
    assert skips == [s in plan for s in range(10)]
    # One check a step (at the end of its backward): the fused pass fails exactly where the
    # oracle plants a fault.
    assert verdicts == [(s, s not in plan) for s in range(10)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norms_mode_reads_each_parameter_gradient_norm(dtype):
    # Three Linear(8, 8) (stacked by shape on CPU), a bias-free one, a 0-d parameter and a
    # last layer of its own shape: every norm against a float64 norm of .grad.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), _Scale(), nn.Linear(8, 8),
                        nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    with gt.detect(net, spike=10.0) as det:
        for _ in range(3):
            net(torch.randn(5, 8, dtype=dtype)).square().sum().backward()
            params, norms = det._screen.param_norms
            got = {name: float(v) for (name, _), v in zip(params, norms, strict=True)}
            expected = {name: float(p.grad.double().norm()) for name, p in net.named_parameters()}
            assert got == pytest.approx(expected, rel=1e-5)
            net.zero_grad()
            det.step()


def test_a_spike_dump_holds_the_forward_tensors_of_the_spiking_call(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    seen = {}

    def keep(module, args, out):  # the oracle: what the call got and returned
        seen["input"], seen["output"] = args[0].detach().clone(), out.detach().clone()

    net[2].register_forward_hook(keep)
    with gt.detect(net, spike=5.0, warmup=3, action="record", dump_dir=tmp_path) as det:
        for step in range(6):
            if step == 5:
                with torch.no_grad():
                    net[2].weight.mul_(1000.0)
            net(torch.randn(8, 4)).pow(2).mean().backward()
            det.step()
            net.zero_grad()
    (a,) = det.anomalies
    assert (a.kind, a.module_name, a.step) == ("spike", "2", 5)
    record = gt.load_dump(a.dump_path)["record"]
    torch.testing.assert_close(record["inputs"]["input"], seen["input"], rtol=0, atol=0)
    torch.testing.assert_close(record["outputs"]["output"], seen["output"], rtol=0, atol=0)
