"""gt.tap against an independent oracle (tests/_oracle.py) on layers and real-model patterns."""

from __future__ import annotations

import copy
import gc
import pickle
import resource
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradtap as gt
from gradtap.capture import Listener, compat, graph_nodes, saved_tensors
from tests._models import ResNetLike, assert_no_hooks
from tests._oracle import assert_close_or_none, oracle_calls


@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def check_against_oracle(model: nn.Module, run, names: list[str] | None = None,
                         checked: list[str] | None = None) -> gt.Tap:
    """Tap every module, the root included (or ``names``), then compare each record (of the
    modules in ``checked`` where given) with the oracle run."""
    torch.manual_seed(0)
    with gt.tap(model, select=names or (lambda name, module: True)) as t:
        run().backward()
    assert t.records, "no records"
    for name in checked or t.names:
        expected = oracle_calls(model, name, run)
        got = t.find(name)
        assert len(got) == len(expected), (
            f"{name}: {len(got)} records, oracle {len(expected)} calls"
        )
        for rec, exp in zip(got, expected):
            where = f"{name} call {rec.call}"
            assert set(rec.param_grads) == set(exp["param_names"]), where
            for key, g in exp["grad_inputs"].items():
                assert key in rec.grad_inputs, (
                    f"{where}: input {key!r} missing in {list(rec.grad_inputs)}"
                )
                assert_close_or_none(rec.grad_inputs[key], g, f"{where} grad_inputs[{key!r}]")
            for key, g in rec.grad_inputs.items():
                if key not in exp["grad_inputs"]:
                    assert g is None, f"{where}: unexpected gradient for input {key!r}"
            assert set(rec.grad_outputs) == set(exp["grad_outputs"]) | {
                k for k, v in rec.grad_outputs.items() if v is None
            }, where
            for key, g in exp["grad_outputs"].items():
                assert_close_or_none(rec.grad_outputs[key], g, f"{where} grad_outputs[{key!r}]")
            for key in rec.param_grads:
                assert_close_or_none(
                    rec.param_grads[key],
                    exp["param_grads"].get(key),
                    f"{where} param_grads[{key!r}]",
                )
    assert_no_hooks(model)
    return t


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_tap_changes_nothing(model: nn.Module, run, exact: bool = True) -> None:
    """p.grad with a tap attached equals p.grad without one, bit for bit (or to float64
    rounding where ``exact=False``)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    run().backward()
    plain = grads_of(model)
    model.zero_grad(set_to_none=True)
    with gt.tap(model, select=lambda name, module: True, keep=("inputs", "outputs")):
        torch.manual_seed(1)
        run().backward()
    tapped = grads_of(model)
    model.zero_grad(set_to_none=True)
    assert plain.keys() == tapped.keys()
    for n in plain:
        if exact:
            assert torch.equal(plain[n], tapped[n]), f"{n} changed by the tap"
        else:
            torch.testing.assert_close(plain[n], tapped[n], atol=1e-13, rtol=1e-12)


def assert_calls_sum_to_grad(t: gt.Tap, model: nn.Module) -> None:
    """For every parameter, the per-call contributions of its owner module sum to p.grad."""
    owners = {
        id(p): (mod_name, p_name)
        for mod_name, mod in model.named_modules()
        for p_name, p in mod.named_parameters(recurse=False)
    }
    for full, p in model.named_parameters():
        mod_name, p_name = owners[id(p)]
        if mod_name not in t.names or p.grad is None:
            continue
        parts = [
            r.param_grads[p_name] for r in t.find(mod_name) if r.param_grads[p_name] is not None
        ]
        torch.testing.assert_close(sum(parts), p.grad, atol=1e-12, rtol=1e-10, msg=full)


# -- single layers ------------------------------------------------------------------------

LAYERS = {
    "linear": (lambda: nn.Linear(5, 3), lambda: torch.randn(4, 5, requires_grad=True)),
    "linear_seq": (lambda: nn.Linear(5, 3), lambda: torch.randn(2, 6, 5, requires_grad=True)),
    "conv1d": (
        lambda: nn.Conv1d(2, 3, 3, stride=2),
        lambda: torch.randn(2, 2, 9, requires_grad=True),
    ),
    "conv2d": (
        lambda: nn.Conv2d(2, 4, 3, padding=1, groups=2),
        lambda: torch.randn(2, 2, 6, 5, requires_grad=True),
    ),
    "conv3d": (lambda: nn.Conv3d(1, 2, 2), lambda: torch.randn(2, 1, 4, 4, 3, requires_grad=True)),
    "convT2d": (
        lambda: nn.ConvTranspose2d(3, 2, 3, stride=2, output_padding=1),
        lambda: torch.randn(2, 3, 4, 4, requires_grad=True),
    ),
    "batchnorm2d": (lambda: nn.BatchNorm2d(3), lambda: torch.randn(4, 3, 5, 5, requires_grad=True)),
    "layernorm": (lambda: nn.LayerNorm(6), lambda: torch.randn(3, 4, 6, requires_grad=True)),
}


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_layer_records_match_oracle(kind, device):
    make_module, make_input = LAYERS[kind]
    torch.manual_seed(0)
    layer = make_module().to(device)
    x = make_input().detach().to(device).requires_grad_()
    weight = torch.randn_like(layer(x))

    def run():
        return (layer(x) * weight).sum()

    t = check_against_oracle(layer, run, names=[""])
    rec = t.records[0]
    assert rec.module_type == type(layer).__name__ and rec.call == 0
    assert set(rec.grad_inputs) == {"input"} and set(rec.grad_outputs) == {"output"}
    # Bit for bit on CPU; GPU kernels (cuDNN's weight gradients) may sum in another order on
    # each run, so there the comparison is to float64 rounding.
    assert_tap_changes_nothing(layer, run, exact=device.type == "cpu")


def test_first_layer_records_without_input_grad():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    x = torch.randn(2, 1, 6, 6)  # does not require grad

    def run():
        return net(x).pow(2).sum()

    t = check_against_oracle(net, run)
    first = t.find("0")[0]
    assert first.grad_inputs == {"input": None}
    assert first.param_grads["weight"] is not None


def test_embedding_records():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, padding_idx=0)
    idx = torch.tensor([[1, 2, 0], [3, 3, 9]])
    w = torch.randn(2, 3, 4)
    t = check_against_oracle(emb, lambda: (emb(idx) * w).sum(), names=[""])
    assert t.records[0].grad_inputs == {"input": None}


def test_multihead_attention_keyword_inputs_and_tuple_output():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    q = torch.randn(2, 3, 8, requires_grad=True)
    kv = torch.randn(2, 5, 8, requires_grad=True)
    wq = torch.randn(2, 3, 8)

    def run():
        out, weights = mha(query=q, key=kv, value=kv, need_weights=True)
        return (out * wq).sum() + weights.pow(2).sum()

    t = check_against_oracle(mha, run, names=[""])
    rec = t.records[0]
    assert {"query", "key", "value"} <= set(rec.grad_inputs)
    assert set(rec.grad_outputs) == {"0", "1"}
    # key and value are the same tensor passed twice: each entry is its own argument's share.
    assert not torch.allclose(rec.grad_inputs["key"], rec.grad_inputs["value"])
    assert (
        rec.param_grads["out_proj.weight"] is not None
    )  # used functionally, not by calling out_proj
    # Giving `value` its own alias makes MultiheadAttention see `key is not value` and take its
    # general (unpacked) projection path: same math, different rounding.
    assert_tap_changes_nothing(mha, run, exact=False)
    distinct = torch.randn(2, 5, 8, requires_grad=True)
    assert_tap_changes_nothing(mha, lambda: mha(q, kv, distinct)[0].sum())


def test_lstm_tuple_output():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 5, num_layers=2, batch_first=True)
    x = torch.randn(3, 6, 4, requires_grad=True)
    h0 = (torch.randn(2, 3, 5, requires_grad=True), torch.randn(2, 3, 5))

    def run():
        out, (h, c) = lstm(x, h0)
        return out.pow(2).sum() + h.sum() + 2 * c.sum()

    t = check_against_oracle(lstm, run, names=[""])
    rec = t.records[0]
    assert set(rec.grad_outputs) == {"0", "1.0", "1.1"}
    assert set(rec.grad_inputs) == {"input", "hx.0", "hx.1"}
    assert rec.grad_inputs["hx.1"] is None
    assert_tap_changes_nothing(lstm, run)


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 4)

    def forward(self, x):
        return {"logits": self.a(x), "extra": {"hidden": [self.b(x), x.shape[0]]}}


def test_module_returning_nested_dict():
    torch.manual_seed(0)
    m = DictOut()
    x = torch.randn(5, 3, requires_grad=True)

    def run():
        out = m(x)
        return out["logits"].sum() + out["extra"]["hidden"][0].pow(2).sum()

    t = check_against_oracle(m, run)
    assert set(t.find("")[0].grad_outputs) == {"logits", "extra.hidden.0"}


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(self.fc(x))
        return self.out(x)


def test_module_called_several_times():
    torch.manual_seed(0)
    m = Shared()
    x = torch.randn(6, 4)
    t = check_against_oracle(m, lambda: m(x).pow(2).sum())
    assert [r.call for r in t.find("fc")] == [0, 1, 2]
    assert_calls_sum_to_grad(t, m)
    assert_tap_changes_nothing(m, lambda: m(x).pow(2).sum())


def test_records_in_backward_completion_order():
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    with gt.tap(net) as t:
        net(torch.randn(2, 3)).sum().backward()
    assert [r.module_name for r in t.records] == ["2", "1", "0"]


# -- real-model patterns --------------------------------------------------------------------


class ConvBlock(nn.Module):
    """conv -> bn, residual added in place, masked in-place write, in-place dropout and ReLU,
    an Identity, and a layer scale owned by the block itself."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.relu = nn.ReLU(inplace=True)
        self.ident = nn.Identity()
        self.drop = nn.Dropout(0.5, inplace=True)
        self.scale = nn.Parameter(torch.full((3, 1, 1), 0.5))  # a layer scale on a non-leaf module

    def forward(self, x):
        h = self.bn(self.conv(x))
        h += x  # in place on a tapped module's output
        h[:, 0] = 0.0  # masked in-place write on a tapped module's output
        h = self.relu(self.drop(h))
        return self.ident(h) * self.scale


