"""Result buffers reused across backwards: per-sample gradients without fresh memory each step.

A backward that builds ``[N, *shape]`` per-sample gradients of a model allocates tens of MB
(25 MB for a small transformer encoder in float32); when they are dropped, the C allocator
returns that memory to the system and the next backward takes it back page by page (thousands
of page faults a step). So on the CPU each model has a :class:`Pool`: the rules that build a
per-sample gradient (Linear's, Embedding's) take its memory from the model's pool while
``per_sample`` computes (:func:`computing`), and a later backward of the same model reuses it.

The contract (docs/semantics.md):

* the pool keeps memory, not tensors: a result tensor is freed with what holds it (the
  ``per_sample`` handle, the user), and its memory is handed out again only when no tensor
  refers to it any more (no result, view, slice, ``detach()``, numpy array) and nobody
  holds its storage object. A result the user holds is never written into;
* the pool keeps only the memory the last backward of the model took (the rest is dropped
  after each backward), and at most :data:`CAP` bytes; after the last backward it holds at
  most that backward's per-sample gradients, until the model is garbage collected;
* GPU tensors are never pooled (the caching allocator already reuses their memory).
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from gradtap.capture import compat

__all__ = ["CAP", "Pool", "computing", "pool_for", "pooled", "zeros"]

#: The most bytes one model's pool keeps.
CAP = 256 * 2**20


def _refs(bucket: list[torch.UntypedStorage], i: int) -> tuple[int | None, int]:
    """References to the memory ``bucket[i]``: tensors on it, and its Python object."""
    s = bucket[i]
    return compat.storage_use_count(s), sys.getrefcount(s)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(d, 1)
    return tuple(reversed(out))


# The counts of memory that only a bucket holds, taken by the very same code path.
_IDLE = _refs([torch.empty(1).untyped_storage()], 0)


class Pool:
    """The memory of one model's per-sample results (see the module doc)."""

    def __init__(self) -> None:
        self._buckets: dict[int, list[torch.UntypedStorage]] = {}  # by size in bytes
        self._taken: set[int] = set()  # ids of the memory handed out since the last settle
        self.bytes = 0
        self._lock = threading.Lock()  # two threads' backwards of one model

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialized contiguous CPU tensor, on pooled memory nothing else refers to,
        or on new memory."""
        with self._lock:
            return self._take(shape, dtype)

    def _take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        size = math.prod(shape) * dtype.itemsize
        bucket = self._buckets.setdefault(size, [])
        for i in range(len(bucket)):
            if (id(bucket[i]) not in self._taken and _refs(bucket, i) == _IDLE
                    and bucket[i].nbytes() == size):  # not resized through a result
                self._taken.add(id(bucket[i]))
                return torch.empty(0, dtype=dtype).set_(bucket[i], 0, shape, _strides(shape))
        t = torch.empty(shape, dtype=dtype)
        if self.bytes + size <= CAP:
            bucket.append(t.untyped_storage())
            self._taken.add(id(bucket[-1]))
            self.bytes += size
        return t

    def settle(self) -> None:
        """A backward ended: keep only the memory it took."""
        with self._lock:
            self._settle()

    def _settle(self) -> None:
        for size, bucket in list(self._buckets.items()):
            kept = [s for s in bucket if id(s) in self._taken]
            self.bytes -= size * (len(bucket) - len(kept))
            if kept:
                self._buckets[size] = kept
            else:
                del self._buckets[size]
        self._taken = set()

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())


_POOLS: weakref.WeakKeyDictionary[nn.Module, Pool] = weakref.WeakKeyDictionary()
# Per thread: the pools of the per_samples computing now (innermost last).
_ACTIVE = threading.local()


def pool_for(model: nn.Module) -> Pool:
    """The pool of ``model`` (made on first use; freed with the model)."""
    pool = _POOLS.get(model)
    if pool is None:
        pool = _POOLS[model] = Pool()
    return pool


@contextmanager
def computing(pool: Pool) -> Iterator[None]:
    """Rules build their per-sample results in ``pool``'s buffers meanwhile."""
    stack = _stack()
    stack.append(pool)
    try:
        yield
    finally:
        stack.pop()


def _stack() -> list[Pool]:
    stack = getattr(_ACTIVE, "pools", None)
    if stack is None:
        stack = _ACTIVE.pools = []
    return stack


def pooled(shape: tuple[int, ...], like: Tensor, dtype: torch.dtype | None = None) -> Tensor | None:
    """An uninitialized ``shape`` tensor of ``dtype`` (``like``'s by default) from the active
    pool, or ``None`` (no pool active, not on the CPU, or grad enabled: the caller computes
    as without a pool)."""
    stack = _stack()
    if (stack and like.device.type == "cpu" and not torch.is_grad_enabled()
            and compat.functorch_wrapped(like) is False
            and compat.available("torch._C._storage_Use_Count")):
        return stack[-1].take(shape, dtype or like.dtype)
    return None


def zeros(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """``shape`` zeros of ``like``'s dtype and device, pooled where :func:`pooled` can."""
    out = pooled(shape, like)
    return like.new_zeros(shape) if out is None else out.zero_()
