"""The quantities of one record (per-sample gradients, squared norms, sums of squares).

:func:`compute_for` picks how: the module type's rule on ``(input, grad_out)`` (carried back
through a parametrization where there is one), its linear pieces, or the ``torch.func``
fallback, which replays the call. Each computes only what is asked, on demand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from gradtap._samples.fallback import CannotReplay, grad_fallback, quiet_vmap, replay_call
from gradtap._samples.layout import KeptCall
from gradtap._samples.owners import Owner, rows
from gradtap._samples.rule import PerSampleRule, Piece, _numel, budget, chunks
from gradtap._samples.rules.linear import (
    grad_pieces,
    norm_sq_pieces,
    sum_sq_pieces,
    total_pieces,
)
from gradtap.record import GradRecord

__all__ = ["Compute", "FallbackCompute", "ParametrizedCompute", "PiecesCompute", "RuleCompute",
           "compute_for"]


class Compute:
    """The quantities of one record, computed on demand."""

    def grads(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def norm_sq(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def sum_sq(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def total(self) -> dict[str, Tensor]:
        """``sum_n g_n``, ``param.shape``: the batch gradient times the scale."""
        return {k: g.sum(0) for k, g in self.grads().items()}

    def weighted_total(self, coefs: dict[str, Tensor]) -> dict[str, Tensor]:
        """``sum_n c_n g_n`` per name, with ``coefs[name]`` ``[N]``: here from the
        per-sample gradients; rules and pieces weight the output gradient instead."""
        return {k: torch.tensordot(coefs[k].to(g.dtype), g, dims=1)
                for k, g in self.grads().items()}

    @property
    def closed_form(self) -> bool:
        """Whether :meth:`weighted_total` needs no per-sample gradients."""
        return False


class RuleCompute(Compute):
    """A registered rule on ``(input, grad_out)``; ``after`` scales results (rules are linear)."""

    def __init__(self, owner: Owner, inp: Tensor, go: Tensor, names: frozenset[str],
                 after: float = 1.0) -> None:
        self.owner, self.inp, self.go, self.names, self.after = owner, inp, go, names, after
        self._kept: dict[str, Tensor] | None = None
        self._keeps: bool | None = None

    def _small(self) -> dict[str, Tensor] | None:
        """The per-sample gradients, unscaled, built once and kept, for a rule with only
        ``grad`` (its norms and sums would build them anyway, each time) whose gradients
        are no larger than the input kept beside them (the norms' affine parameters):
        ``None`` for any other."""
        if self._keeps is None:
            rule = self.rule
            self._keeps = (rule.grad is not None and rule.norm_sq is None
                           and rule.total is None
                           and self.inp.shape[0] * _numel(self.owner.module, self.names)
                           <= self.inp.numel())
        if self._keeps and self._kept is None:
            grad = self.rule.grad
            assert grad is not None
            self._kept = grad(self.owner.module, self.inp, self.go, self.names)
        return self._kept

    def _scaled(self, out: dict[str, Tensor], factor: float) -> dict[str, Tensor]:
        if factor != 1.0:
            for v in out.values():
                v.mul_(factor)  # rule results are fresh tensors
        return out

    @property
    def rule(self) -> PerSampleRule:
        assert self.owner.rule is not None
        return self.owner.rule

    def grads(self) -> dict[str, Tensor]:
        small = self._small()
        if small is not None:
            return {k: g * self.after for k, g in small.items()}
        grad = self.rule.grad
        assert grad is not None
        return self._scaled(grad(self.owner.module, self.inp, self.go, self.names), self.after)

    def norm_sq(self) -> dict[str, Tensor]:
        small = self._small()
        if small is not None:
            return self._scaled({k: g.reshape(g.shape[0], -1).square().sum(1)
                                 for k, g in small.items()}, self.after**2)
        out = self.rule.norm_sq_of(self.owner.module, self.inp, self.go, self.names)
        return self._scaled(out, self.after**2)

    def sum_sq(self) -> dict[str, Tensor]:
        small = self._small()
        if small is not None:
            return self._scaled({k: g.square().sum(0) for k, g in small.items()}, self.after**2)
        out = self.rule.sum_sq_of(self.owner.module, self.inp, self.go, self.names)
        return self._scaled(out, self.after**2)

    def total(self) -> dict[str, Tensor]:
        small = self._small()
        if small is not None:
            return self._scaled({k: g.sum(0) for k, g in small.items()}, self.after)
        out = self.rule.total_of(self.owner.module, self.inp, self.go, self.names)
        return self._scaled(out, self.after)

    def weighted_total(self, coefs: dict[str, Tensor]) -> dict[str, Tensor]:
        """``sum_n c_n g_n``: every rule is linear in the output gradient, so it is the
        batch gradient (``total``) of ``c_n`` times sample n's output gradient (or, where
        the per-sample gradients are kept, their contraction with ``c``)."""
        small = self._small()
        if small is not None:
            return self._scaled({k: torch.tensordot(coefs[k].to(g.dtype), g, dims=1)
                                 for k, g in small.items()}, self.after)
        out: dict[str, Tensor] = {}
        for group in _same_coefs(coefs, self.names):
            c = coefs[next(iter(group))]
            go = self.go * c.to(self.go.dtype).reshape(-1, *([1] * (self.go.dim() - 1)))
            res = self.rule.total_of(self.owner.module, self.inp, go, group)
            out.update(self._scaled(res, self.after))
        return out

    @property
    def closed_form(self) -> bool:
        """No parametrization, and norms without per-sample gradients (``norm_builds``):
        where the norms build them anyway, building them once is cheaper."""
        builds = self.rule.norm_builds
        return not self.owner.parametrized and not (
            builds is not None and builds(self.owner.module, self.inp, self.go))

    def sketch(self, names: frozenset[str], r: Tensor) -> dict[str, Tensor]:
        """``total() @ r`` for the names the rule's ``total_sketch`` covers."""
        sketch = self.rule.total_sketch
        assert sketch is not None
        out = sketch(self.owner.module, self.inp, self.go, names & self.names, r)
        return self._scaled(out, self.after)

    def total_is_cheap(self, grads: dict[str, Tensor]) -> bool:
        """Whether ``total`` costs less than summing the per-sample gradients ``grads``."""
        cost = self.rule.total_cost
        return (cost is not None and self.rule.total is not None
                and cost(self.inp, self.go) < sum(g.numel() for g in grads.values()))


