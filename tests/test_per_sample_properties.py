"""Per-sample gradients end to end, over drawn layers, inputs and settings.

Hypothesis draws a layer and its configuration (Linear with extra dims, Conv1d/2d/3d and their
transposes with stride, padding, dilation and groups, Embedding with padding_idx, EmbeddingBag
with offsets and per_sample_weights, LayerNorm/RMSNorm/GroupNorm/InstanceNorm, RNN/GRU/LSTM
batch-first or not and packed, MultiheadAttention, a module without a rule that goes through
the replay), a batch of 0 to 4 samples, the loss reduction, ``own_grad`` (with inputs that
require grad or not: only calls with such an input are owned) and norms only; every
case is checked against a loop that runs each sample alone through ``torch.autograd.grad``
(float64). Each sample's loss is the sum of its outputs (and final states or attention
weights) against fixed random weights.

``make test`` draws a few examples per test; ``GRADTAP_HYPOTHESIS_PROFILE=long`` (the
compatibility job) draws many more.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

import gradtap as gt
from tests.test_per_sample import CASES

EXAMPLES = {"long": 120}.get(os.environ.get("GRADTAP_HYPOTHESIS_PROFILE", ""), 12)
PROFILE = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Case:
    """A layer, a batch of ``n`` samples, and how to score a batch or one sample alone."""

    module: nn.Module
    n: int
    batch: Callable[[], Any]  # the forward's arguments for the whole batch
    alone: Callable[[int], Any]  # the forward's arguments for sample i alone
    score: Callable[[Any, Any], Tensor]  # (output, which: None = all, or i) -> summed loss
    batch_dim: int = 0  # where the inputs hold their samples (sequence-first layers: 1)


def _weights_like(t: Tensor, gen: torch.Generator) -> Tensor:
    return torch.randn(t.shape, generator=gen, dtype=t.dtype)


def plain_case(module: nn.Module, x: Tensor, n: int) -> Case:
    """A layer with a rule (or none), samples along dim 0 of its one input."""
    # torch warns once per process about some drawn layers (padding="same" with an even
    # kernel): this first call of each is the one that may warn, which is not the point here.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = module(x[:1])  # the drawn input has at least one sample
    w = _weights_like(one[0], torch.Generator().manual_seed(1))
    x = torch.cat([x] * -(-max(n, 1) // x.shape[0]))[:n]
    return Case(module, n, lambda: (x,), lambda i: (x[i:i + 1],),
                lambda out, which: (out * w).sum())


class NoRule(nn.Module):
    """A module without a per-sample rule: its per-sample gradients come from the replay."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))
        self.shift = nn.Parameter(torch.randn(features))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.scale) + self.shift * x.pow(2)


@st.composite
def rule_cases(draw: st.DrawFn) -> tuple[nn.Module, Tensor]:
    kind = draw(st.sampled_from([*CASES, NoRule]))
    if kind is NoRule:
        f = draw(st.integers(1, 4))
        return NoRule(f), torch.randn(2, *[draw(st.integers(1, 3))] * draw(st.integers(0, 1)), f)
    module, x = draw(CASES[kind])
    return module, x


@st.composite
def recurrent_cases(draw: st.DrawFn, n: int) -> Case:
    cls = draw(st.sampled_from([nn.RNN, nn.GRU, nn.LSTM]))
    f, h, layers = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    packed = n > 0 and draw(st.booleans())
    batch_first = draw(st.booleans())
    module = cls(f, h, num_layers=layers, batch_first=batch_first,
                 bidirectional=draw(st.booleans()), bias=draw(st.booleans()))
    gen = torch.Generator().manual_seed(2)
    t_max = 4
    w_out = torch.randn(t_max, h * (2 if module.bidirectional else 1), generator=gen)
    w_state = torch.randn(layers * (2 if module.bidirectional else 1), h, generator=gen)

    def state_of(out: Any) -> Tensor:
        return out[1][0] if cls is nn.LSTM else out[1]

    if packed:
        lengths = [draw(st.integers(1, t_max)) for _ in range(n)]
        seqs = [torch.randn(t, f) for t in lengths]

        def score(out: Any, which: Any) -> Tensor:
            padded, _ = pad_packed_sequence(out[0], batch_first=True)
            return (padded * w_out[:padded.shape[1]]).sum() + (state_of(out) * w_state[:, None]).sum()

        return Case(module, n, lambda: (pack_sequence(seqs, enforce_sorted=False),),
                    lambda i: (pack_sequence([seqs[i]]),), score)
    t = draw(st.integers(1, t_max))
    x = torch.randn(n, t, f) if batch_first else torch.randn(t, n, f)
    dim = 0 if batch_first else 1

    def score_plain(out: Any, which: Any) -> Tensor:
        o = out[0] if batch_first else out[0].transpose(0, 1)
        return (o * w_out[:t]).sum() + (state_of(out) * w_state[:, None]).sum()

    return Case(module, n, lambda: (x,), lambda i: (x.narrow(dim, i, 1),), score_plain, dim)


