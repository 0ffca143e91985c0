"""Per-sample gradients against torch.func (vmap(grad(functional_call))) in float64.

Rule tests draw modules and options with hypothesis for every type registered in
``_samples.rule.PER_SAMPLE`` (the cases come from the registry, so a new rule without a case
fails ``test_every_registered_type_has_a_case``). End-to-end tests compare ``gt.per_sample``
on whole models with the per-sample gradients of each sample's own loss term.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib
import pickle
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.utils import parametrizations, parametrize

import gradtap as gt
from gradtap._samples import rule, rules
from gradtap._samples.rule import PER_SAMPLE, PerSampleRule
from gradtap._samples.rules.conv import grad_conv, norm_conv
from gradtap._samples.rules.linear import norm_linear
from gradtap.errors import GradtapError, SelectionError, UnsupportedModuleError
from tests._models import assert_no_hooks

# The oracle's vmap warns about ops without a batching rule (it falls back to a loop).
pytestmark = [pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
              pytest.mark.usefixtures("float64_seeded")]

HYP = settings(max_examples=25, deadline=None, derandomize=True)
ALL = ("grad", "norm", "variance", "second_moment", "snr")


def close(actual: Tensor, expected: Tensor, what: str) -> None:
    """float64 comparison; every assertion in this file goes through here."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-9, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------------
# rule-level oracle and cases
# --------------------------------------------------------------------------------------------


def module_oracle(module: nn.Module, x: Tensor, go: Tensor) -> dict[str, Tensor]:
    """Per-sample gradients of <module(x_n), go_n> by vmap(grad(functional_call))."""
    if isinstance(module, _InstanceNorm) and module.training:
        # Training mode normalizes with instance statistics whether or not running ones are
        # tracked; vmap cannot update the unbatched running buffers in place, so drop them.
        module = copy.deepcopy(module)
        module.running_mean = module.running_var = None
    params = {k: v.detach() for k, v in module.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in module.named_buffers()}

    def f(p: dict[str, Tensor], xn: Tensor, gn: Tensor) -> Tensor:
        return (functional_call(module, (p, buffers), (xn.unsqueeze(0),)) * gn.unsqueeze(0)).sum()

    return vmap(grad(f), in_dims=(None, 0, 0))(params, x, go)


def _conv_case(cls: type[nn.Module], d: int, transposed: bool) -> st.SearchStrategy:
    @st.composite
    def build(draw: st.DrawFn) -> tuple[nn.Module, Tensor]:
        groups = draw(st.integers(1, 3))
        cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
        kernel = tuple(draw(st.integers(1, 3)) for _ in range(d))
        stride = tuple(draw(st.integers(1, 3)) for _ in range(d))
        dilation = tuple(draw(st.integers(1, 2)) for _ in range(d))
        kw: dict = {"groups": groups, "dilation": dilation, "bias": draw(st.booleans())}
        ext = [dl * (k - 1) + 1 for dl, k in zip(dilation, kernel, strict=True)]
        if transposed:
            pad = tuple(draw(st.integers(0, 1)) for _ in range(d))
            kw["output_padding"] = tuple(
                draw(st.integers(0, max(s, dl) - 1)) for s, dl in zip(stride, dilation, strict=True))
            size = [draw(st.integers(1, 4)) for _ in range(d)]
            for s_, st_, p, e, op in zip(size, stride, pad, ext, kw["output_padding"], strict=True):
                if (s_ - 1) * st_ - 2 * p + e + op < 1:
                    pad = (0,) * d  # keep the output non-empty
            # The int form pads every dim alike: only where the tuple does (else an output may
            # be empty along a dim whose own padding was dropped above).
            same = len(set(pad)) == 1
            kw["padding"] = draw(st.sampled_from([pad, pad[0]])) if d > 0 and same else pad
        else:
            kind = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
            if kind == "same":
                stride = (1,) * d
                kw["padding"] = "same"
            elif kind == "valid":
                kw["padding"] = "valid"
            elif kind == "int":
                kw["padding"] = draw(st.integers(0, 2))
            else:
                kw["padding"] = tuple(draw(st.integers(0, 2)) for _ in range(d))
            kw["padding_mode"] = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
            pads = {"int": (kw["padding"],) * d if kind == "int" else None, "tuple": kw["padding"],
                    "same": tuple(e // 2 + 1 for e in ext), "valid": (0,) * d}[kind]
            # Reflect padding needs pad < size; the output needs size + 2 pad >= extent.
            size = [draw(st.integers(max(e, p + 1), max(e, p + 1) + 2))
                    for e, p in zip(ext, pads, strict=True)]
        module = cls(cin, cout, kernel, stride=stride, **kw)
        n = draw(st.integers(1, 3))
        return module, torch.randn(n, cin, *size)

    return build()


@st.composite
def _linear(draw: st.DrawFn) -> tuple[nn.Module, Tensor]:
    lead = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2)))]
    i, o = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    return nn.Linear(i, o, bias=draw(st.booleans())), torch.randn(draw(st.integers(1, 3)), *lead, i)


