"""Every private torch API gradtap touches (``capture/compat.py``): each fallback, run as on a
torch that lacks the API (``compat.missing``), gives what the API gives, or loses only what
``compat.APIS`` says and warns once. Oracles: the same run with the API, and plain torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap._samples import buffers
from gradtap.capture import (
    HookSet,
    OncePerBackward,
    compat,
    current_backward,
    graph_nodes,
    saved_tensors,
)
from gradtap.capture.amp import ScalerWatch
from gradtap.capture.graph import made_since, sequence_mark

PACKAGE = Path(gt.__file__).parent


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def records_of(net: nn.Module, x: torch.Tensor) -> dict:
    """Every record's tensors, by (module, call, slot, key)."""
    net.zero_grad(set_to_none=True)
    with gt.tap(net, select=["", "*"]) as t:
        net(x).pow(2).sum().backward()
    out = {}
    for r in t.records:
        for slot in ("grad_outputs", "grad_inputs", "param_grads"):
            for k, v in getattr(r, slot).items():
                out[(r.module_name, r.call, slot, k)] = None if v is None else v.clone()
    return out


def assert_same_records(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for key in a:
        if a[key] is None or b[key] is None:
            assert a[key] is None and b[key] is None, key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=str(key))


def test_every_api_in_the_table_is_probed_and_the_running_torch_has_the_ones_it_needs():
    for path in compat.APIS:
        compat.available(path)  # probed without raising
    with pytest.raises(ValueError, match="not a private API"):
        with compat.missing("torch._C._no_such_thing"):
            pass
    # What gradtap cannot do without (no fallback): present in every supported torch.
    for required in compat.REQUIRED:
        assert compat.required_present(required), required


def test_graph_task_fallback_gives_one_id_per_backward():
    x = torch.ones(3, requires_grad=True)
    real: list = []
    with compat.missing("torch._C._current_graph_task_id"):
        assert current_backward() is None
        ends = []
        once = OncePerBackward(lambda: ends.append(1))
        seen: list = []
        y = x * 2
        y.register_hook(lambda g: (seen.append(current_backward()), once.arm(), once.arm()) and None)
        z = y * 3
        z.register_hook(lambda g: seen.append(current_backward()) or None)
        with pytest.warns(compat.TorchCompatWarning, match="_current_graph_task_id"):
            z.sum().backward()
        z2 = x * 2 * 3
        z2.register_hook(lambda g: seen.append(current_backward()) or None)
        z2.sum().backward()
        assert current_backward() is None
    assert ends == [1]
    assert seen[0] is not None and seen[0] == seen[1] and seen[2] != seen[0]
    y = x * 2
    y.register_hook(lambda g: real.append(current_backward()) or None)
    y.sum().backward()
    assert real[0] is not None


def test_sequence_number_fallback_marks_the_same_point():
    x = torch.ones(2, requires_grad=True)
    before = x * 2
    with compat.missing("torch._C._autograd._get_sequence_nr"):
        fallback = sequence_mark()
    real = sequence_mark()
    assert fallback <= real  # the fallback's throw-away op takes one number
    after = before + 1
    assert [made_since(t, fallback) for t in (x, before, after)] == [False, False, True]


@pytest.mark.parametrize("path", ["torch._C._current_graph_task_id",
                                  "torch._C._autograd._get_sequence_nr",
                                  "torch._C._functions.AccumulateGrad",
                                  "torch._C._set_grad_enabled"])
def test_records_are_the_same_without(path):
    net, x = small_net(), torch.randn(5, 4)
    real = records_of(net, x)
    with compat.missing(path):
        assert_same_records(records_of(net, x), real)


def test_accumulate_grad_type_fallback_is_the_real_type():
    with compat.missing("torch._C._functions.AccumulateGrad"):
        fallback = compat.AccumulateGrad
    assert fallback is compat.AccumulateGrad
    leaf = torch.ones(1, requires_grad=True)
    assert type((leaf * 1).grad_fn.next_functions[0][0]) is fallback


def test_version_counter_fallback_uses_the_outputs_own_nodes():
    # Calls whose outputs are plain (not used inside the call, not views): same records.
    net, x = small_net(), torch.randn(5, 4)
    real = records_of(net, x)
    with compat.missing("torch._C._autograd._unsafe_set_version_counter"):
        assert_same_records(records_of(net, x), real)

    # A call returning a view of its input (flatten): the view's own node gives its record.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Flatten(0), nn.Tanh())
    x = torch.randn(2, 3, requires_grad=True)
    expected = torch.autograd.grad(m(x).pow(2).sum(), x)[0]
    real = records_of(m, x)
    x.grad = None
    with compat.missing("torch._C._autograd._unsafe_set_version_counter"):
        with pytest.warns(compat.TorchCompatWarning, match="_unsafe_set_version_counter"):
            with gt.tap(m, select=["", "*"]) as t:
                m(x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, expected)  # gradients untouched
    assert {(r.module_name, r.call) for r in t.records} == {(k[0], k[1]) for k in real}
    flat = t.find("1")[0]
    torch.testing.assert_close(flat.grad_outputs["output"], real[("1", 0, "grad_outputs", "output")])


