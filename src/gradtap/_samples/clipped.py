"""The clipped sum ``sum_n c_n g_n`` of each parameter without its per-sample gradients.

Every rule is linear in the output gradient, so for an owned call (``own_grad``) whose
parameters have a closed form (Linear with any sequence dims, Embedding, convolutions, the
norm layers' affine parameters, attention's pieces) the weighted sum is the batch gradient of
``c_n`` times sample n's output gradient (:meth:`~gradtap._samples.compute.Compute.
weighted_total`), and the squared norms that give ``c_n`` come from the rule's norm path.
:class:`Book` keeps, per parameter, the call's compute (its input and output gradient, which
the record held anyway) and its squared norms ``[N]``: ``[N, *shape]`` is never built.

With ``per_param`` (a function of one parameter's squared norms to its coefficients: the
per-layer clipping of DP-SGD) the sum is formed as soon as the call's record comes in, and
the compute is dropped at once; otherwise (flat clipping: every norm first) the computes are
kept until :meth:`Clipped.weighted`. A parameter used by several calls (a module called
twice, a tied table, a second backward before the step) is materialized from its computes
(norms of a sum do not add up), and :class:`Clipped` reduces it from ``[N, *shape]``, as it
does a parameter given per-sample gradients without a closed form (the ``torch.func``
fallback, a replay, which the book then forgets).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from gradtap._samples.compute import Compute
from gradtap.errors import GradtapError

__all__ = ["Book", "Clipped", "PerParam"]

#: One parameter's squared per-sample norms ``[N]`` -> its coefficients ``[N]``.
PerParam = Callable[[str, Tensor], Tensor]


class Book:
    """The booked calls since the last clear: computes (flat) or formed sums (per parameter)."""

    def __init__(self, per_param: PerParam | None = None) -> None:
        self.per_param = per_param
        self.clear()

    def clear(self) -> None:
        self.computes: dict[str, tuple[str, Compute]] = {}  # qual -> (relative name, compute)
        self.norm_sq: dict[str, Tensor] = {}
        self.sums: dict[str, Tensor] = {}  # formed already (per_param)
        # a second backward before the step (the same samples): summed per sample
        self.grads: dict[str, Tensor] = {}

    def takes(self, summed: bool) -> bool:
        """Whether a call goes to the book: always for flat clipping (a repeat is materialized
        here); with ``per_param`` only a parameter's first use (its sum is formed at once)."""
        return self.per_param is None or not summed

    def __contains__(self, qual: str) -> bool:
        return qual in self.norm_sq

    def add(self, names: dict[str, str], compute: Compute) -> None:
        """One owned call's closed form for ``names`` (relative -> qualified name). A
        parameter booked already since the last clear (a second backward before the step)
        gets per-sample gradients: the norm of a sum needs them.

        Raises:
            GradtapError: that second backward under ``per_param``, whose first sum was
                formed and its per-sample parts dropped.
        """
        again = {rel: q for rel, q in names.items() if q in self.norm_sq or q in self.grads}
        if again:
            if self.per_param is not None:
                raise GradtapError(
                    f"per_sample: {', '.join(again.values())} got a second backward before "
                    "the step, but their clipped sums were formed in the first (per-layer "
                    "clipping): one backward per step")
            self._materialize(again, compute)
            names = {rel: q for rel, q in names.items() if rel not in again}
            if not names:
                return
        norms = compute.norm_sq()
        for rel, q in names.items():
            self.norm_sq[q] = norms[rel]
        if self.per_param is None:
            for rel, q in names.items():
                self.computes[q] = (rel, compute)
            return
        coefs = {rel: self.per_param(q, norms[rel]) for rel, q in names.items()}
        for rel, s in compute.weighted_total(coefs).items():
            self.sums[names[rel]] = s

    def _materialize(self, names: dict[str, str], compute: Compute) -> None:
        new = compute.grads()
        for rel, q in names.items():
            g = new[rel]
            if q in self.computes:
                first_rel, first = self.computes.pop(q)
                g = g + first.grads()[first_rel]
                del self.norm_sq[q]
            self.grads[q] = g if q not in self.grads else self.grads[q] + g

    def drop(self, qual: str) -> None:
        """Forget ``qual`` (a replay gave it per-sample gradients instead)."""
        for kept in (self.computes, self.norm_sq, self.sums, self.grads):
            kept.pop(qual, None)


class Clipped:
    """What a clipping consumer reads after backward: every parameter's squared per-sample
    norms, then its sum weighted by coefficients (see the module doc)."""

    def __init__(self, book: Book, grads: dict[str, Tensor],
                 params: dict[str, nn.Parameter], n: int) -> None:
        self._book, self._params, self._n = book, params, n
        self._grads = dict(book.grads)
        for q, g in grads.items():  # a use without a closed form: all per-sample then
            if q in book.sums:
                raise GradtapError(
                    f"per_sample: {q} was used again after its clipped sum was formed "
                    "(per-layer clipping: a second backward before the step?); one backward "
                    "per step")
            if q in book.computes:
                rel, compute = book.computes.pop(q)
                del book.norm_sq[q]
                g = g + compute.grads()[rel]
            self._grads[q] = g if q not in self._grads else self._grads[q] + g

    @property
    def booked(self) -> set[str]:
        """The parameters whose sum comes from a closed form (no ``[N, *shape]``)."""
        # (norm_sq holds exactly those: a materialized one leaves it)
        return set(self._book.norm_sq)

    def norm_sq(self) -> dict[str, Tensor]:
        """``{name: [N]}``: squared per-sample gradient norms (zeros where no gradient)."""
        out: dict[str, Tensor] = {}
        for q, p in self._params.items():
            if q in self._book:
                out[q] = self._book.norm_sq[q]
            elif q in self._grads:
                g = self._grads[q]
                out[q] = g.reshape(self._n, -1).square().sum(1)
            else:
                out[q] = p.new_zeros(self._n)
        return out

    def weighted(self, coefs: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """``{name: sum_n c_n g_n}`` with ``coefs[name]`` ``[N]`` (parameters booked with
        ``per_param`` were summed in backward and need none)."""
        coefs = coefs or {}
        book = self._book
        calls: dict[int, tuple[Compute, dict[str, str]]] = {}  # one pass per call
        for q, (rel, compute) in book.computes.items():
            calls.setdefault(id(compute), (compute, {}))[1][rel] = q
        booked: dict[str, Tensor] = dict(book.sums)
        for compute, names in calls.values():
            for rel, s in compute.weighted_total({r: coefs[q] for r, q in names.items()}).items():
                booked[names[rel]] = s
        out: dict[str, Tensor] = {}
        for q, p in self._params.items():
            if q in booked:
                out[q] = booked[q]
            elif q in self._grads:
                g = self._grads[q]
                out[q] = torch.tensordot(coefs[q].to(g.dtype), g, dims=1)
            else:
                out[q] = torch.zeros_like(p)
        return out
