"""Spike control in the driver: no host sync per step, unscaled gradients under AMP,
``h.last_factors``, checkpoints, chains, the other moments and clear errors."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch.overrides import TorchFunctionMode

import gradtap as gt
from tests._spike_oracles import SPIKES_ALL, loss_at, make_net, make_opt

# Calls that make the host wait for the device (or read a device value on the host).
SYNCING = {"item", "tolist", "__bool__", "cpu", "__float__", "__int__", "__index__", "numpy",
           "nonzero", "masked_select", "argwhere", "unique", "__complex__"}


class CountSyncs(TorchFunctionMode):
    """Counts tensor calls that sync with the host while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(device: torch.device):
    """Count syncing calls; on CUDA also make torch raise on any synchronising operation."""
    mode = CountSyncs()
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        with mode:
            yield mode
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def all_rules() -> dict:
    return {
        "conv.weight": gt.zclip(warmup=3),
        "conv.bias": gt.zclip(warmup=3, per_tensor=True, max_norm=1.0, mode="percentile"),
        "fc.weight": gt.adagc(warmup=3),
        "fc.bias": gt.chain(gt.agc(), gt.adagn()),
        "head.*": gt.agc(clip=0.05),
    }


def test_the_counter_sees_syncs():
    t = torch.ones(3)
    with CountSyncs() as mode:
        float(t.sum()), t.tolist(), bool(t[0] > 0)
    assert mode.calls == ["__float__", "tolist", "__bool__"]


@pytest.mark.parametrize("when", ["accumulate", "step"])
def test_no_host_sync_in_a_step(when, device):
    net = make_net(dtype=torch.float32).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)  # itself sync-free (checked below)
    rules = all_rules()
    with gt.transform(net, rules, when=when, optimizer=opt if when == "step" else None) as h:
        for step in range(8):
            loss = loss_at(net, step).to(device)  # data made on the host: not counted
            with counting(device) as mode:
                loss.backward()
                opt.step()
                factors = h.last_factors
            opt.zero_grad()
            assert mode.calls == [], (step, mode.calls)
    assert sorted(factors) == sorted(n for n, _ in net.named_parameters())
    # the bare step is sync-free too, so the count above is the transforms' own
    with counting(device) as mode:
        loss_at(net, 0).to(device).backward()
        opt.step()
    assert mode.calls == []


def test_spam_clip_reads_adam_state_without_sync():
    # Adam's own step reads its step count on the host; count only the transform's work,
    # between a step pre-hook registered before the handle's and one registered after it.
    net = make_net(dtype=torch.float32)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    modes: list[CountSyncs] = []
    opt.register_step_pre_hook(lambda *a: modes.append(CountSyncs().__enter__()))
    with gt.transform(net, {"*": gt.spam_clip(threshold=10)}, when="step", optimizer=opt) as h:
        opt.register_step_pre_hook(lambda *a: modes[-1].__exit__(None, None, None))
        for step in range(4):
            loss_at(net, step).backward()
            opt.step()
            opt.zero_grad()
        assert float(min(h.last_factors.values())) < 1.0  # it clipped
    assert len(modes) == 4 and all(m.calls == [] for m in modes), [m.calls for m in modes]


# ------------------------------------------------------------------------------------------ AMP

SCALE = 1024.0


