"""``gt.dp_sgd``'s clipped sum comes from closed forms: every parameter of these models is
booked, and no ``[B, *shape]`` per-sample gradient of a weight is built for Linear (with
sequence dims, where the Gram form of the norms is the cheaper), Embedding and
MultiheadAttention; a convolution's norms may take the direct form (per-sample gradients a
chunk at a time) where it costs fewer flops, its sum is the batch kernel's; a tied table
falls back to per-sample gradients. Every op's output shape is recorded (a ``TorchDispatchMode``) over the
backward and the step. The numbers themselves are checked against a float64 per-sample loop in
test_privacy_dpsgd.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradtap as gt
from tests.test_privacy_dpsgd import MODELS, _batch

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
    assert booked == set(trainable)
    convs = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    per_sample = {n: (B, *p.shape) for n, p in trainable.items()
                  if p.dim() >= 2 and n not in convs}
    assert per_sample or kind == "cnn_groupnorm", kind
    built = {n for n, shape in per_sample.items() if shape in seen}
    assert not built, f"{kind}: per-sample gradients built for {sorted(built)}"


def test_a_tied_table_falls_back_to_per_sample_gradients() -> None:
    model, booked, seen = _run("tied_embedding", "flat")
    assert "emb.weight" not in booked
    assert (B, *model.emb.weight.shape) in seen  # the check can see one where it is built
