"""Per-sample gradients at the edges: custom recurrent layers on packed sequences, a module
that returns the batch loss, a plain ``per_sample`` beside an ``own_grad=True`` one, and
``ps.clear()`` between a forward and its backward. Numbers are checked against a per-sample
loop (``tests/test_per_sample_layouts.check``: each sample's loss alone, float64).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import gradtap as gt
from tests.test_per_sample_layouts import check, loop_oracle

pytestmark = pytest.mark.usefixtures("float64_seeded")


class StepRNN(nn.Module):
    """An Elman RNN written with two Linear cells, stepping through a ``PackedSequence``
    the way a differentially private RNN does (one call per time step on the sequences
    still running), returning a ``PackedSequence`` made with the input's batch sizes and
    the final states ``[1, N, H]``."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.ih, self.hh, self.h = nn.Linear(d, h), nn.Linear(h, h), h

    def forward(self, x: PackedSequence) -> tuple[PackedSequence, Tensor]:
        sizes = [int(b) for b in x.batch_sizes]
        state = x.data.new_zeros(sizes[0], self.h)
        outs, final, start = [], [None] * sizes[0], 0
        for t, b in enumerate(sizes):
            nxt = sizes[t + 1] if t + 1 < len(sizes) else 0
            state = torch.tanh(self.ih(x.data[start:start + b]) + self.hh(state[:b]))
            outs.append(state)
            for i in range(nxt, b):
                final[i] = state[i]
            start += b
        h_n = torch.stack(final)
        if x.unsorted_indices is not None:
            h_n = h_n[x.unsorted_indices]
        return (PackedSequence(torch.cat(outs), x.batch_sizes, x.sorted_indices,
                               x.unsorted_indices), h_n.unsqueeze(0))


class Head(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: PackedSequence) -> Tensor:
        return self.rnn(x)[0].data


def _packed(n: int, lengths: list[int], d: int, sort: bool) -> PackedSequence:
    x = torch.randn(n, max(lengths), d)
    return pack_padded_sequence(x, torch.tensor(lengths), batch_first=True,
                                enforce_sorted=sort)


def _packed_alone(x: PackedSequence, i: int) -> PackedSequence:
    """Sequence ``i`` of ``x`` packed alone."""
    from torch.nn.utils.rnn import unpack_sequence
    seq = unpack_sequence(x)[i]
    return pack_padded_sequence(seq[None], torch.tensor([seq.shape[0]]), batch_first=True)


@pytest.mark.parametrize(("lengths", "sort"), [([2], True), ([3, 1], True), ([1, 3, 2], False),
                                               ([2, 2], True)])
def test_custom_rnn_on_packed_sequences_matches_loop(lengths: list[int], sort: bool) -> None:
    model = Head(StepRNN(3, 4))
    x = _packed(len(lengths), lengths, 3, sort)
    check(model, lambda: model(x).square().sum(),
          lambda i: model(_packed_alone(x, i)).square().sum(), len(lengths))


