"""Tests for gradtap.transform: built-ins against naive float64 formulas, chain, the driver."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtap as gt
from gradtap._transform.base import is_group_only

SETTINGS = settings(max_examples=25, deadline=None)

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=4).map(tuple)


def assert_close(
    actual: torch.Tensor, expected, *, rtol: float = 1e-10, atol: float = 1e-12
) -> None:
    """The one comparison helper: float64 exactness unless a tolerance is written down."""
    expected_t = torch.as_tensor(np.asarray(expected), dtype=actual.dtype)
    assert actual.shape == expected_t.shape, (actual.shape, expected_t.shape)
    torch.testing.assert_close(actual, expected_t, rtol=rtol, atol=atol)


def rand(shape, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


def run(t: gt.Transform, grads, param=None):
    """Apply ``t`` to a sequence of gradients for one tensor; return the outputs."""
    state = t.init(param if param is not None else torch.zeros_like(grads[0]))
    outs = []
    for g in grads:
        before = g.clone()
        out, state = t.update(g, state, param)
        assert torch.equal(g, before), "a transform modified its incoming gradient in place"
        outs.append(out)
    return outs, state


# --------------------------------------------------------------------------- stateless built-ins


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 10_000), s=st.floats(-5, 5))
def test_scale_flip_zero_clip_value_match_formulas(shape, seed, s):
    g = rand(shape, seed)
    x = g.numpy()
    assert_close(run(gt.scale(s), [g])[0][0], x * s)
    assert_close(run(gt.flip(), [g])[0][0], -x)
    assert_close(run(gt.zero(), [g])[0][0], np.zeros_like(x))
    v = abs(s) + 0.1
    assert_close(run(gt.clip_value(v), [g])[0][0], np.minimum(np.maximum(x, -v), v))


@SETTINGS
@given(
    shape=shapes, seed=st.integers(0, 10_000), max_norm=st.floats(0.01, 10), mag=st.floats(0.0, 10)
)
def test_clip_norm_matches_formula(shape, seed, max_norm, mag):
    g = rand(shape, seed) * mag
    x = g.numpy().astype(np.float64)
    norm = math.sqrt(float((x * x).sum()))
    expected = x * min(1.0, max_norm / (norm + 1e-6))
    assert_close(run(gt.clip_norm(max_norm), [g])[0][0], expected)


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 10_000))
def test_centralize_matches_formula(shape, seed):
    g = rand(shape, seed)
    x = g.numpy()
    if x.ndim < 2:
        expected = x
    else:
        flat = x.reshape(x.shape[0], -1)
        expected = (flat - flat.mean(axis=1, keepdims=True)).reshape(x.shape)
    assert_close(run(gt.centralize(), [g])[0][0], expected)


@SETTINGS
@given(
    shapes_=st.lists(shapes, min_size=1, max_size=4),
    seed=st.integers(0, 10_000),
    max_norm=st.floats(0.01, 10),
    mag=st.floats(0.0, 5),
)
def test_clip_global_norm_matches_formula(shapes_, seed, max_norm, mag):
    grads = [rand(s, seed + i) * mag for i, s in enumerate(shapes_)]
    xs = [g.numpy() for g in grads]
    total = math.sqrt(sum(float((x * x).sum()) for x in xs))
    factor = min(1.0, max_norm / (total + 1e-6))
    t = gt.clip_global_norm(max_norm)
    before = [g.clone() for g in grads]
    out, states = t.update_many(grads, [t.init(g) for g in grads], [None] * len(grads))
    assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))
    for o, x in zip(out, xs, strict=True):
        assert_close(o, x * factor)
    assert states == [()] * len(grads)


def test_clip_global_norm_is_group_only():
    t = gt.clip_global_norm(1.0)
    assert is_group_only(t) and is_group_only(gt.chain(gt.scale(2.0), t))
    assert not is_group_only(gt.chain(gt.scale(2.0), gt.normalize()))
    with pytest.raises(
        TypeError, match="clip_global_norm needs every gradient its rule matched at once"
    ):
        t.update(torch.ones(2), (), None)


# --------------------------------------------------------------------------- stateful built-ins


def naive_ewma(xs, beta):
    """The EWMA of docs/semantics.md, written as a loop over steps in float64: yields (m, v) after each."""
    out = []
    m = v = None
    for x in xs:
        x = np.asarray(x, dtype=np.float64)
        if m is None:
            m, v = x.copy(), np.zeros_like(x)
        else:
            d = x - m
            m = m + (1 - beta) * d
            v = beta * (v + (1 - beta) * d * d)
        out.append((m.copy(), v.copy()))
    return out


@SETTINGS
@given(
    shape=shapes,
    seed=st.integers(0, 10_000),
    beta=st.floats(0.0, 0.999),
    eps=st.sampled_from([0.0, 1e-8, 1e-3, 0.5]),
    steps=st.integers(1, 7),
)
def test_normalize_matches_naive_loop(shape, seed, beta, eps, steps):
    grads = [rand(shape, seed + k) + 0.3 * k for k in range(steps)]
    outs, state = run(gt.normalize(beta=beta, eps=eps), grads)
    ref = naive_ewma([g.numpy() for g in grads], beta)
    for k, (out, (_m, v)) in enumerate(zip(outs, ref, strict=True)):
        x = grads[k].numpy()
        # DESIGN's bias correction at step t = k + 1: v_hat = v / (1 - beta**(t - 1)).
        v_hat = v / (1 - beta**k) if k > 0 and 1 - beta**k > 0 else v
        with np.errstate(divide="ignore", invalid="ignore"):
            expected = x if k == 0 else x / (np.sqrt(v_hat) + eps)
        if eps == 0.0 and k > 0:
            # 0/0 and x/0 follow IEEE; compare where the std is non-zero only.
            mask = v_hat > 0
            assert_close(out[torch.as_tensor(mask)], expected[mask])
        else:
            assert_close(out, expected)
    assert state["count"] == steps
    assert_close(state["mean"], ref[-1][0])
    assert_close(state["var"], ref[-1][1])


@SETTINGS
@given(
    shape=shapes, seed=st.integers(0, 10_000), beta=st.floats(0.0, 0.999), steps=st.integers(1, 7)
)
def test_ewma_matches_naive_loop(shape, seed, beta, steps):
    grads = [rand(shape, seed + k) for k in range(steps)]
    outs, state = run(gt.ewma(beta=beta), grads)
    ref = naive_ewma([g.numpy() for g in grads], beta)
    for out, (m, _) in zip(outs, ref, strict=True):
        assert_close(out, m)
    # The output is a copy: changing it leaves the state alone.
    outs[-1].add_(1.0)
    assert_close(state["mean"], ref[-1][0])


def test_normalize_first_step_unchanged_and_keeps_low_precision_dtype():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        t = gt.normalize(beta=0.9)
        grads = [rand((3, 4), k, dtype=dtype) for k in range(3)]
        outs, state = run(t, grads, param=torch.zeros(3, 4, dtype=dtype))
        assert torch.equal(outs[0], grads[0])
        assert all(o.dtype == dtype for o in outs)
        assert state["mean"].dtype == torch.float32
        ref = naive_ewma([g.double().numpy() for g in grads], 0.9)
        expected = grads[2].double().numpy() / (np.sqrt(ref[2][1] / (1 - 0.9**2)) + 1e-8)
        # written-down tolerance: the result is rounded once to the gradient's dtype
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
        torch.testing.assert_close(outs[2].double(), torch.as_tensor(expected), rtol=tol, atol=tol)


def test_add_noise_matches_one_generator_advanced_every_update():
    std, seed = 0.7, 1234
    t = gt.add_noise(std, seed=seed)
    shapes_ = [(3, 2), (3, 2), (5,)]
    grads = [rand(s, i) for i, s in enumerate(shapes_)]
    states = [t.init(g) for g in grads]
    ref_gen = torch.Generator().manual_seed(seed)
    for _ in range(3):  # three "steps", each updating the three tensors in order
        for i, g in enumerate(grads):
            before = g.clone()
            out, states[i] = t.update(g, states[i], None)
            assert torch.equal(g, before)
            noise = torch.randn(g.shape, generator=ref_gen, dtype=torch.float64)
            assert_close(out, (g + std * noise).numpy())


def test_add_noise_same_seed_same_noise_and_different_tensors_differ():
    def draw(seed):
        t = gt.add_noise(1.0, seed=seed)
        s1, s2 = t.init(torch.zeros(4)), t.init(torch.zeros(4))
        a, s1 = t.update(torch.zeros(4), s1, None)
        b, s2 = t.update(torch.zeros(4), s2, None)
        return a, b

    a, b = draw(5)
    a2, b2 = draw(5)
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(a, b)
    assert not torch.equal(draw(6)[0], a)


def test_add_noise_state_resume_through_weights_only_load():
    t = gt.add_noise(0.5, seed=3)
    grads = [rand((2, 3), k) for k in range(6)]
    full, _ = run(t, grads)

    t2 = gt.add_noise(0.5, seed=3)
    state = t2.init(grads[0])
    first = []
    for g in grads[:3]:
        out, state = t2.update(g, state, None)
        first.append(out)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    t3 = gt.add_noise(0.5, seed=3)  # fresh generator: only the loaded state makes it resume
    rest = []
    for g in grads[3:]:
        out, loaded = t3.update(g, loaded, None)
        rest.append(out)
    for a, b in zip(full, first + rest, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "factory",
    [
        lambda: gt.normalize(0.9),
        lambda: gt.ewma(0.9),
        lambda: gt.add_noise(0.1, seed=1),
        lambda: gt.chain(gt.normalize(0.5), gt.clip_norm(1.0), gt.add_noise(0.1, 2), gt.scale(3.0)),
        gt.centralize,
        gt.zero,
    ],
)
def test_states_survive_weights_only_save_load(factory):
    t = factory()
    grads = [rand((4, 3), k, dtype=torch.float32) for k in range(5)]
    state = t.init(grads[0])
    for g in grads[:2]:
        _, state = t.update(g, state, None)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    a_state, b_state = copy.deepcopy(state), loaded
    for g in grads[2:]:
        a, a_state = t.update(g, a_state, None)
        b, b_state = t.update(g, b_state, None)
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- chain


@SETTINGS
@given(seed=st.integers(0, 10_000), steps=st.integers(1, 8))
def test_chain_equals_members_applied_one_after_another(seed, steps):
    members = [
        lambda: gt.normalize(beta=0.8),
        lambda: gt.clip_norm(0.5),
        lambda: gt.ewma(beta=0.6),
        lambda: gt.add_noise(0.01, seed=seed),
        lambda: gt.centralize(),
        lambda: gt.scale(-2.0),
    ]
    chained = gt.chain(*(m() for m in members))
    separate = [m() for m in members]
    grads = [rand((3, 4), seed + k) for k in range(steps)]
    c_state = chained.init(grads[0])
    s_states = [t.init(grads[0]) for t in separate]
    for g in grads:
        c_out, c_state = chained.update(g, c_state, None)
        x = g
        for i, t in enumerate(separate):
            x, s_states[i] = t.update(x, s_states[i], None)
        assert torch.equal(c_out, x)
    assert isinstance(c_state, tuple) and len(c_state) == len(members)


def test_chain_order_matters():
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    a = gt.chain(gt.clip_norm(1.0), gt.scale(10.0))
    b = gt.chain(gt.scale(10.0), gt.clip_norm(1.0))
    assert_close(a.update(g, a.init(g), None)[0], [6.0, 8.0], rtol=1e-6)
    assert_close(b.update(g, b.init(g), None)[0], [0.6, 0.8], rtol=1e-6)


def test_chain_forwards_keyword_extras_and_update_many():
    seen = []

    def upd(g, s, p, **extra):
        seen.append(extra)
        return g + 1, s + 1

    counting = gt.Transform(init=lambda p: 0, update=upd)
    t = gt.chain(counting, gt.scale(2.0))
    out, state = t.update(torch.zeros(2), t.init(torch.zeros(2)), None, step=7)
    assert seen == [{"step": 7}] and state == (1, ())
    assert torch.equal(out, torch.full((2,), 2.0))

    # with a group member the chain offers update_many: per-tensor members run on each tensor
    t = gt.chain(gt.scale(2.0), gt.clip_global_norm(1.0), counting)
    grads = [torch.tensor([3.0], dtype=torch.float64), torch.tensor([4.0], dtype=torch.float64)]
    outs, states = t.update_many(grads, [t.init(g) for g in grads], [None, None])
    assert_close(outs[0], [6.0 / (10.0 + 1e-6) + 1.0])
    assert_close(outs[1], [8.0 / (10.0 + 1e-6) + 1.0])
    assert states == [((), (), 1), ((), (), 1)]


def test_stateless_and_custom_transform():
    t = gt.stateless(lambda g, p: g * p)
    out, state = t.update(torch.tensor([2.0]), t.init(torch.tensor([3.0])), torch.tensor([3.0]))
    assert torch.equal(out, torch.tensor([6.0])) and state == ()


# --------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: gt.scale(float("nan")), ValueError, r"scale: s must not be NaN"),
        (lambda: gt.scale(float("inf")), ValueError, r"scale: s must be finite"),
        (lambda: gt.scale("2"), TypeError, r"scale: s must be a real number; got str"),
        (lambda: gt.scale(True), TypeError, r"scale: s must be a real number; got bool"),
        (lambda: gt.clip_norm(0.0), ValueError, r"clip_norm: max_norm must be > 0; got 0.0"),
        (lambda: gt.clip_norm(-1), ValueError, r"clip_norm: max_norm must be > 0"),
        (lambda: gt.clip_value(0), ValueError, r"clip_value: v must be > 0"),
        (lambda: gt.clip_global_norm(-2.0), ValueError, r"clip_global_norm: max_norm must be > 0"),
        (
            lambda: gt.normalize(beta=1.0),
            ValueError,
            r"normalize: beta must be in \[0, 1\); got 1.0",
        ),
        (lambda: gt.normalize(beta=-0.1), ValueError, r"normalize: beta must be in \[0, 1\)"),
        (lambda: gt.normalize(eps=-1e-3), ValueError, r"normalize: eps must be >= 0 and finite"),
        (
            lambda: gt.normalize(eps=None),
            TypeError,
            r"normalize: eps must be a real number; got NoneType",
        ),
        (lambda: gt.ewma(beta=2), ValueError, r"ewma: beta must be in \[0, 1\)"),
        (lambda: gt.add_noise(-1.0), ValueError, r"add_noise: std must be >= 0 and finite"),
        (
            lambda: gt.add_noise(1.0, seed=1.5),
            TypeError,
            r"add_noise: seed must be an int; got float",
        ),
        (lambda: gt.add_noise(1.0, seed=2**70), ValueError, r"add_noise: seed .* out of range"),
        (
            lambda: gt.chain(gt.scale(1.0), "x"),
            TypeError,
            r"chain\(\): argument 1 must be a gradtap Transform",
        ),
        (lambda: gt.stateless(3), TypeError, r"stateless\(fn\): fn must be callable"),
    ],
)
def test_invalid_arguments_raise_at_construction(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# =========================================================================== the driver

import pickle  # noqa: E402

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class SharedNet(nn.Module):
    """enc -> shared -> shared (one module called twice) -> head; float64."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.enc = nn.Linear(3, 4)
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.head(h)


