"""What ``detect`` found (:class:`Anomaly`) and the plain-text report written for it.

Everything here runs only once something is wrong, so it may take exact counts and syncs.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from gradtap._tensorops.sharded import local
from gradtap._text import format_number, format_table
from gradtap.record import GradRecord

__all__ = ["LOSS", "Anomaly", "AnomalyWarning", "Kind", "TensorStat", "Where"]

Kind = Literal["nan", "inf", "spike", "overflow"]
Where = Literal["forward", "grad_output", "grad_input", "param_grad"]

#: ``module_name`` of an anomaly in the loss.
LOSS = "<loss>"

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class AnomalyWarning(RuntimeWarning):
    """Category of the warnings ``gt.detect(..., action="warn")`` emits."""


@dataclass(frozen=True)
class Anomaly:
    """One NaN, Inf or gradient spike found by :func:`gradtap.detect`, with its report.

    Attributes:
        module_name: qualified name of the module where it originated (``""`` is the model
            itself), or ``"<loss>"`` for a non-finite loss or loss gradient.
        kind: ``"nan"`` (the slot holds a NaN), ``"inf"`` (an Inf and no NaN), ``"spike"``,
            or ``"overflow"``: under ``scaler=``, a NaN/Inf in the gradients, which the grad
            scaler finds and answers by skipping the optimizer step and lowering its scale
            (recorded, never raised; ``nan``/``inf`` say which it was).
        where: ``"forward"``, ``"grad_output"``, ``"grad_input"`` or ``"param_grad"``.
        step: the step it was found in (steps count from 0, advanced by ``det.step()``).
        record: the :class:`~gradtap.GradRecord` of the module call, when its backward ran
            (``None`` otherwise, e.g. for the loss or a forward checked without a backward).
        message: the report: module path and type, slot, NaN/Inf counts, ranges of the
            forward tensors and parameters against their dtype, and a hint.
        module_type: class name of the module (``"loss"`` for the loss).
        slot: the slot's key: an input or output key, a parameter name, ``"loss"``; for a
            spike in parameter gradients the comma-joined direct parameter names.
        call: the module's call index within the step (``None`` for the loss).
        nan: NaN elements in the slot (``None`` when the tensor was no longer available).
        inf: +-Inf elements in the slot (``None`` when unknown).
        numel: elements in the slot.
        value: for a spike, the norm that spiked.
        threshold: for a spike, ``spike * EWMA`` it exceeded.
        dump_path: the dump file written for it (``dump_dir``), else ``None``.
        rank: the ``torch.distributed`` rank where it was found (0 without a process
            group). Under DDP or FSDP2 ranks agree: a rank that found nothing itself while
            rank ``r`` did records one anomaly with ``rank=r``, the kind, ``where`` and
            module rank ``r`` found (``module_name`` ``"<rank r>"`` for the loss) and
            ``record=None`` (the report is on rank ``r``).
        samples: with ``detect(..., samples=True)``, the samples that carry it: positions
            along the batch dim of the step's model call, worst first (``docs/semantics.md``,
            "Which samples did it"); ``()`` when none stands out or it is no sample's doing
            (a parameter already non-finite); ``None`` without ``samples=True``.
        sample_ids: the user's ids of :attr:`samples` (``det.step(sample_ids=ids)``: one id
            per batch row, e.g. dataset indices or file names), else ``None``.
    """

    module_name: str
    kind: Kind
    where: Where
    step: int
    record: GradRecord | None = field(repr=False, compare=False)
    message: str = field(repr=False)
    module_type: str = ""
    slot: str = ""
    call: int | None = None
    nan: int | None = None
    inf: int | None = None
    numel: int | None = None
    value: float | None = None
    threshold: float | None = None
    dump_path: str | None = None
    rank: int = 0
    samples: tuple[int, ...] | None = None
    sample_ids: tuple[int | str, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every field but ``record``, as plain Python values (JSON-serialisable)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "record"}

    def __str__(self) -> str:
        return self.message

    def _repr_html_(self) -> str:
        """The report as preformatted text, for notebooks."""
        return f"<pre>{html.escape(self.message)}</pre>"


class TensorStat(NamedTuple):
    """Range of one tensor as the report shows it; ``nan``/``inf`` are ``None`` if unknown."""

    role: str
    key: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    min: float
    max: float
    nan: int | None = None
    inf: int | None = None

    @property
    def absmax(self) -> float:
        return max(abs(self.min), abs(self.max)) if not _isnan(self.min, self.max) else math.nan

    @property
    def finite(self) -> bool:
        if self.nan is not None and self.inf is not None:
            return not (self.nan or self.inf)
        return math.isfinite(self.min) and math.isfinite(self.max)

    def plain(self) -> dict[str, Any]:
        """As plain values (for dumps)."""
        return {"role": self.role, "key": self.key, "dtype": _dtype_name(self.dtype),
                "shape": list(self.shape), "min": self.min, "max": self.max,
                "nan": self.nan, "inf": self.inf}


def exact_stat(t: Tensor, role: str, key: str) -> TensorStat:
    """Counts of NaN/Inf and the range of the finite elements of a tensor we still hold
    (of this rank's shard, for a sharded tensor)."""
    t = local(t.detach())
    shape = tuple(t.shape)
    if not t.is_floating_point() or t.numel() == 0:
        return TensorStat(role, key, t.dtype, shape, math.nan, math.nan, 0, 0)
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    finite = t[torch.isfinite(t)] if nan or inf else t
    if finite.numel():
        lo, hi = torch.aminmax(finite)
        mn, mx = float(lo), float(hi)
    else:
        mn = mx = math.nan
    return TensorStat(role, key, t.dtype, shape, mn, mx, nan, inf)


def kind_of(stat: TensorStat) -> Kind:
    """``"nan"`` when the tensor holds a NaN (or its range is NaN), else ``"inf"``."""
    if stat.nan is not None:
        return "nan" if stat.nan else "inf"
    return "nan" if _isnan(stat.min, stat.max) else "inf"


def stats_table(stats: Sequence[TensorStat]) -> list[str]:
    """The report's aligned table of tensor ranges (finite elements; counts when known)."""
    rows = []
    for s in stats:
        rows.append([
            s.role, repr(s.key), _dtype_name(s.dtype), _shape(s.shape), format_number(s.min), format_number(s.max),
            format_number(s.absmax), "overflow" if s.inf else _of_max(s.dtype, s.absmax),
            _count(s.nan), _count(s.inf)])
    header = ["tensor", "key", "dtype", "shape", "min", "max", "absmax", "of dtype max",
              "NaN", "Inf"]
    return ["  " + line for line in format_table(header, rows)]


def counts_phrase(stat: TensorStat) -> str:
    """``"12 NaN and 0 Inf of 2048 elements"`` (or a note that the counts are unknown)."""
    n = math.prod(stat.shape)
    if stat.nan is None or stat.inf is None:
        what = "NaN" if kind_of(stat) == "nan" else "Inf"
        return (f"holds {what} ({n} elements; counts unknown: the tensor was freed before the "
                "check, pass dump_dir= to keep forward tensors)")
    return f"holds {stat.nan} NaN and {stat.inf} Inf of {n} elements"


def describe_module(name: str, type_name: str, call: int | None, selected: bool) -> str:
    """``'block.3' (Linear, call 0)``; the unselected model root is named as such."""
    if name == LOSS:
        return "the loss"
    where = f"call {call}" if call is not None else ""
    label = f"{name!r} ({type_name}{', ' + where if where else ''})"
    if name == "" and not selected:
        label = f"the model itself {label}, outside the selected modules"
    return label


# -- hints ---------------------------------------------------------------------------------


def forward_hints(kind: Kind, inputs: Sequence[TensorStat], outputs: Sequence[TensorStat],
                  params: Sequence[TensorStat]) -> list[str]:
    """Likely causes of a NaN/Inf made in forward from finite inputs and parameters."""
    hints: list[str] = []
    low = [s for s in [*inputs, *outputs, *params]
           if s.dtype is not None and s.dtype in _LOW_PRECISION]
    negative = [s for s in inputs if s.min < 0]
    zero = [s for s in inputs if s.min <= 0 <= s.max]
    if kind == "inf" and low:
        dtype = low[0].dtype
        assert dtype is not None  # low holds only summaries with a dtype
        top = max((s.absmax for s in [*inputs, *params] if math.isfinite(s.absmax)), default=0.0)
        hints.append(
            f"{_dtype_name(dtype)} overflow: values beyond its largest finite number "
            f"{torch.finfo(dtype).max:g} become Inf (inputs and parameters reach {format_number(top)}); "
            "run this layer in float32 (e.g. outside torch.autocast, or .float()) or scale its "
            "inputs down")
    if kind == "nan" and negative:
        s = negative[0]
        hints.append(
            f"input {s.key!r} has negative values (min {format_number(s.min)}): sqrt, log or a "
            "fractional pow of a negative number is NaN; clamp the argument "
            "(x.clamp_min(eps)) or use x.abs()")
    if kind == "inf" and zero:
        s = zero[0]
        hints.append(
            f"input {s.key!r} reaches 0 (min {format_number(s.min)}, max {format_number(s.max)}): log(0) is -Inf "
            "and division by 0 is Inf; add an epsilon (log(x + eps), x / (y + eps))")
    exp_limit = {torch.float16: 11.09, torch.bfloat16: 88.72, torch.float32: 88.72,
                 torch.float64: 709.78}
    big = [s for s in inputs
           if s.dtype is not None and s.dtype in exp_limit and s.max > exp_limit[s.dtype]]
    if kind in ("inf", "nan") and big:
        s = big[0]
        hints.append(
            f"input {s.key!r} reaches {format_number(s.max)}: exp overflows above "
            f"{exp_limit.get(s.dtype) if s.dtype is not None else ''} in "
            f"{_dtype_name(s.dtype)} (and Inf - Inf or Inf / Inf is "
            "NaN); use a stable form (logsumexp, log_softmax, softplus)")
    if not hints:
        if kind == "nan":
            hints.append("NaN from finite values comes from 0/0, Inf - Inf, 0 * Inf, or sqrt/log/"
                         "pow of a negative number inside this module's forward")
        else:
            hints.append("Inf from finite values comes from a division by 0, log(0), exp of a "
                         "large number, or an overflow of the dtype inside this module's forward")
    return hints


def backward_hints(kind: Kind, inputs: Sequence[TensorStat], grads: Sequence[TensorStat]
                   ) -> list[str]:
    """Likely causes of a NaN/Inf made by a module's backward from finite ``grad_outputs``."""
    hints: list[str] = []
    zero = [s for s in inputs if s.min <= 0 <= s.max]
    if zero:
        s = zero[0]
        hints.append(
            f"the forward was finite, but input {s.key!r} reaches 0 (min {format_number(s.min)}): the "
            "derivative of sqrt, pow(x, p < 1), log or 1/x is infinite at 0 (and 0 * Inf is "
            "NaN); add an epsilon (sqrt(x + eps)) or clamp the argument away from 0")
    low_dtypes = [s.dtype for s in grads if s.dtype is not None and s.dtype in _LOW_PRECISION]
    if low_dtypes and kind == "inf":
        hints.append(
            f"{_dtype_name(low_dtypes[0])} gradient overflow (largest finite "
            f"{torch.finfo(low_dtypes[0]).max:g}): lower the loss scale (torch.amp.GradScaler "
            "skips such steps) or compute this layer in float32")
    if not hints:
        hints.append("this module's backward turned finite output gradients into non-finite "
                     "ones: look for sqrt, pow, log, division or normalisation of values near 0, "
                     "or at the backward of a custom torch.autograd.Function it uses")
    return hints


def loss_hints(outputs_finite: bool) -> list[str]:
    """Hints for a non-finite loss."""
    if outputs_finite:
        return ["the model's forward was finite, so the loss function made it: log of 0 or of a "
                "negative number, a division by 0, or log(softmax(x)) instead of log_softmax / "
                "F.cross_entropy"]
    return ["check the loss function and its targets"]


# -- formatting ----------------------------------------------------------------------------


def format_lines(title: str, body: Iterable[str]) -> str:
    return "\n".join([title, *body])


def _isnan(*xs: float) -> bool:
    return any(math.isnan(x) for x in xs)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"




def _count(x: int | None) -> str:
    return "?" if x is None else str(x)


def _of_max(dtype: torch.dtype | None, absmax: float) -> str:
    """How close the largest magnitude came to the dtype's largest finite value."""
    if dtype is None or not dtype.is_floating_point or math.isnan(absmax):
        return "-"
    frac = absmax / torch.finfo(dtype).max
    if math.isinf(frac):
        return "overflow"
    if frac < 1e-4:
        return "<0.01%"
    return f"{100 * frac:.3g}%"
