"""The sum check: after each backward, per-sample gradients must add up to the ``.grad`` increment.

For every parameter the calls gave per-sample gradients, ``c * sum_n g_n`` (``c = 1/N`` for a
mean loss) must equal what that backward added to its ``.grad``; a parameter that fails (a use
outside the calls of its modules, a wrong split) is replayed (``replays``). Each call's sums
are taken when its per-sample gradients are (:func:`checked_sums`), from the rule's batch
gradient where that is cheaper, and on a random projection where the check is sketched
(``sketch``); the comparison itself is ``units.mismatches``, one host copy per device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gradtap._samples.compute import Compute, RuleCompute
from gradtap._samples.sketch import Sketches, pair
from gradtap._samples.spec import Spec
from gradtap._samples.units import mismatches

if TYPE_CHECKING:
    from gradtap._samples.accumulate import Step

__all__ = ["check_sums", "checked_sums", "sums"]


def sums(compute: Compute, grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """``sum_n g_n`` of one call's per-sample gradients ``grads``: from the rule's batch
    gradient where that costs less than a pass over them (Linear without sequence dims,
    Embedding), else summed."""
    if isinstance(compute, RuleCompute) and compute.total_is_cheap(grads):
        return compute.total()
    return {rel: g.sum(0) for rel, g in grads.items()}


def checked_sums(sketches: Sketches, compute: Compute, grads: dict[str, Tensor],
                 names: dict[str, str]) -> dict[str, Tensor]:
    """What the end-of-backward check compares of one call: ``sum_n g_n`` per name, times
    its projection where the check is sketched (``_samples.sketch``)."""
    out: dict[str, Tensor] = {}
    if isinstance(compute, RuleCompute) and compute.rule.total_sketch is not None:
        for rel in grads:
            if names[rel] in sketches:
                out.update(compute.sketch(frozenset({rel}), sketches.matrix(names[rel])))
    rest = {rel: g for rel, g in grads.items() if rel not in out}
    if rest:
        out.update((rel, sketches.project(names[rel], t))
                   for rel, t in sums(compute, rest).items() if rel in rest)
    return out


def check_sums(spec: Spec, step: Step, n: int, owned: set[str],
               skip: set[str]) -> dict[str, tuple[str, str]]:
    """Parameters whose per-sample gradients do not reduce to their ``.grad`` increment,
    with ``(owners, why)``; ``owned``: those whose every use this backward was owned (their
    increments are the sums by construction), ``skip``: those a replay gives anyway."""
    c = spec.share(n)
    sketches = spec.sketches
    touched = (set(step.grad) | set(step.pg) | set(step.increments)
               | set(step.norm_sq) | set(step.sum_sq))
    touched -= owned
    rows: dict[str, tuple[Tensor, Tensor, Tensor | None]] = {}
    with torch.no_grad():
        grads = [q for q in touched if q in step.grad and q not in skip]
        if grads:
            totals = [sketches.project(q, step.sums[q] if q in step.sums else step.grad[q].sum(0))
                      for q in grads]
            totals = list(torch._foreach_mul(totals, c))
            for q, a in zip(grads, totals, strict=True):
                inc = step.increments.get(q)
                a, inc = (a, torch.zeros_like(a)) if inc is None else pair(sketches, q, a, inc)
                rows[q] = (a, inc, step.grad[q])
        for q in touched - set(grads) - skip:
            pg = step.pg.get(q)
            inc = step.increments.get(q)
            if pg is None:
                pg = torch.zeros_like(spec.params[q] if inc is None else inc)
            pg, inc = (pg, torch.zeros_like(pg)) if inc is None else pair(sketches, q, pg, inc)
            rows[q] = (pg, inc, None)
    # A gradient that no call gave anything to (a table read through ``.weight``) is not a
    # rounding question: however small it is next to the others, it needs a replay.
    given = (set(step.grad) | set(step.pg) | set(step.sums) | set(step.norm_sq)
             | set(step.sum_sq) | set(step.total))
    unseen = set(step.increments) - given - owned - skip
    return {q: (", ".join(repr(o) for o in spec.owners_of.get(q, ())) or "?",
                "its per-sample gradients do not add up to its gradient in this backward "
                "(is it used outside the calls of the modules that hold it?)")
            for q in mismatches(rows, spec.params, c, step.largest) | unseen}