class ParametrizedCompute(RuleCompute):
    """A rule's gradients w.r.t. a parametrized tensor, carried back to its originals.

    Per sample, ``d s_n / d original = J^T (d s_n / d weight)`` with ``J`` the Jacobian of
    the parametrization at the current originals: one ``vjp``, vmapped over samples.
    """

    def grads(self) -> dict[str, Tensor]:
        module, owner = self.owner.module, self.owner
        originals = {rel for rels in owner.parametrized.values() for rel in rels}
        rule_names = (self.names - originals) | {
            t for t, rels in owner.parametrized.items() if set(rels) & self.names
        }
        grad = self.rule.grad
        assert grad is not None
        raw = grad(module, self.inp, self.go, frozenset(rule_names))
        out = {k: v for k, v in raw.items() if k not in owner.parametrized}
        for tensor, rels in owner.parametrized.items():
            if tensor not in raw:
                continue
            plist = cast(Any, module).parametrizations[tensor]  # a parametrized module
            prefix = f"parametrizations.{tensor}."
            primals = {rel[len(prefix):]: getattr(plist, rel[len(prefix):]).detach()
                       for rel in rels}
            with torch.enable_grad(), quiet_vmap():
                pullback = torch.func.vjp(
                    lambda p, plist=plist: torch.func.functional_call(plist, p, ()), primals
                )[1]
                per_sample = torch.func.vmap(pullback)(raw[tensor])[0]
            out.update({prefix + k: v for k, v in per_sample.items()})
        return out

    def norm_sq(self) -> dict[str, Tensor]:
        return {k: (g.flatten(1) if g.dim() > 1 else g.unsqueeze(1)).square().sum(1) for k, g in self.grads().items()}

    def sum_sq(self) -> dict[str, Tensor]:
        return {k: g.square().sum(0) for k, g in self.grads().items()}

    def total(self) -> dict[str, Tensor]:
        return {k: g.sum(0) for k, g in self.grads().items()}

    def total_is_cheap(self, grads: dict[str, Tensor]) -> bool:
        return False

    def weighted_total(self, coefs: dict[str, Tensor]) -> dict[str, Tensor]:
        return Compute.weighted_total(self, coefs)


class PiecesCompute(Compute):
    def __init__(self, pieces: list[Piece], names: frozenset[str]) -> None:
        self.pieces, self.names = pieces, names

    def grads(self) -> dict[str, Tensor]:
        return grad_pieces(self.pieces, self.names)

    def norm_sq(self) -> dict[str, Tensor]:
        return norm_sq_pieces(self.pieces, self.names)

    def sum_sq(self) -> dict[str, Tensor]:
        return sum_sq_pieces(self.pieces, self.names)

    def total(self) -> dict[str, Tensor]:
        return total_pieces(self.pieces, self.names)

    def weighted_total(self, coefs: dict[str, Tensor]) -> dict[str, Tensor]:
        """``sum_n c_n g_n``: the pieces' batch gradients with weighted output gradients."""
        def weighted(p: Piece) -> Piece:
            c = coefs[p.name].to(p.grad_out.dtype)
            return p._replace(grad_out=p.grad_out * c.reshape(-1, *([1] * (p.grad_out.dim() - 1))))

        names = self.names & set(coefs)
        return total_pieces([weighted(p) for p in self.pieces if p.name in names], names)

    @property
    def closed_form(self) -> bool:
        return True