NAMES = ["enc.weight", "enc.bias", "shared.weight", "shared.bias", "head.weight", "head.bias"]


def functional_grads(P, x, y):
    """Per-call gradients by plain autograd: each call of ``shared`` gets its own leaf copies.

    Returns ``{name: [contribution of call 0, call 1, ...]}`` for one micro-batch loss.
    """
    leaves = {
        n: P[n].detach().clone().requires_grad_(True)
        for n in ("enc.weight", "enc.bias", "head.weight", "head.bias")
    }
    calls = [
        (
            P["shared.weight"].detach().clone().requires_grad_(True),
            P["shared.bias"].detach().clone().requires_grad_(True),
        )
        for _ in range(2)
    ]
    h = torch.tanh(F.linear(x, leaves["enc.weight"], leaves["enc.bias"]))
    for w, b in calls:
        h = torch.tanh(F.linear(h, w, b))
    loss = F.mse_loss(F.linear(h, leaves["head.weight"], leaves["head.bias"]), y)
    flat = [*leaves.values(), *[t for wb in calls for t in wb]]
    grads = torch.autograd.grad(loss, flat)
    out = {n: [g] for n, g in zip(leaves, grads[:4], strict=True)}
    out["shared.weight"] = [grads[4], grads[6]]
    out["shared.bias"] = [grads[5], grads[7]]
    return out


