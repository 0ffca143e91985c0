"""Records of pass-through calls (a call that returns its input, or a view of it, as is) and of
the calls around them, against the oracle (tests/_oracle.py).

The patterns: a no-op or view child inside a call whose input is used again after the call
returned, and a view made by several view ops.
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
