"""Where a call's arguments and outputs hold each sample, for a per-sample replay.

By default every tensor argument and output holds sample ``i`` at index ``i`` along
``batch_dim``; an argument with another size there (or without that dim) is shared by all
samples, and a 0-dim output is a value reduced over the batch (a loss computed inside the call:
each sample's replay gives its own value, whose cotangent is the recorded gradient as is).
A few torch layers keep samples elsewhere, whatever ``batch_dim`` says:

* ``nn.RNN``/``GRU``/``LSTM``: ``input`` and ``output`` at dim 0 with ``batch_first``, else 1;
  ``hx`` and the final states (``h_n``, ``c_n``) always at dim 1. A ``PackedSequence`` input
  has one sample per sequence: sample ``i`` is its own one-sequence ``PackedSequence`` (the
  rows of the packed data that belong to it), and so is the packed output's gradient.
* ``nn.MultiheadAttention``: ``query``, ``key``, ``value`` and the output at dim 0 with
  ``batch_first``, else 1; ``key_padding_mask`` and the attention weights always at dim 0; a
  3-D ``attn_mask`` holds ``num_heads`` rows per sample along dim 0.
* ``nn.EmbeddingBag`` with a flat input and ``offsets``: one sample per bag; sample ``i`` is
  its indices (and ``per_sample_weights``) with offsets ``[0]``.

Any other argument that is a ``PackedSequence`` also has one sample per sequence, and so does
an output ``PackedSequence`` made with the batch sizes and order of a packed argument (a
recurrent layer written with cells: ``CallSplit.note_outputs``). An argument that the forward
was followed through (``membership``) and that was not computed from the batch is shared,
whatever its size along ``batch_dim``. Slicing
along a dim is vectorizable (``torch.func.vmap``); the others are taken one sample at a time.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from gradtap._samples.fallback_errors import CannotReplay

__all__ = ["CallSplit", "Dim", "KeptCall", "Rows", "Scalar", "Slot", "sample_count", "split_call"]


class Slot:
    """How one argument or output gradient holds the samples."""

    vmappable = True

    def take(self, t: Any, i: int) -> Any:
        """Sample ``i``'s part, as a call on that sample alone takes it (or gives it)."""
        raise NotImplementedError

    def stacked(self, t: Tensor, n: int) -> Tensor:
        """Every sample's part stacked along a new dim 0 (vectorizable slots only)."""
        raise NotImplementedError


class Dim(Slot):
    """``group`` consecutive entries per sample along ``dim`` (1 for most tensors)."""

    def __init__(self, dim: int, group: int = 1) -> None:
        self.dim, self.group = dim, group

    def take(self, t: Tensor, i: int) -> Tensor:
        return t.narrow(self.dim, i * self.group, self.group)

    def stacked(self, t: Tensor, n: int) -> Tensor:
        return t.unflatten(self.dim, (n, self.group)).movedim(self.dim, 0)

    def rows(self, t: Tensor) -> int | None:
        """How many samples ``t`` holds here, or ``None`` when it cannot hold whole ones."""
        if t.dim() <= self.dim or t.shape[self.dim] % self.group:
            return None
        return t.shape[self.dim] // self.group


class Rows(Slot):
    """Sample ``i`` is the rows ``index[i]`` along dim 0 (ragged: bags, packed sequences)."""

    vmappable = False

    def __init__(self, index: list[Tensor]) -> None:
        self.index = index

    def take(self, t: Tensor, i: int) -> Tensor:
        return t.index_select(0, self.index[i].to(t.device))


class Fixed(Slot):
    """Sample ``i`` gets ``values[i]`` (the offsets of a bag on its own)."""

    vmappable = False

    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def take(self, t: Any, i: int) -> Any:
        return self.values[i]


class Packed(Slot):
    """A ``PackedSequence`` argument: sample ``i`` is its ``i``-th sequence, packed alone."""

    vmappable = False

    def __init__(self, seq: PackedSequence) -> None:
        self.rows = Rows(packed_rows(seq))
        self.seq = seq

    def made_like(self, batch_sizes: Tensor | None, unsorted: Tensor | None) -> bool:
        """Whether a packed output with these fields holds the sequences as this one does."""
        mine = self.seq.unsorted_indices
        return (batch_sizes is not None and _equal(batch_sizes, self.seq.batch_sizes)
                and ((unsorted is None and mine is None)
                     or (unsorted is not None and mine is not None and _equal(unsorted, mine))))

    def take(self, t: PackedSequence, i: int) -> PackedSequence:
        data = self.rows.take(t.data, i)
        ones = torch.ones(data.shape[0], dtype=torch.int64)
        return PackedSequence(data, ones, None, None)


