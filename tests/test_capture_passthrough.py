"""Records of pass-through calls (a call that returns its input, or a view of it, as is) and of
the calls around them, against the oracle (tests/_oracle.py).

The patterns: a no-op or view child inside a call whose input is used again after it returned, a
view made by several view ops, and pass-throughs on tensors that cannot be modified in place
(a view of a parameter, the alias of a second output path, an expanded tensor, an output of
an op that returns several views).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtap as gt
from tests.test_capture import assert_tap_changes_nothing, check_against_oracle


@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def every_call_recorded(t: gt.Tap) -> None:
    """Each tapped module has exactly one record (each is called once and reached)."""
    for name in t.names:
        assert len(t.find(name)) == 1, name


class NoOpPad(nn.Module):
    """A dynamic "SAME" padding with nothing to pad: returns its input as is."""

    def forward(self, x):
        return x


class PadConv(nn.Conv2d):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pad = NoOpPad()

    def forward(self, x):
        return F.conv2d(self.pad(x), self.weight, self.bias, self.stride)


class Shortcut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = PadConv(4, 8, 1, stride=2)

    def forward(self, x):
        return self.conv(x)


class PreActBlock(nn.Module):
    """Gives the same activated tensor (or a view of it) to the shortcut, then to the conv."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.norm, self.act, self.view = nn.GroupNorm(2, 4), nn.ReLU(), view
        self.downsample, self.conv1 = Shortcut(), PadConv(4, 8, 1, stride=2)

    def forward(self, x):
        pre = self.act(self.norm(x))
        if self.view:
            pre = pre.transpose(2, 3)
        shortcut = self.downsample(pre)
        return self.conv1(pre) + shortcut


@pytest.mark.parametrize("view", [False, True])
def test_calls_around_a_no_op_child_exclude_a_later_use_of_their_input(view):
    torch.manual_seed(0)
    m, x = PreActBlock(view), torch.randn(2, 4, 6, 6)

    def run():
        return m(x).pow(2).sum()

    # The no-op children's grad_outputs hold the later uses of the very tensor they returned
    # (documented); every other call is exactly its own vector-Jacobian product.
    pads = {"downsample.conv.pad", "conv1.pad"}
    t = check_against_oracle(m, run, checked=[n for n, _ in m.named_modules() if n not in pads])
    every_call_recorded(t)
    assert_tap_changes_nothing(m, run)


class FlattenHead(nn.Module):
    """Flattens its input (a view, passed through by ``nn.Flatten``) and also reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.flat, self.lin = nn.Flatten(), nn.Linear(6, 2)

    def forward(self, x):
        return self.lin(self.flat(x)).sum() + (x ** 2).sum()


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(3, 3), FlattenHead(), FlattenHead()

    def forward(self, x):
        h = self.body(x)
        return self.a(h) + 2 * self.b(h) + (h ** 3).sum()


def test_calls_around_a_view_child_exclude_a_later_use_of_their_input():
    torch.manual_seed(0)
    m, x = TwoHeads(), torch.randn(4, 2, 3)
    flats = {"a.flat", "b.flat"}  # their grad_outputs hold later uses of the viewed tensor
    t = check_against_oracle(m, lambda: m(x),
                             checked=[n for n, _ in m.named_modules() if n not in flats])
    every_call_recorded(t)
    # The flattens' boundary nodes send the gradient of the viewed tensor through its
    # CopySlices nodes, which group the sum of its uses differently: same math, other rounding.
    assert_tap_changes_nothing(m, lambda: m(x), exact=False)


class Partition(nn.Module):
    """[B, C, H, W] -> [B, H*W, C] by a permute, then a reshape that makes a view."""

    def forward(self, x):
        return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1, x.shape[1])


class MulInPlace(nn.Module):
    def forward(self, y):
        return y.mul_(2)


@pytest.mark.parametrize("after", [nn.Identity, lambda: nn.Dropout(0.0), MulInPlace, nn.Tanh])
def test_view_made_by_two_view_ops_then_a_pass_through(after):
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Conv2d(4, 4, 1), Partition(), after()), torch.randn(2, 4, 3, 3)

    def run():
        return m(x).pow(2).sum()

    t = check_against_oracle(m, run)
    every_call_recorded(t)
    assert_tap_changes_nothing(m, run)


class Encoder(nn.Module):
    """Returns the same tensor as ``last_hidden_state`` and as ``hidden_states[-1]``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return {"last_hidden_state": h, "hidden_states": (x, h)}


class Pooler(nn.Module):
    def __init__(self, first_token: bool) -> None:
        super().__init__()
        self.dropout, self.dense, self.first_token = nn.Dropout(0.0), nn.Linear(4, 4), first_token

    def forward(self, h):
        return self.dense(self.dropout(h[:, 0] if self.first_token else h)).tanh()


class EncoderPooler(nn.Module):
    def __init__(self, key: str, first_token: bool) -> None:
        super().__init__()
        self.encoder, self.pooler, self.key = Encoder(), Pooler(first_token), key

    def forward(self, x):
        out = self.encoder(x)
        h = out["hidden_states"][-1] if self.key == "hidden_states" else out[self.key]
        return self.pooler(h)