@st.composite
def _embedding(draw: st.DrawFn) -> tuple[nn.Module, Tensor]:
    v, dim = draw(st.integers(2, 6)), draw(st.integers(1, 3))
    pad = draw(st.one_of(st.none(), st.integers(-v, v - 1)))
    lead = [draw(st.integers(1, 4)) for _ in range(draw(st.integers(0, 2)))]
    # Few rows so tokens repeat within a sample, and padding_idx occurs.
    return nn.Embedding(v, dim, padding_idx=pad), torch.randint(0, v, (draw(st.integers(1, 3)), *lead))


@st.composite
def _trailing_norm(draw: st.DrawFn, cls: type[nn.Module]) -> tuple[nn.Module, Tensor]:
    shape = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2)))]
    lead = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2)))]
    if cls is nn.LayerNorm:
        if shape == [1] * len(shape):
            # One value per sample and position has zero variance: x_hat is all zeros, so the
            # weight's gradient is rounding noise, which the sum check cannot tell from a
            # wrong split when nothing else in the model has a gradient (as for GroupNorm).
            shape[-1] = 2
        module = nn.LayerNorm(shape, bias=draw(st.booleans()))
    else:
        module = nn.RMSNorm(shape, eps=draw(st.sampled_from([None, 1e-3])))
    return module, torch.randn(draw(st.integers(1, 3)), *lead, *shape) * 2 + 0.5


def _bias_or_not(module: nn.Module, bias: bool) -> nn.Module:
    """``module`` as its ``bias=False`` constructor argument makes it (which torch 2.9's
    GroupNorm and BatchNorm do not take): no bias parameter."""
    if not bias:
        module.register_parameter("bias", None)
    return module


@st.composite
def _groupnorm(draw: st.DrawFn) -> tuple[nn.Module, Tensor]:
    g = draw(st.integers(1, 3))
    c = g * draw(st.integers(1, 2))
    spatial = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2)))]
    if c == g and all(size == 1 for size in spatial):
        spatial = [*spatial[:-1], 2]  # one value per group has zero variance: x_hat is all zeros
    module = _bias_or_not(nn.GroupNorm(g, c), draw(st.booleans()))
    return module, torch.randn(draw(st.integers(1, 3)), c, *spatial)


def _randomize_running(module: nn.Module) -> None:
    module.running_mean.uniform_(-1, 1)
    module.running_var.uniform_(0.5, 2)


@st.composite
def _instancenorm(draw: st.DrawFn) -> tuple[nn.Module, Tensor]:
    d = draw(st.integers(1, 3))
    cls = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[d]
    track = draw(st.booleans())
    module = cls(draw(st.integers(1, 3)), affine=True, track_running_stats=track)
    if track:
        _randomize_running(module)
        module.train(draw(st.booleans()))  # training with running stats: instance statistics
    size = [draw(st.integers(2, 3)) for _ in range(d)]
    return module, torch.randn(draw(st.integers(1, 3)), module.num_features, *size)


@st.composite
def _batchnorm(draw: st.DrawFn) -> tuple[nn.Module, Tensor]:
    d = draw(st.integers(1, 3))
    cls = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[d]
    module = _bias_or_not(cls(draw(st.integers(1, 3))), draw(st.booleans()))
    _randomize_running(module)
    module.eval()
    spatial = [draw(st.integers(1, 3)) for _ in range(d if d > 1 else draw(st.integers(0, 1)))]
    return module, torch.randn(draw(st.integers(1, 3)), module.num_features, *spatial)


CASES: dict[type[nn.Module], st.SearchStrategy] = {
    nn.Linear: _linear(),
    nn.Conv1d: _conv_case(nn.Conv1d, 1, False),
    nn.Conv2d: _conv_case(nn.Conv2d, 2, False),
    nn.Conv3d: _conv_case(nn.Conv3d, 3, False),
    nn.ConvTranspose1d: _conv_case(nn.ConvTranspose1d, 1, True),
    nn.ConvTranspose2d: _conv_case(nn.ConvTranspose2d, 2, True),
    nn.ConvTranspose3d: _conv_case(nn.ConvTranspose3d, 3, True),
    nn.Embedding: _embedding(),
    nn.LayerNorm: _trailing_norm(nn.LayerNorm),
    nn.RMSNorm: _trailing_norm(nn.RMSNorm),
    nn.GroupNorm: _groupnorm(),
    _InstanceNorm: _instancenorm(),
    _BatchNorm: _batchnorm(),
}


def test_every_rule_file_is_registered_and_every_registered_type_has_a_case() -> None:
    files = {p.stem for p in Path(rules.__file__).parent.glob("*.py") if p.stem != "__init__"}
    assert files == set(rules.__all__)
    registered = {id(entry) for _, entry in PER_SAMPLE.items()}
    builtin: set[int] = set()
    for stem in sorted(files):
        module = importlib.import_module(f"gradtap._samples.rules.{stem}")
        entries = [v for v in vars(module).values() if isinstance(v, PerSampleRule)]
        assert entries, f"rules/{stem}.py defines no PerSampleRule"
        assert all(id(e) in registered for e in entries), f"rules/{stem}.py: an entry is not registered"
        builtin.update(id(e) for e in entries)
    # (Other tests and doctests register their own types through gradtap.rules.)
    types = [(t, e) for t, e in PER_SAMPLE.items() if id(e) in builtin]
    assert {t for t, e in types if e.grad is not None} == set(CASES)
    # Entries without grad split the call into linear maps: test_attention_matches_torch_func.
    assert [t for t, e in types if e.grad is None] == [nn.MultiheadAttention]


