"""The boundary oracle (``boundary.py``) checked on its own, before it judges gradtap.

* On every zoo model: the instrumented forward computes the same loss, the root's
  ``param_grads`` are ``p.grad``, it sees every module call a plain forward hook sees, and the
  contribution of each call equals its VJP through the outputs except where a model has a
  known side channel.
* On leaf modules of zoo models: ``grad_outputs`` and positional ``grad_inputs`` equal what
  ``register_full_backward_hook`` reports (on the models where that hook can run).
* On hand-written models: hand-derived answers for the cases the records contract settles
  (an output also used inside the call, one tensor under two output paths, in-place changes
  after the call on a view and on a pass-through output, one tensor passed as two arguments,
  an argument changed in place by the call, tied weights used by several calls, activation
  checkpointing, a side channel).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.models import zoo
from tests.models.boundary import boundary_oracle

pytestmark = pytest.mark.models

# Calls whose intermediate tensors reach the loss other than through their return value:
# Hugging Face collects BERT's hidden states with forward hooks on its layers, so the
# encoder's layer outputs leave the encoder call through the hooks.
SIDE_CHANNELS = {"bert": {"encoder"}}


# Below this fraction of the model's largest gradient element, a difference is rounding noise:
# a gradient that is 0 in exact arithmetic comes out as float32 noise whose value depends on
# the order autograd sums its terms in, which the oracle's extra nodes can change (torchvision's
# LRASPP: a BatchNorm bias whose shift the next train-mode BatchNorm removes gets 1.4e-8 on
# a scale of 0.43, 3e-17 in float64).
NOISE = 1e-6


def close(a: Tensor | None, b: Tensor | None, scale: float = 0.0) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(
        ((a - b).abs() <= 1e-5 * b.abs().max() + NOISE * scale + 1e-30).all())


def run_of(name: str, model: nn.Module, inputs: dict):
    def run() -> Tensor:
        torch.manual_seed(0)
        return zoo.run(name, model, inputs)
    return run


@pytest.mark.parametrize("name", zoo.params())
def test_oracle_is_the_plain_model_with_named_gradients(name):
    model = zoo.build(name)
    inputs = zoo.make_inputs(name)
    run = run_of(name, model, inputs)
    seen: dict[str, int] = {}
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: seen.__setitem__(n, seen.get(n, 0) + 1))
               for n, m in model.named_modules()]
    loss = run()
    for h in handles:
        h.remove()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in grads.values())
    model.zero_grad(set_to_none=True)

    oracle = boundary_oracle(model, run)
    assert oracle.loss.item() == pytest.approx(loss.item(), rel=1e-6)
    assert {n: len(oracle.of(n)) for n in seen} == seen
    assert all(p.grad is None for p in model.parameters()), "the oracle must not touch .grad"
    (root,) = oracle.of("")
    for n, _ in model.named_parameters():
        assert close(root.param_grads[n], grads.get(n), scale), n
    for call in oracle.calls:
        agree = all(close(call.vjp_inputs[k], g, scale) for k, g in call.grad_inputs.items()) \
            and all(close(call.vjp_params[k], g, scale) for k, g in call.param_grads.items())
        assert agree == (call.name not in SIDE_CHANNELS.get(name, ())), (call.name, call.index)
    # Nothing left behind.
    assert all("forward" not in vars(m) for m in model.modules())
    assert all(not m._forward_pre_hooks for m in model.modules())


# Models on which register_full_backward_hook can run on every leaf (elsewhere an in-place op
# after a leaf module trips its view check).
FULL_HOOK_MODELS = ["gpt2", "bert", "albert", "t5", "bart", "llama", "mamba", "vit", "convnext",
                    "swin", "wav2vec2", "hubert", "whisper", "torchvision_vit", "torchvision_swin",
                    "torchvision_maxvit"]
FULL_HOOK_PARAMS = [p for p in zoo.params() if p.values[0] in FULL_HOOK_MODELS]
assert len(FULL_HOOK_PARAMS) == len(FULL_HOOK_MODELS), "a name not in the zoo"


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("name", FULL_HOOK_PARAMS)
def test_oracle_agrees_with_the_full_backward_hook_on_leaf_modules(name):
    model = zoo.build(name)
    inputs = zoo.make_inputs(name)
    run = run_of(name, model, inputs)
    leaves = {n: m for n, m in model.named_modules() if next(m.children(), None) is None}
    calls: dict[str, list] = {n: [] for n in leaves}
    shapes: dict[str, bool] = {}

    def forward_hook(n):
        def hook(mod, args, kwargs, out):
            # Only calls with positional tensor arguments and one tensor output are comparable.
            shapes[n] = shapes.get(n, True) and not kwargs and isinstance(out, Tensor) \
                and all(isinstance(a, Tensor) for a in args)
        return hook

    def backward_hook(n):
        def hook(mod, grad_input, grad_output):
            calls[n].append((grad_input, grad_output))
        return hook

    handles = []
    for n, m in leaves.items():
        handles.append(m.register_forward_hook(forward_hook(n), with_kwargs=True))
        handles.append(m.register_full_backward_hook(backward_hook(n)))
    try:
        run().backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    oracle = boundary_oracle(model, run)
    compared = 0
    for n in leaves:
        mine = oracle.of(n)
        if len(mine) != 1 or not shapes.get(n) or not mine[0].reached:
            continue
        (call,) = mine
        if not calls[n]:
            # torch's hook waits for the gradient of an input that requires grad; it never
            # fires when the output does not depend on it (BART's position embedding reads
            # only its input's shape).
            assert all(g is None for g in call.grad_inputs.values()), n
            continue
        assert len(calls[n]) == 1, n
        grad_input, grad_output = calls[n][0]
        assert close(call.grad_outputs["output"], grad_output[0]), n
        for key, g in zip(call.input_keys, grad_input):
            assert close(call.grad_inputs[key], g), (n, key)
        compared += 1
    assert compared >= 5, f"{name}: only {compared} leaf calls compared"


# -- hand-written models with known answers ----------------------------------------------------


class SelfLoss(nn.Module):
    """Computes its own loss from the logits it also returns."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        logits = self.lin(x)
        return (logits ** 2).sum(), logits


