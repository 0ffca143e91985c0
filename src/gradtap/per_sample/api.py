"""``gt.per_sample``: per-sample gradients, their norms and their batch statistics.

How it works: one :func:`gradtap.capture.tap` on the modules that directly own a selected
parameter, keeping their forward inputs. As each call's record completes in backward, the
module type's rule (``per_sample.table``; the ``torch.func`` fallback for other types) turns
``(module, input, grad_output)`` into exactly the quantities asked for, the record is dropped,
and only small accumulators stay. When only norms or statistics are asked, ``[N, *shape]``
is never built for layers with a closed form (Linear, convolutions, Embedding) and is built a
chunk of samples at a time for the others. A module called several times per forward has
per-sample gradients summed over its calls; it is materialized, because norms of a sum do not
add up.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar, get_args

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrize import type_before_parametrizations

from gradtap._registry import TypeTable
from gradtap._types import Selector
from gradtap.capture import Listener, tap
from gradtap.errors import GradtapError, SelectionError, UnsupportedModuleError
from gradtap.per_sample import rules as _rules  # noqa: F401  (registers every rule)
from gradtap.per_sample.fallback import grad_fallback, quiet_vmap
from gradtap.per_sample.rules.linear import grad_pieces, norm_sq_pieces, sum_sq_pieces
from gradtap.per_sample.table import (
    BATCH_DIM,
    CHECK,
    GRAD,
    NORM,
    PIECES,
    SUM_SQ,
    Piece,
    PiecesRule,
    Rule,
    budget,
    chunks,
    norm_sq_from_grad,
    sum_sq_from_grad,
)
from gradtap.record import GradRecord
from gradtap.select import select_parameters

__all__ = ["PerSample", "Quantity", "per_sample"]

Quantity = Literal["grad", "norm", "variance", "second_moment", "snr"]
LossReduction = Literal["mean", "sum"]
_QUANTITIES: tuple[str, ...] = get_args(Quantity)
_STATS = frozenset({"variance", "second_moment", "snr"})
R = TypeVar("R")

#: Added to the variance in ``snr`` (DESIGN.md).
SNR_EPS = 1e-12


@dataclass
class _Owner:
    """A module that directly owns selected parameters, resolved once."""

    name: str
    module: nn.Module
    direct: dict[str, str]  # parameter name relative to the module -> qualified name
    nested: dict[str, tuple[str, str]]  # descendant's relative name -> (qualified, owner name)
    rule: Rule | None
    pieces: PiecesRule | None  # neither rule nor pieces: the torch.func fallback
    # A parametrized tensor ("weight") -> its selected originals' relative names.
    parametrized: dict[str, list[str]] = field(default_factory=dict)
    calls: int = 0
    seen: set[str] = field(default_factory=set)


def _split(qual: str) -> tuple[str, str, str | None]:
    """``(owner, relative name, parametrized tensor)`` of a qualified parameter name.

    ``"fc.parametrizations.weight.original0"`` belongs to ``fc`` (whose forward uses the
    parametrized ``weight``), not to the ``ParametrizationList`` that stores it.
    """
    parts = qual.split(".")
    if len(parts) >= 3 and parts[-3] == "parametrizations" and parts[-1].startswith("original"):
        return ".".join(parts[:-3]), ".".join(parts[-3:]), parts[-2]
    owner, _, rel = qual.rpartition(".")
    return owner, rel, None


def _qualify(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _rule_for(table: TypeTable[R], module: nn.Module) -> R | None:
    """The registered rule, unless the module's class overrides the registered ``forward``."""
    rule = table.lookup(module)
    if rule is None:
        return None
    cls = type_before_parametrizations(module)
    owner = next(c for c in cls.__mro__ if c in table)
    return rule if cls.forward is owner.forward else None


