"""What one ``gt.per_sample`` resolves when it starts, and reads unchanged until it is removed.

:class:`Spec` checks the arguments, selects the parameters, resolves the module that owns each
(``owners``) and which checks are sketched (``sketch``), through ``resolved`` (which reuses
the last resolution of an unchanged model), and gives the factors and choices that depend
only on them: the loss reduction's scale, whether a call's per-sample gradients must be built.
The collaborators of :class:`~gradtap._samples.api.PerSample` share it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, cast, get_args

from torch import nn

from gradtap._samples.owners import Owner
from gradtap._samples.resolved import resolved_for
from gradtap._samples.results import STATS
from gradtap._samples.sketch import Sketches
from gradtap._types import Selector
from gradtap.capture import session

if TYPE_CHECKING:
    from gradtap._samples.clipped import Book

__all__ = ["QUANTITIES", "LossReduction", "Quantity", "Spec"]

Quantity = Literal["grad", "norm", "variance", "second_moment", "snr"]
LossReduction = Literal["mean", "sum"]
QUANTITIES: tuple[str, ...] = get_args(Quantity)


class Spec:
    """The checked arguments of one ``per_sample``, its parameters and their owners."""

    def __init__(self, model: nn.Module, select: Selector, loss_reduction: LossReduction,
                 batch_dim: int, quantities: Iterable[Quantity], fallback: bool) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum'; got {loss_reduction!r}")
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"batch_dim must be a non-negative int; got {batch_dim!r}")
        asked: tuple[str, ...] = ((quantities,) if isinstance(quantities, str)
                                  else tuple(quantities))
        unknown = [q for q in asked if q not in QUANTITIES]
        if unknown or not asked:
            raise ValueError(
                f"quantities must be a non-empty subset of {QUANTITIES}; got {asked!r}"
            )
        self.loss_reduction = loss_reduction
        self.batch_dim = batch_dim
        self.quantities: tuple[Quantity, ...] = cast(tuple[Quantity, ...], asked)  # checked
        self.want_grad = "grad" in asked
        self.want_norm = "norm" in asked
        self.want_stats = bool(STATS & set(asked))
        self.want_var = bool({"variance", "snr"} & set(asked))

        # Named as the user's model (no DDP or compile prefixes).
        self.session = session(model, "per_sample()")
        self.model = self.session.root
        self.fallback = fallback
        resolved = resolved_for(self.model, select, batch_dim, fallback)
        self.params: dict[str, nn.Parameter] = resolved.params
        self.owners: dict[str, Owner] = resolved.owners
        self.sketches: Sketches = resolved.sketches
        self.use_count: dict[str, int] = resolved.use_count
        # qualified name -> names of its owners
        self.owners_of: dict[str, list[str]] = resolved.owners_of
        # Where the calls' closed forms go for clipped sums (``clipped``), when asked.
        self.book: Book | None = None

    def scale(self, n: int) -> float:
        """The factor from a record's gradients (of the loss) to those of each sample's term."""
        return float(n) if self.loss_reduction == "mean" else 1.0

    def share(self, n: int) -> float:
        """The factor from the sum of the per-sample gradients to ``.grad`` (``1/N`` or 1)."""
        return 1.0 / n if self.loss_reduction == "mean" else 1.0

    def materialize(self, owner: Owner, names: dict[str, str]) -> bool:
        """Whether one call's per-sample gradients of ``names`` (relative -> qualified) must be
        built: asked for, or summed with those of other calls (norms of a sum do not add up)."""
        return self.want_grad or self.summed(owner, names)

    def summed(self, owner: Owner, names: dict[str, str]) -> bool:
        """Whether one call's per-sample gradients of ``names`` are summed with those of
        other calls (a module called several times, a tied parameter)."""
        return (owner.calls > 1 or bool(owner.seen & set(names))
                or any(self.use_count.get(q, 1) > 1 for q in names.values()))