def make_rules():
    return {
        "shared.weight": gt.chain(gt.ewma(beta=0.5), gt.scale(2.0)),
        "*.weight": gt.normalize(beta=0.9),
        "*.bias": gt.chain(gt.flip(), gt.clip_norm(0.05)),
    }


def data(steps=2, micro=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (
                torch.randn(5, 3, generator=g, dtype=torch.float64),
                torch.randn(5, 2, generator=g, dtype=torch.float64),
            )
            for _ in range(micro)
        ]
        for _ in range(steps)
    ]


def train_with_gradtap(when, batches, lr=0.1):
    net = SharedNet()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    h = gt.transform(net, make_rules(), when=when, optimizer=opt if when == "step" else None)
    seen = []
    with h:
        for micro in batches:
            for x, y in micro:
                F.mse_loss(net(x), y).backward()
            opt.step()
            seen.append({n: p.grad.clone() for n, p in net.named_parameters()})
            opt.zero_grad()
    return net, seen, h


def train_with_oracle(when, batches, lr=0.1):
    """The same training, with the transforms applied by hand to autograd.grad results."""
    net = SharedNet()
    P = {n: p.detach().clone() for n, p in net.named_parameters()}
    rules = make_rules()
    tr = {
        n: rules["shared.weight"]
        if n == "shared.weight"
        else rules["*.weight"]
        if n.endswith("weight")
        else rules["*.bias"]
        for n in NAMES
    }
    # each parameter gets its own state from the rule's transform
    states = {n: tr[n].init(P[n]) for n in NAMES}

    def T(n, g):
        out, states[n] = tr[n].update(g, states[n], P[n])
        return out

    seen = []
    for micro in batches:
        grad = dict.fromkeys(NAMES)
        for x, y in micro:
            contrib = functional_grads(P, x, y)
            for n in NAMES:
                if when == "backward":
                    # Backward reaches the later call of a shared module first.
                    parts = [T(n, c) for c in reversed(contrib[n])]
                    total = sum(parts[1:], parts[0])
                    grad[n] = total if grad[n] is None else grad[n] + total
                elif when == "accumulate":
                    total = sum(contrib[n][1:], contrib[n][0])
                    grad[n] = T(n, total if grad[n] is None else grad[n] + total)
                else:
                    total = sum(contrib[n][1:], contrib[n][0])
                    grad[n] = total if grad[n] is None else grad[n] + total
        if when == "step":
            grad = {n: T(n, grad[n]) for n in NAMES}
        seen.append({n: grad[n].clone() for n in NAMES})
        P = {n: P[n] - lr * grad[n] for n in NAMES}
    return P, seen


