"""The message builder: one :class:`Anomaly` with its report per kind of event.

Each function takes the step number and the statistics already gathered (exact where the
tensors were still there) and returns the anomaly; nothing here measures or hooks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn

from gradtap._detect._anomaly import (
    LOSS,
    Anomaly,
    Kind,
    TensorStat,
    Where,
    backward_hints,
    counts_phrase,
    describe_module,
    exact_stat,
    format_lines,
    forward_hints,
    kind_of,
    loss_hints,
    stats_table,
)
from gradtap._detect._measure import Plan
from gradtap._detect._screen import Suspect
from gradtap._detect._spikes import Spike
from gradtap._text import format_number, format_table
from gradtap.record import GradRecord

__all__ = ["Found", "backward_anomaly", "forward_anomaly", "loss_anomaly",
           "loss_gradient_anomaly", "param_spike_anomaly", "record_stats", "spike_anomaly",
           "unreproduced_anomaly"]

_ROLES = (("grad_output", "grad_outputs"), ("grad_input", "grad_inputs"),
          ("param_grad", "param_grads"))


class Found:
    """An anomaly waiting to be emitted (for a backward anomaly: at the end of the backward),
    with what its dump needs: the module and the call's kept forward tensors."""

    __slots__ = ("anomaly", "key", "module", "kept")

    def __init__(self, anomaly: Anomaly, key: tuple[str, int] | None, module: nn.Module | None,
                 kept: dict[str, dict[str, Tensor]] | None = None) -> None:
        self.anomaly, self.key, self.module, self.kept = anomaly, key, module, kept


def forward_anomaly(step: int, name: str, call: int, type_name: str, selected: bool,
                    bad: TensorStat, ins: list[TensorStat], outs: list[TensorStat],
                    params: list[TensorStat], role: str) -> Anomaly:
    """A non-finite ``role`` (``"param"``, ``"input"`` or ``"output"``) slot in a forward call."""
    kind = kind_of(bad)
    label = describe_module(name, type_name, call, selected)
    what = "NaN" if kind == "nan" else "Inf"
    if role == "param":
        head = (f"{what} in parameter {bad.key!r} of {label} at step {step}: it "
                f"{counts_phrase(bad)} before this forward.")
        hints = ["an earlier optimizer step applied a non-finite gradient (or the weights "
                 "were loaded that way): skip such steps with det.should_skip()"]
    elif role == "input":
        head = (f"{what} arrived in the forward of {label} at step {step}: input "
                f"{bad.key!r} {counts_phrase(bad)} when it was called, and no selected module "
                "before it made it.")
        hints = ["check the data (torch.isfinite(x).all()) and the code that runs before "
                 "this module outside the selected modules"]
    else:
        head = (f"{what} in the forward of {label} at step {step}: output "
                f"{bad.key!r} {counts_phrase(bad)}, while all its inputs and parameters "
                "were finite.")
        hints = forward_hints(kind, ins, outs, params)
    body = ["forward tensors and parameters (ranges of finite elements):",
            *stats_table([*ins, *outs, *params[:20]])]
    if len(params) > 20:
        body.append(f"  ... {len(params) - 20} more parameters")
    body += [f"hint: {h}" for h in hints]
    return Anomaly(
        module_name=name, kind=kind, where="forward", step=step, record=None,
        message=format_lines(head, body), module_type=type_name, slot=bad.key,
        call=call, nan=bad.nan, inf=bad.inf, numel=math.prod(bad.shape))


