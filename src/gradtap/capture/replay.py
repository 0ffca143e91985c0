"""Replays: running a module call or a step again, and what the other consumers see meanwhile.

A replay (``gt.detect`` runs one to find where a NaN came from) is not a training step. While
one runs inside :func:`replaying`, the rule is:

* the replay's owner (a :class:`~gradtap.capture.Listener`) sees every call, record and
  rewrite of the replayed step;
* any other listener sees the replay only if it declares ``sees_replays = True``; the
  consumers of gradtap (Monitor, transform, per_sample) do not, so a replay advances no
  statistic, no transform state and no per-sample result, and rewrites nothing;
* a :class:`~gradtap.capture.HookSet` sees it only if made with ``sees_replays=True``.

:func:`in_recomputation` says whether a forward call is an activation-checkpoint
recomputation (made inside a backward to refill saved tensors), which no consumer counts as
a call; inside a replay started at the end of a backward, forward calls of that backward
count as real calls again.

The replay kit: what a call depends on besides its arguments and parameters, kept when it is
made and put back around its replay, so that the replay sees what the call saw and leaves no
trace (``per_sample``'s fallback, ``detect``'s replay and ``explain`` use it):

* :class:`AutocastState`: the autocast settings of every device in :data:`AUTOCAST_DEVICES`,
  re-entered for the replay;
* :class:`RngState`: the CPU generator and some CUDA generators, restored (to draw the same
  numbers again, or to undo the replay's draws) or compared (did the replay draw any?);
* :func:`buffers_restored`: every buffer of a module back, same tensor and same values
  (BatchNorm's running statistics move once per real step, not again in a replay).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from gradtap.capture.engine import graph_task_id

__all__ = ["AUTOCAST_DEVICES", "AutocastState", "RngState", "buffers_restored",
           "in_recomputation", "replaying", "stands_aside"]


class _ReplayNow:
    """The replay running now (one per process: hooks of a backward run on other threads):
    the listener whose hooks run, and the backward (graph task) in which forward calls still
    count as real calls (-1: none, the usual case)."""

    __slots__ = ("owner", "task")

    def __init__(self) -> None:
        self.owner: Any = None
        self.task = -1


_NOW = _ReplayNow()


def stands_aside(listener: Any) -> bool:
    """Whether hooks working for ``listener`` (``None``: a tap without one) must do nothing
    because a replay owned by another listener runs."""
    owner = _NOW.owner
    return (owner is not None and owner is not listener
            and not getattr(listener, "sees_replays", False))


def replay_running() -> bool:
    """Whether a replay runs now."""
    return _NOW.owner is not None


def in_recomputation() -> bool:
    """Whether a forward call made now is an activation-checkpoint recomputation: made inside
    a backward (other than the one a running replay started in), only to refill saved
    tensors."""
    return graph_task_id() != _NOW.task


@contextmanager
def replaying(owner: Any) -> Iterator[None]:
    """Run a model's forward and backward again, seen by ``owner`` (a listener) and by the
    listeners and hook sets that declare ``sees_replays``; every other hook does nothing.

    Forward calls made inside the backward now running (a replay started at its end) count as
    real calls; forward calls inside the replay's own backward (activation checkpoint
    recomputation) still do not. Not reentrant.
    """
    if _NOW.owner is not None:
        raise RuntimeError("a replay is already running; replays do not nest")
    _NOW.owner, _NOW.task = owner, graph_task_id()
    try:
        yield
    finally:
        _NOW.owner, _NOW.task = None, -1


# -- the replay kit -----------------------------------------------------------------------------

#: The devices whose autocast state a call is made under: ``"cpu"``, and ``"cuda"`` where
#: CUDA is available.
AUTOCAST_DEVICES: tuple[str, ...] = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


class AutocastState(NamedTuple):
    """The autocast settings in force on every device of :data:`AUTOCAST_DEVICES`, to replay a
    call under the ones it was made under.

    Attributes:
        settings: ``(device, enabled, dtype)`` per device, in :data:`AUTOCAST_DEVICES` order.

    Example:
        >>> import torch
        >>> from gradtap.capture import AutocastState
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     state = AutocastState.capture()
        >>> torch.is_autocast_enabled("cpu")
        False
        >>> with state.entered():
        ...     (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        (True, torch.bfloat16)
    """

    settings: tuple[tuple[str, bool, torch.dtype], ...]

    @classmethod
    def capture(cls) -> AutocastState:
        """Return the settings in force now."""
        enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
        # The usual call (autocast off, default dtypes) shares one state: this runs per call.
        for d, _, default in _OFF.settings:
            if enabled(d) or dtype(d) != default:
                return tuple.__new__(cls, (tuple([(e, enabled(e), dtype(e))
                                                  for e in AUTOCAST_DEVICES]),))
        return _OFF

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block under these settings (on and off alike), then the previous ones."""
        with ExitStack() as stack:
            for device, enabled, dtype in self.settings:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            yield


#: The usual call's state: autocast off on every device, with the dtypes in force when gradtap
#: was imported (torch's defaults, as a rule).
_OFF = AutocastState(tuple((d, False, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES))


class RngState:
    """The state of the CPU random number generator and of the CUDA generators of ``cuda``
    devices, saved when made: put back to draw the same numbers again (or to undo a replay's
    draws), or compared with the generators' state now (did anything draw?).

    Args:
        cuda: the CUDA devices (indices or ``torch.device``) whose generators are saved too.

    Example:
        >>> import torch
        >>> from gradtap.capture import RngState
        >>> saved = RngState()
        >>> a = torch.rand(2)
        >>> saved.moved()
        True
        >>> saved.restore()
        >>> saved.moved()
        False
        >>> torch.equal(torch.rand(2), a)
        True
    """

    __slots__ = ("cpu", "cuda", "devices")

    def __init__(self, cuda: Sequence[int | torch.device] = ()) -> None:
        self.cpu: Tensor = torch.default_generator.get_state()
        if cuda:
            self.devices = tuple(cuda)
            self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
        else:  # the usual case, made per call of a model: nothing else to do
            self.devices, self.cuda = (), []

    def restore(self) -> None:
        """Set every generator saved back to its saved state."""
        torch.default_generator.set_state(self.cpu)
        for d, state in zip(self.devices, self.cuda, strict=True):
            torch.cuda.set_rng_state(state, d)

    def moved(self) -> bool:
        """Whether any generator saved is in another state now (it drew numbers)."""
        return not torch.equal(self.cpu, torch.default_generator.get_state()) or any(
            not torch.equal(state, torch.cuda.get_rng_state(d))
            for d, state in zip(self.devices, self.cuda, strict=True))


@contextmanager
def buffers_restored(module: nn.Module) -> Iterator[None]:
    """Put every buffer of ``module`` and its submodules back after the block: the same tensor
    under each name (one the block assigned is replaced by the original) with the same values.

    Example:
        >>> import torch
        >>> from gradtap.capture import buffers_restored
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> with buffers_restored(bn):
        ...     _ = bn(torch.randn(4, 2) + 3)
        ...     bool(bn.running_mean.abs().sum() > 0)
        True
        >>> bn.running_mean, int(bn.num_batches_tracked)
        (tensor([0., 0.]), 0)
    """
    saved: list[tuple[nn.Module, str, Tensor, Tensor]] = []
    values: dict[int, Tensor] = {}  # a buffer shared by two modules is copied once
    with torch.no_grad():
        for m in module.modules():
            for name, b in m.named_buffers(recurse=False, remove_duplicate=False):
                value = values.get(id(b))
                if value is None:
                    value = values[id(b)] = b.detach().clone()
                saved.append((m, name, b, value))
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, value in saved:
                if getattr(m, name, None) is not b:
                    setattr(m, name, b)
                b.copy_(value)