@pytest.mark.parametrize("when", ["backward", "accumulate", "step"])
def test_when_modes_with_shared_module_and_four_micro_batches_match_oracle(when):
    batches = data(steps=3, micro=4)
    net, seen, _ = train_with_gradtap(when, batches)
    P, ref = train_with_oracle(when, batches)
    for step, (got, exp) in enumerate(zip(seen, ref, strict=True)):
        for n in NAMES:
            torch.testing.assert_close(
                got[n], exp[n], rtol=1e-9, atol=1e-12, msg=f"{when} step {step} {n}"
            )
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.detach(), P[n], rtol=1e-9, atol=1e-12)


def test_when_modes_differ_from_each_other():
    # the oracle comparison above is only meaningful if the three modes really differ here
    batches = data(steps=1, micro=4)
    g = {
        when: train_with_gradtap(when, batches)[1][0]["shared.weight"]
        for when in ("backward", "accumulate", "step")
    }
    assert not torch.allclose(g["backward"], g["accumulate"])
    assert not torch.allclose(g["accumulate"], g["step"])
    assert not torch.allclose(g["backward"], g["step"])


def test_plan_first_match_wins_and_order():
    net = SharedNet()
    h = gt.transform(net, make_rules())
    assert h.plan() == {
        "enc.weight": "*.weight",
        "enc.bias": "*.bias",
        "shared.weight": "shared.weight",
        "shared.bias": "*.bias",
        "head.weight": "*.weight",
        "head.bias": "*.bias",
    }
    h.remove()
    h = gt.transform(net, {"shared": gt.flip(), "*": gt.scale(2.0)}, on="grad_output")
    assert h.plan() == {"enc": "*", "shared": "shared", "head": "*"}
    assert h.when == "backward"
    h.remove()


def test_clip_global_norm_at_step_matches_torch_clip_grad_norm():
    batches = data(steps=2, micro=2, seed=3)
    net, ref = SharedNet(), SharedNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    with gt.transform(net, {"*.weight": gt.clip_global_norm(0.01)}, when="step", optimizer=opt):
        for micro in batches:
            for x, y in micro:
                F.mse_loss(net(x), y).backward()
                F.mse_loss(ref(x), y).backward()
            weights = [p for n, p in ref.named_parameters() if n.endswith("weight")]
            total = torch.nn.utils.clip_grad_norm_(weights, 0.01)
            assert total > 0.01  # the clip is active
            opt.step()
            ref_opt.step()
            for (n, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=n)
            opt.zero_grad()
            ref_opt.zero_grad()


class Branches(nn.Module):
    """Two branches ``a`` and ``b``; ``forward(x, use_b)`` may leave ``b`` out; float64."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.a = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        self.b = nn.Linear(3, 2)
        self.double()

    def forward(self, x, use_b=True):
        out = self.a(x)
        return out + self.b(x) if use_b else out


def _clip_ref(ref: nn.Module, pattern: str, max_norm: float) -> torch.Tensor:
    """The oracle: torch's clip_grad_norm_ over the parameters ``pattern`` names (None grads skipped)."""
    import fnmatch

    chosen = [p for n, p in ref.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
    return torch.nn.utils.clip_grad_norm_(chosen, max_norm)


def _assert_same_grads(net: nn.Module, ref: nn.Module) -> None:
    for (n, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=n)


@pytest.mark.parametrize("max_norm", [0.01, 1e3])
def test_clip_global_norm_on_accumulate_matches_clip_grad_norm_after_backward(max_norm, device):
    # one backward per step, next to a per-tensor rule on the biases
    batches = [[(x.to(device), y.to(device)) for x, y in micro]
               for micro in data(steps=3, micro=1, seed=5)]
    net, ref = SharedNet().to(device), SharedNet().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    rules = {"*.weight": gt.clip_global_norm(max_norm), "*.bias": gt.scale(0.5)}
    with gt.transform(net, rules) as h:  # when="accumulate" is the default
        assert h.when == "accumulate"
        for (x, y), in batches:
            F.mse_loss(net(x), y).backward()
            F.mse_loss(ref(x), y).backward()
            total = _clip_ref(ref, "*.weight", max_norm)
            assert (total > max_norm) == (max_norm < 1)  # the clip is active only for the small bound
            for q in (ref.enc.bias, ref.shared.bias, ref.head.bias):
                q.grad = q.grad * 0.5
            _assert_same_grads(net, ref)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    assert hook_free(net)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_clip_global_norm_on_accumulate_clips_the_running_sum_after_each_backward(set_to_none):
    # Several backwards before a step: after each one, the accumulated .grad of the rule's
    # parameters (the already clipped earlier part included) is clipped, i.e. clip_grad_norm_
    # after every backward. A parameter reached only by the first backward is still part of
    # the second one's norm, because its .grad is.
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(6, 3, generator=g, dtype=torch.float64) for _ in range(4)]
    net, ref = Branches(), Branches()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with gt.transform(net, {"*": gt.clip_global_norm(0.05)}):
        for step in range(2):
            for use_b in (True, False):
                x = xs[2 * step + use_b]
                net(x, use_b).square().sum().backward()
                ref(x, use_b).square().sum().backward()
                assert _clip_ref(ref, "*", 0.05) > 0.05
                _assert_same_grads(net, ref)
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            ref_opt.zero_grad(set_to_none=set_to_none)
    # not the same as clipping the sum of the two backwards once (that is when="step")
    once, fresh = Branches(), Branches()
    with gt.transform(fresh, {"*": gt.clip_global_norm(0.05)}):
        for use_b in (True, False):
            once(xs[use_b], use_b).square().sum().backward()
            fresh(xs[use_b], use_b).square().sum().backward()
    _clip_ref(once, "*", 0.05)
    assert not torch.allclose(fresh.b.weight.grad, once.b.weight.grad)


