"""The gradient noise scale: stats ``gns``, ``gns_trace`` and ``gns_sqnorm`` (``gns_from=``).

``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018) from the squared norms of gradients
of two batch sizes of the same step. The small batches are *pieces* of the step's batch:

* ``"ranks"``: each rank's own gradient of the step, before the DDP/FSDP2 reduction. It is read
  when it has been accumulated on the leaf that receives it: the parameter itself under DDP (a
  post-accumulate-grad hook, before DDP's reducer copies the averaged gradient back), and under
  FSDP2 the unsharded parameter that ``fully_shard`` swaps into the module for the forward
  (found in a forward pre-hook of the module holding it; its ``.grad`` is the rank's full local
  gradient until the reduce-scatter). With gradient accumulation the rank's gradient must
  accumulate locally (DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)`` on all
  but the last micro-batch): the last backward's accumulated gradient is taken.
* ``"microbatches"``: each backward of the step (a hook on the same leaves sees the gradient
  each backward adds, before it is accumulated); on every rank.
* ``"samples"``: each sample, from the per-sample gradient norms of a ``gt.per_sample`` handle
  asked for ``quantities=("norm",)`` (its closed-form norms-only path), passed as
  ``per_sample=``; the Monitor reads them at ``step()`` and clears the handle.

Units. ``loss_reduction`` says what each rank's gradient of the step (all its micro-batches) is
in terms of the per-sample gradients ``g_n`` of its ``b_r`` samples (``g_n`` as ``per_sample``
defines them: unscaled, before clipping): ``"mean"``, their mean (a loss divided by the number
of micro-batches, as usual), or ``"sum"``. The global gradient is the ranks' average (DDP,
FSDP2). A piece ``i`` of ``b_i`` samples then has the mean gradient ``G_i`` (a micro-batch's
increment times ``b_r / b_i`` for a mean, over ``b_i`` for a sum), and the step's gradient in
the same units is ``T = p.grad`` (mean) or ``R p.grad / B`` (sum; ``R`` ranks, ``B`` samples).
With ``S = mean_i |G_i|^2``, ``1/b = mean_i 1/b_i`` and ``1/B`` the matching weight of ``T``
(``sum_r 1/(R^2 b_r)`` for a mean: ``1/B`` for equal ranks), both unbiased:

    |G|^2 ~ (B |T|^2 - b S) / (B - b),   tr(Sigma) ~ (S - |T|^2) / (1/b - 1/B)

per tensor, summed over tensors for ``"<all>"``, and ``gns = ewma(tr(Sigma)) / ewma(|G|^2)``,
a ratio of EMAs (factor ``gns_beta``; the first finite pair starts them, a non-finite pair
leaves them as they were). Everything a rank contributes (per tensor: ``sum_i |G_i|^2`` and
the squared norm of the counted shard of ``T``; per rank: pieces, ``sum 1/b_i``, ``1/b_r`` or
``b_r``) travels in the step's one SUM collective: no new collective.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from gradtap import distributed
from gradtap._monitor.gain import sqnorm
from gradtap.capture import HookSet, ScalerWatch, current_backward, unscale

__all__ = ["GNS_SOURCES", "ALL_NAME", "GnsSource", "LossReduction", "NoiseScale", "SampleNorms"]

GnsSource = Literal["ranks", "microbatches", "samples"]
LossReduction = Literal["mean", "sum"]
GNS_SOURCES: tuple[str, ...] = ("ranks", "microbatches", "samples")
#: The name of the statistics of the whole selection.
ALL_NAME = "<all>"


class SampleNorms(Protocol):
    """What ``gns_from="samples"`` reads of a ``gt.per_sample`` handle."""

    loss_reduction: str
    quantities: tuple[str, ...]

    @property
    def names(self) -> list[str]: ...

    @property
    def norms(self) -> dict[str, Tensor]: ...

    def clear(self) -> None: ...


class NoiseScale:
    """The pieces of each step, their reduction, and the two EMAs per tensor and ``"<all>"``.

    Args:
        source: ``gns_from``.
        params: ``(name, parameter)`` of the selected parameters that require grad.
        model: the (unwrapped) model, to find FSDP2's unsharded parameters.
        hooks: the Monitor's hook set.
        beta: the EMA factor.
        loss_reduction: ``"mean"`` or ``"sum"`` (see the module text), or ``None`` for the
            per-sample handle's (``"mean"`` without one).
        per_sample: the ``gt.per_sample`` handle of ``"samples"``.
        amp: the Monitor's grad scaler watch (unscaled norms), if any.
        active: whether the Monitor computes the current step.

    Raises:
        ValueError: a bad combination (see ``Monitor``), named in the message.
    """

    def __init__(self, source: str, params: Sequence[tuple[str, nn.Parameter]], model: nn.Module,
                 hooks: HookSet, *, beta: float, loss_reduction: str | None,
                 per_sample: SampleNorms | None, amp: ScalerWatch | None,
                 active: Callable[[], bool]) -> None:
        if source not in GNS_SOURCES:
            raise ValueError(f"gns_from must be one of {', '.join(map(repr, GNS_SOURCES))}; got "
                             f"{source!r}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise ValueError(f"gns_beta must be a factor with 0 <= beta < 1; got {beta!r}")
        if loss_reduction not in (None, "mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum'; got {loss_reduction!r}")
        self.distributed = distributed.is_distributed()
        self.world_size = distributed.world()[1] if self.distributed else 1
        if source == "ranks" and not self.distributed:
            raise ValueError(
                "gns_from='ranks' compares each rank's gradient with the reduced one: it needs a "
                "process group of more than one rank, initialised before the Monitor is made; "
                "in one process use gns_from='microbatches' or 'samples'")
        if source == "samples":
            loss_reduction = _check_per_sample(per_sample, [n for n, _ in params], loss_reduction)
        elif per_sample is not None:
            raise ValueError(f"per_sample= feeds gns_from='samples'; this Monitor has "
                             f"gns_from={source!r}")
        self.source = source
        self.beta = float(beta)
        self.reduction = loss_reduction or "mean"
        self.names = [n for n, _ in params]
        self._index = {n: i for i, n in enumerate(self.names)}
        self._ps = per_sample
        self._amp = amp
        self._active = active
        self._hooks = hooks
        self._leaves: set[int] = set()
        self._ema: dict[str, tuple[float, float]] = {}
        self._task: int | None = None
        self._pieces = 0
        self._micro: list[tuple[int, int, Tensor]] = []
        self._local: dict[str, Tensor] = {}
        self._incoming: dict[str, tuple[int | None, Tensor]] = {}
        if source != "samples":
            self._watch(params, model)

    # -- hooks (inside backward: device work only) ---------------------------------------------

    def _watch(self, params: Sequence[tuple[str, nn.Parameter]], model: nn.Module) -> None:
        sharded = {id(p): n for n, p in params if distributed.is_dtensor(p)}
        for name, p in params:
            if id(p) not in sharded:
                self._watch_leaf(name, p)
        if not sharded:
            return
        # FSDP2: the leaf that receives this rank's gradient is the unsharded parameter swapped
        # into the module for the forward; the module's pre-hook finds it.
        for module in model.modules():
            pairs = [(local, sharded[id(p)]) for local, p in module.named_parameters(recurse=False)
                     if id(p) in sharded]
            if pairs:
                self._hooks.module_calls(module, functools.partial(self._adopt, module, pairs),
                                         _ignore)

    def _adopt(self, module: nn.Module, pairs: list[tuple[str, str]], args: tuple,
               kwargs: dict) -> None:
        now = dict(module.named_parameters(recurse=False))
        for local, name in pairs:
            t = now.get(local)
            if t is not None and id(t) not in self._leaves and not distributed.is_dtensor(t):
                self._watch_leaf(name, t)

    def _watch_leaf(self, name: str, leaf: Tensor) -> None:
        if not leaf.requires_grad:
            return
        self._leaves.add(id(leaf))
        if self.source == "microbatches":
            # The increment of each backward, kept once it is accumulated (a backward that
            # only computes gradients, torch.autograd.grad, is no micro-batch).
            handle = self._hooks.gradient(leaf, self._on_grad, (name,))
            if handle is not None:
                self._hooks.add(handle)
        self._hooks.post_accumulate_grad(leaf, functools.partial(self._on_accumulated, name))

    def _unscaled_sq(self, g: Tensor) -> Tensor:
        scale = None if self._amp is None else self._amp.step_scale()
        return unscale(sqnorm(g), None if scale is None else scale.double().square())

    def _on_grad(self, name: str, g: Tensor) -> None:
        if self._active():
            self._incoming[name] = (current_backward(), self._unscaled_sq(g))

    def _on_accumulated(self, name: str, leaf: Tensor) -> None:
        if not self._active() or leaf.grad is None:
            return
        if self.source == "ranks":  # the rank's gradient so far: the last backward's counts
            self._local[name] = self._unscaled_sq(leaf.grad)
            return
        task = current_backward()
        incoming = self._incoming.pop(name, None)
        if incoming is None or incoming[0] != task:
            return
        if task != self._task:  # the first gradient of a backward: a new micro-batch
            self._task = task
            self._pieces += 1
        self._micro.append((self._pieces - 1, self._index[name], incoming[1]))

    # -- one step -------------------------------------------------------------------------------

    def queue(self, red: distributed.Reduction, grads: dict[str, Tensor],
              counts: dict[str, bool], batch_size: int | Sequence[int] | None,
              device: torch.device) -> int:
        """Queue this rank's share of the step on ``red`` (see the module text); return the
        handle. ``grads``: the step's (unscaled) gradients, local shards under FSDP2, of which
        the names whose ``counts`` is true enter ``|T|^2``.

        Raises:
            ValueError: a missing or inconsistent ``batch_size``.
        """
        n = len(self.names)
        f64 = torch.float64
        small = torch.zeros(n, dtype=f64, device=device)
        if self.source == "ranks":
            b_r = _one_size(batch_size, "the number of samples of this rank in the step")
            for name, sq in self._local.items():
                small[self._index[name]] = sq.to(device) / (b_r * b_r if self.reduction == "sum"
                                                            else 1.0)
            pieces, inv = (1.0, 1.0 / b_r) if self._local else (0.0, 0.0)
        elif self.source == "microbatches":
            sizes = self._microbatch_sizes(batch_size)
            b_r = float(sum(sizes))
            if self._micro:
                w = np.array([(b_r / s) ** 2 if self.reduction == "mean" else 1.0 / (s * s)
                              for s in sizes])
                piece = torch.tensor([k for k, _, _ in self._micro], device=device)
                row = torch.tensor([i for _, i, _ in self._micro], device=device)
                sq = torch.stack([v.to(device) for _, _, v in self._micro])
                small.index_add_(0, row, sq * torch.as_tensor(w, device=device)[piece])
            pieces, inv = float(len(sizes)), float(sum(1.0 / s for s in sizes))
        else:
            assert self._ps is not None
            norms = self._ps.norms
            b_r = float(next(iter(norms.values())).shape[0]) if norms else 0.0
            if batch_size is not None and _one_size(batch_size, "the batch size") != b_r:
                raise ValueError(f"mon.step(batch_size={batch_size!r}) disagrees with the "
                                 f"{int(b_r)} samples per_sample saw")
            scale = None if self._amp is None else self._amp.step_scale()
            for name in self.names:
                v = norms[name].to(device, f64).pow(2).sum()
                small[self._index[name]] = v if scale is None else v / scale.to(device, f64) ** 2
            pieces, inv = b_r, b_r
        total = torch.zeros(n, dtype=f64, device=device)
        for name, g in grads.items():
            i = self._index.get(name)
            if i is not None and counts.get(name, False) and g.numel():
                total[i] = sqnorm(g).to(device)
        # A rank that saw no piece (the Monitor was made after this step's backward) adds
        # nothing: with no piece anywhere the step's estimates are NaN and the EMAs stay.
        per_rank = 0.0 if not pieces else 1.0 / b_r if self.reduction == "mean" else b_r
        scalars = torch.tensor([pieces, inv, per_rank], dtype=f64, device=device)
        return red.add_sums(torch.cat([small, total, scalars]),
                            "gns\x01" + "\x01".join(self.names))

    def finish(self, red: distributed.Reduction, handle: int, stats: Sequence[str]
               ) -> tuple[list[str], dict[str, np.ndarray]]:
        """Advance the EMAs with the step's estimates; return the names (the tensors, then
        ``"<all>"``) and the requested columns of ``gns``, ``gns_trace``, ``gns_sqnorm``."""
        n = len(self.names)
        v = np.asarray(red.host_sums(handle), dtype=np.float64)
        small, total, (pieces, inv, per_rank) = v[:n], v[n:2 * n], v[2 * n:]
        r = self.world_size
        with np.errstate(all="ignore"):
            s = small / pieces
            a = inv / pieces  # 1/b
            if self.reduction == "mean":
                c = per_rank / (r * r)  # 1/B
            else:
                c = 1.0 / per_rank
                total = total * (r / per_rank) ** 2
            trace = (s - total) / (a - c)
            sq = (a * total - c * s) / (a - c)
        names = [*self.names, ALL_NAME]
        trace = np.append(trace, trace.sum())
        sq = np.append(sq, sq.sum())
        out = np.empty((3, len(names)))
        for i, name in enumerate(names):
            out[:, i] = self._advance(name, float(trace[i]), float(sq[i]))
        columns = {"gns": out[0], "gns_trace": out[1], "gns_sqnorm": out[2]}
        return names, {k: columns[k] for k in stats if k in columns}

    def _advance(self, name: str, trace: float, sq: float) -> tuple[float, float, float]:
        state = self._ema.get(name)
        if math.isfinite(trace) and math.isfinite(sq):
            if state is None:
                state = (trace, sq)
            else:
                k = 1.0 - self.beta
                state = (state[0] + k * (trace - state[0]), state[1] + k * (sq - state[1]))
            self._ema[name] = state
        if state is None:
            return math.nan, math.nan, math.nan
        ratio = state[0] / state[1] if state[1] != 0 else math.nan
        return ratio, state[0], state[1]

    def end_step(self) -> None:
        """Forget the step's pieces (and clear the per-sample handle)."""
        self._reset()
        if self._ps is not None:
            self._ps.clear()

    def _reset(self) -> None:
        self._task = None
        self._pieces = 0
        self._micro = []
        self._local = {}
        self._incoming = {}

    def _microbatch_sizes(self, batch_size: int | Sequence[int] | None) -> list[float]:
        k = self._pieces
        if batch_size is None:
            raise ValueError(
                "gns_from='microbatches' needs the number of samples of each micro-batch: "
                "mon.step(batch_size=b) (every micro-batch) or batch_size=[b1, b2, ...] (one per "
                "backward of the step)")
        if not isinstance(batch_size, Sequence):
            sizes = [_one_size(batch_size, "each micro-batch's size")] * k
        else:
            sizes = [_one_size(b, "each micro-batch's size") for b in batch_size]
            if len(sizes) != k:
                raise ValueError(f"mon.step(batch_size=...) lists {len(sizes)} micro-batch "
                                 f"sizes, but this step had {k} backward(s)")
        return sizes

    # -- checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The EMAs (plain floats)."""
        return {"beta": self.beta, "ema": {n: list(v) for n, v in self._ema.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: another ``gns_beta``.
        """
        if float(state["beta"]) != self.beta:
            raise ValueError(f"the saved noise-scale EMAs have gns_beta={state['beta']!r}; this "
                             f"Monitor has {self.beta!r}")
        self._ema = {n: (float(v[0]), float(v[1])) for n, v in state["ema"].items()}


def _ignore(output: object) -> None:
    return None


def _one_size(value: object, what: str) -> float:
    if value is None:
        raise ValueError(f"the noise scale needs {what}: mon.step(batch_size=...)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"batch_size must be a positive number ({what}); got {value!r}")
    return float(value)


def _check_per_sample(ps: SampleNorms | None, names: list[str], reduction: str | None) -> str:
    if ps is None:
        raise ValueError("gns_from='samples' reads per-sample gradient norms: pass "
                         "per_sample=gt.per_sample(model, quantities=('norm',)) (made on the same "
                         "model)")
    if "norm" not in ps.quantities:
        raise ValueError(f"the per_sample handle was asked for {tuple(ps.quantities)}; "
                         "gns_from='samples' needs its per-sample norms: quantities=('norm',)")
    missing = [n for n in names if n not in set(ps.names)]
    if missing:
        raise ValueError(f"the per_sample handle does not cover {len(missing)} parameter(s) this "
                         f"Monitor selects ({', '.join(missing[:5])}); select the same "
                         "parameters in both")
    if reduction is not None and reduction != ps.loss_reduction:
        raise ValueError(f"loss_reduction={reduction!r} but the per_sample handle has "
                         f"loss_reduction={ps.loss_reduction!r}")
    return ps.loss_reduction

