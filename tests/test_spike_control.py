"""Spike control against its references: ``gt.zclip`` against the ``zclip`` package's ``ZClip``,
the others against float64 implementations of their published formulas
(tests/_spike_oracles.py), over training runs with injected gradient spikes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtap as gt
from tests._spike_oracles import (
    adagc_ref,
    adagn_ref,
    agc_ref,
    assert_same_factors,
    assert_same_params,
    run_gradtap,
    run_reference,
    spam_ref,
    zclip_ref,
)

pytest.importorskip("zclip")

STEPS = 60


def _clipped_somewhere(factors: list[dict[str, float]]) -> bool:
    return any(f < 0.999 for step in factors for f in step.values())


def _differs_from_plain(net, steps: int, opt: str = "sgd") -> bool:
    plain, _ = run_reference(None, steps, opt=opt)
    return any(not torch.allclose(p, q, rtol=1e-6)
               for p, q in zip(net.parameters(), plain.parameters()))


# --------------------------------------------------------------------------------------- zclip

ALL = [lambda n: True]
CONV_REST = [lambda n: n.startswith("conv."), lambda n: not n.startswith("conv.")]


@pytest.mark.parametrize(("ours", "theirs", "groups", "when"), [
    # the defaults (ZClip's max_grad_norm=1.0 default is our max_norm=None's opposite)
    ({}, {"max_grad_norm": None}, ALL, "step"),
    ({}, {"max_grad_norm": None}, ALL, "accumulate"),
    ({"mode": "percentile", "z": 2.0, "max_norm": 0.5},
     {"mode": "percentile", "z_thresh": 2.0, "max_grad_norm": 0.5}, ALL, "step"),
    ({"mode": "mean", "alpha": 0.9, "warmup": 10},
     {"clip_option": "mean", "alpha": 0.9, "warmup_steps": 10, "max_grad_norm": None}, ALL,
     "accumulate"),
    # one history per rule pattern
    ({"z": 2.0}, {"z_thresh": 2.0, "max_grad_norm": None}, CONV_REST, "step"),
])
def test_zclip_matches_the_zclip_package(ours, theirs, groups, when):
    rules = ({"*": gt.zclip(**ours)} if len(groups) == 1
             else {"conv.*": gt.zclip(**ours), "*": gt.zclip(**ours)})
    net, factors = run_gradtap(rules, STEPS, when=when)
    ref, _ = run_reference(zclip_ref(groups, **theirs), STEPS)
    assert_same_params(net, ref)
    assert _clipped_somewhere(factors) and _differs_from_plain(net, STEPS)
    # one factor per rule at every step, the same for all the rule's tensors
    for step in factors:
        assert len({v for n, v in step.items() if not n.startswith("conv.")}) == 1


@pytest.mark.parametrize("when", ["step", "accumulate"])
def test_zclip_per_tensor_matches_one_zclip_per_tensor(when):
    net, factors = run_gradtap({"*": gt.zclip(per_tensor=True, max_norm=2.0, warmup=20)},
                               STEPS, when=when)
    ref, _ = run_reference(zclip_ref(ALL, per_tensor=True, max_grad_norm=2.0, warmup_steps=20),
                           STEPS)
    assert_same_params(net, ref)
    assert _clipped_somewhere(factors)
    # the layer that spiked alone is clipped alone
    assert factors[34]["conv.weight"] < 0.5 and factors[34]["head.weight"] == 1.0


@settings(max_examples=12, deadline=None)
@given(z=st.floats(0.5, 4.0), alpha=st.floats(0.5, 0.99), warmup=st.integers(1, 30),
       mode=st.sampled_from(["adaptive", "mean", "percentile"]),
       max_norm=st.one_of(st.none(), st.floats(0.05, 5.0)), per_tensor=st.booleans())
def test_zclip_matches_the_package_over_drawn_settings(z, alpha, warmup, mode, max_norm,
                                                       per_tensor):
    steps = 40
    rule = gt.zclip(z=z, alpha=alpha, warmup=warmup, mode=mode, max_norm=max_norm,
                    per_tensor=per_tensor)
    net, _ = run_gradtap({"*": rule}, steps)
    theirs = {"z_thresh": z, "alpha": alpha, "warmup_steps": warmup, "max_grad_norm": max_norm,
              "mode": "percentile" if mode == "percentile" else "zscore",
              "clip_option": "mean" if mode == "mean" else "adaptive_scaling"}
    ref, _ = run_reference(zclip_ref(ALL, per_tensor=per_tensor, **theirs), steps)
    assert_same_params(net, ref)


# ------------------------------------------------------------------- adagc, agc, adagn, spam_clip

# name -> (transform, reference factory, optimizer, steps); references hold state, so each
# test makes its own.
CASES = {
    "adagc default": (gt.adagc(), adagc_ref, {}, "sgd", 110),
    "adagc short warm-up": (gt.adagc(rel=1.02, beta=0.9, warmup=20, abs_max=0.3), adagc_ref,
                            {"rel": 1.02, "beta": 0.9, "warmup": 20, "abs_max": 0.3}, "sgd", STEPS),
    "agc default": (gt.agc(), agc_ref, {}, "sgd", STEPS),
    "agc loose": (gt.agc(clip=0.05, eps=1e-2), agc_ref, {"clip": 0.05, "eps": 1e-2}, "sgd", STEPS),
    "adagn default": (gt.adagn(), adagn_ref, {}, "adam", STEPS),
    "adagn slow": (gt.adagn(beta1=0.9, beta2=0.99), adagn_ref, {"beta1": 0.9, "beta2": 0.99},
                   "adam", STEPS),
    "spam_clip default": (gt.spam_clip(), spam_ref, {}, "adam", STEPS),
    "spam_clip tight": (gt.spam_clip(threshold=50), spam_ref, {"threshold": 50}, "adam", STEPS),
}


@pytest.mark.parametrize(("case", "when"), [
    (case, when) for case in CASES for when in ("step", "accumulate")
    if when == "step" or not case.startswith("spam")])  # spam_clip: when="step" only
def test_rules_match_their_published_formulas(case, when):
    rule, make_ref, kwargs, opt, steps = CASES[case]
    net, factors = run_gradtap({"*": rule}, steps, when=when, opt=opt)
    want, want_factors = run_reference(make_ref(**kwargs), steps, opt=opt)
    assert_same_params(net, want)
    assert_same_factors(factors, want_factors)
    assert _differs_from_plain(net, steps, opt)
    if not case.startswith("adagn"):  # adagn rescales every step; the others clip spikes
        assert _clipped_somewhere(factors)


def test_adagc_clips_the_spiking_layer_alone_after_warmup():
    _, factors = run_gradtap({"*": gt.adagc(warmup=20)}, STEPS)
    spike = factors[34]  # only conv.weight spiked at step 34
    # rel=1.05 clips ordinary fluctuations a little; the spiking layer by 1000x
    assert spike["conv.weight"] < 0.01
    assert all(f > 0.1 for n, f in spike.items() if n != "conv.weight")


@settings(max_examples=10, deadline=None)
@given(clip=st.floats(1e-3, 0.5), eps=st.floats(1e-4, 1e-1),
       shape=st.lists(st.integers(1, 4), min_size=0, max_size=4).map(tuple),
       seed=st.integers(0, 1000), mag=st.floats(1e-3, 1e3))
def test_agc_matches_timm_formula_over_drawn_shapes(clip, eps, shape, seed, mag):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    grad = torch.randn(shape, generator=g, dtype=torch.float64) * mag
    p = torch.nn.Parameter(w.clone())
    p.grad = grad.clone()
    want = agc_ref(clip, eps)(0, [("p", p)], None)
    t = gt.agc(clip=clip, eps=eps)
    out, state = t.update(grad, t.init(w), w)
    torch.testing.assert_close(out, p.grad, rtol=1e-12, atol=0)
    assert float(state["factor"]) == pytest.approx(want["p"], rel=1e-12)


@settings(max_examples=10, deadline=None)
@given(beta1=st.floats(0.0, 0.99), beta2=st.floats(0.0, 0.999), seed=st.integers(0, 1000),
       steps=st.integers(1, 12))
def test_adagn_matches_the_formula_over_drawn_settings(beta1, beta2, seed, steps):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(3, 2, generator=g, dtype=torch.float64)
             * float(torch.rand(1, generator=g) * 10) for _ in range(steps)]
    t = gt.adagn(beta1=beta1, beta2=beta2)
    state = t.init(grads[0])
    ref = adagn_ref(beta1, beta2)
    for step, grad in enumerate(grads):
        p = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
        p.grad = grad.clone()
        want = ref(step, [("p", p)], None)
        out, state = t.update(grad, state, None)
        torch.testing.assert_close(out, p.grad, rtol=1e-12, atol=1e-15)
        assert float(state["factor"]) == pytest.approx(want["p"], rel=1e-12)
