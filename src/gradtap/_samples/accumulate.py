"""What the backwards computed: one backward's results (:class:`Step`) and their sum (:class:`Totals`).

A :class:`Step` lives for one backward. Each call's record adds its per-sample gradients
(``[N, *shape]``, where they are built) with their sums over the samples, or only the reduced
quantities asked for (squared norms ``[N]``, ``sum_n g_n**2``, the batch gradient); a hook on
each parameter adds what autograd puts into its ``.grad``. The end-of-backward check
(``check``) compares the two, and the step is merged into the :class:`Totals`, which cover
every backward since the start or the last ``clear()``, as ``.grad`` accumulates.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from gradtap._samples.check import checked_sums
from gradtap._samples.compute import Compute, compute_for
from gradtap._samples.fallback import CannotReplay
from gradtap._samples.layout import KeptCall
from gradtap._samples.owners import Owner
from gradtap._samples.results import results
from gradtap._samples.sketch import pair
from gradtap._samples.spec import Spec
from gradtap._samples.units import largest_norm
from gradtap.errors import GradtapError
from gradtap.record import GradRecord

__all__ = ["Step", "Totals"]


class Step:
    """What one backward computed, and what it added to each ``.grad``."""

    def __init__(self, spec: Spec) -> None:
        self._spec = spec
        self.grad: dict[str, Tensor] = {}
        # sum over samples of grad, times its projection where the check is sketched
        self.sums: dict[str, Tensor] = {}
        self.norm_sq: dict[str, Tensor] = {}
        self.sum_sq: dict[str, Tensor] = {}
        self.total: dict[str, Tensor] = {}
        self.pg: dict[str, Tensor] = {}  # the calls' own contributions (not materialized)
        # What this backward adds to each .grad; where the check is sketched, its projection
        # unless it is the very tensor kept as a call's contribution (pg): keeping no
        # reference to a wide gradient lets autograd move it into .grad without a copy.
        self.increments: dict[str, Tensor] = {}
        self.late: dict[str, tuple[str, str]] = {}  # found in backward: qual -> (module, why)
        self._largest: float | None = None

    # -- a call's record --------------------------------------------------------------------

    def add_call(self, owner: Owner, rec: GradRecord, names: dict[str, str], n: int,
                 call: KeptCall | None) -> None:
        """Add the quantities of one call of ``owner`` (not owned) for ``names`` (relative ->
        qualified name); ``call``: its arguments as passed, for the fallback. A call whose
        split cannot be trusted marks them late instead (replayed at the end)."""
        if all(g is None for g in rec.grad_outputs.values()):
            if any(rec.param_grads.get(rel) is not None for rel in names):
                self.mark_late(names.values(), rec.module_name,
                               "its output gradient was not recorded (its output modified in "
                               "place afterwards?)")
            return
        if rec.notes:
            self.mark_late(names.values(), rec.module_name, "; ".join(rec.notes))
            return
        names = {rel: q for rel, q in names.items() if q not in self.late}
        if not names:
            return
        spec = self._spec
        scale = spec.scale(n)
        booked = spec.book is not None and spec.book.takes(spec.summed(owner, names))
        materialize = spec.materialize(owner, names) and not booked
        try:
            with torch.no_grad():
                compute = compute_for(owner, rec, scale, frozenset(names), materialize, n,
                                      spec.batch_dim, call)
                if booked and compute.closed_form:
                    assert spec.book is not None
                    spec.book.add(names, compute)
                    for rel, qual in names.items():  # autograd's, for the sum check
                        g = rec.param_grads.get(rel)
                        if g is not None:
                            self.pg[qual] = g
                    owner.seen.update(names)
                    return
                if materialize or booked:
                    grads = compute.grads()
                    self.add_grads(names, grads,
                                   checked_sums(self._spec.sketches, compute, grads, names))
                else:
                    self.add_reduced(names, compute, rec, scale)
        except CannotReplay as err:
            self.mark_late(names.values(), rec.module_name, str(err))
            return
        owner.seen.update(names)

    def add_grads(self, names: dict[str, str], grads: dict[str, Tensor],
                  sums: dict[str, Tensor]) -> None:
        """Add one call's per-sample gradients, and their sums over the samples (for the
        check at the end of backward; projected where it is sketched, or left for the check
        to project)."""
        for rel, t in sums.items():
            qual = names[rel]
            if qual in self.sums:
                kept, t = pair(self._spec.sketches, qual, self.sums[qual], t)
                t = kept + t
            self.sums[qual] = t
        for rel, g in grads.items():
            qual = names[rel]
            self.grad[qual] = g if qual not in self.grad else self.grad[qual] + g

    def add_reduced(self, names: dict[str, str], compute: Compute, rec: GradRecord,
                    scale: float, shares: dict[str, Tensor] | None = None) -> None:
        """Add one call's reduced quantities, and its contribution to each ``.grad``: the
        record's, or ``shares`` (qualified name -> tensor) for an owned call."""
        spec = self._spec
        if spec.want_norm:
            for rel, v in compute.norm_sq().items():
                self.norm_sq[names[rel]] = v
        if spec.want_stats:
            for rel, v in compute.sum_sq().items():
                self.sum_sq[names[rel]] = v
        for rel, qual in names.items():
            g = rec.param_grads.get(rel) if shares is None else shares.get(qual)
            if g is not None:
                self.pg[qual] = g
                if spec.want_var:
                    self.total[qual] = g * scale

    def mark_late(self, quals: Iterable[str], module: str, reason: str) -> None:
        """Give ``quals`` their per-sample gradients from a replay at the end of backward."""
        for q in quals:
            self.late.setdefault(q, (repr(module), reason))

    # -- .grad increments -------------------------------------------------------------------

    def increment(self, qual: str, grad: Tensor) -> None:
        """Autograd added ``grad`` to ``qual``'s ``.grad`` (projected where the check is
        sketched, unless it is the call's own contribution kept as it is)."""
        sketches = self._spec.sketches
        with torch.no_grad():
            if qual in sketches and self.pg.get(qual) is not grad:
                grad = sketches.project(qual, grad)
            self.add_increment(qual, grad)  # twice: a reentrant checkpoint

    def add_increment(self, qual: str, grad: Tensor) -> None:
        inc = self.increments.get(qual)
        if inc is not None:
            inc, grad = pair(self._spec.sketches, qual, inc, grad)
            grad = inc + grad
        self.increments[qual] = grad

    def largest(self) -> float:
        """The largest gradient norm of this backward, over every selected parameter (of the
        projection, whose expected square is the norm's, where the check is sketched)."""
        if self._largest is None:
            self._largest = largest_norm(list(self.increments.values()))
        return self._largest

    def discard(self, qual: str) -> None:
        """Forget what the calls gave ``qual`` (a replay gives it instead, or nothing)."""
        for step in (self.grad, self.sums, self.norm_sq, self.sum_sq, self.total, self.pg):
            step.pop(qual, None)