@pytest.mark.parametrize("when", ["accumulate", "step"])
def test_clip_global_norm_skips_parameters_without_grad(when):
    # b never takes part: its .grad stays None and does not enter the norm; a rule whose
    # parameters a backward does not reach leaves them alone.
    g = torch.Generator().manual_seed(8)
    net, ref = Branches(), Branches()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # steps leave net equal to ref
    rules = {"a.*": gt.clip_global_norm(0.1), "b.*": gt.clip_global_norm(0.1)}
    with gt.transform(net, rules, when=when, optimizer=opt if when == "step" else None):
        for _ in range(2):
            x = torch.randn(6, 3, generator=g, dtype=torch.float64)
            net(x, use_b=False).square().sum().backward()
            ref(x, use_b=False).square().sum().backward()
            if when == "step":
                opt.step()
            assert _clip_ref(ref, "a.*", 0.1) > 0.1
            assert net.b.weight.grad is None and net.b.bias.grad is None
            _assert_same_grads(net, ref)
            net.zero_grad()
            ref.zero_grad()


@pytest.mark.parametrize("when", ["accumulate", "step"])
def test_clip_global_norm_in_a_chain_runs_after_the_members_before_it(when):
    batches = data(steps=2, micro=1, seed=9)
    net, ref = SharedNet(), SharedNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    rules = {"*": gt.chain(gt.scale(2.0), gt.clip_global_norm(0.1), gt.scale(0.25))}
    with gt.transform(net, rules, when=when, optimizer=opt if when == "step" else None):
        for (x, y), in batches:
            F.mse_loss(net(x), y).backward()
            F.mse_loss(ref(x), y).backward()
            for q in ref.parameters():
                q.grad = q.grad * 2.0
            assert _clip_ref(ref, "*", 0.1) > 0.1
            for q in ref.parameters():
                q.grad = q.grad * 0.25
            opt.step()
            ref_opt.step()
            _assert_same_grads(net, ref)
            torch.testing.assert_close(net.enc.weight, ref.enc.weight, rtol=1e-12, atol=1e-15)
            opt.zero_grad()
            ref_opt.zero_grad()


def test_clip_global_norm_on_accumulate_waits_for_the_end_of_a_reentrant_checkpointed_backward():
    # With use_reentrant=True the checkpointed segment's gradients are accumulated inside a
    # nested backward; the clip must still see every gradient of the outer one.
    from torch.utils.checkpoint import checkpoint

    class Ckpt(SharedNet):
        def forward(self, x):
            h = torch.tanh(self.enc(x))
            h = checkpoint(lambda t: torch.tanh(self.shared(torch.tanh(self.shared(t)))), h,
                           use_reentrant=True)
            return self.head(h)

    x, y = rand((5, 3), 11), rand((5, 2), 12)
    net, ref = Ckpt(), SharedNet()
    with gt.transform(net, {"*": gt.clip_global_norm(0.01)}):
        F.mse_loss(net(x), y).backward()
    F.mse_loss(ref(x), y).backward()
    assert _clip_ref(ref, "*", 0.01) > 0.01
    _assert_same_grads(net, ref)


def test_clip_global_norm_on_accumulate_is_gone_after_remove():
    x = rand((5, 3), 13)
    net = Branches()
    h = gt.transform(net, {"*": gt.clip_global_norm(1e-3)})
    h.remove()
    assert hook_free(net)
    net(x).square().sum().backward()
    ref = Branches()
    ref(x).square().sum().backward()
    _assert_same_grads(net, ref)


def test_bad_update_many_output_on_accumulate_names_the_rule_and_parameter():
    from gradtap._transform.base import _mark_group_only

    def update(g, s, p):
        raise AssertionError("not called")

    bad = gt.Transform(
        lambda p: (), _mark_group_only(update), lambda gs, ss, ps: ([g.sum() for g in gs], list(ss))
    )
    net = SharedNet()
    with gt.transform(net, {"head.*": bad}):
        with pytest.raises(
            ValueError,
            match=r"rule 'head\.\*' on parameter 'head\.weight': the transform returned shape \(\), torch\.float64",
        ):
            F.mse_loss(net(rand((2, 3), 0)), rand((2, 2), 1)).backward()


# --------------------------------------------------------------------------- activation gradients


class EncHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.encoder = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4))
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(4, 2))
        self.double()

    def forward(self, x):
        return self.head(self.encoder(x))


def grads_of(net, x, y):
    x = x.clone().requires_grad_(True)
    net.zero_grad(set_to_none=True)
    F.mse_loss(net(x), y).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}, x.grad.clone()


