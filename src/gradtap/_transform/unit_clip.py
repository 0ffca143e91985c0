"""Spike control below the tensor: ``agc`` (per output unit) and ``spam_clip`` (per element).

Neither keeps a history of its own: ``agc`` compares each output unit's gradient with that
unit's weights, ``spam_clip`` each element with the optimizer's second moment. Their state is
the factor they report, ``{"factor": norm after / norm before}``
(:attr:`TransformHandle.last_factors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradtap._tensorops.sharded import is_sharded, local, rebuild, row_norms, sumsq_whole
from gradtap._transform.base import State, Transform, _mark
from gradtap._transform.library import _positive
from gradtap._transform.spike_ops import factor_of, ones, whole_norms

__all__ = ["agc", "spam_clip"]

# timm's guard on the gradient's unit norm in the clipped factor.
_AGC_MIN_NORM = 1e-6

Params = Sequence["Tensor | None"]


def _acc(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _ratios(grads: list[Tensor], news: list[Tensor], states: Sequence[State],
            what: str) -> list[State]:
    """``{"factor": norm(new) / norm(grad)}`` per tensor (1 where the gradient is 0)."""
    if not grads:
        return []
    device = states[0]["factor"].device
    both = whole_norms([*grads, *news], what, device)
    before, after = both[: len(grads)], both[len(grads):]
    f = torch.where(before > 0, after / before, 1.0)
    return [{"factor": k} for k in f.unbind()]


def _init(param: Tensor) -> dict[str, Tensor]:
    return {"factor": ones(param)}


def agc(clip: float = 0.01, eps: float = 1e-3) -> Transform:
    """Clip each output unit's gradient relative to its weights (AGC, Brock et al. 2021).

    For each output unit ``i`` (row ``i`` of the weight: dimension 0 of a ``Linear`` ``[O, I]``
    or ``Conv`` ``[O, I, *K]`` weight; a tensor with fewer than 2 dimensions is one unit), with
    ``w_i = max(norm(W_i), eps)`` and ``n_i = norm(G_i)``: when ``n_i > clip * w_i`` the row is
    multiplied by ``clip * w_i / max(n_i, 1e-6)``, otherwise left as it is (timm's and optax's
    ``adaptive_clip_grad``, without a host sync). Needs the parameter, so it applies to
    parameter gradients only. Under FSDP2 rows sharded by the first dimension need no
    communication. State: ``{"factor"}``, the ratio of the tensor's norms after/before.

    Args:
        clip: the largest ratio of gradient to weight norm, ``> 0``.
        eps: the smallest weight norm used, ``> 0``.

    Raises:
        TypeError: an argument is not a real number.
        ValueError: an argument is not ``> 0``; at a step, ``param`` is None.

    Example:
        >>> import torch, gradtap as gt
        >>> w = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
        >>> t = gt.agc(clip=0.1)
        >>> g, s = t.update(torch.tensor([[0.3, 0.4], [0.0, 0.05]]), t.init(w), w)
        >>> g                       # row 0: 0.5 > 0.1 * 5 -> scaled to 0.5; row 1 kept
        tensor([[0.3000, 0.4000],
                [0.0000, 0.0500]])
        >>> g, s = t.update(torch.tensor([[3.0, 4.0], [0.0, 0.05]]), s, w)
        >>> g[0]
        tensor([0.3000, 0.4000])
    """
    c = _positive("clip", "agc", clip)
    e = _positive("eps", "agc", eps)

    def unit_norms(ts: list[Tensor]) -> list[Tensor]:
        # Rows of tensors with >= 2 dims; whole tensors otherwise (sharded ones in one
        # collective for all).
        out: list[Any] = [None] * len(ts)
        whole = [i for i, t in enumerate(ts) if t.dim() < 2]
        if any(is_sharded(ts[i]) for i in whole):
            sums = sumsq_whole([ts[i] for i in whole], "agc")
            for j, i in enumerate(whole):
                out[i] = sums[j].sqrt().to(device=local(ts[i]).device, dtype=_acc(ts[i]))
        else:
            for i in whole:
                out[i] = torch.linalg.vector_norm(ts[i], dtype=_acc(ts[i]))
        for i, t in enumerate(ts):
            if out[i] is None:
                out[i] = row_norms(t, _acc(t))
        return out

    def update_many(grads: Sequence[Tensor], states: Sequence[State], params: Params, /,
                    **extra: Any) -> tuple[list[Tensor], list[State]]:
        if any(p is None for p in params):
            raise ValueError("agc compares a gradient with its parameter's weights; it applies "
                             "to parameter gradients only (on='param_grad')")
        grads = list(grads)
        if not grads:
            return [], list(states)
        ws = [p.detach() for p in params if p is not None]
        both = unit_norms([*ws, *grads])
        news = []
        sums = []
        for g, wn, gn in zip(grads, both[: len(ws)], both[len(ws):], strict=True):
            bound = c * wn.clamp(min=e)
            f = torch.where(gn > bound, bound / gn.clamp(min=_AGC_MIN_NORM), 1.0)
            part = local(g)
            news.append(rebuild(g, (part * f.to(part.device)).to(g.dtype)))
            # the tensor's squared norms before and after, from its units' norms
            sums.append(torch.stack([gn.square().sum(), (f * gn).square().sum()]))
        if any(is_sharded(g) for g in grads):  # units on other ranks: whole-tensor norms
            return news, _ratios(grads, news, states, "agc")
        device = states[0]["factor"].device
        pairs = torch.stack([t.to(device) for t in sums]).to(states[0]["factor"].dtype)
        f = torch.where(pairs[:, 0] > 0, (pairs[:, 1] / pairs[:, 0]).sqrt(), 1.0)
        return news, [{"factor": k} for k in f.unbind()]

    def update(grad: Tensor, state: State, param: Tensor | None, /,
               **extra: Any) -> tuple[Tensor, State]:
        grads, states = update_many([grad], [state], [param])
        return grads[0], states[0]

    marked = _mark(update, factor=factor_of, needs=frozenset({"param"}), batched=True)
    return Transform(_init, marked, update_many)


def spam_clip(threshold: float = 5000) -> Transform:
    """Clip elements far above the optimizer's second moment (SPAM's spike-aware clipping).

    With ``v`` the optimizer's ``exp_avg_sq`` for the parameter (Adam's running mean of
    squared gradients, before this step's update), elements with ``g**2 > threshold * v`` are
    set to ``sign(g) * sqrt(threshold * v)`` (Huang et al. 2025). It reads the optimizer's
    state, so it runs with ``gradtap.transform(..., when="step", optimizer=<Adam-like>)``
    (``Adam``, ``AdamW``, ``NAdam``, ``RAdam``, ... whose state holds ``exp_avg_sq``); before
    the optimizer's first step a parameter has no ``exp_avg_sq`` yet and is left as it is.
    State: ``{"factor"}``, the ratio of the tensor's norms after/before.

    Args:
        threshold: the bound on ``g**2 / v``, ``> 0``.

    Raises:
        TypeError: ``threshold`` is not a real number; at a step, no ``optimizer=``.
        ValueError: ``threshold`` is not ``> 0``; at a step, an optimizer whose state has
            no ``exp_avg_sq``.

    Example:
        >>> import torch, gradtap as gt
        >>> w = torch.nn.Parameter(torch.zeros(3))
        >>> opt = torch.optim.Adam([w], lr=0.0)
        >>> w.grad = torch.ones(3); opt.step()        # exp_avg_sq = 0.001
        >>> t = gt.spam_clip(threshold=1000)          # bound: sqrt(1000 * 0.001) = 1
        >>> g, s = t.update_many([torch.tensor([0.5, -3.0, 2.0])], [t.init(w)], [w], optimizer=opt)
        >>> g[0]
        tensor([ 0.5000, -1.0000,  1.0000])
    """
    bound = _positive("threshold", "spam_clip", threshold)

    def clipped(g: Tensor, p: Tensor, optimizer: torch.optim.Optimizer) -> Tensor:
        st = optimizer.state.get(p)
        if not st:  # before the optimizer's first step for this parameter
            return g
        if "exp_avg_sq" not in st:
            raise ValueError(
                f"spam_clip needs an Adam-like optimizer, whose state holds exp_avg_sq for "
                f"each parameter; {type(optimizer).__name__}'s holds "
                f"{', '.join(sorted(map(str, st)))}"
            )
        part = local(g)
        acc = _acc(part)
        # g**2 > threshold * v  <=>  |g| > sqrt(threshold * v) =: s; such g become sign(g) s
        s = (local(st["exp_avg_sq"]).to(device=part.device, dtype=acc) * bound).sqrt_()
        out = torch.clamp(part.to(acc), min=torch.neg(s), max=s)
        return rebuild(g, out.to(g.dtype))

    def update_many(grads: Sequence[Tensor], states: Sequence[State], params: Params, /,
                    optimizer: torch.optim.Optimizer | None = None,
                    **extra: Any) -> tuple[list[Tensor], list[State]]:
        if optimizer is None:
            raise TypeError(
                "spam_clip reads the optimizer's exp_avg_sq: it runs through "
                "gradtap.transform(..., when='step', optimizer=<an Adam-like optimizer>), "
                "or update_many(..., optimizer=opt)"
            )
        if any(p is None for p in params):
            raise ValueError("spam_clip reads the optimizer's state of a parameter; it applies "
                             "to parameter gradients only (on='param_grad')")
        grads = list(grads)
        news = [clipped(g, p, optimizer) for g, p in zip(grads, params, strict=True)
                if p is not None]
        return news, _ratios(grads, news, states, "spam_clip")

    def update(grad: Tensor, state: State, param: Tensor | None, /,
               **extra: Any) -> tuple[Tensor, State]:
        grads, states = update_many([grad], [state], [param], **extra)
        return grads[0], states[0]

    marked = _mark(update, factor=factor_of, needs=frozenset({"optimizer", "param"}),
                   batched=True)
    return Transform(_init, marked, update_many)
