"""``GradtapCallback`` for Lightning (``pip install gradtap[lightning]``).

One Monitor step per optimizer step, in ``on_before_optimizer_step``: after the last
micro-batch of a gradient accumulation and before gradient clipping, so the statistics are
those of the gradients the optimizer is about to apply, unclipped (and, under mixed
precision, unscaled: the Monitor is given the trainer's ``GradScaler``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from gradtap.errors import missing_extra

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise missing_extra("gradtap.integrations.lightning", "Lightning", "lightning") from exc

from gradtap._monitor.monitor import DEFAULT_STATS
from gradtap._types import Selector
from gradtap.integrations._callback import CallbackCore, CallbackViews

__all__ = ["GradtapCallback"]


class GradtapCallback(CallbackViews, Callback):  # type: ignore[misc]
    """Monitor a Lightning model's gradients: one Monitor step per optimizer step.

    The Monitor watches the ``LightningModule`` (parameters named as in it) from
    ``on_train_start`` to the end of ``fit``, and writes a run store that ``gradtap report``
    reads: ``store``, or by default a ``gradtap`` folder in ``trainer.log_dir`` (the
    logger's version folder; ``default_root_dir`` without a logger).

    Statistics are taken in ``on_before_optimizer_step``: once per optimizer step after
    gradient accumulation and before ``gradient_clip_val`` clips. The step's loss is stored as
    name ``"<loss>"``, stat ``value``: the sum of what Lightning backpropagated in the step
    (each ``training_step`` loss divided by ``accumulate_grad_batches``, unscaled), so the mean
    over the micro-batches of a full accumulation. Under
    ``precision="16-mixed"`` the Monitor is given the precision plugin's ``GradScaler``
    (``scaler=``): statistics are those of the unscaled gradients, fused optimizers
    included, and each step stores the scale and whether the scaler found an overflow. With
    ``detect=True`` a detector screens every backward; on a step where it finds a NaN/Inf
    the gradients are set to ``None`` before the optimizer runs, so torch's optimizers leave
    the parameters and their state (momentum, Adam's moments and step) unchanged; the
    anomalies are in :attr:`anomalies` and the skipped steps in :attr:`skipped`. The
    learning-rate scheduler still steps. Under the grad scaler an inf/NaN gradient is an
    overflow that the scaler skips itself: recorded (``Anomaly(kind="overflow")``,
    :attr:`overflows`), not counted in :attr:`skipped`.

    The callback's state (Monitor step count, EWMA, update/cosine snapshots) is saved in
    Lightning's checkpoints and restored by ``trainer.fit(..., ckpt_path=...)``: a resumed
    run's EWMA and step numbers continue the first run's.

    Args:
        store: run directory (default: ``<trainer.log_dir>/gradtap``; a resumed run that
            finds a store there writes to ``gradtap-<step>`` beside it).
        select, stats, kinds, every, ewma, hist_bins: as for :class:`gradtap.Monitor`.
        detect: skip the optimizer step on a NaN/Inf gradient (see above); ``"samples"``
            also names the samples behind each anomaly (``gt.detect(..., samples=True)``),
            with the ids of a batch that is a dict with a ``"sample_ids"`` entry (one id per
            row; without gradient accumulation), as ``Anomaly.sample_ids``.

    Example:
        >>> import lightning.pytorch as pl
        >>> from gradtap.integrations.lightning import GradtapCallback
        >>> cb = GradtapCallback(ewma=0.99, every=10)
        >>> trainer = pl.Trainer(callbacks=[cb], max_steps=0, logger=False,
        ...                      enable_progress_bar=False, enable_model_summary=False)
    """

    def __init__(self, store: str | os.PathLike[str] | None = None, select: Selector = "*",
                 stats: Sequence[str] = DEFAULT_STATS, kinds: Sequence[str] = ("param_grad",),
                 every: int = 1, ewma: float | None = None, hist_bins: int | None = None,
                 detect: bool | Literal["samples"] = False) -> None:
        self._core = CallbackCore(store, select, stats, kinds, every, ewma, hist_bins, detect)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._core.started:
            self._core.note_batch(batch)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        log_dir = trainer.log_dir or trainer.default_root_dir
        # Under precision="16-mixed" the plugin's GradScaler: unscaled statistics.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._core.start(pl_module, Path(log_dir) / "gradtap",
                         meta={"framework": "lightning"},
                         scaler=scaler if isinstance(scaler, torch.amp.GradScaler) else None)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule,
                           loss: torch.Tensor) -> None:
        # The loss Lightning backpropagates: divided by accumulate_grad_batches and, under
        # 16-mixed, scaled.
        if self._core.started:
            self._core.add_loss(loss, scaled=True)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: Any) -> None:
        if not self._core.started:
            return
        if self._core.optimizer_step():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._core.stop("finished")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        self._core.stop("failed")

    def state_dict(self) -> dict[str, Any]:
        return self._core.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._core.load_state_dict(state_dict)
