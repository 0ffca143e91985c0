"""Edges of the transform library: ``chain`` passes each member only the keyword extras it
accepts; ``clip_norm`` in one foreach pass equals the per-tensor version exactly."""

from __future__ import annotations

import torch

import gradtap as gt
from tests._spike_oracles import assert_same_params, run_gradtap, run_reference, spam_ref


def _halve_by_hand(step, named, opt):
    for _, p in named:
        p.grad = p.grad / 2
    return {}


def _halve_then(ref):
    def both(step, named, opt):
        _halve_by_hand(step, named, opt)
        return ref(step, named, opt)
    return both


#: A user transform written without ``**extra``, as the Transform docs' own example is.
HALVE = gt.Transform(init=lambda p: (), update=lambda g, s, p: (g / 2, s))


def test_chain_of_a_user_transform_without_extras_and_spam_clip_at_a_step():
    steps = 12
    net, _ = run_gradtap({"*": gt.chain(HALVE, gt.spam_clip(threshold=2.0))}, steps,
                         when="step", opt="adam")
    want, _ = run_reference(_halve_then(spam_ref(threshold=2.0)), steps, opt="adam")
    assert_same_params(net, want)


def test_chain_passes_extras_by_name_and_to_extras_parameters():
    seen: list[tuple[str, dict]] = []

    def named(g, s, p, *, optimizer=None):
        seen.append(("named", {"optimizer": optimizer}))
        return g, s

    def anything(g, s, p, /, **extra):
        seen.append(("anything", extra))
        return g, s

    t = gt.chain(HALVE, gt.Transform(lambda p: (), named), gt.Transform(lambda p: (), anything))
    g = torch.ones(2)
    out, _ = t.update(g, t.init(g), None, optimizer="opt", other=1)
    assert torch.equal(out, g / 2)
    assert seen == [("named", {"optimizer": "opt"}), ("anything", {"optimizer": "opt", "other": 1})]
    # update_many: a member without it runs per tensor with the extras it accepts
    many = gt.chain(HALVE, gt.clip_global_norm(1.0))
    outs, _ = many.update_many([g], [many.init(g)], [None], optimizer="opt")
    torch.testing.assert_close(outs[0], g / 2 / max(1.0, float((g / 2).norm())))
