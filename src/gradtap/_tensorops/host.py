"""The one device-to-host copy: every tensor a step needs, one transfer per device."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["HostCopy", "to_host"]


class HostCopy:
    """Collect device tensors during a step and copy them to the host once per device.

    ``add`` returns a handle; after :meth:`run`, ``get(handle)`` is a numpy array of the
    tensor's shape. Every tensor of one device goes through one ``torch.cat`` and a single
    ``.cpu()``, so a step costs one device-to-host transfer, not one per tensor.

    Args:
        views: how CPU tensors come back. ``False`` (default): float64 copies the caller owns.
            ``True``: numpy arrays over the tensors' own memory, in their own dtype (bfloat16,
            which numpy lacks, as a float64 copy); nothing is copied, so they are only valid
            while the tensors are and change with them. Other devices always give float64.

    Example:
        >>> import torch
        >>> copy = HostCopy()
        >>> h = copy.add(torch.arange(4.0).reshape(2, 2))
        >>> copy.run()
        >>> copy.get(h).tolist(), copy.transfers
        ([[0.0, 1.0], [2.0, 3.0]], 0)
    """

    def __init__(self, *, views: bool = False) -> None:
        self.views = views
        self._items: list[Tensor] = []
        self._owned: set[int] = set()
        self._out: list[np.ndarray] = []
        #: device-to-host transfers made so far (CPU tensors need none)
        self.transfers = 0

    def add(self, t: Tensor, *, owned: bool = False) -> int:
        """Queue ``t`` (any float or int dtype); return its handle. ``owned``: ``t`` is a
        fresh tensor nobody else holds, so a CPU one may be handed out without a copy."""
        self._items.append(t.detach())
        if owned:
            self._owned.add(len(self._items) - 1)
        return len(self._items) - 1

    def add_rows(self, groups: Sequence[tuple[Sequence[int], Tensor]], n: int) -> Callable[[], np.ndarray]:
        """Queue row blocks that together make ``n`` rows: ``groups`` holds ``(indices, rows)``
        with ``rows[j]`` the row of index ``indices[j]`` (the grouped results of
        ``tensor_moments`` and ``norms``). Returns a function that, after :meth:`run`, gives
        the float64 array ``[n, ...]`` in index order."""
        if len(groups) == 1 and len(groups[0][0]) == n and list(groups[0][0]) == list(range(n)):
            h = self.add(groups[0][1])  # the usual case: one group, already in order
            return lambda: self.get(h)
        handles = [(list(idx), self.add(rows)) for idx, rows in groups]

        def gather() -> np.ndarray:
            out: np.ndarray | None = None
            for idx, h in handles:
                v = self.get(h)
                if out is None:
                    out = np.zeros((n, *v.shape[1:]), dtype=np.float64)
                out[idx] = v
            return np.zeros(n) if out is None else out

        return gather

    def run(self) -> None:
        """Copy everything queued to the host (one transfer per device)."""
        items = self._items
        if len(items) == 1 and 0 in self._owned and items[0].is_cpu \
                and items[0].dtype == torch.float64 and not self.views:
            # the usual step: one fresh float64 buffer of the step's statistics on the CPU
            self._out = [items[0].numpy()]
            self._items = []
            self._owned = set()
            return
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(self._items):
            by_device.setdefault(t.device, []).append(i)
        out: list[np.ndarray] = [np.empty(0)] * len(self._items)
        for device, idx in by_device.items():
            if device.type == "cpu" and self.views:
                for i in idx:
                    t = self._items[i]
                    out[i] = (t if t.dtype != torch.bfloat16 else t.to(torch.float64)).numpy()
                continue
            parts = [self._items[i].reshape(-1).to(torch.float64) for i in idx]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0]
            if device.type == "cpu" and len(parts) == 1 and idx[0] not in self._owned:
                flat = flat.clone()  # never hand out numpy views of a caller's tensor
            if device.type != "cpu":
                self.transfers += 1
            host = flat.cpu().numpy()
            offset = 0
            for i in idx:
                n = self._items[i].numel()
                out[i] = host[offset:offset + n].reshape(self._items[i].shape)
                offset += n
        self._out = out
        self._items = []
        self._owned = set()

    def get(self, handle: int) -> np.ndarray:
        """The host copy of the tensor behind ``handle`` (after :meth:`run`)."""
        return self._out[handle]


def to_host(parts: Sequence[Tensor], *, views: bool = True) -> list[np.ndarray]:
    """Copy tensors to the host at once: one transfer per device, CPU tensors as views.

    A shorthand for a :class:`HostCopy` that holds only ``parts``: see there for ``views``.

    Example:
        >>> import torch
        >>> [a.tolist() for a in to_host([torch.ones(2), torch.zeros(1, dtype=torch.float64)])]
        [[1.0, 1.0], [0.0]]
    """
    if views and all(p.device.type == "cpu" and p.dtype != torch.bfloat16 for p in parts):
        return [p.detach().numpy() for p in parts]  # what HostCopy gives, without its bookkeeping
    copy = HostCopy(views=views)
    handles = [copy.add(p) for p in parts]
    copy.run()
    return [copy.get(h) for h in handles]