@pytest.mark.parametrize("later", [0.0, 3.0])
def test_an_output_also_used_inside_the_call_gets_only_the_later_uses(later):
    torch.manual_seed(0)
    m = SelfLoss()
    x = torch.randn(2, 3, requires_grad=True)

    def run():
        loss, logits = m(x)
        return loss + later * logits.sum() if later else loss

    (call,) = boundary_oracle(m, run).of("")
    assert torch.equal(call.grad_outputs["0"], torch.tensor(1.0))
    if later:
        assert torch.equal(call.grad_outputs["1"], torch.full((2, 3), later))
    else:
        assert call.grad_outputs["1"] is None
    # The call's own uses count in the VJP through output 0.
    logits = m.lin(x)
    expected = torch.autograd.grad((logits ** 2).sum() + later * logits.sum(), [x, m.lin.weight])
    assert torch.allclose(call.grad_inputs["x"], expected[0])
    assert torch.allclose(call.param_grads["lin.weight"], expected[1])
    # register_full_backward_hook agrees.
    seen = {}
    h = m.register_full_backward_hook(lambda mod, gi, go: seen.update(gi=gi, go=go))
    run().backward()
    h.remove()
    assert close(call.grad_outputs["1"], seen["go"][1]) and close(call.grad_inputs["x"], seen["gi"][0])


