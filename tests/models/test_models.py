"""Every feature on tiny real models (``zoo.py``), each against an independent oracle.

* ``tap``: every module, the root included, against the boundary oracle (``boundary.py``,
  itself checked in ``test_oracle.py``): a record for every call that a gradient reaches
  (same call numbers), and per call ``grad_outputs`` (the gradient from the uses after the
  call returned), ``grad_inputs`` and ``param_grads`` (what reaches the arguments and the
  parameters through this call's uses of them: the VJP of the call with ``grad_outputs`` as
  cotangents, where nothing leaves the call other than through its outputs) under the same
  keys; the root's ``param_grads`` equal ``p.grad``, and so does the sum of the outermost
  (non-root) calls' (the oracle's sum for a parameter the root holds and uses itself);
  ``p.grad`` is the same with and without the tap, and the tap leaves no hook behind. A
  record for a call no gradient reached is accepted only if every slot holds ``None``.
* ``per_sample``: ``ps.grad`` and ``ps.norm`` against ``torch.autograd.grad`` of each
  sample's own loss run alone (``model.eval()`` where BatchNorm would couple the samples,
  in float64 there; every dropout is 0). The zoo's losses are means over samples of
  per-sample terms, so ``loss_reduction="mean"`` applies; the test checks that first.
* ``Monitor``: norm, mean, population std, absmax and the non-finite count of every
  parameter gradient, over two steps, against the same statistics computed from ``p.grad``.
* ``detect``: nothing on a healthy step, then a NaN planted in one element of the output of
  a leaf module in the middle of the forward is reported once, at that module.
* ``explain``: prints a table per record and leaves ``.grad`` and buffers as they were.

Tolerances (float32): a tensor matches when every element is within ``3e-5 * max|expected|``
of the oracle (the largest rounding difference seen between two correct computations, from
a different order of accumulation, is 6e-6). A gradient that is rounding noise around 0
(an attention key bias's: softmax ignores a constant shift) cannot be compared that way: a
tensor whose largest element is below ``1e-6`` of its neighbours' (the same kind of slot in
the same call; the parameters of the same module) only has to stay at that noise level.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gradtap as gt
from tests.models import zoo
from tests.models.boundary import Call, OracleResult, boundary_oracle

pytestmark = pytest.mark.models

MODELS = zoo.params()
RTOL = 3e-5  # of the tensor's largest element
NOISE = 1e-6  # of its neighbours' largest element: below this a tensor is rounding noise


# -- helpers ----------------------------------------------------------------------------------


def grads_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def gradient_scale(grads: Iterable[Tensor | None]) -> float:
    return max((float(g.abs().max()) for g in grads if g is not None and g.numel()), default=0.0)


def mismatch(actual: Tensor | None, expected: Tensor | None, noise: float = 0.0,
             same_dtype: bool = True) -> str | None:
    """None when they match, else why not: both None, or tensors of one shape and dtype
    within ``RTOL * max|expected|`` elementwise; where ``max|expected| <= noise`` (a gradient
    that is rounding noise around 0) within ``2 * noise``."""
    if expected is None or actual is None:
        if expected is None and actual is None:
            return None
        if actual is None:
            return f"None, expected a tensor of norm {float(expected.norm()):.4g}"
        return f"a tensor of norm {float(actual.norm()):.4g}, expected None"
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if same_dtype and actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(a).all():
        return "holds non-finite values"
    top = float(e.abs().max()) if e.numel() else 0.0
    err = float((a - e).abs().max()) if e.numel() else 0.0
    if err <= (2 * noise if top <= noise else RTOL * top):
        return None
    return f"max error {err:.3g} on a scale of {top:.3g} (norms {float(a.norm()):.5g} vs {float(e.norm()):.5g})"


def check(problems: list[str], what: str, actual: Tensor | None, expected: Tensor | None,
          noise: float = 0.0, same_dtype: bool = True) -> None:
    why = mismatch(actual, expected, noise, same_dtype)
    if why is not None:
        problems.append(f"{what}: {why}")


def fail_with(problems: list[str], title: str) -> None:
    if problems:
        shown = "\n  ".join(problems[:25])
        more = f"\n  ... and {len(problems) - 25} more" if len(problems) > 25 else ""
        pytest.fail(f"{title}: {len(problems)} mismatches\n  {shown}{more}", pytrace=False)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def hooks_of(model: nn.Module) -> dict[str, Any]:
    """Every hook on the model's modules and parameters (the model's own included)."""
    found: dict[str, Any] = {}
    for name, m in model.named_modules():
        for attr in _HOOK_DICTS:
            found[f"{name}:{attr}"] = sorted(getattr(m, attr, None) or {})
        found[f"{name}:attributes"] = sorted(vars(m))
    for name, p in model.named_parameters():
        found[f"{name}:tensor"] = (sorted(p._backward_hooks or {}),
                                   sorted(p._post_accumulate_grad_hooks or {}))
    return found


def noise_levels(grads: dict[str, Tensor]) -> dict[str, float]:
    """Per parameter, NOISE times the largest gradient element among the parameters of the
    module that owns it (a key bias's gradient is rounding noise next to its weight's)."""
    owner = {n: n.rpartition(".")[0] for n in grads}
    scale: dict[str, float] = {}
    for n, g in grads.items():
        scale[owner[n]] = max(scale.get(owner[n], 0.0), gradient_scale([g]))
    return {n: NOISE * scale[owner[n]] for n in grads}


def loss_fn(name: str, model: nn.Module, inputs: dict[str, Any]):
    def run() -> Tensor:
        torch.manual_seed(0)
        return zoo.run(name, model, inputs)
    return run


# -- tap against the boundary oracle ----------------------------------------------------------


def _compare_call(problems: list[str], rec: gt.GradRecord, call: Call) -> None:
    where = f"{call.name or '(root)'} call {call.index}"
    # Activation gradients are per element of a batch, parameter gradients sums over it: each
    # kind gets its own noise level, from the same call.
    act = NOISE * gradient_scale([*call.grad_outputs.values(), *call.grad_inputs.values()])
    par = NOISE * gradient_scale(call.param_grads.values())
    side_channel = " [this call's inputs/params also reach the loss outside its outputs]"
    for slot, got, expected in (("grad_outputs", rec.grad_outputs, call.grad_outputs),
                                ("grad_inputs", rec.grad_inputs, call.grad_inputs),
                                ("param_grads", rec.param_grads, call.param_grads)):
        if set(got) != set(expected):
            problems.append(f"{where} {slot} keys {sorted(got)}, expected {sorted(expected)}")
        vjp = {"grad_inputs": call.vjp_inputs, "param_grads": call.vjp_params}.get(slot, {})
        noise = par if slot == "param_grads" else act
        for key in expected:
            if key not in got:
                continue
            why = mismatch(got[key], expected[key], noise)
            if why is not None:
                note = ""
                if key in vjp and mismatch(vjp[key], expected[key], noise) is not None:
                    note = side_channel
                    if mismatch(got[key], vjp[key], noise) is None:
                        note += " (the record holds the VJP through the outputs only)"
                problems.append(f"{where} {slot}[{key!r}]: {why}{note}")


def _outermost_sums(model: nn.Module, records: dict[tuple[str, int], Any], oracle: OracleResult,
                    plain: dict[str, Tensor], noise: dict[str, float],
                    problems: list[str]) -> None:
    """The outermost (non-root) calls' param_grads, summed by parameter object, are p.grad.
    A parameter the root holds itself may also be used by the root's own forward outside
    every child call (ViT's class token): there the sum is the oracle's outermost calls'."""
    modules = dict(model.named_modules())
    got: dict[int, Tensor] = {}
    oracle_sum: dict[int, Tensor] = {}
    for call in oracle.calls:
        if not call.outermost:
            continue
        for key, g in call.param_grads.items():
            if g is not None:
                pid = id(modules[call.name].get_parameter(key))
                oracle_sum[pid] = oracle_sum.get(pid, 0) + g
        rec = records.get((call.name, call.index))
        if rec is None:
            continue
        for key, g in rec.param_grads.items():
            if g is not None:
                pid = id(modules[call.name].get_parameter(key))
                got[pid] = got.get(pid, 0) + g
    own = {id(p) for p in model._parameters.values() if p is not None}
    for name, p in model.named_parameters():
        if name in plain:
            expected = oracle_sum.get(id(p)) if id(p) in own else plain[name]
            check(problems, f"sum of the outermost calls' param_grads for {name}", got.get(id(p)),
                  expected, noise[name])


@pytest.mark.parametrize("name", MODELS)
def test_tap_records_match_the_boundary_oracle(name):
    model = zoo.build(name)
    inputs = zoo.make_inputs(name)
    run = loss_fn(name, model, inputs)
    loss = run()
    loss.backward()
    plain = grads_of(model)
    noise = noise_levels(plain)
    hooks = hooks_of(model)  # after a first forward: Hugging Face adds its own hooks lazily

    model.zero_grad(set_to_none=True)
    with gt.tap(model, select=["", "*"]) as t:
        tapped_loss = run()
        tapped_loss.backward()
    tapped = grads_of(model)
    assert hooks_of(model) == hooks, "the tap left hooks or attributes behind"
    model.zero_grad(set_to_none=True)
    oracle = boundary_oracle(model, run)
    assert oracle.loss.item() == pytest.approx(loss.item(), rel=1e-6)
    assert tapped_loss.item() == pytest.approx(loss.item(), rel=1e-6)

    problems: list[str] = []
    assert set(tapped) == set(plain), "the tap changed which parameters get a gradient"
    for n in plain:
        check(problems, f"p.grad of {n} under the tap", tapped[n], plain[n], noise[n])

    records: dict[tuple[str, int], gt.GradRecord] = {}
    for rec in t.records:
        key = (rec.module_name, rec.call)
        if key in records:
            problems.append(f"{rec.module_name} call {rec.call}: two records")
        records[key] = rec
    calls = {(c.name, c.index): c for c in oracle.calls}
    modules = dict(model.named_modules())
    for key, call in calls.items():
        rec = records.get(key)
        if rec is None:
            if call.reached:
                got = len(t.find(call.name))
                expected = sum(c.reached for c in oracle.of(call.name))
                problems.append(f"{call.name or '(root)'} call {call.index}: no record "
                                f"({got} records of that module, oracle {expected} calls "
                                "that a gradient reached)")
            continue
        if rec.module_type != type(modules[call.name]).__name__:
            problems.append(f"{call.name} call {call.index}: module_type {rec.module_type!r}")
        _compare_call(problems, rec, call)
    for key in records:
        if key not in calls:
            problems.append(f"{key[0] or '(root)'} call {key[1]}: a record for a call the "
                            f"oracle did not see ({len(oracle.of(key[0]))} calls)")

    root = records.get(("", 0))
    if root is not None:
        for n in plain:
            check(problems, f"root param_grads[{n!r}] vs p.grad", root.param_grads.get(n),
                  plain[n], noise[n])
    _outermost_sums(model, records, oracle, plain, noise, problems)
    fail_with(problems, f"{name}: tap records vs the boundary oracle")


# -- per-sample gradients against a loop over samples -----------------------------------------


def one_sample(inputs: dict[str, Any], n: int) -> dict[str, Any]:
    """Sample ``n`` of every batched tensor input (dim 0 of size N); the rest as is."""
    return {k: v[n:n + 1] if isinstance(v, Tensor) and v.dim() and v.shape[0] == zoo.N else v
            for k, v in inputs.items()}


def couples_samples(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("name", MODELS)
def test_per_sample_gradients_match_a_loop_over_samples(name):
    model = zoo.build(name)
    inputs = zoo.make_inputs(name)
    if couples_samples(model):
        # BatchNorm in train mode mixes the samples of a batch: eval mode, on running
        # statistics. There a deep random network amplifies float32 rounding well past the
        # tolerance (on torchvision's DenseNet, GoogLeNet, RegNet, the float32 loop alone is
        # off the float64 one by up to a few percent of a gradient's largest element, and a
        # batch rounds differently from a single sample), so these models run it in float64.
        model.eval().double()
        inputs = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v
                  for k, v in inputs.items()}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    losses, loop = [], []
    for n in range(zoo.N):
        loss_n = loss_fn(name, model, one_sample(inputs, n))()
        losses.append(loss_n.item())
        loop.append(torch.autograd.grad(loss_n, [p for _, p in params], allow_unused=True))
    expected = {pn: torch.stack([g[i] if g[i] is not None else torch.zeros_like(p)
                                 for g in loop])
                for i, (pn, p) in enumerate(params)}
    noise = noise_levels(expected)

    # Parameters no per-layer rule can split (shared position ids, windows folded into the
    # batch, per-sample sub-calls) come from a replay of an enclosing call, announced by one
    # warning per replayed call that names it.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gt.per_sample(model, loss_reduction="mean", quantities=("grad", "norm")) as ps:
            loss = loss_fn(name, model, inputs)()
            loss.backward()
    for w in caught:
        text = str(w.message)
        assert issubclass(w.category, UserWarning) and text.startswith("gradtap.per_sample"), text
        assert "replay of " in text, text
    # The zoo's loss is the mean over samples of each sample's own loss.
    assert loss.item() == pytest.approx(sum(losses) / zoo.N, rel=1e-5)

    problems: list[str] = []
    for pn, p in params:
        if pn not in ps.grad:
            problems.append(f"ps.grad has no entry for {pn}")
            continue
        check(problems, f"ps.grad[{pn!r}]", ps.grad[pn], expected[pn], noise[pn])
        check(problems, f"p.grad of {pn} vs the mean of the per-sample loop", p.grad,
              expected[pn].mean(0), noise[pn])
    norm = torch.stack([torch.stack([e[i].double().norm() for e in expected.values()]).norm()
                        for i in range(zoo.N)]).float()
    check(problems, "ps.norm", ps.norm, norm, same_dtype=False)
    fail_with(problems, f"{name}: per-sample gradients vs a loop over samples")


# -- Monitor statistics against p.grad --------------------------------------------------------


def statistics(g: Tensor) -> dict[str, float]:
    g = g.detach().double()
    return {"norm": float(g.norm()), "mean": float(g.mean()), "std": float(g.std(correction=0)),
            "absmax": float(g.abs().max()), "nonfinite": float((~torch.isfinite(g)).sum())}


@pytest.mark.parametrize("name", MODELS)
def test_monitor_statistics_match_the_gradients(name):
    model = zoo.build(name)
    expected: dict[tuple[int, str, str], tuple[float, float]] = {}
    with gt.Monitor(model) as mon:
        for step in range(2):
            model.zero_grad(set_to_none=True)
            loss_fn(name, model, zoo.make_inputs(name, seed=step))().backward()
            for pn, p in model.named_parameters():
                if p.grad is None:
                    continue
                rms = float(p.grad.double().pow(2).mean().sqrt())
                for stat, value in statistics(p.grad).items():
                    expected[(step, pn, stat)] = (value, rms)
            mon.step()
    frame = mon.frame()
    got = {(int(r.step), r.name, r.stat): float(r.value)
           for r in frame.itertuples() if r.kind == "param_grad"}
    problems = [f"step {s} {n} {stat}: missing" for (s, n, stat) in expected
                if (s, n, stat) not in got]
    problems += [f"step {s} {n} {stat}: reported, but that parameter has no gradient"
                 for (s, n, stat) in got if (s, n, stat) not in expected]
    for key, (value, rms) in expected.items():
        if key in got and abs(got[key] - value) > RTOL * (abs(value) + rms):
            problems.append(f"step {key[0]} {key[1]} {key[2]}: {got[key]!r}, expected {value!r}")
    fail_with(problems, f"{name}: Monitor statistics vs p.grad")


# -- detect: a planted NaN ---------------------------------------------------------------------


def leaf_calls_in_order(model: nn.Module, name: str, inputs: dict[str, Any]) -> list[str]:
    """Leaf modules with parameters that return a floating tensor, in the order first called."""
    order: list[str] = []
    handles = []
    for mname, m in model.named_modules():
        if next(m.children(), None) is None and next(m.parameters(recurse=False), None) is not None:
            def hook(mod, args, out, _name=mname):
                if isinstance(out, Tensor) and out.is_floating_point() and _name not in order:
                    order.append(_name)
            handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            loss_fn(name, model, inputs)()
    finally:
        for h in handles:
            h.remove()
    return order


def plant_nan(module: nn.Module):
    def hook(mod, args, out):
        mask = torch.zeros(out.numel(), dtype=torch.bool, device=out.device)
        mask[out.numel() // 2] = True
        return out.masked_fill(mask.view(out.shape), float("nan"))
    return module.register_forward_hook(hook)


def nan_target(model: nn.Module, name: str, inputs: dict[str, Any]) -> str:
    """The leaf in the middle of the forward (or the nearest one after it) whose planted NaN
    makes the loss NaN."""
    order = leaf_calls_in_order(model, name, inputs)
    modules = dict(model.named_modules())
    for target in order[len(order) // 2:] + order[:len(order) // 2][::-1]:
        handle = plant_nan(modules[target])
        try:
            with torch.no_grad():
                poisoned = loss_fn(name, model, inputs)()
        finally:
            handle.remove()
        if torch.isnan(poisoned):
            return target
    raise AssertionError(f"{name}: no leaf module whose NaN reaches the loss")


@pytest.mark.parametrize("name", MODELS)
def test_detect_reports_a_planted_nan_at_its_module(name):
    model = zoo.build(name)
    inputs = zoo.make_inputs(name)
    target = nan_target(model, name, inputs)
    with gt.detect(model, action="record") as det:
        loss_fn(name, model, inputs)().backward()
        det.step()
        healthy = list(det.anomalies)
        handle = plant_nan(dict(model.named_modules())[target])
        try:
            model.zero_grad(set_to_none=True)
            loss_fn(name, model, inputs)().backward()
            det.step()
        finally:
            handle.remove()
    assert healthy == [], f"{name}: anomalies on a healthy step: {healthy}"
    found = [(a.module_name, a.kind, a.where, a.slot, a.step, a.call) for a in det.anomalies]
    assert found == [(target, "nan", "forward", "output", 1, 0)], (
        f"{name}: NaN planted in {target}'s output; detect reported {found}"
        + "".join(f"\n--- {a.message}" for a in det.anomalies[:2]))


# -- explain -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_explain_prints_a_table_and_changes_nothing(name):
    model = zoo.build(name)
    inputs = zoo.make_inputs(name)
    loss_fn(name, model, inputs)().backward()
    before = grads_of(model)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    ex = gt.explain(model, zoo.model_inputs(inputs), loss=zoo.loss_of(name, inputs))
    text = str(ex)
    assert ex.records, f"{name}: explain made no record"
    for rec in ex.records:
        assert f"{rec.module_type} {rec.module_name or '(root)'!r} call {rec.call}" in text
    after = grads_of(model)
    assert set(after) == set(before)
    for n in before:
        assert torch.equal(after[n], before[n]), f"{name}: explain changed {n}.grad"
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), f"{name}: explain changed buffer {n}"
