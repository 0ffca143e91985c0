"""Mixed precision: with ``scaler=`` every consumer sees the unscaled gradient.

Oracle: the same model and batch under the same autocast, differentiated without a scaler
by ``torch.autograd.grad`` (the scale is a power of two, so the scaled backward is exactly
``scale`` times this one), reduced in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap._detect._detector import Detector

SCALE = 1024.0


def _model(seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # bfloat16 autocast on CPU; float16, the format GradScaler exists for, on CUDA.
    kind = x.device.type
    with torch.autocast(kind, dtype=torch.float16 if kind == "cuda" else torch.bfloat16):
        out = model(x)
    return out.float().pow(2).mean()


def _oracle(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(_loss(model, x), params)
    return {n: g.double() for n, g in zip(names, grads)}


def _stats(g: torch.Tensor) -> dict[str, float]:
    return {"norm": float(g.norm()), "mean": float(g.mean()), "std": float(g.std(unbiased=False)),
            "absmax": float(g.abs().max())}


def _value(mon: gt.Monitor, step: int, name: str, stat: str) -> float:
    steps, values = mon._history().series(name, stat)
    return float(values[list(steps).index(step)])


@pytest.mark.parametrize("where", ["before_unscale", "after_unscale", "after_step_update"])
def test_monitor_sees_unscaled_gradients(where, device):
    model = _model(device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE)
    mon = gt.Monitor(model, scaler=scaler)
    xs = [torch.randn(8, 6, generator=torch.Generator().manual_seed(i)).to(device)
          for i in range(3)]
    for s, x in enumerate(xs):
        expected = _oracle(model, x)
        scaler.scale(_loss(model, x)).backward()
        if where == "before_unscale":
            mon.step()
        scaler.unscale_(opt)
        if where == "after_unscale":
            mon.step()
        scaler.step(opt)
        scaler.update()
        if where == "after_step_update":
            mon.step()
        opt.zero_grad()
        for name, g in expected.items():
            for stat, want in _stats(g).items():
                assert _value(mon, s, name, stat) == pytest.approx(want, rel=1e-5, abs=1e-12), (
                    name, stat)
        assert _value(mon, s, "<scaler>", "amp_scale") == SCALE
        assert _value(mon, s, "<scaler>", "nonfinite") == 0
    mon.close()


def test_monitor_without_scaler_would_see_scaled_gradients():
    # The test above can fail: the raw .grad after a scaled backward is scale times the oracle.
    model = _model()
    x = torch.randn(8, 6)
    expected = _oracle(model, x)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with gt.Monitor(model) as mon:
        scaler.scale(_loss(model, x)).backward()
        mon.step()
    got = _value(mon, 0, "0.weight", "norm")
    assert got == pytest.approx(SCALE * float(expected["0.weight"].norm()), rel=1e-5)


def test_ewma_of_unscaled_gradients():
    beta = 0.8
    model = _model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    mon = gt.Monitor(model, scaler=scaler, ewma=beta)
    m = v = None
    for i in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 + i))
        g = _oracle(model, x)["2.weight"]
        if m is None:
            m, v = g.clone(), torch.zeros_like(g)
        else:
            d = g - m
            m = m + (1 - beta) * d
            v = beta * (v + (1 - beta) * d * d)
        scaler.scale(_loss(model, x)).backward()
        if i % 2:
            mon.step()
            scaler.step(opt)
        else:
            scaler.step(opt)
            mon.step()
        scaler.update()
        opt.zero_grad()
    torch.testing.assert_close(mon.ewma_mean("2.weight").double(), m, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(mon.ewma_var("2.weight").double(), v, rtol=1e-4, atol=1e-12)
    mon.close()


@pytest.mark.parametrize("where", ["before_step", "after_step"])
@pytest.mark.parametrize("overflow", [False, True])
def test_fused_optimizer(where, overflow, device):
    # A fused optimizer takes the scale itself: its step starts with scaled gradients and
    # writes the unscaled ones back, unless the scaler found an inf and it skipped the step.
    model = _model(2, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE)
    seen = {}
    opt.register_step_pre_hook(
        lambda o, a, k: seen.update(pre=float(model[2].weight.grad.double().norm())))
    mon = gt.Monitor(model, scaler=scaler)
    x = torch.randn(8, 6).to(device)
    expected = _oracle(model, x)
    scaler.scale(_loss(model, x)).backward()
    if overflow:
        model[0].weight.grad[1, 1] = math.inf
    if where == "before_step":
        mon.step()
    scaler.step(opt)
    after = float(model[2].weight.grad.double().norm())
    scaler.update()
    if where == "after_step":
        mon.step()
    true = float(expected["2.weight"].norm())
    assert seen["pre"] == pytest.approx(SCALE * true, rel=1e-5)
    assert after == pytest.approx(SCALE * true if overflow else true, rel=1e-5)
    for name, g in expected.items():
        if overflow and name == "0.weight":
            continue
        assert _value(mon, 0, name, "norm") == pytest.approx(float(g.norm()), rel=1e-5), name
    assert _value(mon, 0, "<scaler>", "nonfinite") == (1 if overflow else 0)
    mon.close()


def test_overflow_step_is_stored_with_its_scale(device):
    model = _model(3, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE)
    mon = gt.Monitor(model, scaler=scaler)
    for s in range(2):
        x = torch.randn(8, 6).to(device)
        scaler.scale(_loss(model, x)).backward()
        if s == 0:
            model[0].weight.grad[0, 0] = math.inf  # an fp16-style overflow
        before = model[0].weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        mon.step()
        opt.zero_grad()
        if s == 0:
            assert torch.equal(model[0].weight.detach(), before)  # the scaler skipped the step
    assert _value(mon, 0, "0.weight", "nonfinite") > 0
    assert _value(mon, 0, "<scaler>", "nonfinite") == 1
    assert _value(mon, 0, "<scaler>", "amp_scale") == SCALE
    # the skipped step backed the scale off; the next step is clean at the new scale
    assert scaler.get_scale() == SCALE / 2
    assert _value(mon, 1, "<scaler>", "amp_scale") == SCALE / 2
    assert _value(mon, 1, "<scaler>", "nonfinite") == 0
    assert _value(mon, 1, "0.weight", "nonfinite") == 0
    mon.close()


def test_overflow_counted_before_the_scaler_checks():
    model = _model(4)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with gt.Monitor(model, scaler=scaler) as mon:
        scaler.scale(_loss(model, torch.randn(8, 6))).backward()
        model[2].bias.grad[:2] = math.nan
        mon.step()
    assert _value(mon, 0, "<scaler>", "nonfinite") == 2
    assert _value(mon, 0, "2.bias", "nonfinite") == 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gradients_accumulate_in_float32(dtype):
    # sum of squares of 4096 values of 300 is 3.7e8: past float16's range, and far from
    # exact in bfloat16; the norm itself (19200) is representable in both.
    model = nn.Linear(64, 64, bias=False).to(dtype)
    g = torch.full((64, 64), 300.0)
    g[::2] = -300.0
    g[0, :8] = 1.0
    model.weight.grad = g.to(dtype)
    with gt.Monitor(model, stats=("norm", "mean", "std", "absmax")) as mon:
        mon.step()
    ref = model.weight.grad.double()
    for stat, want in _stats(ref).items():
        assert _value(mon, 0, "weight", stat) == pytest.approx(want, rel=1e-6, abs=1e-9), stat


def test_scaler_watch_is_removed_with_the_last_consumer():
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    a = gt.Monitor(model, scaler=scaler)
    b = gt.Monitor(model, scaler=scaler)
    assert "scale" in vars(scaler)
    a.close()
    assert "scale" in vars(scaler)
    b.close()
    assert not {"scale", "unscale_", "step", "update"} & set(vars(scaler))


def test_a_watched_scaler_still_pickles():
    import pickle

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with gt.Monitor(model, scaler=scaler):
        scaler.scale(_loss(model, torch.randn(8, 6))).backward()
        scaler.step(opt)
        scaler.update()
        copy = pickle.loads(pickle.dumps(scaler))
    assert copy.get_scale() == SCALE
    scaler_copy_loss = copy.scale(_loss(model, torch.randn(8, 6)))
    assert scaler_copy_loss.requires_grad


def test_scaler_must_be_a_grad_scaler():
    with pytest.raises(TypeError, match="Monitor: scaler= must be a torch.amp.GradScaler"):
        gt.Monitor(_model(), scaler=1024.0)
    with pytest.raises(TypeError, match="detect: scaler= must be a torch.amp.GradScaler"):
        gt.detect(_model(), scaler="amp")
    with pytest.raises(TypeError, match="transform: scaler= must be a torch.amp.GradScaler"):
        gt.transform(_model(), {"*": gt.clip_norm(1.0)}, scaler=object())


def test_disabled_scaler_changes_nothing():
    model = _model(10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=False)
    x = torch.randn(8, 6)
    expected = _oracle(model, x)
    with gt.Monitor(model, scaler=scaler) as mon:
        scaler.scale(_loss(model, x)).backward()
        scaler.step(opt)
        scaler.update()
        mon.step()
    assert _value(mon, 0, "0.weight", "norm") == pytest.approx(float(expected["0.weight"].norm()),
                                                                rel=1e-5)
    assert _value(mon, 0, "<scaler>", "amp_scale") == 1


def _clipped(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    return g * min(1.0, max_norm / float(g.norm()))


@pytest.mark.parametrize("when,fused", [("accumulate", False), ("backward", False),
                                        ("step", False), ("step", True), ("accumulate", True)])
def test_transform_clip_norm_sees_unscaled_norms(when, fused):
    max_norm = 0.02
    model = _model(5)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.05))
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    handle = gt.transform(model, {"*": gt.clip_norm(max_norm)}, when=when,
                          optimizer=opt if when == "step" else None, scaler=scaler)
    received = {}

    def seen(o, a, k):  # what the optimizer's step gets, unscaled by the oracle's own reading
        factor = SCALE if fused else 1.0
        received.update({n: p.grad.double() / factor for n, p in model.named_parameters()})

    hook = opt.register_step_pre_hook(seen)
    for _ in range(2):
        x = torch.randn(8, 6)
        expected = {n: _clipped(g, max_norm) for n, g in _oracle(model, x).items()}
        assert any(float(g.norm()) > max_norm for g in _oracle(model, x).values())
        scaler.scale(_loss(model, x)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        for n, g in expected.items():
            torch.testing.assert_close(received[n], g, rtol=1e-4, atol=1e-9)
    hook.remove()
    handle.remove()
    assert not set(vars(scaler)) & {"scale", "unscale_", "step", "update"}


def test_transform_clip_global_norm_with_scaler():
    max_norm = 0.05
    model = _model(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    x = torch.randn(8, 6)
    oracle = _oracle(model, x)
    total = math.sqrt(sum(float(g.norm()) ** 2 for g in oracle.values()))
    assert total > max_norm
    with gt.transform(model, {"*": gt.clip_global_norm(max_norm)}, scaler=scaler):
        scaler.scale(_loss(model, x)).backward()
        scaler.unscale_(opt)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), oracle[n] * (max_norm / total),
                                   rtol=1e-5, atol=1e-10)


def test_transform_activation_gradients_with_scaler():
    # on="grad_output": gt.clip_norm on the output of layer 2 sees dL/dy, not scale * dL/dy.
    max_norm = 1e-3
    model = _model(7)
    x = torch.randn(8, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model[1](model[0](x))
        y = model[2](hidden)
    loss = y.float().pow(2).mean()
    g_y, = torch.autograd.grad(loss, y, retain_graph=True)
    want, = torch.autograd.grad(y, hidden, _clipped(g_y.float(), max_norm).to(y.dtype))
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with gt.transform(model, {"2": gt.clip_norm(max_norm)}, on="grad_output", scaler=scaler):
        with gt.tap(model, "1") as t:
            scaler.scale(_loss(model, x)).backward()
        got = t.records[0].grad_outputs["output"] / SCALE
    # bfloat16 rounding of the clipped gradient: compare to 1% of its size (without the
    # scaler the clip would act on scale * dL/dy and give 1/scale of this)
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err < 1e-2


class _Half(nn.Module):
    """A float16 island in a float32 model: its gradient overflows at a large scale."""

    def forward(self, x):
        return x.half().float()


def _overflow_model() -> nn.Module:
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), _Half(), nn.Linear(16, 1))
    with torch.no_grad():
        model[3].weight.fill_(0.2)  # dL/dh = 8 * 0.2 = 1.6 (the loss below is 8 * sum)
    return model


@pytest.mark.parametrize("replay", [None, False])
def test_detect_records_an_overflow_and_never_raises(replay):
    # At scale 2**16 the float16 gradient 1.6 * 65536 overflows (max 65504); the scaler skips
    # the step and halves the scale, and at 2**15 the next step is finite.
    model = _overflow_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    det = gt.detect(model, scaler=scaler, replay=replay, action="raise",
                    spike=None if replay is None else 1e6)
    mon = gt.Monitor(model, scaler=scaler)
    steps_taken = []
    opt.register_step_post_hook(lambda o, a, k: steps_taken.append(det.steps_done))
    for _ in range(2):
        x = torch.randn(4, 6)
        loss = 8 * model(x).sum()
        scaler.scale(loss).backward()  # never raises
        assert not det.should_skip()
        scaler.step(opt)
        scaler.update()
        det.step()
        mon.step()
        opt.zero_grad()
    assert steps_taken == [1]  # step 0 skipped by the scaler
    assert [a.kind for a in det.anomalies] == ["overflow"]
    a = det.anomalies[0]
    assert a.step == 0 and a.where != "forward" and a.inf
    assert a.module_name == "2"  # the float16 island, named as an Inf origin would be
    assert "overflow" in a.message and "scale 65536" in a.message
    assert _value(mon, 0, "<scaler>", "nonfinite") == 1
    assert _value(mon, 0, "<scaler>", "amp_scale") == 2.0 ** 16
    assert _value(mon, 1, "<scaler>", "amp_scale") == 2.0 ** 15
    det.remove()
    mon.close()


def test_detect_without_scaler_raises_on_the_same_step():
    # The test above can fail: without scaler= the same overflow is an Inf that raises.
    model = _overflow_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with gt.detect(model, action="raise") as det, pytest.raises(gt.GradientAnomaly):
        scaler.scale(8 * model(torch.randn(4, 6)).sum()).backward()
    assert det.anomalies[0].kind == "inf"


def test_detect_forward_nan_still_raises_under_a_scaler():
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with torch.no_grad():
        model[0].bias[0] = math.nan
    with gt.detect(model, scaler=scaler) as det, pytest.raises(gt.GradientAnomaly):
        scaler.scale(_loss(model, torch.randn(8, 6))).backward()
    assert det.anomalies[0].kind == "nan" and det.anomalies[0].where == "forward"


def _jumping_scale_steps(model: nn.Module, det: Detector, scaler: torch.amp.GradScaler,
                         x: torch.Tensor) -> None:
    """Ten SGD steps through ``scaler``, its scale multiplied by 1024 before the last one,
    ``det.step()`` each."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for step in range(10):
        scaler.scale(_loss(model, x)).backward()
        scaler.step(opt)
        scaler.update(scaler.get_scale() * 1024.0 if step == 8 else None)
        det.step()
        opt.zero_grad()


def test_detect_spikes_on_unscaled_norms():
    # The scale jumps 1024x at the last step: on scaled norms that is a spike; on unscaled
    # ones the norms are those of a run without a scaler.
    model = _model(9)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10_000)
    det = gt.detect(model, spike=True, warmup=3, action="record", scaler=scaler)
    x = torch.randn(8, 6)
    _jumping_scale_steps(model, det, scaler, x)
    assert det.anomalies == []
    assert scaler.get_scale() == SCALE * 1024
    base = det.spike_baseline("2", "param_grad")
    g = _oracle(model, x)  # lr is small: the norm barely moves over the steps
    assert base["weight"] == pytest.approx(float(g["2.weight"].norm()), rel=0.05)
    assert base["bias"] == pytest.approx(float(g["2.bias"].norm()), rel=0.05)
    det.remove()


def test_detect_without_scaler_sees_the_jumping_scale_as_spikes():
    # The test above can fail: without scaler= the 1024x scale is a spike.
    model = _model(9)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10_000)
    det = gt.detect(model, spike=True, warmup=3, action="record")
    _jumping_scale_steps(model, det, scaler, torch.randn(8, 6))
    assert [(a.kind, a.step) for a in det.anomalies] == [("spike", 9)]
    det.remove()
