"""Which tensors of a forward hold samples: those computed from the batch, by data flow.

A tensor's first dimension having ``N`` rows does not make it per-sample: positions
``arange(T)`` with ``T == N``, a table of ``N`` rows, or a buffer's first ``N`` rows are shared
by every sample, and splitting their call into rows would give wrong per-sample gradients
whose mean is still ``.grad`` (the sum check cannot see it). So while the outermost call of
the model runs, a ``TorchFunctionMode`` marks every tensor computed from the call's batched
arguments (those with a row per sample where the call's layout says, ``layout``): the result
of any torch function or tensor method that got a marked tensor, and the tensor an in-place
op or ``out=`` wrote a marked value into. A tensor made without one (a factory call, a
parameter, a buffer, a view of either) is not marked: it is shared by all samples, whatever
its shape. The mark is the forward's own token, so a tensor kept from an earlier forward is
not taken for one of this forward's. Where a shared call's output is watched (``shared``),
each ``add``/``sub``/``mul`` that got a marked tensor is reported too: where the shared output
meets the batch.

Where no forward was followed (an owner called outside the model's call), the row count
decides, as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor
from torch.nn.utils.rnn import PackedSequence
from torch.overrides import TorchFunctionMode

__all__ = ["ADDS", "MEETS", "MULS", "SUBS", "Membership"]

ADDS = frozenset({"add", "__add__", "__radd__", "add_", "__iadd__"})
SUBS = frozenset({"sub", "subtract", "__sub__", "sub_", "__isub__", "__rsub__"})
MULS = frozenset({"mul", "multiply", "__mul__", "__rmul__", "mul_", "__imul__"})
#: The broadcasting ops at which a shared tensor may meet the batch (``shared``).
MEETS = ADDS | SUBS | MULS

# Each Membership marks under an attribute of its own: two open per_samples follow the same
# forward, each with its own token.
_NAMES = itertools.count()


def _marked(obj: Any, attr: str, token: object) -> bool:
    if isinstance(obj, Tensor):
        return getattr(obj, attr, None) is token
    if isinstance(obj, (list, tuple)):
        return any(isinstance(o, Tensor) and getattr(o, attr, None) is token for o in obj)
    return False


def _mark(obj: Any, attr: str, token: object) -> None:
    if isinstance(obj, Tensor):
        try:
            setattr(obj, attr, token)
        except (AttributeError, RuntimeError):  # a tensor type without a __dict__
            pass
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, Tensor):
                _mark(o, attr, token)


class _Follow(TorchFunctionMode):
    """Marks what torch functions compute from marked tensors (see the module doc)."""

    def __init__(self, attr: str, token: object) -> None:
        super().__init__()
        self.attr, self.token = attr, token
        self.meet: Callable[[str, tuple, dict[str, Any] | None, Any], None] | None = None
        self.shared_op: Callable[[tuple, Any], None] | None = None

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **kwargs) if kwargs else func(*args)
        attr, token = self.attr, self.token
        # Written out (no helper, no generator): this runs for every op of the forward.
        for a in args:
            if isinstance(a, Tensor):
                if getattr(a, attr, None) is token:
                    break
            elif isinstance(a, (list, tuple)) and _marked(a, attr, token):
                break
        else:
            if not kwargs or not any(_marked(v, attr, token) for v in kwargs.values()):
                if self.shared_op is not None and args:
                    self.shared_op(args, out)
                return out
        _mark(out, attr, token)
        name = getattr(func, "__name__", "")
        if args and (name == "__setitem__" or name.startswith("__i")
                     or (name.endswith("_") and not name.startswith("_"))):
            _mark(args[0], attr, token)  # written in place: it holds samples now
        if kwargs and "out" in kwargs:
            _mark(kwargs["out"], attr, token)
        if self.meet is not None and name in MEETS:
            self.meet(name, args, kwargs, out)
        return out


class Membership:
    """Follows the model's outermost call (see the module doc)."""

    def __init__(self) -> None:
        self._mode: _Follow | None = None
        self._name: str | None = None
        self._depth = 0
        self.token: object | None = None
        self._attr = f"_gradtap_samples_{next(_NAMES)}"

    @property
    def attr(self) -> str:
        """The attribute this membership marks tensors under."""
        return self._attr

    def report_meetings(self, meet: Callable[[str, tuple, dict[str, Any] | None, Any], None],
                        shared_op: Callable[[tuple, Any], None]) -> None:
        """Until this forward ends, call ``meet(name, args, kwargs, out)`` after each op of
        :data:`MEETS` that got a tensor computed from the batch, and ``shared_op(args, out)``
        after each op that got none."""
        if self._mode is not None:
            self._mode.meet, self._mode.shared_op = meet, shared_op

    @property
    def following(self) -> bool:
        """Whether a forward is being followed now."""
        return self._mode is not None

    def begin(self, name: str, batched: Iterable[Any]) -> None:
        """The outermost call of ``name`` starts; ``batched``: its arguments that hold
        samples (tensors or ``PackedSequence``s)."""
        self.end()
        token = self.token = object()
        for leaf in batched:
            _mark(leaf.data if isinstance(leaf, PackedSequence) else leaf, self._attr, token)
        self._mode = _Follow(self._attr, token)
        self._mode.__enter__()
        self._name, self._depth = name, 1

    def enter(self, name: str) -> None:
        """A call of ``name`` starts inside the followed one (the same module again)."""
        if self._mode is not None and name == self._name:
            self._depth += 1

    def leave(self, name: str) -> None:
        """A call of ``name`` returned or raised: the outermost one ends the following."""
        if self._mode is not None and name == self._name:
            self._depth -= 1
            if self._depth <= 0:
                self.end()

    def end(self) -> None:
        """Stop following (the marks stay, for the checks made since)."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

    def holds_samples(self, t: Any) -> bool:
        """Whether ``t`` (a tensor or ``PackedSequence``) was computed from this forward's
        batch."""
        if isinstance(t, PackedSequence):
            t = t.data
        return self.token is not None and getattr(t, self._attr, None) is self.token
