"""The per-model session: one set of module hooks however many consumers listen, one meaning
of ``select=``, one root and clean names; every consumer's numbers equal its numbers alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap.capture.modhooks import hook_counts


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)


def _step(model: nn.Module) -> None:
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()


def _grads(record: gt.GradRecord) -> dict[str, list[float] | None]:
    """Every gradient of a record, as exact Python floats (comparable with ==)."""
    slots = {**{f"param:{k}": v for k, v in record.param_grads.items()},
             **{f"in:{k}": v for k, v in record.grad_inputs.items()},
             **{f"out:{k}": v for k, v in record.grad_outputs.items()}}
    return {k: None if v is None else v.flatten().tolist() for k, v in slots.items()}


def test_three_consumers_share_one_pre_hook_and_one_forward_hook_per_module():
    model = _model()
    mon = gt.Monitor(model, kinds=("param_grad", "grad_output"), stats=("norm",))
    tap = gt.tap(model)
    ps = gt.per_sample(model)
    try:
        for _, module in model.named_modules():
            if module is not model:
                assert hook_counts(module) == (1, 1), module
        _step(model)
        mon.step()
        together = (mon.frame(), [(r.module_name, _grads(r)) for r in tap.records],
                    {k: v.clone() for k, v in ps.grad.items()})
    finally:
        ps.remove()
        tap.remove()
        mon.close()
    for _, module in model.named_modules():
        assert hook_counts(module) == (0, 0)

    alone_model = _model()
    with gt.Monitor(alone_model, kinds=("param_grad", "grad_output"), stats=("norm",)) as m:
        _step(alone_model)
        m.step()
        frame = m.frame()
    assert frame.equals(together[0])

    alone_model = _model()
    with gt.tap(alone_model) as t:
        _step(alone_model)
    assert [(r.module_name, _grads(r)) for r in t.records] == [
        (name, grads) for name, grads in together[1]]

    alone_model = _model()
    with gt.per_sample(alone_model) as p:
        _step(alone_model)
        assert p.grad.keys() == together[2].keys()
        assert all(torch.equal(p.grad[k], together[2][k]) for k in together[2])


def test_a_module_selector_selects_its_parameters_everywhere_parameters_are_meant():
    model = _model()
    with gt.Monitor(model, select="0", stats=("norm",)) as mon:
        _step(model)
        mon.step()
        assert sorted(mon.frame().name.unique()) == ["0.bias", "0.weight"]
    with gt.transform(model, {"2": gt.scale(0.0)}) as h:
        assert list(h.plan()) == ["2.weight", "2.bias"]
        model.zero_grad()
        _step(model)
        assert torch.count_nonzero(model[2].weight.grad) == 0
        assert torch.count_nonzero(model[0].weight.grad) > 0
    x, y = _batch()

    def loss() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    by_module = gt.hessian_trace(loss, model, samples=4, select="2")
    by_tensors = gt.hessian_trace(loss, [model[2].weight, model[2].bias], samples=4)
    assert by_module == by_tensors


def test_one_session_per_model_behind_any_wrapper_released_with_its_last_consumer():
    from gradtap.capture import session
    from gradtap.capture.sessions import _SESSIONS

    model = _model()
    assert session(nn.DataParallel(model)) is session(model)
    assert session(torch.compile(model, backend="eager")) is session(model)
    tap = gt.tap(model)
    h = gt.transform(model, {"*": gt.scale(1.0)})
    assert session(model).consumers == 2
    tap.remove()
    tap.remove()  # twice: counted once
    assert session(model).consumers == 1
    h.remove()
    assert model not in _SESSIONS


def test_consumers_share_one_scaler_watch_and_one_unscaling_formula():
    from gradtap.capture import session, unscale

    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    sess = session(model).attach()
    try:
        assert sess.scaler(scaler, "Monitor") is sess.scaler(scaler, "transform")
        watch = sess.scaler(scaler, "Monitor")
        x, y = _batch()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        w = model[0].weight
        assert torch.equal(watch.unscaled(w.grad, w), unscale(w.grad, torch.tensor(64.0)))
        assert torch.equal(watch.unscaled(w.grad, w) * 64.0, w.grad)
        half = unscale(torch.tensor([60000.0], dtype=torch.float16), torch.tensor(0.5))
        assert half.dtype == torch.float32 and half.item() == 120000.0  # float16 would overflow
    finally:
        sess.detach()
    with pytest.raises(TypeError, match="Monitor needs an nn.Module; got str"):
        session("model", "Monitor")  # type: ignore[arg-type]
