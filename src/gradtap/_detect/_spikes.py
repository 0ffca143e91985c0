"""Spike trackers: gradient norms scored against their own history by the shared detector
(:mod:`gradtap._tensorops.spikes`), ``spike`` the score threshold.

:class:`SpikeTracker` serves the per-call watch (``replay=False``): parameter-gradient and
grad_output norms from each call's record. :class:`ParamSpikes` serves the default watch:
parameter-gradient norms read from ``.grad`` at the screen's check, no hook at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from torch import Tensor, nn

from gradtap._detect._measure import Backward, Plan, innermost
from gradtap._tensorops.spikes import SCALE_FLOOR, OnlineScores

__all__ = ["ParamSpikes", "Spike", "SpikeTracker"]

#: One spiking norm: (index of its plan or module, module name, kind, norm, score).
Spike = tuple[int, str, str, float, float]


class SpikeTracker:
    """A step's sum of squared norms per ``(module, kind)``, each scored against its own
    history by the shared detector (:class:`~gradtap._tensorops.spikes.OnlineScores`).

    ``kind`` is ``"grad_output"`` (the module's output-gradient norm) or ``"param_grad"`` (its
    direct parameters' gradient norm). NaN, Inf and zero norms are not scored and never enter
    a history; a norm is scored once its history has ``warmup`` values.

    With :attr:`scale_of` (the grad scaler's scale of the step, under mixed precision) the
    norms measured in backward are divided by it: spikes and histories are those of the
    unscaled gradients.
    """

    def __init__(self, spike: float | None, warmup: int) -> None:
        self.spike, self.warmup = spike, warmup
        self.scale_of: Callable[[], float] | None = None
        self._inv2: float | None = None  # 1 / scale**2 of this step, read once
        self._totals: dict[tuple[str, str], float] = {}
        self._flagged: set[tuple[str, str]] = set()  # reported or non-finite this step
        self._bad: set[tuple[str, str]] = set()  # non-finite this step
        self._index: dict[tuple[str, str], int] = {}
        self._scores = OnlineScores(0, warmup)
        self._scored = False  # this step's totals were scored (pending for the history)

    def baseline(self, name: str, kind: str) -> float:
        """The baseline norm of module ``name``'s ``kind`` norm (KeyError if none)."""
        i = self._index.get((name, kind))
        base = None if i is None else self._scores.baseline()[i]
        if base is None or base != base:
            have = sorted(f"{n}:{k}" for n, k in self._index)
            raise KeyError(f"no spike baseline for module {name!r} kind {kind!r}; have: "
                           f"{', '.join(have[:10]) or '(none: pass spike= and call step())'}")
        return math.exp(base)

    def might_spike(self, plan: Plan, back: Backward) -> bool:
        """Whether this record (its norms all measured) may push a norm of its module over
        the threshold: its norm so far is at least ``exp(spike * SCALE_FLOOR / 2)`` times its
        baseline (a spike's record is kept to be shown)."""
        hit = False
        base = self._scores.baseline() if self._index else None
        for kind, idx in (("grad_output", [j for _, j in plan.outs]), ("param_grad", plan.direct)):
            if not idx:
                continue
            key = (plan.name, kind)
            add = sum(back.norms[j] ** 2 for j in idx) * self._unscale2()
            back.partial[key] = back.partial.get(key, 0.0) + add
            j = self._index.get(key)
            if j is None or base is None or self._scores.count[j] < self._scores.warmup:
                continue
            total = self._totals.get(key, 0.0) + back.partial[key]
            if total > 0:
                hit = hit or (0.5 * math.log(total) - base[j]
                              > self.spike * SCALE_FLOOR / 2)  # type: ignore[operator]
        return hit

    def check(self, plans: list[Plan], norms: np.ndarray, finite: np.ndarray,
              selected: set[str]) -> tuple[int, list[Spike]] | None:
        """Add a backward's norms to the step's; return the first spiking module (innermost,
        in backward order) as ``(plan index, its spikes, grad_output first)``, or None.
        A spike is ``(plan index, name, kind, norm, score)``."""
        sq = (np.where(finite, norms, 0.0) ** 2 * self._unscale2()).tolist()
        fin = finite.tolist()
        totals, flagged = self._totals, self._flagged
        touched: list[tuple[int, str, str]] = []
        seen: set[tuple[str, str]] = set()
        for i, p in enumerate(plans):
            name = p.name
            if name not in selected:
                continue
            for kind, idx in (("grad_output", [j for _, j in p.outs]), ("param_grad", p.direct)):
                if not idx:
                    continue
                key = (name, kind)
                if not all(fin[j] for j in idx):
                    flagged.add(key)  # a non-finite norm never enters the history
                    self._bad.add(key)
                    continue
                if key not in seen:
                    seen.add(key)
                    touched.append((i, name, kind))
                total = totals.get(key, 0.0)
                for j in idx:
                    total += sq[j]
                totals[key] = total
        scores = self._score()
        spiking: list[Spike] = []
        for i, name, kind in touched:
            key = (name, kind)
            at = self._index.get(key)
            if at is None or key in self._flagged or not scores[at] > self.spike:  # type: ignore[operator]
                continue
            spiking.append((i, name, kind, math.sqrt(self._totals[key]), float(scores[at])))
        if not spiking:
            return None
        for _, name, kind, _, _ in spiking:
            self._flagged.add((name, kind))
        first = innermost(spiking, lambda s: s[1])[0]
        kinds = [s for s in spiking if s[1] == first[1]]
        # The grad_output spike is the cause of a param_grad spike of the same module.
        kinds.sort(key=lambda s: s[2] != "grad_output")
        return first[0], kinds

    def _values(self) -> np.ndarray:
        """This step's norms of the keys with a history (NaN: none, or non-finite)."""
        values = np.full(len(self._index), np.nan)
        for key, total in self._totals.items():
            j = self._index.get(key)
            if j is not None and key not in self._bad:
                values[j] = math.sqrt(total)
        return values

    def _score(self) -> np.ndarray:
        self._scored = True
        return self._scores.score(self._values())

    def _unscale2(self) -> float:
        if self.scale_of is None:
            return 1.0
        if self._inv2 is None:
            self._inv2 = 1.0 / self.scale_of() ** 2
        return self._inv2

    def close_step(self) -> None:
        """Add the step's norms to the histories and start a new step."""
        try:
            if self.spike is not None and self._totals:
                new = [k for k in self._totals if k not in self._index]
                for key in new:  # first seen this step: their first value starts a history
                    self._index[key] = len(self._index)
                if new:
                    self._scores.grow(len(new))
                values = self._values()
                if new or not self._scored:
                    self._scores.score(values)
                self._scores.push(values)
        finally:
            self._totals = {}
            self._flagged = set()
            self._bad = set()
            self._inv2 = None
            self._scored = False


class ParamSpikes:
    """Parameter-gradient spikes of the default watch, with no hook: each selected module's
    direct parameters' ``.grad`` norms, each scored against its own history by the shared
    detector (:class:`~gradtap._tensorops.spikes.OnlineScores`; ``docs/semantics.md``,
    "Gradient spikes").

    The screen, in its norms mode, reduces every parameter gradient to its L2 norm at its
    check (one ``torch._foreach_norm`` per device and dtype; on CPU, gradients of one shape
    stacked and reduced in one norm; in place of its finiteness pass) and reads them with
    its one host copy; :meth:`check` scores them on the host (a later check in the same step,
    after another backward, scores the accumulated gradient again); :meth:`close_step` adds
    the step's last norms to the histories. A tensor is scored once its history has
    ``warmup`` values; a NaN/Inf or zero norm is not scored and does not enter it.
    """

    def __init__(self, selected: list[tuple[str, nn.Module]], threshold: float,
                 warmup: int) -> None:
        self.spike, self.warmup = threshold, warmup
        self.names: list[str] = []  # modules with parameters of their own
        self.tensors: list[tuple[int, str]] = []  # (module index, parameter name)
        self._index_of: dict[int, int] = {}  # id(parameter) -> its tensor index
        self._owner_of: dict[int, Tensor] = {}
        for name, module in selected:
            own = [(n, p) for n, p in module.named_parameters(recurse=False)
                   if p.is_floating_point() and p.requires_grad and id(p) not in self._index_of]
            if not own:
                continue
            for n, p in own:
                self._index_of[id(p)] = len(self.tensors)
                self._owner_of[id(p)] = p
                self.tensors.append((len(self.names), n))
            self.names.append(name)
        self._at = {name: i for i, name in enumerate(self.names)}
        self._module_of = np.array([m for m, _ in self.tensors], dtype=np.int64)
        self._scores = OnlineScores(len(self.tensors), warmup)
        self._values: np.ndarray | None = None  # this step's norms (the last check's), NaN: none
        self._flagged = np.zeros(len(self.tensors), dtype=bool)  # reported this step
        self._positions: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        self._last: tuple[object, Any] = (None, None)  # the list of the last check, its entry
        #: The spiking tensors of the last check, per module name: (parameter, norm, score).
        self.hits: dict[str, list[tuple[str, float, float]]] = {}

    def baseline(self, name: str) -> dict[str, float]:
        """Module ``name``'s parameters' baseline norms (``exp`` of the log baseline; those
        with fewer than two values have none)."""
        i = self._at.get(name)
        base = self._scores.baseline()
        return {} if i is None else {n: math.exp(base[k]) for k, (m, n) in
                                     enumerate(self.tensors) if m == i and base[k] == base[k]}

    def any_grad(self) -> bool:
        """Whether a watched parameter has a gradient now."""
        return any(p.grad is not None for p in self._owner_of.values())

    def check(self, params: list[tuple[str, Tensor]], norms: np.ndarray) -> list[Spike]:
        """Score the step's norms from the screen's ``params`` and the norms of their gradients
        (one host copy, made by the screen); return the modules with a spiking tensor not
        reported yet this step, in module order, as ``(module index, name, "param_grad",
        norm, score)`` of their highest-scoring tensor (all in :attr:`hits`)."""
        if params is self._last[0]:  # the screen's usual list, as at the last check
            positions, tensors = self._last[1]
        else:
            key = tuple([id(p) for _, p in params])
            entry = self._positions.get(key)
            if entry is None:
                idx = np.array([self._index_of.get(id(p), -1) for _, p in params],
                               dtype=np.int64)
                mine = idx >= 0
                entry = self._positions[key] = (np.flatnonzero(mine), idx[mine])
            self._last = (params, entry)
            positions, tensors = entry
        values = np.full(len(self.tensors), np.nan)
        values[tensors] = norms[positions]
        self._values = values
        scores = self._scores.score(values)
        hit = (scores > self.spike) & ~self._flagged  # False for NaN
        self.hits = {}
        if not hit.any():
            return []
        self._flagged |= hit
        out: list[Spike] = []
        for k in np.flatnonzero(hit).tolist():
            m, pname = self.tensors[k]
            self.hits.setdefault(self.names[m], []).append(
                (pname, float(values[k]), float(scores[k])))
        for name, found in self.hits.items():
            found.sort(key=lambda h: -h[2])
            out.append((self._at[name], name, "param_grad", found[0][1], found[0][2]))
        out.sort()
        return out

    def close_step(self) -> None:
        """Add the step's norms to the histories and start a new step."""
        values, self._values = self._values, None
        self._flagged[:] = False
        self.hits = {}
        if values is not None:
            self._scores.push(values)
