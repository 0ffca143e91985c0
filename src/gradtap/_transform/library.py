"""Built-in gradient transforms.

Every factory validates its arguments when called (bad values raise ``ValueError``, wrong
types ``TypeError``) and returns a :class:`~gradtap._transform.base.Transform`. States are
plain dicts of tensors and numbers (see each factory), so checkpoints load with
``torch.load(weights_only=True)``. No transform syncs with the host: clipping multiplies by a
clamped factor kept as a tensor.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradtap._tensorops import ewma_init, ewma_update_, group_by_device_dtype, group_norms
from gradtap._tensorops.sharded import centered_rows, is_sharded, local, rebuild, sumsq_whole
from gradtap._transform.base import State, Transform, _mark, _mark_group_only, stateless
from gradtap._types import is_int

__all__ = [
    "add_noise",
    "centralize",
    "clip_global_norm",
    "clip_norm",
    "clip_value",
    "ewma",
    "flip",
    "normalize",
    "scale",
    "zero",
]

# clip_norm / clip_global_norm: the same guard torch.nn.utils.clip_grad_norm_ uses.
_CLIP_EPS = 1e-6


def _real(name: str, factory: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{factory}: {name} must be a real number; got {type(value).__name__} {value!r}")
    out = float(value)
    if math.isnan(out):
        raise ValueError(f"{factory}: {name} must not be NaN")
    return out


def _positive(name: str, factory: str, value: Any) -> float:
    out = _real(name, factory, value)
    if not out > 0:
        raise ValueError(f"{factory}: {name} must be > 0; got {value!r}")
    return out


def _beta(factory: str, beta: Any) -> float:
    out = _real("beta", factory, beta)
    if not 0.0 <= out < 1.0:
        raise ValueError(f"{factory}: beta must be in [0, 1); got {beta!r}")
    return out


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def scale(s: float) -> Transform:
    """Multiply the gradient by the constant ``s`` (``s = -1`` is :func:`flip`).

    Args:
        s: a finite real factor.

    Raises:
        TypeError: ``s`` is not a real number.
        ValueError: ``s`` is NaN or infinite.

    Example:
        >>> import torch, gradtap as gt
        >>> gt.scale(0.5).update(torch.tensor([2.0]), (), None)[0]
        tensor([1.])
    """
    factor = _real("s", "scale", s)
    if math.isinf(factor):
        raise ValueError(f"scale: s must be finite; got {s!r}")
    return stateless(lambda grad, param: grad * factor)


def flip() -> Transform:
    """Negate the gradient (gradient reversal when used on ``grad_output``).

    Example:
        >>> import torch, gradtap as gt
        >>> gt.flip().update(torch.tensor([2.0, -1.0]), (), None)[0]
        tensor([-2.,  1.])
    """
    return stateless(lambda grad, param: torch.neg(grad))


def zero() -> Transform:
    """Replace the gradient by zeros (freezes a parameter under plain SGD).

    Note that optimizers with weight decay or momentum may still move a parameter whose
    gradient is zero.

    Example:
        >>> import torch, gradtap as gt
        >>> gt.zero().update(torch.tensor([2.0, -1.0]), (), None)[0]
        tensor([0., 0.])
    """
    return stateless(lambda grad, param: torch.zeros_like(grad))


def clip_value(v: float) -> Transform:
    """Clamp every element of the gradient to ``[-v, v]``.

    Args:
        v: the bound, ``> 0``.

    Raises:
        TypeError: ``v`` is not a real number.
        ValueError: ``v`` is not ``> 0``.

    Example:
        >>> import torch, gradtap as gt
        >>> gt.clip_value(1.0).update(torch.tensor([-3.0, 0.5]), (), None)[0]
        tensor([-1.0000,  0.5000])
    """
    bound = _positive("v", "clip_value", v)
    return stateless(lambda grad, param: grad.clamp(-bound, bound))


def clip_norm(max_norm: float) -> Transform:
    """Rescale the gradient so that its L2 norm is at most ``max_norm`` (per tensor).

    The gradient is multiplied by ``min(1, max_norm / (norm + 1e-6))``, computed
    as a clamped tensor factor (no host sync). The norm is taken in float32 or wider, with
    ``torch._foreach_norm`` (:func:`gradtap._tensorops.group_norms`, the kernel
    ``torch.nn.utils.clip_grad_norm_`` uses). Over several tensors (``update_many``: with
    ``when="step"``, and with ``when="accumulate"`` over the parameters each backward
    reached) one foreach norm and one ``torch._foreach_mul`` per device and dtype do them
    all, with the same result as one by one.

    Args:
        max_norm: the largest norm allowed, ``> 0``.

    Raises:
        TypeError: ``max_norm`` is not a real number.
        ValueError: ``max_norm`` is not ``> 0``.

    Example:
        >>> import torch, gradtap as gt
        >>> g = gt.clip_norm(1.0).update(torch.tensor([3.0, 4.0]), (), None)[0]
        >>> round(float(g.norm()), 4)
        1.0
    """
    bound = _positive("max_norm", "clip_norm", max_norm)

    def fn(grad: Tensor, param: Tensor | None) -> Tensor:
        if is_sharded(grad):
            return update_many([grad], [()], [param])[0][0]
        norm = group_norms([grad])[0]
        factor = (bound / (norm + _CLIP_EPS)).clamp_(max=1.0)
        return grad * factor.to(grad.dtype)

    def clipped(group: list[Tensor]) -> list[Tensor]:
        # One device and dtype: one foreach norm, one foreach multiply (on CPU the same
        # numbers as ``fn`` one by one, bit for bit).
        factors = (bound / (group_norms(group) + _CLIP_EPS)).clamp_(max=1.0)
        return list(torch._foreach_mul(group, list(factors.to(group[0].dtype).unbind())))

    def update_many(
        grads: Sequence[Tensor],
        states: Sequence[State],
        params: Sequence[Tensor | None],
        /,
        **extra: Any,
    ) -> tuple[list[Tensor], list[State]]:
        # Every tensor's own norm: one foreach norm and one foreach multiply per device and
        # dtype, the same numbers as one by one; sharded gradients' sums of squares in one
        # collective.
        if not any(is_sharded(g) for g in grads):
            out: list[Tensor] = list(grads)
            for idx in group_by_device_dtype(grads).values():
                for i, g in zip(idx, clipped([grads[i] for i in idx]), strict=True):
                    out[i] = g
            return out, list(states)
        factors = (bound / (sumsq_whole(grads, "clip_norm").sqrt() + _CLIP_EPS)).clamp_(max=1.0)
        out = [rebuild(g, local(g) * factors[i].to(device=local(g).device, dtype=g.dtype))
               for i, g in enumerate(grads)]
        return out, list(states)

    plain = stateless(fn)
    # Batched: with when="accumulate" one pass at the end of each backward over the tensors
    # it reached; under compiled autograd, which refuses that callback, one by one (``fn``).
    return Transform(plain.init, _mark(plain.update, batched=True), update_many)


def clip_global_norm(max_norm: float) -> Transform:
    """Rescale every tensor one rule matched by the same factor so their joint norm is bounded.

    With ``total = sqrt(sum_i ||g_i||^2)`` over all the tensors one rule matched, each is
    multiplied by ``min(1, max_norm / (total + 1e-6))`` (like ``torch.nn.utils.clip_grad_norm_``
    restricted to that rule's parameters; the norms are :func:`gradtap._tensorops.norms`'
    accurate float64 sums, one batch per device and dtype, so no host sync). It needs all
    those gradients at once, so it is *group-only*: calling its per-tensor ``update`` raises,
    and :func:`gradtap.transform` (alone or inside a :func:`chain`) runs it through
    ``update_many`` on the accumulated ``.grad`` of the rule's parameters, at the end of each
    backward (``when="accumulate"``, the default: ``clip_grad_norm_`` after every backward)
    or right before each ``optimizer.step()`` (``when="step"``). Parameters whose ``.grad``
    is None are left out. ``when="backward"`` and activation gradients refuse it.

    Args:
        max_norm: the largest joint norm allowed, ``> 0``.

    Raises:
        TypeError: ``max_norm`` is not a real number.
        ValueError: ``max_norm`` is not ``> 0``.

    Example:
        >>> import torch, gradtap as gt
        >>> t = gt.clip_global_norm(5.0)
        >>> gs, _ = t.update_many([torch.tensor([6.0]), torch.tensor([8.0])], [(), ()], [None, None])
        >>> [round(float(g), 3) for g in gs]
        [3.0, 4.0]
    """
    bound = _positive("max_norm", "clip_global_norm", max_norm)

    def update(grad: Tensor, state: State, param: Tensor | None, /, **extra: Any) -> tuple[Tensor, State]:
        raise TypeError(
            "clip_global_norm needs every gradient its rule matched at once; it runs only "
            "through update_many, as gradtap.transform(..., when='accumulate' or 'step') does"
        )

    def update_many(
        grads: Sequence[Tensor],
        states: Sequence[State],
        params: Sequence[Tensor | None],
        /,
        **extra: Any,
    ) -> tuple[list[Tensor], list[State]]:
        if not grads:
            return [], list(states)
        total = sumsq_whole(grads, "clip_global_norm").sum().sqrt()
        factor = (bound / (total + _CLIP_EPS)).clamp_(max=1.0)
        out = [rebuild(g, local(g) * factor.to(device=local(g).device, dtype=g.dtype))
               for g in grads]
        return out, list(states)

    def init(param: Tensor) -> tuple[()]:
        return ()

    return Transform(init, _mark_group_only(update), update_many)


def centralize() -> Transform:
    """Subtract the mean over every dimension but the first (gradient centralization).

    For a conv weight ``[O, I, *kernel]`` each output filter's gradient gets zero mean.
    Tensors with fewer than 2 dimensions (biases, scalars) are returned unchanged.

    Example:
        >>> import torch, gradtap as gt
        >>> gt.centralize().update(torch.tensor([[1.0, 3.0], [0.0, 4.0]]), (), None)[0]
        tensor([[-1.,  1.],
                [-2.,  2.]])
    """

    def fn(grad: Tensor, param: Tensor | None) -> Tensor:
        if grad.dim() < 2:
            return grad
        return centered_rows(grad)

    return stateless(fn)


def _ewma_state(like: Tensor) -> dict[str, Any]:
    mean, var = ewma_init(torch.zeros_like(like))
    return {"count": 0, "mean": mean, "var": var}


def _ewma_step(grad: Tensor, state: dict[str, Any], beta: float) -> dict[str, Any]:
    # Shares the Monitor's EWMA numerics (gradtap._tensorops).
    if state["count"] == 0:
        mean, var = ewma_init(grad)
        return {"count": 1, "mean": mean, "var": var}
    ewma_update_(state["mean"], state["var"], grad, beta)
    return {"count": state["count"] + 1, "mean": state["mean"], "var": state["var"]}


def normalize(beta: float = 0.99, eps: float = 1e-8) -> Transform:
    """Divide the gradient by the running std of its own history (elementwise).

    The EWMA (``m = g, v = 0`` at the first step, then ``d = g - m_prev;
    m = m_prev + (1 - beta) d; v = beta (v_prev + (1 - beta) d^2)``) is updated with the
    incoming gradient, then ``g / (sqrt(v_hat) + eps)`` is returned with the bias-corrected
    ``v_hat = v / (1 - beta**(t - 1))`` at step ``t >= 2`` (as Adam corrects its moments: the
    EWMA after a few steps has seen a fraction of its window, and the uncorrected ``v`` would
    amplify the first steps by orders of magnitude); at the first step ``g`` is returned
    unchanged. State: ``{"count": int, "mean": Tensor, "var": Tensor}`` (float32 or wider, the
    shape of the parameter; ``count`` is ``t``).

    Args:
        beta: EWMA factor in ``[0, 1)``.
        eps: added to the std, ``>= 0``.

    Raises:
        TypeError: an argument is not a real number.
        ValueError: ``beta`` is outside ``[0, 1)`` or ``eps`` is negative or infinite.

    Example:
        >>> import torch, gradtap as gt
        >>> t = gt.normalize(beta=0.5)
        >>> s = t.init(torch.zeros(1))
        >>> g, s = t.update(torch.tensor([1.0]), s, None)   # first step: unchanged
        >>> g, s = t.update(torch.tensor([3.0]), s, None)   # v = 0.5 * 0.5 * 4 = 1, v_hat = 2
        >>> g
        tensor([2.1213])
    """
    b = _beta("normalize", beta)
    e = _real("eps", "normalize", eps)
    if not 0.0 <= e < math.inf:
        raise ValueError(f"normalize: eps must be >= 0 and finite; got {eps!r}")

    def update(grad: Tensor, state: State, param: Tensor | None, /, **extra: Any) -> tuple[Tensor, State]:
        first = state["count"] == 0
        state = _ewma_step(grad, state, b)
        if first:
            return grad, state
        correction = 1.0 - b ** (state["count"] - 1)
        v_hat = state["var"] / correction if correction > 0 else state["var"]
        out = grad.to(state["var"].dtype) / (v_hat.sqrt() + e)
        return out.to(grad.dtype), state

    return Transform(_ewma_state, update)


def ewma(beta: float = 0.99) -> Transform:
    """Replace the gradient by its running mean (the EWMA of :func:`normalize`, updated first).

    At the first step the mean is the gradient itself. State: ``{"count": int, "mean":
    Tensor, "var": Tensor}``, the same EWMA state :func:`normalize` keeps. The returned
    gradient is a copy, never the state tensor.

    Args:
        beta: EWMA factor in ``[0, 1)``.

    Raises:
        TypeError: ``beta`` is not a real number.
        ValueError: ``beta`` is outside ``[0, 1)``.

    Example:
        >>> import torch, gradtap as gt
        >>> t = gt.ewma(beta=0.5)
        >>> s = t.init(torch.zeros(1))
        >>> g, s = t.update(torch.tensor([1.0]), s, None)
        >>> g, s = t.update(torch.tensor([3.0]), s, None)
        >>> g
        tensor([2.])
    """
    b = _beta("ewma", beta)

    def update(grad: Tensor, state: State, param: Tensor | None, /, **extra: Any) -> tuple[Tensor, State]:
        state = _ewma_step(grad, state, b)
        return state["mean"].to(grad.dtype, copy=True), state

    return Transform(_ewma_state, update)


def add_noise(std: float, seed: int = 0) -> Transform:
    """Add Gaussian noise ``N(0, std^2)`` to the gradient, reproducibly.

    One CPU generator, seeded once with ``seed``, draws the noise for every tensor this
    transform is applied to and advances with every update (so two parameters never get the
    same noise). Its state is a ``uint8`` tensor (``Generator.get_state()``) shared by the
    states of all those tensors and updated in place: ``{"rng": Tensor}``. A handle's
    ``state_dict`` therefore carries it and resuming reproduces the same noise. Noise is drawn
    in float32 or wider on the CPU, then moved to the gradient's device and dtype.

    Args:
        std: the standard deviation, ``>= 0`` and finite.
        seed: the generator's seed (an int).

    Raises:
        TypeError: ``std`` is not a real number or ``seed`` is not an int.
        ValueError: ``std`` is negative or infinite, or ``seed`` is out of range.

    Example:
        >>> import torch, gradtap as gt
        >>> t = gt.add_noise(0.1, seed=0)
        >>> a, _ = t.update(torch.zeros(3), t.init(torch.zeros(3)), None)
        >>> u = gt.add_noise(0.1, seed=0)
        >>> bool((u.update(torch.zeros(3), u.init(torch.zeros(3)), None)[0] == a).all())
        True
    """
    sigma = _real("std", "add_noise", std)
    if not 0.0 <= sigma < math.inf:
        raise ValueError(f"add_noise: std must be >= 0 and finite; got {std!r}")
    if not is_int(seed):
        raise TypeError(f"add_noise: seed must be an int; got {type(seed).__name__} {seed!r}")
    gen = torch.Generator()
    try:
        gen.manual_seed(int(seed))
    except (RuntimeError, OverflowError, ValueError) as err:
        raise ValueError(f"add_noise: seed {seed!r} is out of range for torch.Generator") from err
    shared = {"rng": gen.get_state()}

    def init(param: Tensor) -> dict[str, Tensor]:
        # Every tensor's state references the same generator state tensor.
        return {"rng": shared["rng"]}

    def update(grad: Tensor, state: State, param: Tensor | None, /, **extra: Any) -> tuple[Tensor, State]:
        rng = state["rng"]
        gen.set_state(rng)
        noise = torch.randn(grad.shape, generator=gen, dtype=_compute_dtype(grad))
        rng.copy_(gen.get_state())
        return grad + (sigma * noise).to(device=grad.device, dtype=grad.dtype), state

    return Transform(init, update)