@pytest.mark.parametrize("on", ["grad_output", "grad_input"])
def test_gradient_reversal_negates_every_upstream_gradient(on):
    net = EncHead()
    x, y = rand((6, 3), 1), rand((6, 2), 2)
    plain, plain_x = grads_of(net, x, y)
    # flip what the encoder receives, or what the head sends back: the same cut
    rules = {"encoder": gt.flip()} if on == "grad_output" else {"head": gt.flip()}
    with gt.transform(net, rules, on=on):
        flipped, flipped_x = grads_of(net, x, y)
    assert torch.equal(flipped_x, -plain_x)
    for n in plain:
        if n.startswith("encoder."):
            assert torch.equal(flipped[n], -plain[n]), n
        else:
            assert torch.equal(flipped[n], plain[n]), n
    # removed: back to the plain gradients
    after, after_x = grads_of(net, x, y)
    assert torch.equal(after_x, plain_x) and all(torch.equal(after[n], plain[n]) for n in plain)


def test_stateful_grad_output_transform_matches_oracle():
    net, ref = EncHead(), EncHead()
    steps = [(rand((6, 3), 10 + k), rand((6, 2), 20 + k)) for k in range(4)]
    t = gt.chain(gt.normalize(beta=0.8), gt.clip_norm(2.0))
    h = gt.transform(net, {"encoder": t}, on="grad_output")
    ot = gt.chain(gt.normalize(beta=0.8), gt.clip_norm(2.0))
    state = None
    for x, y in steps:
        got, _ = grads_of(net, x, y)
        # oracle: dL/d(encoder output) by autograd.grad, transformed, then pushed through
        enc_params = list(ref.encoder.parameters())
        z = ref.encoder(x)
        loss = F.mse_loss(ref.head(z), y)
        gz, *head_grads = torch.autograd.grad(loss, [z, *ref.head.parameters()], retain_graph=True)
        if state is None:
            state = ot.init(gz)
        tz, state = ot.update(gz, state, None)
        enc_grads = torch.autograd.grad(z, enc_params, grad_outputs=tz)
        exp = dict(
            zip([f"encoder.{n}" for n, _ in ref.encoder.named_parameters()], enc_grads, strict=True)
        )
        exp.update(
            zip([f"head.{n}" for n, _ in ref.head.named_parameters()], head_grads, strict=True)
        )
        for n in exp:
            torch.testing.assert_close(got[n], exp[n], rtol=1e-10, atol=1e-13, msg=n)
    assert set(h.state_dict()["state"]) == {"encoder:output"}
    h.remove()


# --------------------------------------------------------------------------- checkpoint / resume


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(
    ("when", "on", "rules"),
    [
        (
            "accumulate",
            "param_grad",
            lambda: {
                "shared.*": gt.chain(gt.normalize(0.9), gt.add_noise(0.01, seed=7)),
                "*": gt.ewma(0.7),
            },
        ),
        (
            "backward",
            "param_grad",
            lambda: {"*.weight": gt.chain(gt.ewma(0.6), gt.normalize(0.5), gt.clip_norm(1.0))},
        ),
        (
            "step",
            "param_grad",
            lambda: {
                "*.weight": gt.chain(
                    gt.normalize(0.9), gt.clip_global_norm(0.5), gt.add_noise(0.001, 1)
                )
            },
        ),
        (
            "backward",
            "grad_output",
            lambda: {"shared": gt.chain(gt.normalize(0.9), gt.add_noise(0.01, 3))},
        ),
    ],
)
def test_checkpoint_resume_gives_the_same_gradients_as_never_stopping(when, on, rules):
    batches = data(steps=6, micro=2, seed=11)

    def make():
        net = SharedNet()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        h = gt.transform(net, rules(), when=when, on=on, optimizer=opt if when == "step" else None)
        return net, opt, h

    def train(net, opt, part):
        grads = []
        for micro in part:
            for x, y in micro:
                F.mse_loss(net(x), y).backward()
            opt.step()
            grads.append([p.grad.clone() for p in net.parameters()])
            opt.zero_grad()
        return grads

    net, opt, h = make()
    straight = train(net, opt, batches)
    h.remove()

    net, opt, h = make()
    first = train(net, opt, batches[:3])
    ckpt = _save_load(
        {"model": net.state_dict(), "opt": opt.state_dict(), "transform": h.state_dict()}
    )
    h.remove()
    del net, opt, h
    net, opt, h = make()
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    h.load_state_dict(ckpt["transform"])
    rest = train(net, opt, batches[3:])
    h.remove()
    for k, (a, b) in enumerate(zip(straight, first + rest, strict=True)):
        for ga, gb in zip(a, b, strict=True):
            assert torch.equal(ga, gb), f"step {k}"

    # without loading the transform state, the resumed run differs (the test can fail)
    net, opt, h = make()
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    fresh = train(net, opt, batches[3:])
    h.remove()
    assert not all(torch.equal(a, b) for a, b in zip(fresh[0], rest[0], strict=True))