def _amp_run(rules_fn, when: str, use_scaler: bool, tell_gradtap: bool, fused: bool = False):
    net = make_net(dtype=torch.float32)
    opt = (torch.optim.Adam(net.parameters(), lr=1e-3, fused=True) if fused
           else torch.optim.Adam(net.parameters(), lr=1e-3))
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=use_scaler)
    factors = []
    with gt.transform(net, rules_fn(), when=when, optimizer=opt if when == "step" else None,
                      scaler=scaler if tell_gradtap else None) as h:
        for step in range(32):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_at(net, step)
            scaler.scale(loss.float()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            factors.append({n: float(f) for n, f in h.last_factors.items()})
    return net, factors


AMP_RULES = {
    "zclip": lambda: {"*": gt.zclip(warmup=5)},
    "adagc": lambda: {"*": gt.adagc(warmup=5)},
    "agc+adagn": lambda: {"*.weight": gt.agc(), "*": gt.adagn()},
    "spam_clip": lambda: {"*": gt.spam_clip(threshold=20)},
}


@pytest.mark.parametrize(("rules", "when", "fused"), [
    (rules, when, fused) for rules in AMP_RULES
    for when, fused in (("accumulate", False), ("step", False), ("step", True))
    if when == "step" or rules != "spam_clip"])  # spam_clip: when="step" only
def test_under_amp_the_rules_see_unscaled_gradients(rules, when, fused):
    rules_fn = AMP_RULES[rules]
    # The scale is a power of two: with scaler= the run is the unscaled run exactly.
    plain, want = _amp_run(rules_fn, when, use_scaler=False, tell_gradtap=False, fused=fused)
    net, got = _amp_run(rules_fn, when, use_scaler=True, tell_gradtap=True, fused=fused)
    assert got == want
    for p, q in zip(net.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    if rules in ("zclip", "adagc"):
        assert any(f < 0.5 for f in got[SPIKES_ALL[0]].values())
    # Without scaler= the rules see scale * g where the gradient is still scaled (before the
    # scaler's unscale_, or with a fused optimizer that unscales inside its step): the check
    # can fail. A plain optimizer's when="step" comes after scaler.step's unscale_ anyway.
    _, blind = _amp_run(rules_fn, when, use_scaler=True, tell_gradtap=False, fused=fused)
    assert (blind != want) == (when == "accumulate" or fused)


# -------------------------------------------------------------------------- last_factors, state

def test_last_factors_start_at_one_cover_spike_rules_only_and_multiply_in_a_chain():
    net = make_net()
    rules = {"conv.*": gt.chain(gt.agc(clip=1e-3), gt.scale(2.0), gt.adagn()),
             "fc.*": gt.normalize(), "head.*": gt.zclip()}
    with gt.transform(net, rules) as h:
        assert {n: float(f) for n, f in h.last_factors.items()} == {
            "conv.weight": 1.0, "conv.bias": 1.0, "head.weight": 1.0, "head.bias": 1.0}
        loss_at(net, 0).backward()
        state = h.state_dict()["state"]["conv.weight"]
        agc_f, adagn_f = state[0]["factor"], state[2]["factor"]
        assert float(agc_f) < 1.0
        torch.testing.assert_close(h.last_factors["conv.weight"], agc_f * adagn_f)
        assert all(f.dim() == 0 for f in h.last_factors.values())


def test_checkpoint_resume_reproduces_the_straight_run():
    def make():
        net = make_net()
        opt = make_opt(net, "adam")
        rules = {"conv.*": gt.zclip(warmup=5), "fc.*": gt.adagc(warmup=5),
                 "head.weight": gt.chain(gt.agc(), gt.adagn()),
                 "head.bias": gt.spam_clip(threshold=30)}
        return net, opt, gt.transform(net, rules, when="step", optimizer=opt)

    def train(net, opt, h, steps):
        out = []
        for step in steps:
            loss_at(net, step).backward()
            opt.step()
            opt.zero_grad()
            out.append({n: f.clone() for n, f in h.last_factors.items()})
        return out

    net, opt, h = make()
    straight = train(net, opt, h, range(45))
    h.remove()
    net, opt, h = make()
    first = train(net, opt, h, range(30))
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "h": h.state_dict()}, buf)
    h.remove()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    net, opt, h = make()
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    h.load_state_dict(ckpt["h"])
    # a rule's tensors still share one history after loading
    e = h._states.entries
    assert e["conv.weight"].state["mean"] is e["conv.bias"].state["mean"]
    rest = train(net, opt, h, range(30, 45))
    h.remove()
    for s, (a, b) in enumerate(zip(straight, first + rest)):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a), s


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(3, 4).double()
        self.a = torch.nn.Linear(4, 1).double()
        self.b = torch.nn.Linear(4, 1).double()

    def forward(self, x, head):
        return getattr(self, head)(torch.tanh(self.body(x)))


