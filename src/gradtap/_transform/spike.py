"""Spike control from a tensor's own gradient-norm history: ``zclip``, ``adagc``, ``adagn``.

Each keeps, per parameter, a few 0-dim statistics of past gradient norms and multiplies the
gradient by a factor computed from them on the device (no host sync), which its state reports
as ``"factor"`` (:attr:`TransformHandle.last_factors`). A step whose norm is NaN or infinite
leaves the gradient and the statistics as they were (under AMP the scaler then skips it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from gradtap._transform.base import State, Transform, _mark, _mark_group_only
from gradtap._transform.library import _beta, _positive
from gradtap._transform.spike_ops import (
    by_count,
    count_of,
    factor_of,
    ones,
    scale_by,
    split,
    stack,
    warmup_steps,
    whole_norms,
)

__all__ = ["adagc", "adagn", "zclip"]

ZClipMode = Literal["adaptive", "mean", "percentile"]
_ZCLIP_MODES: tuple[str, ...] = ("adaptive", "mean", "percentile")
# The zclip package's guards: added to the std in the z-score, to the norm in the factor.
_Z_EPS = 1e-6
_CLIP_EPS = 1e-6
# adagc's and adagn's guard against a zero norm (the references' eps).
_EPS = 1e-8

Grads = Sequence[Tensor]
Params = Sequence["Tensor | None"]


def _group_only_update(name: str) -> Any:
    def update(grad: Tensor, state: State, param: Tensor | None, /, **extra: Any) -> tuple[Tensor, State]:
        raise TypeError(
            f"{name} needs every gradient its rule matched at once; it runs only through "
            "update_many, as gradtap.transform(..., when='accumulate' or 'step') does"
        )

    return _mark_group_only(update, name)


def zclip(z: float = 2.5, alpha: float = 0.97, warmup: int = 25, mode: ZClipMode = "adaptive",
          max_norm: float | None = None, per_tensor: bool = False) -> Transform:
    """Clip gradient-norm spikes by their z-score against an EMA of past (clipped) norms (ZClip).

    ``x`` is the L2 norm of the rule's gradients together (``per_tensor=False``: one norm over
    every tensor the rule matched, one factor for all) or of each tensor. The first ``warmup``
    steps only collect ``x`` (mean ``mu`` and population variance ``var``); then, with
    ``s = sqrt(var)`` and ``zs = (x - mu) / (s + 1e-6)``, the target is ``c = mu + z s / (zs /
    z)`` (``mode="adaptive"``) or ``c = mu`` (``"mean"``) when ``zs > z``, and ``c = mu + z s``
    when ``x`` exceeds it (``"percentile"``); else ``c = x``. With ``max_norm`` the target is
    ``min(c, max_norm)`` (and warm-up steps are clipped at ``max_norm`` as
    ``clip_grad_norm_`` does). The gradient is multiplied by ``target / (x + 1e-6)`` when ``x``
    exceeds the target, and the EMA moves towards ``c``: ``mu = alpha mu + (1 - alpha) c;
    var = alpha var + (1 - alpha) (c - mu)^2``. This is ``zclip.ZClip(alpha, z_thresh=z,
    max_grad_norm=max_norm, warmup_steps=warmup, mode="zscore"|"percentile")`` step for step,
    without its host syncs. State (per parameter, shared by the rule's tensors unless
    ``per_tensor``): ``{"count", "mean", "var", "factor"}``.

    Args:
        z: the z-score threshold, ``> 0``.
        alpha: the EMA factor in ``[0, 1)``.
        warmup: steps that only collect norms, ``>= 1``.
        mode: ``"adaptive"``, ``"mean"`` or ``"percentile"``.
        max_norm: an absolute bound on the norm, ``> 0``, or None.
        per_tensor: clip each tensor by its own norm history.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range or ``mode`` is unknown.

    Example:
        >>> import torch, gradtap as gt
        >>> t = gt.zclip(warmup=3, per_tensor=True)
        >>> s = t.init(torch.zeros(2))
        >>> for g in ([3.0, 4.0], [4.0, 3.0], [0.0, 5.1], [30.0, 40.0]):
        ...     out, s = t.update(torch.tensor(g), s, None)
        >>> round(float(out.norm()), 3), round(float(s["factor"]), 4)
        (5.034, 0.1007)
    """
    zt = _positive("z", "zclip", z)
    a = _beta("zclip", alpha)
    steps = warmup_steps("zclip", warmup, 1)
    if mode not in _ZCLIP_MODES:
        raise ValueError(f"zclip: unknown mode={mode!r}; expected one of "
                         f"{', '.join(map(repr, _ZCLIP_MODES))}")
    bound = None if max_norm is None else _positive("max_norm", "zclip", max_norm)
    if not isinstance(per_tensor, bool):
        raise TypeError(f"zclip: per_tensor must be a bool; got {type(per_tensor).__name__}")

    def math_(x: Tensor, mu: Tensor, var: Tensor, count: int) -> tuple[Tensor, Tensor, Tensor]:
        if count < steps:  # warm-up: a running mean and population variance (Welford)
            n = count + 1
            d = x - mu
            new_mu = mu + d / n
            new_var = var + (d * (x - new_mu) - var) / n
            f = (torch.ones_like(x) if bound is None
                 else (bound / (x + _CLIP_EPS)).clamp(max=1.0))
        else:
            std = var.sqrt()
            if mode == "percentile":
                threshold = mu + zt * std
                spike = x > threshold
            else:
                zs = (x - mu) / (std + _Z_EPS)
                spike = zs > zt
                threshold = mu + (zt * std) / (zs / zt) if mode == "adaptive" else mu
            c = torch.where(spike, threshold, x)
            target = c if bound is None else c.clamp(max=bound)
            f = torch.where(x > target, target / (x + _CLIP_EPS), 1.0)
            new_mu = a * mu + (1 - a) * c
            new_var = a * var + (1 - a) * (c - new_mu) ** 2
        ok = torch.isfinite(x)
        return (torch.where(ok, new_mu, mu), torch.where(ok, new_var, var),
                torch.where(ok, f, 1.0))

    def init(param: Tensor) -> dict[str, Any]:
        one = ones(param)
        return {"count": 0, "mean": torch.zeros_like(one), "var": torch.zeros_like(one),
                "factor": one}

    def each(grads: Grads, states: Sequence[State], idx: list[int]) -> tuple[list[Tensor], list[State]]:
        gs, ss = [grads[i] for i in idx], [states[i] for i in idx]
        device = ss[0]["factor"].device
        x = whole_norms(gs, "zclip", device)
        mu, var, f = math_(x, stack(ss, "mean", device), stack(ss, "var", device),
                           count_of(ss[0]))
        count = count_of(ss[0]) + 1
        return scale_by(gs, f), [{"count": count, "mean": m, "var": v, "factor": k}
                                 for m, v, k in zip(mu.unbind(), var.unbind(), f.unbind())]

    def update_many(grads: Grads, states: Sequence[State], params: Params, /,
                    **extra: Any) -> tuple[list[Tensor], list[State]]:
        if not grads:
            return [], list(states)
        if per_tensor:
            return split(len(grads), by_count(states),
                         lambda idx: each(grads, states, idx))
        # One history for the rule; the most advanced state holds it (a tensor that had no
        # gradient at some steps keeps an older copy).
        ref = max(states, key=count_of)
        device = ref["factor"].device
        x = whole_norms(grads, "zclip", device).square().sum().sqrt()
        mu, var, f = math_(x, ref["mean"], ref["var"], count_of(ref))
        shared = {"count": count_of(ref) + 1, "mean": mu, "var": var, "factor": f}
        return scale_by(grads, f), [dict(shared) for _ in grads]

    def update(grad: Tensor, state: State, param: Tensor | None, /,
               **extra: Any) -> tuple[Tensor, State]:
        grads, states = update_many([grad], [state], [param])
        return grads[0], states[0]

    fn = update if per_tensor else _group_only_update("zclip(per_tensor=False)")
    return Transform(init, _mark(fn, factor=factor_of, batched=True), update_many)


def adagc(rel: float = 1.05, beta: float = 0.98, warmup: int = 100, abs_max: float = 1.0
          ) -> Transform:
    """Clip each tensor against an EMA of its own past clipped norms (AdaGC, Wang et al. 2025).

    At step ``t`` (from 1), with ``x_i`` the norm of tensor ``i`` and ``X`` the norm of all the
    rule's tensors together: while ``t < warmup`` (the paper's ``T_start``) every tensor is
    multiplied by ``h = min(1, abs_max / (X + 1e-8))`` (global clipping) and ``gamma_i =
    min(gamma_{i}, h x_i)`` (the first step sets it); from ``t = warmup`` on, tensor ``i`` is
    multiplied by ``h_i = min(1, rel gamma_i / (x_i + 1e-8))`` and ``gamma_i = beta gamma_i +
    (1 - beta) h_i x_i``. Warm-up needs the whole rule's norm, so the rule runs over all its
    tensors at once (at the end of each backward with ``when="accumulate"``, before the
    optimizer step with ``"step"``). State per parameter: ``{"count", "gamma", "factor"}``.

    Args:
        rel: the relative bound ``lambda_rel``, ``> 0``.
        beta: the EMA factor in ``[0, 1)``.
        warmup: ``T_start``: steps ``1 .. warmup - 1`` clip globally, ``>= 2``.
        abs_max: the global bound during warm-up ``lambda_abs``, ``> 0``.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range.

    Example:
        >>> import torch, gradtap as gt
        >>> t = gt.adagc(warmup=2, abs_max=1.0)
        >>> gs, ss = [torch.tensor([3.0, 4.0])], [t.init(torch.zeros(2))]
        >>> gs, ss = t.update_many(gs, ss, [None])    # warm-up: the global norm 5 -> 1
        >>> gs, ss = t.update_many([torch.tensor([0.0, 2.0])], ss, [None])
        >>> gs[0], round(float(ss[0]["factor"]), 3)   # 1.05 * gamma (1) / 2
        (tensor([0.0000, 1.0500]), 0.525)
    """
    r = _positive("rel", "adagc", rel)
    b = _beta("adagc", beta)
    steps = warmup_steps("adagc", warmup, 2)
    top = _positive("abs_max", "adagc", abs_max)

    def init(param: Tensor) -> dict[str, Any]:
        one = ones(param)
        return {"count": 0, "gamma": torch.full_like(one, float("inf")), "factor": one}

    def update_many(grads: Grads, states: Sequence[State], params: Params, /,
                    **extra: Any) -> tuple[list[Tensor], list[State]]:
        if not grads:
            return [], list(states)
        t = max(count_of(s) for s in states) + 1
        device = states[0]["factor"].device
        x = whole_norms(grads, "adagc", device)
        gamma = stack(states, "gamma", device)
        if t < steps:
            total = x.square().sum().sqrt()
            ok = torch.isfinite(total)
            h = torch.where(ok, (top / (total + _EPS)).clamp(max=1.0), 1.0)
            gamma = torch.where(ok, torch.minimum(gamma, h * x), gamma)
            f = h.expand(len(grads)).clone()
        else:
            ok = torch.isfinite(x)
            f = torch.where(ok, (r * gamma / (x + _EPS)).clamp(max=1.0), 1.0)
            gamma = torch.where(ok, b * gamma + (1 - b) * (f * x), gamma)
        return scale_by(grads, f), [{"count": t, "gamma": g, "factor": k}
                                    for g, k in zip(gamma.unbind(), f.unbind())]

    update = _group_only_update("adagc")
    return Transform(init, _mark(update, factor=factor_of, batched=True), update_many)


def adagn(beta1: float = 0.7, beta2: float = 0.9) -> Transform:
    """Normalise each tensor's gradient by its own norm history (Stable-SPAM's AdaGN).

    With ``x`` the tensor's gradient norm at step ``t`` (from 1): ``m = beta1 m + (1 - beta1)
    x``, ``v = beta2 v + (1 - beta2) x^2`` (from 0), ``m_hat = m / (1 - beta1^t)``, ``v_hat = v
    / (1 - beta2^t)``, and the gradient becomes ``g / x * m_hat / (sqrt(v_hat) + 1e-8)`` (left
    as it is when ``x`` is 0): its direction, with the norm ``m_hat / sqrt(v_hat)``, about 1
    while ``x`` is steady (so it suits scale-invariant optimizers such as Adam) and a bounded
    number however large a spike. The reported factor is ``m_hat / (sqrt(v_hat) + 1e-8) /
    x``. State: ``{"count", "m", "v", "factor"}``.

    Args:
        beta1: EMA factor of the norm, in ``[0, 1)``.
        beta2: EMA factor of the squared norm, in ``[0, 1)``.

    Raises:
        TypeError: an argument is not a real number.
        ValueError: an argument is outside ``[0, 1)``.

    Example:
        >>> import torch, gradtap as gt
        >>> t = gt.adagn()
        >>> s = t.init(torch.zeros(2))
        >>> g, s = t.update(torch.tensor([3.0, 4.0]), s, None)   # first step: norm 1
        >>> round(float(g.norm()), 3)
        1.0
        >>> g, s = t.update(torch.tensor([30.0, 40.0]), s, None) # a 10x spike
        >>> round(float(g.norm()), 3)
        0.864
    """
    b1 = _beta("adagn", beta1)
    b2 = _beta("adagn", beta2)

    def init(param: Tensor) -> dict[str, Any]:
        one = ones(param)
        return {"count": 0, "m": torch.zeros_like(one), "v": torch.zeros_like(one), "factor": one}

    def each(grads: Grads, states: Sequence[State], idx: list[int]) -> tuple[list[Tensor], list[State]]:
        gs, ss = [grads[i] for i in idx], [states[i] for i in idx]
        device = ss[0]["factor"].device
        t = count_of(ss[0]) + 1
        x = whole_norms(gs, "adagn", device)
        m0, v0 = stack(ss, "m", device), stack(ss, "v", device)
        m = b1 * m0 + (1 - b1) * x
        v = b2 * v0 + (1 - b2) * x ** 2
        c = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + _EPS)
        ok = torch.isfinite(x)
        f = torch.where(ok & (x > 0), c / x, 1.0)
        m, v = torch.where(ok, m, m0), torch.where(ok, v, v0)
        return scale_by(gs, f), [{"count": t, "m": a, "v": q, "factor": k}
                                 for a, q, k in zip(m.unbind(), v.unbind(), f.unbind())]

    def update_many(grads: Grads, states: Sequence[State], params: Params, /,
                    **extra: Any) -> tuple[list[Tensor], list[State]]:
        if not grads:
            return [], list(states)
        return split(len(grads), by_count(states), lambda idx: each(grads, states, idx))

    def update(grad: Tensor, state: State, param: Tensor | None, /,
               **extra: Any) -> tuple[Tensor, State]:
        grads, states = update_many([grad], [state], [param])
        return grads[0], states[0]

    return Transform(init, _mark(update, factor=factor_of, batched=True), update_many)
