"""Which samples carry an anomaly (``gt.detect(..., samples=True)``), from the replay of its step.

Runs only on a bad step, after the replay named the origin, on the tensors the replay kept
(its watch keeps every call's inputs and outputs then). Per-sample gradients of a module's
parameters come from the per-sample engine's rules (:mod:`gradtap._samples.calls`); the
rest is rows of tensors along ``batch_dim``:

* a non-finite forward value: the rows of the first bad tensor (the origin's slot) that hold
  one; a non-finite loss value: the rows of the gradient that reached the model's outputs
  that hold one (none when no backward ran);
* a non-finite gradient: the samples whose own gradient at the origin's slot is non-finite
  (the slot's rows for an input or output gradient, each sample's gradient of the parameter,
  by the engine's rule, for a parameter gradient);
* a spike: the samples whose gradient norm in the spiking tensors is far above the batch's
  (:func:`far_samples`).

Worst first: by the number of non-finite values, or by the norm; ties by position.
``docs/semantics.md``, "Which samples did it", is the definition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from gradtap._detect._anomaly import LOSS
from gradtap._detect._measure import Plan
from gradtap._detect._messages import Found
from gradtap._detect._screen import Screen
from gradtap._samples.calls import bad_rows, batch_size, call_compute

__all__ = ["FAR", "attach", "batch_of", "far_samples", "ids_of", "nonfinite_samples",
           "spike_samples"]

#: A sample is far above the batch when its norm exceeds the batch's median by more than
#: ``FAR`` robust deviations (``far_samples``).
FAR = 6.0
#: The robust deviation is never taken below this fraction of the median.
MIN_SPREAD = 0.05


def batch_of(screen: Screen, batch_dim: int) -> int | None:
    """The number of samples in this step's first replayable call of the model."""
    for call in screen.calls:
        if call.args is not None:
            return batch_size(call.module, call.args, call.kwargs, batch_dim,
                              who="the model" if not call.name else repr(call.name))
    return None


def ids_of(ids: object, n: int | None, batch_dim: int) -> tuple[int | str, ...]:
    """The user's ids, one per batch row, as a tuple of ints and strs (a 1-D tensor or array
    of integers is read as a list).

    Raises:
        ValueError: not one id per row of this step's ``n`` samples.
        TypeError: not a sequence, or an id that is neither an int nor a str.
    """
    if isinstance(ids, Tensor) or hasattr(ids, "tolist"):
        ids = ids.tolist()  # type: ignore[attr-defined]
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"sample_ids must be a sequence of ids (one per batch row: ints or "
                        f"strs, or a 1-D integer tensor); got {type(ids).__name__}")
    for i in ids:
        if not isinstance(i, (int, str)) or isinstance(i, bool):
            raise TypeError(f"sample_ids must hold ints or strs; got {i!r} "
                            f"({type(i).__name__})")
    if n is not None and len(ids) != n:
        raise ValueError(f"sample_ids has {len(ids)} ids, but this step's batch has {n} "
                         f"samples along batch_dim={batch_dim}: pass one id per row")
    return tuple(ids)


def far_samples(norms: Tensor) -> list[int]:
    """Positions whose norm is far above the batch's, largest first.

    With ``m`` the median of the finite norms and ``s = max(1.4826 * MAD, MIN_SPREAD * m)``
    (MAD the median absolute deviation from ``m``), sample ``n`` is named when
    ``(norm_n - m) / s > FAR``; a non-finite norm is always named, first. With fewer than
    three samples there is no spread to compare with: every sample, largest first.
    """
    a = norms.detach().double().cpu()
    order = sorted(range(a.numel()), key=lambda i: (math.isfinite(a[i]), -float(a[i]), i))
    if a.numel() < 3:
        return order
    fin = a[torch.isfinite(a)]
    if fin.numel() == 0:
        return order
    m = float(fin.median())
    s = max(1.4826 * float((fin - m).abs().median()), MIN_SPREAD * m)
    if s == 0.0:
        return [i for i in order if not math.isfinite(a[i]) or a[i] > m]
    return [i for i in order if not math.isfinite(a[i]) or (float(a[i]) - m) / s > FAR]


