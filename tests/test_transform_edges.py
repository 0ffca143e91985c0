"""Edges of the transform library: ``chain`` passes each member only the keyword extras it
accepts; ``clip_norm`` in one foreach pass equals the per-tensor version exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradtap as gt
from gradtap._transform.base import is_batched
from tests._spike_oracles import assert_same_params, run_gradtap, run_reference, spam_ref


def _halve_by_hand(step, named, opt):
    for _, p in named:
        p.grad = p.grad / 2
    return {}


def _halve_then(ref):
    def both(step, named, opt):
        _halve_by_hand(step, named, opt)
        return ref(step, named, opt)
    return both


#: A user transform written without ``**extra``, as the Transform docs' own example is.
HALVE = gt.Transform(init=lambda p: (), update=lambda g, s, p: (g / 2, s))


def test_chain_of_a_user_transform_without_extras_and_spam_clip_at_a_step():
    steps = 12
    net, _ = run_gradtap({"*": gt.chain(HALVE, gt.spam_clip(threshold=2.0))}, steps,
                         when="step", opt="adam")
    want, _ = run_reference(_halve_then(spam_ref(threshold=2.0)), steps, opt="adam")
    assert_same_params(net, want)


def test_chain_passes_extras_by_name_and_to_extras_parameters():
    seen: list[tuple[str, dict]] = []

    def named(g, s, p, *, optimizer=None):
        seen.append(("named", {"optimizer": optimizer}))
        return g, s

    def anything(g, s, p, /, **extra):
        seen.append(("anything", extra))
        return g, s

    t = gt.chain(HALVE, gt.Transform(lambda p: (), named), gt.Transform(lambda p: (), anything))
    g = torch.ones(2)
    out, _ = t.update(g, t.init(g), None, optimizer="opt", other=1)
    assert torch.equal(out, g / 2)
    assert seen == [("named", {"optimizer": "opt"}), ("anything", {"optimizer": "opt", "other": 1})]
    # update_many: a member without it runs per tensor with the extras it accepts
    many = gt.chain(HALVE, gt.clip_global_norm(1.0))
    outs, _ = many.update_many([g], [many.init(g)], [None], optimizer="opt")
    torch.testing.assert_close(outs[0], g / 2 / max(1.0, float((g / 2).norm())))


# -- clip_norm in one foreach pass --------------------------------------------------------------


def _clip_by_hand(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The per-tensor formula of the docs, one tensor at a time."""
    low = g.dtype in (torch.float16, torch.bfloat16)
    norm = torch.linalg.vector_norm(g, dtype=torch.float32 if low else None)
    return g * (max_norm / (norm + 1e-6)).clamp(max=1.0).to(g.dtype)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1,
                       max_size=6),
       dtypes=st.lists(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
                       min_size=6, max_size=6),
       scale=st.floats(1e-3, 1e3), max_norm=st.floats(0.01, 10.0), seed=st.integers(0, 99))
def test_clip_norm_update_many_equals_update_per_tensor_exactly(shapes, dtypes, scale,
                                                                max_norm, seed):
    g = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(tuple(s), generator=g, dtype=torch.float64) * scale).to(d)
             for s, d in zip(shapes, dtypes)]
    t = gt.clip_norm(max_norm)
    assert is_batched(t)  # on accumulate: one pass at the end of each backward
    many, _ = t.update_many(grads, [t.init(x) for x in grads], [None] * len(grads))
    for x, got in zip(grads, many, strict=True):
        one = t.update(x, t.init(x), None)[0]
        assert got.dtype == x.dtype and torch.equal(got, one)
        assert torch.equal(got, _clip_by_hand(x, max_norm))


def test_clip_norm_on_accumulate_runs_once_per_backward_as_one_by_one():
    """``when="accumulate"``: every tensor the backward reached is clipped in one pass at its
    end (a hook that runs as a gradient is accumulated still sees it unclipped), with the
    numbers of the per-tensor formula bit for bit, over two backwards accumulating."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    net[2].double()
    xs = [torch.randn(5, 4) for _ in range(2)]

    def loss(x: torch.Tensor) -> torch.Tensor:
        h = net[1](net[0](x)).double()
        return net[4](net[3](net[2](h)).float()).square().sum() * 10

    want = {}
    for x in xs:  # the oracle: autograd's gradients, accumulated and clipped by hand
        for n, g in zip([n for n, _ in net.named_parameters()],
                        torch.autograd.grad(loss(x), list(net.parameters())), strict=True):
            want[n] = _clip_by_hand(g if n not in want else want[n] + g, 0.3)
    seen: list[float] = []
    first = net[0].weight
    with gt.transform(net, {"*": gt.clip_norm(0.3)}, when="accumulate"):
        first.register_post_accumulate_grad_hook(lambda p: seen.append(float(p.grad.norm())))
        for x in xs:
            loss(x).backward()
    assert all(v > 0.3 + 1e-6 for v in seen)  # unclipped when accumulated, not yet clipped
    for n, p in net.named_parameters():
        assert torch.equal(p.grad, want[n]), n


def test_clip_norm_one_by_one_and_together_agree(device):
    """Large tensors too (several chunks of the foreach kernels), with mixed dtypes."""
    g = torch.Generator().manual_seed(3)
    sizes = [(300, 700), (5,), (), (0, 3), (70000,), (64, 64)]
    grads = [(torch.randn(s, generator=g) * 3).to(device=device, dtype=d)
             for s, d in zip(sizes, [torch.float32, torch.float64, torch.float32,
                                     torch.bfloat16, torch.bfloat16, torch.float32])]
    t = gt.clip_norm(0.5)
    many, _ = t.update_many(grads, [()] * len(grads), [None] * len(grads))
    for x, got in zip(grads, many, strict=True):
        one = t.update(x, (), None)[0]
        if device.type == "cpu":
            assert torch.equal(got, one)
        else:  # the foreach norm's kernel may round the last bit differently
            torch.testing.assert_close(got, one)
        torch.testing.assert_close(got, _clip_by_hand(x, 0.5))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 2))


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(4, 5, generator=g) * (1 + 10 * (step % 3)), torch.randn(4, 2, generator=g))
            for _ in range(3)]


@pytest.mark.parametrize("when", ["accumulate", "step"])
def test_clip_norm_in_training_equals_the_per_tensor_formula_by_hand(when):
    """Three micro-batches a step: with when="accumulate" the accumulated .grad is clipped
    after each backward, with when="step" once before the step; the reference by hand."""
    max_norm, steps = 0.3, 4
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gt.transform(net, {"*": gt.clip_norm(max_norm)}, when=when,
                      optimizer=opt if when == "step" else None):
        for step in range(steps):
            for x, y in _batches(step):
                F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    over = 0  # gradients the clip changed
    for step in range(steps):
        for x, y in _batches(step):
            F.mse_loss(ref(x), y).backward()
            if when == "accumulate":
                for p in ref.parameters():
                    over += float(p.grad.norm()) > max_norm
                    p.grad = _clip_by_hand(p.grad, max_norm)
        if when == "step":
            for p in ref.parameters():
                over += float(p.grad.norm()) > max_norm
                p.grad = _clip_by_hand(p.grad, max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
    assert over > 0
    for (n, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
