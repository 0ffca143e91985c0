"""Per-sample quantities of calls a consumer already recorded, by the engine's rules.

For a consumer that holds a call's :class:`~gradtap.GradRecord` (its inputs kept) rather
than a whole :class:`~gradtap._samples.engine.PerSample`: :func:`call_compute` gives that
call's per-sample gradients or squared norms of some of its module's own parameters (the
module type's rule, or the ``torch.func`` fallback, exactly as ``gt.per_sample`` computes
them), :func:`batch_size` the number of samples of a model call's arguments, and
:func:`bad_rows` how many non-finite values each sample's row of a tensor holds.

Sample ``n``'s quantities are those of its share of the recorded gradient: the gradient the
record's ``grad_outputs`` carry restricted to row ``n`` (``loss_reduction="sum"`` in
``per_sample``'s terms; ``scale`` multiplies it). A consumer clipping each sample's gradient
reads ``norm_sq()`` and then ``grads()`` of the same :class:`Compute`.

Example:
    >>> import torch, gradtap as gt
    >>> from gradtap._samples.calls import call_compute
    >>> lin = torch.nn.Linear(3, 2)
    >>> with gt.tap(lin, select="", keep=("inputs",)) as t:
    ...     lin(torch.randn(4, 3)).sum().backward()
    >>> comp = call_compute(lin, "", t.records[0], ["weight"], n=4, batch_dim=0)
    >>> comp.norm_sq()["weight"].shape
    torch.Size([4])
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from gradtap._samples.compute import Compute, compute_for
from gradtap._samples.fallback import CannotReplay
from gradtap._samples.frames import samples_of
from gradtap._samples.owners import Owner, check_module, resolve_owners
from gradtap.errors import GradtapError
from gradtap.record import GradRecord

__all__ = ["BatchSplitError", "Compute", "bad_rows", "batch_size", "call_compute"]


class BatchSplitError(GradtapError, ValueError):
    """A tensor or a call that has no row per sample along the batch dim."""


def batch_size(module: nn.Module, args: tuple, kwargs: dict[str, Any], batch_dim: int,
               who: str = "the model") -> int:
    """The number of samples in one call's arguments (as ``gt.per_sample`` counts them: the
    call's layout, else the size most tensor arguments have along ``batch_dim``)."""
    try:
        return samples_of(who, module, args, kwargs, batch_dim)
    except ValueError as err:
        raise BatchSplitError(str(err)) from None


def bad_rows(t: Tensor, n: int, batch_dim: int, what: str) -> Tensor:
    """``[n]`` int64: how many NaN/Inf values each sample's row of ``t`` holds.

    Raises:
        BatchSplitError: ``t`` has no ``n`` rows along ``batch_dim`` (``what`` names it).
    """
    if t.dim() <= batch_dim or t.shape[batch_dim] != n:
        raise BatchSplitError(
            f"{what} of shape {tuple(t.shape)} has no row per sample along "
            f"batch_dim={batch_dim} ({n} samples)")
    bad = ~torch.isfinite(t.detach().movedim(batch_dim, 0))
    return bad.reshape(n, -1).sum(1) if bad.dim() > 1 else bad.long()


def call_compute(module: nn.Module, name: str, rec: GradRecord, params: Iterable[str], n: int,
                 batch_dim: int, scale: float = 1.0) -> Compute:
    """The per-sample quantities of one recorded call of ``module`` (named ``name``) for its
    own parameters ``params`` (names relative to it), on demand (``grads()``,
    ``norm_sq()``, ``sum_sq()``); the record must keep the call's inputs.

    Raises:
        UnsupportedModuleError: the module couples its samples (BatchNorm in training mode).
        BatchSplitError: the call's input or output gradient has no row per sample along
            ``batch_dim``.
    """
    every = dict(module.named_parameters())
    names = [p for p in params if p in every]
    if all("." not in p or p.startswith("parametrizations.") for p in names):
        owners = resolve_owners(module, {p: every[p] for p in names}, batch_dim, fallback=True)
        owner = replace(owners[""], name=name)
    else:  # a descendant's parameters: the torch.func fallback replays this call
        check_module(name, module, batch_dim, subtree=True)
        owner = Owner(name, module, {p: p for p in names}, {}, None)
    try:
        return _Checked(compute_for(owner, rec, scale, frozenset(names), False, n, batch_dim),
                        name, module, batch_dim, n)
    except CannotReplay as err:
        raise _split_error(name, module, batch_dim, n, err) from None


class _Checked(Compute):
    """A :class:`Compute` whose failure to split the call says what to do."""

    def __init__(self, inner: Compute, name: str, module: nn.Module, batch_dim: int,
                 n: int) -> None:
        self._inner, self._where = inner, (name, module, batch_dim, n)

    def _run(self, what: str) -> dict[str, Tensor]:
        try:
            return getattr(self._inner, what)()  # type: ignore[no-any-return]
        except CannotReplay as err:
            raise _split_error(*self._where, err) from None

    def grads(self) -> dict[str, Tensor]:
        return self._run("grads")

    def norm_sq(self) -> dict[str, Tensor]:
        return self._run("norm_sq")

    def sum_sq(self) -> dict[str, Tensor]:
        return self._run("sum_sq")


def _split_error(name: str, module: nn.Module, batch_dim: int, n: int,
                 err: Exception) -> BatchSplitError:
    return BatchSplitError(
        f"module {name!r} ({type(module).__name__}): its call does not split into the batch's "
        f"{n} samples along batch_dim={batch_dim}: {err}")