def _against_loop(model: nn.Module, total, alone, n: int, **kw: object) -> None:
    """``check`` without its no-hooks check (Opacus's layers keep state-dict hooks)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gt.per_sample(model, loss_reduction="sum", **kw) as ps:  # type: ignore[arg-type]
            total().backward()
    for k, r in loop_oracle(model, alone, n, ps.names).items():
        torch.testing.assert_close(ps.grad[k], r, msg=lambda m, k=k: f"grad {k}: {m}")


@pytest.mark.parametrize("cls", ["DPRNN", "DPLSTM", "DPGRU"])
@pytest.mark.parametrize(("batch_first", "packed"), [(False, False), (True, False),
                                                     (False, True), (True, True)])
def test_opacus_rnns_with_one_sample_match_loop(cls: str, batch_first: bool,
                                                packed: bool) -> None:
    layers = pytest.importorskip("opacus.layers")
    model = Head(getattr(layers, cls)(3, 4, num_layers=2, batch_first=batch_first,
                                      bidirectional=True)) if packed else None
    if packed:
        assert model is not None
        x = _packed(1, [2], 3, True)
        _against_loop(model, lambda: model(x).square().sum(),
                      lambda i: model(_packed_alone(x, i)).square().sum(), 1)
        return
    rnn = getattr(layers, cls)(3, 4, num_layers=2, batch_first=batch_first)
    x = torch.randn(1, 2, 3) if batch_first else torch.randn(2, 1, 3)
    bd = 0 if batch_first else 1
    _against_loop(rnn, lambda: rnn(x)[0].square().sum(),
                  lambda i: rnn(x.narrow(bd, i, 1))[0].square().sum(), 1, batch_dim=bd)


@pytest.mark.parametrize("cls", [nn.RNN, nn.LSTM, nn.GRU])
@pytest.mark.parametrize("n", [1, 2])
def test_sequence_first_rnn_small_batches_match_loop(cls: type[nn.RNNBase], n: int) -> None:
    rnn = cls(3, 4, num_layers=2)
    x = torch.randn(2, n, 3)  # [T, N, D]: the output [T, N, H] has T rows at dim 0
    check(rnn, lambda: rnn(x)[0].square().sum(),
          lambda i: rnn(x[:, i:i + 1])[0].square().sum(), n, batch_dim=1)


needs_lce = pytest.mark.skipif(not hasattr(nn, "LinearCrossEntropyLoss"),
                               reason=f"torch {torch.__version__} has no "
                                      "nn.LinearCrossEntropyLoss")


@needs_lce
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_loss_module_matches_loop(reduction: str, bias: bool) -> None:
    m = nn.LinearCrossEntropyLoss(5, 4, bias=bias, reduction=reduction)
    x, y = torch.randn(3, 5), torch.randint(0, 4, (3,))
    check(m, lambda: m(x, y), lambda i: m(x[i:i + 1], y[i:i + 1]), 3,
          loss_reduction=reduction)


@pytest.mark.parametrize("own_first", [False, True])
def test_plain_and_own_grad_on_one_module_are_refused_at_construction(
        own_first: bool) -> None:
    m = nn.MultiheadAttention(8, 2, batch_first=True)
    first = gt.per_sample(m, own_grad=own_first)
    try:
        with pytest.raises(ValueError, match=r"per_sample\(own_grad=(True|False)\).*"
                                             r"per_sample\(own_grad=(True|False)\).*"
                                             r"remove the other first"):
            gt.per_sample(m, own_grad=not own_first)
        # Two of the same kind without own_grad are fine, and so is the other after remove.
        if not own_first:
            gt.per_sample(m).remove()
    finally:
        first.remove()
    x = torch.randn(3, 5, 8)
    want = torch.stack([torch.autograd.grad(m(x[i:i + 1], x[i:i + 1], x[i:i + 1])[0]
                                            .square().sum(), m.in_proj_weight)[0]
                        for i in range(3)])
    with gt.per_sample(m, own_grad=not own_first, loss_reduction="sum") as ps:
        m(x, x, x)[0].square().sum().backward()
    torch.testing.assert_close(ps.grad["in_proj_weight"], want)


def test_own_grad_inside_a_plain_one_on_other_modules_is_allowed() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with gt.per_sample(net, select="0.*"), gt.per_sample(net, select="2.*", own_grad=True):
        pass


@pytest.mark.parametrize("own_grad", [False, True])
def test_clear_between_forward_and_backward_keeps_that_forward(own_grad: bool) -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 3)
    want = {k: torch.stack([torch.autograd.grad(net(x[i:i + 1]).square().sum(), p)[0]
                            for i in range(3)]) for k, p in net.named_parameters()}
    net.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gt.per_sample(net, own_grad=own_grad, loss_reduction="sum") as ps:
            net(x[:2]).square().sum().backward()  # an earlier batch, of another size
            ps.clear()
            out = net(x)
            ps.clear()  # the forward above is pending: its backward is the next result
            net.zero_grad()
            out.square().sum().backward()
            for k, p in net.named_parameters():
                torch.testing.assert_close(ps.grad[k], want[k])
                torch.testing.assert_close(p.grad, want[k].sum(0))
            ps.clear()  # after the backward: everything is forgotten
            with pytest.raises(gt.GradtapError, match="no per-sample gradient"):
                ps.grad  # noqa: B018