def loss_anomaly(step: int, loss: Tensor, outputs_finite: bool) -> Anomaly:
    """A non-finite loss after a finite forward."""
    stat = exact_stat(loss, "loss", "loss")
    kind = kind_of(stat)
    value = f" = {format_number(float(loss))}" if loss.numel() == 1 else ""
    head = (f"{'NaN' if kind == 'nan' else 'Inf'} in the loss{value} at step "
            f"{step}: it {counts_phrase(stat)}, while every selected module's "
            "forward was finite.")
    body = [*stats_table([stat]),
            *(f"hint: {h}" for h in loss_hints(outputs_finite=outputs_finite))]
    return Anomaly(
        module_name=LOSS, kind=kind, where="forward", step=step, record=None,
        message=format_lines(head, body), module_type="loss", slot="loss",
        call=None, nan=stat.nan, inf=stat.inf, numel=loss.numel())


def backward_anomaly(step: int, rec: GradRecord, selected: bool, where: Where, key: str,
                     arrived: bool, grads: list[TensorStat], fwd_in: list[TensorStat],
                     fwd_out: list[TensorStat], params: list[TensorStat]) -> Anomaly:
    """A non-finite gradient in a call's backward (``arrived``: in its ``grad_outputs``, from
    code outside the selected modules)."""
    bad = next(s for s in grads if s.role == where and s.key == key)
    kind = kind_of(bad)
    label = describe_module(rec.module_name, rec.module_type, rec.call, selected)
    what = "NaN" if kind == "nan" else "Inf"
    slot_word = {"grad_input": "the gradient it sends to input",
                 "param_grad": "its gradient for parameter",
                 "grad_output": "dL/d(output)"}[where]
    if arrived:
        head = (f"{what} arrived in the backward of {label} at step {step}: "
                f"{slot_word} {key!r} {counts_phrase(bad)}, and no selected module after it "
                "made it: it comes from code between this module's output and the loss.")
        hints = ["look at the functional code after this module (outside the selected "
                 "modules), or select more modules"]
    else:
        head = (f"{what} in the backward of {label} at step {step}: {slot_word} "
                f"{key!r} {counts_phrase(bad)}, while its grad_outputs were finite.")
        hints = backward_hints(kind, fwd_in, grads)
    body = ["gradients of this call (ranges of finite elements):", *grad_table(grads)]
    if fwd_in or fwd_out or params:
        body += ["forward tensors and parameters (ranges of finite elements):",
                 *stats_table([*fwd_in, *fwd_out, *params])]
    body += [f"hint: {h}" for h in hints]
    return Anomaly(
        module_name=rec.module_name, kind=kind, where=where, step=step, record=rec,
        message=format_lines(head, body), module_type=rec.module_type, slot=key,
        call=rec.call, nan=bad.nan, inf=bad.inf, numel=math.prod(bad.shape))


def loss_gradient_anomaly(step: int, rec: GradRecord, fwd_out: list[TensorStat]) -> Anomaly:
    """A non-finite dL/d(model output) after a finite forward: the loss's backward made it."""
    grads = [s for s in record_stats(rec) if s.role == "grad_output"]
    bad = next(s for s in grads if not s.finite)
    kind = kind_of(bad)
    head = (f"{'NaN' if kind == 'nan' else 'Inf'} in the gradient of the loss at step "
            f"{step}: dL/d(model output {bad.key!r}) {counts_phrase(bad)} while the "
            "model's forward was finite: the loss function's backward made it.")
    body = ["gradient entering the model (range of finite elements):", *grad_table(grads)]
    if fwd_out:
        body += ["model outputs:", *stats_table(fwd_out)]
    body.append("hint: the loss has an infinite derivative at these outputs (sqrt or pow "
                "at 0, log at 0, a division by 0); add an epsilon or use a stable loss "
                "(F.cross_entropy, F.binary_cross_entropy_with_logits); det.check_loss(loss) "
                "also checks the loss value")
    return Anomaly(
        module_name=LOSS, kind=kind, where="grad_output", step=step, record=rec,
        message=format_lines(head, body), module_type="loss", slot=bad.key, call=None,
        nan=bad.nan, inf=bad.inf, numel=math.prod(bad.shape))


