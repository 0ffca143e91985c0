"""``GradtapCallback`` for the Hugging Face ``Trainer`` (``pip install gradtap[transformers]``).

The Trainer clips gradients before its ``on_pre_optimizer_step`` event, so a callback that
reads gradients there sees clipped ones. This callback takes its Monitor step earlier: at the
end of the backward of the last micro-batch of each optimizer step (the one on which
Accelerate syncs gradients), through :class:`gradtap.capture.HookSet`. Its statistics are of
the accumulated gradients **before clipping** (``max_grad_norm``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from gradtap.errors import missing_extra

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise missing_extra("gradtap.integrations.transformers", "transformers", "transformers") from exc

from gradtap._monitor.monitor import DEFAULT_STATS
from gradtap._types import Selector
from gradtap.capture import HookSet
from gradtap.integrations._callback import STATE_FILE, CallbackCore, CallbackViews
from gradtap.select import unwrap_model

__all__ = ["GradtapCallback"]


class GradtapCallback(CallbackViews, TrainerCallback):  # type: ignore[misc]
    """Monitor a Hugging Face ``Trainer``'s gradients: one Monitor step per optimizer step.

    The Monitor watches the Trainer's model (parameters named as in it, without wrapper
    prefixes) and writes a run store that ``gradtap report`` reads: ``store``, or by default
    a ``gradtap`` folder in ``args.output_dir``.

    Statistics are of the gradients of each optimizer step after gradient accumulation and
    **before clipping**: the step is closed at the end of the backward of the step's last
    micro-batch (if that point is not seen, in ``on_pre_optimizer_step``, after clipping).
    The step's loss is stored as name ``"<loss>"``, stat ``value``: the loss the model returns
    (``outputs.loss``, what ``Trainer.compute_loss`` uses), averaged over the step's
    micro-batches as the Trainer does (summed when the model normalised it by the step's
    ``num_items_in_batch``); nothing is stored when the model returns no loss (a
    ``compute_loss_func`` or label smoothing computes it outside the model).
    With ``detect=True`` a detector screens every backward; on an optimizer step where it
    finds an anomaly, or where a gradient holds a NaN/Inf, the gradients are set to ``None``
    in ``on_pre_optimizer_step``, so torch's optimizers leave the parameters and their state
    unchanged; the anomalies are in :attr:`anomalies`, the skipped steps in :attr:`skipped`.
    The learning-rate scheduler and ``global_step`` still advance.

    Under ``fp16=True`` the Monitor (and detector) is given Accelerate's ``GradScaler``
    (``scaler=``): statistics are those of the unscaled gradients, and each step stores the
    scale and whether the scaler found an overflow. An inf/NaN gradient under the scaler is
    an overflow that the scaler skips itself: recorded (``Anomaly(kind="overflow")``,
    :attr:`overflows`), not counted in :attr:`skipped`.

    The callback's state (Monitor step count, EWMA, update/cosine snapshots) is written as
    ``gradtap_state.pt`` into each checkpoint directory and read back by
    ``trainer.train(resume_from_checkpoint=...)`` from ``output_dir/checkpoint-<global_step>``
    (or ``args.resume_from_checkpoint`` when set): the resumed run's EWMA and step numbers
    continue the first run's. A resumed run that finds the first run's store at the default
    place writes to ``gradtap-<step>`` beside it.

    Args:
        store: run directory (default: ``<output_dir>/gradtap``).
        select, stats, kinds, every, ewma, hist_bins: as for :class:`gradtap.Monitor`.
        detect: skip the optimizer step on an anomaly (see above); ``"samples"`` also names
            the samples behind each anomaly as batch positions (``Anomaly.samples``; the
            Trainer hands the model only the columns it takes, so no ids reach it).

    Example:
        >>> from gradtap.integrations.transformers import GradtapCallback
        >>> cb = GradtapCallback(ewma=0.99, every=10)
        >>> # Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
    """

    def __init__(self, store: str | os.PathLike[str] | None = None, select: Selector = "*",
                 stats: Sequence[str] = DEFAULT_STATS, kinds: Sequence[str] = ("param_grad",),
                 every: int = 1, ewma: float | None = None, hist_bins: int | None = None,
                 detect: bool | Literal["samples"] = False) -> None:
        self._core = CallbackCore(store, select, stats, kinds, every, ewma, hist_bins, detect)
        self._model: torch.nn.Module | None = None
        self._sync: Any = None
        self._hooks: HookSet | None = None
        self._stepped = False
        self._scaler: torch.amp.GradScaler | None = None
        self._losses: list[torch.Tensor] = []
        self._normalized = False

    # The Trainer restores its state from a checkpoint after on_train_begin: the Monitor is
    # made at the first on_step_begin, when global_step is the resumed one.
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        self._model = model
        # Accelerate's gradient state says whether this backward is the step's last one.
        self._sync = getattr(optimizer, "gradient_state", None)
        # Under fp16 mixed precision Accelerate's optimizer holds the run's GradScaler.
        scaler = getattr(optimizer, "scaler", None)
        self._scaler = scaler if isinstance(scaler, torch.amp.GradScaler) else None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._core.started or self._model is None:
            return
        if state.global_step > 0:
            self._load(args, state)
        model = unwrap_model(self._model)
        self._core.start(model, Path(args.output_dir) / "gradtap",
                         meta={"framework": "transformers"}, scaler=self._scaler)
        params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        self._hooks = HookSet()
        self._hooks.after_accumulation([params], self._end_of_backward)
        self._hooks.module_calls(model, self._before_forward, self._after_forward)

    # The Trainer's loss is the loss the model returns (what its compute_loss uses): divided by
    # the number of micro-batches of the step, unless the model normalised it by the step's
    # item count (num_items_in_batch), in which case the micro-batches' losses add up.
    def _before_forward(self, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            self._normalized = kwargs.get("num_items_in_batch") is not None

    def _after_forward(self, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())

    def _step_loss(self) -> None:
        losses, self._losses = self._losses, []
        if losses:
            total = torch.stack([v.to(losses[0].device, torch.float64).reshape(())
                                 for v in losses]).sum()
            self._core.add_loss(total if self._normalized else total / len(losses))

    def _end_of_backward(self, reached: list[int]) -> None:
        if self._sync is not None and self._sync.sync_gradients and not self._stepped:
            self._step_loss()
            self._core.monitor_step()
            self._stepped = True

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None,
                              optimizer: Any = None, **kwargs: Any) -> None:
        if not self._core.started:
            return
        if not self._stepped:  # the end of the last backward was not seen: after clipping
            self._step_loss()
            self._core.monitor_step()
        self._stepped = False
        if self._core.verdict() and optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            torch.save(self._core.state_dict(), folder / STATE_FILE)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop("finished")

    def _stop(self, status: str) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self._core.stop(status)

    def _load(self, args: Any, state: Any) -> None:
        candidates = [Path(args.output_dir) / f"checkpoint-{state.global_step}"]
        if getattr(args, "resume_from_checkpoint", None):
            candidates.insert(0, Path(args.resume_from_checkpoint))
        for folder in candidates:
            if (folder / STATE_FILE).is_file():
                self._core.load_state_dict(torch.load(folder / STATE_FILE, weights_only=True))
                return
        warnings.warn(f"resuming at step {state.global_step} without gradtap's state (no "
                      f"{STATE_FILE} in {', '.join(map(str, candidates))}): the Monitor's "
                      "steps and EWMA start afresh", stacklevel=2)
