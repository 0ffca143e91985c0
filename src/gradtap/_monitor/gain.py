"""Kind ``grad_output``'s stat ``gain``: per module, ``|dL/d input| / |dL/d output|`` over its
calls in the step.

Each record of a call gives the squared norm of its first floating input that received a
gradient and of each output slot's gradient (device scalars, no host sync inside backward); at
the step they are summed per ``"<module>:<output path>"`` (over ranks too, in the step's one SUM
collective) and their ratio's square root is the gain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from gradtap.distributed import Reduction

__all__ = ["Gain", "sqnorm"]

def sqnorm(g: Tensor) -> Tensor:
    """Squared L2 norm of ``g`` as a float64 0-dim tensor on its device (float32 accumulation at
    least, so half-precision gradients do not lose it; no host sync)."""
    acc = torch.promote_types(g.dtype, torch.float32)
    return torch.linalg.vector_norm(g.detach(), dtype=acc).to(torch.float64) ** 2


class Gain:
    """Squared norms of the input and output gradients of each watched call, summed per name.

    Example:
        >>> import torch
        >>> gain = Gain()
        >>> gain.record({"input": torch.tensor([3.0, 4.0])},
        ...             [("fc:output", torch.tensor([1.0, 0.0]))])
        >>> red = Reduction(); names, values = gain.queue(red); red.run()
        >>> names, values(red.sums).tolist()
        (['fc:output'], [5.0])
    """

    def __init__(self) -> None:
        # per "<module>:<output path>": the squared norms of the input and of that output's
        # gradient, one of each per call
        self._num: dict[str, list[Tensor]] = {}
        self._den: dict[str, list[Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self._den)

    def record(self, grad_inputs: Mapping[str, Tensor | None],
               outputs: list[tuple[str, Tensor]]) -> None:
        """Note one call: its input gradients by argument and its ``(name, output gradient)``.

        A call none of whose floating inputs received a gradient (the first layer, fed data)
        has no gain and is left out."""
        first = next((g for g in grad_inputs.values()
                      if g is not None and g.is_floating_point() and g.numel()), None)
        if first is None or not outputs:
            return
        sq_in = sqnorm(first)
        for name, g in outputs:
            self._num.setdefault(name, []).append(sq_in)
            self._den.setdefault(name, []).append(sqnorm(g))

    def queue(self, red: Reduction) -> tuple[list[str], Callable[[Callable[[int], np.ndarray]],
                                                                   np.ndarray]]:
        """Queue the step's sums on ``red``; return the names and a function that, given how to
        read a block of ``red`` (``host_sums`` after the copy, or ``sums``), gives the gains."""
        names = sorted(self._den)
        if not names:
            return [], lambda read: np.zeros(0)
        num = torch.stack([torch.stack(self._num[n]).sum() for n in names])
        den = torch.stack([torch.stack(self._den[n]).sum() for n in names])
        k = len(names)
        h = red.add_sums(torch.cat([num, den.to(num.device)]), "gain\x01" + "\x01".join(names))

        def gains(read: Callable[[int], np.ndarray]) -> np.ndarray:
            v = np.asarray(read(h), dtype=np.float64)
            with np.errstate(all="ignore"):
                return np.sqrt(v[:k] / v[k:])

        return names, gains

    def clear(self) -> None:
        """Forget the step's calls."""
        self._num = {}
        self._den = {}
