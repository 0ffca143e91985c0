"""Loss scaling for DP-SGD: ``dp_sgd(..., scaler=)`` with a ``torch.amp.GradScaler``.

Under a scaler, the backward is of ``scale * loss``, so every per-sample gradient is
``scale * g_i``. :class:`LossScale` gives the scale of the step (the scaler's own, as
``scaler.scale(...)`` last applied it: it changes only at ``scaler.update()``, after the
step), by which the clipping divides the per-sample squared norms (``scale**2``) and the
clipped sum (``scale``), so the bound applies to the unscaled gradients exactly. At
``scaler.step(optimizer)`` the scaler unscales ``.grad`` (the batch gradient) and looks for
inf/NaN; when it finds some it skips ``optimizer.step()``, and so the private step: the
logical batch is dropped, no noise is drawn, and the accountant still counts the step (the
batch was drawn: counting it can only overstate epsilon). A scaler given to ``dp_sgd`` is
the only one that may step its optimizer while enabled; a fused optimizer (one that takes
the scale itself, ``fused=True``) is refused, as it would divide the private gradient by
the scale once more. Under DDP each rank's scaler looks at its own ``.grad`` (DDP reduces
nothing while ``dp_sgd`` is attached): an overflow on one rank is shared first
(:meth:`~gradtap._privacy.distributed.Ranks.agree_on_overflow`), so every rank skips the same
steps and the scalers keep the same scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gradtap.capture import HookSet, Session, compat

__all__ = ["LossScale"]


class LossScale:
    """The loss scale of the steps of one optimizer, and what happens at a skipped step.

    ``skipped()`` runs after a ``scaler.step(optimizer)`` that did not step the optimizer;
    ``agree(params)`` runs before the scaler looks at the gradients of ``params`` (under DDP:
    an inf/NaN on any rank is made one on every rank, so the ranks skip together).
    """

    def __init__(self, hooks: HookSet, session: Session, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None, skipped: Callable[[], None],
                 agree: Callable[[list[Tensor]], None]) -> None:
        self._watch = session.scaler(scaler, "dp_sgd")
        self._optimizer = optimizer
        self._skipped = skipped
        self._agree = agree
        self._stepping = False
        self.stepped = False  # set by the private step while a scaler's step runs
        if scaler is not None and compat.steps_with_scale(optimizer):
            raise NotImplementedError(
                "dp_sgd: the optimizer takes the loss scale itself (fused=True) and would "
                "unscale the private gradient once more; make it with fused=False")
        hooks.around_any_grad_scaler_step(self._before, self._after)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return None if self._watch is None else self._watch.scaler

    def scale(self) -> Tensor | None:
        """The factor the per-sample gradients of this step carry (``None``: none)."""
        return None if self._watch is None else self._watch.step_scale()

    def _before(self, scaler: torch.amp.GradScaler, optimizer: Any) -> None:
        if optimizer is not self._optimizer or not scaler.is_enabled():
            return
        if scaler is not self.scaler:
            raise NotImplementedError(
                "dp_sgd: a torch.amp.GradScaler steps the optimizer, but dp_sgd was not given "
                "it: the per-sample gradients are those of the scaled loss, and clipping them "
                "at max_grad_norm would clip at the wrong bound; pass scaler=scaler to "
                "gt.dp_sgd")
        self._agree([p for group in optimizer.param_groups for p in group["params"]])
        self._stepping, self.stepped = True, False

    def _after(self, scaler: torch.amp.GradScaler, optimizer: Any) -> None:
        if not self._stepping or optimizer is not self._optimizer:
            return
        self._stepping = False
        if not self.stepped:
            self._skipped()