def spike_anomaly(step: int, plan: Plan, kinds: list[Spike], baseline: float,
                  threshold: float) -> Anomaly:
    """The per-call watch's spike: a ``(module, kind)`` norm scored above ``threshold``
    against its own history (``kinds``: the module's spikes ``(index, name, kind, norm,
    score)``, the one reported first; ``baseline``: its baseline norm). ``plan`` is the
    module's call (its record if kept)."""
    _, name, kind, value, score = kinds[0]
    rec = plan.rec
    params = [k for k, _ in plan.params if "." not in k]
    outs = [k for k, _ in plan.outs]
    label = describe_module(name, plan.type_name, plan.call, True)
    if kind == "grad_output":
        slot, what = ",".join(outs), "output-gradient norm"
    else:
        slot, what = ",".join(params), "parameter-gradient norm"
    ratio = f"{value / baseline:.3g}x" if baseline > 0 else "inf x"
    head = (f"Gradient spike in {label} at step {step}: its {what} ({slot}) is "
            f"{format_number(value)}, {ratio} its baseline {format_number(baseline)} "
            f"(score {score:.3g}, above the threshold spike={threshold:g}).")
    body = [f"also: {'output-gradient' if k == 'grad_output' else 'parameter-gradient'} "
            f"norm {format_number(v)} (score {z:.3g})" for _, _, k, v, z in kinds[1:]]
    if rec is not None:
        body += ["gradients of this call (ranges of finite elements):",
                 *grad_table(record_stats(rec))]
    body.append("hint: a spike in dL/d(output) comes from the modules after this one (or the "
                "loss); one in the parameter gradient alone from this module's inputs. "
                "Skip the step (det.should_skip()), clip gradients, or lower the learning rate")
    return Anomaly(
        module_name=name, kind="spike", where=kind,  # type: ignore[arg-type]
        step=step, record=rec, message=format_lines(head, body),
        module_type=plan.type_name, slot=slot, call=plan.call, nan=0, inf=0,
        value=value, threshold=threshold)


def param_spike_anomaly(step: int, plan: Plan | None, name: str,
                        hits: list[tuple[str, float, float]], threshold: float,
                        baselines: dict[str, float], *, module: tuple[str, list[str]],
                        note: str | None = None) -> Anomaly:
    """The default watch's spike: module ``name``'s parameters ``hits`` (``(parameter, norm,
    score)``, highest score first) scored above ``threshold`` against their own baselines.
    ``plan`` is the module's call from the replay (its record if kept), else ``None``."""
    rec = plan.rec if plan is not None else None
    type_name, call = (plan.type_name, plan.call) if plan is not None else (module[0], None)
    label = describe_module(name, type_name, call, True)
    slot, value, score = hits[0]

    def one(p: str, v: float, z: float) -> str:
        base = baselines.get(p)
        ratio = f", {v / base:.3g}x its baseline {format_number(base)}" if base else ""
        return f"the gradient norm of {p!r} is {format_number(v)}{ratio} (score {z:.3g})"

    head = (f"Gradient spike in {label} at step {step}: {one(slot, value, score)}, above "
            f"the threshold spike={threshold:g}.")
    body = [f"also: {one(p, v, z)}" for p, v, z in hits[1:]]
    if note:
        body.append(note)
    if rec is not None:
        body += ["gradients of this call (ranges of finite elements):",
                 *grad_table(record_stats(rec))]
    body.append("hint: a spike in one parameter's gradient comes from this module's inputs or "
                "from the gradient reaching its output (grad_output, above when replayed). "
                "Skip the step (det.should_skip()), clip gradients, or lower the learning rate")
    return Anomaly(
        module_name=name, kind="spike", where="param_grad", step=step, record=rec,
        message=format_lines(head, body), module_type=type_name,
        slot=",".join(p for p, _, _ in hits), call=call, nan=0, inf=0,
        value=value, threshold=threshold)


