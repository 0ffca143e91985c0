"""A model used through its own methods (``decode(encode(x))``, as every autoencoder is
trained) rather than its root's ``forward``: every consumer sees those calls, against the
same oracles as through ``forward`` (the zero-leaf oracle of records, ``torch.autograd.grad``
at module outputs, a per-sample loop, and for ``detect`` the module, slot and step where the
fault was planted)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import gradtap as gt
from tests._oracle import oracle_calls
from tests.test_capture import assert_tap_changes_nothing, check_against_oracle
from tests.test_detect import BadInputGrad, ScaledLinear, _Times, mode  # noqa: F401
from tests.test_monitor import frame_dict


class Scale(nn.Module):
    """A parameter used elementwise: no per-sample rule, so per_sample replays the call."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class Fault(nn.Module):
    """Tanh, with a NaN put into its output while ``on``."""

    on = False

    def forward(self, x: Tensor) -> Tensor:
        out = torch.tanh(x)
        if self.on:
            out = out.clone()
            out[0, 0] = math.nan
        return out


class AE(nn.Module):
    """An autoencoder; ``w`` is used by ``project`` directly, through no child module."""

    def __init__(self, fault: str = "") -> None:
        super().__init__()
        mid = BadInputGrad() if fault == "backward" else nn.Tanh()
        self.enc = nn.Sequential(nn.Linear(4, 3), Fault(), ScaledLinear(3, 2))
        self.dec = nn.Sequential(nn.Linear(2, 3), mid, Scale(3), nn.Linear(3, 4))
        self.w = nn.Parameter(torch.eye(4) * 0.5)

    def encode(self, x: Tensor) -> Tensor:
        return self.enc(x)

    def decode(self, z: Tensor) -> Tensor:
        return self.dec(z)

    def project(self, x: Tensor) -> Tensor:
        return x @ self.w

    def forward(self, x: Tensor) -> Tensor:
        return self.decode(self.encode(x))


def _loss(ae: AE, x: Tensor, through: str) -> Tensor:
    rec = ae(x) if through == "forward" else ae.decode(ae.encode(x))
    return ((rec - x) ** 2).sum(1).mean()


def _ae(fault: str = "", dtype=torch.float64) -> tuple[AE, Tensor]:
    torch.manual_seed(0)
    return AE(fault).to(dtype), torch.randn(6, 4, dtype=dtype)


# -- records --------------------------------------------------------------------------------


def test_records_of_a_model_used_through_methods_match_the_oracle():
    ae, x = _ae()
    t = check_against_oracle(ae, lambda: _loss(ae, x, "methods"))
    assert not t.find("") and t.find("enc") and t.find("dec.2")
    assert_tap_changes_nothing(ae, lambda: _loss(ae, x, "methods"))


# -- Monitor ----------------------------------------------------------------------------------


def test_monitor_grad_output_through_methods_matches_autograd():
    ae, x = _ae()
    names = ["enc", "enc.2", "dec", "dec.2"]
    with gt.Monitor(ae, select=names, kinds=["grad_output", "param_grad"]) as mon:
        for _ in range(2):
            _loss(ae, x, "methods").backward()
            mon.step()
    got = frame_dict(mon.frame())
    for name in names:
        (call,) = oracle_calls(ae, name, lambda: _loss(ae, x, "methods"))
        g = call["grad_outputs"]["output"]
        for step in range(2):
            value = got[(step, f"{name}:output", "grad_output", "norm")]
            assert math.isclose(value, float(g.norm()), rel_tol=1e-9), (name, step)
    assert math.isclose(got[(1, "enc.2.weight", "param_grad", "norm")],
                        float(ae.enc[2].weight.grad.norm()), rel_tol=1e-9)


# -- per_sample -------------------------------------------------------------------------------


def _per_sample_loop(ae: AE, x: Tensor) -> dict[str, Tensor]:
    """Per-sample gradients of the mean loss, one backward per sample (times N: the mean's
    1/N left out, as per_sample reports them)."""
    params = dict(ae.named_parameters())
    names = [n for n in params if not n.startswith("w")]
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(_loss(ae, x[i:i + 1], "methods"), [params[n] for n in names])
        rows.append(grads)
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(names)}


@pytest.mark.parametrize("own_grad", [False, True])
def test_per_sample_through_methods_matches_a_per_sample_loop(own_grad):
    ae, x = _ae()
    expected = _per_sample_loop(ae, x)
    ae.zero_grad()
    with gt.per_sample(ae, select=["enc", "dec"], quantities=("grad", "norm"),
                       own_grad=own_grad) as ps:
        _loss(ae, x, "methods").backward()
        got = ps.grad
        norm = ps.norm
    assert set(got) == set(expected)
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=1e-9, atol=1e-12, msg=n)
        torch.testing.assert_close(g.mean(0), ae.get_parameter(n).grad, rtol=1e-9, atol=1e-12)
    total = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in expected.values()))
    torch.testing.assert_close(norm, total, rtol=1e-9, atol=1e-12)


# -- detect -----------------------------------------------------------------------------------


FAULTS = {
    # fault: where it is planted, and (module, kind, where, slot) detect must name
    "forward": ("enc.1", "nan", "forward", "output"),
    "backward": ("dec.1", "inf", "grad_input", "x"),
    "param_grad": ("enc.2", "nan", "param_grad", "weight"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_detect_names_the_fault_of_a_model_used_through_methods(mode, fault):  # noqa: F811
    found = {}
    for through in ("forward", "methods"):
        ae, x = _ae("backward" if fault == "backward" else "", torch.float32)
        if fault == "backward":
            ae.dec[1].forward = lambda x: x * 2.0  # healthy until step 2
        with gt.detect(ae, action="record") as det:
            for step in range(4):
                if step == 2:
                    if fault == "forward":
                        ae.enc[1].on = True
                    elif fault == "backward":
                        del ae.dec[1].forward
                    else:
                        ae.enc[2].factor = math.nan
                _loss(ae, x, through).backward()
                det.step()
                ae.zero_grad()
                ae.enc[2].factor = 1.0
                ae.enc[1].on = False
                if fault == "backward":
                    ae.dec[1].forward = lambda x: x * 2.0
        found[through] = [(a.module_name, a.kind, a.where, a.slot, a.step)
                          for a in det.anomalies]
    assert found["methods"] == found["forward"], found
    assert found["methods"] == [(*FAULTS[fault], 2)]


def test_detect_checks_parameters_used_by_a_method_that_calls_no_child():
    ae, x = _ae(dtype=torch.float32)
    with gt.detect(ae, action="record") as det:
        for step in range(3):
            factor = math.nan if step == 1 else 1.0
            _Times.apply(ae.project(x), factor).sum().backward()
            det.step()
            ae.zero_grad()
    assert [(a.kind, a.where, a.slot, a.step) for a in det.anomalies] == [
        ("nan", "param_grad", "w", 1)]
