"""Per-sample gradients where the samples are not rows along ``batch_dim`` of every tensor.

Empty batches, recurrent layers' final states ``[layers, N, H]``, sequence-first attention
weights ``[N, L, S]``, ``PackedSequence`` inputs (one sample per sequence) and
``nn.EmbeddingBag`` with flat input and offsets (one sample per bag). Every test compares
``gt.per_sample`` with a per-sample loop oracle: ``torch.autograd.grad`` of each sample's loss,
computed by running that sample alone, in float64.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import gradtap as gt
from tests._models import assert_no_hooks

pytestmark = pytest.mark.usefixtures("float64_seeded")


def loop_oracle(model: nn.Module, alone: Callable[[int], Tensor], n: int,
                names: list[str]) -> dict[str, Tensor]:
    """``d l_i / d p`` for each sample i, from a forward and backward of sample i alone."""
    params = dict(model.named_parameters())
    out: dict[str, Tensor] = {}
    for k in names:
        p = params[k]
        rows = []
        for i in range(n):
            g = torch.autograd.grad(alone(i), p, allow_unused=True)[0]
            rows.append(torch.zeros_like(p) if g is None else g)
        out[k] = torch.stack(rows) if rows else p.new_zeros((0, *p.shape))
    return out


def check(model: nn.Module, total: Callable[[], Tensor], alone: Callable[[int], Tensor], n: int,
          *, loss_reduction: str = "sum", quantities: tuple = ("grad", "norm"),
          **kw: object) -> gt.PerSample:
    """``gt.per_sample`` on ``total()`` against the loop oracle, for every asked quantity."""
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # which calls were replayed is not the point here
        with gt.per_sample(model, loss_reduction=loss_reduction, quantities=quantities,
                           **kw) as ps:  # type: ignore[arg-type]
            total().backward()
        names = ps.names
        got = {q: getattr(ps, "norms" if q == "norm" else q) for q in quantities}
    assert_no_hooks(model)
    ref = loop_oracle(model, alone, n, names)
    for k, r in ref.items():
        if "grad" in quantities:
            torch.testing.assert_close(got["grad"][k], r, msg=lambda m, k=k: f"grad {k}: {m}")
        if "norm" in quantities:
            torch.testing.assert_close(got["norm"][k], (r.flatten(1) if r.dim() > 1 else r[:, None]).norm(dim=1),
                                       msg=lambda m, k=k: f"norm {k}: {m}")
    return ps


# --------------------------------------------------------------------------------------------
# empty batches
# --------------------------------------------------------------------------------------------


class Shift(nn.Module):
    """No rule: the torch.func replay."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b


EMPTY = [
    (lambda: nn.Linear(4, 3), (0, 2, 4)),
    (lambda: nn.Conv1d(4, 8, 2), (0, 4, 6)),
    (lambda: nn.GroupNorm(2, 4), (0, 4, 5)),
    (lambda: nn.Embedding(10, 3), None),
    (Shift, (0, 4)),
    (lambda: nn.LSTM(4, 3, batch_first=True), (0, 5, 4)),
]


@pytest.mark.parametrize("own_grad", [False, True])
@pytest.mark.parametrize("quantities", [("grad", "norm"), ("norm",)])
@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
@pytest.mark.parametrize("case", range(len(EMPTY)))
def test_empty_batch_gives_zero_rows(case: int, loss_reduction: str, quantities: tuple,
                                     own_grad: bool) -> None:
    make, shape = EMPTY[case]
    m = make()
    x = torch.randint(0, 10, (0, 5)) if shape is None else torch.randn(shape)

    def total() -> Tensor:
        out = m(x)
        out = out[0] if isinstance(out, tuple) else out
        return getattr(out.abs(), loss_reduction)()

    check(m, total, lambda i: total(), 0, loss_reduction=loss_reduction, quantities=quantities,
          own_grad=own_grad)


def test_empty_batch_then_a_full_one_with_clear() -> None:
    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    with gt.per_sample(m) as ps:
        m(torch.randn(0, 4)).sum().backward()
        assert ps.grad["0.weight"].shape == (0, 3, 4) and ps.norm.shape == (0,)
        ps.clear()
        x = torch.randn(3, 4)
        m.zero_grad()
        m(x).pow(2).mean().backward()
        got = ps.grad["0.weight"]
    ref = loop_oracle(m, lambda i: m(x[i:i + 1]).pow(2).mean(), 3, ["0.weight"])
    torch.testing.assert_close(got, ref["0.weight"])


# --------------------------------------------------------------------------------------------
# samples at another dim: recurrent states, attention weights
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_hx", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cls", [nn.RNN, nn.GRU, nn.LSTM])
def test_recurrent_final_state_feeds_the_loss(cls: type[nn.RNNBase], batch_first: bool,
                                              with_hx: bool) -> None:
    n, t, i_size, h_size, layers = 3, 5, 4, 6, 2
    m = cls(i_size, h_size, num_layers=layers, batch_first=batch_first)
    bd = 0 if batch_first else 1
    x = torch.randn(n, t, i_size) if batch_first else torch.randn(t, n, i_size)
    h0 = torch.randn(layers, n, h_size)
    hx = None if not with_hx else ((h0, torch.randn(layers, n, h_size)) if cls is nn.LSTM else h0)

    def loss(x: Tensor, hx: object) -> Tensor:
        out, h = m(x, hx)
        h_n = h[0] if isinstance(h, tuple) else h  # [layers, N, H] whatever batch_first says
        return h_n.pow(2).sum() + out.sin().sum()

    def alone(i: int) -> Tensor:
        h = None if hx is None else (tuple(s[:, i:i + 1] for s in hx) if isinstance(hx, tuple)
                                     else hx[:, i:i + 1])
        return loss(x.narrow(bd, i, 1), h)

    check(m, lambda: loss(x, hx), alone, n, batch_dim=bd)


