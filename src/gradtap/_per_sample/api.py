"""``gt.per_sample``: per-sample gradients, their norms and their batch statistics.

How it works: one :func:`gradtap.capture.tap` on the modules that directly own a selected
parameter (each module holding a tied parameter owns it too), keeping their forward inputs.
As each call's record completes in backward, the module type's rule (``_per_sample.table``;
the ``torch.func`` fallback for other types) turns ``(module, input, grad_output)`` into
exactly the quantities asked for, the record is dropped, and only small accumulators stay.
When only norms or statistics are asked, ``[N, *shape]`` is never built for layers with a
closed form (Linear, convolutions, Embedding) and is built a chunk of samples at a time for
the others. A parameter used by several calls (a module called several times, tied weights)
has per-sample gradients summed over its uses; it is materialized, because norms of a sum do
not add up.

Parameters that no call of their own module can split into samples (an input shared by all
samples, samples folded with other rows, a call per sample, an output gradient that cannot be
trusted) get theirs from a replay of an enclosing call (``_per_sample.units``), with a warning
naming the module. After each backward, every parameter's per-sample gradients are checked to
reduce to that backward's increment of its ``.grad``; a parameter that fails is replayed too.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrize import type_before_parametrizations

from gradtap._per_sample import rules as _rules  # noqa: F401  (registers every rule)
from gradtap._per_sample.fallback import CannotReplay, grad_fallback, quiet_vmap, replay_call
from gradtap._per_sample.rule import PER_SAMPLE, PerSampleRule, Piece, budget, chunks
from gradtap._per_sample.rules.linear import grad_pieces, norm_sq_pieces, sum_sq_pieces
from gradtap._per_sample.units import (
    MAX_OUTER_CALLS,
    Frame,
    candidates,
    frames_of,
    largest_norm,
    mismatches,
)
from gradtap._types import Selector
from gradtap.capture import HookSet, at_end_of_backward, tap
from gradtap.errors import GradtapError, SelectionError, UnsupportedModuleError
from gradtap.record import GradRecord, flatten_tensors
from gradtap.select import select_module_parameters

__all__ = ["PerSample", "Quantity", "per_sample"]

Quantity = Literal["grad", "norm", "variance", "second_moment", "snr"]
LossReduction = Literal["mean", "sum"]
_QUANTITIES: tuple[str, ...] = get_args(Quantity)
_STATS = frozenset({"variance", "second_moment", "snr"})
_graph_task_id = torch._C._current_graph_task_id

#: Added to the variance in ``snr``.
SNR_EPS = 1e-12


@dataclass
class _Owner:
    """A module that directly owns selected parameters, resolved once."""

    name: str
    module: nn.Module
    direct: dict[str, str]  # parameter name relative to the module -> qualified name
    nested: dict[str, tuple[str, str]]  # descendant's relative name -> (qualified, owner name)
    entry: PerSampleRule | None  # None: the torch.func fallback
    # A parametrized tensor ("weight") -> its selected originals' relative names.
    parametrized: dict[str, list[str]] = field(default_factory=dict)
    calls: int = 0
    seen: set[str] = field(default_factory=set)

    @property
    def rule(self) -> PerSampleRule | None:
        """The entry, when it computes from ``(input, grad_out)``."""
        return self.entry if self.entry is not None and self.entry.grad is not None else None

    @property
    def pieces(self) -> PerSampleRule | None:
        """The entry, when it splits the call into linear maps instead."""
        return self.entry if self.entry is not None and self.entry.grad is None else None

    @property
    def quals(self) -> list[str]:
        """Qualified names of every selected parameter a call of this module may use."""
        nested = [q for q, _ in self.nested.values()] if self.rule is None else []
        return list(dict.fromkeys([*self.direct.values(), *nested]))


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


def _rule_for(module: nn.Module) -> PerSampleRule | None:
    """The registered entry, unless the module's class overrides the registered ``forward``."""
    rule = PER_SAMPLE.lookup(module)
    if rule is None:
        return None
    cls = type_before_parametrizations(module)
    owner = next(c for c in cls.__mro__ if c in PER_SAMPLE)
    return rule if cls.forward is owner.forward else None