def test_in_place_patterns_block():
    torch.manual_seed(0)
    block = ConvBlock()
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    w = torch.randn(2, 3, 5, 5)

    def run():
        torch.manual_seed(3)  # same dropout mask in every run
        return (block(x) * w).sum()

    t = check_against_oracle(block, run)
    ident = t.find("ident")[0]
    assert torch.equal(ident.grad_inputs["input"], ident.grad_outputs["output"])
    assert t.find("")[0].param_grads["scale"] is not None
    assert_calls_sum_to_grad(t, block)
    assert_tap_changes_nothing(block, run)


class TinyViT(nn.Module):
    """Class token owned by the root, tied embedding/head weights, a frozen layer, and a
    weight used functionally without calling its module."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 6))
        self.emb = nn.Embedding(11, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.GELU())
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.side = nn.Linear(6, 6)  # only its weight is used, through F.linear
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):
        x = self.emb(idx)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.body(x) + F.linear(x, self.side.weight)
        return self.head(self.frozen(x))


def test_tied_frozen_class_token_and_functional_weights():
    torch.manual_seed(0)
    m = TinyViT()
    idx = torch.randint(0, 11, (2, 4))
    t = check_against_oracle(m, lambda: m(idx).logsumexp(-1).sum())
    root = t.find("")[0]
    assert root.param_grads["cls"] is not None
    assert root.param_grads["side.weight"] is not None and root.param_grads["side.bias"] is None
    assert t.find("side") == []  # never called, so no record of its own
    assert t.find("frozen")[0].param_grads == {"weight": None, "bias": None}
    tied = t.find("emb")[0].param_grads["weight"] + t.find("head")[0].param_grads["weight"]
    torch.testing.assert_close(tied, m.emb.weight.grad)
    assert_tap_changes_nothing(m, lambda: m(idx).logsumexp(-1).sum())


def test_resnet_like_every_module():
    torch.manual_seed(0)
    net = ResNetLike(width=4, num_classes=5).double()
    x = torch.randn(2, 3, 16, 16)
    y = torch.tensor([1, 3])

    def run():
        return F.cross_entropy(net(x), y)

    t = check_against_oracle(net, run)
    assert len(t.names) > 40
    net.zero_grad(set_to_none=True)
    with gt.tap(net) as t2:
        run().backward()
    assert_calls_sum_to_grad(t2, net)
    assert_tap_changes_nothing(net, run)


def test_nested_selection_parent_is_sum_of_children():
    torch.manual_seed(0)
    net = ResNetLike(width=4, num_classes=5).double()
    x = torch.randn(2, 3, 16, 16)
    with gt.tap(net, select=["layer1.0", "layer1.0.*"]) as t:
        net(x).sum().backward()
    block = t.find("layer1.0")[0]
    for name, g in block.param_grads.items():
        child, p_name = name.rsplit(".", 1)
        torch.testing.assert_close(g, t.find(f"layer1.0.{child}")[0].param_grads[p_name])


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(checkpoint(self.inner, x, use_reentrant=False))


def test_activation_checkpointing_adds_no_duplicates():
    torch.manual_seed(0)
    m = Checkpointed()
    x = torch.randn(3, 4, requires_grad=True)
    t = check_against_oracle(m, lambda: m(x).pow(2).sum())
    assert sorted(r.module_name for r in t.records) == sorted(t.names)


class CheckpointedSelfAttention(nn.Module):
    """``attn(h, h, h)`` inside a non-reentrant checkpoint: the tap aliases the repeated
    argument, and the recomputation in backward must do the same."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        a = checkpoint(lambda h: self.attn(h, h, h, need_weights=False)[0], x,
                       use_reentrant=False)
        return self.out(a)


