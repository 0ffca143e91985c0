"""The Monitor's elementwise EWMA of each parameter gradient (formula in ``_tensorops.ewma``)."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtap._tensorops import ewma_init, ewma_update_, ewma_update_finite_, group_norms

__all__ = ["GradEwma", "unknown_name"]


class GradEwma:
    """Per parameter, the EWMA ``(mean, var)`` of its gradient and how many steps fed it.

    Args:
        beta: the EWMA factor, ``0 <= beta < 1``.
        names: the selected parameter names (for error messages).
    """

    def __init__(self, beta: float, names: Iterable[str]) -> None:
        self.beta = beta
        self._names = list(names)
        self._known = set(self._names)
        self._state: dict[str, tuple[Tensor, Tensor]] = {}
        self._updates: dict[str, int] = {}
        #: full shapes of the names whose state is a shard (set by the owner)
        self.shapes: dict[str, tuple[int, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self._state)

    def __contains__(self, name: object) -> bool:
        return name in self._state

    def update(self, grads: Mapping[str, Tensor]) -> None:
        """Advance the EWMA of each gradient given with its finite elements (a non-finite
        element leaves its EWMA as it was). The first all-finite gradient starts it: deciding
        that reads one flag from the device, once per parameter."""
        for name, g in grads.items():
            state = self._state.get(name)
            if state is None:
                if bool(torch.isfinite(g).all()):
                    self._state[name] = ewma_init(g)
                    self._updates[name] = 1
            else:
                if g.device.type == "cpu" and bool(torch.isfinite(g.sum())):
                    # all finite (a NaN/Inf element makes the sum NaN/Inf): on the CPU reading
                    # that waits for nothing, and spares the masked update's passes
                    ewma_update_(state[0], state[1], g, self.beta)
                else:
                    ewma_update_finite_(state[0], state[1], g, self.beta)
                self._updates[name] += 1

    def state(self, name: str) -> tuple[Tensor, Tensor]:
        """``(mean, var)`` of ``name`` (the live tensors).

        Raises:
            KeyError: ``name`` is not a selected parameter, or had no gradient yet.
        """
        if name not in self._state:
            if name in self._known:
                raise KeyError(f"parameter {name!r} has had no gradient at a computed step yet "
                               "(none all finite: a gradient with NaN or Inf does not start it)")
            raise KeyError(unknown_name(name, self._names, "selected parameter"))
        return self._state[name]

    def state_dict(self) -> dict[str, Any]:
        """The EWMA as plain tensors and numbers, for :meth:`load_state_dict` (a checkpoint)."""
        return {"beta": self.beta,
                "mean": {n: m.detach().clone() for n, (m, _) in self._state.items()},
                "var": {n: v.detach().clone() for n, (_, v) in self._state.items()},
                "updates": dict(self._updates)}

    def load_state_dict(self, state: Mapping[str, Any], devices: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, each tensor on ``devices[name]``.

        Raises:
            ValueError: ``beta`` differs, or a name is not a selected parameter.
        """
        if float(state["beta"]) != self.beta:
            raise ValueError(f"the saved EWMA has beta={state['beta']!r}; this one has "
                             f"beta={self.beta!r}")
        unknown = sorted(set(state["mean"]) - self._known)
        if unknown:
            raise ValueError(f"the saved EWMA has parameters that are not selected: "
                             f"{', '.join(unknown[:5])}")
        self._state = {n: (state["mean"][n].to(devices[n], copy=True),
                           state["var"][n].to(devices[n], copy=True)) for n in state["mean"]}
        self._updates = {n: int(k) for n, k in state["updates"].items()}

    def summaries(self, reduced: Mapping[str, tuple[float, float, float, float]] | None = None,
                  ) -> list[tuple[Any, ...]]:
        """One row per parameter for ``RunWriter.write_ewma``: ``(name, beta, updates, numel,
        shape_json, mean_norm, mean_absmax, var_mean, var_max)``.

        ``reduced`` gives ``(mean_norm, mean_absmax, var_mean, var_max)`` per name where the
        state is a shard (reduced over ranks by the caller); ``shapes`` the full shapes."""
        rows = []
        for name, (m, v) in self._state.items():
            shape = list(self.shapes.get(name, m.shape))
            if reduced is not None and name in reduced:
                figures = reduced[name]
            else:
                figures = (float(group_norms([m], accurate=True)[0]), float(m.abs().max()),
                           float(v.mean()), float(v.max()))
            rows.append((name, self.beta, self._updates[name], int(np.prod(shape)),
                         json.dumps(shape), *figures))
        return rows


def unknown_name(name: str, names: list[str], what: str) -> str:
    """``no <what> named <name>``, with the close matches among ``names``."""
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = f"; close names: {', '.join(close)}" if close else ""
    return f"no {what} named {name!r}{hint}"