class FallbackCompute(Compute):
    def __init__(self, owner: Owner, rec: GradRecord, scale: float, names: frozenset[str],
                 batch_dim: int, n: int, call: KeptCall | None) -> None:
        self.owner, self.rec, self.scale, self.names = owner, rec, scale, names
        self.batch_dim, self.n, self.call = batch_dim, n, call

    def _run(self, samples: slice | None = None) -> dict[str, Tensor]:
        if self.call is not None:  # the arguments as passed, non-tensors included
            module = self.owner.module
            every = dict(module.named_parameters())
            grads = {k: g for k, g in self.rec.grad_outputs.items() if g is not None}
            args, kwargs, outputs, members = self.call
            return replay_call(module, self.owner.name, args, kwargs, grads,
                               {k: every[k] for k in self.names}, self.batch_dim, self.n,
                               self.scale, samples, outputs=outputs, members=members)
        return grad_fallback(self.owner.module, self.owner.name, self.rec.inputs,
                             self.rec.grad_outputs, self.names, self.batch_dim, self.scale,
                             samples, self.n)

    def grads(self) -> dict[str, Tensor]:
        return self._run()

    def _chunks(self) -> Sequence[slice]:
        tensors = [*self.rec.inputs.values(),
                   *(g for g in self.rec.grad_outputs.values() if g is not None)]
        params = dict(self.owner.module.named_parameters())
        per_sample = sum(params[k].numel() for k in self.names)
        return list(chunks(self.n, per_sample, budget(*tensors)))

    def norm_sq(self) -> dict[str, Tensor]:
        parts: dict[str, list[Tensor]] = {}
        for sl in self._chunks():
            for k, g in self._run(sl).items():
                parts.setdefault(k, []).append((g.flatten(1) if g.dim() > 1 else g.unsqueeze(1)).square().sum(1))
        return {k: torch.cat(v) for k, v in parts.items()}

    def sum_sq(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for sl in self._chunks():
            for k, g in self._run(sl).items():
                s = g.square().sum(0)
                out[k] = s if k not in out else out[k] + s
        return out


def _same_coefs(coefs: dict[str, Tensor], names: frozenset[str]) -> list[frozenset[str]]:
    """``names`` grouped by their coefficient tensor (one group under flat clipping)."""
    groups: dict[int, set[str]] = {}
    for k in sorted(names & set(coefs)):
        groups.setdefault(id(coefs[k]), set()).add(k)
    return [frozenset(g) for g in groups.values()]


def compute_for(owner: Owner, rec: GradRecord, scale: float, names: frozenset[str],
                materialize: bool, n: int, bd: int,
                call: KeptCall | None = None) -> Compute:
    """How to compute the quantities of one record: its rule, its pieces or the fallback.

    ``scale`` turns the recorded output gradient into ``d s_n / d output``;
    ``materialize`` says whether ``[N, *param.shape]`` will be built anyway; ``call`` is the
    call's arguments as passed, which the fallback replays when given (the record keeps
    only tensor arguments).
    """
    if owner.rule is not None and "output" in rec.grad_outputs and rec.inputs:
        inp = next(iter(rec.inputs.values()))
        go = rec.grad_outputs["output"]
        if go is not None:
            if rows(inp, bd) != n or rows(go, bd) != n:
                raise CannotReplay(
                    f"its input {tuple(inp.shape)} or output gradient {tuple(go.shape)} has "
                    f"no row per sample along batch_dim={bd} ({n} samples)")
            inp, go = inp.movedim(bd, 0), go.movedim(bd, 0)
            # Rules are linear in grad_out: scale it, or their results if those are smaller
            # (norms and sums of squares, [N] and param-shaped, always are).
            params = dict(owner.module.named_parameters())
            results = go.shape[0] * sum(params[k].numel() for k in names if k in params)
            smaller = not materialize or go.numel() > results
            after = scale if smaller and not owner.parametrized else 1.0
            if after == 1.0:
                go = go * scale
            cls = ParametrizedCompute if owner.parametrized else RuleCompute
            return cls(owner, inp, go, names, after)
    entry = owner.pieces
    if entry is not None and entry.pieces is not None:
        pieces = entry.pieces(owner.module, rec.inputs, rec.grad_outputs, scale)
        if pieces is not None:
            return PiecesCompute(pieces, names)
    return FallbackCompute(owner, rec, scale, names, bd, n, call)
