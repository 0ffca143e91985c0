"""Per-sample membership from data flow: a tensor holds samples when it was computed from the
batch, not when its first dimension happens to have ``N`` rows.

Drawn shapes make the sequence length ``T``, a shared table's rows and a buffer's first
dimension equal to the batch size ``N`` (the case a row count takes for samples) or not.
Every model combines a shared part (positions ``arange(T)`` looked up in an embedding, a
parameter table read by a LayerNorm and a Linear, a buffer read by a Linear) with the
batch by broadcasting, so the shared call's output gradient is a sum over samples. Each
draw is checked against a per-sample loop (each sample's loss alone, float64), for the
gradients and the norms, with and without ``own_grad``.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import gradtap as gt
from tests.test_per_sample_layouts import loop_oracle

pytestmark = pytest.mark.usefixtures("float64_seeded")

EXAMPLES = {"long": 100}.get(os.environ.get("GRADTAP_HYPOTHESIS_PROFILE", ""), 10)
PROFILE = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow,
                                          HealthCheck.function_scoped_fixture])
D = 4


class Positions(nn.Module):
    """Token embedding plus a learned position embedding looked up with shared ``arange(T)``."""

    def __init__(self, vocab: int, t: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D), nn.Embedding(t, D)
        self.head = nn.Linear(D, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(torch.tanh(h))


class Table(nn.Module):
    """A parameter table ``[R, D]`` read by a LayerNorm and a Linear, added to every sample."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, D))
        self.norm, self.proj = nn.LayerNorm(D), nn.Linear(D, D)
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.inp(x) + self.proj(self.norm(self.table))))


class Buffer(nn.Module):
    """A buffer ``[R, D]`` (its first dim may equal ``N``) read by a Linear, scaling the batch."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.register_buffer("basis", torch.randn(rows, D))
        self.mix, self.head = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x * torch.sigmoid(self.mix(self.basis)))


def _compare(model: nn.Module, x: Tensor, own_grad: bool) -> None:
    n = x.shape[0]

    def loss(out: Tensor) -> Tensor:
        return out.square().sum()

    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # replays are announced; the numbers are the test
        with gt.per_sample(model, loss_reduction="sum", own_grad=own_grad) as ps:
            loss(model(x)).backward()
        grads, norms = ps.grad, ps.norms
    want = loop_oracle(model, lambda i: loss(model(x[i:i + 1])), n, ps.names)
    for k, r in want.items():
        torch.testing.assert_close(grads[k], r, msg=lambda m, k=k: f"grad {k}: {m}")
        torch.testing.assert_close(norms[k], r.flatten(1).norm(dim=1),
                                   msg=lambda m, k=k: f"norm {k}: {m}")
        p = dict(model.named_parameters())[k]
        torch.testing.assert_close(p.grad, r.sum(0), msg=lambda m, k=k: f".grad {k}: {m}")


@PROFILE
@given(n=st.integers(1, 4), extra=st.sampled_from([0, 0, 1, 2]), vocab_is_n=st.booleans(),
       own_grad=st.booleans())
def test_shared_positions_match_loop(n: int, extra: int, vocab_is_n: bool,
                                     own_grad: bool) -> None:
    t = n + extra  # T == N half of the time
    vocab = n if vocab_is_n else 7
    model = Positions(vocab, t)
    ids = torch.randint(0, vocab, (n, t))
    _compare(model, ids, own_grad)


@PROFILE
@given(n=st.integers(1, 4), extra=st.sampled_from([0, 0, 1]), own_grad=st.booleans())
def test_shared_table_read_by_norm_and_linear_matches_loop(n: int, extra: int,
                                                           own_grad: bool) -> None:
    rows = n + extra
    _compare(Table(rows), torch.randn(n, rows, D), own_grad)


@PROFILE
@given(n=st.integers(1, 4), extra=st.sampled_from([0, 0, 2]), own_grad=st.booleans())
def test_buffer_with_n_rows_read_by_linear_matches_loop(n: int, extra: int,
                                                        own_grad: bool) -> None:
    rows = n + extra
    _compare(Buffer(rows), torch.randn(n, rows, D), own_grad)


def test_positions_with_t_equal_n_are_not_split_by_rows() -> None:
    """The case the row count got wrong: ``T == N`` positions, every sample sees all rows."""
    model = Positions(5, 3)
    _compare(model, torch.randint(0, 5, (3, 3)), own_grad=False)


def test_zero_state_made_from_the_batch_still_splits_by_rows() -> None:
    """A state made with ``x.new_zeros`` is computed from the batch: its Linear's call keeps
    its closed form (no replay, no warning)."""

    class Cell(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ih, self.hh = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x: Tensor) -> Tensor:
            h = x.new_zeros(x.shape[0], D)
            for t in range(x.shape[1]):
                h = torch.tanh(self.ih(x[:, t]) + self.hh(h))
            return h

    model = Cell()
    x = torch.randn(3, 2, D)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gt.per_sample(model, loss_reduction="sum") as ps:
            model(x).square().sum().backward()
    want = loop_oracle(model, lambda i: model(x[i:i + 1]).square().sum(), 3, ps.names)
    for k, r in want.items():
        torch.testing.assert_close(ps.grad[k], r)
