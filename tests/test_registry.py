"""TypeTable: decorator registration, duplicates, MRO lookup through parametrizations, caching."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from gradtap._registry import TypeTable
from gradtap.errors import UnsupportedModuleError


class MyLinear(nn.Linear):
    pass


class Double(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def rule_a(module: nn.Module) -> str:
    return "a"


def rule_b(module: nn.Module) -> str:
    return "b"


def test_register_returns_the_rule_and_lookup_finds_it() -> None:
    table: TypeTable = TypeTable("test")
    assert table.register(nn.Linear, nn.Conv1d)(rule_a) is rule_a
    assert table.lookup(nn.Linear(2, 3)) is rule_a
    assert table.lookup(nn.Conv1d(1, 1, 1)) is rule_a
    assert table.lookup(nn.Conv2d(1, 1, 1)) is None
    assert table.supported() == ["Conv1d", "Linear"]
    assert table.types() == [nn.Linear, nn.Conv1d]
    assert table.items() == [(nn.Linear, rule_a), (nn.Conv1d, rule_a)]
    assert nn.Linear in table and nn.Conv2d not in table


def test_lookup_walks_the_mro_and_prefers_the_most_derived_class() -> None:
    table: TypeTable = TypeTable("test")
    table.register(nn.Linear)(rule_a)
    sub = MyLinear(2, 3)
    assert table.lookup(sub) is rule_a  # found through the base class
    table.register(MyLinear)(rule_b)  # a later registration must not be hidden by the cache
    assert table.lookup(sub) is rule_b
    assert table.lookup(nn.Linear(2, 3)) is rule_a


def test_lookup_sees_through_parametrizations() -> None:
    table: TypeTable = TypeTable("test")
    table.register(nn.Linear)(rule_a)
    lin = nn.Linear(2, 3)
    parametrize.register_parametrization(lin, "weight", Double())
    assert type(lin) is not nn.Linear  # parametrize swapped in a generated subclass
    assert table.lookup(lin) is rule_a
    table.register(MyLinear)(rule_b)
    sub = MyLinear(2, 3)
    parametrize.register_parametrization(sub, "weight", Double())
    assert table.lookup(sub) is rule_b


def test_lookup_caches_per_class() -> None:
    table: TypeTable = TypeTable("test")
    table.register(nn.Linear)(rule_a)
    table.lookup(MyLinear(2, 2))
    table.lookup(nn.Tanh())
    assert table._cache == {MyLinear: rule_a, nn.Tanh: None}


def test_duplicate_registration_is_rejected_unless_replace() -> None:
    table: TypeTable = TypeTable("per-sample gradient")
    table.register(nn.Linear)(rule_a)
    with pytest.raises(ValueError, match=r"per-sample gradient table: Linear already has a rule "
                                          r"\(rule_a\); pass replace=True"):
        table.register(nn.Conv1d, nn.Linear)(rule_b)
    assert table.lookup(nn.Conv1d(1, 1, 1)) is None  # nothing half-registered
    table.register(nn.Linear, replace=True)(rule_b)
    assert table.lookup(nn.Linear(1, 1)) is rule_b


def test_register_rejects_non_module_types() -> None:
    table: TypeTable = TypeTable("test")
    with pytest.raises(TypeError, match="register\\(\\) takes nn.Module subclasses, got <class 'int'>"):
        table.register(int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs at least one module type"):
        table.register()


def test_require_names_the_module_and_lists_supported_types() -> None:
    table: TypeTable = TypeTable("per-sample gradient")
    table.register(nn.Linear, nn.Conv2d)(rule_a)
    assert table.require(nn.Linear(1, 1), "fc") is rule_a
    with pytest.raises(UnsupportedModuleError,
                       match=r"no per-sample gradient rule for module 'head' of type Bilinear; "
                             r"supported types \(and their subclasses\): Conv2d, Linear"):
        table.require(nn.Bilinear(1, 1, 1), "head")
