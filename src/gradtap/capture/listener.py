"""The consumer interface of a tap: one object whose methods capture calls per module call.

A consumer subclasses :class:`Listener` and overrides what it needs; capture installs only
the hooks the overridden methods require (a listener that rewrites no ``grad_output`` costs
nothing there). Methods run inside the forward or the backward: they must not sync with the
host.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from gradtap.record import GradRecord

__all__ = ["Listener", "overrides"]


class Listener:
    """What a :class:`~gradtap.capture.Tap` tells its consumer, per call of a tapped module.

    ``name`` is the module's qualified name and ``call`` the index its record will carry.
    A ``rewrite_*`` method returns a replacement gradient (same shape, dtype and device) or
    ``None`` to leave it; capture applies it before anything upstream sees the gradient, and
    the record holds the replacement.

    Replays (see :mod:`gradtap.capture.replay`): while a replay owned by another listener
    runs, none of these methods is called unless ``sees_replays`` is True. The default is
    False: a replay is not a training step.

    Example:
        >>> import torch, gradtap as gt
        >>> from gradtap.capture import Listener
        >>> class Halve(Listener):
        ...     def rewrite_grad_output(self, name, call, path, grad):
        ...         return grad / 2
        >>> lin = torch.nn.Linear(3, 1)
        >>> x = torch.ones(1, 3, requires_grad=True)
        >>> with gt.tap(lin, "", listener=Halve()) as t:
        ...     lin(x).sum().backward()
        >>> t.records[0].grad_outputs["output"]
        tensor([[0.5000]])
    """

    #: Whether this listener's methods run during a replay owned by another listener.
    sees_replays: ClassVar[bool] = False

    def on_forward(self, name: str, call: int, module: nn.Module, inputs: dict[str, Tensor],
                   outputs: dict[str, Tensor]) -> None:
        """After each tapped forward call (not a checkpoint recomputation): its tensor
        arguments and outputs by slot key (``outputs`` is empty for a call that returned None)."""

    def rewrite_grad_output(self, name: str, call: int, path: str, grad: Tensor) -> Tensor | None:
        """dL/d(output ``path``) as it enters the call's backward; a replacement or None."""
        return None

    def rewrite_grad_input(self, name: str, call: int, key: str, grad: Tensor) -> Tensor | None:
        """What the call sends to its input ``key``; a replacement or None."""
        return None

    def rewrite_param_grad(self, name: str, call: int, param: str, grad: Tensor) -> Tensor | None:
        """The call's contribution to parameter ``param`` (relative name) before it is
        accumulated; a replacement or None."""
        return None

    def on_record(self, record: GradRecord) -> None:
        """Each record as it completes (possibly inside the backward)."""


def overrides(listener: Listener | None, method: str) -> bool:
    """Whether ``listener`` overrides ``Listener.<method>`` (capture hooks only for those)."""
    return listener is not None and getattr(type(listener), method) is not getattr(Listener, method)
