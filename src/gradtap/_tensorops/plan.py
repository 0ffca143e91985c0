"""A reduction plan kept from step to step: :class:`MomentPlan`.

Made once for a list of tensors of fixed devices, dtypes and sizes, it lays out each group's
flat buffer (:class:`~gradtap._tensorops.moments._Layout`: one stack and one host copy per
group) and keeps the element counts, so a step costs the kernels, one copy and a few numpy
operations. On the CPU the small tensors of a group have no kernels of their own: their
elements join the flat buffer and are reduced on the host (:class:`_HostReduced`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtap._tensorops.groups import Scratch, group_by_device_dtype
from gradtap._tensorops.host import HostCopy
from gradtap._tensorops.moments import Needs, _Layout, _layout

__all__ = ["HOST_REDUCED", "HOST_REDUCED_TOTAL", "MomentPlan"]


class MomentPlan:
    """How to reduce one list of tensors (fixed devices, dtypes and sizes) step after step.

    Made once for a list's signature (:meth:`signature`), it groups the tensors by device and
    dtype, lays out each group's flat buffer (one stack and one host copy per group) and keeps
    the element counts, so a step costs the kernels, one copy and a few numpy operations.

    Args:
        tensors: non-empty floating-point tensors.
        needs: the fields to compute (:func:`needs_for`).

    Example:
        >>> import torch
        >>> from gradtap._tensorops.moments import needs_for
        >>> ts = [torch.ones(3), torch.arange(4.0)]
        >>> plan = MomentPlan(ts, needs_for(["mean", "norm"]))
        >>> copy = HostCopy()
        >>> get = plan.queue(ts, copy)
        >>> copy.run()
        >>> {f: v.round(5).tolist() for f, v in get().items()}
        {'sum': [3.0, 6.0], 'sumsq': [3.0, 14.0]}
    """

    def __init__(self, tensors: Sequence[Tensor], needs: Needs) -> None:
        self.needs = needs
        self.n = len(tensors)
        # Each group's kernel-reduced tensors, then its host-reduced ones (CPU, small).
        order: list[int] = []
        split: list[tuple[list[int], list[int], torch.dtype, bool]] = []
        for (device, dtype), idx in group_by_device_dtype(tensors).items():
            if not dtype.is_floating_point:
                raise TypeError(f"statistics need floating-point tensors; got {dtype}")
            cpu = device.type == "cpu"
            small = _host_reduced(idx, tensors) if cpu else []
            rest = [i for i in idx if i not in set(small)]
            order += rest + small
            split.append((rest, small, dtype, cpu))
        if not any(small for _, small, _, _ in split):
            order = list(range(self.n))
        #: the order :meth:`queue` takes the tensors in (``None``: as given; otherwise each
        #: group's kernel-reduced tensors, then its host-reduced ones, group after group)
        self.order = None if order == list(range(self.n)) else order
        at = {i: j for j, i in enumerate(order)}
        self.count = np.array([tensors[i].numel() for i in order], dtype=np.float64)
        self.groups: list[tuple[list[int], torch.dtype, _Layout | None]] = []
        self._hosts: list[_HostReduced | None] = []
        for rest, small, dtype, cpu in split:
            idx = [at[i] for i in rest + small]
            self.groups.append((idx, torch.promote_types(dtype, torch.float32), _layout(
                tuple(tensors[i].numel() for i in rest), needs, cpu) if rest else None))
            self._hosts.append(_HostReduced(tuple(tensors[i].numel() for i in small), needs)
                               if small else None)
        self._in_order = len(self.groups) == 1

    @staticmethod
    def signature(tensors: Sequence[Tensor]) -> tuple[Any, ...]:
        """What a plan depends on: each tensor's device, dtype and element count."""
        return tuple((t.device, t.dtype, t.numel()) for t in tensors)

    def queue(self, tensors: Sequence[Tensor], copy: HostCopy, scratch: Scratch | None = None
              ) -> Callable[[], dict[str, np.ndarray]]:
        """Launch the kernels over ``tensors`` (in :attr:`order`) and queue their buffers on
        ``copy`` (``scratch``: work buffers for the kernels that need a temporary). Returns a function that, after ``copy.run()``, gives each field as a float64
        array [n] (in :attr:`order`).

        On the CPU, the small tensors of a group (see :data:`HOST_REDUCED`) have no kernels of
        their own: their elements join the group's flat buffer and are reduced on the host in
        float64, a few numpy calls for all of them (they come last in :attr:`order`)."""
        handles = []
        with torch.no_grad():  # as detached, without a detach per tensor
            for (idx, acc, layout), host in zip(self.groups, self._hosts):
                ts = tensors if self._in_order else [tensors[i] for i in idx]
                n_rest = len(ts) - (0 if host is None else len(host.starts))
                extra = ([torch.cat([t.reshape(-1) for t in ts[n_rest:]])]
                         if host is not None else [])
                flat = (layout.launch(ts[:n_rest] if extra else ts, acc, extra, scratch)
                        if layout is not None else extra[0].to(torch.float64))
                handles.append(copy.add(flat, owned=True))
        if self._in_order:
            layout, host, h = self.groups[0][2], self._hosts[0], handles[0]
            return lambda: _group_fields(layout, host, copy.get(h))

        def gather() -> dict[str, np.ndarray]:
            out: dict[str, np.ndarray] = {}
            for (idx, _, layout), host, h in zip(self.groups, self._hosts, handles):
                for f, v in _group_fields(layout, host, copy.get(h)).items():
                    if f not in out:
                        out[f] = np.zeros(self.n)
                    out[f][idx] = v
            return out

        return gather