def test_accumulate_transforms_what_each_backward_reached_as_one_by_one():
    # Two backwards per step; the second does not reach head b. At when="accumulate" a
    # per-tensor rule transforms, after each backward, the running sum of the parameters it
    # reached, exactly as a post-accumulate hook per parameter would.
    from tests._spike_oracles import adagn_ref

    def batches(step):
        g = torch.Generator().manual_seed(step)
        return [(torch.randn(5, 3, generator=g, dtype=torch.float64), head) for head in "ab"]

    net = TwoHeads()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gt.transform(net, {"*": gt.adagn()}) as h:
        for step in range(4):
            for x, head in batches(step):
                net(x, head).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        counts = {n: e.state["count"] for n, e in h._states.entries.items()}
    assert counts == {"body.weight": 8, "body.bias": 8, "a.weight": 4, "a.bias": 4,
                      "b.weight": 4, "b.bias": 4}

    ref_net = TwoHeads()
    ref_opt = torch.optim.SGD(ref_net.parameters(), lr=0.1)
    refs = {n: (adagn_ref(), 0) for n, _ in ref_net.named_parameters()}
    for step in range(4):
        for x, head in batches(step):
            ref_net(x, head).pow(2).sum().backward()
            for n, p in ref_net.named_parameters():
                reached = n.startswith("body") or n.startswith(head)
                if reached:
                    ref, t = refs[n]
                    ref(t, [(n, p)], None)
                    refs[n] = (ref, t + 1)
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15)


def test_one_rule_over_tensors_of_several_dtypes():
    ga, gb = torch.ones(3), torch.full((2,), 2.0, dtype=torch.float64)
    params = [torch.zeros(3), torch.zeros(2, dtype=torch.float64)]
    t = gt.zclip(warmup=1, max_norm=0.1)  # warm-up step: clip_grad_norm_'s factor
    (oa, ob), states = t.update_many([ga, gb], [t.init(p) for p in params], params)
    want = 0.1 / (11 ** 0.5 + 1e-6)
    assert (oa.dtype, ob.dtype) == (torch.float32, torch.float64)
    torch.testing.assert_close(oa, ga * want)
    # the float32 tensor's norm is taken in float32: the shared factor to float32 precision
    torch.testing.assert_close(ob, gb * want, rtol=1e-6, atol=0)
    t = gt.zclip(warmup=1, max_norm=0.1, per_tensor=True)
    (oa, ob), _ = t.update_many([ga, gb], [t.init(p) for p in params], params)
    torch.testing.assert_close(ob, gb * (0.1 / (8 ** 0.5 + 1e-6)), rtol=1e-12, atol=0)
    torch.testing.assert_close(oa, ga * (0.1 / (3 ** 0.5 + 1e-6)))


def test_other_moments_and_activation_gradients():
    # when="backward": each call's contribution; on="grad_output": an activation's gradient
    net = make_net()
    with gt.transform(net, {"*": gt.chain(gt.agc(), gt.adagn())}, when="backward") as h:
        for step in range(3):
            loss_at(net, step).backward()
        assert len(h.last_factors) == 6
    with gt.transform(net, {"fc": gt.zclip(warmup=2, per_tensor=True)}, on="grad_output") as h:
        for step in range(4):
            loss_at(net, step).backward()
        assert list(h.last_factors) == ["fc:output"]