def _check_rules(module: nn.Module, x: Tensor) -> None:
    go = torch.randn_like(module(x))
    ref = module_oracle(module, x, go)
    names = frozenset(ref)
    entry = PER_SAMPLE.require(module, "m")
    assert entry.grad is not None
    got = entry.grad(module, x, go, names)
    assert got.keys() == ref.keys()
    for k in ref:
        close(got[k], ref[k], f"{module} grad {k}")
    norm_sq = {k: r.flatten(1).square().sum(1) for k, r in ref.items()}
    sum_sq = {k: r.square().sum(0) for k, r in ref.items()}
    generic = dataclasses.replace(entry, norm_sq=None, sum_sq=None)  # reduced from grad
    for kind, e in (("chunked", generic), ("entry", entry)):
        out = e.norm_sq_of(module, x, go, names)
        for k in ref:
            close(out[k], norm_sq[k], f"{module} {kind} norm {k}")
        out = e.sum_sq_of(module, x, go, names)
        for k in ref:
            close(out[k], sum_sq[k], f"{module} {kind} sum of squares {k}")
    if entry.norm_sq in (norm_linear, norm_conv):
        for form in ("direct", "ghost"):
            out = entry.norm_sq(module, x, go, names, form=form)  # type: ignore[call-arg]
            for k in ref:
                close(out[k], norm_sq[k], f"{module} norm {k} form={form}")
    if entry.grad is grad_conv:
        for method in ("unfold", "conv"):
            out = grad_conv(module, x, go, names, method=method)
            for k in ref:
                close(out[k], ref[k], f"{module} grad {k} method={method}")


@pytest.mark.parametrize("module_type", list(CASES), ids=lambda t: t.__name__)
@HYP
@given(data=st.data())
def test_rule_matches_torch_func(module_type: type[nn.Module], data: st.DataObject) -> None:
    module, x = data.draw(CASES[module_type])
    _check_rules(module, x)


def test_chunked_reductions_split_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rule, "MIN_BUDGET", 1)
    module, x = nn.Conv2d(2, 3, 3, padding=1), torch.randn(5, 2, 4, 4)
    assert len(list(rule.chunks(5, 54, rule.budget(x)))) > 1
    _check_rules(module, x)
    _check_rules(nn.Linear(6, 7), torch.randn(5, 3, 6))


# --------------------------------------------------------------------------------------------
# end to end: gt.per_sample on models
# --------------------------------------------------------------------------------------------


def model_oracle(model: nn.Module, loss: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor,
                 batch_dim: int = 0) -> dict[str, Tensor]:
    """d l_n / d p for each sample n, where l_n = loss on sample n alone (a batch of one)."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}

    def f(p: dict[str, Tensor], xn: Tensor, yn: Tensor) -> Tensor:
        out = functional_call(model, (p, buffers), (xn.unsqueeze(batch_dim),))
        return loss(out, yn.unsqueeze(batch_dim))

    return vmap(grad(f), in_dims=(None, batch_dim, batch_dim))(params, x, y)


def hook_snapshot(model: nn.Module) -> dict[str, object]:
    """Every hook dict of every module and parameter (parametrizations bring their own)."""
    snap: dict[str, object] = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if "hook" in attr and isinstance(value, dict):
                snap[f"{name}:{attr}"] = list(value)
    for name, p in model.named_parameters():
        snap[f"{name}:backward"] = list(p._backward_hooks or {})
        snap[f"{name}:post_accumulate"] = p._post_accumulate_grad_hooks
    return snap


def run_and_check(model: nn.Module, x: Tensor, y: Tensor, *, quantities=ALL,
                  loss: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
                  loss_reduction: str = "mean", batch_dim: int = 0, **kw) -> gt.PerSample:
    """Run gt.per_sample on one backward and check every asked quantity against the oracle."""
    ref = model_oracle(model, loss, x, y, batch_dim)
    n = x.shape[batch_dim]
    state = copy.deepcopy(model.state_dict())
    hooks = hook_snapshot(model)
    model.zero_grad(set_to_none=True)
    with gt.per_sample(model, loss_reduction=loss_reduction, batch_dim=batch_dim,
                       quantities=quantities, **kw) as ps:
        total = loss(model(x), y)
        (total * (n if loss_reduction == "sum" else 1)).backward()
    assert hook_snapshot(model) == hooks
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    if not any(parametrize.is_parametrized(m) for m in model.modules()):
        pickle.dumps(model)  # (torch itself refuses to pickle parametrized modules)
    params = dict(model.named_parameters())
    assert set(ps.names) == set(ref)
    for k, r in ref.items():
        if "grad" in quantities:
            close(ps.grad[k], r, f"grad {k}")
            summed = ps.grad[k].mean(0) if loss_reduction == "mean" else ps.grad[k].sum(0)
            close(summed, params[k].grad, f"grad {k} reduced vs .grad")
        if "norm" in quantities:
            close(ps.norms[k], r.flatten(1).norm(dim=1), f"norms {k}")
        mean = r.mean(0)
        second = r.square().mean(0)
        var = second - mean.square()
        if "second_moment" in quantities:
            close(ps.second_moment[k], second, f"second_moment {k}")
        if "variance" in quantities:
            close(ps.variance[k], var, f"variance {k}")
        if "snr" in quantities:
            close(ps.snr[k], mean.square() / (var + 1e-12), f"snr {k}")
    if "norm" in quantities:
        close(ps.norm, torch.cat([r.flatten(1) for r in ref.values()], 1).norm(dim=1), "norm")
    return ps


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("quantities", [ALL, ("norm", "variance"), ("second_moment", "snr")])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_mlp(quantities: tuple, loss_reduction: str, device: torch.device) -> None:
    x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))
    run_and_check(_mlp().to(device), x.to(device), y.to(device), quantities=quantities,
                  loss_reduction=loss_reduction)


def test_batch_of_one_and_results_readable_inside_the_block() -> None:
    model = _mlp()
    x, y = torch.randn(1, 5), torch.randint(0, 3, (1,))
    ref = model_oracle(model, F.cross_entropy, x, y)
    with gt.per_sample(model, quantities=ALL) as ps:
        F.cross_entropy(model(x), y).backward()
        close(ps.grad["0.weight"], ref["0.weight"], "inside")
        close(ps.variance["0.weight"], torch.zeros(6, 5), "variance of one sample")


class TokenModel(nn.Module):
    """Embedding (padding_idx), Linear over sequences, LayerNorm, RMSNorm, token logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.lin = nn.Linear(4, 5)
        self.ln = nn.LayerNorm(5)
        self.rms = nn.RMSNorm(5)
        self.out = nn.Linear(5, 7)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(self.rms(torch.tanh(self.ln(self.lin(self.emb(tokens))))))