def _worst(counts: Tensor) -> list[int]:
    """Positions with a non-zero count, the largest count first (ties by position)."""
    c = counts.tolist()
    return sorted((i for i, v in enumerate(c) if v), key=lambda i: (-c[i], i))


def nonfinite_samples(found: Found, screen: Screen, n: int, batch_dim: int,
                      modules: dict[str, nn.Module]) -> list[int]:
    """The samples carrying the non-finite value ``found`` reports (worst first)."""
    a, rec = found.anomaly, found.anomaly.record
    what = f"the {a.where} {a.slot!r} of module {a.module_name!r}"
    if a.where == "forward":
        if a.module_name == LOSS:  # the loss is one number: the gradient it sent says who
            grads = [g for call in screen.calls for g in call.grads.values()]
            counts = [bad_rows(g, n, batch_dim, "the gradient at the model's output")
                      for g in grads]
            return _worst(sum(counts)) if counts else []  # type: ignore[arg-type]
        kept = found.kept or {}
        role = "outputs" if a.slot in kept.get("outputs", {}) else "inputs"
        t = kept.get(role, {}).get(a.slot)
        if t is None:
            return []  # a parameter already non-finite: no sample's doing
        return _worst(bad_rows(t, n, batch_dim, f"the {role[:-1]} {a.slot!r} of module "
                                                f"{a.module_name!r}"))
    if rec is None:
        return []
    if a.where in ("grad_output", "grad_input"):
        slots = rec.grad_outputs if a.where == "grad_output" else rec.grad_inputs
        g = slots.get(a.slot)
        return [] if g is None else _worst(bad_rows(g, n, batch_dim, what))
    module = modules[rec.module_name]
    per_sample = call_compute(module, rec.module_name, rec, [a.slot], n, batch_dim).grads()
    g = per_sample.get(a.slot)
    return [] if g is None else _worst(bad_rows(g, n, batch_dim, what))


def spike_samples(plans: list[Plan], name: str, params: list[str], n: int, batch_dim: int,
                  module: nn.Module) -> tuple[list[int], Tensor | None]:
    """The samples far above the batch in the spiking ``params`` of module ``name``, and
    every sample's norm there: the norm over those tensors together of its gradient summed
    over the module's calls in the replayed backward."""
    recs = [p.rec for p in plans if p.name == name and p.rec is not None]
    if not recs:
        return [], None
    comps = [call_compute(module, name, r, params, n, batch_dim) for r in recs]
    if len(comps) == 1:
        sq = sum(comps[0].norm_sq().values())
    else:  # norms of a sum do not add: the per-sample gradients summed over the calls
        total: dict[str, Tensor] = {}
        for c in comps:
            for k, g in c.grads().items():
                total[k] = g if k not in total else total[k] + g
        sq = sum(g.reshape(n, -1).double().square().sum(1) for g in total.values())
    if not isinstance(sq, Tensor):
        return [], None
    norms = sq.double().sqrt()
    return far_samples(norms), norms


def attach(found: Found, samples: list[int], norms: Tensor | None = None,
           note: str | None = None) -> Found:
    """``found`` with its anomaly's ``samples`` set and listed in its message (``note``
    instead of the list when they could not be named)."""
    a = found.anomaly
    line = f"samples: {note}" if note is not None else _line(samples, norms)
    anomaly = replace(a, samples=tuple(samples), message=f"{a.message}\n{line}")
    return Found(anomaly, found.key, found.module, found.kept)


def _line(samples: list[int], norms: Tensor | None) -> str:
    if not samples:
        return "samples: none stands out (the whole batch, or no sample's doing)"
    shown = samples[:10]
    more = f", ... ({len(samples)} in all)" if len(samples) > 10 else ""
    if norms is None:
        return f"samples (batch positions, worst first): {', '.join(map(str, shown))}{more}"
    med = float(norms[torch.isfinite(norms)].median()) if torch.isfinite(norms).any() else math.nan
    each = ", ".join(f"{i} (norm {float(norms[i]):.4g})" for i in shown)
    return (f"samples (batch positions, largest per-sample gradient norm first; batch median "
            f"{med:.4g}): {each}{more}")