def unreproduced_anomaly(step: int, s: Suspect, failure: BaseException | None,
                         modules: dict[str, nn.Module], selected: set[str]) -> Found:
    """An anomaly from the screen's own evidence ``s``, when the replay did not show its
    origin (``failure``: the replay's error, if it failed)."""
    if s.where == "param_grad":
        name, _, slot = s.key.rpartition(".")
        where: Where = "param_grad"
        what = f"the gradient of parameter {slot!r}"
    elif s.where == "loss":
        name, slot, where, what = LOSS, "loss", "forward", "the loss value"
    elif s.where == "grad_input":
        name, slot, where = s.module, s.key, "grad_input"
        what = f"dL/d(input {slot!r})"
    else:
        name, slot = s.module, s.key
        where = "forward" if s.where == "forward" else "grad_output"
        what = f"output {slot!r}" if where == "forward" else f"dL/d(output {slot!r})"
    module = None if name == LOSS else modules.get(name)
    type_name = "loss" if name == LOSS else type(module).__name__
    kind: Kind
    if s.tensor is not None:
        stat: TensorStat | None = exact_stat(s.tensor, s.where, slot)
        kind = kind_of(stat)  # type: ignore[arg-type]
    else:
        stat, kind = None, "nan" if s.nan else "inf"
    label = LOSS if name == LOSS else describe_module(name, type_name, None, name in selected)
    why = (f"the replay failed ({type(failure).__name__}: {failure})" if failure is not None
           else "running the step's forward and backward again did not reproduce it")
    counts = f"it {counts_phrase(stat)}; " if stat is not None else ""
    if where == "forward" and name == "":
        seen = ("the model's output (the screen watches the model's outputs, not each "
                "module's: gt.detect(..., screen='modules') screens every selected call)")
    else:
        seen = {"forward": "the first selected call, in the order calls finished, whose "
                           "output was non-finite (its inputs and parameters were not "
                           "checked: code of an enclosing module may have made the value "
                           "before this call)",
                "grad_output": "the first gradient the screen saw non-finite, in backward "
                               "order",
                "grad_input": "the first gradient the screen saw non-finite, in backward "
                              "order",
                }.get(where, "what the screen saw after the backward")
    head = (f"{'NaN' if kind == 'nan' else 'Inf'} found at step {step} in {what} of "
            f"{label}: {counts}{why}, so this reports {seen}.")
    hint = ("the forward may depend on state other than buffers and the RNG, a kernel may "
            "not be deterministic, or the gradient entered the model other than through its "
            "outputs (a loss on an intermediate tensor, an earlier backward accumulated into "
            ".grad); gt.detect(..., replay=False) watches every selected call as it runs")
    body = [*(stats_table([stat]) if stat is not None else []), f"hint: {hint}"]
    anomaly = Anomaly(
        module_name=name, kind=kind, where=where, step=step, record=None,
        message=format_lines(head, body), module_type=type_name, slot=slot, call=None,
        nan=None if stat is None else stat.nan, inf=None if stat is None else stat.inf,
        numel=None if s.tensor is None else s.tensor.numel())
    return Found(anomaly, None, module)


def record_stats(rec: GradRecord) -> list[TensorStat]:
    """Exact statistics of every gradient a record holds."""
    return [exact_stat(g, role, key) for role, attr in _ROLES
            for key, g in getattr(rec, attr).items() if g is not None]


def grad_table(stats: Sequence[TensorStat]) -> list[str]:
    """The report's table of a call's gradients."""
    rows = []
    for s in stats:
        n = math.prod(s.shape)
        rows.append([s.role, repr(s.key), str(s.dtype).removeprefix("torch."),
                     "[" + ", ".join(map(str, s.shape)) + "]", format_number(s.min), format_number(s.max),
                     str(s.nan), str(s.inf), str(n)])
    header = ["gradient", "key", "dtype", "shape", "min", "max", "NaN", "Inf", "elements"]
    return ["  " + line for line in format_table(header, rows)]