def _token_loss(logits: Tensor, y: Tensor) -> Tensor:
    # Mean over every token of every sample: s_n is sample n's mean over its tokens.
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("quantities", [ALL, ("norm", "variance")])
def test_sequences_with_token_mean_loss(quantities: tuple) -> None:
    tokens = torch.randint(0, 7, (4, 6))
    run_and_check(TokenModel(), tokens, torch.randint(0, 7, (4, 6)), quantities=quantities,
                  loss=_token_loss)


@pytest.mark.parametrize("quantities", [ALL, ("norm", "second_moment")])
def test_batch_dim_one(quantities: tuple) -> None:
    tokens = torch.randint(0, 7, (6, 3))  # [T, N]: samples along dim 1
    run_and_check(TokenModel(), tokens, torch.randint(0, 7, (6, 3)), quantities=quantities,
                  loss=_token_loss, batch_dim=1)


class Shared(nn.Module):
    """One Linear called three times per forward, on different inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.a(h)) + self.a(x.flip(-1))
        h = self.conv(self.conv(h.view(-1, 2, 2)).tanh()).view(-1, 4)
        return self.head(h)


@pytest.mark.parametrize("quantities", [ALL, ("norm",), ("variance",)])
def test_module_called_several_times_sums_over_calls(quantities: tuple) -> None:
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    run_and_check(Shared(), x, y, quantities=quantities)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect")
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, groups=2)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.up = nn.ConvTranspose2d(4, 2, 3, stride=2, output_padding=1)
        self.bn = nn.BatchNorm2d(2)
        self.fc = nn.Linear(2 * 6 * 6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.gn(self.c1(x)))
        h = torch.relu(self.inorm(self.c2(h)))
        return self.fc(self.bn(self.up(h)).flatten(1))


@pytest.mark.parametrize("quantities", [ALL, ("norm", "variance")])
def test_convnet_with_norm_layers(quantities: tuple) -> None:
    model = ConvNet()
    _randomize_running(model.bn)
    model.eval()
    x, y = torch.randn(4, 2, 5, 5), torch.randint(0, 3, (4,))
    run_and_check(model, x, y, quantities=quantities)


class Scaled(nn.Module):
    """No rule: a direct parameter and a child that is called (the child keeps its rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.rand(4) + 0.5)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x)) * self.gain


class FallbackNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scaled = Scaled()
        self.bil = nn.Bilinear(4, 4, 3)
        self.prelu = nn.PReLU(3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.scaled(x)
        return self.prelu(self.bil(h, x))


@pytest.mark.parametrize("quantities", [ALL, ("norm", "variance")])
def test_fallback_on_modules_without_a_rule(quantities: tuple) -> None:
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    run_and_check(FallbackNet(), x, y, quantities=quantities)


class Attention(nn.Module):
    """MultiheadAttention uses out_proj's parameters without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        a, _ = self.att(x, x, x, need_weights=False)
        return self.fc(a.mean(1))


def test_fallback_covers_parameters_of_a_child_that_is_never_called() -> None:
    model = Attention()
    model.att.bias_k = nn.Parameter(torch.randn(1, 1, 4))  # no replay rule: the fallback
    model.att.bias_v = nn.Parameter(torch.randn(1, 1, 4))
    x, y = torch.randn(3, 5, 4), torch.randint(0, 3, (3,))
    run_and_check(model, x, y, quantities=("grad", "norm"))


class CrossAttention(nn.Module):
    """MultiheadAttention with every option the replay has to reproduce."""

    def __init__(self, att: nn.MultiheadAttention, mask: Tensor | None, weights: str) -> None:
        super().__init__()
        self.att, self.mask, self.weights = att, mask, weights
        self.fc = nn.Linear(att.embed_dim, 3)

    def forward(self, q: Tensor, kv: Tensor, pad: Tensor) -> Tensor:
        a, w = self.att(q, kv, kv * 0.5, key_padding_mask=pad, attn_mask=self.mask,
                        need_weights=self.weights != "none")
        t = 1 if self.att.batch_first else 0
        out = self.fc(a.mean(t, keepdim=True)).squeeze(t)  # fc's samples also at batch_dim
        if self.weights == "used":  # a gradient reaches the weights: the fallback takes it
            out = out + w.sum((1, 2))[:, None]
        return out


@settings(HYP, max_examples=15)
@given(data=st.data())
def test_attention_matches_torch_func(data: st.DataObject) -> None:
    heads = data.draw(st.integers(1, 2))
    e = heads * data.draw(st.integers(1, 3))
    kdim = data.draw(st.sampled_from([None, 2, 3]))
    weights = data.draw(st.sampled_from(["none", "unused", "used"]))
    # The fallback splits every input at batch_dim (docs/semantics.md); key_padding_mask and the
    # returned weights are batch-first whatever batch_first says: only batch_first=True there.
    batch_first = weights == "used" or data.draw(st.booleans())
    att = nn.MultiheadAttention(e, heads, bias=data.draw(st.booleans()),
                                add_zero_attn=data.draw(st.booleans()), kdim=kdim, vdim=kdim,
                                batch_first=batch_first)
    n, t, s = (data.draw(st.integers(1, 3)) for _ in range(3))
    # A shared [T, S] mask has no sample dim: only the replay rule knows it, not the fallback.
    mask = "none" if weights == "used" else data.draw(st.sampled_from(["none", "causal", "bool"]))
    attn_mask = {"none": None, "causal": torch.ones(t, s, dtype=torch.bool).triu(1),
                 "bool": torch.rand(t, s) < 0.3}[mask]
    if mask == "bool":
        attn_mask[:, 0] = False  # every query keeps a key: no all-masked rows (NaN)
    model = CrossAttention(att, attn_mask, weights)
    b = 0 if batch_first else 1
    q = torch.randn(n, t, e).movedim(0, b)
    kv = torch.randn(n, s, kdim or e).movedim(0, b)
    pad = torch.rand(n, s) < 0.3
    pad[:, 0] = False
    y = torch.randint(0, 3, (n,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p: dict[str, Tensor], qn: Tensor, kvn: Tensor, padn: Tensor, yn: Tensor) -> Tensor:
        out = functional_call(model, p, (qn.unsqueeze(b), kvn.unsqueeze(b), padn[None]))
        return F.cross_entropy(out, yn[None])

    ref = vmap(grad(f), in_dims=(None, b, b, 0, 0))(params, q, kv, pad, y)
    quantities = data.draw(st.sampled_from([ALL, ("norm", "variance")]))
    with gt.per_sample(model, quantities=quantities, batch_dim=b) as ps:
        F.cross_entropy(model(q, kv, pad), y).backward()
    for k, r in ref.items():
        if "grad" in quantities:
            close(ps.grad[k], r, f"grad {k}")
        if "norm" in quantities:
            close(ps.norms[k], r.flatten(1).norm(dim=1), f"norm {k}")
        close(ps.variance[k], r.var(0, correction=0), f"variance {k}")


class SharedInputAttention(nn.Module):
    """MultiheadAttention whose projections share inputs: q = k = v, or k = v only."""

    def __init__(self, att: nn.MultiheadAttention, shared: str, mask: Tensor | None) -> None:
        super().__init__()
        self.att, self.shared, self.mask = att, shared, mask
        self.fc = nn.Linear(att.embed_dim, 3)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        t = 1 if self.att.batch_first else 0
        q = x if self.shared == "qkv" else x.flip(t) * 0.5
        a, _ = self.att(q, x, x, key_padding_mask=pad, attn_mask=self.mask, need_weights=False)
        return self.fc(a.mean(t, keepdim=True)).squeeze(t)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("shared", ["qkv", "kv"])
@pytest.mark.parametrize(("batch_first", "zero_attn", "mask"),
                         [(True, False, "none"), (False, True, "bool"), (True, True, "float")])
def test_attention_with_shared_projection_inputs(shared: str, batch_first: bool, zero_attn: bool,
                                                 mask: str, chunked: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Projections reading one tensor are replayed as one packed piece, a chunk at a time."""
    # The replay in one chunk of all samples, or one chunk per sample.
    size = 1 if chunked else None
    monkeypatch.setattr(rules.attention, "chunks",
                        lambda n, per_sample, limit: rule.chunks(n, 1, size or n))
    n, t, e = 3, 4, 4
    att = nn.MultiheadAttention(e, 2, batch_first=batch_first, add_zero_attn=zero_attn)
    attn_mask = {"none": None, "bool": torch.ones(t, t, dtype=torch.bool).triu(1),
                 "float": torch.randn(t, t)}[mask]
    model = SharedInputAttention(att, shared, attn_mask)
    b = 0 if batch_first else 1
    x = torch.randn(n, t, e).movedim(0, b)
    pad = torch.rand(n, t) < 0.3
    pad[:, 0] = False
    if mask == "float":  # masks of one kind (torch deprecates mixing them)
        pad = torch.zeros(n, t).masked_fill_(pad, float("-inf"))
    y = torch.randint(0, 3, (n,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p: dict[str, Tensor], xn: Tensor, padn: Tensor, yn: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xn.unsqueeze(b), padn[None])), yn[None])

    ref = vmap(grad(f), in_dims=(None, b, 0, 0))(params, x, pad, y)
    for quantities in (ALL, ("norm", "variance")):
        with gt.per_sample(model, quantities=quantities, batch_dim=b) as ps:
            F.cross_entropy(model(x, pad), y).backward()
        for k, r in ref.items():
            if "grad" in quantities:
                close(ps.grad[k], r, f"grad {k}")
            close(ps.norms[k], r.flatten(1).norm(dim=1), f"norm {k}")
            close(ps.variance[k], r.var(0, correction=0), f"variance {k}")


