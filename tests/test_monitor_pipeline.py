"""A Monitor step is one pipeline: its rows reach every sink, columnar and labelled; one host
copy per step; the step module reads nothing of the Monitor."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap._monitor import step as step_module
from gradtap._monitor.rows import StepRows
from gradtap._monitor.sinks import HistorySink, StepSink
from gradtap._tensorops import HostCopy


class Recorder:
    """A sink that keeps what it was given."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, StepRows]] = []
        self.closed: list[str] = []

    def write(self, step: int, rows: StepRows) -> None:
        self.steps.append((step, rows))

    def close(self, status: str) -> None:
        self.closed.append(status)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def test_every_sink_gets_the_rows_the_history_stores(tmp_path):
    model = _net()
    mon = gt.Monitor(model, stats=("norm", "mean", "absmax"), kinds=("param_grad", "param"),
                     store=tmp_path / "run")
    rec = Recorder()
    mon._pipeline.sinks.append(rec)
    grads = []
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, 5, generator=g)).square().sum().backward()
        grads.append({n: p.grad.detach().double().clone() for n, p in model.named_parameters()})
        mon.step(loss=torch.tensor(0.5))
        model.zero_grad()
    mon.close()
    assert rec.closed == ["finished"]
    assert [s for s, _ in rec.steps] == [0, 1, 2]
    seen: set[int] = set()
    frame = mon.frame()
    for s, rows in rec.steps:
        assert rows.step == s and rows.values.dtype == np.float64 and len(rows) == len(rows.ids)
        seen |= {i for i, *_ in rows.new_series}
        assert set(rows.ids.tolist()) <= seen  # every id was announced by now
        names, kinds, stats = rows.labels()
        got = {(n, k, st): v for n, k, st, v in zip(names, kinds, stats, rows.values.tolist())}
        stored = frame[frame.step == s]
        assert got == {(r.name, r.kind, r.stat): r.value for r in stored.itertuples()}
        for name, grad in grads[s].items():  # against torch in float64
            assert got[(name, "param_grad", "norm")] == pytest.approx(
                float(torch.linalg.vector_norm(grad)), rel=1e-5)
        assert got[("<loss>", "health", "value")] == 0.5


def test_sinks_are_step_sinks_and_all_close_when_one_fails():
    model = _net()
    mon = gt.Monitor(model)
    assert isinstance(mon._pipeline.sinks[0], HistorySink)
    assert all(isinstance(s, StepSink) for s in mon._pipeline.sinks)

    class Failing(Recorder):
        def close(self, status: str) -> None:
            super().close(status)
            raise OSError("tracker went away")

    first, after = Failing(), Recorder()
    mon._pipeline.sinks += [first, after]
    model(torch.randn(2, 5)).sum().backward()
    mon.step()
    with pytest.raises(OSError, match="tracker went away"):
        mon.close()
    assert first.closed == after.closed == ["finished"]
    assert mon.frame().step.unique().tolist() == [0]  # the history closed too, and reads


@pytest.mark.parametrize("wide", [False, True])
def test_one_host_copy_per_step(monkeypatch, wide):
    """One host copy per step, once the first step has learnt which tensors need the two-pass
    std (a dominant mean: here the last bias, whose gradient is constant); that step takes
    one more, small copy for them."""
    model = _net()
    mon = (gt.Monitor(model, stats=("norm", "mean", "std", "absmax", "nonfinite", "rms"),
                      kinds=("param_grad", "param", "update", "grad_cosine"), ewma=0.9)
           if wide else gt.Monitor(model))
    runs = []
    real = HostCopy.run
    monkeypatch.setattr(HostCopy, "run", lambda self: (runs.append(1), real(self))[1])
    for i in range(4):
        model(torch.randn(3, 5)).sum().backward()
        before = len(runs)
        mon.step()
        assert len(runs) - before == (1 if i else 2), f"step {i}: {len(runs) - before} copies"
        model.zero_grad()
    mon.close()


def test_the_step_module_reads_nothing_of_the_monitor():
    """One way: the Monitor builds its pipeline; the pipeline never imports the Monitor."""
    tree = ast.parse(Path(step_module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "gradtap._monitor.monitor" not in imported
    assert "Monitor" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
