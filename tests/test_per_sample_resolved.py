"""``gt.per_sample`` made each step: the resolution of an unchanged model is reused, and a
changed model is resolved again.

Oracles (float64): per-sample gradients from a loop over samples (``torch.autograd.grad`` of
each sample's loss on that sample alone) and ``.grad`` from a plain backward. The cache is
observed through ``select_parameters`` (called only when a resolution is made).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

import gradtap as gt
from gradtap._samples import resolved
from gradtap.errors import UnsupportedModuleError
from tests._models import assert_no_hooks
from tests.test_per_sample_models import N, close, loop_oracle

pytestmark = pytest.mark.usefixtures("float64_seeded")


def _loss(m: nn.Module, b: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(m(b["x"]), b["y"])


def _batch(width: int = 6) -> dict[str, Tensor]:
    return {"x": torch.randn(N, width), "y": torch.randint(0, 3, (N,))}


@pytest.fixture
def resolutions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the resolutions made (one entry each)."""
    made: list[int] = []
    real = resolved.select_parameters

    def counted(model, select):  # type: ignore[no-untyped-def]
        made.append(1)
        return real(model, select)

    monkeypatch.setattr(resolved, "select_parameters", counted)
    return made


def _step(model: nn.Module, b: dict[str, Tensor], **kw: object) -> dict[str, Tensor]:
    with gt.per_sample(model, quantities=("grad",), **kw) as ps:  # type: ignore[arg-type]
        _loss(model, b).backward()
    model.zero_grad(set_to_none=True)
    return ps.grad


@pytest.mark.parametrize("own_grad", [False, True])
def test_a_handle_made_each_step_resolves_once_and_stays_exact(resolutions, own_grad):
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    for _ in range(3):
        b = _batch()
        ref = loop_oracle(model, _loss, b)
        grads = _step(model, b, own_grad=own_grad)
        assert grads.keys() == ref.keys()
        for k in ref:
            close(grads[k], ref[k], k)
    assert len(resolutions) == 1
    assert_no_hooks(model)


def test_each_handle_gets_its_own_owners():
    model = nn.Sequential(nn.Linear(6, 3))
    a, b = gt.per_sample(model), None
    a.remove()
    b = gt.per_sample(model)
    b.remove()
    assert a._spec.owners["0"] is not b._spec.owners["0"]
    assert a._spec.owners["0"].module is b._spec.owners["0"].module


def test_a_replaced_module_is_resolved_again(resolutions):
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    _step(model, _batch())
    model[2] = nn.Linear(8, 3)  # same name, same type: a new module and new parameters
    b = _batch()
    ref = loop_oracle(model, _loss, b)
    grads = _step(model, b)
    assert len(resolutions) == 2
    for k in ref:
        close(grads[k], ref[k], k)
    model[0] = nn.Sequential(nn.Linear(6, 8))  # a new structure: new names
    b = _batch()
    ref = loop_oracle(model, _loss, b)
    grads = _step(model, b)
    assert len(resolutions) == 3 and set(grads) == set(ref) and "0.0.weight" in grads


def test_requires_grad_shape_and_dtype_changes_are_seen(resolutions):
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    _step(model, _batch())
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in _step(model, _batch())
    model[0].weight.requires_grad_(True)
    assert "0.weight" in _step(model, _batch())
    assert len(resolutions) == 3
    with torch.no_grad():  # the same Parameter objects, new shapes
        model[2].weight.data = torch.randn(4, 8)
        model[2].bias.data = torch.randn(4)
    b = _batch()
    ref = loop_oracle(model, _loss, b)
    grads = _step(model, b)
    assert len(resolutions) == 4
    for k in ref:
        close(grads[k], ref[k], k)
    model.float()  # parameters keep their identity, their dtype changes
    b = {k: v.float() if v.is_floating_point() else v for k, v in _batch().items()}
    assert _step(model, b)["2.weight"].dtype == torch.float32
    assert len(resolutions) == 5


def test_a_parametrization_and_a_new_rule_are_seen(resolutions):
    class Double(nn.Module):
        def forward(self, w: Tensor) -> Tensor:
            return 2 * w

    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    _step(model, _batch())
    parametrize.register_parametrization(model[0], "weight", Double())
    b = _batch()
    ref = loop_oracle(model, _loss, b)
    grads = _step(model, b)
    assert len(resolutions) == 2 and "0.parametrizations.weight.original" in grads
    for k in ref:
        close(grads[k], ref[k], k)


def test_train_mode_batchnorm_is_refused_after_an_eval_step(resolutions):
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).eval()
    _step(model, _batch())
    model.train()
    with pytest.raises(UnsupportedModuleError, match="BatchNorm"):
        gt.per_sample(model)
    assert_no_hooks(model)
    model.eval()
    _step(model, _batch())
    assert len(resolutions) == 1


def test_a_predicate_selector_is_resolved_every_time(resolutions):
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    for _ in range(2):
        gt.per_sample(model, select=lambda name, _m: name == "2").remove()
    assert len(resolutions) == 2
    for _ in range(2):
        gt.per_sample(model, select="2").remove()
    assert len(resolutions) == 3


def test_the_kept_resolution_does_not_keep_the_model_alive():
    model = nn.Sequential(nn.Linear(6, 3))
    gt.per_sample(model).remove()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


class WideTied(nn.Module):
    """A wide Linear (its sum check is sketched) whose weight is also used outside its call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(40, 40)
        self.head = nn.Linear(40, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x))
        return self.head(h + h @ self.fc.weight.T)


def test_own_grad_share_and_autograds_increment_meet_in_the_sum_check():
    # fc's call is owned (its sums are kept unprojected), the use outside it comes from
    # autograd (projected): the check must compare them, find that they do not add up,
    # and the replay must give the right answer.
    model = WideTied()
    b = _batch(40)
    ref = loop_oracle(model, _loss, b)
    model.zero_grad(set_to_none=True)
    _loss(model, b).backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="replay"), gt.per_sample(model, own_grad=True) as ps:
        _loss(model, b).backward()
    for k, p in model.named_parameters():
        close(p.grad, expected[k], f".grad {k}")
        close(ps.grad[k], ref[k], f"grad {k}")