def test_transformer_encoder_layer() -> None:
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(12, 3))
    x, y = torch.randn(4, 3, 4), torch.randint(0, 3, (4,))
    run_and_check(model, x, y)
    run_and_check(model, x, y, quantities=("norm", "second_moment"))


def test_attention_dropout_in_training_is_refused() -> None:
    model = Attention()
    model.att.dropout = 0.1
    with gt.per_sample(model) as ps, pytest.raises(UnsupportedModuleError, match="dropout=0.1"):
        model(torch.randn(2, 3, 4)).sum().backward()
    del ps


def test_parametrized_weights() -> None:
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh(),
                          parametrizations.orthogonal(nn.Linear(5, 5)), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    run_and_check(model, x, y)
    run_and_check(model, x, y, quantities=("norm", "variance"))


def test_root_module_and_selection_of_a_subset() -> None:
    lin = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    run_and_check(lin, x, y)
    model = _mlp()
    model[0].weight.requires_grad_(False)  # frozen parameters are skipped
    with gt.per_sample(model, select="0.*") as ps:
        F.cross_entropy(model(x.new_ones(4, 5)), y).backward()
    assert ps.names == ["0.bias"] and set(ps.grad) == {"0.bias"}


def test_parameter_never_reached_has_zero_per_sample_gradients() -> None:
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
    x = torch.randn(4, 3)
    with gt.per_sample(model, quantities=("grad", "norm")) as ps:
        model["used"](x).sum().backward()
    close(ps.grad["unused.weight"], torch.zeros(4, 2, 3), "unused")
    close(ps.norms["unused.bias"], torch.zeros(4), "unused norm")


def test_clear_between_steps_and_accumulation_like_grad() -> None:
    model = _mlp()
    x1, x2, y = torch.randn(3, 5), torch.randn(3, 5), torch.randint(0, 3, (3,))
    ref1, ref2 = (model_oracle(model, F.cross_entropy, x, y) for x in (x1, x2))
    with gt.per_sample(model, quantities=("norm",)) as ps:
        F.cross_entropy(model(x1), y).backward()
        ps.clear()
        F.cross_entropy(model(x2), y).backward()
        close(ps.norms["2.weight"], ref2["2.weight"].flatten(1).norm(dim=1), "after clear")
        F.cross_entropy(model(x1), y).backward()  # no clear: norms cannot be combined
        with pytest.raises(GradtapError, match=r"more than one backward pass .* call ps.clear\(\)"):
            _ = ps.norm
    with gt.per_sample(model, quantities=("grad",)) as ps:  # grads add up, as .grad does
        F.cross_entropy(model(x1), y).backward()
        F.cross_entropy(model(x2), y).backward()
    close(ps.grad["0.weight"], ref1["0.weight"] + ref2["0.weight"], "accumulated")


@pytest.mark.parametrize("own_grad", [False, True])
def test_made_once_and_cleared_in_a_training_loop(own_grad: bool) -> None:
    """One object over several optimizer steps (the weights change): each batch's results
    equal the oracle at that step's weights, and ``.grad`` is autograd's."""
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(40, 48), nn.Tanh(), nn.Linear(48, 3))  # sketched widths

    model, twin = make(), make()  # the oracle runs on a twin without hooks
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ps = gt.per_sample(model, quantities=("grad", "norm"), own_grad=own_grad)
    try:
        for step in range(3):
            x, y = torch.randn(5, 40), torch.randint(0, 3, (5,))
            twin.load_state_dict(model.state_dict())
            ref = model_oracle(twin, F.cross_entropy, x, y)
            ps.clear()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for k, p in model.named_parameters():
                close(ps.grad[k], ref[k], f"step {step} grad {k}")
                close(p.grad, ref[k].mean(0), f"step {step} .grad {k}")
            norm = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
            close(ps.norm, norm, f"step {step} norm")
            opt.step()
    finally:
        ps.remove()
    assert_no_hooks(model)


