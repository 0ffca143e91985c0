"""The detector: a screen or a per-call watch each step, a replay to localize, anomalies emitted.

``gt.detect(model)`` screens every step cheaply (:class:`~gradtap._detect._screen.Screen`)
and replays a step found non-finite (:func:`~gradtap._detect._replay.replay`) under a fresh
per-call watch (:class:`~gradtap._detect._watch.CallWatch`), which names the origin
(:class:`~gradtap._detect._localize.Localizer`). With ``spike=`` the screen's check also
reads every module's parameter-gradient norm (:class:`~gradtap._detect._spikes.ParamSpikes`)
and a spiking step is replayed to name the module. ``replay=False`` uses the per-call watch
every step instead, with a :class:`~gradtap._detect._spikes.SpikeTracker` for spikes. The
reports themselves are built by :mod:`gradtap._detect._messages`; the options are checked by
:mod:`gradtap._detect._options`. The :class:`Detector` holds only what ties these together:
the step number, the anomalies and how they are emitted (raised, warned, dumped, and under
``torch.distributed`` agreed between ranks: :mod:`gradtap._detect._ranks`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from gradtap._detect._anomaly import Anomaly, AnomalyWarning
from gradtap._detect._culprits import batch_of, ids_of
from gradtap._detect._dump import write_dump
from gradtap._detect._localize import Localizer
from gradtap._detect._messages import Found
from gradtap._detect._options import ActionLiteral, ScreenLiteral, check_options, check_samples
from gradtap._detect._ranks import exchange
from gradtap._detect._screen import RootCall, Screen, Suspect
from gradtap._detect._spikes import ParamSpikes, SpikeTracker
from gradtap._detect._watch import CallWatch, WatchOptions
from gradtap._tensorops.sharded import is_sharded, world
from gradtap._tensorops.spikes import THRESHOLD, WARMUP
from gradtap._types import Selector
from gradtap.capture import HookSet, ScalerWatch, check_scaler, compiled_feature, session
from gradtap.errors import GradientAnomaly
from gradtap.select import unwrap_model

__all__ = ["Detector", "detect"]


class Detector:
    """Finds where gradients break; see :func:`detect`. Use as a context manager.

    ``options`` tunes how the per-call watch measures records (:class:`WatchOptions`).
    """

    def __init__(
        self,
        model: nn.Module,
        select: Selector = "*",
        *,
        nonfinite: bool = True,
        spike: float | bool | None = None,
        warmup: int | None = None,
        action: ActionLiteral = "raise",
        dump_dir: str | os.PathLike[str] | None = None,
        replay: bool | None = None,
        screen: ScreenLiteral | None = None,
        options: WatchOptions | None = None,
        scaler: torch.amp.GradScaler | None = None,
        samples: bool = False,
        batch_dim: int = 0,
    ) -> None:
        sess = session(model, "detect()")
        # Under DDP the inner module is watched and replayed (its forward has no collectives);
        # a compiled model keeps its wrapper (the screen's hooks stay outside compiled code).
        model = unwrap_model(model, keep_compiled=True)
        check_scaler(scaler, "detect")
        replays = check_options(action=action, spike=spike, warmup=warmup,
                                nonfinite=nonfinite, replay=replay, screen=screen)
        check_samples(samples, batch_dim, replays)
        self.samples = bool(samples)
        self.batch_dim = int(batch_dim)
        self.dump_dir = None if dump_dir is None else os.fspath(dump_dir)
        if self.dump_dir is not None:
            if os.path.exists(self.dump_dir) and not os.path.isdir(self.dump_dir):
                raise ValueError(f"dump_dir={self.dump_dir!r} exists and is not a directory")
            os.makedirs(self.dump_dir, exist_ok=True)
        self.nonfinite = bool(nonfinite)
        self.spike = (None if spike is None or spike is False
                      else THRESHOLD if spike is True else float(spike))
        self.warmup = WARMUP if warmup is None else int(warmup)
        self.action: ActionLiteral = action
        self.anomalies: list[Anomaly] = []

        # A compiled model keeps its wrapper (the screen's hooks stay outside compiled code);
        # names are those of the model it compiles.
        selected = sess.modules(select)  # SelectionError naming close names
        options = options or WatchOptions()
        self._selected = {name for name, _ in selected}
        self._modules: dict[str, nn.Module] = dict(sess.root.named_modules())
        self._step = 0
        self._skip = False
        self._rank, self._world = world()
        self._agreed = False  # this step's one collective (distributed) is done
        self._held: list[Anomaly] = []  # found this step, raised or warned at the agreement
        # FSDP2 all-gathers parameters in the forward: a replay on one rank would wait for
        # the others forever, so a sharded model's anomalies are reported from the screen.
        self._sharded = any(is_sharded(p) for p in model.parameters())
        self._found: list[Found] = []  # made from the screen's evidence, not yet emitted
        self._ready: list[Found] = []  # found by a replay, not yet emitted
        self._spikes = SpikeTracker(self.spike, self.warmup)
        self._hooks = HookSet()
        self._hooks.add_cleanup(sess.attach().detach)
        self._amp: ScalerWatch | None = sess.scaler(scaler, "detect()")
        if self._amp is not None:
            self._spikes.scale_of = self._scale
        self._param_spikes: ParamSpikes | None = None
        self._screen: Screen | None = None
        self._localizer: Localizer | None = None
        self._watch: CallWatch | None = None
        if replays:
            self._screen = Screen(model, selected if screen == "modules" else [])
            self._screen.on_backward_end = self._screened_backward
            self._localizer = Localizer(model, select, self._screen, options=options,
                                        keep_forward=self.dump_dir is not None,
                                        sharded=self._sharded, modules=self._modules,
                                        selected=self._selected,
                                        batch_dim=self.batch_dim if self.samples else None)
            if self.spike is not None:
                # With the default selection the model's own parameters (a position table,
                # a class token) are watched too: they belong to no submodule.
                root = [("", model)] if select == "*" and all(n for n, _ in selected) else []
                self._param_spikes = ParamSpikes(root + list(selected), self.spike, self.warmup)
                self._screen.norms_mode = True
            return
        # The model itself is always watched: its grad_outputs are dL/d(model output), the
        # gradient coming from the loss, and it catches what unselected code does.
        with compiled_feature("detect(replay=False)"):
            self._watch = CallWatch(model, selected, nonfinite=self.nonfinite,
                                    keep_forward=self.dump_dir is not None,
                                    spikes=self._spikes if self.spike is not None else None,
                                    options=options)
        self._watch.on_backward_end = self._emit

    # -- public -------------------------------------------------------------------------------

    @property
    def steps_done(self) -> int:
        """Number of :meth:`step` calls so far (the current step's number)."""
        return self._step

    def check_loss(self, loss: Tensor) -> Tensor:
        """Have ``loss`` checked with the forward; returns ``loss``.

        A non-finite loss is reported as module ``"<loss>"`` (``where="forward"``) when the
        model's forward was finite. Without it, a non-finite loss is only seen if its gradient
        is non-finite too (``where="grad_output"``).

        The default (replay) watch adds the loss to the step's one check at the end of the
        backward (or at :meth:`step`, :meth:`should_skip`, :meth:`check` when no backward
        comes): no host sync here. The per-call watch (``replay=False``) checks the forward
        and the loss now, before the backward: the forward's one host sync, while every
        forward tensor saved for backward is still there.

        Raises:
            TypeError: ``loss`` is not a tensor.
            GradientAnomaly: with ``action="raise"``, if the forward or the loss is bad.
        """
        if not isinstance(loss, Tensor):
            raise TypeError(f"check_loss() needs a Tensor; got {type(loss).__name__}")
        if self._screen is not None:
            self._screen.add_loss(loss)
        elif self.nonfinite:
            self._watch.add_loss(loss)  # type: ignore[union-attr]
            self._check_forward()
            self._emit()
        return loss

    def should_skip(self) -> bool:
        """True when an anomaly was found since the last :meth:`step`: skip the optimizer step.

        Under ``torch.distributed`` (DDP, FSDP2) ranks agree: true on every rank when any rank
        found one (one all-reduce of ``world_size`` numbers per step, here or in :meth:`step`).

        Raises:
            GradientAnomaly: with ``action="raise"`` under ``torch.distributed``, on every rank
                when any rank found one (raised here, on all ranks at once, not from the
                backward of one rank).
        """
        if self._pending_forward():
            self._check_forward()
            self._emit()
        if self._param_spikes is not None:
            self._check_unscreened_backward()
            self._emit()
        self._agree()
        return self._skip

    def check(self) -> list[Anomaly]:
        """Check now what ran since the last check (e.g. a forward with no backward yet).

        Returns:
            The anomalies found by this call (also appended to :attr:`anomalies`).

        Raises:
            GradientAnomaly: with ``action="raise"``, for the first one.
        """
        before = len(self.anomalies)
        self._check_forward()
        self._emit()
        return self.anomalies[before:]

    def _pending_forward(self) -> bool:
        if self._screen is not None:
            return self._screen.unchecked()
        return self._watch is not None and self._watch.pending_forward()

    def step(self, sample_ids: Sequence[int | str] | Tensor | None = None) -> None:
        """Close the current step: check what is pending, add the spike norms to their histories, advance.

        Call it once per training step, after ``backward()``. Steps count from 0.

        Args:
            sample_ids: with ``samples=True``, one id per row of this step's batch (dataset
                indices, file names; a list, or a 1-D integer tensor): each of this step's
                anomalies gets :attr:`Anomaly.sample_ids`, the ids of its ``samples``. Under
                ``action="raise"`` the anomaly is raised from ``backward()``: call
                ``det.step(sample_ids=ids)`` in the handler to have them in
                :attr:`anomalies`.

        Raises:
            GradientAnomaly: with ``action="raise"``, if a forward without backward was bad
                (the step still advances).
            ValueError: ``sample_ids`` without ``samples=True``, or, on a step with an
                anomaly, not one id per batch row (the step is closed all the same).
            TypeError: on a step with an anomaly, ids that are not a sequence of ints and
                strs.
        """
        if sample_ids is not None and not self.samples:
            raise ValueError("det.step(sample_ids=...) names the samples of anomalies: pass "
                             "samples=True to gt.detect")
        try:
            self._check_forward()
            self._check_unscreened_backward()
            self._emit()
            self._agree()
        finally:
            bad_ids: Exception | None = None
            if sample_ids is not None:
                try:
                    self._name_ids(sample_ids)
                except (ValueError, TypeError) as err:  # raised once the step is closed
                    bad_ids = err
            self._agreed = False
            self._held = []
            if self._watch is not None:
                self._spikes.close_step()
            if self._param_spikes is not None:
                self._param_spikes.close_step()
            self._skip = False
            self._step += 1
            if self._watch is not None:
                self._watch.new_step(self._step)
            if self._screen is not None:
                self._screen.new_step()
        if bad_ids is not None:
            raise bad_ids

    def spike_baseline(self, name: str,
                       kind: Literal["param_grad", "grad_output"] = "param_grad"
                       ) -> dict[str, float]:
        """The baseline norms the spike check compares module ``name``'s next norms with.

        Under the default watch, one per direct parameter of the module (by parameter name;
        kind ``"param_grad"`` only); under ``replay=False``, the module's ``kind`` norm, by
        ``kind``. A norm with fewer than two values of history has none.

        Raises:
            KeyError: ``spike`` is off, or no such module/kind has a baseline yet.
        """
        tracker = self._param_spikes
        if tracker is None:
            return {kind: self._spikes.baseline(name, kind)}
        found = tracker.baseline(name) if kind == "param_grad" else {}
        if not found:
            if kind == "grad_output":
                raise KeyError(f"no spike baseline for module {name!r} kind 'grad_output': "
                               "the default watch scores parameter-gradient norms only (pass "
                               "replay=False for grad_output baselines)")
            have = [n for n in tracker.names if tracker.baseline(n)]
            raise KeyError(f"no spike baseline for module {name!r} kind {kind!r}; have: "
                           f"{', '.join(f'{n}:param_grad' for n in have[:10]) or '(none: call step())'}")
        return found

    def _name_ids(self, sample_ids: object) -> bool:
        """This step's anomalies with the ids of their samples. The ids are read and checked
        against the step's batch only when the step has such an anomaly: a healthy step
        does not look at them (no copy of an id tensor to the host)."""
        mine = [i for i, a in enumerate(self.anomalies)
                if a.step == self._step and a.samples is not None]
        if not mine:
            return False
        n = None if self._screen is None else batch_of(self._screen, self.batch_dim)
        ids = ids_of(sample_ids, n, self.batch_dim)
        for i in mine:
            a = self.anomalies[i]
            bad = [j for j in a.samples or () if j >= len(ids)]
            if bad:
                raise ValueError(f"sample_ids has {len(ids)} ids, but the anomaly at module "
                                 f"{a.module_name!r} names batch position {bad[0]}")
            self.anomalies[i] = dataclasses.replace(
                a, sample_ids=tuple(ids[j] for j in a.samples or ()))
        return True

    def remove(self) -> None:
        """Remove every hook; the model is left as it was. Safe to call twice."""
        self._hooks.remove()
        if self._watch is not None:
            self._watch.remove()
        if self._screen is not None:
            self._screen.remove()

    def __enter__(self) -> Detector:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None:
                self._check_forward()
                self._emit()
        finally:
            self.remove()

    def __repr__(self) -> str:
        return (f"<Detector step={self._step} modules={len(self._selected)} "
                f"anomalies={len(self.anomalies)} action={self.action!r}>")

    # -- checks -------------------------------------------------------------------------------

    def _check_forward(self) -> None:
        if self._watch is not None:
            self._watch.check_forward()
        elif self._screen is not None and self._screen.unchecked():
            suspects = self._screen.check()
            if suspects and self.nonfinite:
                self._localize(suspects, [])

    def _check_unscreened_backward(self) -> None:
        """The parameter gradients' check when no backward reached a screened tensor this step
        (none ran, only a loss on an intermediate, or a model used through methods that call
        no child, only its own parameters): once a step."""
        screen = self._screen
        if screen is None or screen.backward_checked:
            return
        if screen.calls or screen.params.any_grad():
            suspects = screen.check(backward=True, stale=True)
            self._after_check(suspects, [])

    def _screened_backward(self, backward: list[RootCall]) -> None:
        """End of a backward that reached a screened output: one check, a replay if bad."""
        assert self._screen is not None
        for c in backward:
            if c.reported:
                break  # consequences of a reported forward
        else:
            suspects = self._screen.check(backward=True)
            self._after_check(suspects, backward)
        self._emit()

    def _after_check(self, suspects: list[Suspect], backward: list[RootCall]) -> None:
        """After a check of the parameter gradients: a replay for a non-finite value, else
        the spike check of the parameter-gradient norms read with it."""
        assert self._screen is not None
        if suspects and self.nonfinite:
            self._localize(suspects, backward)
            return
        found = self._screen.param_norms
        if self._param_spikes is None or found is None or self._screen.quiet_params:
            return
        params, norms = found
        if self._amp is not None:  # the norms of the unscaled gradients (g / scale)
            norms = norms / self._scale()
        spikes = self._param_spikes.check(params, norms)
        if spikes:
            assert self._localizer is not None
            self._ready.extend(self._localizer.spike(spikes, self._param_spikes, backward,
                                                     self._step))

    def _localize(self, suspects: list[Suspect], backward: list[RootCall]) -> None:
        """Replay the step to find where the suspects came from (:class:`Localizer`)."""
        assert self._localizer is not None
        ready, found = self._localizer.nonfinite(suspects, backward, self._step)
        self._ready.extend(ready)
        self._found.extend(found)

    # -- emitting -----------------------------------------------------------------------------

    def _emit(self) -> None:
        if not self._ready and not self._found and (self._watch is None or not self._watch.found):
            return  # nothing found: the usual step
        try:
            self._emit_found()
        finally:
            error = None if self._localizer is None else self._localizer.sample_error
            if error is not None:  # the anomaly is recorded; the batch did not split
                self._localizer.sample_error = None  # type: ignore[union-attr]
                raise error

    def _emit_found(self) -> None:
        found = self._ready + (self._watch.found if self._watch is not None else []) + self._found
        self._ready, self._found = [], []
        if self._watch is not None:
            self._watch.found = []
        new = []
        for f in found:
            anomaly = self._as_overflow(f.anomaly)
            if self._rank:
                anomaly = dataclasses.replace(anomaly, rank=self._rank)
            if self.dump_dir is not None:
                anomaly = write_dump(self.dump_dir, anomaly, len(self.anomalies), f.module, f.kept)
            self.anomalies.append(anomaly)
            if anomaly.kind != "overflow":  # the scaler skips that step itself: recorded only
                new.append(anomaly)
        if not new:
            return
        self._skip = True
        if self._world > 1:  # raised or warned on every rank at once, at the agreement
            self._held.extend(new)
            return
        self._act(new)

    def _act(self, new: list[Anomaly]) -> None:
        if self.action == "raise":
            raise GradientAnomaly(new[0].message, new[0])
        if self.action == "warn":
            for a in new:
                warnings.warn(a.message, AnomalyWarning, stacklevel=4)

    def _agree(self) -> None:
        """Under ``torch.distributed``, once a step: every rank learns which ranks found an
        anomaly (the kind, ``where`` and module of each one's first), in one all-reduce (max)
        of ``world_size`` numbers (:func:`~gradtap._detect._ranks.exchange`); each rank records
        one anomaly per other finding rank, skips, and raises or warns."""
        if self._world < 2 or self._agreed:
            return
        self._agreed = True
        remote = exchange(self._held, self._rank, self._world, self._step, self._modules)
        self.anomalies.extend(remote)
        new, self._held = self._held + remote, []
        if new:
            self._skip = True
            self._act(new)

    def _scale(self) -> float:
        """The grad scaler's scale of this step (1.0 when it is disabled)."""
        assert self._amp is not None
        scale = self._amp.step_scale()
        return 1.0 if scale is None else float(scale)

    def _as_overflow(self, anomaly: Anomaly) -> Anomaly:
        """Under a grad scaler, a NaN/Inf in the gradients is an overflow: the scaler finds it,
        skips the optimizer step and lowers the scale."""
        if (self._amp is None or not self._amp.enabled or anomaly.where == "forward"
                or anomaly.kind not in ("nan", "inf")):
            return anomaly
        message = (f"gradient overflow at step {anomaly.step} under the grad scaler (scale "
                   f"{self._scale():g}): the scaler skips this optimizer step and lowers its "
                   f"scale; where the {'NaN' if anomaly.kind == 'nan' else 'Inf'} "
                   f"first appeared:\n{anomaly.message}")
        return dataclasses.replace(anomaly, kind="overflow", message=message)


def detect(
    model: nn.Module,
    select: Selector = "*",
    *,
    nonfinite: bool = True,
    spike: float | bool | None = None,
    warmup: int | None = None,
    action: ActionLiteral = "raise",
    dump_dir: str | os.PathLike[str] | None = None,
    replay: bool | None = None,
    screen: ScreenLiteral | None = None,
    scaler: torch.amp.GradScaler | None = None,
    samples: bool = False,
    batch_dim: int = 0,
) -> Detector:
    """Find where gradients break: the module where a NaN/Inf first appears, and spikes.

    Lasts across steps: call ``det.step()`` once per training step, after ``backward()``.
    What is reported (one anomaly per event, at its origin, the innermost module):

    * forward: the first selected call, in the order calls finish, whose output holds
      NaN/Inf while all its floating inputs and parameters were finite (``where="forward"``,
      slot = output key). A parameter that is already non-finite is reported as the slot; a
      non-finite value arriving from outside the selected modules at the first module that
      received it (slot = input key).
    * the loss, as module ``"<loss>"``: with ``det.check_loss(loss)`` when its value is
      non-finite (``where="forward"``), and always when dL/d(model output) is non-finite
      (``where="grad_output"``).
    * backward (only if the forward and loss were finite): the first module, in backward
      order, whose ``grad_inputs`` or ``param_grads`` hold NaN/Inf while its ``grad_outputs``
      were finite.
    * spikes (``spike=``): under the default watch, each direct parameter's gradient norm
      of each selected module, scored against that tensor's own history by the detector of
      ``Run.spikes()`` (``docs/semantics.md``, "Gradient spikes": a robust z-score of the
      log-norm against a trend-following baseline, the step's common deviation taken out),
      reported when the score exceeds ``spike`` once the tensor's history has ``warmup``
      values; with ``replay=False``, each module's parameter-gradient norm (its direct
      parameters together) and grad-output norm, scored alike. NaN, Inf and zero norms are
      not scored and never enter a history; one spike is reported per event (the first
      spiking module in backward order, innermost, ``slot`` naming its spiking parameters),
      and a tensor flagged in a step is not reported again in that step.

      The default watch reads the norm of each selected module's direct parameters' ``.grad``
      at the end of each backward (one batched norm, read with the screen's one host copy;
      no hook on any call), scores them on the host, and adds them to the histories in
      ``det.step()``. Only when a norm spikes is the step replayed under the per-call watch:
      the report names the first spiking module in backward order and carries its call's
      record, whose grad_output is the gradient that reached it in this step (its norm is in
      the message). That grad_output has no history to be compared with (keeping one would
      need a hook on every call every step), so under the default watch a grad_output spike
      is never reported on its own: a large gradient arriving at a module shows as its
      parameters' spike, with the grad_output in its report. ``replay=False`` keeps
      grad_output histories and reports grad_output spikes (``where="grad_output"``), at
      per-call cost. The default watch's norm is that of ``.grad`` (with weight sharing, of
      the summed gradient; with gradient accumulation over backwards in one step, of the
      total); the per-call watch's adds each call's squared norms.

    Two ways to watch (``replay=``):

    * **replay** (the default, with or without ``spike``): a light screen, then a replay. Each
      step the screen reduces on the device the model's outputs, the loss given to
      ``check_loss``, the gradients reaching the model's outputs and leaving its inputs, and
      every parameter gradient, and reads them in one host copy at the end of the backward;
      nothing else is hooked and no record is made. ``screen="modules"`` also screens every
      selected call's outputs and the gradients reaching them (small tensors by reference, all
      at once): slower, but it also sees a NaN/Inf that vanishes before it reaches any
      parameter gradient, such as the Inf gradient of a sqrt at 0 that a ReLU before it masks
      (harmless to that step's update, so the default screen lets it pass). Only when
      something is non-finite is the step's forward and backward run again, with the same
      arguments, RNG and autocast state and the very gradients that reached the model's
      outputs, under the per-call watch below, which names the origin. The replay restores
      buffers and RNG state, leaves ``.grad`` alone, and other taps do not see it. It cannot
      replay a forward that depends on other state or a gradient entering the model other
      than through its outputs: such an anomaly is still reported, from what the screen saw,
      saying so.
    * **per-call watch** (``replay=False``): every selected call
      is captured as it runs (device-side min/max of forward tensors, norms of every
      gradient of its record), with two host syncs per step: one for the forward (at
      ``det.check_loss(loss)``, else when the backward starts) and one when the backward
      ends. Slower, but the model never runs twice.

    Forward tensors are kept only with ``dump_dir``.

    Args:
        model: the model to watch (the model itself is always watched too, to see the loss's
            gradient and what unselected code does).
        select: which modules may be reported (glob, list, class, predicate).
        nonfinite: look for NaN/Inf.
        spike: the score above which a norm is a spike: ``True`` for the default (6.0, as
            ``Run.spikes()``), a number for another; ``None`` or ``False``: off.
        warmup: values of a norm's history before it is scored (``None``: 20, as
            ``Run.spikes()``).
        action: ``"raise"`` :class:`~gradtap.GradientAnomaly` (from ``backward()`` or
            ``step()``), ``"warn"`` (:class:`AnomalyWarning`) or ``"record"`` silently.
        dump_dir: write one dump file per anomaly there (see :func:`load_dump`).
        replay: ``None`` or ``True``: the screen, and a replay after an anomaly; ``False``:
            the per-call watch (for a forward with side effects that must not run twice, or
            for grad_output spikes).
        screen: what the replay watch screens each step: ``"model"`` (the default) or
            ``"modules"`` (every selected call too); only with the replay watch.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision run. Spike norms and their
            histories are then those of the unscaled gradients (``g / scale``), and a NaN/Inf in
            the gradients (not in the forward or the loss value) is an anomaly of kind
            ``"overflow"``: the scaler finds it, skips the optimizer step and lowers its
            scale, so it is recorded in :attr:`anomalies` (its origin named as for an Inf)
            but never raised or warned, and ``should_skip()`` stays false (call
            ``scaler.step`` as usual: it skips the step and ``scaler.update()`` needs it).
        samples: name the samples behind each anomaly (:attr:`Anomaly.samples`, batch
            positions, worst first; ``det.step(sample_ids=ids)`` gives them the user's ids):
            the rows of the first non-finite forward tensor that hold a NaN/Inf, the samples
            whose own gradient at the origin is non-finite, or those whose per-sample
            gradient norm in the spiking tensors is far above the batch's
            (``docs/semantics.md``, "Which samples did it"). Found in the replay of the bad
            step only (a healthy step costs the same); only with the replay watch. A batch
            that does not split into samples along ``batch_dim`` raises ``BatchSplitError``
            (a ``ValueError``) after the anomaly is recorded.
        batch_dim: the dim of the model's inputs and activations that indexes samples
            (``1`` for a time-major model whose tensors are ``[T, N, ...]``).

    Returns:
        A :class:`Detector`: ``.anomalies``, ``.step()``, ``.should_skip()``,
        ``.check_loss(loss)``, ``.check()``, ``.spike_baseline(name, kind)``, ``.remove()``.

    Raises:
        SelectionError: ``select`` matched no module.
        ValueError: a bad ``action``, ``spike``, ``warmup``, ``dump_dir``, ``replay``,
            ``screen``, ``samples`` or ``batch_dim``, or ``screen`` or ``samples`` with the
            per-call watch.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> with gt.detect(net, action="record") as det:
        ...     net[0].bias.data[1] = float("nan")
        ...     net(torch.randn(2, 4)).sum().backward()
        ...     skip = det.should_skip()
        ...     det.step()
        >>> a = det.anomalies[0]
        >>> (a.module_name, a.kind, a.where, a.slot, skip)
        ('0', 'nan', 'forward', 'bias', True)
    """
    return Detector(model, select, nonfinite=nonfinite, spike=spike, warmup=warmup,
                    action=action, dump_dir=dump_dir, replay=replay, screen=screen,
                    scaler=scaler, samples=samples, batch_dim=batch_dim)
