"""What a tracker receives of one logged step: the summary (at most :data:`MAX_KEYS` keys,
whatever the model's size) or every row, computed once for all the Monitor's trackers.

The summary of a step (``log_keys="summary"``):

* ``grad/global_norm``: the L2 norm of all the selected gradients together
  (``sqrt(sum of the squared per-tensor norms)``);
* ``grad/group_norm/<group>``: the same over each top-level block of the model (or each group
  of ``log_groups={glob: label}``), at most :data:`MAX_GROUPS` of them;
* ``<prefix>/max_<stat>`` and, as text where the tracker takes text,
  ``<prefix>/max_<stat>_tensor``: the largest per-tensor value of each stat of each kind and
  the tensor that has it (a NaN wins: it is the value to see);
* the values of the run's own names (``health/amp_scale/scaler``, ``health/norm/clip``, ``health/gns/all``, ...);
* ``grad/spikes``: the (step, tensor) pairs whose gradient norm the online spike detector
  (``gt.detect``'s, fed every computed step) flagged since the previous logged step, this step
  included; ``grad/clipped``: the (step, tensor) pairs a spike rule clipped
  (``clip_factor < 1``) over the same steps;
* ``loss``.

``log_keys="all"`` sends every row of the step under its key (:mod:`.keys`) and the summary.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gradtap._monitor.health import LOSS_NAME
from gradtap._monitor.rows import StepRows
from gradtap._monitor.trackers.keys import LOSS_KEY, KeyTable, clean, key_of, prefix_of
from gradtap._tensorops.spikes import THRESHOLD, WARMUP, OnlineScores
from gradtap.store import HEALTH_KIND

__all__ = ["MAX_GROUPS", "MAX_KEYS", "Metrics", "Summary", "check_groups", "default_groups"]

#: Keys of one step's summary, at most.
MAX_KEYS = 64
#: Group norms in the summary, at most.
MAX_GROUPS = 16
_FIXED = 4  # global norm, spikes, clipped, loss


@dataclass
class Metrics:
    """One logged step as trackers take it: numbers, and texts for trackers that take text."""

    numbers: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)


def check_groups(groups: object, params: Sequence[str]) -> dict[str, str]:
    """``log_groups`` as ``{glob: label}``, or a ``ValueError`` naming what is wrong."""
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"log_groups must be a non-empty dict {{parameter glob: label}}; got "
                         f"{groups!r}")
    out: dict[str, str] = {}
    for glob, label in groups.items():
        if not isinstance(glob, str) or not isinstance(label, str) or not label:
            raise ValueError(f"log_groups maps parameter globs (str) to labels (non-empty str); "
                             f"got {glob!r}: {label!r}")
        if not any(fnmatch.fnmatchcase(n, glob) for n in params):
            raise ValueError(f"log_groups glob {glob!r} matches no selected parameter (they are "
                             f"named like {', '.join(params[:3])})")
        out[glob] = clean(label)
    labels = set(out.values())
    if len(labels) > MAX_GROUPS:
        raise ValueError(f"log_groups has {len(labels)} labels; the summary takes at most "
                         f"{MAX_GROUPS} group norms (log_keys='all' sends every tensor)")
    return out


def default_groups(params: Sequence[str]) -> dict[str, str]:
    """Each parameter's group: its top-level block (the first part of its name), one level
    deeper while a single block holds everything (``model.layers.0`` under ``model``); with
    more than :data:`MAX_GROUPS` blocks, runs of consecutive blocks (``"0-7"``)."""
    depth = 0
    while True:
        blocks = [".".join(n.split(".")[:depth + 1]) for n in params]
        if len(set(blocks)) != 1 or any(b == n for b, n in zip(blocks, params)):
            break
        depth += 1
    order = list(dict.fromkeys(blocks))
    if len(order) > MAX_GROUPS:
        chunks = np.array_split(np.arange(len(order)), MAX_GROUPS)
        label = {}
        for c in chunks:
            first, last = order[c[0]], order[c[-1]]
            for i in c.tolist():
                label[order[i]] = first if first == last else f"{first}-{last}"
    else:
        label = {b: b for b in order}
    return {n: clean(label[b]) for n, b in zip(params, blocks)}


class _Plan:
    """Where each part of the summary is in the rows of one layout."""

    def __init__(self, rows: StepRows, params: Sequence[str], group_of: dict[str, str],
                 budget_note: list[str] | None) -> None:
        names, kinds, stats = rows.labels()
        index = {(n, k, s): i for i, (n, k, s) in enumerate(zip(names, kinds, stats))}
        self.norms = np.array([index.get((p, "param_grad", "norm"), -1) for p in params],
                              dtype=np.int64)
        self.has_norms = bool((self.norms >= 0).any())
        labels = [group_of.get(p) for p in params]
        self.group_labels = list(dict.fromkeys(lb for lb in labels if lb is not None))
        pos = {lb: i for i, lb in enumerate(self.group_labels)}
        self.group_ids = np.array([pos.get(lb, -1) if lb is not None else -1 for lb in labels])
        self.loss = index.get((LOSS_NAME, HEALTH_KIND, "value"), -1)
        selected = set(params)
        self.clip = np.array([i for (n, k, s), i in index.items()
                              if k == "param_grad" and s == "clip_factor" and n in selected],
                             dtype=np.int64)
        self.special: list[tuple[str, int]] = []
        maxes: dict[tuple[str, str], list[int]] = {}
        for (n, k, s), i in index.items():
            if n == LOSS_NAME:
                continue
            if n.startswith("<"):
                self.special.append((key_of(n, k, s), i))
            elif s != "clip_factor":
                maxes.setdefault((prefix_of(k, s), s), []).append(i)
        room = MAX_KEYS - _FIXED - len(self.group_labels)
        self.special = self.special[:max(room, 0)]
        room -= len(self.special)
        pairs = list(maxes.items())
        keep = max(room // 2, 0)
        if len(pairs) > keep and budget_note is not None:
            budget_note.append(
                f"the tracker summary keeps {MAX_KEYS} keys: the largest value of "
                f"{', '.join(f'{p}/{s}' for (p, s), _ in pairs[keep:])} is not sent "
                "(log_keys='all' sends every row)")
        self.maxes = [(f"{p}/max_{s}", np.array(ix), [names[i] for i in ix])
                      for (p, s), ix in pairs[:keep]]


class Summary:
    """The summary of each logged step (see the module text), the same for every tracker.

    Args:
        params: the selected parameter names (the global and group norms are over these).
        groups: ``{glob: label}`` (checked by :func:`check_groups`), or ``None``: top-level
            blocks (:func:`default_groups`).
        everything: ``log_keys="all"``: every row too.
    """

    def __init__(self, params: Sequence[str], groups: Mapping[str, str] | None,
                 everything: bool) -> None:
        self.params = list(params)
        if groups is None:
            self.group_of = default_groups(self.params)
        else:
            self.group_of = {}
            for p in self.params:
                for glob, label in groups.items():
                    if fnmatch.fnmatchcase(p, glob):
                        self.group_of[p] = label
                        break
        self.everything = everything
        #: send ``loss`` (off in the callbacks: the trainers log their own loss)
        self.loss = True
        self.notes: list[str] = []  # for the training thread to warn about, once each
        self._plans: dict[int, tuple[np.ndarray, _Plan]] = {}
        self._keys = KeyTable()
        self._scores = OnlineScores(len(self.params), WARMUP)
        self._spikes = 0  # flagged (step, tensor) pairs since the last logged step
        self._clipped = 0

    def _plan(self, rows: StepRows) -> _Plan:
        hit = self._plans.get(id(rows.ids))
        if hit is None or hit[0] is not rows.ids:
            hit = self._plans[id(rows.ids)] = (rows.ids, _Plan(
                rows, self.params, self.group_of, None if self.everything else self.notes))
        return hit[1]

    def extract(self, rows: StepRows) -> tuple[int, np.ndarray | None, int]:
        """What the counts need of a computed step, taken on the training thread (a few
        values, so the rows need not be kept): ``(step, norms or None, clipped tensors)``."""
        plan = self._plan(rows)
        v = rows.values
        norms = (np.where(plan.norms >= 0, v[np.maximum(plan.norms, 0)], np.nan)
                 if plan.has_norms else None)
        return rows.step, norms, int((v[plan.clip] < 1.0).sum()) if len(plan.clip) else 0

    def observe(self, seen: tuple[int, np.ndarray | None, int]) -> None:
        """Count one computed step (from :meth:`extract`, every computed step in order)."""
        _, norms, clipped = seen
        self._clipped += clipped
        if norms is not None:
            self._spikes += int((self._scores.score(norms) > THRESHOLD).sum())
            self._scores.push(norms)

    def metrics(self, rows: StepRows) -> Metrics:
        """The step's metrics (after :meth:`observe` of it and the steps before it)."""
        plan = self._plan(rows)
        v = rows.values
        out = Metrics()
        nums = out.numbers
        if self.everything:
            nums.update(zip(self._keys.keys(rows), v.tolist()))
        if (plan.norms >= 0).any():
            sq = np.where(plan.norms >= 0, v[plan.norms], 0.0) ** 2
            nums["grad/global_norm"] = float(np.sqrt(sq.sum()))
            if plan.group_labels:
                ok = plan.group_ids >= 0
                per = np.bincount(plan.group_ids[ok], weights=sq[ok],
                                  minlength=len(plan.group_labels))
                for label, value in zip(plan.group_labels, np.sqrt(per).tolist()):
                    nums[f"grad/group_norm/{label}"] = value
            nums["grad/spikes"] = float(self._spikes)
        if len(plan.clip):
            nums["grad/clipped"] = float(self._clipped)
        self._spikes = self._clipped = 0
        for key, i in plan.special:
            nums[key] = float(v[i])
        for key, ix, names in plan.maxes:
            vals = v[ix]
            nan = np.flatnonzero(np.isnan(vals))
            at = int(nan[0]) if len(nan) else int(np.argmax(vals))
            nums[key] = float(vals[at])
            out.texts[f"{key}_tensor"] = names[at]
        if plan.loss >= 0 and self.loss:
            nums[LOSS_KEY] = float(v[plan.loss])
        elif self.everything:
            nums.pop(LOSS_KEY, None)
        return out