def test_results_are_freed_with_the_object_without_the_garbage_collector() -> None:
    model = _mlp()
    gc.disable()  # a reference cycle would keep every per-sample gradient until gc runs
    try:
        with gt.per_sample(model) as ps:
            F.cross_entropy(model(torch.randn(3, 5)), torch.tensor([0, 1, 2])).backward()
        grad = weakref.ref(ps.grad["0.weight"])
        obj = weakref.ref(ps)
        del ps
        assert obj() is None and grad() is None
    finally:
        gc.enable()


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


def test_batchnorm_in_training_mode_is_refused() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    with pytest.raises(UnsupportedModuleError, match=r"module '1' \(BatchNorm2d\) are not defined: "
                                                     r"it normalizes with statistics of the whole batch"):
        gt.per_sample(model)
    assert_no_hooks(model)
    with gt.per_sample(model, select="0.*"):  # leaving it out is fine
        pass
    model.eval()
    with gt.per_sample(model) as ps:
        model.train()  # switched back after the start: caught at the forward call
        with pytest.raises(UnsupportedModuleError, match="BatchNorm2d"):
            model(torch.randn(2, 1, 4, 4))
    del ps
    model.eval()

    class WithBatchNorm(nn.Module):  # no rule; its BatchNorm owns no parameter
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))
            self.bn = nn.BatchNorm1d(4, affine=False)

        def forward(self, x: Tensor) -> Tensor:
            return self.bn(x) * self.gain

    with pytest.raises(UnsupportedModuleError, match=r"module 'block.bn' \(BatchNorm1d\) \(inside "
                                                     r"'block', replayed by the fallback\)"):
        gt.per_sample(nn.ModuleDict({"block": WithBatchNorm()}))


def test_embedding_scale_grad_by_freq_is_refused() -> None:
    with pytest.raises(UnsupportedModuleError, match="scale_grad_by_freq=True"):
        gt.per_sample(nn.Embedding(4, 2, scale_grad_by_freq=True))


def test_fallback_false_lists_supported_types() -> None:
    with pytest.raises(UnsupportedModuleError, match=r"no per-sample rule for module 'scaled' of "
                                                     r"type Scaled \(owner of scaled.gain\), and "
                                                     r"fallback=False; supported .*Conv2d"):
        gt.per_sample(FallbackNet(), fallback=False)


def test_fallback_refuses_random_forward() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.drop = nn.Dropout(0.5)

        def forward(self, x: Tensor) -> Tensor:
            return self.drop(x * self.w)

    model = Noisy()
    with gt.per_sample(model) as ps, pytest.raises(UnsupportedModuleError, match="dropout"):
        model(torch.randn(2, 3)).sum().backward()
    del ps


