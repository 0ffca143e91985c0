"""``Run.spikes()``: the gradient spikes of a stored run, from its ``norm`` of kind
``param_grad`` (the detector of :mod:`gradtap._tensorops.spikes`; ``docs/semantics.md``).

Example:
    >>> import numpy as np
    >>> from gradtap._monitor.history import MemoryRun
    >>> run = MemoryRun({"selected": {"parameters": ["w", "b"]}})
    >>> for step in range(40):
    ...     norms = np.array([1.0 + 0.01 * (step % 3), 2.0 + 0.01 * (step % 2)])
    ...     norms[1] *= 10 if step == 30 else 1
    ...     series = [(0, "w", "param_grad", "norm"), (1, "b", "param_grad", "norm")]
    ...     run.write_step(step, series if step == 0 else [], np.array([0, 1]), norms)
    >>> [(s.step, s.name, s.first) for s in spikes_of(run)]
    [(30, 'b', True)]
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from gradtap._tensorops.spikes import THRESHOLD, WARMUP, check_spike_args, scores

__all__ = ["Spike", "spikes_of"]


class Spike(NamedTuple):
    """One gradient spike of a run (see :meth:`gradtap.Run.spikes`).

    Attributes:
        step: the step.
        name: the parameter whose gradient norm spiked.
        kind: the kind of the statistic (``"param_grad"``).
        value: the gradient norm at that step.
        score: how far it left its baseline: ``(log(value) - baseline) / scale`` (a robust
            z-score of the log-norm, ``docs/semantics.md``, "Gradient spikes").
        first: whether it is the step's first spiking tensor in backward order (the model's
            parameter order reversed: the gradient nearest the loss is computed first).
    """

    step: int
    name: str
    kind: str
    value: float
    score: float
    first: bool


class _Readable(Protocol):
    @property
    def meta(self) -> dict[str, Any]: ...

    @property
    def stats(self) -> list[str]: ...

    def arrays(self, names: Any = None, stats: Any = None, kinds: Any = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[str, str, str]]]: ...

    def series(self, name: str, stat: str, kind: str | None = None
               ) -> tuple[np.ndarray, np.ndarray]: ...


def _series_keys(run: _Readable) -> list[tuple[str, str, str]]:
    """``(name, kind, stat)`` of every series: a store's catalogue (``Run.series_keys()``),
    else the series table ``arrays(names=[])`` returns without reading a value."""
    keys = getattr(run, "series_keys", None)
    return keys() if keys is not None else run.arrays(names=[])[3]


def _scored(name: str) -> bool:
    """A tensor's own norm: not ``"<all>"``/``"<loss>"``/``"<scaler>"``, not a ``split=``
    slice (``experts.w1[3]``)."""
    return not name.startswith("<") and not name.endswith("]")


def spikes_of(run: _Readable, threshold: float | None = None, warmup: int | None = None
              ) -> list[Spike]:
    """The spikes of ``run`` (a :class:`~gradtap.Run` or the Monitor's in-memory run), by
    step, then in backward order; ``[]`` when it stored no ``norm`` of kind ``param_grad``.

    Raises:
        ValueError: ``threshold`` is not a finite number > 0, or ``warmup`` not an int >= 2.
    """
    threshold = THRESHOLD if threshold is None else threshold
    warmup = WARMUP if warmup is None else warmup
    check_spike_args(threshold, warmup, "Run.spikes()")
    if "norm" not in run.stats:
        return []
    params = [name for name, kind, stat in _series_keys(run)
              if kind == "param_grad" and stat == "norm" and _scored(name)]
    if not params:
        return []
    selected = (run.meta.get("selected") or {}).get("parameters") or []
    rank = {p: i for i, p in enumerate(selected) if isinstance(p, str)}
    # the model's parameter order (names the metadata lacks last): the detector's neighbours
    order = sorted(set(params), key=lambda n: (n not in rank, rank.get(n, 0), n))
    series = [run.series(name, "norm", "param_grad") for name in order]
    steps = np.unique(np.concatenate([st for st, _ in series])).astype(np.int64)
    table = np.full((len(steps), len(order)), np.nan)  # 8 bytes per (step, tensor)
    for col, (st, v) in enumerate(series):
        table[np.searchsorted(steps, st), col] = v
    del series
    z = scores(table, warmup)
    out = []
    # by step, then in backward order: the model's order reversed, names it lacks last
    back = sorted(range(len(order)), key=lambda c: (order[c] not in rank,
                                                  c if order[c] not in rank else -c))
    for t in np.flatnonzero(np.any(z > threshold, axis=1)).tolist():
        first = True
        for c in back:
            if z[t, c] > threshold:
                out.append(Spike(int(steps[t]), order[c], "param_grad", float(table[t, c]),
                                 float(z[t, c]), first))
                first = False
    return out
