"""The spike tracker: per (module, kind) a step's norm against ``spike`` times its EWMA."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from gradtap import _tensorops as ops
from gradtap._detect._measure import Backward, Plan, innermost

__all__ = ["Spike", "SpikeTracker"]

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

