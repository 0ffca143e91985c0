"""``clip_factor`` on its own step for every ``when=``: the factor a Monitor stores at step s
is the one applied to step s's gradient, and the report marks the clip at step s.

The oracle is the gradient itself: step s's gradient without the transform (a twin model with
the same weights, no hooks) and the gradient the optimizer receives (an optimizer pre-hook
registered after the transform's); a spike rule's factor is the ratio of their norms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap.report.data import build_report_data

SPIKE = 6


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(when: str, monitor_first: bool, store=None) -> tuple[gt.Monitor, list[dict]]:
    model, twin = _net(), _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(4)
    oracle: list[dict[str, float]] = []
    h = gt.transform(model, {"*.weight": gt.zclip(warmup=2, per_tensor=True)}, when=when,
                     optimizer=opt if when == "step" else None)
    before: dict[str, torch.Tensor] = {}

    def received(o, args, kwargs):  # after the transform's own pre-hook
        oracle.append({n: float(p.grad.norm() / before[n].norm())
                       for n, p in model.named_parameters() if n.endswith("weight")})

    opt.register_step_pre_hook(received)
    mon = gt.Monitor(model, stats=("norm",), store=store)
    with h:
        for step in range(10):
            x = torch.randn(8, 4, generator=gen) * (30.0 if step == SPIKE else 1.0)
            twin.load_state_dict(model.state_dict())
            nn.functional.mse_loss(twin(x), torch.zeros(8, 2)).backward()
            before = {n: p.grad for n, p in twin.named_parameters()}
            twin.zero_grad()
            nn.functional.mse_loss(model(x), torch.zeros(8, 2)).backward()
            if monitor_first:
                mon.step()
            opt.step()
            if not monitor_first:
                mon.step()
            opt.zero_grad()
    mon.close()
    return mon, oracle


@pytest.mark.parametrize(("when", "monitor_first"), [
    ("accumulate", True), ("backward", True), ("step", True), ("step", False)])
def test_the_factor_stored_at_step_s_is_the_one_applied_to_step_s(when, monitor_first):
    mon, oracle = _train(when, monitor_first)
    got = mon.frame(stats="clip_factor")
    assert sorted(set(got.step)) == list(range(10))
    for step, factors in enumerate(oracle):
        at = got[got.step == step].set_index("name").value.to_dict()
        assert at == pytest.approx(factors, rel=1e-5), step
    assert min(oracle[SPIKE].values()) < 0.5  # the spike was clipped, at its own step
    assert min(oracle[SPIKE + 1].values()) > 0.5


def test_the_report_marks_the_clip_at_its_own_step_with_when_step(tmp_path):
    _, oracle = _train("step", True, store=tmp_path / "run")
    clipped = build_report_data(tmp_path / "run").clipped
    expected = {s: min(f.values()) for s, f in enumerate(oracle) if min(f.values()) < 1.0}
    assert SPIKE in expected
    assert clipped == pytest.approx(expected, rel=1e-5)


def test_a_held_step_is_visible_after_the_optimizer_step():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gt.transform(model, {"*.weight": gt.adagc(warmup=2)}, when="step", optimizer=opt), \
            gt.Monitor(model, stats=("norm",)) as mon:
        model(torch.randn(3, 4)).sum().backward()
        mon.step()
        assert mon.frame().empty  # its rule has not run yet: the step waits for it
        opt.step()
        assert sorted(set(mon.frame().stat)) == ["clip_factor", "norm"]