# ------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize(("make", "exc", "match"), [
    (lambda: gt.zclip(z=0), ValueError, r"zclip: z must be > 0"),
    (lambda: gt.zclip(alpha=1.0), ValueError, r"zclip: beta must be in \[0, 1\)"),
    (lambda: gt.zclip(warmup=0), ValueError, r"zclip: warmup must be >= 1; got 0"),
    (lambda: gt.zclip(warmup=2.5), TypeError, r"zclip: warmup must be an int; got float"),
    (lambda: gt.zclip(mode="zscore"), ValueError, r"zclip: unknown mode='zscore'; expected one "
     r"of 'adaptive', 'mean', 'percentile'"),
    (lambda: gt.zclip(max_norm=0), ValueError, r"zclip: max_norm must be > 0"),
    (lambda: gt.zclip(per_tensor=1), TypeError, r"zclip: per_tensor must be a bool; got int"),
    (lambda: gt.adagc(warmup=1), ValueError, r"adagc: warmup must be >= 2; got 1"),
    (lambda: gt.adagc(abs_max=-1.0), ValueError, r"adagc: abs_max must be > 0"),
    (lambda: gt.adagc(rel="1"), TypeError, r"adagc: rel must be a real number; got str"),
    (lambda: gt.agc(clip=0), ValueError, r"agc: clip must be > 0"),
    (lambda: gt.adagn(beta2=1.0), ValueError, r"adagn: beta must be in \[0, 1\)"),
    (lambda: gt.spam_clip(threshold=0), ValueError, r"spam_clip: threshold must be > 0"),
])
def test_invalid_arguments_raise_at_construction(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_rules_refused_where_they_cannot_work():
    net = make_net()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    adam = torch.optim.Adam(net.parameters(), lr=0.1)
    cases = [
        (dict(rules={"*": gt.spam_clip()}), r"rule '\*': spam_clip reads the optimizer's "
         r"exp_avg_sq, so it runs right before optimizer.step\(\): use when='step' with "
         r"optimizer=<an Adam-like optimizer>; got when='accumulate'"),
        (dict(rules={"*": gt.spam_clip()}, when="step", optimizer=sgd),
         r"spam_clip needs an Adam-like optimizer .*; got SGD"),
        (dict(rules={"fc": gt.chain(gt.scale(1.0), gt.spam_clip())}, on="grad_output"),
         r"rule 'fc': this transform \(agc, spam_clip\) reads the parameter and the optimizer"),
        (dict(rules={"fc": gt.agc()}, on="grad_input"), r"on='grad_input' transforms activation"),
        (dict(rules={"*": gt.zclip()}, when="backward"),
         r"rule '\*': zclip\(per_tensor=False\) needs every gradient the rule matched at once"),
        (dict(rules={"*": gt.adagc()}, when="backward"), r"adagc needs every gradient"),
        (dict(rules={"fc": gt.adagc()}, on="grad_output"), r"adagc needs every gradient .* "
         r"on='grad_output'"),
    ]
    for kwargs, match in cases:
        kwargs = dict(kwargs)
        rules = kwargs.pop("rules")
        with pytest.raises(ValueError, match=match):
            gt.transform(net, rules, **kwargs)
    # allowed: spam_clip at when="step" with Adam
    gt.transform(net, {"*": gt.spam_clip()}, when="step", optimizer=adam).remove()


def test_direct_calls_that_cannot_work_say_why():
    g = torch.ones(3)
    for t, name in [(gt.zclip(), r"zclip\(per_tensor=False\)"), (gt.adagc(), "adagc")]:
        with pytest.raises(TypeError, match=f"{name} needs every gradient its rule matched"):
            t.update(g, t.init(g), None)
    t = gt.spam_clip()
    with pytest.raises(TypeError, match=r"spam_clip reads the optimizer's exp_avg_sq"):
        t.update_many([g], [t.init(g)], [g])
    with pytest.raises(ValueError, match=r"agc compares a gradient with its parameter"):
        gt.agc().update(g, gt.agc().init(g), None)
    # Adamax has betas but no exp_avg_sq: said at the first step that has optimizer state
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adamax([w], lr=0.1)
    with gt.transform(torch.nn.ParameterList([w]), {"*": gt.spam_clip()}, when="step",
                      optimizer=opt):
        for _ in range(2):
            w.grad = torch.ones(3)
            if opt.state:
                with pytest.raises(ValueError, match=r"Adamax's holds exp_avg, exp_inf, step"):
                    opt.step()
            else:
                opt.step()