def test_state_dict_is_a_copy_and_load_checks_the_plan():
    net = SharedNet()
    h = gt.transform(net, {"*.weight": gt.normalize()})
    sd = h.state_dict()
    assert sd["plan"] == h.plan() and sd["on"] == "param_grad" and sd["when"] == "accumulate"
    F.mse_loss(net(rand((2, 3), 0)), rand((2, 2), 1)).backward()
    F.mse_loss(net(rand((2, 3), 2)), rand((2, 2), 3)).backward()
    assert sd["state"]["enc.weight"]["count"] == 0  # the copy did not move on
    h.remove()

    other = gt.transform(net, {"*.bias": gt.normalize()})
    with pytest.raises(
        ValueError, match=r"load_state_dict: the checkpoint's plan differs .*missing \['enc.bias'"
    ):
        other.load_state_dict(sd)
    other.remove()
    changed = gt.transform(net, {"*.weight": gt.chain(gt.normalize(), gt.scale(1.0))})
    bad = copy.deepcopy(sd)
    with pytest.raises(
        ValueError,
        match=r"load_state_dict: state 'enc.weight' holds dict; expected a tuple of 2 parts",
    ):
        changed.load_state_dict(bad)
    renamed = copy.deepcopy(sd)
    renamed["state"]["enc.weight"]["avg"] = renamed["state"]["enc.weight"].pop("mean")
    with pytest.raises(
        ValueError,
        match=r"state 'enc.weight' holds keys \['avg', 'count', 'var'\]; expected keys \['count', 'mean', 'var'\]",
    ):
        h2 = gt.transform(net, {"*.weight": gt.normalize()})
        try:
            h2.load_state_dict(renamed)
        finally:
            h2.remove()
    with pytest.raises(ValueError, match=r"load_state_dict: checkpoint has on='param_grad'"):
        gt.transform(net, {"enc": gt.flip()}, on="grad_output").load_state_dict(sd)
    with pytest.raises(ValueError, match=r"expected a dict made by TransformHandle.state_dict"):
        changed.load_state_dict({"x": 1})
    wrong_shape = copy.deepcopy(sd)
    wrong_shape["state"]["enc.weight"] = (
        {"count": 1, "mean": torch.zeros(2), "var": torch.zeros(2)},
        (),
    )
    with pytest.raises(
        ValueError,
        match=r"state 'enc.weight'\[0\]\['mean'\] holds shape \(2,\); expected a tensor of shape \(4, 3\)",
    ):
        changed.load_state_dict(wrong_shape)
    changed.remove()


# --------------------------------------------------------------------------- hygiene


def hook_free(net: nn.Module) -> bool:
    for m in net.modules():
        for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
            if d:
                return False
    return all(
        not p._backward_hooks and not p._post_accumulate_grad_hooks for p in net.parameters()
    )


@pytest.mark.parametrize(
    ("when", "on"),
    [
        ("accumulate", "param_grad"),
        ("backward", "param_grad"),
        ("step", "param_grad"),
        (None, "grad_output"),
        (None, "grad_input"),
    ],
)
def test_remove_and_exit_restore_the_model(when, on):
    net = SharedNet()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rules = {"*": gt.flip()} if on == "param_grad" else {"shared": gt.flip()}
    kwargs = {"optimizer": opt} if when == "step" else {}
    with (
        pytest.raises(RuntimeError, match="boom"),
        gt.transform(net, rules, when=when, on=on, **kwargs),
    ):
        F.mse_loss(net(rand((2, 3), 0)), rand((2, 2), 1)).backward()
        raise RuntimeError("boom")
    assert hook_free(net) and not opt._optimizer_step_pre_hooks
    h = gt.transform(net, rules, when=when, on=on, **kwargs)
    h.remove()
    h.remove()  # idempotent
    assert hook_free(net) and not opt._optimizer_step_pre_hooks
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    pickle.dumps(net)
    # and the gradients are plain again
    ref = SharedNet()
    net.zero_grad(set_to_none=True)
    x, y = rand((2, 3), 5), rand((2, 2), 6)
    F.mse_loss(net(x), y).backward()
    F.mse_loss(ref(x), y).backward()
    assert all(
        torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters(), strict=True)
    )


# --------------------------------------------------------------------------- driver errors


def _wrong(kind):
    if kind == "shape":
        return gt.Transform(init=lambda p: (), update=lambda g, s, p: (g.sum(), s))
    if kind == "dtype":
        return gt.Transform(init=lambda p: (), update=lambda g, s, p: (g.float(), s))
    if kind == "not a pair":
        return gt.Transform(init=lambda p: (), update=lambda g, s, p: g)
    return gt.Transform(init=lambda p: (), update=lambda g, s, p: (None, s))


@pytest.mark.parametrize("when", ["accumulate", "backward", "step"])
@pytest.mark.parametrize(
    ("kind", "exc", "match"),
    [
        (
            "shape",
            ValueError,
            r"rule 'shared\.w\*' on parameter 'shared\.weight': the transform returned shape \(\), torch\.float64, cpu; expected shape \(4, 4\), torch\.float64",
        ),
        (
            "dtype",
            ValueError,
            r"rule 'shared\.w\*' on parameter 'shared\.weight': the transform returned shape \(4, 4\), torch\.float32, cpu; expected shape \(4, 4\), torch\.float64",
        ),
        (
            "not a pair",
            TypeError,
            r"rule 'shared\.w\*' on parameter 'shared\.weight': update must return a pair \(new_grad, new_state\); got Tensor",
        ),
        (
            "none",
            TypeError,
            r"rule 'shared\.w\*' on parameter 'shared\.weight': the transform returned NoneType as the new gradient",
        ),
    ],
)
def test_bad_transform_output_names_the_rule(when, kind, exc, match):
    net = SharedNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gt.transform(
        net, {"shared.w*": _wrong(kind)}, when=when, optimizer=opt if when == "step" else None
    ):
        with pytest.raises(exc, match=match):
            F.mse_loss(net(rand((2, 3), 0)), rand((2, 2), 1)).backward()
            opt.step()
    assert hook_free(net)