def test_checkpoint_recomputes_a_call_with_a_repeated_argument_as_the_forward_did():
    torch.manual_seed(0)
    m = CheckpointedSelfAttention()
    x = torch.randn(2, 5, 8, requires_grad=True)
    with gt.tap(m, select=["attn", "out"]) as t:
        m(x).pow(2).sum().backward()
    (rec,) = t.find("attn")
    # Oracle: torch.autograd.grad at the call's boundary, without a tap.
    params = dict(m.attn.named_parameters())
    y = m(x)
    grads = torch.autograd.grad(y.pow(2).sum(), [x, *params.values()])
    torch.testing.assert_close(rec.grad_inputs["query"] + rec.grad_inputs["key"]
                               + rec.grad_inputs["value"], grads[0])
    for (name, _), g in zip(params.items(), grads[1:], strict=True):
        torch.testing.assert_close(rec.param_grads[name], g, msg=name)
    torch.testing.assert_close(t.find("out")[0].grad_outputs["output"], 2 * y.detach())


def test_create_graph_and_double_backward():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, 3)
    params = list(net.parameters())
    with gt.tap(net) as t:
        grads = torch.autograd.grad(net(x).pow(2).sum(), params, create_graph=True)
        first = list(t.records)
        penalty = sum(g.pow(2).sum() for g in grads)
        penalty.backward()
    for rec in first:
        assert all(g is None or not g.requires_grad for g in rec.param_grads.values())
    ref = torch.autograd.grad(net(x).pow(2).sum(), params, create_graph=True)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g, torch.autograd.grad(net(x).pow(2).sum(), p)[0])
    expected = torch.autograd.grad(sum(g.pow(2).sum() for g in ref), params)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e)
    assert first[-1].module_name == "0"


