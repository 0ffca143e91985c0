"""CLI wiring of consumers' commands: `gradtap inspect` (detect dumps)."""

from __future__ import annotations

import torch
from torch import nn

import gradtap as gt
from gradtap.cli import main


class SqrtOfInput(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


def test_inspect_prints_the_dump_report(tmp_path, capsys):
    net = nn.Sequential(nn.Linear(4, 4), SqrtOfInput(), nn.Linear(4, 2))
    with torch.no_grad():
        net[0].bias.fill_(-100.0)  # sqrt of negatives: a forward NaN in module "1"
    with gt.detect(net, action="record", dump_dir=tmp_path / "dumps") as det:
        net(torch.randn(3, 4)).sum().backward()
        det.step()
    anomaly = det.anomalies[0]
    assert anomaly.module_name == "1"
    assert main(["inspect", anomaly.dump_path]) == 0
    assert capsys.readouterr().out.startswith(anomaly.message)
    assert main(["inspect", str(tmp_path / "missing.pt")]) == 2
    assert "gradtap inspect: error:" in capsys.readouterr().err