@pytest.mark.parametrize("first_token", [True, False])
@pytest.mark.parametrize("key", ["hidden_states", "last_hidden_state"])
def test_pass_through_on_a_tensor_returned_under_two_output_paths(key, first_token):
    torch.manual_seed(0)
    m, x = EncoderPooler(key, first_token), torch.randn(2, 5, 4)

    def run():
        return m(x).pow(2).sum()

    t = check_against_oracle(m, run)
    every_call_recorded(t)
    assert_tap_changes_nothing(m, run)


class MaskQuery(nn.Module):
    """A learned embedding, expanded to the batch (or sliced, or as is), through Dropout(0)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.mask_emb = nn.Parameter(torch.randn(1, 1, 4))
        self.dropout, self.out, self.how = nn.Dropout(0.0), nn.Linear(4, 3), how

    def forward(self, h):
        q = {"expand": lambda: self.mask_emb.expand(2, h.shape[1], -1),
             "slice": lambda: self.mask_emb[:, :1],
             "as is": lambda: self.mask_emb}[self.how]()
        return self.out(self.dropout(q) * h[:2])


@pytest.mark.parametrize("how", ["expand", "slice", "as is"])
def test_pass_through_on_a_view_of_a_parameter(how):
    torch.manual_seed(0)
    m, h = MaskQuery(how), torch.randn(5, 3, 4)

    def run():
        return m(h).pow(2).sum()

    t = check_against_oracle(m, run)
    every_call_recorded(t)
    assert_tap_changes_nothing(m, run)


class Positions(nn.Module):
    """Returns its Parameter expanded to the batch, as is, or as a new tensor; no tensor input."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.position_embeddings, self.how = nn.Parameter(torch.randn(5, 4)), how

    def forward(self, batch_size: int):
        pe = self.position_embeddings
        return {"expand": lambda: pe.expand(batch_size, -1, -1), "as is": lambda: pe,
                "times one": lambda: pe * 1}[self.how]()


class PositionDecoder(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.output_positions = Positions(how)
        self.positions_projection, self.out = nn.Identity(), nn.Linear(4, 3)

    def forward(self, z):
        return self.out(self.positions_projection(self.output_positions(z.shape[0])) * z)


@pytest.mark.parametrize("how", ["expand", "as is", "times one"])
def test_pass_through_on_a_parameter_a_module_returned(how):
    torch.manual_seed(0)
    m, z = PositionDecoder(how), torch.randn(2, 5, 4)

    def run():
        return m(z).pow(2).sum()

    t = check_against_oracle(m, run)
    every_call_recorded(t)
    assert_tap_changes_nothing(m, run)


class ExpandedGate(nn.Module):
    """A vector made in the forward, expanded to the batch, through a pass-through."""

    def __init__(self, after: nn.Module) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(1, 4))
        self.after, self.out = after, nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.after((2 * self.q).expand(x.shape[0], -1)) * x)


@pytest.mark.parametrize("after", [nn.Identity, lambda: nn.Dropout(0.0)])
def test_pass_through_on_an_expanded_view_of_a_non_leaf(after):
    torch.manual_seed(0)
    m, x = ExpandedGate(after()), torch.randn(3, 4)

    def run():
        return m(x).pow(2).sum()

    t = check_against_oracle(m, run)
    every_call_recorded(t)
    assert_tap_changes_nothing(m, run)


def test_in_place_op_on_an_expanded_pass_through_output_is_refused_as_without_a_tap():
    ident, q = nn.Identity(), torch.randn(1, 4, requires_grad=True)
    with pytest.raises(RuntimeError):
        ident((2 * q).expand(3, -1)).mul_(2)
    with gt.tap(ident, select=""), pytest.raises(RuntimeError):
        ident((2 * q).expand(3, -1)).mul_(2)


class ExpandedOutput(nn.Module):
    """Returns a vector it made, expanded to the batch (a view of a tensor made in the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(1, 3))

    def forward(self, n: int):
        return (2 * self.q).expand(n, -1)


class UsesExpandedOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.lin = ExpandedOutput(), nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(self.gate(x.shape[0]) * x)


def test_expanded_view_of_a_tensor_made_in_the_call():
    torch.manual_seed(0)
    m, x = UsesExpandedOutput(), torch.randn(4, 3)

    def run():
        return m(x).pow(2).sum()

    t = check_against_oracle(m, run)
    every_call_recorded(t)
    assert_tap_changes_nothing(m, run)


class Halves(nn.Module):
    """Returns the two halves of ``chunk`` (views that cannot be modified in place) and uses
    them inside the call too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        a, b = self.lin(x).chunk(2, dim=1)
        return a, b, (a * b).sum()


class UsesHalves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.halves, self.ident = Halves(), nn.Identity()

    def forward(self, x):
        a, b, s = self.halves(x)
        return (3 * self.ident(a)).sum() + b.pow(2).sum() + s


def test_views_of_a_multi_output_op_also_used_inside_the_call():
    torch.manual_seed(0)
    m, x = UsesHalves(), torch.randn(4, 4, requires_grad=True)
    t = check_against_oracle(m, lambda: m(x))
    every_call_recorded(t)
    assert_tap_changes_nothing(m, lambda: m(x))