def _equal(a: Tensor, b: Tensor) -> bool:
    return a is b or (a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu())))


class Scalar(Slot):
    """A 0-dim output reduced over the batch: every sample's replay gets the same cotangent."""

    def take(self, t: Tensor, i: int) -> Tensor:
        return t


def packed_rows(seq: PackedSequence) -> list[Tensor]:
    """The rows of ``seq.data`` of each sequence, in the order the sequences were given."""
    sizes = seq.batch_sizes.to("cpu")
    starts = torch.cumsum(sizes, 0) - sizes
    n = int(sizes[0]) if sizes.numel() else 0
    order = (seq.unsorted_indices.to("cpu") if seq.unsorted_indices is not None
             else torch.arange(n))
    return [starts[: int((sizes > k).sum())] + k for k in order.tolist()]


def _class_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward of the module's class, bound to it: the signature the layouts name, also
    while ``per_sample(own_grad=True)`` has set a forward of its own on the instance."""
    return type(module).forward.__get__(module, type(module))


def _signature_names(module: nn.Module, args: tuple | list, kwargs: dict[str, Any]
                     ) -> dict[str, Any] | None:
    try:
        bound = inspect.signature(_class_forward(module)).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return dict(bound.arguments)


def _positional_names(module: nn.Module) -> list[str]:
    params = inspect.signature(_class_forward(module)).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


Layout = tuple[dict[str, Slot | None], Callable[[str], Slot | None], int]

#: A kept call's arguments as passed, its integer outputs by path and, where the forward was
#: followed, whether each argument was computed from the batch (``split_call``).
KeptCall = tuple[tuple, dict[str, Any], dict[str, Tensor], list[bool] | None]


def _rnn(module: nn.RNNBase, named: dict[str, Any]) -> Layout | None:
    inp = named.get("input")
    slot: Slot
    out0: Slot
    if isinstance(inp, PackedSequence):
        packed = Packed(inp)
        slot, out0, n, first = packed, packed.rows, len(packed.rows.index), "0.0"
    elif isinstance(inp, Tensor) and inp.dim() == 3:
        d = 0 if module.batch_first else 1
        slot = out0 = Dim(d)
        n, first = inp.shape[d], "0"
    else:
        return None
    args: dict[str, Slot | None] = {"input": slot, "hx": Dim(1)}

    def output(path: str) -> Slot | None:
        if path == first:
            return out0
        return Dim(1) if path.split(".")[0] == "1" else None

    return args, output, n


def _attention(module: nn.MultiheadAttention, named: dict[str, Any]) -> Layout | None:
    query = named.get("query")
    if not isinstance(query, Tensor) or query.dim() != 3:
        return None
    d = 0 if module.batch_first else 1
    args: dict[str, Slot | None] = {k: Dim(d) for k in ("query", "key", "value")}
    mask = named.get("key_padding_mask")
    args["key_padding_mask"] = Dim(0) if isinstance(mask, Tensor) and mask.dim() == 2 else None
    attn = named.get("attn_mask")
    args["attn_mask"] = (Dim(0, module.num_heads) if isinstance(attn, Tensor) and attn.dim() == 3
                         else None)
    outputs = {"0": Dim(d), "1": Dim(0)}
    return args, outputs.get, query.shape[d]


def _bag(module: nn.EmbeddingBag, named: dict[str, Any]) -> Layout | None:
    inp, offsets = named.get("input"), named.get("offsets")
    if not isinstance(inp, Tensor) or inp.dim() != 1 or not isinstance(offsets, Tensor):
        return None
    starts = offsets.to("cpu").tolist()
    if module.include_last_offset:
        starts, end = starts[:-1], starts[-1]
    else:
        end = inp.shape[0]
    ends = [*starts[1:], end] if starts else []
    index = [torch.arange(s, e) for s, e in zip(starts, ends, strict=True)]
    rows = Rows(index)
    alone = [offsets.new_tensor([0, e - s] if module.include_last_offset else [0])
             for s, e in zip(starts, ends, strict=True)]
    args: dict[str, Slot | None] = {"input": rows, "offsets": Fixed(alone),
                                    "per_sample_weights": rows}
    return args, {"output": Dim(0)}.get, len(index)


_LAYOUTS: list[tuple[type[nn.Module], Callable[[Any, dict[str, Any]], Layout | None]]] = [
    (nn.RNN, _rnn), (nn.GRU, _rnn), (nn.LSTM, _rnn), (nn.MultiheadAttention, _attention),
    (nn.EmbeddingBag, _bag)]


def _layout(module: nn.Module, args: tuple | list, kwargs: dict[str, Any]) -> Layout | None:
    for cls, fn in _LAYOUTS:
        # Only the layer's own forward: a subclass with its own forward has its own layout.
        if isinstance(module, cls) and type(module).forward is cls.forward:
            named = _signature_names(module, args, kwargs)
            return None if named is None else fn(module, named)
    return None


def sample_count(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> int | None:
    """The number of samples of a call that a known layout or a ``PackedSequence`` argument
    decides (``None``: count rows along ``batch_dim``)."""
    layout = _layout(module, args, kwargs)
    if layout is not None:
        return layout[2]
    for leaf in _leaves((args, kwargs)):
        if isinstance(leaf, PackedSequence):
            return int(leaf.batch_sizes[0]) if leaf.batch_sizes.numel() else 0
    return None


def leaves(obj: Any) -> list[Any]:
    """Every tensor and ``PackedSequence`` leaf of nested arguments, in order."""
    return _leaves(obj)


def _leaves(obj: Any) -> list[Any]:
    out: list[Any] = []

    def add(leaf: Any) -> Any:
        out.append(leaf)
        return leaf

    _map(obj, add)
    return out


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild arguments with ``fn`` applied to every tensor and ``PackedSequence`` leaf."""
    if isinstance(obj, (Tensor, PackedSequence)):
        return fn(obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple):
        mapped = [_map(v, fn) for v in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else tuple(mapped)
    if isinstance(obj, list):
        return [_map(v, fn) for v in obj]
    return obj


class CallSplit:
    """One call's arguments split into samples, and the slots of its output gradients."""

    def __init__(self, module: nn.Module, args: tuple | list, kwargs: dict[str, Any], n: int,
                 batch_dim: int, members: list[bool] | None = None) -> None:
        self.n, self.batch_dim = n, batch_dim
        self.args, self.kwargs = tuple(args), dict(kwargs)
        layout = _layout(module, self.args, kwargs)
        self._output = layout[1] if layout is not None else (lambda _path: None)
        named: dict[str, Slot | None] = layout[0] if layout is not None else {}
        # Each leaf's slot, in the order _map visits (args, kwargs).
        self.slots: list[Slot | None] = []
        positional = _positional_names(module) if named else []
        keyed = [(positional[i] if i < len(positional) else "", v) for i, v in enumerate(self.args)]
        for key, value in [*keyed, *self.kwargs.items()]:
            _map(value, functools.partial(self._note, slot=named.get(key, "default")))
        if members is not None:  # not computed from the batch: shared, whatever its rows
            self.slots = [s if m else None for s, m in zip(self.slots, members, strict=True)]
        self.vmappable = all(s is None or s.vmappable for s in self.slots)
        self._packed: dict[str, Slot] = {}  # output path -> a packed argument's rows

    def _note(self, leaf: Any, slot: Slot | None | str) -> Any:
        if slot == "default":
            slot = self._default(leaf)
        elif isinstance(slot, Dim) and slot.rows(leaf) != self.n:
            slot = None  # unbatched or shared (a 2-D mask)
        self.slots.append(slot if not isinstance(slot, str) else None)
        return leaf

    def _default(self, leaf: Any) -> Slot | None:
        if isinstance(leaf, PackedSequence):
            return Packed(leaf)
        slot = Dim(self.batch_dim)
        return slot if slot.rows(leaf) == self.n else None

    def batched(self) -> list[Any]:
        """The arguments (tensors, ``PackedSequence``s) that hold samples."""
        return [leaf for leaf, slot in zip(_leaves((self.args, self.kwargs)), self.slots,
                                           strict=True) if slot is not None]

    def _each(self, fn: Callable[[Any, Slot | None], Any]) -> tuple[tuple, dict[str, Any]]:
        slots = iter(self.slots)
        args, kwargs = _map((self.args, self.kwargs), lambda leaf: fn(leaf, next(slots)))
        return args, kwargs

    def one(self, i: int) -> tuple[tuple, dict[str, Any]]:
        """The arguments of sample ``i`` alone (tensors detached)."""
        return self._each(lambda leaf, slot: _detached(leaf if slot is None
                                                       else slot.take(leaf, i)))

    def stacked(self, sl: slice) -> list[Tensor]:
        """Every sliced argument, samples ``sl`` stacked along dim 0 (vectorizable only)."""
        out: list[Tensor] = []
        for leaf, slot in zip(_leaves((self.args, self.kwargs)), self.slots, strict=True):
            if slot is not None:
                out.append(slot.stacked(leaf.detach(), self.n)[sl])
        return out

    def rebuild(self, xs: list[Tensor]) -> tuple[tuple, dict[str, Any]]:
        """The arguments with the sliced ones replaced by ``xs`` (one sample's parts)."""
        it = iter(xs)
        return self._each(lambda leaf, slot: _detached(leaf) if slot is None else next(it))

    def note_outputs(self, outputs: dict[str, Tensor]) -> None:
        """Find the outputs that are the data of a ``PackedSequence`` made like a packed
        argument (same batch sizes and order: a custom recurrent layer's output): sample
        ``i`` is that argument's ``i``-th sequence there too."""
        packed = [s for s in self.slots if isinstance(s, Packed)]
        if not packed:
            return
        for path, sizes in outputs.items():
            head, dot, last = path.rpartition(".")
            if last != "1":  # a packed output's batch sizes, beside its data at "...0"
                continue
            unsorted = outputs.get(f"{head}{dot}3")
            slot = next((s for s in packed if s.made_like(sizes, unsorted)), None)
            if slot is not None:
                self._packed[f"{head}{dot}0"] = slot.rows

    def slot_of(self, path: str, t: Tensor) -> Slot:
        """Where output ``t`` at ``path`` (or its gradient) holds the samples, unchecked."""
        if path in self._packed:
            return self._packed[path]
        return Scalar() if t.dim() == 0 else self._output(path) or Dim(self.batch_dim)

    def output_slot(self, path: str, g: Tensor) -> Slot:
        """How output gradient ``g`` at ``path`` holds the samples.

        Raises:
            CannotReplay: it holds no row per sample where the call's layout says.
        """
        slot = self.slot_of(path, g)
        if isinstance(slot, Dim) and slot.rows(g) != self.n:
            raise CannotReplay(
                f"the gradient of its output {path!r} has shape {tuple(g.shape)}, without a "
                f"row per sample along dim {slot.dim} (batch of {self.n})"
            )
        return slot


def _detached(leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return leaf.detach()
    if isinstance(leaf, PackedSequence):
        return PackedSequence(leaf.data.detach(), leaf.batch_sizes, leaf.sorted_indices,
                              leaf.unsorted_indices)
    return leaf


def split_call(module: nn.Module, args: tuple | list, kwargs: dict[str, Any], n: int,
               batch_dim: int, outputs: dict[str, Tensor] | None = None,
               members: list[bool] | None = None) -> CallSplit:
    """The samples of one call of ``module`` (see the module doc); ``outputs``: the call's
    outputs by path (their integer tensors suffice), to find the packed ones; ``members``:
    for each tensor or ``PackedSequence`` argument (in ``leaves`` order), whether it was
    computed from the batch (``membership``), where that is known."""
    split = CallSplit(module, args, kwargs, n, batch_dim, members)
    if outputs:
        split.note_outputs(outputs)
    return split


def restore(module: nn.Module, nested: dict[str, Any]) -> dict[str, Any]:
    """Record arguments rebuilt as the call got them: a recurrent layer's packed ``input``
    (recorded as its tensors) is a ``PackedSequence`` again."""
    inp = nested.get("input")
    if isinstance(module, nn.RNNBase) and isinstance(inp, tuple) and not isinstance(
            inp, PackedSequence):
        nested = {**nested, "input": PackedSequence(*inp)}
    return nested
