"""What a Monitor step holds beyond the moments of each tensor: gain, noise scale and the loss.

* stat ``gain`` of kind ``grad_output`` (:mod:`~gradtap._monitor.gain`);
* stats ``gns``, ``gns_trace``, ``gns_sqnorm`` per parameter and for ``"<all>"``
  (:mod:`~gradtap._monitor.gns`);
* the value given to ``mon.step(loss=...)``, as name :data:`LOSS_NAME`, stat ``value``, kind
  ``health`` (under a process group the mean over the ranks of each rank's value).

Everything that crosses ranks goes into the step's :class:`~gradtap.distributed.Reduction`
beside the moments, so the Monitor still makes at most two collectives per step.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradtap._monitor.gain import Gain
from gradtap._monitor.gns import NoiseScale, SampleNorms
from gradtap._monitor.options import GNS_STATS
from gradtap._monitor.rows import RowBuilder
from gradtap._tensorops import HostCopy
from gradtap.capture import HookSet, ScalerWatch
from gradtap.distributed import Reduction
from gradtap.store import HEALTH_KIND

__all__ = ["LOSS_NAME", "HealthStats", "gns_stats", "queue_loss"]

#: The name under which ``mon.step(loss=...)`` stores the loss (stat ``value``).
LOSS_NAME = "<loss>"


def gns_stats(stats: Sequence[str], gns_from: str | None, loss_reduction: str | None,
              per_sample: object) -> tuple[str, ...]:
    """The noise-scale stats among ``stats``, checked against the options that feed them.

    Raises:
        ValueError: a noise-scale stat without ``gns_from``, or the reverse; ``loss_reduction``
            or ``per_sample`` without ``gns_from``.
    """
    chosen = tuple(s for s in stats if s in GNS_STATS)
    if (gns_from is None) != (not chosen):
        raise ValueError(
            "the gradient noise scale needs both a stat (gns, gns_trace, gns_sqnorm) and "
            "gns_from= ('ranks', 'microbatches' or 'samples': where the small batches come "
            f"from); got stats={list(stats)} and gns_from={gns_from!r}")
    if gns_from is None and (loss_reduction is not None or per_sample is not None):
        raise ValueError("loss_reduction= and per_sample= describe the batches of the noise "
                         "scale: they need gns_from=")
    return chosen


class HealthStats:
    """The gain, noise scale and loss of the Monitor's steps.

    Args:
        stats: the Monitor's stats.
        gns_from, gns_beta, loss_reduction, per_sample: the Monitor's options.
        params: ``(name, parameter)`` of the selected parameters.
        model: the unwrapped model.
        hooks: the Monitor's hook set.
        amp: the Monitor's grad scaler watch, if any.
        active: whether the Monitor computes the current step.
    """

    def __init__(self, stats: Sequence[str], *, gns_from: str | None, gns_beta: float,
                 loss_reduction: str | None, per_sample: SampleNorms | None,
                 params: Sequence[tuple[str, nn.Parameter]], model: nn.Module, hooks: HookSet,
                 amp: ScalerWatch | None, active: Callable[[], bool]) -> None:
        self.gns_stats = gns_stats(stats, gns_from, loss_reduction, per_sample)
        self.gain = Gain() if "gain" in stats else None
        self.gns = None if gns_from is None else NoiseScale(
            gns_from, [(n, p) for n, p in params if p.requires_grad], model, hooks,
            beta=gns_beta, loss_reduction=loss_reduction, per_sample=per_sample, amp=amp,
            active=active)

    def config(self) -> dict[str, Any]:
        """The options, for the run metadata."""
        gns = self.gns
        return {"gns_from": None if gns is None else gns.source,
                "gns_beta": None if gns is None else gns.beta,
                "loss_reduction": None if gns is None else gns.reduction}

    def queue(self, red: Reduction, copy: HostCopy, *, reduce: bool, world_size: int,
              grads: dict[str, Tensor], counts: dict[str, bool], loss: object,
              batch_size: int | Sequence[int] | None, device: torch.device
              ) -> Callable[[RowBuilder], None] | None:
        """Queue the step's gain, noise scale and loss on ``red`` / ``copy``; return what adds
        their rows after the copy ran (``None`` when there is nothing). ``grads``: the step's
        unscaled gradients (local shards under FSDP2), of which those whose ``counts`` is true
        count toward global norms."""
        gain = None if self.gain is None else self.gain.queue(red)
        gns = None if self.gns is None else self.gns.queue(red, grads, counts, batch_size,
                                                           device)
        value = None if loss is None else queue_loss(loss, red, copy, reduce=reduce,
                                                     world_size=world_size)
        if gain is None and gns is None and value is None:
            return None

        def add(rows: RowBuilder) -> None:
            if reduce and red.host_mismatch():
                raise RuntimeError("ranks reduced different statistics: every rank must select "
                                   "the same tensors, run the same modules, and pass loss= "
                                   "(or not) alike")
            if gain is not None and gain[0]:
                rows.add("grad_output", gain[0], {"gain": gain[1](red.host_sums)})
            if gns is not None and self.gns is not None:
                rows.add("param_grad", *self.gns.finish(red, gns, self.gns_stats))
            if value is not None:
                rows.add(HEALTH_KIND, [LOSS_NAME], {"value": value()})

        return add

    def end_step(self) -> None:
        """Forget the step's records and pieces."""
        if self.gain is not None:
            self.gain.clear()
        if self.gns is not None:
            self.gns.end_step()

    def state_dict(self) -> dict[str, Any] | None:
        """The noise scale's EMAs (``None`` without them)."""
        return None if self.gns is None else self.gns.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (a state without EMAs leaves them empty)."""
        if self.gns is not None and state is not None:
            self.gns.load_state_dict(state)


def queue_loss(loss: object, red: Reduction, copy: HostCopy, *, reduce: bool, world_size: int
               ) -> Callable[[], np.ndarray]:
    """Queue the value of ``loss`` (a one-element tensor or a real number); return a function
    giving it ``[1]`` after the copy (the mean over ranks when ``reduce``).

    Raises:
        TypeError: ``loss`` is neither a tensor nor a real number.
        ValueError: a tensor with other than one element.

    Example:
        >>> import torch
        >>> red, copy = Reduction(), HostCopy()
        >>> value = queue_loss(torch.tensor(0.25), red, copy, reduce=False, world_size=1)
        >>> copy.run(); value().tolist()
        [0.25]
    """
    if isinstance(loss, Tensor):
        if loss.numel() != 1:
            raise ValueError(f"mon.step(loss=...) takes the step's scalar loss; got a tensor of "
                             f"shape {tuple(loss.shape)}")
        value = loss.detach().reshape(1).to(torch.float64)
    elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        value = torch.tensor([float(loss)], dtype=torch.float64)
    else:
        raise TypeError(f"mon.step(loss=...) takes a tensor or a number; got "
                        f"{type(loss).__name__}")
    if reduce:
        h = red.add_sums(value, "loss")
        return lambda: red.host_sums(h) / world_size
    hc = copy.add(value)
    return lambda: copy.get(hc).reshape(1)