def test_bad_arguments() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum'; got 'avg'"):
        gt.per_sample(model, loss_reduction="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quantities must be a non-empty subset"):
        gt.per_sample(model, quantities=("grad", "hessian"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_dim must be a non-negative int; got -1"):
        gt.per_sample(model, batch_dim=-1)
    with pytest.raises(SelectionError, match="matches no module or parameter"):
        gt.per_sample(model, select="nothing.*")
    model[0].requires_grad_(False)
    with pytest.raises(SelectionError, match="only parameters that do not require grad: 0.weight"):
        gt.per_sample(model, select="0.*")
    with pytest.raises(ValueError, match=r"batch_dim=1, but module 'c1' \(Conv2d\) takes inputs "
                                         r"with the sample dim at 0; use batch_dim=0"):
        gt.per_sample(ConvNet(), batch_dim=1)
    with pytest.raises(ValueError, match=r"module 'att' \(MultiheadAttention\) .* at 1"):
        gt.per_sample(nn.ModuleDict({"att": nn.MultiheadAttention(4, 2)}))
    assert_no_hooks(model)


def test_reading_too_early_or_unrequested() -> None:
    model = _mlp()
    with gt.per_sample(model, quantities=("norm",)) as ps:
        with pytest.raises(GradtapError, match="no per-sample gradient was computed yet"):
            _ = ps.norm
        F.cross_entropy(model(torch.randn(2, 5)), torch.tensor([0, 1])).backward()
    with pytest.raises(GradtapError, match=r"'grad' was not requested; pass quantities=\(\.\.\., 'grad'\)"):
        _ = ps.grad
    with pytest.raises(GradtapError, match="'variance' was not requested"):
        _ = ps.variance


def test_batch_size_mismatch_and_missing_batch_dim() -> None:
    model = _mlp()
    with gt.per_sample(model):
        model(torch.randn(3, 5))
        with pytest.raises(ValueError, match=r"the model got 2 samples along batch_dim=0, but an "
                                             r"earlier call had 3; call ps.clear\(\)"):
            model(torch.randn(2, 5))
    with gt.per_sample(model, batch_dim=1):
        with pytest.raises(ValueError, match=r"the model was called without a tensor argument that "
                                             r"has the sample dim batch_dim=1 \(tensor arguments: "
                                             r"\(5,\)\)"):
            model(torch.randn(5))
    parts = nn.ModuleDict({"lin": nn.Linear(5, 2)})
    with gt.per_sample(parts, batch_dim=1):  # a part called alone: its input decides
        with pytest.raises(ValueError, match=r"module 'lin' was called with shape \(5,\); its "
                                             r"input needs the sample dim batch_dim=1"):
            parts["lin"](torch.randn(5))


def test_hooks_removed_when_backward_raises() -> None:
    model = FallbackNet()
    with pytest.raises(RuntimeError, match="boom"), gt.per_sample(model):
        model(torch.randn(2, 4))
        raise RuntimeError("boom")
    assert_no_hooks(model)


# --------------------------------------------------------------------------------------------
# benchmark script
# --------------------------------------------------------------------------------------------


def test_benchmark_quick_runs() -> None:
    import importlib
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    # Imported by name, as benchmarks/run_all.py does: Opacus deep-copies (pickles) models.
    bench = importlib.import_module("per_sample")
    torch.set_default_dtype(torch.float32)  # the benchmark's models are float32
    # One thread, as the rest of the suite (its no-trim child process too): two threads per
    # process oversubscribe the cores the two pytest workers share. test_benchmarks.py runs the
    # two-thread goal setting.
    # The benchmark collects garbage before each of its ~100 memory readings; frozen, the
    # objects this test process already holds (every test module and what it imported) are
    # not walked again each time, only the benchmark's own.
    gc.collect()
    gc.freeze()
    try:
        text = bench.main(["--quick", "--threads", "1"])
    finally:
        gc.unfreeze()
    assert "default allocator" in text and "no trim" in text and "time only" in text
    for model in bench.MODELS:
        assert text.count(f"**{model}**") == 2  # both allocators
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| gradtap") or line.startswith("| plain step"):
            assert float(cells[1]) > 0 and cells[-1] == "", line  # timed, no failure note
        elif line.startswith(("| BackPACK", "| Opacus")):
            # An anchor that is not installed, or fails on a model, gets a note instead of a time.
            assert ("not installed" in cells[-1] or "fails" in cells[-1]) != (cells[1] != "-"), line
    assert "| conv |" not in text
    methods = bench.main(["--quick", "--methods"])
    assert methods.count("\n") == 4 and ("| unfold |" in methods or "| conv |" in methods)


# --------------------------------------------------------------------------------------------
# the end-of-backward check on a projection (wide Linear weights)
# --------------------------------------------------------------------------------------------


@HYP
@given(n=st.integers(1, 12), width=st.integers(33, 300), out=st.integers(1, 40),
       seq=st.sampled_from([(), (3,)]), dtype=st.sampled_from([torch.float32, torch.float64]),
       reduction=st.sampled_from(["mean", "sum"]))
def test_sketched_check_passes_healthy_linear_models(n: int, width: int, out: int,
                                                     seq: tuple[int, ...], dtype: torch.dtype,
                                                     reduction: str) -> None:
    """No false alarm from the projected check in float32 or float64, with or without
    sequence dims: no warning, and the per-sample gradients still reduce to ``.grad``."""
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, out)).to(dtype)
    x = torch.randn(n, *seq, width, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught, gt.per_sample(
            model, quantities=("grad",), loss_reduction=reduction) as ps:
        warnings.simplefilter("always")
        y = model(x).square()
        (y.mean(tuple(range(1, y.dim()))).mean() if reduction == "mean" else y.sum()).backward()
        grads = ps.grad
    assert "0.weight" in ps._sketches
    assert [str(w.message) for w in caught] == []
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for k, p in model.named_parameters():
        total = grads[k].mean(0) if reduction == "mean" else grads[k].sum(0)
        torch.testing.assert_close(total, p.grad, rtol=tol, atol=tol * float(p.grad.abs().max()))


@pytest.mark.parametrize("quantities", [
    "variance", "snr", "second_moment",
    pytest.param(lambda: (q for q in ("norm", "variance")), id="generator"),
])
@pytest.mark.usefixtures("float64_seeded")
def test_quantities_as_one_string_or_a_one_shot_iterable(quantities) -> None:
    """What is computed follows the quantities as checked, not the argument read again (a
    string is not its set of characters, a generator is read once)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    asked = quantities() if callable(quantities) else quantities
    with gt.per_sample(model, quantities=asked) as ps:
        model(x).square().sum().backward()
    with gt.per_sample(model, quantities=("grad",)) as ref:
        model(x).square().sum().backward()
    for q in ps.quantities:
        got = ps.norms if q == "norm" else getattr(ps, q)
        for k, g in ref.grad.items():
            var, mean = torch.var_mean(g, 0, correction=0)
            expected = {"norm": g.flatten(1).norm(dim=1), "variance": var,
                        "second_moment": g.square().mean(0), "snr": mean.square() / (var + 1e-12)}
            torch.testing.assert_close(got[k], expected[q], rtol=1e-8, atol=1e-12)