def test_bad_activation_transform_output_names_the_rule_and_slot():
    net = SharedNet()
    with gt.transform(net, {"enc": _wrong("shape")}, on="grad_output"):
        with pytest.raises(
            ValueError,
            match=r"rule 'enc' on grad_output 'enc:output': the transform returned shape \(\)",
        ):
            F.mse_loss(net(rand((2, 3), 0)), rand((2, 2), 1)).backward()


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"when": "step"},
            ValueError,
            r"when='step' transforms gradients right before optimizer\.step\(\); pass optimizer=",
        ),
        (
            {"on": "grad_outputs"},
            ValueError,
            r"unknown on='grad_outputs'; expected one of 'param_grad', 'grad_output', 'grad_input'",
        ),
        (
            {"when": "later"},
            ValueError,
            r"unknown when='later'; expected one of 'backward', 'accumulate', 'step'",
        ),
        (
            {"on": "grad_output", "when": "accumulate", "rules": {"enc": gt.flip()}},
            ValueError,
            r"on='grad_output' .* only when='backward' applies; got when='accumulate'",
        ),
        (
            {"optimizer": "OPT"},
            ValueError,
            r"optimizer= is only used with when='step'; got when='accumulate'",
        ),
        (
            {"when": "step", "optimizer": object()},
            TypeError,
            r"optimizer must be a torch\.optim\.Optimizer; got object",
        ),
        (
            {"rules": {"*.wieght": gt.flip()}},
            gt.SelectionError,
            r"select='\*\.wieght' matches no parameter; closest",
        ),
        (
            {"rules": {"encoder": gt.flip()}, "on": "grad_output"},
            gt.SelectionError,
            r"select='encoder' matches no module",
        ),
        (
            {"rules": {"*": gt.flip(), "*.bias": gt.zero()}},
            gt.SelectionError,
            r"rule '\*\.bias' applies to no parameter: every parameter it matches \(enc\.bias, shared\.bias, head\.bias\) was taken by the earlier rule\(s\) '\*'",
        ),
        (
            {
                "rules": {"*.weight": gt.chain(gt.scale(2.0), gt.clip_global_norm(1.0))},
                "when": "backward",
            },
            ValueError,
            r"rule '\*\.weight': clip_global_norm needs every gradient the rule matched at once; "
            r"when='backward' transforms each call's contribution as it arrives \(use "
            r"when='accumulate' to clip after each backward, when='step' to clip before each "
            r"optimizer step, or clip_norm for a per-tensor bound\)",
        ),
        (
            {"rules": {"enc": gt.clip_global_norm(1.0)}, "on": "grad_input"},
            ValueError,
            r"rule 'enc': clip_global_norm .* on='grad_input'",
        ),
        (
            {"rules": {"*.bias": 0.1}},
            TypeError,
            r"rule '\*\.bias': expected a gradtap Transform \(e\.g\. gt\.scale\(0\.1\)\); got float",
        ),
        ({"rules": {}}, ValueError, r"rules is empty"),
        ({"rules": "*"}, TypeError, r"rules must be a mapping \{glob: Transform\}; got str"),
        (
            {"rules": [("*", gt.flip()), "x"]},
            TypeError,
            r"sequence of \(glob, Transform\) pairs; item 1 is str",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, exc, match):
    net = SharedNet()
    kwargs = dict(kwargs)
    if kwargs.get("optimizer") == "OPT":
        kwargs["optimizer"] = torch.optim.SGD(net.parameters(), lr=0.1)
    rules = kwargs.pop("rules", {"*": gt.flip()})
    with pytest.raises(exc, match=match):
        gt.transform(net, rules, **kwargs)
    assert hook_free(net)


def test_frozen_parameters_and_optimizer_membership():
    net = SharedNet()
    net.enc.weight.requires_grad_(False)
    net.enc.bias.requires_grad_(False)
    h = gt.transform(net, {"*": gt.flip()})
    assert "enc.weight" not in h.plan() and "shared.weight" in h.plan()
    h.remove()
    with pytest.raises(
        gt.SelectionError,
        match=r"rule 'enc\.\*' matches only parameters that do not require grad \(enc\.weight, enc\.bias\)",
    ):
        gt.transform(net, {"enc.*": gt.flip()})
    opt = torch.optim.SGD(net.head.parameters(), lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"rule\(s\) '\*': parameter\(s\) shared\.weight, shared\.bias are not in the optimizer's param_groups",
    ):
        gt.transform(net, {"*": gt.flip()}, when="step", optimizer=opt)
    assert hook_free(net)


def test_tied_weights_and_unassigned_handle_in_backward_mode():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(4)
            self.a = nn.Linear(3, 3, bias=False)
            self.b = nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight
            self.double()

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    net = Tied()
    x = rand((4, 3), 0)
    net(x).square().sum().backward()
    plain = net.a.weight.grad.clone()
    net.zero_grad()
    # The README's one-liner style: the handle is not kept, the transform still applies
    gt.transform(net, {"*": gt.scale(3.0)}, when="backward")
    net(x).square().sum().backward()
    torch.testing.assert_close(net.a.weight.grad, 3.0 * plain, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- benchmark smoke test


def test_benchmark_quick_runs_and_prints_the_table(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "transform_overhead.py"
    spec = importlib.util.spec_from_file_location("transform_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        assert module.main(["--quick"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| variant | ms / step | ratio vs plain |" in out
    for row in ("plain step", "when='accumulate'", "when='backward'", "when='step'"):
        assert row in out
    assert module.main(["--quick", "--clip-norm"]) == 0
    out = capsys.readouterr().out
    assert "(27 tensors)" in out
    for row in ("| plain step |", "| clip_norm, one pass per backward |",
                "| clip_norm, one tensor at a time |"):
        assert row in out


def test_backward_mode_refuses_a_parameter_used_outside_its_module():
    class Outside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3, bias=False)

        def forward(self, x):
            return torch.tanh(x @ self.a.weight.T)  # the weight, but no call of `a`

    net = Outside()
    with gt.transform(net, {"a.weight": gt.scale(2.0)}, when="backward"):
        with pytest.raises(
            ValueError,
            match=r"rule 'a\.weight' on parameter 'a\.weight': when='backward' .* module that owns it \('a'\), but this backward gave it a gradient with no such call",
        ):
            net(torch.randn(2, 3)).sum().backward()
    # the same rule with when='accumulate' applies
    net.zero_grad(set_to_none=True)
    x = torch.randn(2, 3)
    net(x).sum().backward()
    plain = net.a.weight.grad.clone()
    net.zero_grad(set_to_none=True)
    with gt.transform(net, {"a.weight": gt.scale(2.0)}, when="accumulate"):
        net(x).sum().backward()
    torch.testing.assert_close(net.a.weight.grad, 2.0 * plain)