# -- keep, to, clear, removal and hygiene --------------------------------------------------


def test_keep_inputs_outputs_and_to():
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True))
    x = torch.randn(4, 3)
    with gt.tap(net, keep=("inputs", "outputs"), to="cpu") as t:
        net(x).sum().backward()
    lin, relu = t.find("0")[0], t.find("1")[0]
    torch.testing.assert_close(lin.inputs["input"], x)
    # The in-place ReLU overwrote its input; the kept input is the value before the call.
    torch.testing.assert_close(
        relu.inputs["input"], lin.outputs["output"].clamp(min=0) * 0 + relu.inputs["input"]
    )
    assert (relu.inputs["input"] < 0).any() and (relu.outputs["output"] >= 0).all()
    assert all(not v.requires_grad for v in lin.inputs.values())
    with gt.tap(net) as t2:
        net(x).sum().backward()
    assert t2.records[0].inputs == {} and t2.records[0].outputs == {}


def test_clear_restarts_call_counts():
    net = nn.Linear(2, 2)
    with gt.tap(net, select="") as t:
        net(torch.randn(1, 2)).sum().backward()
        net(torch.randn(1, 2)).sum().backward()
        assert [r.call for r in t.records] == [0, 1]
        t.clear()
        assert t.records == []
        net(torch.randn(1, 2)).sum().backward()
        assert [r.call for r in t.records] == [0]