def _group_fields(layout: _Layout | None, host: _HostReduced | None, flat: np.ndarray
                  ) -> dict[str, np.ndarray]:
    """The fields of one group's flat buffer: its kernel-reduced tensors, then the others."""
    if host is None:
        assert layout is not None
        return layout.host_fields(flat)
    if layout is None:
        return host.fields(flat)
    first = layout.host_fields(flat[:layout.size])
    last = host.fields(flat[layout.size:])
    return {f: np.concatenate([v, last[f]]) for f, v in first.items()}


#: On the CPU, tensors of at most this many elements are reduced on the host (one buffer of
#: their elements instead of a kernel per tensor and field) ...
HOST_REDUCED = 1024
#: ... up to this many elements in all per group (the smallest first).
HOST_REDUCED_TOTAL = 1 << 16


def _host_reduced(idx: Sequence[int], tensors: Sequence[Tensor]) -> list[int]:
    """The tensors of a CPU group reduced on the host (none unless at least two)."""
    small = sorted((tensors[i].numel(), i) for i in idx if 0 < tensors[i].numel() <= HOST_REDUCED)
    picked, total = [], 0
    for n, i in small:
        if total + n > HOST_REDUCED_TOTAL:
            break
        picked.append(i)
        total += n
    return sorted(picked) if len(picked) > 1 else []


class _HostReduced:
    """Moment fields of small tensors from their elements on the host, in float64: sums and
    extremes per tensor with one ``reduceat`` each (NaN propagates, as on the device)."""

    def __init__(self, numels: tuple[int, ...], needs: Needs) -> None:
        self.needs = needs
        self.starts = np.concatenate([[0], np.cumsum(numels)[:-1]]).astype(np.int64)

    def fields(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """The fields of the tensors whose elements, back to back, are ``x``."""
        needs, at = self.needs, self.starts
        out: dict[str, np.ndarray] = {}
        with np.errstate(all="ignore"):  # inf - inf is NaN, as in torch, without a warning
            if needs.sum:
                out["sum"] = np.add.reduceat(x, at)
            if needs.minmax:
                out["max"] = np.maximum.reduceat(x, at)
                out["negmin"] = -np.minimum.reduceat(x, at)
            if needs.nonfinite:
                out["nonfinite"] = np.add.reduceat((~np.isfinite(x)).astype(np.float64), at)
            if needs.nonzero:
                out["nonzero"] = np.add.reduceat((x != 0).astype(np.float64), at)
            if needs.sumsq:
                out["sumsq"] = np.add.reduceat(x * x, at)
        return out