class PerSample:
    """Per-sample gradients and statistics of one model; see :func:`per_sample`.

    Results are read after backward, inside or after the ``with`` block, and cover every
    backward since the start or the last :meth:`clear`, like ``.grad`` accumulates.
    """

    def __init__(
        self,
        model: nn.Module,
        select: Selector = "*",
        *,
        loss_reduction: LossReduction = "mean",
        batch_dim: int = 0,
        quantities: Iterable[Quantity] = ("grad", "norm"),
        fallback: bool = True,
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum'; got {loss_reduction!r}")
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"batch_dim must be a non-negative int; got {batch_dim!r}")
        quantities = (quantities,) if isinstance(quantities, str) else tuple(quantities)
        unknown = [q for q in quantities if q not in _QUANTITIES]
        if unknown or not quantities:
            raise ValueError(
                f"quantities must be a non-empty subset of {_QUANTITIES}; got {quantities!r}"
            )
        self.loss_reduction = loss_reduction
        self.batch_dim = batch_dim
        self.quantities: tuple[Quantity, ...] = quantities
        self._want_grad = "grad" in quantities
        self._want_norm = "norm" in quantities
        self._want_stats = bool(_STATS & set(quantities))
        self._want_var = bool({"variance", "snr"} & set(quantities))

        params = select_parameters(model, select)
        self._params = {n: p for n, p in params if p.requires_grad}
        if not self._params:
            raise SelectionError(
                f"select={select!r} matches only parameters that do not require grad: "
                f"{', '.join(n for n, _ in params)}"
            )
        self._owners = self._resolve(model, fallback)
        self.batch_size: int | None = None
        self._reset()
        owners = set(self._owners)
        # The tap must not keep this object alive: a reference cycle would hold every result
        # (hundreds of MB of per-sample gradients) until the cyclic garbage collector runs.
        me = weakref.ref(self)
        self._tap = tap(
            model,
            select=lambda name, _module: name in owners,
            keep=("inputs",),
            store=False,
            listener=_Forward(me),
        )

    # -- setup ------------------------------------------------------------------------------

    def _resolve(self, model: nn.Module, fallback: bool) -> dict[str, _Owner]:
        modules = dict(model.named_modules())
        owned: dict[str, dict[str, str]] = {}
        parametrized: dict[str, dict[str, list[str]]] = {}
        for qual in self._params:
            owner, rel, tensor = _split(qual)
            owned.setdefault(owner, {})[rel] = qual
            if tensor is not None:
                parametrized.setdefault(owner, {}).setdefault(tensor, []).append(rel)
        owners: dict[str, _Owner] = {}
        for name, direct in owned.items():
            module = modules[name]
            rule = _rule_for(GRAD, module)
            pieces = _rule_for(PIECES, module) if rule is None else None
            if rule is None and pieces is None and not fallback:
                raise UnsupportedModuleError(
                    f"no per-sample rule for module {name!r} of type {type(module).__name__} "
                    f"(owner of {', '.join(direct.values())}), and fallback=False; supported "
                    f"types (and subclasses): {', '.join(GRAD.supported())}"
                )
            _check(name, module, self.batch_dim, rule is None and pieces is None)
            nested = {
                q[len(name) + 1 :] if name else q: (q, o)
                for o, d in owned.items()
                if o != name and (not name or o.startswith(name + "."))
                for q in d.values()
            }
            owners[name] = _Owner(name, module, direct, nested, rule, pieces,
                                  parametrized.get(name, {}))
        return owners

    def _reset(self) -> None:
        self.batch_size = None
        self._grad: dict[str, Tensor] = {}
        self._norm_sq: dict[str, Tensor] = {}
        self._sum_sq: dict[str, Tensor] = {}
        self._total: dict[str, Tensor] = {}
        self._problems: list[str] = []
        self._results: dict[str, object] | None = None
        for owner in self._owners.values():
            owner.calls = 0
            owner.seen = set()

    # -- hooks (forward, then backward) -----------------------------------------------------

    def _on_forward(self, name: str, call: int, module: nn.Module, inputs: dict[str, Tensor],
                    outputs: dict[str, Tensor]) -> None:
        owner = self._owners[name]
        owner.calls += 1
        _check(name, module, self.batch_dim, owner.rule is None and owner.pieces is None)
        first = next(iter(inputs.values()), None)
        if first is None or first.dim() <= self.batch_dim:
            got = "no tensor argument" if first is None else f"shape {tuple(first.shape)}"
            raise ValueError(
                f"per_sample: module {name!r} was called with {got}; every input needs the "
                f"sample dim batch_dim={self.batch_dim}"
            )
        n = first.shape[self.batch_dim]
        if self.batch_size is None:
            self.batch_size = n
        elif n != self.batch_size:
            raise ValueError(
                f"per_sample: module {name!r} got {n} samples along batch_dim={self.batch_dim}, "
                f"but an earlier call had {self.batch_size}; call ps.clear() between batches"
            )

    def _on_record(self, rec: GradRecord) -> None:
        owner = self._owners[rec.module_name]
        if all(g is None for g in rec.grad_outputs.values()):
            return
        self._results = None
        n = next(iter(rec.inputs.values())).shape[self.batch_dim]
        scale = float(n) if self.loss_reduction == "mean" else 1.0
        names = dict(owner.direct)
        if owner.rule is None:
            # A descendant that owns selected parameters but was never called (e.g.
            # MultiheadAttention's out_proj) has them used by this call: cover them here
            # (pieces rules and the fallback see the whole subtree).
            for rel, (qual, sub) in owner.nested.items():
                if self._owners[sub].calls == 0 and rec.param_grads.get(rel) is not None:
                    names[rel] = qual
        materialize = self._want_grad or owner.calls > 1 or bool(owner.seen & set(names))
        with torch.no_grad():
            compute = self._computer(owner, rec, scale, frozenset(names), materialize)
            if materialize:
                self._add_grads(owner, names, compute.grads())
            else:
                self._add_reduced(owner, names, compute, rec, scale)
        owner.seen.update(names)

    def _computer(self, owner: _Owner, rec: GradRecord, scale: float,
                  names: frozenset[str], materialize: bool = True) -> _Compute:
        if owner.rule is not None and "output" in rec.grad_outputs and rec.inputs:
            inp = next(iter(rec.inputs.values())).movedim(self.batch_dim, 0)
            go = rec.grad_outputs["output"]
            if go is not None:
                go = go.movedim(self.batch_dim, 0)
                # Rules are linear in grad_out: scale it, or their results if those are smaller
                # (norms and sums of squares, [N] and param-shaped, always are).
                params = dict(owner.module.named_parameters())
                results = go.shape[0] * sum(params[k].numel() for k in names if k in params)
                smaller = not materialize or go.numel() > results
                after = scale if smaller and not owner.parametrized else 1.0
                if after == 1.0:
                    go = go * scale
                cls = _ParametrizedCompute if owner.parametrized else _RuleCompute
                return cls(owner, inp, go, names, after)
        if owner.pieces is not None:
            pieces = owner.pieces(owner.module, rec.inputs, rec.grad_outputs, scale)
            if pieces is not None:
                return _PiecesCompute(pieces, names)
        return _FallbackCompute(owner, rec, scale, names, self.batch_dim)

    def _add_grads(self, owner: _Owner, names: dict[str, str], grads: dict[str, Tensor]) -> None:
        for rel, g in grads.items():
            qual = names[rel]
            if qual in self._norm_sq or qual in self._sum_sq:
                self._problems.append(qual)
            self._grad[qual] = g if qual not in self._grad else self._grad[qual] + g

    def _add_reduced(self, owner: _Owner, names: dict[str, str], compute: _Compute,
                     rec: GradRecord, scale: float) -> None:
        if self._want_norm:
            for rel, v in compute.norm_sq().items():
                self._norm_sq[names[rel]] = v
        if self._want_stats:
            for rel, v in compute.sum_sq().items():
                self._sum_sq[names[rel]] = v
        if self._want_var:
            for rel, qual in names.items():
                g = rec.param_grads.get(rel)
                if g is not None:
                    self._total[qual] = g * scale

    # -- results ----------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Qualified names of the selected parameters (the keys of every result dict)."""
        return list(self._params)

    @property
    def grad(self) -> dict[str, Tensor]:
        """``{name: [N, *param.shape]}``: ``d s_n / d param`` for each sample n."""
        return self._get("grad")  # type: ignore[return-value]

    @property
    def norm(self) -> Tensor:
        """``[N]``: per-sample gradient norm over all selected parameters."""
        return self._get("norm")  # type: ignore[return-value]

    @property
    def norms(self) -> dict[str, Tensor]:
        """``{name: [N]}``: per-sample gradient norm of each parameter."""
        return self._get("norms", "norm")  # type: ignore[return-value]

    @property
    def second_moment(self) -> dict[str, Tensor]:
        """``{name: param.shape}``: ``mean_n g_n**2``, elementwise."""
        return self._get("second_moment")  # type: ignore[return-value]

    @property
    def variance(self) -> dict[str, Tensor]:
        """``{name: param.shape}``: ``second_moment - mean_n(g_n)**2`` (ddof=0), elementwise."""
        return self._get("variance")  # type: ignore[return-value]

    @property
    def snr(self) -> dict[str, Tensor]:
        """``{name: param.shape}``: ``mean_n(g_n)**2 / (variance + 1e-12)``, elementwise."""
        return self._get("snr")  # type: ignore[return-value]

    def _get(self, key: str, quantity: str | None = None) -> object:
        quantity = quantity or key
        if quantity not in self.quantities:
            raise GradtapError(
                f"per_sample: {key!r} was not requested; pass quantities=(..., {quantity!r}) "
                f"(requested: {', '.join(self.quantities)})"
            )
        if self._results is None:
            self._results = self._finish()
        return self._results[key]

    def _finish(self) -> dict[str, object]:
        n = self.batch_size
        if n is None or not (self._grad or self._norm_sq or self._sum_sq or self._total):
            raise GradtapError(
                "per_sample: no per-sample gradient was computed yet; read the results after "
                "a forward and backward pass inside the `with gt.per_sample(...)` block"
            )
        if self._problems:
            shared = sorted({q for q in self._problems})
            raise GradtapError(
                "per_sample: the parameters "
                f"{', '.join(shared)} got per-sample gradients from more than one backward pass "
                "since the start or the last ps.clear(), after their norms/statistics were "
                "already reduced; call ps.clear() before each forward, or add 'grad' to quantities"
            )
        out: dict[str, object] = {}
        grads: dict[str, Tensor] = {}
        norms: dict[str, Tensor] = {}
        second: dict[str, Tensor] = {}
        var: dict[str, Tensor] = {}
        snr: dict[str, Tensor] = {}
        for qual, p in self._params.items():
            g = self._grad.get(qual)
            if g is None and qual not in self._norm_sq and qual not in self._sum_sq:
                # Never reached by this backward: every sample's gradient is zero.
                g = p.new_zeros((n, *p.shape))
            if g is not None:
                grads[qual] = g
                if self._want_norm:
                    norms[qual] = g.flatten(1).square().sum(1)
                if "second_moment" in self.quantities:
                    second[qual] = g.square().mean(0)
                if self._want_var:
                    var[qual], m = torch.var_mean(g, 0, correction=0)
                    if "snr" in self.quantities:
                        snr[qual] = m.square() / (var[qual] + SNR_EPS)
                continue
            if self._want_norm:
                norms[qual] = self._norm_sq[qual]
            if self._want_stats:
                second[qual] = sm = self._sum_sq[qual] / n
            if self._want_var:
                total = self._total.get(qual)
                m2 = (total / n).square_() if total is not None else torch.zeros_like(sm)
                var[qual] = (sm - m2).clamp_min_(0)
                if "snr" in self.quantities:
                    snr[qual] = m2 / (var[qual] + SNR_EPS)
        if self._want_grad:
            out["grad"] = grads
        if self._want_norm:
            out["norm"] = torch.stack(list(norms.values())).sum(0).sqrt()
            out["norms"] = {k: v.sqrt() for k, v in norms.items()}
        out["second_moment"], out["variance"], out["snr"] = second, var, snr
        return out

    # -- lifecycle --------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every result and call count, ready for the next batch."""
        self._tap.clear()
        self._reset()

    def remove(self) -> None:
        """Remove every hook; results stay readable. Safe to call twice."""
        self._tap.remove()

    def __enter__(self) -> PerSample:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (f"<PerSample {len(self._params)} parameters in {len(self._owners)} modules, "
                f"quantities={self.quantities}>")


