"""The per-model session: what every consumer needs about a model's environment, resolved once.

``session(model)`` gives the one :class:`Session` of a model (the same object for the model
and for any wrapper around it: DDP, ``torch.compile``, FSDP1, checkpoint and framework
wrappers), kept in a weak map and counted by the consumers attached to it. It holds:

* the **root** behind the wrappers and its **clean names** (wrapper components such as
  ``_checkpoint_wrapped_module.`` dropped): one unwrap for every consumer;
* the **selection** with one meaning: :meth:`Session.modules` for module selectors and
  :meth:`Session.parameters`, where a module selector selects its parameters;
* the **distributed mode** (:meth:`Session.distributed`: none, DDP, FSDP2 or HSDP, with the
  rank and world size);
* the **loss scaler**: one :class:`~gradtap.capture.ScalerWatch` per scaler for every
  consumer (:meth:`Session.scaler`), and its unscaled view of a gradient
  (:meth:`ScalerWatch.unscaled`, the one formula);
* **one set of hooks per module** (:mod:`gradtap.capture.modhooks`) and **replays**
  (:mod:`gradtap.capture.replay`), which every consumer shares through capture.

Example:
    >>> import torch, gradtap as gt
    >>> from gradtap.capture import session
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> session(torch.nn.DataParallel(net)) is session(net)
    True
    >>> [name for name, _ in session(net).parameters("0")]
    ['0.weight', '0.bias']
    >>> session(net).distributed()
    Distributed(mode='none', rank=0, world=1)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Literal, NamedTuple, TypeAlias

import torch
from torch import Tensor, nn

from gradtap._tensorops.sharded import is_sharded, world
from gradtap._types import Selector
from gradtap.capture.amp import ScalerWatch, check_scaler
from gradtap.select import clean_name, select_modules, select_parameters, unwrap_model

__all__ = ["Distributed", "Session", "session"]


#: What a consumer publishes to the others (see :meth:`Session.publish`).
Source: TypeAlias = Callable[[], Mapping[str, Tensor]]


class Distributed(NamedTuple):
    """How a model trains across processes: ``mode`` is ``"none"`` (one process, or no
    process group), ``"ddp"`` (replicated parameters, gradients all-reduced), ``"fsdp2"``
    (``fully_shard``: DTensor parameters on a 1-D mesh) or ``"hsdp"`` (a 2-D replicate x
    shard mesh)."""

    mode: Literal["none", "ddp", "fsdp2", "hsdp"]
    rank: int
    world: int


class Session:
    """Everything consumers need about one model; see the module docstring. Made by
    :func:`session`, never directly."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.consumers = 0
        self._scalers: dict[int, tuple[torch.amp.GradScaler, ScalerWatch]] = {}
        self._sources: dict[str, list[Source]] = {}

    # -- names and selection ---------------------------------------------------------------

    def modules(self, select: Selector) -> list[tuple[str, nn.Module]]:
        """The ``(qualified name, module)`` pairs ``select`` picks (names as ``named_modules()``
        of the root gives them)."""
        return select_modules(self.root, select)

    def parameters(self, select: Selector) -> list[tuple[str, nn.Parameter]]:
        """The ``(clean name, parameter)`` pairs ``select`` picks, a module selector selecting
        its parameters (see :func:`gradtap.select.select_parameters`)."""
        return [(clean_name(n), p) for n, p in select_parameters(self.root, select)]

    # -- environment -----------------------------------------------------------------------

    def distributed(self) -> Distributed:
        """The distributed mode now (a process group may be made after the session)."""
        rank, size = world()
        if size == 1:
            return Distributed("none", rank, size)
        sharded = next((p for p in self.root.parameters() if is_sharded(p)), None)
        if sharded is not None:
            ndim = sharded.device_mesh.ndim  # type: ignore[attr-defined]
            return Distributed("hsdp" if ndim > 1 else "fsdp2", rank, size)
        return Distributed("ddp", rank, size)

    def scaler(self, scaler: torch.amp.GradScaler | None, owner: str) -> ScalerWatch | None:
        """The one :class:`ScalerWatch` of ``scaler`` for every consumer of this session
        (``None`` for ``None``); ``owner`` names the consumer in the error for a bad
        argument. The watch lasts as long as the session."""
        if scaler is None:
            return None
        check_scaler(scaler, owner)
        held = self._scalers.get(id(scaler))
        if held is None:
            held = self._scalers[id(scaler)] = (scaler, ScalerWatch(scaler))
        return held[1]

    # -- what consumers tell each other ---------------------------------------------------

    def publish(self, topic: str, source: Source) -> Callable[[], None]:
        """Offer ``source()`` (a mapping of clean parameter names to 0-dim tensors, read when
        asked) under ``topic`` to the other consumers of the model; returns the function that
        withdraws it. How a transform's spike rules tell a Monitor on the same model what
        they did (topic ``"clip_factor"``) without either importing the other."""
        self._sources.setdefault(topic, []).append(source)

        def withdraw() -> None:
            sources = self._sources.get(topic, [])
            if source in sources:
                sources.remove(source)

        return withdraw

    def published(self, topic: str) -> dict[str, Tensor]:
        """What the sources under ``topic`` hold now, merged (a later source wins a name)."""
        out: dict[str, Tensor] = {}
        for source in self._sources.get(topic, ()):
            out.update(source())
        return out

    # -- lifetime --------------------------------------------------------------------------

    def attach(self) -> Session:
        """Count one more consumer; returns the session."""
        self.consumers += 1
        return self

    def detach(self) -> None:
        """Count one consumer less; the last one releases what the session holds (the scaler
        watches) and the session itself. Safe to call once per :meth:`attach`."""
        self.consumers -= 1
        if self.consumers > 0:
            return
        for _, watch in self._scalers.values():
            watch.remove()
        self._scalers.clear()
        if _SESSIONS.get(self.root) is self:
            del _SESSIONS[self.root]

    def __repr__(self) -> str:
        return (f"<Session of {type(self.root).__name__}: {self.consumers} consumer(s), "
                f"{self.distributed().mode}>")


_SESSIONS: weakref.WeakKeyDictionary[nn.Module, Session] = weakref.WeakKeyDictionary()


def session(model: nn.Module, owner: str = "gradtap") -> Session:
    """The session of ``model`` (made on first use): the same for a model and any training
    wrapper around it.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (the message starts with ``owner``, the
            verb the user called).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{owner} needs an nn.Module; got {type(model).__name__}")
    root = unwrap_model(model)
    found = _SESSIONS.get(root)
    if found is None:
        found = _SESSIONS[root] = Session(root)
    return found