def test_hygiene_after_exit_remove_and_exception():
    net = ResNetLike(width=4, num_classes=3)
    state = copy.deepcopy(net.state_dict())
    x = torch.randn(2, 3, 16, 16)
    with gt.tap(net, keep=("inputs",)):
        net(x).sum().backward()
    assert_no_hooks(net)
    t = gt.tap(net)
    t.remove()
    t.remove()
    assert_no_hooks(net)
    with pytest.raises(RuntimeError, match="boom"):
        with gt.tap(net):
            net(x)
            raise RuntimeError("boom")
    assert_no_hooks(net)
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[k]) or k.endswith(
            ("running_mean", "running_var", "num_batches_tracked")
        )
    pickle.dumps(net)


def test_exception_inside_forward_leaves_no_open_call():
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("bad input")

    net = nn.Sequential(nn.Linear(2, 2), Boom())
    with gt.tap(net) as t:
        with pytest.raises(ValueError, match="bad input"):
            net(torch.randn(1, 2))
        out = net[0](torch.randn(1, 2)).sum()
        out.backward()
    assert [r.call for r in t.find("0")] == [1]


def test_graph_kept_alive_after_removal_records_nothing():
    net = nn.Linear(2, 1)
    t = gt.tap(net, select="")
    loss = net(torch.randn(3, 2)).sum()
    t.remove()
    loss.backward()
    assert t.records == []


def _records_alive() -> int:
    return sum(type(o) is gt.GradRecord for o in gc.get_objects())


def test_memory_flat_over_many_steps():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(64, 256)  # one step keeps ~0.5 MB of tensors in its records
    refs = []
    # Records other tests left reachable (a docs example's namespace held by a cache of forward
    # functions, say) are not this tap's: count the ones alive beyond those.
    gc.collect()
    records_before = _records_alive()
    with gt.tap(net, keep=("inputs", "outputs")) as t:
        for step in range(1000):
            net(x).sum().backward()
            if step % 100 == 0:
                refs.append(weakref.ref(t.records[0].grad_outputs["output"]))
            if step == 100:
                peak_after_warmup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
            t.clear()
            net.zero_grad(set_to_none=True)
        growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_after_warmup) / 1024
        gc.collect()
        alive = sum(r() is not None for r in refs)
        objects = _records_alive() - records_before
    assert alive == 0, f"{alive} gradients from cleared steps are still alive"
    assert objects == 0, f"{objects} records of cleared steps are still alive"
    # 900 more steps would add ~450 MB if records leaked; allow allocator noise only.
    assert growth_mib < 16, f"peak memory grew by {growth_mib:.1f} MiB over 900 steps"


# -- errors ---------------------------------------------------------------------------------


def test_bad_arguments():
    net = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="keep= accepts 'inputs' and 'outputs'"):
        gt.tap(net, keep=("grads",))
    with pytest.raises(gt.SelectionError, match="select='1' matches no module; module names: 0"):
        gt.tap(net, select="1")
    with pytest.raises(TypeError, match="needs an nn.Module"):
        gt.tap(lambda x: x)
    with gt.tap(net) as t:
        with pytest.raises(KeyError, match="not a tapped module"):
            t.find("missing")
    assert_no_hooks(net)


def test_rewrite_shape_mismatch_names_the_module():
    class FirstRow(Listener):
        def rewrite_grad_output(self, name, call, path, grad):
            return grad[:1]

    net = nn.Sequential(nn.Linear(2, 3))
    with gt.tap(net, listener=FirstRow()):
        with pytest.raises(
            ValueError, match=r"rewrite of grad_output 'output' of '0' returned shape \(1, 3\)"
        ):
            net(torch.randn(2, 2)).sum().backward()
    assert_no_hooks(net)


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, first, *args, scale=None, **extra):
        out = self.lin(first) * scale
        for i, a in enumerate(args):
            out = out + (i + 1) * a
        return out + extra["bias_term"].sum()


