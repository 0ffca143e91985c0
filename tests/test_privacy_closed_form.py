"""``gt.dp_sgd``'s clipped sum comes from closed forms: every parameter of these models is
booked, and no ``[B, *shape]`` per-sample gradient of a weight is built for Linear (with
sequence dims, where the Gram form of the norms is the cheaper), Embedding and
MultiheadAttention; a convolution whose norms take the direct form (per-sample gradients,
where that costs fewer flops than the Gram form, as on this small one) and a tied table fall
back to per-sample gradients, built once. Every op's output shape is recorded (a ``TorchDispatchMode``) over the
backward and the step. The numbers themselves are checked against a float64 per-sample loop in
test_privacy_dpsgd.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradtap as gt
from gradtap.errors import GradtapError
from tests.test_privacy_dpsgd import MODELS, _batch, _bound, _oracle_sum, _per_sample_loop

B = 7  # no other tensor of these models has a weight's shape behind 7 rows


class _Shapes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.add(tuple(t.shape))
        return out


def _run(kind: str, clipping: str) -> tuple[nn.Module, set[str], set[tuple[int, ...]]]:
    torch.manual_seed(0)
    model = MODELS[kind][0]().double()
    x, y = _batch(kind, B, 1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    shapes = _Shapes()
    with gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=80,
                   noise_multiplier=0.0, clipping=clipping) as dp:  # type: ignore[arg-type]
        loss = F.cross_entropy(model(x), y)
        with shapes:
            loss.backward()
            booked = dp._ps.clipped.booked
            opt.step()
    return model, booked, shapes.seen


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("kind", ["mlp", "sequence_linear", "cnn_groupnorm",
                                  "embedding_layernorm_mha", "rmsnorm", "lora"])
def test_no_per_sample_weight_gradient_is_built(kind: str, clipping: str) -> None:
    model, booked, seen = _run(kind, clipping)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    convs = {f"{n}.{k}" for n, m in model.named_modules() if isinstance(m, nn.Conv2d)
             for k in ("weight", "bias")}
    assert booked == set(trainable) - convs
    per_sample = {n: (B, *p.shape) for n, p in trainable.items()
                  if p.dim() >= 2 and n not in convs}
    assert per_sample or kind == "cnn_groupnorm", kind
    built = {n for n, shape in per_sample.items() if shape in seen}
    assert not built, f"{kind}: per-sample gradients built for {sorted(built)}"


def test_a_convolution_with_the_gram_form_is_booked() -> None:
    """Few output positions and a wide kernel: the Gram form is the cheaper, the conv is
    booked and its per-sample weight gradient never built."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 5), nn.Flatten(), nn.Linear(8 * 2 * 2, 3)).double()
    x, y = torch.randn(B, 8, 6, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shapes = _Shapes()
    with gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=80,
                   noise_multiplier=0.0) as dp:
        loss = F.cross_entropy(model(x), y)
        with shapes:
            loss.backward()
            booked = dp._ps.clipped.booked
            opt.step()
    assert {"0.weight", "0.bias"} <= booked
    assert (B, *model[0].weight.shape) not in shapes.seen


def test_a_tied_table_falls_back_to_per_sample_gradients() -> None:
    model, booked, seen = _run("tied_embedding", "flat")
    assert "emb.weight" not in booked
    assert (B, *model.emb.weight.shape) in seen  # the check can see one where it is built


def test_two_backwards_before_a_step_add_up_per_sample() -> None:
    """Two backwards over one forward (one micro-batch). Flat: the second backward's
    per-sample parts join the first's (materialized, as the norm of a sum needs); the step
    equals the per-sample loop's. Per layer: refused."""
    torch.manual_seed(0)
    model = MODELS["sequence_linear"][0]().double()
    ref = copy.deepcopy(model)
    x, y = _batch("sequence_linear", 5, 1)
    grads = _per_sample_loop(ref, x, y)
    c = _bound(grads)
    expected = _oracle_sum(grads, list(ref.parameters()), c, "flat")
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with gt.dp_sgd(model, opt, max_grad_norm=c, sample_rate=0.5, dataset_size=4,
                   noise_multiplier=0.0):
        out = model(x)
        (0.3 * F.cross_entropy(out, y)).backward(retain_graph=True)
        (0.7 * F.cross_entropy(out, y)).backward()
        opt.step()
    for p, b, e in zip(model.parameters(), before, expected, strict=True):
        torch.testing.assert_close(b - p.detach(), e / 2, rtol=1e-10, atol=1e-13)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with gt.dp_sgd(model, opt, max_grad_norm=c, sample_rate=0.5, dataset_size=4,
                   noise_multiplier=0.0, clipping="per_layer"):
        out = model(x)
        F.cross_entropy(out, y).backward(retain_graph=True)
        with pytest.raises(GradtapError, match="second backward"):
            F.cross_entropy(out, y).backward()
            opt.step()