def test_saved_tensor_fallback_reads_nothing_and_runs_no_recomputation():
    runs = []

    def region(x):
        runs.append(1)
        return x.sin().exp()

    x = torch.randn(5, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False).tanh()
    with compat.missing("torch._C._autograd.SavedTensor.unpack_hook"):
        with pytest.warns(compat.TorchCompatWarning, match="unpack_hook"):
            assert saved_tensors(graph_nodes([y])) == {}
    assert runs == [1]
    y.sum().backward()
    assert runs == [1, 1]


def test_saved_tensor_fallback_in_detect_still_names_the_module():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    net[0].weight.data[0, 0] = float("nan")
    with compat.missing("torch._C._autograd.SavedTensor.unpack_hook"):
        with gt.detect(net, action="record") as det:
            net(torch.randn(2, 3)).sum().backward()
            det.step()
    assert [(a.module_name, a.kind) for a in det.anomalies][:1] == [("0", "nan")]


def after_accumulation_runs(checkpointed: bool) -> list:
    """What HookSet.after_accumulation reports over two backwards of a two-group model
    (the second layer under reentrant checkpointing: a backward nested in a node, which
    accumulates into its parameters before the first layer's)."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 1)
    ends: list = []
    hooks = HookSet()
    hooks.after_accumulation([list(a.parameters()), list(b.parameters())], ends.append)
    for _ in range(2):
        x = torch.randn(2, 3, requires_grad=True)
        h = a(x)
        out = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=True) if checkpointed else b(h)
        out.sum().backward()
    hooks.remove()
    return ends


def test_current_node_fallback_ends_each_plain_backward_once():
    assert after_accumulation_runs(False) == after_accumulation_runs(True) == [[0, 1], [0, 1]]
    with compat.missing("torch._C._current_autograd_node"):
        with pytest.warns(compat.TorchCompatWarning, match="_current_autograd_node"):
            assert after_accumulation_runs(False) == [[0, 1], [0, 1]]
        # What the fallback loses: the end of the checkpoint's nested backward is taken for
        # the end of the step's, so each backward reports its groups in two parts.
        assert after_accumulation_runs(True) == [[1], [0], [1], [0]]


def test_post_accumulate_hooks_attribute_fallback_still_removes_the_hook():
    p = nn.Parameter(torch.ones(2))
    fired = []
    with compat.missing("torch.Tensor._post_accumulate_grad_hooks"):
        hooks = HookSet()
        hooks.post_accumulate_grad(p, lambda t: fired.append(1))
        (p * 2).sum().backward()
        hooks.remove()
        (p * 2).sum().backward()
    assert fired == [1]


def test_grad_mode_fallback_sets_the_mode():
    with compat.missing("torch._C._set_grad_enabled"):
        with torch.enable_grad():
            compat.set_grad_enabled(False)
            assert not torch.is_grad_enabled()
            compat.set_grad_enabled(True)
            assert torch.is_grad_enabled()


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
def test_fused_finiteness_fallback_flags_the_same(poison):
    from gradtap._detect import _host

    group = [torch.randn(3), torch.randn(2, 2)]
    if poison is not None:
        group[1][0, 1] = poison
    (real,) = _host.nonfinite_flags([group])
    with compat.missing("torch._amp_foreach_non_finite_check_and_unscale_"):
        with pytest.warns(compat.TorchCompatWarning, match="non_finite_check"):
            (fallback,) = _host.nonfinite_flags([group])
    assert float(real) == float(fallback) == (0.0 if poison is None else 1.0)


def amp_step(scaler: torch.amp.GradScaler, poison: bool) -> tuple:
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    watch = ScalerWatch(scaler)
    loss = net(torch.randn(4, 3)).sum() * (float("inf") if poison else 1.0)
    scaler.scale(loss).backward()
    scale = watch.step_scale()
    scaler.unscale_(opt)
    found = watch.found_inf()
    scaler.step(opt)
    scaler.update()
    watch.remove()
    return scale, found


def test_scaler_scale_fallback_reads_the_same_scale():
    real, _ = amp_step(torch.amp.GradScaler("cpu", init_scale=16.0), poison=False)
    with compat.missing("torch.amp.GradScaler._scale"):
        with pytest.warns(compat.TorchCompatWarning, match="_scale"):
            fallback, _ = amp_step(torch.amp.GradScaler("cpu", init_scale=16.0), poison=False)
    assert float(real) == float(fallback) == 16.0


def test_scaler_state_fallback_loses_found_inf_only():
    _, real = amp_step(torch.amp.GradScaler("cpu"), poison=True)
    assert float(real) == 1.0
    with compat.missing("torch.amp.GradScaler._per_optimizer_states"):
        with pytest.warns(compat.TorchCompatWarning, match="_per_optimizer_states"):
            scale, fallback = amp_step(torch.amp.GradScaler("cpu", init_scale=8.0), poison=True)
    assert fallback is None and float(scale) == 8.0


def test_fused_optimizer_fallback_takes_every_optimizer_as_unfused():
    p = nn.Parameter(torch.ones(2))
    fused = torch.optim.Adam([p], fused=True)
    assert compat.steps_with_scale(fused)
    with compat.missing("torch.optim.Optimizer._step_supports_amp_scaling"):
        assert not compat.steps_with_scale(fused)
    assert not compat.steps_with_scale(torch.optim.SGD([p]))


# Importing torch's compiler builds TorchScript modules that warn on first import.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_compile_wrapper_fallback_finds_the_wrapper():
    net = small_net()
    wrapped = torch.compile(net)  # compiles lazily: nothing runs here
    assert compat.is_compile_wrapper(wrapped) and not compat.is_compile_wrapper(net)
    with compat.missing("torch._dynamo.eval_frame.OptimizedModule"):
        assert compat.is_compile_wrapper(wrapped) and not compat.is_compile_wrapper(net)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_compiled_call_fallback_sees_no_module_compiled_in_place():
    net = small_net()
    assert compat.compiled_call(net) is None
    net.compile()
    assert compat.compiled_call(net) is not None
    with compat.missing("torch.nn.Module._compiled_call_impl"):
        assert compat.compiled_call(net) is None


def test_no_private_torch_name_outside_the_compat_module():
    """``torch._X`` (and ``torch.a._b``) appears only in capture/compat.py; torch's documented
    ``torch._foreach_*`` functions are the exception."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() == "capture/compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                chain, cur = [node.attr], node.value
                while isinstance(cur, ast.Attribute):
                    chain.append(cur.attr)
                    cur = cur.value
                if isinstance(cur, ast.Name) and cur.id == "torch":
                    private = [c for c in chain if c.startswith("_") and not c.startswith("__")
                               and not c.startswith("_foreach_")]
                    if private:
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} "
                                     f"torch.{'.'.join(reversed(chain))}")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                    "torch") and any(p.startswith("_") for p in node.module.split(".")):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} from {node.module}")
    assert sorted(set(found)) == []