class _Forward(Listener):
    """Hands the tap's calls and records on to a PerSample without keeping it alive."""

    def __init__(self, ref: weakref.ref[PerSample]) -> None:
        self._ref = ref

    def on_forward(self, name: str, call: int, module: nn.Module, inputs: dict[str, Tensor],
                   outputs: dict[str, Tensor]) -> None:
        _call(self._ref, "_on_forward", name, call, module, inputs, outputs)

    def on_record(self, record: GradRecord) -> None:
        _call(self._ref, "_on_record", record)


def _call(ref: weakref.ref[PerSample], method: str, *args: object) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)(*args)


def _check(name: str, module: nn.Module, batch_dim: int, subtree: bool) -> None:
    """Refuse modules whose samples are coupled, or whose layout contradicts ``batch_dim``."""
    subs = module.named_modules() if subtree else [("", module)]
    for sub_name, sub in subs:
        check = CHECK.lookup(sub)
        reason = check(sub) if check is not None else None
        if reason is not None:
            where = _qualify(name, sub_name)
            inside = f" (inside {name!r}, replayed by the fallback)" if sub_name else ""
            raise UnsupportedModuleError(
                f"per-sample gradients of module {where!r} ({type(sub).__name__}){inside} are "
                f"not defined: {reason}"
            )
    required = BATCH_DIM.lookup(module)
    if required is not None and required(module) != batch_dim:
        raise ValueError(
            f"per_sample: batch_dim={batch_dim}, but module {name!r} ({type(module).__name__}) "
            f"takes inputs with the sample dim at {required(module)}; use "
            f"batch_dim={required(module)}"
        )


