"""What a script's own gradient clip did, stored with the step whose gradients it clipped.

When the Monitor closes a step right before the script's ``clip_grad_norm_`` /
``clip_grad_value_`` (:meth:`gradtap.Monitor.step_clipped`, what ``gradtap watch`` and the
framework callbacks call), its statistics are those of the gradients before the clip, and the
step also stores what the clip did:

* stat ``clip_factor`` (kind ``param_grad``) of each selected tensor the clip was given: the
  factor its gradient was multiplied by; for ``clip_grad_norm_`` torch's
  ``min(1, max_norm / (total + 1e-6))``, the same for every tensor; for ``clip_grad_value_``
  the ratio of the tensor's norms after/before (1 for a zero gradient). A tensor a spike rule
  of ``gt.transform`` holds keeps that rule's factor;
* name :data:`CLIP_NAME` (kind ``health``, as the run's other own rows), stats ``norm`` (the total norm the clip returned, of all the
  gradients it was given as one vector, in its ``norm_type``) and ``clip_factor``
  (``clip_grad_norm_`` and ``clip_grads_with_norm_`` only).

A "clip" to ``max_norm=inf`` (how the Hugging Face Trainer measures the norm when
``max_grad_norm`` is 0) clips nothing and stores nothing; the statistics are still taken
right before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from gradtap import _tensorops as ops
from gradtap._monitor.rows import RowBuilder
from gradtap.capture import Clip, Session
from gradtap.store import HEALTH_KIND

__all__ = ["CLIP_NAME", "ClipRows"]

#: The name of the clip's own row (its total norm and factor).
CLIP_NAME = "<clip>"


class ClipRows:
    """The clip's rows of one step: made before the clip runs (:meth:`__init__` reads what
    ``clip_grad_value_`` needs of the gradients before it), added after (:meth:`add`).

    Args:
        clip: the script's clip call, not yet run.
        params: the Monitor's ``(name, parameter)`` pairs.
        session: the model's session (the names a spike rule already stores a factor for).
    """

    def __init__(self, clip: Clip, params: Sequence[tuple[str, nn.Parameter]],
                 session: Session) -> None:
        #: a clip to an infinite norm (how the Hugging Face Trainer measures the norm when it
        #: does not clip) changes nothing: no rows
        self.stores = not (clip.kind != "value" and clip.max_norm == math.inf)
        given = {id(p) for p in clip.parameters} if self.stores else set()
        ruled = session.published("clip_factor")
        self.clip = clip
        self.names = [n for n, p in params
                      if id(p) in given and p.grad is not None and n not in ruled]
        kept = set(self.names)
        self._grads = [p for n, p in params if n in kept]
        self._before: list[tuple[list[int], Tensor]] | None = None
        if clip.kind == "value" and self._grads:
            self._before = ops.norms([p.grad for p in self._grads if p.grad is not None])

    def add(self, rows: RowBuilder) -> None:
        """After the clip ran: copy its norm and factors to the host (one copy) and add them
        to ``rows``."""
        clip = self.clip
        if not self.stores:
            return
        copy = ops.HostCopy()
        per_tensor: Callable[[], np.ndarray] | None = None
        total: Callable[[], np.ndarray] | None = None
        if clip.kind == "value":
            if self._before is not None and all(p.grad is not None for p in self._grads):
                after = ops.norms([p.grad for p in self._grads if p.grad is not None])
                ratios = [(idx, torch.where(b > 0, a / b.clamp_min(torch.finfo(b.dtype).tiny),
                                            torch.ones_like(b)))
                          for (idx, b), (_, a) in zip(self._before, after, strict=True)]
                per_tensor = copy.add_rows(ratios, len(self._grads))
        else:
            norm, factor = clip.norm(), clip.factor()
            if norm is not None and factor is not None:
                h = copy.add(torch.stack([norm.reshape(()).to(torch.float64),
                                          factor.reshape(()).to(norm.device, torch.float64)]))
                total = lambda: copy.get(h)  # noqa: E731
        copy.run()
        if per_tensor is not None:
            rows.add("param_grad", self.names, {"clip_factor": per_tensor()})
        if total is not None:
            norm_v, factor_v = total()
            if self.names:
                rows.add("param_grad", self.names,
                         {"clip_factor": np.full(len(self.names), factor_v)})
            rows.add(HEALTH_KIND, [CLIP_NAME], {"norm": np.array([norm_v]),
                                                 "clip_factor": np.array([factor_v])})