def test_the_docs_table_is_the_compat_table():
    docs = (Path(__file__).parents[1] / "docs" / "semantics.md").read_text()
    rows = [line for line in docs.splitlines() if line.startswith("| `torch.")]
    expected = [f"| `{a.path}` | {a.used_for} | {a.fallback} | {a.loses or 'nothing'} |"
                for a in compat.APIS.values()]
    assert rows == expected


@pytest.mark.parametrize("path", ["torch._C._storage_Use_Count",
                                  "torch._C._functorch.is_functorch_wrapped_tensor"])
def test_result_memory_fallback_builds_every_result_on_new_memory(path):
    """Without either probe no per-sample result is built on reused memory; the results stay
    those of ``torch.func.vmap``."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)

    def loss(p, xn, yn):
        return ((torch.func.functional_call(model, p, (xn[None],)) - yn) ** 2).sum()

    params = {k: p.detach() for k, p in model.named_parameters()}
    want = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    with compat.missing(path):
        for _ in range(3):
            with gt.per_sample(model, quantities=("grad",), loss_reduction="sum") as ps:
                ((model(x) - y) ** 2).sum().backward()
                got = ps.grad
            model.zero_grad(set_to_none=True)
            torch.testing.assert_close(got["weight"], want["weight"], rtol=1e-12, atol=1e-12)
            del got
        assert len(buffers.pool_for(model)) == 0  # nothing was built on pooled memory
        assert compat.functorch_wrapped(x) is None or compat.storage_use_count(
            x.untyped_storage()) is None
    assert compat.functorch_wrapped(x) is False and compat.storage_use_count(
        x.untyped_storage()) >= 1
