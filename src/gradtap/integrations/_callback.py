"""What the Lightning and Hugging Face callbacks share: a Monitor (and, with ``detect=True``, a
detector) over the trainer's model, one step per optimizer step, and its checkpoint state.

The framework modules only decide *when* a step closes and *where* things are written; this
module does the rest, so both callbacks behave the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradtap._detect._detector import Detector, detect
from gradtap._monitor.monitor import Monitor
from gradtap._types import Selector
from gradtap.capture import Clip, HookSet, ScalerWatch
from gradtap.report.data import write_anomalies
from gradtap.select import unwrap_model
from gradtap.store import DB_NAME

__all__ = ["STATE_FILE", "TRAINER", "CallbackCore", "CallbackViews"]

#: The file the Hugging Face callback writes into each checkpoint directory.
STATE_FILE = "gradtap_state.pt"

#: ``log_to=`` of the callbacks: the trainer's own loggers (Lightning) or integrations (the
#: Hugging Face Trainer's ``report_to``).
TRAINER = "trainer"

#: What ``anomalies.json`` says wrote it.
ANOMALY_SOURCE = "gradtap callback (detect=True)"


class CallbackCore:
    """The options of ``GradtapCallback`` and, once training starts, the Monitor they make.

    Args: as ``GradtapCallback`` (see the framework modules).
    """

    def __init__(self, store: str | os.PathLike[str] | None, select: Selector,
                 stats: Sequence[str], kinds: Sequence[str], every: int, ewma: float | None,
                 hist_bins: int | None, detect: bool | str, log_to: Any = TRAINER,
                 log_every: int | None = None, log_keys: str = "summary",
                 log_groups: dict[str, str] | None = None) -> None:
        if detect not in (True, False, "samples"):
            raise ValueError(f"detect must be True, False or 'samples'; got {detect!r}")
        self.store = None if store is None else os.fspath(store)
        self.select = select
        self.stats = tuple(stats)
        self.kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
        self.every = every
        self.ewma = ewma
        self.hist_bins = hist_bins
        self.detect = detect
        self.log_to = log_to
        self.log_every = log_every
        self.log_keys = log_keys
        self.log_groups = log_groups
        self.monitor: Monitor | None = None
        self.detector: Detector | None = None
        self.skipped: list[int] = []
        self.overflows: list[int] = []
        self._scaler: torch.amp.GradScaler | None = None
        self._params: list[nn.Parameter] = []
        self._last_step = -1
        self._anomalies: list[Any] = []
        self._pending_state: dict[str, Any] | None = None
        self._batch_ids: list[Any] = []  # each micro-batch's "sample_ids" since the last step
        self._loss: torch.Tensor | None = None
        self._loss_hooks: HookSet | None = None
        self._loss_scale: ScalerWatch | None = None
        self._clips: HookSet | None = None
        self._model_ids: set[int] = set()
        self._awaiting = False  # the step is to be taken before the trainer's clip
        # Checked now, not at the first training step: a bad option fails where it is written
        # (on a stand-in model with one submodule, as every kind can watch it; ``print`` stands
        # in for the trackers, which are known only at the start of training).
        Monitor(nn.Sequential(nn.Linear(1, 1)), "*", stats=self.stats, kinds=self.kinds,
                ewma=ewma, hist_bins=hist_bins, every=every,
                log_to=None if log_to is None else print, log_every=log_every,
                log_keys=log_keys).close()

    @property
    def started(self) -> bool:
        return self.monitor is not None

    def start(self, model: nn.Module, default_dir: str | os.PathLike[str],
              meta: dict[str, Any], scaler: torch.amp.GradScaler | None = None,
              trackers: Sequence[Any] = (), log_every: int | None = None) -> Monitor:
        """Make the Monitor (and detector) over ``model``, writing to ``store`` or, when that
        is ``None``, to ``default_dir`` (a free ``gradtap-<step>`` beside it when a resumed
        run would find the first run's store there). ``scaler``: the trainer's
        ``GradScaler`` under mixed precision (statistics of the unscaled gradients; a step
        the scaler skips is an overflow, not an anomaly to skip). ``trackers``: what the
        Monitor logs to (the trainer's loggers, or ``log_to``); ``log_every``: its cadence
        (``None``: only when :meth:`log_now` says)."""
        self.stop("finished")
        model = unwrap_model(model)
        state, self._pending_state = self._pending_state, None
        path = Path(self.store) if self.store is not None else Path(default_dir)
        if self.store is None and state is not None and (path / DB_NAME).exists():
            path = path.with_name(f"{path.name}-{int(state['step'])}")
        self._scaler = scaler
        self._loss = None
        if scaler is not None:  # the scale of each step, to unscale the loss without a sync
            self._loss_hooks = HookSet()
            self._loss_scale = self._loss_hooks.grad_scaler(scaler)
        self.monitor = Monitor(model, self.select, stats=self.stats, kinds=self.kinds,
                               ewma=self.ewma, hist_bins=self.hist_bins, every=self.every,
                               store=path, meta=meta, scaler=scaler,
                               log_to=list(trackers) or None,
                               log_every=log_every if trackers else None,
                               log_keys=self.log_keys if trackers else "summary",
                               log_groups=self.log_groups if trackers else None)
        if self.monitor._trackers is not None:  # the trainer logs its own loss, and may say when
            self.monitor._trackers.for_trainer(on_demand=log_every is None)
        if state is not None:
            self.monitor.load_state_dict(state)
        self._model_ids = {id(p) for p in model.parameters()}
        self._awaiting = False
        self._clips = HookSet()
        self._clips.around_any_clip(self._around_clip, _reraise)
        if self.detect:
            self.detector = detect(model, action="record", scaler=scaler,
                                   samples=self.detect == "samples")
            self._params = [p for p in model.parameters() if p.requires_grad]
        return self.monitor

    def note_batch(self, batch: Any) -> None:
        """A micro-batch starts: under ``detect="samples"``, its ``"sample_ids"`` (a batch
        that is a mapping with that key), for the anomalies of this optimizer step."""
        if self.detect == "samples":
            ids = batch.get("sample_ids") if isinstance(batch, Mapping) else None
            self._batch_ids.append(ids)

    def trackers(self, from_trainer: Sequence[Any]) -> list[Any]:
        """What the Monitor logs to: ``log_to``, or with the default the trainer's own."""
        if self.log_to is None:
            return []
        if isinstance(self.log_to, str) and self.log_to == TRAINER:
            return list(from_trainer)
        return list(self.log_to) if isinstance(self.log_to, (list, tuple)) else [self.log_to]

    def log_now(self, step: int) -> None:
        """Log the last computed step to the trackers at the trainer's step ``step``."""
        if self.monitor is not None and self.monitor._trackers is not None:
            self.monitor._trackers.log_last(step)

    def drain(self) -> None:
        """Wait until the trackers have taken the queued steps (before the trainer closes
        their writers)."""
        if self.monitor is not None and self.monitor._trackers is not None:
            self.monitor._trackers.drain()

    def optimizer_step(self, clips: bool = False) -> bool:
        """Close one Monitor step for the gradients about to be applied, then :meth:`verdict`.

        ``clips``: the trainer clips the gradients next; unless the step is skipped, the
        Monitor step is then taken right before the clip (:meth:`expect_clip`)."""
        if not clips:
            self.monitor_step()
            return self.verdict()
        assert self.monitor is not None
        self._last_step = self.monitor.steps_done
        skip = self.verdict()
        if skip:
            self.monitor_step()  # before the caller drops the gradients: nothing to clip
        else:
            self.expect_clip()
        return skip

    # The trainer's gradient clip (Lightning's gradient_clip_val, the Hugging Face Trainer's
    # max_grad_norm through Accelerate): the step is taken right before it, over the gradients
    # before the clip, and stores what the clip did.

    def expect_clip(self) -> None:
        """The gradients of this optimizer step are complete and the trainer clips next: the
        Monitor step is taken at the clip (or at :meth:`settle`, if none comes)."""
        self._awaiting = True

    def settle(self) -> None:
        """Take the step :meth:`expect_clip` left open when no clip came."""
        if self._awaiting:
            self._awaiting = False
            self.monitor_step()

    def _around_clip(self, clip: Clip) -> None:
        if not self._awaiting or self.monitor is None or not any(
                id(p) in self._model_ids for p in clip.parameters):
            clip.run()
            return
        self._awaiting = False
        self.monitor_step(clip)

    def add_loss(self, loss: torch.Tensor, *, scaled: bool = False) -> None:
        """Add one backward's share of the step's loss (as the trainer sums them); ``scaled``:
        it carries the grad scaler's factor (divided out on the device, no sync)."""
        value = loss.detach().to(torch.float64).reshape(())
        watch = self._loss_scale
        if scaled and watch is not None and watch.enabled:
            scale = watch.step_scale()
            if scale is not None:
                value = value / scale.to(value.device, torch.float64)
        self._loss = value if self._loss is None else self._loss + value.to(self._loss.device)

    def monitor_step(self, clip: Clip | None = None) -> None:
        """Close one Monitor step (the gradients of this optimizer step are complete), with the
        loss added since the last one; right before ``clip`` (run by the Monitor) if given."""
        assert self.monitor is not None
        self._last_step = self.monitor.steps_done
        loss, self._loss = self._loss, None
        if clip is None:
            self.monitor.step(loss=loss)
        else:
            self.monitor.step_clipped(clip, loss=loss)

    def verdict(self) -> bool:
        """Whether the detector found an anomaly since the last optimizer step, or the
        gradients hold a NaN/Inf (the caller skips the update); closes the detector's step.

        Under an enabled grad scaler a NaN/Inf in the gradients is an overflow: the scaler
        skips that optimizer step itself, so it is listed in :attr:`overflows` (and recorded
        by the Monitor and the detector), never skipped here.
        """
        if self.detector is None:
            return False
        # The detector names an origin when it saw one; the gradients themselves decide too,
        # since a trainer's step may make a NaN outside any call of the model.
        grads = [p.grad for p in self._params if p.grad is not None]
        nonfinite = bool(grads) and not bool(
            torch.stack([g.isfinite().all() for g in grads]).all())
        scaled = self._scaler is not None and self._scaler.is_enabled()
        skip = self.detector.should_skip() or (nonfinite and not scaled)
        # One micro-batch: its ids name the samples (with several, which one found the
        # anomaly is not known here: batch positions only).
        batches, self._batch_ids = self._batch_ids, []
        self.detector.step(sample_ids=batches[0] if len(batches) == 1 else None)
        if nonfinite and scaled:
            self.overflows.append(self._last_step)
        if skip:
            self.skipped.append(self._last_step)
        return skip

    @property
    def anomalies(self) -> list[Any]:
        live = [] if self.detector is None else list(self.detector.anomalies)
        return self._anomalies + live

    def state_dict(self) -> dict[str, Any]:
        """The Monitor's state (or the one waiting for it), for the trainer's checkpoint."""
        if self.monitor is not None:
            return {"monitor": self.monitor.state_dict(), "skipped": list(self.skipped),
                    "overflows": list(self.overflows)}
        if self._pending_state is not None:
            return {"monitor": self._pending_state, "skipped": list(self.skipped),
                    "overflows": list(self.overflows)}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep ``state`` for the Monitor made when training starts."""
        if not state:
            return
        if self.monitor is not None:
            raise RuntimeError("the gradtap callback's state must be loaded before training "
                               "starts")
        self._pending_state = state["monitor"]
        self.skipped = list(state.get("skipped", []))
        self.overflows = list(state.get("overflows", []))

    def stop(self, status: str) -> None:
        """Close the Monitor, keeping its state for a checkpoint written afterwards."""
        if status == "finished" and self.monitor is not None:
            self.settle()
        if self.monitor is not None:
            self._pending_state = self.monitor.state_dict()
        if self.detector is not None:
            self._anomalies += self.detector.anomalies
            self.detector.remove()
            self.detector = None
            run = None if self.monitor is None else self.monitor.run  # rank 0's store
            if run is not None:  # beside the statistics, for the report
                write_anomalies(run.path, self._anomalies, source=ANOMALY_SOURCE)
        if self._clips is not None:
            self._clips.remove()
            self._clips = None
            self._awaiting = False
        if self._loss_hooks is not None:
            self._loss_hooks.remove()
            self._loss_hooks = self._loss_scale = None
        if self.monitor is not None:
            self.monitor.close(status)
            self.monitor = None


def _reraise(exc: BaseException) -> None:
    raise exc


class CallbackViews:
    """What both frameworks' ``GradtapCallback`` show of their :class:`CallbackCore`."""

    _core: CallbackCore

    @property
    def monitor(self) -> Monitor | None:
        """The Monitor while training runs (``None`` before and after)."""
        return self._core.monitor

    @property
    def anomalies(self) -> list[Any]:
        """Anomalies found with ``detect=True`` (:class:`gradtap.Anomaly`)."""
        return self._core.anomalies

    @property
    def skipped(self) -> list[int]:
        """Steps whose optimizer update was skipped (``detect=True``)."""
        return list(self._core.skipped)

    @property
    def overflows(self) -> list[int]:
        """Steps the grad scaler skipped for an inf/NaN gradient (``detect=True``)."""
        return list(self._core.overflows)
