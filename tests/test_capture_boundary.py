"""Boundary semantics of records on the patterns real models use, against the oracle.

``grad_outputs[k]`` is what flows back into a call through output ``k`` from the uses after the
call returned; the oracle (tests/_oracle.py) adds a zero leaf to every output as the call
returns, so its gradient is exactly that. Each pattern below broke an earlier capture: an output
also used inside the call, views returned and then modified in place, pass-through outputs
followed by in-place ops, and one tensor under two output paths.
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


def torch_hook_grad_outputs(module: nn.Module, run) -> tuple:
    """grad_output as register_full_backward_hook reports it (where it works)."""
    seen: dict[str, tuple] = {}
    h = module.register_full_backward_hook(lambda mod, gi, go: seen.update(go=go))
    try:
        run().backward()
    finally:
        h.remove()
    return seen["go"]


class SelfLoss(nn.Module):
    """Computes its own loss from the logits it also returns (HF ``*ForCausalLM(labels=)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        logits = self.lin(x)
        return (logits ** 2).sum(), logits


@pytest.mark.parametrize("later", [None, 3.0])
def test_output_used_inside_the_call_is_not_part_of_grad_outputs(later):
    m, x = SelfLoss(), torch.randn(2, 3, requires_grad=True)

    def run():
        loss, logits = m(x)
        return loss if later is None else loss + later * logits.sum()

    t = check_against_oracle(m, run)
    rec = t.find("")[0]
    hook_go = torch_hook_grad_outputs(m, run)
    if later is None:
        assert rec.grad_outputs["1"] is None and hook_go[1] is None
    else:
        torch.testing.assert_close(rec.grad_outputs["1"], torch.full((2, 3), later))
        torch.testing.assert_close(rec.grad_outputs["1"], hook_go[1])
    assert_tap_changes_nothing(m, run)


class BiasBlock(nn.Module):
    """T5-like: the first block makes a position bias, uses it, and returns it for the rest."""

    def __init__(self, makes_bias: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rel = nn.Embedding(5, 1) if makes_bias else None

    def forward(self, h, bias=None):
        if bias is None:
            bias = self.rel(torch.arange(4)).view(1, 4)
        return torch.tanh(self.lin(h) + bias), bias


class BiasStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([BiasBlock(True), BiasBlock(False), BiasBlock(False)])

    def forward(self, h):
        bias = None
        for block in self.blocks:
            h, bias = block(h, bias)
        return h


def test_position_bias_returned_and_used_reports_only_later_blocks_share():
    m, x = BiasStack(), torch.randn(2, 4)
    t = check_against_oracle(m, lambda: m(x).pow(2).sum())
    assert t.find("blocks.0")[0].grad_outputs["1"] is not None
    assert t.find("blocks.2")[0].grad_outputs["1"] is None  # no later block uses it
    assert_tap_changes_nothing(m, lambda: m(x).pow(2).sum())


class Swin(nn.Module):
    """nn.Linear on a 4-D input returns a view; then ReLU(inplace=True) (Swinv2's MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


class MaskedProjection(nn.Module):
    """Wav2Vec2's feature projection: a view output later hit by ``h[~mask] = 0``."""

    def __init__(self, dropout: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.0) if dropout else nn.Identity()
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        h = self.drop(self.proj(x))
        h[x[..., 0] > 0.5] = 0
        return self.out(h)


class FlattenDropout(nn.Module):
    """MobileNetV2's head: torch.flatten of a pooled map, then Dropout(inplace=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.5, inplace=True)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        torch.manual_seed(7)  # the same dropout mask in the tap run and the oracle run
        return self.fc(self.drop(torch.flatten(self.pool(x), 1)))


class Slice(nn.Module):
    def forward(self, x):
        return x[:, :3]


class ViewThenInplace(nn.Module):
    """A module returning a view of its input (``x[:, :3]``, ``nn.Flatten``), then in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.slice = Slice()
        self.flat = nn.Flatten()
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        h = F.gelu(self.lin(x))  # saves its input, so its output may be modified in place
        s = self.slice(h)
        s.mul_(2)
        f = self.flat(s.unsqueeze(-1).expand(-1, -1, 2).contiguous())
        f.add_(1)
        return self.head(f * f)


@pytest.mark.parametrize("make, shape", [
    (Swin, (1, 3, 3, 2)),
    (MaskedProjection, (3, 5, 4)),
    (lambda: MaskedProjection(dropout=True), (3, 5, 4)),
    (FlattenDropout, (4, 3, 2, 2)),
    (ViewThenInplace, (3, 4)),
])
def test_views_modified_in_place_after_the_call(make, shape):
    torch.manual_seed(0)
    m, x = make(), torch.randn(*shape, requires_grad=True)
    m.train()
    t = check_against_oracle(m, lambda: m(x).pow(2).sum())
    for rec in t.records:
        if rec.module_name:
            assert any(g is not None for g in rec.grad_outputs.values()), rec.module_name
        assert not rec.notes, (rec.module_name, rec.notes)
    assert_tap_changes_nothing(m, lambda: m(x).pow(2).sum())


def test_linear_view_then_inplace_relu_matches_boundary_gradient_by_hand():
    """The Swinv2 pattern against a hand-made boundary: clone the Linear's output."""
    torch.manual_seed(0)
    net, x = Swin().net, torch.randn(1, 3, 3, 2)
    with gt.tap(net) as t:
        net(x).sum().backward()
    kept = {}

    def boundary_clone(mod, args, out):
        kept["out"] = out.clone()
        return kept["out"].clone()

    h = net[0].register_forward_hook(boundary_clone)
    (g,) = torch.autograd.grad(net(x).sum(), kept["out"])
    h.remove()
    torch.testing.assert_close(t.find("0")[0].grad_outputs["output"], g)
    torch.testing.assert_close(t.find("1")[0].grad_inputs["input"], g)


class ConvLayer(nn.Module):
    """HF ResNetConvLayer with activation=None: ends in a pass-through module."""

    def __init__(self, last: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = last

    def forward(self, x):
        return self.act(self.lin(x))


class Residual(nn.Module):
    def __init__(self, last: nn.Module) -> None:
        super().__init__()
        self.layer = ConvLayer(last)

    def forward(self, x):
        h = self.layer(x)
        h += x
        return h.relu()


@pytest.mark.parametrize("last", [nn.Identity, lambda: nn.Dropout(0.0)])
def test_pass_through_output_then_inplace_residual(last):
    torch.manual_seed(0)
    m, x = Residual(last()), torch.randn(2, 4, requires_grad=True)
    m.train()
    t = check_against_oracle(m, lambda: (m(x) ** 2).sum())
    assert len(t.find("layer.act")) == 1
    act = t.find("layer.act")[0]
    torch.testing.assert_close(act.grad_inputs["input"], act.grad_outputs["output"])
    out = m.layer(x)
    assert not out._is_view()  # the tap's pass-through handling never makes a view
    assert_tap_changes_nothing(m, lambda: (m(x) ** 2).sum())


def test_pass_through_output_is_the_same_tensor_and_not_a_view():
    ident, lin = nn.Identity(), nn.Linear(3, 3)
    x = torch.randn(2, 3)
    with gt.tap(ident, select=""):
        h = lin(x)
        out = ident(h)
        assert out is h and not out._is_view()
        v = lin(x).view(2, 3)  # a view stays a view
        assert ident(v) is v


def test_pass_through_leaf_input_and_parameter():
    class ReturnsParam(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return x, self.w

    m = ReturnsParam()
    x = torch.randn(3, requires_grad=True)

    def run():
        a, w = m(x)
        return (a * w * 2).sum()

    t = check_against_oracle(m, run)
    rec = t.find("")[0]
    torch.testing.assert_close(rec.grad_inputs["x"], 2 * m.w.detach())
    torch.testing.assert_close(rec.param_grads["w"], 2 * x.detach())


class Encoder(nn.Module):
    """SuperPoint-like: ``last_hidden_state`` is also ``hidden_states[-1]``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        return {"last_hidden_state": h, "hidden_states": (x, h)}


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        return h, h, 3


def test_same_tensor_under_two_output_paths_gets_each_paths_gradient():
    enc, x = Encoder(), torch.randn(2, 3, requires_grad=True)

    def run():
        out = enc(x)
        return 2 * out["last_hidden_state"].sum() + 5 * out["hidden_states"][1].sum()

    t = check_against_oracle(enc, run)
    go = t.find("")[0].grad_outputs
    torch.testing.assert_close(go["last_hidden_state"], torch.full((2, 3), 2.0))
    torch.testing.assert_close(go["hidden_states.1"], torch.full((2, 3), 5.0))

    m = Twice()
    t = check_against_oracle(m, lambda: (lambda a, b, _: (a * 2 + b ** 2).sum())(*m(x)))
    assert set(t.find("")[0].grad_outputs) == {"0", "1"}
    assert_tap_changes_nothing(m, lambda: (lambda a, b, _: (a * 2 + b ** 2).sum())(*m(x)))


class LMHead(nn.Module):
    """BERT's prediction head: the decoder's bias is the head's own bias (one Parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(4, 6, bias=False)
        self.bias = nn.Parameter(torch.randn(6))
        self.decoder.bias = self.bias

    def forward(self, h):
        return self.decoder(h) + self.bias


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.head = LMHead()
        self.head.decoder.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def test_tied_parameters_held_by_nested_modules():
    m, ids = TiedLM(), torch.tensor([[1, 2, 3], [0, 5, 5]])

    def run():
        return m(ids).pow(2).sum()

    t = check_against_oracle(m, run)
    head, dec, emb = t.find("head")[0], t.find("head.decoder")[0], t.find("emb")[0]
    # nested records overlap: the head's record holds the decoder's use of the bias too
    bias_total = head.param_grads["bias"]
    assert bias_total is not None and dec.param_grads["bias"] is not None
    torch.testing.assert_close(bias_total, m.head.bias.grad)
    # the outermost calls that use the tied weight sum to its .grad
    torch.testing.assert_close(emb.param_grads["weight"] + head.param_grads["decoder.weight"],
                               m.emb.weight.grad)


def test_functional_flatten_dropout_inplace_gives_pool_and_dropout_records():
    torch.manual_seed(0)
    m, x = FlattenDropout(), torch.randn(4, 3, 2, 2, requires_grad=True)
    with gt.tap(m) as t:
        m(x).sum().backward()
    drop = t.find("drop")[0]
    pool = t.find("pool")[0]
    assert drop.grad_inputs["input"] is not None
    torch.testing.assert_close(drop.grad_inputs["input"].reshape(4, 3, 1, 1),
                               pool.grad_outputs["output"])


def test_output_modified_in_place_inside_parent_keeps_first_value_gradient():
    """``y.mul_(2)`` right after the call: grad_outputs is w.r.t. the value returned."""
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    with gt.tap(lin, select="") as t:
        y = lin(x)
        y.mul_(2)
        y.sum().backward()
    torch.testing.assert_close(t.records[0].grad_outputs["output"], torch.full((2, 3), 2.0))


def test_second_path_alias_refuses_in_place_and_parent_records_stay_right():
    """The alias of a second output path cannot be modified in place (autograd says so), and a
    parent that returns it again gets its own boundary gradient (SuperPoint's encoder inside
    the keypoint model)."""
    enc = Encoder()
    x = torch.randn(2, 3, requires_grad=True)
    with gt.tap(enc, select=""):
        out = enc(x)
        with pytest.raises(RuntimeError, match="inplace"):
            out["hidden_states"][1].mul_(2)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = Encoder()

        def forward(self, x):
            out = self.enc(x)
            return torch.tanh(out["last_hidden_state"]), out["hidden_states"][1]

    m = Outer()
    check_against_oracle(m, lambda: (lambda a, b: (a * 2 + b ** 2).sum())(*m(x)))


def test_view_of_an_earlier_tensor_later_uses_of_the_base_count_within_the_view():
    """Documented: for a call returning a view of a tensor made before it, later uses of that
    tensor within the view count as uses of the output; outside the view they do not."""
    s = Slice()
    x = torch.randn(2, 5, requires_grad=True)
    with gt.tap(s, select="") as t:
        h = x * 1.0
        y = s(h)
        (2 * y.sum() + (3 * h).sum()).backward()
    go = t.records[0].grad_outputs["output"]
    torch.testing.assert_close(go, torch.full((2, 3), 5.0))  # 2 from y, 3 from h's region
    torch.testing.assert_close(x.grad, torch.cat([torch.full((2, 3), 5.0),
                                                  torch.full((2, 2), 3.0)], 1))
