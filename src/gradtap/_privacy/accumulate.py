"""Gradient accumulation for DP-SGD: the clipped sums of the micro-batches of one logical batch.

Several forwards and backwards (micro-batches) may come before one ``optimizer.step()``.
Each micro-batch holds distinct samples, and each sample's whole gradient is known once its
micro-batch's backward is over, so :class:`MicroBatches` folds a micro-batch into the running
clipped sum (``sum_i c_i g_i`` over its samples) when the next micro-batch starts: at the
next forward of the model (with grad enabled, outside a backward) after a backward went
through an output of an earlier forward. The per-sample engine is then cleared, so a
micro-batch of another size is welcome and its per-sample gradients are freed. The step
(the optimizer pre-hook of :class:`~gradtap._privacy.dpsgd.DPSGD`) folds the last one and
takes the total. Several backwards over one forward (two losses) are one micro-batch: their
per-sample gradients add up as ``.grad`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradtap.capture import HookSet, current_backward
from gradtap.record import flatten_tensors

__all__ = ["MicroBatches"]


class MicroBatches:
    """The running clipped sum of the micro-batches since the last step.

    ``clipped_sum()`` gives the clipped sum of the samples the engine holds (``None`` when
    it holds none) and ``clear()`` forgets them; the hooks go on ``root`` through ``hooks``,
    which must subscribe before the engine's (so a fold runs before the engine sees the
    next micro-batch's forward).
    """

    def __init__(self, hooks: HookSet, root: nn.Module,
                 clipped_sum: Callable[[], list[Tensor] | None],
                 clear: Callable[[], None]) -> None:
        self._hooks = hooks
        self._clipped_sum = clipped_sum
        self._clear = clear
        self._total: list[Tensor] | None = None
        self._reached = False  # a backward went through a forward's output since the fold
        hooks.module_calls(root, self._before, self._after)

    def _training_call(self) -> bool:
        return torch.is_grad_enabled() and current_backward() is None

    def _before(self, _args: tuple, _kwargs: dict[str, Any]) -> None:
        if self._reached and self._training_call():
            self.fold()

    def _after(self, output: Any) -> None:
        if not self._training_call():
            return
        for _, t in flatten_tensors(output, "output"):
            if t.requires_grad and not t.is_leaf:  # a leaf output: no graph to follow
                self._hooks.gradient(t, self._on_grad)

    def _on_grad(self, _grad: Tensor) -> None:
        self._reached = True

    def fold(self) -> None:
        """Add the clipped sum of the engine's samples to the total and clear the engine."""
        sums = self._clipped_sum()
        self._reached = False
        self._clear()
        if sums is None:
            return
        if self._total is None:
            self._total = sums
        else:
            torch._foreach_add_(self._total, sums)

    def take(self, like: Sequence[Tensor]) -> list[Tensor]:
        """The clipped sum of every micro-batch since the last step (zeros like ``like``
        without samples); starts the next logical batch."""
        self.fold()
        total, self._total = self._total, None
        return total if total is not None else [torch.zeros_like(p) for p in like]

    def discard(self) -> None:
        """Forget the logical batch (a step the loss scaler skipped)."""
        self._reached = False
        self._clear()
        self._total = None