def test_varargs_and_kwargs_naming():
    torch.manual_seed(0)
    m = VarArgs()
    a, b, c = (torch.randn(2, 3, requires_grad=True) for _ in range(3))
    s = torch.randn(2, 3, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    t = check_against_oracle(m, lambda: m(a, b, c, scale=s, bias_term=bias).pow(2).sum(), names=[""])
    assert set(t.records[0].grad_inputs) == {"first", "args.0", "args.1", "scale", "bias_term"}


def test_a_forward_assigned_to_a_module_is_named_and_not_kept_alive():
    # A forward set on one instance (a closure over it, as a wrapper or a patch makes) is
    # named by its own signature, and tapping it keeps neither it nor the module alive.
    import gc
    import weakref

    def make() -> nn.Module:
        m = nn.Linear(3, 3)

        def forward(inp, gain=2.0):
            return nn.Linear.forward(m, inp) * gain

        m.forward = forward
        return m

    m = make()
    x = torch.randn(2, 3, requires_grad=True)
    with gt.tap(m, "") as t:
        m(x).sum().backward()
    assert set(t.records[0].grad_inputs) == {"inp"}
    torch.testing.assert_close(t.records[0].grad_inputs["inp"], x.grad)
    alive = weakref.ref(m)
    del m, t
    gc.collect()
    assert alive() is None


def test_no_records_under_no_grad():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with gt.tap(net) as t:
        with torch.no_grad():
            net(torch.randn(3, 2))
        out = net(torch.randn(3, 2))
        out.sum().backward()
    assert [r.call for r in t.find("0")] == [0]  # the no_grad call is not counted


def test_parameters_swapped_in_by_functional_call():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    with gt.tap(net) as t:
        torch.func.functional_call(net, params, (torch.randn(2, 3),)).sum().backward()
    for rec in t.records:
        for p_name, g in rec.param_grads.items():
            assert torch.equal(g, params[f"{rec.module_name}.{p_name}"].grad)
    assert all(p.grad is None for p in net.parameters())


def test_on_forward_gets_the_call_index_of_the_records():
    """A listener's on_forward sees each call with the index its record will carry, including calls that
    return None (they count as calls but have no backward, hence no record)."""

    class Sometimes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x, skip=False):
            return None if skip else self.lin(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Sometimes()

        def forward(self, x):
            a = self.block(x)
            self.block(x, skip=True)
            return self.block(a) * 2

    net = Net()
    seen = []

    class Calls(Listener):
        def on_forward(self, name, call, module, inputs, outputs):
            seen.append((name, call, module is net.block, sorted(outputs)))

    with gt.tap(net, "block", listener=Calls()) as t:
        net(torch.randn(2, 3)).sum().backward()
    assert seen == [("block", 0, True, ["output"]), ("block", 1, True, []),
                    ("block", 2, True, ["output"])]
    assert sorted(r.call for r in t.find("block")) == [0, 2]


# -- saved tensors (read back for detect's reports) ----------------------------------------


@pytest.mark.skipif(not compat.available("torch._C._autograd.SavedTensor.unpack_hook"),
                    reason="this torch's saved tensors do not say whether a hook is behind them; "
                    "then none is read (the fallback's test is in test_compat.py)")
def test_saved_tensors_reads_no_saved_tensor_behind_an_unpack_hook():
    runs = []

    def region(x: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        return x.sin().exp()

    torch.manual_seed(0)
    x = torch.randn(5, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False).tanh()
    saved = saved_tensors(graph_nodes([y]))
    assert runs == [1]  # nothing recomputed to read the checkpointed region
    assert list(saved) == [y.data_ptr()]  # tanh's own saved result, read as before
    assert torch.equal(saved[y.data_ptr()][0], y)
    y.sum().backward()  # the backward still finds every saved tensor, unpacked once
    assert runs == [1, 1]
    oracle = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(oracle.sin().exp().tanh().sum(), oracle)
    torch.testing.assert_close(x.grad, g)


def test_a_record_prints_shapes_dtypes_and_norms_not_values():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(300, 200))
    with gt.tap(net, select="0", keep="inputs") as t:
        net(torch.randn(64, 300)).sum().backward()
    rec = t.records[0]
    text = repr(rec)
    assert len(text.splitlines()) <= 6 and len(text) < 600, text
    norm, dtype = float(net[0].weight.grad.double().norm()), str(net[0].weight.dtype)[6:]
    assert f"weight: 200x300 {dtype} norm {norm:.4g}" in text, text
    assert f"inputs={{input: 64x300 {dtype} norm" in text
    html = rec._repr_html_()
    assert html.count("<tr>") == 1 + len(list(rec.slots())) and "200x300" in html
