"""gradtap.rules: a per-sample rule registered for a user's own module type, by dotted path.

Oracle: torch.func (vmap(grad(functional_call))) on each sample's own loss term, in float64.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import gradtap as gt
import gradtap.rules
from gradtap.errors import UnsupportedModuleError


@pytest.fixture(autouse=True)
def _restore_table() -> Iterator[None]:
    """Each test registers its own types; leave the table as it was."""
    table = gradtap.rules.PER_SAMPLE
    saved = dict(table._rules)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(old)
    table._rules.clear()
    table._rules.update(saved)
    table._cache.clear()


class Gate(nn.Module):
    """``y = x * sigmoid(gate) + shift`` over the last dim, for inputs ``[N, ..., D]``."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(features))
        self.shift = nn.Parameter(torch.randn(features))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(self.gate) + self.shift


def grad_gate(module: nn.Module, inp: Tensor, grad_out: Tensor,
              names: frozenset[str]) -> dict[str, Tensor]:
    n, d = inp.shape[0], inp.shape[-1]
    s = torch.sigmoid(module.gate)
    out = {}
    if "gate" in names:
        out["gate"] = (grad_out * inp).reshape(n, -1, d).sum(1) * s * (1 - s)
    if "shift" in names:
        out["shift"] = grad_out.reshape(n, -1, d).sum(1)
    return out


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), Gate(4), nn.Tanh(), nn.Linear(4, 2))


def oracle(net: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p: dict[str, Tensor], xn: Tensor, yn: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(net, p, (xn[None],)), yn[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def run(net: nn.Module, **kw: object) -> tuple[gt.PerSample, dict[str, Tensor]]:
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    with gt.per_sample(net, fallback=False, **kw) as ps:  # type: ignore[arg-type]
        F.cross_entropy(net(x), y).backward()
    return ps, oracle(net, x, y)


def test_a_rule_registered_by_dotted_path_gives_per_sample_gradients_and_norms() -> None:
    net = model()
    with pytest.raises(UnsupportedModuleError, match=r"no per-sample rule for module '1' of type "
                                                     r"Gate .*fallback=False"):
        run(net)
    assert gradtap.rules.per_sample_rule(Gate)(grad_gate) is grad_gate
    ps, ref = run(net, quantities=("grad", "norm", "variance"))
    for k, r in ref.items():
        torch.testing.assert_close(ps.grad[k], r, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(ps.norms[k], r.flatten(1).norm(dim=1), rtol=1e-9, atol=1e-12)
    # Norms and statistics only: reduced from the rule's gradients, a chunk of samples at a time.
    ps, ref = run(model(), quantities=("norm", "variance"))
    for k, r in ref.items():
        torch.testing.assert_close(ps.norms[k], r.flatten(1).norm(dim=1), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(ps.variance[k], r.var(0, correction=0), rtol=1e-9, atol=1e-12)


def test_fast_paths_are_used_for_norms_and_sums_of_squares() -> None:
    calls: list[str] = []

    def norm_gate(module: nn.Module, inp: Tensor, grad_out: Tensor,
                  names: frozenset[str]) -> dict[str, Tensor]:
        calls.append("norm")
        return {k: g.flatten(1).square().sum(1) for k, g in grad_gate(module, inp, grad_out,
                                                                       names).items()}

    def sum_sq_gate(module: nn.Module, inp: Tensor, grad_out: Tensor,
                    names: frozenset[str]) -> dict[str, Tensor]:
        calls.append("sum_sq")
        return {k: g.square().sum(0) for k, g in grad_gate(module, inp, grad_out, names).items()}

    gradtap.rules.per_sample_rule(Gate, norm_sq=norm_gate, sum_sq=sum_sq_gate)(grad_gate)
    ps, ref = run(model(), quantities=("norm", "second_moment"))
    assert calls == ["norm", "sum_sq"]
    torch.testing.assert_close(ps.norms["1.gate"], ref["1.gate"].flatten(1).norm(dim=1))
    torch.testing.assert_close(ps.second_moment["1.shift"], ref["1.shift"].square().mean(0))


def test_check_and_batch_dim_refuse_what_the_rule_cannot_split() -> None:
    gradtap.rules.per_sample_rule(
        Gate, check=lambda m: "its gate mixes samples" if m.gate.shape[0] > 3 else None
    )(grad_gate)
    with pytest.raises(UnsupportedModuleError, match=r"module '1' \(Gate\) are not defined: its "
                                                     r"gate mixes samples"):
        run(model())
    gradtap.rules.per_sample_rule(Gate, batch_dim=1, replace=True)(grad_gate)
    with pytest.raises(ValueError, match=r"batch_dim=0, but module '1' \(Gate\) takes inputs with "
                                         r"the sample dim at 1; use batch_dim=1"):
        run(model())


def test_a_subclass_uses_its_base_rule_unless_it_overrides_forward() -> None:
    class QuietGate(Gate):
        pass

    class OtherGate(Gate):
        def forward(self, x: Tensor) -> Tensor:
            return 2 * super().forward(x)

    gradtap.rules.per_sample_rule(Gate)(grad_gate)
    assert gradtap.rules.PER_SAMPLE.lookup(QuietGate(2)).grad is grad_gate
    net = nn.Sequential(nn.Linear(3, 4), OtherGate(4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(UnsupportedModuleError, match="of type OtherGate"):
        run(net)  # its own forward: the base rule does not apply, and fallback=False


def test_registration_errors_name_the_problem() -> None:
    gradtap.rules.per_sample_rule(Gate)(grad_gate)
    with pytest.raises(ValueError, match=r"per-sample gradient table: Gate already has a rule "
                                         r"\(PerSampleRule.*\); pass replace=True"):
        gradtap.rules.per_sample_rule(Gate)(grad_gate)
    with pytest.raises(TypeError, match=r"register\(\) needs at least one module type"):
        gradtap.rules.per_sample_rule()
    with pytest.raises(TypeError, match=r"register\(\) takes nn.Module subclasses, got 'Gate'"):
        gradtap.rules.per_sample_rule("Gate")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"PerSampleRule needs grad= .* or pieces="):
        gradtap.rules.PerSampleRule(norm_sq=grad_gate)


def test_per_sample_functional_and_rules_modules_import_by_dotted_path() -> None:
    """``import gradtap.a.b as m`` resolves attributes: no public verb may hide a module."""
    import importlib
    import pathlib
    import types

    root = pathlib.Path(gt.__file__).parent
    paths = [root / "rules.py", *sorted((root / "_samples").rglob("*.py")),
             *sorted((root / "_per_sample").rglob("*.py")),
             *sorted((root / "functional").rglob("*.py"))]
    for path in paths:
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        importlib.import_module(".".join(["gradtap", *parts]))
        obj: object = gt
        for part in parts:
            obj = getattr(obj, part)
        assert isinstance(obj, types.ModuleType), f"gradtap.{'.'.join(parts)} is {obj!r}"
