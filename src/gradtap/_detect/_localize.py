"""Naming the origin of what the screen found: the step replayed under a fresh per-call watch.

For a non-finite value, the replay's watch names where it first appeared; when the replay
cannot show it (it failed, or the state changed since the call), the report is built from the
screen's own evidence. For a parameter-gradient spike, the replay names the first spiking
module in backward order and carries its call's record; not reproduced, the spike is still
reported from ``.grad``. Either way, one event per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

from gradtap._detect import _culprits
from gradtap._detect._anomaly import LOSS
from gradtap._detect._measure import Plan, innermost
from gradtap._detect._messages import Found, param_spike_anomaly, unreproduced_anomaly
from gradtap._detect._replay import replay as replay_step
from gradtap._detect._screen import RootCall, Screen, Suspect
from gradtap._detect._spikes import ParamSpikes, Spike
from gradtap._detect._watch import CallWatch, WatchOptions
from gradtap._samples.calls import BatchSplitError
from gradtap._types import Selector
from gradtap.capture import compiled_feature, session
from gradtap.errors import UnsupportedModuleError

__all__ = ["Localizer"]


class Localizer:
    """Replays the step ``screen`` kept to find where what it saw came from.

    ``model`` and ``select`` are the Detector's (a fresh watch selects again); ``modules`` is
    every module by name, ``selected`` the names that may be reported. ``batch_dim``: name
    the samples of each anomaly along that dim (``samples=True``), else ``None``; a failure
    to split the batch is kept in :attr:`sample_error` (the anomaly is still reported)."""

    def __init__(self, model: nn.Module, select: Selector, screen: Screen, *,
                 options: WatchOptions, keep_forward: bool, sharded: bool,
                 modules: dict[str, nn.Module], selected: set[str],
                 batch_dim: int | None = None) -> None:
        self._model, self._select, self._screen = model, select, screen
        self._options = options
        self._batch_dim = batch_dim
        self.sample_error: BatchSplitError | None = None
        # The samples are read from the replay's tensors: its watch keeps every call's.
        self._keep_forward = keep_forward or batch_dim is not None
        self._sharded = sharded
        self._modules, self._selected = modules, selected

    def nonfinite(self, suspects: list[Suspect], backward: list[RootCall], step: int
                  ) -> tuple[list[Found], list[Found]]:
        """Replay the step under a fresh per-call watch to find where the suspects came from:
        ``(found by the replay, made from the screen's evidence)``, one of them empty.

        A bad loss is checked after a replay of the forward alone: its gradient would only
        repeat it."""
        loss = next((s.tensor for s in suspects if s.where == "loss"), None)
        if loss is not None:
            backward = []
        watch = self._watch(self._options, step)
        failure: BaseException | None = None
        try:
            self._replay(watch, backward)
            if loss is not None:
                watch.add_loss(loss)
            watch.check_forward()
        except Exception as err:  # noqa: BLE001 - reported with the screen's evidence below
            failure = err
        finally:
            watch.remove()
        # One event per step: the first finding (later top-level calls of a model used
        # through its methods replay what arrived from it).
        found = watch.found[:1]
        first = suspects[0]
        if found and first.where == "forward" and (found[0].anomaly.where != "forward"
                                                   or found[0].anomaly.module_name == LOSS):
            # The screen saw a module's output go bad, the replay did not (state changed
            # since the call): the screen's evidence is the better report.
            found = []
        self._one_event_per_step()
        if found:
            return [self._samples(found[0], lambda n, bd: _culprits.nonfinite_samples(
                found[0], self._screen, n, bd, self._modules))], []
        made = unreproduced_anomaly(step, first, failure, self._modules, self._selected)
        if self._batch_dim is not None:  # the replay did not show it: no sample to name
            made = _culprits.attach(made, [], note="not found (the replay did not show it)")
        return [], [made]

    def spike(self, spikes: list[Spike], tracker: ParamSpikes, backward: list[RootCall],
              step: int) -> list[Found]:
        """Replay the step under a per-call watch to name the first spiking module in backward
        order (innermost) and show its call's record, grad_outputs included."""
        watch = self._watch(WatchOptions(eager_on_cpu=False), step)
        watch.plans = []
        try:
            self._replay(watch, backward)
            watch.check_forward()
        except Exception:  # noqa: BLE001 - the spike is still reported, from .grad
            watch.plans = []
            watch.found = []
        finally:
            watch.remove()
        plans = watch.plans
        spiking = {s[1]: s for s in spikes}
        self._one_event_per_step()
        # A NaN/Inf in the gradients that the parameter gradients did not show is reported
        # instead; one in a forward input (a causal mask's -inf) is no spike's cause.
        found = [f for f in watch.found if f.anomaly.where != "forward"]
        if found:
            return found
        order = [(i, p) for i, p in enumerate(plans) if p.name in spiking and p.rec is not None]
        first = innermost(order, lambda ip: ip[1].name)
        if first:
            _, plan = first[0]
            name = plan.name
            note = _replay_note(plan)
        else:  # not reproduced (e.g. gradients accumulated over several backwards)
            name = innermost(spikes, lambda s: s[1])[0][1]
            plan, note = None, ("the replay of this backward did not show this module's call: "
                                "its norm is that of .grad at the end of the backward")
        module = self._modules[name]
        own = [n for n, _ in module.named_parameters(recurse=False)]
        anomaly = param_spike_anomaly(step, plan, name, tracker.hits[name], tracker.spike,
                                      tracker.baseline(name), module=(type(module).__name__, own),
                                      note=note)
        made = Found(anomaly, None if plan is None else (name, plan.call), module)
        if plan is None and self._batch_dim is not None:
            return [_culprits.attach(made, [], note="not found (the replay did not show this "
                                                     "module's call)")]
        params = [p.strip() for p in anomaly.slot.split(",") if p.strip()]
        return [self._samples(made, lambda n, bd: _culprits.spike_samples(
            plans, name, params, n, bd, module))]

    def _samples(self, found: Found, name_them: Callable[[int, int], Any]) -> Found:
        """``found`` with the samples ``name_them(batch size, batch_dim)`` names (a list, or
        ``(list, norms)``); unchanged without ``samples=True``."""
        bd = self._batch_dim
        if bd is None:
            return found
        try:
            n = _culprits.batch_of(self._screen, bd)
            got = [] if n is None else name_them(n, bd)
        except (BatchSplitError, UnsupportedModuleError, ValueError) as err:
            self.sample_error = BatchSplitError(
                f"detect(samples=True) could not name the samples of the {found.anomaly.kind} "
                f"at module {found.anomaly.module_name!r} (step {found.anomaly.step}; it is "
                f"recorded in det.anomalies): {err}. Pass the dim that indexes samples as "
                "batch_dim= (1 for a time-major model), or leave samples off for a model that "
                "folds its samples together")
            return _culprits.attach(found, [], note=f"not named ({err})")
        if isinstance(got, tuple):
            return _culprits.attach(found, *got)
        return _culprits.attach(found, got)

    def _watch(self, options: WatchOptions, step: int) -> CallWatch:
        with compiled_feature(None):  # a replay runs eagerly, and says nothing
            return CallWatch(self._model, session(self._model).modules(self._select),
                             keep_forward=self._keep_forward, options=options, step=step)

    def _replay(self, watch: CallWatch, backward: list[RootCall]) -> None:
        if self._sharded:
            raise RuntimeError("not replayed: the model's parameters are sharded (FSDP2), and "
                               "its forward's all-gathers would wait for the other ranks")
        replay_step(self._screen, watch, backward)

    def _one_event_per_step(self) -> None:
        """Later checks of this step would see its consequences: report none of them."""
        self._screen.quiet_params = True
        for call in self._screen.calls:
            call.reported = True


def _replay_note(plan: Plan) -> str:
    """What the replay shows of the gradient reaching the module (no EWMA for it)."""
    rec = plan.rec
    assert rec is not None
    out = [g for g in rec.grad_outputs.values() if g is not None]
    if not out:
        return "found by a replay of the step"
    norm = math.sqrt(sum(float(g.detach().double().square().sum()) for g in out))
    return (f"found by a replay of the step: the gradient reaching its output "
            f"(grad_output) has norm {norm:.4g} in this step; the default watch keeps no "
            f"history of it (replay=False does): compare it with other steps' reports")