@st.composite
def attention_cases(draw: st.DrawFn, n: int) -> Case:
    heads = draw(st.integers(1, 2))
    e = heads * draw(st.integers(1, 3))
    batch_first = draw(st.booleans())
    module = nn.MultiheadAttention(e, heads, bias=draw(st.booleans()), batch_first=batch_first)
    length, source = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    q = torch.randn(n, length, e) if batch_first else torch.randn(length, n, e)
    kv = torch.randn(n, source, e) if batch_first else torch.randn(source, n, e)
    dim = 0 if batch_first else 1
    gen = torch.Generator().manual_seed(3)
    w_out, w_att = torch.randn(length, e, generator=gen), torch.randn(length, source, generator=gen)

    def score(out: Any, which: Any) -> Tensor:
        o = out[0] if batch_first else out[0].transpose(0, 1)
        return (o * w_out).sum() + (out[1] * w_att).sum()

    return Case(module, n, lambda: (q, kv, kv),
                lambda i: (q.narrow(dim, i, 1), kv.narrow(dim, i, 1), kv.narrow(dim, i, 1)), score,
                dim)


@st.composite
def bag_cases(draw: st.DrawFn, n: int) -> Case:
    v, d = draw(st.integers(2, 6)), draw(st.integers(1, 3))
    weighted = draw(st.booleans())
    mode = "sum" if weighted else draw(st.sampled_from(["sum", "mean", "max"]))
    module = nn.EmbeddingBag(v, d, mode=mode)
    sizes = [draw(st.integers(1, 4)) for _ in range(n)]
    flat = torch.randint(0, v, (sum(sizes),))
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]] if n else [],
                           dtype=torch.long)
    psw = torch.randn(len(flat)) if weighted else None
    w = torch.randn(d, generator=torch.Generator().manual_seed(4))
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()] if n else [0]

    def args(i: int | None) -> tuple:
        if i is None:
            return (flat, offsets) if psw is None else (flat, offsets, psw)
        part = flat[starts[i]:starts[i + 1]]
        one = torch.zeros(1, dtype=torch.long)
        return (part, one) if psw is None else (part, one, psw[starts[i]:starts[i + 1]])

    return Case(module, n, lambda: args(None), args, lambda out, which: (out * w).sum())


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(0, 4))
    family = draw(st.sampled_from(["rule", "recurrent", "attention", "bag"]))
    if family == "recurrent":
        return draw(recurrent_cases(n))
    if family == "attention":
        return draw(attention_cases(n))
    if family == "bag":
        return draw(bag_cases(n))
    module, x = draw(rule_cases())
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        n = max(n, 1)  # torch's instance_norm with affine parameters fails on an empty batch
    return plain_case(module, x, n)


def loop_oracle(case: Case, names: list[str]) -> dict[str, Tensor]:
    params = dict(case.module.named_parameters())
    rows: dict[str, list[Tensor]] = {k: [] for k in names}
    for i in range(case.n):
        loss = case.score(case.module(*case.alone(i)), i)
        grads = torch.autograd.grad(loss, [params[k] for k in names], allow_unused=True)
        for k, g in zip(names, grads):
            rows[k].append(torch.zeros_like(params[k]) if g is None else g)
    return {k: torch.stack(r) if r else params[k].new_zeros((0, *params[k].shape))
            for k, r in rows.items()}


def _needing_grad(args: tuple) -> tuple:
    """The batch's floating-point inputs as leaves that require grad (packed data included):
    ``own_grad`` owns only calls with such an input, so this is what exercises its path."""
    def leaf(a: Any) -> Any:
        if isinstance(a, PackedSequence):
            return a._replace(data=leaf(a.data))
        if isinstance(a, Tensor) and a.is_floating_point():
            return a.detach().requires_grad_(True)
        return a
    return tuple(leaf(a) for a in args)


@PROFILE
@given(data=st.data(), reduction=st.sampled_from(["sum", "mean"]), own_grad=st.booleans(),
       norms_only=st.booleans(), inputs_grad=st.booleans())
def test_per_sample_matches_a_loop_over_samples(data, reduction, own_grad, norms_only,
                                                inputs_grad):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        case = data.draw(cases())
        _check(case, reduction, own_grad, norms_only, inputs_grad)
    finally:
        torch.set_default_dtype(old)


def _check(case: Case, reduction: str, own_grad: bool, norms_only: bool,
           inputs_grad: bool = False) -> None:
    module, n = case.module, case.n
    module.zero_grad(set_to_none=True)
    quantities = ("norm",) if norms_only else ("grad", "norm")
    args = _needing_grad(case.batch()) if inputs_grad else case.batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # which calls were replayed is not the point here
        with gt.per_sample(module, loss_reduction=reduction, quantities=quantities,
                           own_grad=own_grad, batch_dim=case.batch_dim) as ps:
            loss = case.score(module(*args), None)
            if reduction == "mean" and n:
                loss = loss / n
            loss.backward()
    names = ps.names
    expected = loop_oracle(case, names)
    tol = {"rtol": 1e-7, "atol": 1e-9}
    for k in names:
        if not norms_only:
            torch.testing.assert_close(ps.grad[k], expected[k], **tol,
                                       msg=lambda m, k=k: f"grad {k} of {module}: {m}")
        p = dict(module.named_parameters())[k]
        total = expected[k].sum(0) / (n if reduction == "mean" and n else 1)
        if n:
            torch.testing.assert_close(p.grad if p.grad is not None else torch.zeros_like(p),
                                       total, **tol, msg=lambda m, k=k: f"p.grad {k}: {m}")
    norm = torch.stack([torch.cat([expected[k][i].flatten() for k in names]).norm()
                        for i in range(n)]) if n else torch.zeros(0)
    torch.testing.assert_close(ps.norm.double(), norm, **tol)