def _rows(t: Tensor, batch_dim: int) -> int | None:
    return t.shape[batch_dim] if t.dim() > batch_dim else None


def _describe(name: str, module: nn.Module) -> str:
    return "the model" if name == "" else f"{name!r} ({type(module).__name__})"


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

        params = select_module_parameters(model, select)
        self._params = {n: p for n, p in params if p.requires_grad}
        if not self._params:
            raise SelectionError(
                f"select={select!r} matches only parameters that do not require grad: "
                f"{', '.join(n for n, _ in params)}"
            )
        self._fallback = fallback
        self._owners = self._resolve(model, fallback)
        self._owners_of: dict[str, list[str]] = {}
        for owner in self._owners.values():
            for qual in owner.direct.values():
                self._owners_of.setdefault(qual, []).append(owner.name)
        self._warned: set[tuple[str, str]] = set()
        self._replaying = False
        self._queued = False
        self.batch_size: int | None = None
        self._reset()
        owners = set(self._owners)
        # Hooks must not keep this object alive: a reference cycle would hold every result
        # (hundreds of MB of per-sample gradients) until the cyclic garbage collector runs.
        me = weakref.ref(self)
        self._hooks = HookSet()
        self._tap = tap(
            model,
            select=lambda name, _module: name in owners,
            keep=("inputs",),
            store=False,
            on_record=lambda rec: _call(me, "_on_record", rec),
            on_forward=lambda *args: _call(me, "_on_forward", *args),
        )
        try:
            for name, module in self._enclosing_modules(model):
                self._hooks.module_calls(
                    module,
                    functools.partial(_call_kw, me, "_before", name, module),
                    functools.partial(_call, me, "_after", name),
                )
            for qual, p in self._params.items():
                handle = self._hooks.gradient(p, functools.partial(_call, me, "_on_increment",
                                                                   qual))
                if handle is not None:
                    self._hooks.add(handle)
        except BaseException:
            self.remove()
            raise

    # -- setup ------------------------------------------------------------------------------

    def _resolve(self, model: nn.Module, fallback: bool) -> dict[str, _Owner]:
        modules = dict(model.named_modules())
        module_names = {id(m): n for n, m in modules.items()}
        selected = {id(p): q for q, p in self._params.items()}
        owned: dict[str, dict[str, str]] = {}
        parametrized: dict[str, dict[str, list[str]]] = {}
        # Every module that holds a selected parameter owns it, so each use of a tied
        # parameter (an embedding reused as the output head) is computed and summed.
        for full, p in model.named_parameters(remove_duplicate=False):
            qual = selected.get(id(p))
            if qual is None:
                continue
            owner, rel, tensor = _split(full)
            owner = module_names[id(model.get_submodule(owner))]  # a module under two names
            owned.setdefault(owner, {})[rel] = qual
            if tensor is not None:
                rels = parametrized.setdefault(owner, {}).setdefault(tensor, [])
                if rel not in rels:
                    rels.append(rel)
        owners: dict[str, _Owner] = {}
        for name, direct in owned.items():
            module = modules[name]
            entry = _rule_for(module)
            if entry is None and not fallback:
                raise UnsupportedModuleError(
                    f"no per-sample rule for module {name!r} of type {type(module).__name__} "
                    f"(owner of {', '.join(direct.values())}), and fallback=False; supported "
                    f"types (and subclasses): {', '.join(PER_SAMPLE.supported())}"
                )
            _check(name, module, self.batch_dim, entry is None)
            nested = {
                q[len(name) + 1 :] if name else q: (q, o)
                for o, d in owned.items()
                if o != name and (not name or o.startswith(name + "."))
                for q in d.values()
            }
            owners[name] = _Owner(name, module, direct, nested, entry, parametrized.get(name, {}))
        self._use_count = {q: sum(q in o.direct.values() for o in owners.values())
                      for q in self._params}
        return owners

    def _enclosing_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The model, every module that encloses an owner, and every owner without a rule:
        the calls a replay can use."""
        names = {""}
        for owner in self._owners.values():
            parts = owner.name.split(".") if owner.name else []
            names.update(".".join(parts[:i]) for i in range(len(parts)))
            if owner.entry is None:
                names.add(owner.name)
        return [(n, m) for n, m in model.named_modules() if n in names]

    def _reset(self) -> None:
        self.batch_size = None
        self._grad: dict[str, Tensor] = {}
        self._norm_sq: dict[str, Tensor] = {}
        self._sum_sq: dict[str, Tensor] = {}
        self._total: dict[str, Tensor] = {}
        self._problems: list[str] = []
        self._failed: dict[str, str] = {}
        self._results: dict[str, object] | None = None
        self._stack: list[tuple[str, Frame | None]] = []
        for owner in self._owners.values():
            owner.calls = 0
            owner.seen = set()
        self._frames: list[Frame] = []
        self._new_group()
        self._new_backward()

    def _new_group(self) -> None:
        """Start a forward group: the forwards whose graph the next backward goes through."""
        for frame in getattr(self, "_frames", []):
            frame.drop()
        self._frames = []
        self._outer_calls = 0
        self._enclosing: dict[str, list[tuple[Frame, ...]]] = {}  # qual -> frames per use
        self._flagged: dict[str, tuple[str, str]] = {}  # qual -> (repr of module, reason)
        self._flagged_calls: set[tuple[str, int]] = set()
        self._covered: dict[tuple[str, int], set[str]] = {}
        self._group_done = False

    def _new_backward(self) -> None:
        """Forget what the last backward computed (merged already) and its increments."""
        self._step_grad: dict[str, Tensor] = {}
        self._step_norm_sq: dict[str, Tensor] = {}
        self._step_sum_sq: dict[str, Tensor] = {}
        self._step_total: dict[str, Tensor] = {}
        self._step_pg: dict[str, Tensor] = {}  # the calls' own contributions (not materialized)
        self._increments: dict[str, Tensor] = {}  # what this backward adds to each .grad
        self._largest_norm: float | None = None
        self._late: dict[str, tuple[str, str]] = {}  # found in backward: qual -> (module, why)

    # -- forward side -----------------------------------------------------------------------

    def _before(self, name: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if name == "":  # a new call of the model: leftovers are from a forward that raised
            self._stack.clear()
        # Calls inside a backward are checkpoint recomputations or replays, not new uses.
        if not torch.is_grad_enabled() or _graph_task_id() != -1 or self._replaying:
            self._stack.append((name, None))
            return
        outer = not any(f is not None for _, f in self._stack)
        if outer:
            self._forward_starts()
            self._set_batch_size(_describe(name, module), args, kwargs)
            self._outer_calls += 1
        frame = Frame(name, module, args, kwargs, outer)
        self._stack.append((name, frame))
        self._frames.append(frame)

    def _after(self, name: str, output: Any) -> None:
        frame = None
        while self._stack:
            popped, frame = self._stack.pop()
            if popped == name:
                break
        else:
            return
        if frame is None:
            return
        me = weakref.ref(self)
        for path, t in flatten_tensors(output, "output"):
            if frame.owns_output(t):
                self._hooks.gradient(t, functools.partial(_call, me, "_on_frame_grad", frame, path))
        if not any(f is not None for _, f in self._stack):
            self._settle()

    def _forward_starts(self) -> None:
        if self._group_done or self._outer_calls >= MAX_OUTER_CALLS:
            self._new_group()

    def _set_batch_size(self, who: str, args: tuple, kwargs: dict[str, Any]) -> None:
        tensors = [t for _, t in flatten_tensors((args, kwargs), "a")]
        sizes = [s for s in (_rows(t, self.batch_dim) for t in tensors) if s is not None]
        if not sizes:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors) or "none"
            raise ValueError(
                f"per_sample: {who} was called without a tensor argument that has the sample dim "
                f"batch_dim={self.batch_dim} (tensor arguments: {shapes})"
            )
        # The size most arguments have (the first one's on a tie): a shared [1, T] argument
        # or a batch-first mask next to [T, N, ...] inputs does not decide it alone.
        n = max(sizes, key=lambda s: (sizes.count(s), -sizes.index(s)))
        if self.batch_size is None:
            self.batch_size = n
        elif n != self.batch_size:
            raise ValueError(
                f"per_sample: {who} got {n} samples along batch_dim={self.batch_dim}, but an "
                f"earlier call had {self.batch_size}; call ps.clear() between batches"
            )

    def _settle(self) -> None:
        """The outermost call returned: keep the calls a replay may need, drop the others."""
        needed = {id(f) for q in self._flagged for frames in self._enclosing.get(q, ())
                  for f in frames}
        kept = []
        for frame in self._frames:
            if not frame.settled:
                frame.settled = True
                frame.keep = frame.outer or id(frame) in needed
                if not frame.keep:
                    frame.drop()
                    continue
            if frame.keep:
                kept.append(frame)
        self._frames = kept

    def _on_forward(self, name: str, call: int, module: nn.Module, inputs: dict[str, Tensor],
                    outputs: dict[str, Tensor]) -> None:
        if self._replaying:
            return
        owner = self._owners[name]
        owner.calls += 1
        _check(name, module, self.batch_dim, owner.entry is None)
        # The calls around this one (its own too, when it is one: a replay of it with every
        # argument as passed is the first thing to try for a module without a rule).
        frames = tuple(f for _, f in self._stack if f is not None)
        if not frames:  # called outside the model's own call
            self._forward_starts()
            if self.batch_size is None:
                first = next(iter(inputs.values()), None)
                if first is None or first.dim() <= self.batch_dim:
                    got = "no tensor argument" if first is None else f"shape {tuple(first.shape)}"
                    raise ValueError(
                        f"per_sample: module {name!r} was called with {got}; its input needs the "
                        f"sample dim batch_dim={self.batch_dim}"
                    )
                self.batch_size = first.shape[self.batch_dim]
        quals = owner.quals
        for q in quals:
            self._enclosing.setdefault(q, []).append(frames)
        # A parameter also held by an enclosing module without a rule (a tied decoder bias
        # held by the head and by its Linear) is covered by that module's own replay, which
        # sees every use inside its call: counting this call too would count it twice.
        covered = {q for f in frames if f.module is not module and f.name in self._owners
                   and self._owners[f.name].entry is None
                   for q in self._owners[f.name].direct.values()}
        if covered & set(quals):
            self._covered[(name, call)] = covered
        reason = self._classify(owner, inputs, outputs)
        if reason is not None:
            self._flagged_calls.add((name, call))
            for q in quals:
                self._flagged.setdefault(q, (repr(name), reason))

    def _classify(self, owner: _Owner, inputs: dict[str, Tensor],
                  outputs: dict[str, Tensor]) -> str | None:
        """Why this call's own record cannot give per-sample gradients, or ``None``."""
        n, bd = self.batch_size, self.batch_dim

        def wrong_rows(key: str, t: Tensor, what: str) -> str:
            rows = _rows(t, bd)
            if rows is None or rows == 1:
                return (f"its {what} {key!r} of shape {tuple(t.shape)} has one row for {n} "
                        "samples (shared by all of them, or one sample's own sub-call), so its "
                        "gradient does not split by sample")
            return (f"its {what} {key!r} has {rows} rows along batch_dim={bd} for {n} samples "
                    "(samples folded with other rows?)")

        if owner.entry is not None:
            # A rule reads the first input and needs one row per sample in it (a pieces rule
            # knows the layout of its other arguments, masks included).
            key, inp = next(iter(inputs.items()), ("input", None))
            if inp is None:
                return "it was called without a tensor argument"
            if _rows(inp, bd) != n:
                return wrong_rows(key, inp, "input")
            outputs = dict(list(outputs.items())[:1])
        # A module without a rule is replayed with its arguments: those without a row per
        # sample are shared, but every output needs one.
        for path, t in outputs.items():
            if t.requires_grad and _rows(t, bd) != n:
                rows = _rows(t, bd)
                return (f"its output {path!r} of shape {tuple(t.shape)} has "
                        f"{'no' if rows is None else rows} rows along batch_dim={bd} for {n} samples")
        return None

    # -- backward side ----------------------------------------------------------------------

    def _queue_end(self) -> None:
        if self._queued:
            return
        self._queued = True
        me = weakref.ref(self)
        # Queued twice, so it runs after capture's own end-of-backward step, which delivers
        # the records still pending.
        at_end_of_backward(lambda: at_end_of_backward(lambda: _call(me, "_end_of_backward")))

    def _on_frame_grad(self, frame: Frame, path: str, grad: Tensor) -> None:
        if self._replaying or not frame.keep:
            return
        frame.grads[path] = grad if path not in frame.grads else frame.grads[path] + grad
        self._queue_end()

    def _on_increment(self, qual: str, grad: Tensor) -> None:
        if self._replaying:
            return
        self._queue_end()
        if qual in self._increments:  # the parameter's hook ran twice (reentrant checkpoint)
            grad = self._increments[qual] + grad
        self._increments[qual] = grad

    def _mark_late(self, quals: Iterable[str], module: str, reason: str) -> None:
        for q in quals:
            self._late.setdefault(q, (repr(module), reason))

    def _on_record(self, rec: GradRecord) -> None:
        if self._replaying:
            return
        owner = self._owners[rec.module_name]
        self._queue_end()
        if (rec.module_name, rec.call) in self._flagged_calls:
            return
        covered = self._covered.get((rec.module_name, rec.call), set())
        names = {rel: q for rel, q in owner.direct.items()
                 if q not in self._flagged and q not in covered}
        if owner.rule is None:
            # A descendant that owns selected parameters but was never called (e.g.
            # MultiheadAttention's out_proj) has them used by this call: cover them here
            # (pieces rules and the fallback see the whole subtree).
            for rel, (qual, sub) in owner.nested.items():
                if (self._owners[sub].calls == 0 and rec.param_grads.get(rel) is not None
                        and qual not in self._flagged):
                    names[rel] = qual
        if not names:
            return
        if all(g is None for g in rec.grad_outputs.values()):
            if any(rec.param_grads.get(rel) is not None for rel in names):
                self._mark_late(names.values(), rec.module_name,
                                "its output gradient was not recorded (its output modified in "
                                "place afterwards?)")
            return
        if rec.notes:
            self._mark_late(names.values(), rec.module_name, "; ".join(rec.notes))
            return
        names = {rel: q for rel, q in names.items() if q not in self._late}
        if not names:
            return
        self._results = None
        scale = float(self.batch_size) if self.loss_reduction == "mean" else 1.0  # type: ignore[arg-type]
        materialize = (self._want_grad or owner.calls > 1 or bool(owner.seen & set(names))
                       or any(self._use_count.get(q, 1) > 1 for q in names.values()))
        self._replaying = True  # a fallback's own backward must not count as an increment
        try:
            with torch.no_grad():
                compute = self._computer(owner, rec, scale, frozenset(names), materialize)
                if materialize:
                    self._add_grads(names, compute.grads())
                else:
                    self._add_reduced(names, compute, rec, scale)
        except CannotReplay as err:
            self._mark_late(names.values(), rec.module_name, str(err))
            return
        finally:
            self._replaying = False
        owner.seen.update(names)

    def _computer(self, owner: _Owner, rec: GradRecord, scale: float,
                  names: frozenset[str], materialize: bool = True) -> _Compute:
        n, bd = self.batch_size, self.batch_dim
        if owner.rule is not None and "output" in rec.grad_outputs and rec.inputs:
            inp = next(iter(rec.inputs.values()))
            go = rec.grad_outputs["output"]
            if go is not None:
                if _rows(inp, bd) != n or _rows(go, bd) != n:
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
                cls = _ParametrizedCompute if owner.parametrized else _RuleCompute
                return cls(owner, inp, go, names, after)
        if owner.pieces is not None:
            pieces = owner.pieces.pieces(owner.module, rec.inputs, rec.grad_outputs, scale)  # type: ignore[misc]
            if pieces is not None:
                return _PiecesCompute(pieces, names)
        return _FallbackCompute(owner, rec, scale, names, bd, n)  # type: ignore[arg-type]

    def _add_grads(self, names: dict[str, str], grads: dict[str, Tensor]) -> None:
        for rel, g in grads.items():
            qual = names[rel]
            step = self._step_grad
            step[qual] = g if qual not in step else step[qual] + g

    def _add_reduced(self, names: dict[str, str], compute: _Compute, rec: GradRecord,
                     scale: float) -> None:
        if self._want_norm:
            for rel, v in compute.norm_sq().items():
                self._step_norm_sq[names[rel]] = v
        if self._want_stats:
            for rel, v in compute.sum_sq().items():
                self._step_sum_sq[names[rel]] = v
        for rel, qual in names.items():
            g = rec.param_grads.get(rel)
            if g is not None:
                self._step_pg[qual] = g
                if self._want_var:
                    self._step_total[qual] = g * scale

    # -- end of backward: check, replay, merge ------------------------------------------------

    def _end_of_backward(self) -> None:
        self._queued = False
        try:
            if self.batch_size is not None and self._increments:
                late = self._check_sums()
                bad = {q: why for q, why in {**self._flagged, **self._late, **late}.items()
                       if q in self._increments}
                for q in {**self._flagged, **self._late, **late}:
                    self._discard(q)
                if bad:
                    self._replay(bad)
            self._merge()
        finally:
            self._new_backward()
            for frame in self._frames:
                frame.grads = {}
            self._group_done = True

    def _check_sums(self) -> dict[str, tuple[str, str]]:
        """Parameters whose per-sample gradients do not reduce to their ``.grad`` increment."""
        n = self.batch_size
        c = 1.0 / n if self.loss_reduction == "mean" else 1.0  # type: ignore[operator]
        touched = (set(self._step_grad) | set(self._step_pg) | set(self._increments)
                   | set(self._step_norm_sq) | set(self._step_sum_sq))
        rows: dict[str, tuple[Tensor, Tensor, Tensor | None]] = {}
        with torch.no_grad():
            grads = [q for q in touched if q in self._step_grad
                     and q not in self._flagged and q not in self._late]
            if grads:
                sums = [self._step_grad[q].sum(0) for q in grads]
                torch._foreach_mul_(sums, c)
                for q, a in zip(grads, sums, strict=True):
                    rows[q] = (a, self._increments.get(q, torch.zeros_like(a)),
                               self._step_grad[q])
            for q in touched - set(grads) - set(self._flagged) - set(self._late):
                a = self._step_pg.get(q)
                if a is None:
                    a = torch.zeros_like(self._params[q])
                rows[q] = (a, self._increments.get(q, torch.zeros_like(a)), None)
        return {q: (", ".join(repr(o) for o in self._owners_of.get(q, ())) or "?",
                    "its per-sample gradients do not add up to its gradient in this backward "
                    "(is it used outside the calls of the modules that hold it?)")
                for q in mismatches(rows, self._params, c, self._largest)}

    def _largest(self) -> float:
        """The largest gradient norm of this backward, over every selected parameter."""
        if self._largest_norm is None:
            self._largest_norm = largest_norm(list(self._increments.values()))
        return self._largest_norm

    def _discard(self, qual: str) -> None:
        for step in (self._step_grad, self._step_norm_sq, self._step_sum_sq, self._step_total,
                     self._step_pg):
            step.pop(qual, None)

    def _uses(self, qual: str) -> list[tuple[Frame, ...]]:
        """The enclosing calls of each call that used ``qual``; the model's own calls when no
        call of a module holding it was seen (a use outside them)."""
        return self._enclosing.get(qual) or [(f,) for f in self._frames if f.outer]

    def _replay(self, bad: dict[str, tuple[str, str]]) -> None:
        """Per-sample gradients of ``bad`` from replays of enclosing calls, innermost first."""
        n = self.batch_size
        c = 1.0 / n if self.loss_reduction == "mean" else 1.0  # type: ignore[operator]
        scale = float(n) if self.loss_reduction == "mean" else 1.0  # type: ignore[arg-type]
        todo = {q: candidates(self._uses(q)) if self._fallback else [] for q in bad}
        tried: dict[str, list[str]] = {q: [] if self._fallback else ["fallback=False"]
                                       for q in bad}
        done: dict[str, dict[str, str]] = {}  # replayed call -> {module: reason}
        while todo:
            groups: dict[str, list[str]] = {}
            for q, cands in list(todo.items()):
                if not cands:
                    self._fail(q, bad[q], tried[q])
                    del todo[q]
                    continue
                groups.setdefault(cands.pop(0), []).append(q)
            for unit, quals in groups.items():
                frames = frames_of(unit, [calls for q in quals for calls in self._uses(q)])
                where = _describe(unit, frames[0].module)
                try:
                    result = self._replay_unit(frames, quals, scale)
                except CannotReplay as err:
                    for q in quals:
                        tried[q].append(f"{where}: {err}")
                    continue
                with torch.no_grad():
                    rows = {q: (result[q].sum(0) * c, self._increments[q], result[q])
                            for q in quals}
                wrong = mismatches(rows, self._params, c, self._largest)
                for q in quals:
                    if q in wrong:
                        tried[q].append(f"{where}: its replay does not add up to the gradient "
                                        "(a use outside that call?)")
                        continue
                    self._step_grad[q] = result[q]
                    del todo[q]
                    done.setdefault(where, {}).setdefault(*bad[q])
        for where, problems in done.items():
            fresh = {m: why for m, why in problems.items() if (m, where) not in self._warned}
            if fresh:
                self._warned.update((m, where) for m in fresh)
                listed = "; ".join(f"{m}: {why}" for m, why in fresh.items())
                warnings.warn(f"gradtap.per_sample: per-sample gradients of the parameters of "
                              f"{len(fresh)} module(s) come from a torch.func replay of {where} "
                              f"(a forward and backward of it per step), because no rule can "
                              f"split them: {listed}", stacklevel=2)

    def _replay_unit(self, frames: list[Frame], quals: list[str], scale: float) -> dict[str, Tensor]:
        module, name = frames[0].module, frames[0].name
        under: dict[int, str] = {}
        for rel, p in module.named_parameters(remove_duplicate=False):
            under.setdefault(id(p), rel)
        keys = {q: under.get(id(self._params[q]), q) for q in quals}
        params = {keys[q]: self._params[q] for q in quals}
        total: dict[str, Tensor] = {}
        self._replaying = True
        try:
            for frame in frames:
                why = frame.changed()
                if why is not None:
                    raise CannotReplay(why)
                if not frame.grads:
                    continue
                out = replay_call(module, name, frame.args, frame.kwargs, frame.grads,  # type: ignore[arg-type]
                                  params, self.batch_dim, self.batch_size, scale,  # type: ignore[arg-type]
                                  autocast=frame.autocast)
                for k, g in out.items():
                    total[k] = g if k not in total else total[k] + g
        finally:
            self._replaying = False
        n = self.batch_size
        return {q: total[keys[q]].detach() if keys[q] in total
                else self._params[q].new_zeros((n, *self._params[q].shape)) for q in quals}  # type: ignore[arg-type]

    def _fail(self, qual: str, problem: tuple[str, str], tried: list[str]) -> None:
        module_name, reason = problem
        attempts = "; ".join(tried) if tried else "no call around it was recorded"
        self._failed[qual] = (
            f"{qual} (module {module_name}: {reason}), and no enclosing call could be replayed "
            f"({attempts})"
        )

    def _merge(self) -> None:
        """Add this backward's results to those of earlier backwards since the last clear."""
        for q, g in self._step_grad.items():
            if q in self._norm_sq or q in self._sum_sq:
                self._problems.append(q)
            self._grad[q] = g if q not in self._grad else self._grad[q] + g
        for step, total in ((self._step_norm_sq, self._norm_sq), (self._step_sum_sq, self._sum_sq)):
            for q, v in step.items():
                if q in total or q in self._grad:
                    self._problems.append(q)
                total[q] = v
        self._total.update(self._step_total)
        if self._step_grad or self._step_norm_sq or self._step_sum_sq:
            self._results = None
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
        if self._failed:
            raise GradtapError(
                "per_sample: no per-sample gradients could be computed for "
                + "; ".join(self._failed.values())
                + ". Leave these parameters out with select=, or make the forward one a replay "
                "can repeat (eval mode, arguments not modified in place)"
            )
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
        self._hooks.remove()

    def __enter__(self) -> PerSample:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (f"<PerSample {len(self._params)} parameters in {len(self._owners)} modules, "
                f"quantities={self.quantities}>")


