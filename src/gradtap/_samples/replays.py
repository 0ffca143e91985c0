"""Per-sample gradients from replays of enclosing calls, for parameters no call of their own split.

At the end of a backward, the parameters whose calls were flagged in the forward, found late
in backward, or failed the sum check (``check``) are replayed: the candidates are the modules
whose kept calls enclose every use of the parameter, innermost first
(``units.candidates``); parameters that share a candidate are replayed together, and a replay
whose result does not add up to the ``.grad`` increment moves on to the next candidate. A
parameter no candidate works for fails, and reading the results names it; each replay warns
once per module and replayed call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from gradtap._samples.accumulate import Step, Totals
from gradtap._samples.fallback import CannotReplay
from gradtap._samples.owners import describe
from gradtap._samples.sketch import pair
from gradtap._samples.spec import Spec
from gradtap._samples.units import Frame, candidates, frames_of, mismatches, replay_frames

__all__ = ["Replays"]


class Replays:
    """Replays of enclosing calls, and which (module, replayed call) pairs warned already."""

    def __init__(self, spec: Spec) -> None:
        self._spec = spec
        self._warned: set[tuple[str, str]] = set()

    def run(self, bad: dict[str, tuple[str, str]], n: int, step: Step, totals: Totals,
            uses: Callable[[str], list[tuple[Frame, ...]]]) -> None:
        """Per-sample gradients of ``bad`` (qual -> (module, why)) into ``step``, from
        replays of the calls around their ``uses``, innermost first; ``totals`` learns of
        those that none could give."""
        spec = self._spec
        c, scale = spec.share(n), spec.scale(n)
        todo = {q: candidates(uses(q)) if spec.fallback else [] for q in bad}
        tried: dict[str, list[str]] = {q: [] if spec.fallback else ["fallback=False"]
                                       for q in bad}
        done: dict[str, dict[str, str]] = {}  # replayed call -> {module: reason}
        while todo:
            groups: dict[str, list[str]] = {}
            for q, cands in list(todo.items()):
                if not cands:
                    totals.fail(q, _failure(q, bad[q], tried[q]))
                    del todo[q]
                    continue
                groups.setdefault(cands.pop(0), []).append(q)
            for unit, quals in groups.items():
                frames = frames_of(unit, [calls for q in quals for calls in uses(q)])
                where = describe(unit, frames[0].module)
                try:
                    result = replay_frames(frames, {q: spec.params[q] for q in quals},
                                           spec.batch_dim, n, scale)
                except CannotReplay as err:
                    for q in quals:
                        tried[q].append(f"{where}: {err}")
                    continue
                with torch.no_grad():
                    rows = {q: (*pair(spec.sketches, q, result[q].sum(0) * c,
                                      step.increments[q]), result[q]) for q in quals}
                wrong = mismatches(rows, spec.params, c, step.largest)
                for q in quals:
                    if q in wrong:
                        tried[q].append(f"{where}: its replay does not add up to the gradient "
                                        "(a use outside that call?)")
                        continue
                    step.grad[q] = result[q]
                    del todo[q]
                    done.setdefault(where, {}).setdefault(*bad[q])
        self._warn(done)

    def _warn(self, done: dict[str, dict[str, str]]) -> None:
        for where, problems in done.items():
            fresh = {m: why for m, why in problems.items() if (m, where) not in self._warned}
            if fresh:
                self._warned.update((m, where) for m in fresh)
                listed = "; ".join(f"{m}: {why}" for m, why in fresh.items())
                warnings.warn(f"gradtap.per_sample: per-sample gradients of the parameters of "
                              f"{len(fresh)} module(s) come from a torch.func replay of {where} "
                              f"(a forward and backward of it per step), because no rule can "
                              f"split them: {listed}",
                              stacklevel=3)  # the caller of run()


def _failure(qual: str, problem: tuple[str, str], tried: list[str]) -> str:
    """Why ``qual`` got no per-sample gradients, as reading the results says it."""
    module_name, reason = problem
    attempts = "; ".join(tried) if tried else "no call around it was recorded"
    return (f"{qual} (module {module_name}: {reason}), and no enclosing call could be "
            f"replayed ({attempts})")