class _Compute:
    """The quantities of one record, computed on demand."""

    def grads(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def norm_sq(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def sum_sq(self) -> dict[str, Tensor]:
        raise NotImplementedError


class _RuleCompute(_Compute):
    """A registered rule on ``(input, grad_out)``; ``after`` scales results (rules are linear)."""

    def __init__(self, owner: _Owner, inp: Tensor, go: Tensor, names: frozenset[str],
                 after: float = 1.0) -> None:
        self.owner, self.inp, self.go, self.names, self.after = owner, inp, go, names, after

    def _scaled(self, out: dict[str, Tensor], factor: float) -> dict[str, Tensor]:
        if factor != 1.0:
            for v in out.values():
                v.mul_(factor)  # rule results are fresh tensors
        return out

    def grads(self) -> dict[str, Tensor]:
        module, rule = self.owner.module, self.owner.rule
        return self._scaled(rule(module, self.inp, self.go, self.names), self.after)  # type: ignore[misc]

    def norm_sq(self) -> dict[str, Tensor]:
        module, rule = self.owner.module, NORM.lookup(self.owner.module)
        if rule is not None:
            out = rule(module, self.inp, self.go, self.names)
        else:
            out = norm_sq_from_grad(self.owner.rule, module, self.inp, self.go, self.names)  # type: ignore[arg-type]
        return self._scaled(out, self.after**2)

    def sum_sq(self) -> dict[str, Tensor]:
        module, rule = self.owner.module, SUM_SQ.lookup(self.owner.module)
        if rule is not None:
            out = rule(module, self.inp, self.go, self.names)
        else:
            out = sum_sq_from_grad(self.owner.rule, module, self.inp, self.go, self.names)  # type: ignore[arg-type]
        return self._scaled(out, self.after**2)


class _ParametrizedCompute(_RuleCompute):
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
        raw = owner.rule(module, self.inp, self.go, frozenset(rule_names))  # type: ignore[misc]
        out = {k: v for k, v in raw.items() if k not in owner.parametrized}
        for tensor, rels in owner.parametrized.items():
            if tensor not in raw:
                continue
            plist = module.parametrizations[tensor]
            prefix = f"parametrizations.{tensor}."
            primals = {rel[len(prefix):]: getattr(plist, rel[len(prefix):]).detach()
                       for rel in rels}
            with torch.enable_grad(), quiet_vmap():
                _, pullback = torch.func.vjp(
                    lambda p, plist=plist: torch.func.functional_call(plist, p, ()), primals
                )
                per_sample = torch.func.vmap(pullback)(raw[tensor])[0]
            out.update({prefix + k: v for k, v in per_sample.items()})
        return out

    def norm_sq(self) -> dict[str, Tensor]:
        return {k: g.flatten(1).square().sum(1) for k, g in self.grads().items()}

    def sum_sq(self) -> dict[str, Tensor]:
        return {k: g.square().sum(0) for k, g in self.grads().items()}


class _PiecesCompute(_Compute):
    def __init__(self, pieces: list[Piece], names: frozenset[str]) -> None:
        self.pieces, self.names = pieces, names

    def grads(self) -> dict[str, Tensor]:
        return grad_pieces(self.pieces, self.names)

    def norm_sq(self) -> dict[str, Tensor]:
        return norm_sq_pieces(self.pieces, self.names)

    def sum_sq(self) -> dict[str, Tensor]:
        return sum_sq_pieces(self.pieces, self.names)


class _FallbackCompute(_Compute):
    def __init__(self, owner: _Owner, rec: GradRecord, scale: float, names: frozenset[str],
                 batch_dim: int) -> None:
        self.owner, self.rec, self.scale, self.names = owner, rec, scale, names
        self.batch_dim = batch_dim

    def _run(self, samples: slice | None = None) -> dict[str, Tensor]:
        return grad_fallback(self.owner.module, self.owner.name, self.rec.inputs,
                             self.rec.grad_outputs, self.names, self.batch_dim, self.scale,
                             samples)

    def grads(self) -> dict[str, Tensor]:
        return self._run()

    def _chunks(self) -> Sequence[slice]:
        tensors = [*self.rec.inputs.values(),
                   *(g for g in self.rec.grad_outputs.values() if g is not None)]
        n = next(iter(self.rec.inputs.values())).shape[self.batch_dim]
        params = dict(self.owner.module.named_parameters())
        per_sample = sum(params[k].numel() for k in self.names)
        return list(chunks(n, per_sample, budget(*tensors)))

    def norm_sq(self) -> dict[str, Tensor]:
        parts: dict[str, list[Tensor]] = {}
        for sl in self._chunks():
            for k, g in self._run(sl).items():
                parts.setdefault(k, []).append(g.flatten(1).square().sum(1))
        return {k: torch.cat(v) for k, v in parts.items()}

    def sum_sq(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for sl in self._chunks():
            for k, g in self._run(sl).items():
                s = g.square().sum(0)
                out[k] = s if k not in out else out[k] + s
        return out


def per_sample(
    model: nn.Module,
    select: Selector = "*",
    *,
    loss_reduction: LossReduction = "mean",
    batch_dim: int = 0,
    quantities: Iterable[Quantity] = ("grad", "norm"),
    fallback: bool = True,
) -> PerSample:
    """Compute per-sample gradients, their norms and batch statistics during backward.

    Args:
        model: the model; its forward and backward run as usual inside the block.
        select: which parameters (a glob on ``named_parameters()`` names, a list of globs, a
            module class, or a predicate ``(name, param) -> bool``); ``"*"`` is every
            parameter. Parameters that do not require grad are skipped.
        loss_reduction: ``"mean"`` if the loss is ``(1/N) sum_n s_n``, ``"sum"`` if it is
            ``sum_n s_n``. Either way ``ps.grad[p].mean(0)`` (or ``.sum(0)``) equals ``p.grad``.
        batch_dim: the dim of every input tensor that indexes samples.
        quantities: any of ``"grad"`` (``ps.grad``), ``"norm"`` (``ps.norm``, ``ps.norms``),
            ``"variance"``, ``"second_moment"``, ``"snr"``. Without ``"grad"``,
            ``[N, *shape]`` is not built where a closed form exists.
        fallback: handle modules without a rule by replaying them under ``torch.func.vmap``;
            ``False`` raises ``UnsupportedModuleError`` for them instead.

    Returns:
        A :class:`PerSample`, to use as a context manager; read its results after backward.

    Raises:
        SelectionError: ``select`` matches no parameter that requires grad.
        UnsupportedModuleError: a module couples its samples (BatchNorm in training mode),
            or has no rule and ``fallback=False``.
        ValueError: a bad argument.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> with gt.per_sample(net, quantities=("grad", "norm", "variance")) as ps:
        ...     torch.nn.functional.cross_entropy(net(x), y).backward()
        >>> ps.grad["0.weight"].shape, ps.norm.shape
        (torch.Size([5, 4, 3]), torch.Size([5]))
        >>> torch.allclose(ps.grad["0.weight"].mean(0), net[0].weight.grad, atol=1e-6)
        True
    """
    return PerSample(model, select, loss_reduction=loss_reduction, batch_dim=batch_dim,
                     quantities=quantities, fallback=fallback)