def _call(ref: weakref.ref[PerSample], method: str, *args: object) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)(*args)


def _call_kw(ref: weakref.ref[PerSample], method: str, name: str, module: nn.Module,
             args: tuple, kwargs: dict[str, Any]) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)(name, module, args, kwargs)


def _check(name: str, module: nn.Module, batch_dim: int, subtree: bool) -> None:
    """Refuse modules whose samples are coupled, or whose layout contradicts ``batch_dim``."""
    subs = module.named_modules() if subtree else [("", module)]
    for sub_name, sub in subs:
        entry = PER_SAMPLE.lookup(sub)
        reason = entry.check(sub) if entry is not None and entry.check is not None else None
        if reason is not None:
            where = _qualify(name, sub_name)
            inside = f" (inside {name!r}, replayed by the fallback)" if sub_name else ""
            raise UnsupportedModuleError(
                f"per-sample gradients of module {where!r} ({type(sub).__name__}){inside} are "
                f"not defined: {reason}"
            )
    entry = PER_SAMPLE.lookup(module)
    required = entry.required_batch_dim(module) if entry is not None else None
    if required is not None and required != batch_dim:
        raise ValueError(
            f"per_sample: batch_dim={batch_dim}, but module {name!r} ({type(module).__name__}) "
            f"takes inputs with the sample dim at {required}; use batch_dim={required}"
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

    @property
    def rule(self) -> PerSampleRule:
        assert self.owner.rule is not None
        return self.owner.rule

    def grads(self) -> dict[str, Tensor]:
        grad = self.rule.grad
        assert grad is not None
        return self._scaled(grad(self.owner.module, self.inp, self.go, self.names), self.after)

    def norm_sq(self) -> dict[str, Tensor]:
        out = self.rule.norm_sq_of(self.owner.module, self.inp, self.go, self.names)
        return self._scaled(out, self.after**2)

    def sum_sq(self) -> dict[str, Tensor]:
        out = self.rule.sum_sq_of(self.owner.module, self.inp, self.go, self.names)
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
        grad = self.rule.grad
        assert grad is not None
        raw = grad(module, self.inp, self.go, frozenset(rule_names))
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
                 batch_dim: int, n: int) -> None:
        self.owner, self.rec, self.scale, self.names = owner, rec, scale, names
        self.batch_dim, self.n = batch_dim, n

    def _run(self, samples: slice | None = None) -> dict[str, Tensor]:
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
        select: which parameters. A module selector (as for ``gt.tap``: a glob on module
            names, a list of globs, a module class or tuple of classes, a predicate
            ``(name, module) -> bool``) selects every parameter under the modules it picks;
            a glob also matches parameter names (``"fc.weight"``, ``"*.bias"``). ``"*"`` is
            every parameter. Parameters that do not require grad are skipped.
        loss_reduction: ``"mean"`` if the loss is ``(1/N) sum_n s_n``, ``"sum"`` if it is
            ``sum_n s_n``. Either way ``ps.grad[p].mean(0)`` (or ``.sum(0)``) equals ``p.grad``.
        batch_dim: the dim of every input tensor that indexes samples. An input whose size
            there is 1 while the batch has more samples, or that has fewer dims, is shared
            by all samples (position ids ``[1, T]``, a broadcast mask). The batch size is the
            size most of the model's tensor arguments have there.
        quantities: any of ``"grad"`` (``ps.grad``), ``"norm"`` (``ps.norm``, ``ps.norms``),
            ``"variance"``, ``"second_moment"``, ``"snr"``. Without ``"grad"``,
            ``[N, *shape]`` is not built where a closed form exists.
        fallback: replay calls under ``torch.func`` where no rule applies: a module without
            a rule (its own call), and parameters whose module's call cannot be split into
            samples (a shared input, samples folded with other rows, one call per sample,
            an output gradient that cannot be trusted, a use outside the module, per-sample
            gradients that do not add up to ``.grad``), which get theirs from the innermost
            enclosing call that can be replayed, with a warning naming the module. ``False``
            raises ``UnsupportedModuleError`` for modules without a rule, and makes the
            results name the other parameters in a ``GradtapError`` instead.

    Returns:
        A :class:`PerSample`, to use as a context manager; read its results after backward.

    Raises:
        SelectionError: ``select`` matches no parameter that requires grad.
        UnsupportedModuleError: a module couples its samples (BatchNorm in training mode),
            or has no rule and ``fallback=False``; in backward, a replay that draws random
            numbers (dropout in training mode).
        ValueError: a bad argument.
        GradtapError: when results are read, for parameters that no rule and no replay could
            give per-sample gradients (the message names each one, its module and why).

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
