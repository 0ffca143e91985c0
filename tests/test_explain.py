"""gt.explain and `gradtap explain`: tables, legacy indices found by value, no side effects."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtap as gt
from gradtap.cli import main
from tests._models import assert_no_hooks, convnet


def test_explain_convnet_matches_autograd_and_restores_state():
    torch.manual_seed(0)
    net = convnet()
    x, y = torch.randn(2, 1, 28, 28), torch.tensor([3, 7])
    ex = gt.explain(net, x, loss=lambda out: F.cross_entropy(out, y))
    assert all(p.grad is None for p in net.parameters())
    assert_no_hooks(net)
    expected = torch.autograd.grad(F.cross_entropy(net(x), y), [net.conv1.weight, net.fc3.bias])
    conv1 = [r for r in ex.records if r.module_name == "conv1"][0]
    fc3 = [r for r in ex.records if r.module_name == "fc3"][0]
    torch.testing.assert_close(conv1.param_grads["weight"], expected[0])
    torch.testing.assert_close(fc3.param_grads["bias"], expected[1])
    text = str(ex)
    assert "Conv2d 'conv1' call 0" in text and "ReLU 'relu' call 3" in text
    assert "this call's share of dL/d weight" in text  # the roles explained once, below
    assert "'parameter' rows this call's share of p.grad" in text


def test_explain_restores_batchnorm_buffers_and_existing_grads():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    net(torch.randn(5, 3)).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    running = net[1].running_mean.clone()
    gt.explain(net, torch.randn(5, 3))
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads))
    assert torch.equal(net[1].running_mean, running)


@pytest.mark.parametrize(
    ("layer", "x", "expected"),
    [
        (nn.Linear(3, 2), torch.randn(4, 3),
         {"parameter:bias": "0", "input:input": "1", "parameter:weight": "2 (transposed)"}),
        (nn.Conv2d(2, 3, 3), torch.randn(2, 2, 5, 5),
         {"input:input": "0", "parameter:weight": "1", "parameter:bias": "2"}),
    ],
)
def test_legacy_indices_found_by_value(layer, x, expected):
    # The documented legacy layouts: Linear (bias, input, weight.T), Conv2d (input, weight, bias).
    x.requires_grad_(True)
    ex = gt.explain(layer, x, select="", legacy=True)
    assert ex.legacy[("", 0)] == expected
    assert "legacy" in str(ex).splitlines()[1]
    assert layer._is_full_backward_hook is None
    assert_no_hooks(layer)


def test_explain_bad_loss():
    net = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="loss must return a scalar tensor; got a tensor of shape"):
        gt.explain(net, torch.randn(3, 2), loss=lambda out: out)
    with pytest.raises(TypeError, match="inputs must be a tensor"):
        gt.explain(net, 3)
    assert_no_hooks(net)


def test_cli_explain_example(capsys):
    assert main(["explain", "--example", "convnet", "--legacy"]) == 0
    out = capsys.readouterr().out
    for name in ["conv1", "conv2", "fc1", "fc2", "fc3"]:
        assert f"'{name}' call 0" in out
    assert "2 (transposed)" in out


def test_cli_explain_user_file(tmp_path, capsys):
    path = tmp_path / "mymodel.py"
    path.write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(3 * 6, 2))
    """))
    assert main(["explain", f"{path}:build", "--input-shape", "2,2,8"]) == 0
    assert "Conv1d '0' call 0" in capsys.readouterr().out
    assert main(["explain", f"{path}:nope", "--input-shape", "2,2,8"]) == 2
    assert "has no callable 'nope'; callables there: build" in capsys.readouterr().err
    assert main(["explain", f"{path}:build"]) == 2
    assert "--input-shape is required" in capsys.readouterr().err
    assert main(["explain", f"{path}:build", "--input-shape", "2,x"]) == 2
    assert "--input-shape must be comma-separated integers" in capsys.readouterr().err
    assert main(["explain", "--example", "convnet", "--select", "conv9"]) == 2
    assert "select='conv9' matches no module; closest module names: conv2, conv1" in capsys.readouterr().err


def test_the_tables_fit_the_terminal_and_say_each_meaning_once(monkeypatch):
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    ex = gt.explain(net, torch.randn(5, 3))
    monkeypatch.setenv("COLUMNS", "72")
    text = str(ex)
    assert max(len(line) for line in text.splitlines()) <= 72
    full = ex.render()  # no width: nothing cut
    assert full.count("its uses after the call returned") == 1  # in the legend only
    assert "..." not in full and max(len(line) for line in full.splitlines()) > 72
    html = ex._repr_html_()
    assert html.count("<table>") == len(ex.records)


def test_explain_bare_layer_explains_the_layer_itself():
    # A model without submodules: the default selection is the root (select="" elsewhere).
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    x = torch.randn(4, 5, requires_grad=True)
    ex = gt.explain(layer, x)
    assert [(r.module_name, r.module_type, r.call) for r in ex.records] == [("", "Linear", 0)]
    (rec,) = ex.records
    out = layer(x)
    g_x, g_w, g_b = torch.autograd.grad(out.sum(), (x, layer.weight, layer.bias))
    slots = {f"{role}:{key}": grad for role, key, grad in rec.slots()}
    torch.testing.assert_close(slots["output:output"], torch.ones_like(out))
    torch.testing.assert_close(slots["input:input"], g_x)
    torch.testing.assert_close(slots["parameter:weight"], g_w)
    torch.testing.assert_close(slots["parameter:bias"], g_b)
    assert "Linear '(root)' call 0" in str(ex)
    # A model with submodules still explains only the submodules by default.
    net = nn.Sequential(nn.Linear(5, 3))
    assert [r.module_name for r in gt.explain(net, x).records] == ["0"]


def test_cli_explain_bare_layer_factory(tmp_path, capsys):
    (tmp_path / "bare.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(5, 3)\n")
    assert main(["explain", f"{tmp_path / 'bare.py'}:build", "--input-shape", "2,5"]) == 0
    assert "Linear '(root)' call 0" in capsys.readouterr().out


def test_cli_explain_runs_the_file_with_its_own_argv(tmp_path, capsys, monkeypatch):
    # A training script that parses its command line at import: it must not see gradtap's.
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import argparse, sys
        import torch
        SEEN = list(sys.argv)
        print("argv at import:", SEEN)
        args = argparse.ArgumentParser().parse_args()  # exits on an unknown argument

        def build():
            assert sys.argv == SEEN, (sys.argv, SEEN)
            return torch.nn.Sequential(torch.nn.Linear(3, 2))
    """))
    argv = ["explain", f"{script}:build", "--input-shape", "4,3", "--select", "0"]
    monkeypatch.setattr(sys, "argv", ["gradtap", *argv])
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "Linear '0' call 0" in captured.out, captured.err
    assert f"argv at import: [{str(script)!r}]" in captured.out
    assert sys.argv == ["gradtap", *argv]  # restored


def test_cli_explain_file_that_exits_at_import_is_one_line(tmp_path, capsys):
    script = tmp_path / "needs_args.py"
    script.write_text("import argparse\nargparse.ArgumentParser().add_argument('--data', "
                      "required=True)\nimport sys\nsys.exit(3)\n")
    assert main(["explain", f"{script}:build", "--input-shape", "4,3"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"gradtap explain: error: {script} exited (code 3) while gradtap "
                          f"imported it and called build() with sys.argv = ['{script}']")