@pytest.mark.parametrize(("own_grad", "inputs_grad"), [(False, False), (True, False),
                                                        (True, True)])
@pytest.mark.parametrize("masks", [False, True])
@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
def test_sequence_first_attention_weights_feed_the_loss(loss_reduction: str, masks: bool,
                                                        own_grad: bool, inputs_grad: bool) -> None:
    # own_grad with inputs that need no grad: the call is not owned and goes through the
    # attention rule's replay, whose layout must be the layer's own (not that of the forward
    # own_grad sets on the instance); with inputs that need grad the call is owned.
    n, q_len, s_len, e, heads = 3, 4, 5, 8, 2
    m = nn.MultiheadAttention(e, heads)
    q, kv = torch.randn(q_len, n, e), torch.randn(s_len, n, e)
    q.requires_grad_(inputs_grad)
    kv.requires_grad_(inputs_grad)
    pad = torch.zeros(n, s_len)
    pad[1, -2:] = -1e4  # float, as attn_mask
    attn = torch.randn(n * heads, q_len, s_len)
    c = 1.0 if loss_reduction == "sum" else 1.0 / n

    def loss(q: Tensor, kv: Tensor, pad: Tensor, attn: Tensor) -> Tensor:
        kw = {"key_padding_mask": pad, "attn_mask": attn} if masks else {}
        out, weights = m(q, kv, kv, **kw)  # weights: [N, L, S]
        return weights.pow(2).sum() + out.sum() * 0.1

    def alone(i: int) -> Tensor:
        return loss(q[:, i:i + 1], kv[:, i:i + 1], pad[i:i + 1], attn[i * heads:(i + 1) * heads])

    check(m, lambda: c * loss(q, kv, pad, attn), alone, n, batch_dim=1,
          loss_reduction=loss_reduction, own_grad=own_grad)
    if own_grad:  # .grad from the owned shares and the rule's, as autograd's of the batch
        got = {k: p.grad for k, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        (c * loss(q, kv, pad, attn)).backward()
        for k, p in m.named_parameters():
            torch.testing.assert_close(got[k], p.grad, msg=lambda msg, k=k: f".grad {k}: {msg}")


# --------------------------------------------------------------------------------------------
# one sample per packed sequence, one sample per bag
# --------------------------------------------------------------------------------------------


class PackedClassifier(nn.Module):
    """Pads and packs inside, as text classifiers do, and reads both outputs."""

    def __init__(self, cls: type[nn.RNNBase], sort: bool) -> None:
        super().__init__()
        self.rnn = cls(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)
        self.sort = sort

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        out, h = self.rnn(pack_padded_sequence(x, lengths, batch_first=True,
                                               enforce_sorted=self.sort))
        h_n = h[0] if isinstance(h, tuple) else h
        padded = pad_packed_sequence(out, batch_first=True)[0]
        return self.head(h_n[-1]) + padded.pow(2).sum(1)[:, :3]


@pytest.mark.parametrize("root", [True, False])
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM])
def test_packed_sequence_one_sample_per_sequence(cls: type[nn.RNNBase], sort: bool,
                                                 root: bool) -> None:
    n = 3
    lengths = torch.tensor([5, 3, 2]) if sort else torch.tensor([2, 5, 3])
    x = torch.randn(n, 5, 4)
    if root:  # the recurrent layer is the model, fed the PackedSequence
        m: nn.Module = cls(4, 6, batch_first=True)

        def loss(x: Tensor, lengths: Tensor) -> Tensor:
            out, _ = m(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=sort))
            return pad_packed_sequence(out, batch_first=True)[0].pow(2).sum()
    else:
        m = PackedClassifier(cls, sort)

        def loss(x: Tensor, lengths: Tensor) -> Tensor:
            return m(x, lengths).pow(2).sum()

    check(m, lambda: loss(x, lengths),
          lambda i: loss(x[i:i + 1, :int(lengths[i])], lengths[i:i + 1]), n)


@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize(("mode", "weighted"), [("sum", False), ("mean", False), ("max", False),
                                                ("sum", True)])
@pytest.mark.parametrize("sizes", [(2, 1, 4), (1, 1, 1), (3, 0, 2)])
def test_embedding_bag_with_offsets_one_sample_per_bag(sizes: tuple, mode: str, weighted: bool,
                                                       last: bool) -> None:
    m = nn.EmbeddingBag(10, 4, mode=mode, include_last_offset=last, padding_idx=2)
    flat = torch.randint(0, 10, (sum(sizes),))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    offsets = torch.tensor([*starts, sum(sizes)] if last else starts)
    w = torch.rand(len(flat)) if weighted else None

    def alone(i: int) -> Tensor:
        s, e = starts[i], starts[i] + sizes[i]
        off = torch.tensor([0, e - s] if last else [0])
        return m(flat[s:e], off, per_sample_weights=None if w is None else w[s:e]).pow(2).sum()

    check(m, lambda: m(flat, offsets, per_sample_weights=w).pow(2).sum(), alone, len(sizes))
