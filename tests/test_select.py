"""Selection by glob, list of globs, class and predicate, with helpful errors."""

from __future__ import annotations

import fnmatch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradtap as gt
from tests._models import ResNetLike


@pytest.fixture(scope="module")
def net() -> nn.Module:
    return ResNetLike(width=2, num_classes=3)


def names(pairs):
    return [n for n, _ in pairs]


def test_star_is_every_submodule_and_root_only_by_empty(net):
    all_names = [n for n, _ in net.named_modules()]
    assert names(gt.select_modules(net, "*")) == all_names[1:]
    assert names(gt.select_modules(net, "")) == [""]


def test_glob_crosses_dots_and_question_mark(net):
    got = names(gt.select_modules(net, "layer?.*.conv*"))
    assert got and all(fnmatch.fnmatchcase(n, "layer?.*.conv*") for n in got)
    assert "layer1.0.conv1" in got and "layer4.1.conv2" in got


def test_list_of_globs_keeps_model_order_without_duplicates(net):
    got = names(gt.select_modules(net, ["fc", "layer1.0.*", "layer1.0.bn1"]))
    order = [n for n, _ in net.named_modules()]
    assert got == sorted(set(got), key=order.index)
    assert got[-1] == "fc"


def test_class_and_tuple_of_classes(net):
    convs = gt.select_modules(net, nn.Conv2d)
    assert convs and all(isinstance(m, nn.Conv2d) for _, m in convs)
    both = gt.select_modules(net, (nn.Conv2d, nn.Linear))
    assert len(both) == len(convs) + 1


def test_predicate(net):
    got = gt.select_modules(net, lambda name, m: name.endswith("bn2"))
    assert names(got) == [n for n, _ in net.named_modules() if n.endswith("bn2")]


def test_no_match_names_closest(net):
    with pytest.raises(gt.SelectionError, match=r"select='layer1.0.conv3' matches no module; closest module names: layer1.0.conv2, layer1.0.conv1"):
        gt.select_modules(net, "layer1.0.conv3")
    with pytest.raises(gt.SelectionError, match="no module of type LSTM in the model; module types present: .*Conv2d"):
        gt.select_modules(net, nn.LSTM)
    with pytest.raises(gt.SelectionError, match="the predicate 'nothing' selected no module"):
        def nothing(name, module):
            return False
        gt.select_modules(net, nothing)
    with pytest.raises(gt.SelectionError, match="select='fcc' matches no module"):
        gt.select_modules(net, ["fc", "fcc"])  # every glob of a list must match
    with pytest.raises(ValueError):  # SelectionError is a ValueError
        gt.select_modules(net, [])
    with pytest.raises(TypeError, match="select= must be a glob string"):
        gt.select_modules(net, 3)


def test_parameters(net):
    assert names(gt.select_parameters(net, "*")) == [n for n, _ in net.named_parameters()]
    biases = names(gt.select_parameters(net, "*.bias"))
    assert biases and all(n.endswith(".bias") for n in biases)
    conv_params = names(gt.select_parameters(net, nn.Conv2d))
    assert conv_params and all("conv" in n or "downsample.0" in n for n in conv_params)
    with pytest.raises(gt.SelectionError, match="closest parameter names: fc.weight"):
        gt.select_parameters(net, "fc.wieght")


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab.*?01", min_size=1, max_size=6))
def test_glob_agrees_with_fnmatch(glob):
    net = nn.Sequential(nn.Sequential(nn.Linear(1, 1), nn.ReLU()), nn.Linear(1, 1))
    expected = [n for n, _ in net.named_modules() if n and fnmatch.fnmatchcase(n, glob)]
    if expected:
        assert names(gt.select_modules(net, glob)) == expected
    else:
        with pytest.raises(gt.SelectionError):
            gt.select_modules(net, glob)


def test_module_parameters_by_module_or_parameter_name(net):
    from gradtap.select import select_parameters as select

    under = [n for n, _ in net.named_parameters() if n.startswith("layer1.")]
    assert names(select(net, "layer1")) == under  # a module: every parameter under it
    assert names(select(net, "layer1.*")) == under  # its submodules, and its parameters
    assert names(select(net, "fc.weight")) == ["fc.weight"]  # a parameter by its own name
    assert names(select(net, ["fc", "layer1.0.conv1"])) == ["layer1.0.conv1.weight",
                                                            "fc.weight", "fc.bias"]
    convs = [f"{m}.{p}" for m, mod in net.named_modules() if isinstance(mod, nn.Conv2d)
             for p, _ in mod.named_parameters()]
    assert names(select(net, nn.Conv2d)) == convs
    blocks = names(select(net, type(net.layer1[0])))  # a class: everything under its modules
    assert blocks and "layer1.0.bn1.weight" in blocks and "fc.weight" not in blocks
    assert names(select(net, lambda name, module: name == "fc")) == ["fc.weight", "fc.bias"]
    with pytest.raises(gt.SelectionError, match="select='layer9' matches no module or parameter"):
        select(net, ["fc", "layer9"])


def test_module_parameters_name_a_tied_weight_once():
    from gradtap.select import select_parameters

    tied = nn.ModuleDict({"emb": nn.Embedding(4, 3), "head": nn.Linear(3, 4, bias=False)})
    tied["head"].weight = tied["emb"].weight
    assert names(select_parameters(tied, "head")) == ["emb.weight"]
    assert names(select_parameters(tied, "*")) == ["emb.weight"]
