"""Per-sample membership from data flow: a tensor holds samples when it was computed from the
batch, not when its first dimension happens to have ``N`` rows.

Drawn shapes make the sequence length ``T``, a shared table's rows and a buffer's first
dimension equal to the batch size ``N`` (the case a row count takes for samples) or not.
Every model combines a shared part (positions ``arange(T)`` looked up in an embedding, a
parameter table read by a LayerNorm and a Linear, a buffer read by a Linear) with the
batch by broadcasting, so the shared call's output gradient is a sum over samples. Each
draw is checked against a per-sample loop (each sample's loss alone, float64), for the
gradients and the norms, with and without ``own_grad``. Where the shared output meets the
batch directly (an add or a mul), its per-sample gradient is the one the meeting carries
(``_samples.shared``): no replay, so no replay warning.
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


class DirectTable(nn.Module):
    """A buffer table ``[R, D]`` read by a LayerNorm and added to the batch, and another read
    by a Linear that scales it: each shared output meets the batch directly."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(rows, D))
        self.register_buffer("basis", torch.randn(rows, D))
        self.norm, self.mix = nn.LayerNorm(D), nn.Linear(D, D)
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = self.mix(self.basis) * torch.tanh(h + self.norm(self.table))
        return self.head(h)


class Reused(Positions):
    """Positions whose shared output is also used apart from the batch: the meeting carries
    only part of its gradient, so it is replayed."""

    def forward(self, ids: Tensor) -> Tensor:
        p = self.pos(torch.arange(ids.shape[1]))
        return self.head(torch.tanh(self.tok(ids) + p)) + p.sum()


def _compare(model: nn.Module, x: Tensor, own_grad: bool, closed: bool | None = None) -> None:
    """Per-sample gradients and norms against the loop; ``closed``: whether no replay (True)
    or one (False) is expected, or either (None)."""
    n = x.shape[0]

    def loss(out: Tensor) -> Tensor:
        return out.square().sum()

    want: dict[str, Tensor] = {}
    for quantities in (("grad", "norm"), ("norm",)):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as seen:
            # replays are announced; where none is expected, one fails the test
            warnings.simplefilter("error" if closed else "always")
            with gt.per_sample(model, loss_reduction="sum", own_grad=own_grad,
                               quantities=quantities) as ps:
                loss(model(x)).backward()
            norms = ps.norms
        if closed is False:
            assert any("replay" in str(w.message) for w in seen)
        want = want or loop_oracle(model, lambda i: loss(model(x[i:i + 1])), n, ps.names)
        for k, r in want.items():
            if "grad" in quantities:
                torch.testing.assert_close(ps.grad[k], r, msg=lambda m, k=k: f"grad {k}: {m}")
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
    _compare(model, ids, own_grad, closed=True)


@PROFILE
@given(n=st.integers(1, 4), extra=st.sampled_from([0, 0, 1]), own_grad=st.booleans())
def test_shared_tables_meeting_the_batch_directly_need_no_replay(n: int, extra: int,
                                                                 own_grad: bool) -> None:
    rows = n + extra  # a table's rows == N half of the time
    _compare(DirectTable(rows), torch.randn(n, rows, D), own_grad, closed=True)


@pytest.mark.parametrize("t", [3, 4])
def test_shared_output_used_apart_from_the_batch_is_replayed(t: int) -> None:
    _compare(Reused(5, t), torch.randint(0, 5, (3, t)), own_grad=False, closed=False)


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
    _compare(model, torch.randint(0, 5, (3, 3)), own_grad=False, closed=True)


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


_MEETINGS = {
    "add": lambda h, p: h + p,
    "radd": lambda h, p: p + h,
    "iadd": lambda h, p: h.mul(1.0).add_(p),
    "sub": lambda h, p: h - p,
    "rsub": lambda h, p: p - h,
    "alpha": lambda h, p: torch.add(h, p, alpha=0.5),
    "mul": lambda h, p: h * p,
    "rmul": lambda h, p: torch.mul(p, h),
    "twice": lambda h, p: (h + p) * p,
    "view": lambda h, p: h + p[None],
    "unsqueeze": lambda h, p: p.unsqueeze(0) * h,
}


class Meets(Positions):
    """Positions meeting the batch at one of :data:`_MEETINGS`, with the batch along dim
    ``bd`` (``[T, N]`` ids look positions ``[T, 1]`` up)."""

    def __init__(self, how: str, bd: int) -> None:
        super().__init__(5, 3)
        self.how, self.bd = how, bd

    def forward(self, ids: Tensor) -> Tensor:
        t = torch.arange(ids.shape[1 - self.bd])
        p = self.pos(t if self.bd == 0 else t[:, None])
        return self.head(torch.tanh(_MEETINGS[self.how](self.tok(ids), p)))


@pytest.mark.parametrize(("how", "bd"), [(how, bd) for how in sorted(_MEETINGS) for bd in (0, 1)
                                         if bd == 0 or how not in ("view", "unsqueeze")])
def test_each_meeting_gives_the_shared_lookup_its_closed_form(how: str, bd: int) -> None:
    model = Meets(how, bd)
    ids = torch.randint(0, 5, (3, 3))  # T == N: rows alone cannot tell the samples
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no replay
        with gt.per_sample(model, loss_reduction="sum", batch_dim=bd) as ps:
            model(ids).square().sum().backward()
        got = ps.grad

    def alone(i: int) -> Tensor:
        return model(ids[i:i + 1] if bd == 0 else ids[:, i:i + 1]).square().sum()

    for k, r in loop_oracle(model, alone, 3, ps.names).items():
        torch.testing.assert_close(got[k], r, msg=lambda m, k=k: f"grad {k}: {m}")


class Checkpointed(Positions):
    """Positions under a non-reentrant checkpoint: the meeting's gradient comes from the
    original graph, its saved tensors recomputed."""

    def forward(self, ids: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, ids, use_reentrant=False)


@pytest.mark.parametrize("case", ["checkpoint", "two forwards", "retain_graph"])
def test_closed_form_across_checkpoints_forwards_and_backwards(case: str) -> None:
    model = Checkpointed(5, 3) if case == "checkpoint" else Positions(5, 3)
    a, b = torch.randint(0, 5, (3, 3)), torch.randint(0, 5, (3, 3))

    def loss(i: slice) -> Tensor:
        out = model(a[i]).square().sum()
        return out + model(b[i]).sin().sum() if case == "two forwards" else out

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no replay
        with gt.per_sample(model, loss_reduction="sum") as ps:
            total = loss(slice(None))
            total.backward(retain_graph=case == "retain_graph")
            if case == "retain_graph":
                total.backward()  # the same forward's gradient again: results add up
        got = ps.grad
    times = 2 if case == "retain_graph" else 1
    for k, r in loop_oracle(model, lambda i: loss(slice(i, i + 1)), 3, ps.names).items():
        torch.testing.assert_close(got[k], times * r, msg=lambda m, k=k: f"grad {k}: {m}")
