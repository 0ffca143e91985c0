"""The report's health panels: the loss on top, the noise scale, gain, RMS and the experts'
heatmap, read back from a run store and checked against the values the Monitor was given or
computed directly."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from torch import nn

import gradtap as gt
import gradtap.report as report
from tests.test_health import Experts


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = Experts()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.moe(x))


@pytest.fixture(scope="module")
def health_run(tmp_path_factory):
    torch.manual_seed(0)
    net = Model().double()
    run_dir = tmp_path_factory.mktemp("health") / "run"
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    losses, slice_norms = [], []
    with gt.Monitor(net, stats=("norm", "rms", "gain", "gns"),
                    kinds=("param_grad", "grad_output", "update"), split={"moe.experts.*": 0},
                    gns_from="microbatches", gns_beta=0.5, store=run_dir) as mon:
        for _ in range(6):
            total = 0.0
            for _ in range(2):
                x = torch.randn(4, 4, dtype=torch.float64)
                loss = net(x).pow(2).mean() / 2
                loss.backward()
                total += loss.item()
            mon.step(loss=total, batch_size=4)
            losses.append(total)
            slice_norms.append([float(g.norm()) for g in net.moe.experts.w1.grad])
            opt.step()
            opt.zero_grad()
    return run_dir, losses, np.array(slice_norms)


def test_report_data_holds_the_health_series(health_run):
    run_dir, losses, slice_norms = health_run
    data = report.build_report_data(run_dir)
    h = data.health
    assert h.loss is not None and h.loss[1].tolist() == pytest.approx(losses, rel=1e-15)
    assert list(h.gns)[0] == "<all>" and "moe.experts.w1" in h.gns
    assert not any("[" in n for n in h.gns) and h.gns_beta == 0.5
    assert set(h.gain) == {"head:output"}  # the others are fed the data (no input gradient)
    assert set(h.rms) == {"param_grad", "grad_output", "update"}
    # the slices have their own panel, not lines among the layers
    assert not any("[" in n for n in data.norms["param_grad"])
    assert set(h.experts) == {"moe.experts.w1", "moe.experts.w2"}
    w1 = h.experts["moe.experts.w1"]
    assert [k for k, _ in w1] == [0, 1, 2]
    got = np.stack([s[1] for _, s in w1], axis=1)
    np.testing.assert_allclose(got, slice_norms, rtol=1e-12)


def test_html_has_the_health_panels_with_the_loss_on_top(health_run, tmp_path):
    run_dir, _, slice_norms = health_run
    page = report.write_report(run_dir, tmp_path / "r.html").read_text()
    parser = _Tags()
    parser.feed(page)
    ids = [a.get("id") for t, a in parser.tags if t == "section"]
    assert {"loss", "gns", "gain", "rms", "experts"} <= set(ids)
    assert ids.index("loss") < ids.index("norms")  # the loss above the gradient norms
    plots = {a["data-plot"]: a for t, a in parser.tags if t == "svg"}
    assert {"health-loss", "health-gns", "health-gain", "health-rms-param_grad",
            "health-rms-update", "health-experts-0", "health-experts-1"} <= set(plots)
    heat = plots["health-experts-0"]
    assert (heat["data-rows"], heat["data-cols"]) == ("3", "6")
    # each cell's tooltip carries its slice's norm at its step
    tips = re.findall(r"<title>\[(\d)\], step (\d+): L2 norm ([^<]+)</title>", page)
    first = {(int(r), int(s)): v for r, s, v in tips[:18]}
    assert len(first) == 18
    for (r, s), v in first.items():
        assert float(v) == pytest.approx(slice_norms[s, r], rel=1e-2)


def test_a_run_without_health_stats_has_no_health_panels(tmp_path):
    net = nn.Linear(3, 1)
    with gt.Monitor(net, store=tmp_path / "run") as mon:
        net(torch.randn(2, 3)).sum().backward()
        mon.step()
    page = report.render_html(tmp_path / "run")
    for sid in ("loss", "gns", "gain", "rms", "experts"):
        assert f'<section id="{sid}">' not in page
