"""`HookSet.around_any_clip`: a script's gradient clips seen around each call. The oracle is
torch's own clip on a copy of the gradients: the script's call runs exactly once, returns
and raises what it would without the wrapper, whatever the consumer does."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradtap.capture import Clip, HookSet


def _params(seed: int = 0, scale: float = 3.0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 4, generator=g)),
              torch.nn.Parameter(torch.randn(4, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


def _plain(fn, *args, **kwargs):
    """What the clip does without gradtap, on fresh copies of the same gradients."""
    params = _params()
    out = fn(params, *args, **kwargs)
    return out, [p.grad.clone() for p in params]


def test_the_clip_runs_once_and_the_consumer_sees_the_gradients_before_it():
    seen: list[Clip] = []
    before: list[float] = []

    def around(clip: Clip) -> None:
        seen.append(clip)
        before.append(float(torch.nn.utils.get_total_norm([p.grad for p in clip.parameters])))
        clip.run()

    with HookSet() as hooks:
        hooks.around_any_clip(around, pytest.fail)
        params = _params()
        gen = (p for p in params)  # a generator is read once, as torch reads it
        total = torch.nn.utils.clip_grad_norm_(gen, 1.0)
    want, grads = _plain(torch.nn.utils.clip_grad_norm_, 1.0)
    assert torch.equal(total, want) and all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    assert len(seen) == 1 and seen[0].kind == "norm" and seen[0].max_norm == 1.0
    assert before == [pytest.approx(float(want), rel=1e-6)]
    assert torch.equal(seen[0].norm(), want)
    assert torch.equal(seen[0].factor(), torch.clamp(1.0 / (want + 1e-6), max=1.0))
    assert torch.nn.utils.clip_grad_norm_ is torch.nn.utils.clip_grad.clip_grad_norm_  # restored


def test_a_failing_consumer_never_stops_the_clip_and_the_clips_own_error_is_the_scripts():
    errors: list[BaseException] = []

    def broken(clip: Clip) -> None:
        raise RuntimeError("consumer bug")

    with HookSet() as hooks:
        hooks.around_any_clip(broken, errors.append)
        params = _params()
        torch.nn.utils.clip_grad_value_(params, clip_value=0.5)
    _, grads = _plain(torch.nn.utils.clip_grad_value_, clip_value=0.5)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    assert [str(e) for e in errors] == ["consumer bug"]

    def runs(clip: Clip) -> None:
        clip.run()

    with HookSet() as hooks:
        hooks.around_any_clip(runs, pytest.fail)
        params = _params()
        params[0].grad[0, 0] = float("inf")
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_nested_and_deprecated_names_are_seen_once_and_with_norm_has_the_callers_total():
    seen: list[str] = []

    def around(clip: Clip) -> None:
        seen.append(clip.kind)
        clip.run()

    with HookSet() as hooks:
        hooks.around_any_clip(around, pytest.fail)
        params = _params()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # clip_grad_norm is deprecated
            torch.nn.utils.clip_grad_norm(params, 1.0)  # calls clip_grad_norm_ inside
        assert seen == ["norm"]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        holder: list[Clip] = []
        hooks.around_any_clip(lambda c: (holder.append(c), c.run()), pytest.fail)
        torch.nn.utils.clip_grads_with_norm_(params, 0.1, total)
    assert holder[0].kind == "with_norm"
    assert torch.equal(holder[0].factor(), torch.clamp(0.1 / (total + 1e-6), max=1.0))
    assert holder[0].norm() is not None and torch.equal(holder[0].norm(), total)


def test_names_imported_after_the_subscription_are_seen_and_restored_after():
    calls: list[str] = []
    with HookSet() as hooks:
        hooks.around_any_clip(lambda c: (calls.append(c.kind), c.run()), pytest.fail)
        from torch.nn.utils import clip_grad_value_  # what a script imports at its top

        clip_grad_value_(_params(), 0.1)
    assert calls == ["value"]
    assert torch.nn.utils.clip_grad_value_ is torch.nn.utils.clip_grad.clip_grad_value_
    torch.nn.utils.clip_grad_value_(_params(), 0.1)
    assert calls == ["value"]


def test_two_subscribers_nest_and_the_clip_still_runs_once():
    order: list[str] = []
    original = torch.nn.utils.clip_grad_norm_

    def first(clip: Clip) -> None:
        order.append("first before")
        clip.run()
        order.append("first after")

    def second(clip: Clip) -> None:
        order.append("second before")
        clip.run()
        order.append("second after")

    with HookSet() as a, HookSet() as b:
        a.around_any_clip(first, pytest.fail)
        b.around_any_clip(second, pytest.fail)
        params = _params()
        total = torch.nn.utils.clip_grad_norm_(params, 0.5)
    want, grads = _plain(torch.nn.utils.clip_grad_norm_, 0.5)
    assert torch.equal(total, want) and all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    assert order == ["first before", "second before", "second after", "first after"]
    assert torch.nn.utils.clip_grad_norm_ is original  # restored
