"""Spike trackers: per (module, kind) a step's norm against ``spike`` times its EWMA.

:class:`SpikeTracker` serves the per-call watch (``replay=False``): parameter-gradient and
grad_output norms from each call's record. :class:`ParamSpikes` serves the default watch:
parameter-gradient norms read from ``.grad`` at the screen's check, no hook at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradtap import _tensorops as ops
from gradtap._detect._measure import Backward, Plan, innermost

__all__ = ["ParamSpikes", "Spike", "SpikeTracker"]

#: One spiking norm: (index of its plan, module name, kind, value, limit).
Spike = tuple[int, str, str, float, float]


class SpikeTracker:
    """A step's sum of squared norms per ``(module, kind)``, and their EWMAs across steps.

    ``kind`` is ``"grad_output"`` (the module's output-gradient norm) or ``"param_grad"`` (its
    direct parameters' gradient norm). Spiking, NaN and Inf values never feed the EWMA; a norm
    is checked once its EWMA has ``warmup`` steps.

    With :attr:`scale_of` (the grad scaler's scale of the step, under mixed precision) the
    norms measured in backward are divided by it: spikes and EWMAs are those of the
    unscaled gradients.
    """

    def __init__(self, spike: float | None, warmup: int, beta: float) -> None:
        self.spike, self.warmup, self.beta = spike, warmup, beta
        self.scale_of: Callable[[], float] | None = None
        self._inv2: float | None = None  # 1 / scale**2 of this step, read once
        self._totals: dict[tuple[str, str], float] = {}
        self._flagged: set[tuple[str, str]] = set()
        self._index: dict[tuple[str, str], int] = {}
        self._mean = torch.zeros(0, dtype=torch.float64)
        self._var = torch.zeros(0, dtype=torch.float64)
        self._count = np.zeros(0, dtype=np.int64)

    def ewma(self, name: str, kind: str) -> tuple[float, float]:
        """``(mean, var)`` of the EWMA of module ``name``'s ``kind`` norm (KeyError if none)."""
        i = self._index.get((name, kind))
        if i is None:
            have = sorted(f"{n}:{k}" for n, k in self._index)
            raise KeyError(f"no spike EWMA for module {name!r} kind {kind!r}; have: "
                           f"{', '.join(have[:10]) or '(none: pass spike= and call step())'}")
        return float(self._mean[i]), float(self._var[i])

    def might_spike(self, plan: Plan, back: Backward) -> bool:
        """Whether this record (its norms all measured) pushes a norm of its module over the
        spike threshold."""
        hit = False
        for kind, idx in (("grad_output", [j for _, j in plan.outs]), ("param_grad", plan.direct)):
            if not idx:
                continue
            key = (plan.name, kind)
            add = sum(back.norms[j] ** 2 for j in idx) * self._unscale2()
            back.partial[key] = back.partial.get(key, 0.0) + add
            j = self._index.get(key)
            if j is None or self._count[j] < max(self.warmup, 1):
                continue
            total = self._totals.get(key, 0.0) + back.partial[key]
            hit = hit or math.sqrt(total) > self.spike * float(self._mean[j])  # type: ignore[operator]
        return hit

    def check(self, plans: list[Plan], norms: np.ndarray, finite: np.ndarray,
              selected: set[str]) -> tuple[int, list[Spike]] | None:
        """Add a backward's norms to the step's; return the first spiking module (innermost,
        in backward order) as ``(plan index, its spikes, grad_output first)``, or None."""
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
                    flagged.add(key)  # a non-finite norm never feeds the EWMA
                    continue
                if key not in seen:
                    seen.add(key)
                    touched.append((i, name, kind))
                total = totals.get(key, 0.0)
                for j in idx:
                    total += sq[j]
                totals[key] = total
        spiking: list[Spike] = []
        for i, name, kind in touched:
            key = (name, kind)
            at = self._index.get(key)
            if at is None or key in self._flagged or self._count[at] < max(self.warmup, 1):
                continue
            value = math.sqrt(self._totals[key])
            limit = self.spike * float(self._mean[at])  # type: ignore[operator]
            if value > limit:
                spiking.append((i, name, kind, value, limit))
        if not spiking:
            return None
        for _, name, kind, _, _ in spiking:
            self._flagged.add((name, kind))
        first = innermost(spiking, lambda s: s[1])[0]
        kinds = [s for s in spiking if s[1] == first[1]]
        # The grad_output spike is the cause of a param_grad spike of the same module.
        kinds.sort(key=lambda s: s[2] != "grad_output")
        return first[0], kinds

    def _unscale2(self) -> float:
        if self.scale_of is None:
            return 1.0
        if self._inv2 is None:
            self._inv2 = 1.0 / self.scale_of() ** 2
        return self._inv2

    def mean(self, name: str, kind: str) -> float:
        """The EWMA mean of a norm that has one."""
        return float(self._mean[self._index[(name, kind)]])

    def close_step(self) -> None:
        """Feed the step's norms into the EWMAs and start a new step."""
        try:
            self._update()
        finally:
            self._totals = {}
            self._flagged = set()
            self._inv2 = None

    def _update(self) -> None:
        if self.spike is None or not self._totals:
            return
        values = np.full(len(self._index), np.nan)
        new: dict[tuple[str, str], float] = {}
        for key, total in self._totals.items():
            if key in self._flagged:
                continue  # spiking or non-finite values never feed the EWMA
            j = self._index.get(key)
            if j is None:
                new[key] = math.sqrt(total)
            else:
                values[j] = math.sqrt(total)
        present = np.flatnonzero(~np.isnan(values))
        if len(present) == len(values):  # the usual step: every norm is there, update in place
            ops.ewma_update_(self._mean, self._var, torch.from_numpy(values), self.beta)
            self._count += 1
        elif len(present):
            idx = torch.from_numpy(present)
            mean, var = self._mean[idx], self._var[idx]
            ops.ewma_update_(mean, var, torch.from_numpy(values[present]), self.beta)
            self._mean[idx] = mean
            self._var[idx] = var
            self._count[present] += 1
        if new:
            mean, var = ops.ewma_init(torch.tensor(list(new.values()), dtype=torch.float64))
            for key in new:
                self._index[key] = len(self._index)
            self._mean = torch.cat([self._mean, mean])
            self._var = torch.cat([self._var, var])
            self._count = np.concatenate([self._count, np.ones(len(new), np.int64)])



class ParamSpikes:
    """Parameter-gradient spikes of the default watch, with no hook: per selected module, the
    norm of its own (direct) parameters' ``.grad`` against ``spike`` times its EWMA.

    The screen, in its norms mode, reduces every parameter gradient to its L2 norm at its
    check (one ``torch._foreach_norm`` per device and dtype; on CPU, gradients of one shape
    stacked and reduced in one norm; in place of its finiteness pass) and reads them with
    its one host copy; :meth:`check` adds them up per module on the host.
    :meth:`close_step` feeds the step's norms into the EWMAs, all
    modules at once. Spiking, NaN and Inf values never feed the EWMA; a norm is checked once
    its EWMA has ``warmup`` steps.
    """

    def __init__(self, selected: list[tuple[str, nn.Module]], spike: float, warmup: int,
                 beta: float) -> None:
        self.spike, self.warmup, self.beta = spike, warmup, beta
        self.names: list[str] = []
        self._index_of: dict[int, int] = {}  # id(parameter) -> its module's index
        self._owner_of: dict[int, Tensor] = {}
        for name, module in selected:
            own = [p for _, p in module.named_parameters(recurse=False)
                   if p.is_floating_point() and p.requires_grad and id(p) not in self._index_of]
            if not own:
                continue
            for p in own:
                self._index_of[id(p)] = len(self.names)
                self._owner_of[id(p)] = p
            self.names.append(name)
        self._at = {name: i for i, name in enumerate(self.names)}
        n = len(self.names)
        self._mean = np.zeros(n)  # the EWMA state, float64
        self._var = np.zeros(n)
        self._count = np.zeros(n, dtype=np.int64)
        self._armed = np.zeros(n, dtype=bool)  # count >= max(warmup, 1): checked for spikes
        self._all_armed = False
        self._limit = np.full(n, np.inf)  # spike x mean once armed, else inf
        self._values: np.ndarray | None = None  # this step's norms (the last check's), NaN: none
        self._clean = False  # every module has a finite norm this step, none flagged
        self._flagged = np.zeros(n, dtype=bool)  # spiking or non-finite this step
        self._none_flagged = True  # not self._flagged.any()
        # Per list of the screen's parameters: the positions of the watched ones (None: all),
        # their modules' indices, and which modules have a norm.
        # (positions, owners, present, whether every module is present)
        self._owners: dict[tuple[int, ...],
                           tuple[np.ndarray | None, np.ndarray, np.ndarray, bool]] = {}
        self._last: tuple[object, Any] = (None, None)  # the list of the last check, its entry

    def ewma(self, name: str) -> tuple[float, float] | None:
        """``(mean, var)`` of module ``name``'s parameter-gradient EWMA, None if it has none."""
        i = self._at.get(name)
        if i is None or self._count[i] == 0:
            return None
        return float(self._mean[i]), float(self._var[i])

    def mean(self, name: str) -> float:
        """The EWMA mean of module ``name``'s parameter-gradient norm (it has one)."""
        return float(self._mean[self._at[name]])

    def any_grad(self) -> bool:
        """Whether a watched parameter has a gradient now."""
        return any(p.grad is not None for p in self._owner_of.values())

    def check(self, params: list[tuple[str, Tensor]], norms: np.ndarray) -> list[Spike]:
        """Note the step's norms from the screen's ``params`` and the norms of their gradients
        (one host copy, made by the screen); return the modules that spike and were not
        flagged yet this step, in module order, as ``(module index, name, "param_grad",
        value, limit)``."""
        n = len(self.names)
        if params is self._last[0]:  # the screen's usual list, as at the last check
            entry = self._last[1]
        else:
            key = tuple([id(p) for _, p in params])
            entry = self._owners.get(key)
            if entry is None:
                owners = np.array([self._index_of.get(id(p), -1) for _, p in params],
                                  dtype=np.int64)
                mine = owners >= 0
                present = np.bincount(owners[mine], minlength=n) > 0
                entry = self._owners[key] = (None if mine.all() else np.flatnonzero(mine),
                                             owners[mine], present, bool(present.all()))
            self._last = (params, entry)
        positions, owners, present, complete = entry
        if positions is not None:
            norms = norms[positions]
        values = np.sqrt(np.bincount(owners, weights=norms * norms, minlength=n))
        self._values = values
        # The usual step: every module has a finite norm within its limit (inf until armed),
        # none flagged yet.
        if (complete and math.isfinite(values.sum()) and bool((values <= self._limit).all())
                and self._none_flagged):
            self._clean = True
            return []
        if not complete:
            values[~present] = np.nan
        hit = values > self._limit  # False for NaN and for modules not armed yet
        if not hit.any() and np.isfinite(values[present]).all():
            self._clean = not self._flagged.any() and bool(present.all())
            return []
        self._clean = False
        self._flagged |= present & ~np.isfinite(values)  # never feeds the EWMA
        hit &= ~self._flagged
        self._flagged |= hit
        self._none_flagged = not self._flagged.any()
        return [(int(i), self.names[i], "param_grad", float(values[i]), float(self._limit[i]))
                for i in np.flatnonzero(hit)]

    def close_step(self) -> None:
        """Feed the step's norms into the EWMAs (vectorised) and start a new step."""
        values, flagged, clean = self._values, self._flagged, self._clean
        n = len(self.names)
        self._values, self._clean = None, False
        if values is None:
            return
        if clean and self._all_armed:  # the usual step: every norm, update in place
            # ops.ewma_update_'s formula, on the host arrays (a few small numpy operations
            # cost less than torch's dispatch here).
            m, v = self._mean, self._var
            delta = values - m
            step = (1.0 - self.beta) * delta
            m += step
            v += step * delta
            v *= self.beta
            np.multiply(m, self.spike, out=self._limit)
            self._count += 1
            return
        self._flagged = np.zeros(n, dtype=bool)
        self._none_flagged = True
        use = np.isfinite(values) & ~flagged
        if not use.any():
            return
        first = use & (self._count == 0)
        self._mean[first] = values[first]
        self._var[first] = 0.0
        update = use & ~first
        if update.any():
            mean, var = torch.from_numpy(self._mean[update]), torch.from_numpy(self._var[update])
            ops.ewma_update_(mean, var, torch.from_numpy(values[update]), self.beta)
            self._mean[update] = mean.numpy()
            self._var[update] = var.numpy()
        self._count[use] += 1
        self._armed = self._count >= max(self.warmup, 1)
        self._all_armed = bool(self._armed.all())
        self._limit = np.where(self._armed, self.spike * self._mean, np.inf)
