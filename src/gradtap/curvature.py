"""Second-order tools: Hessian-vector products, Hutchinson trace and top eigenvalue.

All three differentiate the loss twice with ``torch.autograd`` (reverse over reverse), so they
work on any model whose operations have double backward. Convolutions have it natively; run
the closure inside ``gt.explicit_conv(model)`` to take every order through the explicit
formulas of ``gt.functional.conv`` instead.

Parameters can be given as a whole model, a submodule, a model plus ``select=`` (a parameter
selector, see ``gradtap.select``), a mapping ``name -> tensor``, or a sequence of tensors; the
Hessian is then the block of those parameters only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeAlias, overload

import torch
from torch import Tensor, nn

from gradtap._types import Selector, is_int
from gradtap.select import select_parameters

__all__ = ["hessian_trace", "hvp", "top_eigenvalue"]

#: What ``params`` accepts.
Params: TypeAlias = nn.Module | Tensor | Mapping[str, Tensor] | Iterable[Tensor]


def _resolve(params: Params, select: Selector | None, where: str) -> tuple[list[str], list[Tensor]]:
    if isinstance(params, nn.Module):
        if select is None:
            named: list[tuple[str, Tensor]] = [
                (n, p) for n, p in params.named_parameters() if p.requires_grad]
        else:
            named = [(n, p) for n, p in select_parameters(params, select) if p.requires_grad]
    elif select is not None:
        raise TypeError(
            f"{where}: select= needs params to be an nn.Module, got {type(params).__name__}"
        )
    elif isinstance(params, Tensor):
        named = [("0", params)]
    elif isinstance(params, Mapping):
        named = [(str(k), v) for k, v in params.items()]
    elif isinstance(params, Iterable):
        named = [(str(i), p) for i, p in enumerate(params)]
    else:
        raise TypeError(
            f"{where}: params must be an nn.Module, a tensor, a mapping name -> tensor or an "
            f"iterable of tensors; got {type(params).__name__}"
        )
    if not named:
        raise ValueError(f"{where}: no parameter that requires grad was given")
    for name, p in named:
        if not isinstance(p, Tensor):
            raise TypeError(f"{where}: parameter {name!r} is a {type(p).__name__}, not a tensor")
        if not p.requires_grad:
            raise ValueError(f"{where}: parameter {name!r} does not require grad")
    return [n for n, _ in named], [p for _, p in named]


def _check_loss(loss: object, where: str) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"{where}: the loss must be a scalar tensor, got {got}")
    if not loss.requires_grad:
        raise ValueError(
            f"{where}: the loss does not require grad (was it computed under no_grad?)"
        )
    return loss


def _first_grads(loss: Tensor, params: list[Tensor]) -> tuple[Tensor, ...]:
    return torch.autograd.grad(
        loss, params, create_graph=True, allow_unused=True, materialize_grads=True
    )


def _hessian_product(
    grads: Sequence[Tensor], params: list[Tensor], vectors: Sequence[Tensor], retain_graph: bool
) -> list[Tensor]:
    # A gradient that does not require grad is constant in every parameter (the loss is at most
    # linear there), so its row of the Hessian is zero and it takes no part in the product.
    pairs = [(g, v) for g, v in zip(grads, vectors, strict=True) if g.requires_grad]
    if not pairs:
        return [torch.zeros_like(p) for p in params]
    out = torch.autograd.grad(
        [g for g, _ in pairs],
        params,
        grad_outputs=[v for _, v in pairs],
        retain_graph=retain_graph,
        allow_unused=True,
        materialize_grads=True,
    )
    return list(out)


@overload
def hvp(
    loss: Tensor,
    params: Params,
    vectors: Tensor,
    *,
    select: Selector | None = ...,
    retain_graph: bool = ...,
) -> Tensor: ...
@overload
def hvp(
    loss: Tensor,
    params: Params,
    vectors: Mapping[str, Tensor],
    *,
    select: Selector | None = ...,
    retain_graph: bool = ...,
) -> dict[str, Tensor]: ...
@overload
def hvp(
    loss: Tensor,
    params: Params,
    vectors: Sequence[Tensor],
    *,
    select: Selector | None = ...,
    retain_graph: bool = ...,
) -> list[Tensor]: ...
def hvp(
    loss: Tensor,
    params: Params,
    vectors: Tensor | Mapping[str, Tensor] | Sequence[Tensor],
    *,
    select: Selector | None = None,
    retain_graph: bool = True,
) -> Tensor | dict[str, Tensor] | list[Tensor]:
    """Multiply the Hessian of ``loss`` w.r.t. ``params`` by ``vectors``.

    Computes ``H v`` with two reverse passes (the gradient with ``create_graph=True``, then the
    gradient of ``<grad, v>``), without forming ``H``. The Hessian is the block of the given
    parameters: other parameters are held fixed.

    Args:
        loss: a scalar tensor whose graph reaches ``params``.
        params: an ``nn.Module`` (its parameters that require grad, or those picked by
            ``select``), a tensor, a mapping ``name -> tensor`` or a sequence of tensors.
        vectors: one tensor per parameter, each ``[*param.shape]``: a sequence in parameter
            order, a mapping keyed by parameter name, or a lone tensor for a lone parameter.
        select: a parameter selector (glob, list of globs, module class, predicate) applied
            to ``params`` when it is a module.
        retain_graph: keep the loss's graph so it can be differentiated again (another
            ``hvp``, or ``loss.backward()``).

    Returns:
        ``H v`` in the form of ``vectors``: a list in parameter order, a dict by name, or a
        tensor; each entry ``[*param.shape]``, detached.

    Raises:
        ValueError: the loss is not a scalar that requires grad, or the vectors do not match
            the parameters in number, names or shapes.

    Example:
        >>> import torch, gradtap as gt
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> loss = (w ** 3).sum()                      # H = diag(6 w)
        >>> gt.hvp(loss, [w], [torch.ones(2)])
        [tensor([ 6., 12.])]
    """
    where = "hvp"
    loss = _check_loss(loss, where)
    names, tensors = _resolve(params, select, where)
    if isinstance(vectors, Tensor):
        if len(tensors) != 1:
            raise ValueError(
                f"{where}: a lone tensor of vectors needs exactly one parameter, got {len(tensors)}"
            )
        vecs = [vectors]
    elif isinstance(vectors, Mapping):
        if set(vectors) != set(names):
            missing = sorted(set(names) - set(vectors))
            extra = sorted(set(vectors) - set(names))
            raise ValueError(
                f"{where}: vectors must be keyed by the parameter names; missing {missing}, unexpected {extra}"
            )
        vecs = [vectors[n] for n in names]
    else:
        vecs = list(vectors)
        if len(vecs) != len(tensors):
            raise ValueError(
                f"{where}: got {len(vecs)} vectors for {len(tensors)} parameters ({', '.join(names)})"
            )
    for name, p, v in zip(names, tensors, vecs, strict=True):
        if not isinstance(v, Tensor) or v.shape != p.shape:
            got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(
                f"{where}: vector for parameter {name!r} must have shape {tuple(p.shape)}, got {got}"
            )
    out = _hessian_product(_first_grads(loss, tensors), tensors, vecs, retain_graph)
    if isinstance(vectors, Tensor):
        return out[0]
    if isinstance(vectors, Mapping):
        return dict(zip(names, out, strict=True))
    return out


def _generators(tensors: list[Tensor], seed: int) -> dict[torch.device, torch.Generator]:
    gens: dict[torch.device, torch.Generator] = {}
    for p in tensors:
        if p.device not in gens:
            gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
    return gens


def hessian_trace(
    loss_fn: Callable[[], Tensor],
    params: Params,
    samples: int = 64,
    per_param: bool = False,
    *,
    select: Selector | None = None,
    seed: int = 0,
) -> float | dict[str, float]:
    """Estimate the trace of the Hessian with Hutchinson's method (Rademacher probes).

    ``tr(H) ~ mean_s v_s^T H v_s`` with entries of ``v_s`` drawn from {-1, +1} by a generator
    seeded with ``seed`` (same seed, same estimate). The estimate is unbiased; its standard
    error shrinks as ``1 / sqrt(samples)``. ``loss_fn`` is called once and its graph is reused
    for every probe.

    Args:
        loss_fn: a zero-argument closure returning the scalar loss, e.g.
            ``lambda: F.cross_entropy(model(x), y)``.
        params: an ``nn.Module`` (its parameters that require grad, or those picked by
            ``select``), a tensor, a mapping ``name -> tensor`` or a sequence of tensors.
        samples: number of Rademacher probes.
        per_param: return the trace of each parameter's diagonal block, keyed by parameter
            name (positions ``"0"``, ``"1"``, ... for a sequence), instead of the total.
        select: a parameter selector applied to ``params`` when it is a module.
        seed: seed of the probe generator.

    Returns:
        The estimated trace, or ``{name: trace of that parameter's block}`` (they sum to the
        total) when ``per_param``.

    Raises:
        ValueError: ``samples < 1``, or the closure does not return a scalar that requires grad.

    Example:
        >>> import torch, gradtap as gt
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> gt.hessian_trace(lambda: (w ** 3).sum(), [w], samples=4)   # exact for diagonal H
        18.0
    """
    where = "hessian_trace"
    if not is_int(samples) or samples < 1:
        raise ValueError(f"{where}: samples must be a positive int, got {samples!r}")
    names, tensors = _resolve(params, select, where)
    loss = _check_loss(loss_fn(), where)
    grads = _first_grads(loss, tensors)
    gens = _generators(tensors, seed)
    totals = [torch.zeros((), dtype=p.dtype, device=p.device) for p in tensors]
    for s in range(samples):
        probes = [
            torch.randint(0, 2, p.shape, generator=gens[p.device], device=p.device)
            .to(p.dtype)
            .mul_(2)
            .sub_(1)
            for p in tensors
        ]
        products = _hessian_product(grads, tensors, probes, retain_graph=s < samples - 1)
        for i, (v, hv) in enumerate(zip(probes, products, strict=True)):
            totals[i] = totals[i] + torch.vdot(v.flatten(), hv.flatten())
    # One host transfer for all blocks.
    values = [t / samples for t in torch.stack([t.double().cpu() for t in totals]).tolist()]
    if per_param:
        return dict(zip(names, values, strict=True))
    return float(sum(values))


def top_eigenvalue(
    loss_fn: Callable[[], Tensor],
    params: Params,
    iters: int = 100,
    *,
    tol: float = 1e-6,
    select: Selector | None = None,
    seed: int = 0,
) -> float:
    """Find the Hessian eigenvalue of largest magnitude by power iteration.

    Starts from a seeded Gaussian vector over all selected parameters, repeatedly applies the
    Hessian (one Hessian-vector product per iteration, reusing one graph of ``loss_fn``) and
    normalises, and returns the Rayleigh quotient ``v^T H v``. It stops after ``iters``
    products or when the quotient changes by at most ``tol`` relative. The result keeps its
    sign (a saddle's dominant curvature can be negative). Convergence is geometric in
    ``|lambda_2 / lambda_1|``: slow when the two largest magnitudes are close, and no
    convergence when they are equal with opposite signs.

    Args:
        loss_fn: a zero-argument closure returning the scalar loss.
        params: an ``nn.Module`` (its parameters that require grad, or those picked by
            ``select``), a tensor, a mapping ``name -> tensor`` or a sequence of tensors.
        iters: maximum number of power iterations.
        tol: relative change of the Rayleigh quotient under which to stop.
        select: a parameter selector applied to ``params`` when it is a module.
        seed: seed of the starting vector.

    Returns:
        The eigenvalue of largest magnitude of the Hessian block of ``params`` (0.0 when the
        Hessian is zero).

    Raises:
        ValueError: ``iters < 1``, ``tol < 0``, or the closure does not return a scalar that
            requires grad.

    Example:
        >>> import torch, gradtap as gt
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> round(gt.top_eigenvalue(lambda: (w ** 3).sum(), [w], iters=200, tol=1e-10), 4)
        12.0
    """
    where = "top_eigenvalue"
    if not is_int(iters) or iters < 1:
        raise ValueError(f"{where}: iters must be a positive int, got {iters!r}")
    if tol < 0:
        raise ValueError(f"{where}: tol must be >= 0, got {tol!r}")
    _, tensors = _resolve(params, select, where)
    loss = _check_loss(loss_fn(), where)
    grads = _first_grads(loss, tensors)
    gens = _generators(tensors, seed)
    v = [
        torch.randn(p.shape, generator=gens[p.device], dtype=p.dtype, device=p.device)
        for p in tensors
    ]
    start_norm = _global_norm(v)
    v = [t / start_norm for t in v]
    eigenvalue = 0.0
    for i in range(iters):
        hv = _hessian_product(grads, tensors, v, retain_graph=i < iters - 1)
        previous = eigenvalue
        eigenvalue = float(
            sum(torch.vdot(a.flatten(), b.flatten()) for a, b in zip(v, hv, strict=True))
        )
        norm = _global_norm(hv)
        if norm == 0.0:
            return 0.0
        if i > 0 and abs(eigenvalue - previous) <= tol * abs(eigenvalue):
            break
        v = [t / norm for t in hv]
    return eigenvalue


def _global_norm(vectors: list[Tensor]) -> float:
    return math.sqrt(sum(float(torch.vdot(t.flatten(), t.flatten())) for t in vectors))