class Totals:
    """The results of the backwards since the start or the last clear, and the parameters
    that got none."""

    def __init__(self, spec: Spec) -> None:
        self._spec = spec
        self.grad: dict[str, Tensor] = {}
        self.norm_sq: dict[str, Tensor] = {}
        self.sum_sq: dict[str, Tensor] = {}
        self.total: dict[str, Tensor] = {}
        self._problems: list[str] = []  # reduced already, and given more by a backward
        self._failed: dict[str, str] = {}  # qual -> why no per-sample gradients
        self._results: dict[str, object] | None = None

    def fail(self, qual: str, message: str) -> None:
        """No rule and no replay gave ``qual`` per-sample gradients; reading says why."""
        self._failed[qual] = message
        self._results = None

    def merge(self, step: Step) -> None:
        """Add one backward's results to those of earlier backwards since the last clear."""
        for q, g in step.grad.items():
            if q in self.norm_sq or q in self.sum_sq:
                self._problems.append(q)
            self.grad[q] = g if q not in self.grad else self.grad[q] + g
        for new, total in ((step.norm_sq, self.norm_sq), (step.sum_sq, self.sum_sq)):
            for q, v in new.items():
                if q in total or q in self.grad:
                    self._problems.append(q)
                total[q] = v
        self.total.update(step.total)
        if step.grad or step.norm_sq or step.sum_sq:
            self._results = None

    def results(self, n: int | None) -> dict[str, object]:
        """Every quantity over the parameters (``results.results``) for ``n`` samples.

        Raises:
            GradtapError: a parameter got no per-sample gradients, none was computed yet,
                or norms/statistics already reduced got more from a later backward.
        """
        if self._results is None:
            self._results = self._finish(n)
        return self._results

    def raise_failed(self) -> None:
        """Raise when a parameter got no per-sample gradients from a rule or a replay."""
        if self._failed:
            raise GradtapError(
                "per_sample: no per-sample gradients could be computed for "
                + "; ".join(self._failed.values())
                + ". Leave these parameters out with select=, or make the forward one a replay "
                "can repeat (eval mode, arguments not modified in place)"
            )

    def _finish(self, n: int | None) -> dict[str, object]:
        self.raise_failed()
        if n is None or not (self.grad or self.norm_sq or self.sum_sq or self.total):
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
        return results(self._spec.params, n, self._spec.quantities, self.grad, self.norm_sq,
                       self.sum_sq, self.total)