class TwoPaths(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        return {"last_hidden_state": h, "hidden_states": (x, h)}


def test_one_tensor_under_two_output_paths_gets_each_paths_gradient():
    torch.manual_seed(0)
    m, x = TwoPaths(), torch.randn(2, 3, requires_grad=True)

    def run():
        out = m(x)
        return 2 * out["last_hidden_state"].sum() + 5 * out["hidden_states"][1].sum()

    (call,) = boundary_oracle(m, run).of("")
    assert torch.equal(call.grad_outputs["last_hidden_state"], torch.full((2, 3), 2.0))
    assert torch.equal(call.grad_outputs["hidden_states.1"], torch.full((2, 3), 5.0))
    assert call.grad_outputs["hidden_states.0"] is None  # x itself, unused later
    assert torch.allclose(call.param_grads["lin.bias"], torch.full((3,), 14.0))


def test_in_place_changes_after_the_call_leave_the_returned_value_s_gradient():
    torch.manual_seed(0)
    # nn.Linear on a 4-D input returns a view; ReLU(inplace=True) then overwrites it.
    net = nn.Sequential(nn.Linear(2, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    x = torch.randn(1, 3, 3, 2)
    oracle = boundary_oracle(net, lambda: net(x).sum())
    h = net[0](x)
    h.retain_grad()
    net[2](torch.relu(h)).sum().backward()  # the same function, out of place
    (lin,), (relu,) = oracle.of("0"), oracle.of("1")
    assert torch.allclose(lin.grad_outputs["output"], h.grad)
    assert torch.allclose(relu.grad_inputs["input"], h.grad)

    # A pass-through output (nn.Identity) modified by `+=` afterwards.
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(4, 4), nn.Identity()

        def forward(self, x):
            return self.act(self.lin(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Layer()

        def forward(self, x):
            h = self.layer(x)
            h += x
            return h.relu()

    block, x = Block(), torch.randn(2, 4)
    oracle = boundary_oracle(block, lambda: (block(x) ** 2).sum())
    h = block.layer.lin(x)
    h.retain_grad()
    ((h + x).relu() ** 2).sum().backward()
    for name in ("layer", "layer.act", "layer.lin"):
        (call,) = oracle.of(name)
        assert torch.allclose(call.grad_outputs["output"], h.grad), name


def test_one_tensor_passed_as_two_arguments_and_an_argument_changed_in_place():
    class Mul(nn.Module):
        def forward(self, a, b):
            return a * b.sin()

    m = nn.ModuleDict({"mul": Mul(), "act": nn.ReLU(inplace=True)})
    x = torch.randn(5, requires_grad=True)

    def run():
        y = m["mul"](x, x)
        z = m["act"](y * 1.0)  # changes its argument in place
        return (z * torch.arange(5.0)).sum()

    oracle = boundary_oracle(m, run)
    (mul,), (act,) = oracle.of("mul"), oracle.of("act")
    y = x * x.sin()
    g = torch.arange(5.0) * (y > 0)
    assert torch.allclose(act.grad_inputs["input"], g)
    assert torch.allclose(mul.grad_inputs["a"], g * x.sin())
    assert torch.allclose(mul.grad_inputs["b"], g * x * x.cos())


class Tied(nn.Module):
    """One Linear called twice; its weight is also held by a child of another module."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, bias=False)
        self.head = nn.Sequential(nn.Linear(3, 3, bias=False))
        self.head[0].weight = self.lin.weight

    def forward(self, x):
        return self.head(torch.tanh(self.lin(self.lin(x))))


def test_tied_weights_used_by_several_calls_are_attributed_per_call():
    torch.manual_seed(0)
    m, x = Tied(), torch.randn(4, 3)
    w = m.lin.weight
    oracle = boundary_oracle(m, lambda: m(x).pow(2).sum())
    # Untied twin: one copy of the weight per use.
    w1, w2, w3 = (w.detach().clone().requires_grad_() for _ in range(3))
    (torch.tanh(x @ w1.T @ w2.T) @ w3.T).pow(2).sum().backward()
    lin0, lin1 = oracle.of("lin")
    assert torch.allclose(lin0.param_grads["weight"], w1.grad)
    assert torch.allclose(lin1.param_grads["weight"], w2.grad)
    (head,), (head0,), (root,) = oracle.of("head"), oracle.of("head.0"), oracle.of("")
    assert torch.allclose(head.param_grads["0.weight"], w3.grad)
    assert torch.allclose(head0.param_grads["weight"], w3.grad)
    assert list(root.param_grads) == ["lin.weight"]
    assert torch.allclose(root.param_grads["lin.weight"], w1.grad + w2.grad + w3.grad)
    assert [c.outermost for c in (lin0, lin1, head, head0)] == [True, True, True, False]


class Checkpointed(nn.Module):
    def __init__(self, use_checkpoint: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3))
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.use_checkpoint else b(x)
        return x


def test_activation_checkpointing_changes_nothing_and_adds_no_calls():
    torch.manual_seed(0)
    plain = Checkpointed(False)
    ckpt = Checkpointed(True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 4)
    a = boundary_oracle(plain, lambda: plain(x).pow(2).sum())
    b = boundary_oracle(ckpt, lambda: ckpt(x).pow(2).sum())
    assert [(c.name, c.index) for c in a.calls] == [(c.name, c.index) for c in b.calls]
    for ca, cb in zip(a.calls, b.calls):
        for slots in ("grad_outputs", "grad_inputs", "param_grads"):
            sa, sb = getattr(ca, slots), getattr(cb, slots)
            assert sa.keys() == sb.keys()
            assert all(close(sb[k], sa[k]) for k in sa), (ca.name, slots)


def test_a_side_channel_counts_in_the_contribution_not_in_the_vjp():
    torch.manual_seed(0)
    captured: list[Tensor] = []
    enc = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    model = nn.ModuleDict({"enc": enc})
    handle = enc[0].register_forward_hook(lambda mod, a, out: captured.append(out))
    x = torch.randn(2, 3)

    def run():
        captured.clear()
        return model["enc"](x).sum() + 7 * captured[0].sum()

    oracle = boundary_oracle(model, run)
    (call,) = oracle.of("enc")
    # Contribution: all of enc's uses of its parameters, the hook's path included.
    total = torch.autograd.grad(run(), enc[0].bias)[0]
    handle.remove()
    assert torch.allclose(call.param_grads["0.bias"], total)
    # VJP through enc's output only: without the captured path.
    h = torch.tanh(enc[0](x))
    vjp = torch.autograd.grad(enc[2](h).sum(), enc[0].bias)[0]
    assert torch.allclose(call.vjp_params["0.bias"], vjp)
    assert not torch.allclose(vjp, total)
    # The captured tensor is enc.0's output, used after enc.0 returned.
    (first,) = oracle.of("enc.0")
    assert torch.allclose(first.grad_outputs["output"],
                          7 + F.linear(torch.ones(2, 3), enc[2].weight.T) * (1 - h ** 2))
