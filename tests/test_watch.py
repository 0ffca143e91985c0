"""`gradtap watch -- python train.py`: unmodified scripts run as they would, every optimizer
they create is monitored. The oracle is the script itself: it prints the gradient norms its
optimizer receives, and the same script run without gradtap gives the same output."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap._watch import child
from gradtap.cli import main

SRC = str(Path(gt.__file__).resolve().parent.parent)

USER_SITE = "import builtins\nbuiltins.USER_SITE_RAN = True\n"

# Two optimizers (a second one steps every other batch), DataLoader worker processes, a
# Python subprocess, a spawned process that trains on its own (not the main process: not
# written), and an exit code of its own.
PLAIN = """
import builtins, json, multiprocessing as mp, subprocess, sys
import torch
from torch import nn

def side_job():
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.ones(1, 2)).sum().backward()
    opt.step()

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
    def forward(self, x):
        return self.head(self.body(x))

if __name__ == "__main__":
    print("user sitecustomize ran:", getattr(builtins, "USER_SITE_RAN", False))
    torch.manual_seed(0)
    model, critic = Net(), nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_critic = torch.optim.Adam(critic.parameters(), lr=0.01)
    ds = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        print("model", json.dumps({n: p.grad.norm().item() for n, p in model.named_parameters()}))
        opt.step()
        if i % 2 == 0:
            opt_critic.zero_grad()
            critic(x).pow(2).mean().backward()
            print("critic", json.dumps({n: p.grad.norm().item() for n, p in critic.named_parameters()}))
            opt_critic.step()
    p = mp.get_context("spawn").Process(target=side_job)
    p.start(); p.join()
    print("spawned exit code", p.exitcode)
    out = subprocess.run([sys.executable, "-c", "print('subprocess ran')"],
                         capture_output=True, text=True).stdout.strip()
    print(out)
    sys.exit(int(sys.argv[1]))
"""


def _env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "usersite"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(USER_SITE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(site)])}


def _printed(stdout: str, tag: str) -> list[dict[str, float]]:
    return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines()
            if line.startswith(tag + " ")]


def _assert_norms(run_dir: Path, printed: list[dict[str, float]]) -> None:
    run = gt.open_run(run_dir)
    assert run.steps == list(range(len(printed)))
    assert sorted(n for n in run.names if n != "<scaler>") == sorted(printed[0])
    df = run.frame(stats="norm")
    for step, norms in enumerate(printed):
        for name, norm in norms.items():
            got = df[(df.step == step) & (df.name == name)].value.item()
            if math.isinf(norm):
                assert math.isinf(got) or math.isnan(got), (step, name)
            else:
                assert got == pytest.approx(norm, rel=1e-6), (step, name)


def test_a_plain_script_runs_unchanged_and_every_optimizer_is_monitored(tmp_path, capfd,
                                                                         monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(PLAIN)
    env = _env(tmp_path)
    plain = subprocess.run([sys.executable, str(script), "3"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode == 3, plain.stderr
    assert "user sitecustomize ran: True" in plain.stdout

    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    out = tmp_path / "run"
    capfd.readouterr()
    code = main(["watch", "--out", str(out), "--", sys.executable, str(script), "3"])
    watched = capfd.readouterr()
    assert code == 3
    assert watched.out == plain.stdout  # output, sitecustomize, workers, subprocesses
    # gradtap's only words: where each run went, at the end
    said = [line for line in watched.err.splitlines() if line.startswith("gradtap watch:")]
    assert said == [f"gradtap watch: run stored in {out} (5 steps)",
                    f"gradtap watch: run stored in {out / 'optimizer-1'} (3 steps)"]

    _assert_norms(out, _printed(plain.stdout, "model"))
    _assert_norms(out / "optimizer-1", _printed(plain.stdout, "critic"))
    # The spawned process's optimizer is not the main process's: nothing else was written.
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["optimizer-1"]
    # sys.exit(3) is a failed run; the exit code is kept with it.
    assert gt.open_run(out).meta["status"] == "failed"
    assert gt.open_run(out / "optimizer-1").meta["exit_code"] == 3


def test_kinds_with_grad_output_runs_the_script(tmp_path, capfd, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(CRASH.replace("raise RuntimeError", "print"))
    monkeypatch.setenv("PYTHONPATH", _env(tmp_path)["PYTHONPATH"])
    out = tmp_path / "run"
    code = main(["watch", "--out", str(out), "--kinds", "param_grad,grad_output", "--",
                 sys.executable, str(script)])
    assert code == 0, capfd.readouterr().err
    df = gt.open_run(out).frame()
    assert set(df.kind) == {"param_grad", "grad_output"}
    assert sorted(set(df.step)) == [0, 1, 2]


CRASH = """
import torch
from torch import nn
net = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for step in range(3):
    if step == 2:
        raise RuntimeError("the script's own error")
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_an_uncaught_exception_keeps_its_exit_code_and_the_report_is_written(tmp_path, capfd,
                                                                             monkeypatch):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    monkeypatch.setenv("PYTHONPATH", SRC)
    out = tmp_path / "run"
    code = main(["watch", "--out", str(out), "--report", "--detect", "--select", "2.*",
                 "--stats", "norm,absmax", "--", sys.executable, str(script)])
    err = capfd.readouterr().err
    assert code == 1
    assert "RuntimeError: the script's own error" in err
    run = gt.open_run(out)
    assert run.steps == [0, 1] and run.meta["status"] == "failed" and run.meta["exit_code"] == 1
    assert sorted(run.names) == ["2.bias", "2.weight"]
    assert sorted(run.frame().stat.unique()) == ["absmax", "norm"]
    assert (out / "report.html").is_file() and (out / "anomalies.json").is_file()
    # Why it failed, in the metadata and on the report.
    assert run.meta["error"] == "RuntimeError: the script's own error"
    page = (out / "report.html").read_text()
    assert "RuntimeError: the script&#x27;s own error" in page and ">exit code<" in page


NAN = """
import sys
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(3, 4), nn.Linear(4, 1)
    def forward(self, x, poison=False):
        h = self.body(x)
        return self.head(h * float("nan") if poison else h)

# The script reads its own arguments, as scripts do: the watch's own never reach it.
assert sys.argv[1:] == ["--steps", "3"], sys.argv
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for step in range(int(sys.argv[2])):
    net(torch.randn(4, 3), poison=step == 1).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_detect_says_how_many_anomalies_and_the_first_ones_module(tmp_path, capfd, monkeypatch):
    script = tmp_path / "nan.py"
    script.write_text(NAN)
    monkeypatch.setenv("PYTHONPATH", SRC)
    out = tmp_path / "run"
    code = main(["watch", "--out", str(out), "--detect", "--stats", "norm", "--",
                 sys.executable, str(script), "--steps", "3"])
    err = capfd.readouterr().err
    assert code == 0, err
    found = json.loads((out / "anomalies.json").read_text())["anomalies"]
    # the NaN is made in the model's own forward, between its children's calls
    assert found and found[0]["step"] == 1 and found[0]["module_name"] == ""
    last = err.strip().splitlines()[-1]
    assert last == (f"gradtap watch: run stored in {out} (3 steps); --detect found "
                    f"{len(found)} anomal{'y' if len(found) == 1 else 'ies'}, the first at "
                    f"step 1 in the model itself ({found[0]['kind']}); see {out / 'anomalies.json'}")


HF = """
import json
import torch
import transformers

torch.manual_seed(0)
cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2)
model = transformers.GPT2LMHeadModel(cfg)
ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": x, "labels": x} for x in ids]

class PrintNorms(transformers.TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        print("norms", json.dumps({n: p.grad.norm().item() for n, p in model.named_parameters()}))

args = transformers.TrainingArguments(
    output_dir="out", max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
    max_grad_norm=0.0, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
    dataloader_num_workers=0, seed=0)
transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[PrintNorms()]).train()
"""


def test_a_hugging_face_trainer_script(tmp_path, capfd, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    script = tmp_path / "hf.py"
    script.write_text(HF)
    monkeypatch.setenv("PYTHONPATH", SRC)
    monkeypatch.chdir(tmp_path)
    code = main(["watch", "--out", "run", "--", sys.executable, str(script)])
    out = capfd.readouterr().out
    assert code == 0
    printed = _printed(out, "norms")
    assert len(printed) == 3
    _assert_norms(tmp_path / "run", printed)  # the Trainer's AdamW, wrapper not counted twice
    assert not (tmp_path / "run" / "optimizer-1").exists()


DDP = """
import json, os, sys, torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    torch.manual_seed(100 + 10 * step + rank)  # each rank its own batch
    model(torch.randn(6, 4)).pow(2).mean().backward()
    if rank == 0:  # the all-reduced gradients the optimizers receive
        print("norms", json.dumps({n: p.grad.norm().item()
                                   for n, p in model.module.named_parameters()}), flush=True)
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
# Skip interpreter teardown, where torch's gloo threads now and then abort the process
# ("terminate called without an active exception"; this script without gradtap did so in
# 1 of 12 torchrun runs), as tests/_dist.py does.
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_torchrun_ranks_rank_0_writes_the_reduced_gradients(tmp_path, capfd, monkeypatch):
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    monkeypatch.setenv("PYTHONPATH", SRC)
    out = tmp_path / "run"
    code = main(["watch", "--out", str(out), "--", sys.executable, "-m", "torch.distributed.run",
                 "--standalone", "--nproc-per-node", "2", str(script)])
    captured = capfd.readouterr()
    printed = _printed(captured.out, "norms")
    assert code == 0 and len(printed) == 3, captured.err[-3000:]
    _assert_norms(out, printed)  # names without DDP's "module."
    assert gt.open_run(out).meta["world_size"] == 2


# ------------------------------------------------------------------ in-process, no subprocess


def test_owner_model_names_parameters_by_their_outermost_module():
    class Wrapper(nn.Module):  # a wrapper with a "module" child is not taken off
        def __init__(self, m):
            super().__init__()
            self.module = m

    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    outer = Wrapper(inner)
    model, missing = child.owner_model(list(inner.parameters()))
    assert model is outer and missing == 0
    assert [n for n, _ in model.named_parameters()][0] == "module.0.weight"

    a, b = nn.Linear(2, 2), nn.Linear(2, 1)
    loose = torch.zeros(3, requires_grad=True)
    model, missing = child.owner_model([*a.parameters(), *b.parameters(), loose])
    assert missing == 1
    assert sorted(n for n, _ in model.named_parameters()) == [
        "Linear.bias", "Linear.weight", "Linear_1.bias", "Linear_1.weight"]
    assert child.owner_model([loose]) == (None, 1)


def test_an_optimizer_over_part_of_a_model_and_a_wrapping_optimizer(tmp_path, monkeypatch):
    monkeypatch.setenv(child.MAIN_ENV, str(os.getpid()))
    monkeypatch.delenv("RANK", raising=False)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    frozen_opt = torch.optim.SGD(net[2].parameters(), lr=0.1)  # fine-tuning the head only

    class Wrapping(torch.optim.Optimizer):  # as Accelerate's: steps an inner optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer
            super().__init__(optimizer.param_groups, {})

        def step(self, closure=None):
            return self.optimizer.step(closure)

    wrapped = Wrapping(frozen_opt)
    child.install({"out": str(tmp_path / "run")})
    try:
        seen = []
        for _ in range(3):
            net(torch.randn(5, 3)).pow(2).sum().backward()
            seen.append({n: p.grad.norm().item() for n, p in net.named_parameters()
                         if n.startswith("2.")})
            wrapped.step()
            net.zero_grad()
    finally:
        child.uninstall()
    _assert_norms(tmp_path / "run", seen)


# Gradient accumulation (two backwards of 4 samples per optimizer step); the script prints
# what the noise scale is made of: each backward's increment and the accumulated gradient.
ACCUMULATE = """
import json
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for step in range(4):
    before = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    increments = []
    for k in range(2):
        x, y = torch.randn(4, 3), torch.randn(4, 1)
        (nn.functional.mse_loss(net(x), y) / 2).backward()
        increments.append({n: (p.grad - before[n]).pow(2).sum().item()
                           for n, p in net.named_parameters()})
        before = {n: p.grad.clone() for n, p in net.named_parameters()}
    print("step", json.dumps({"increments": increments,
                              "total": {n: p.grad.pow(2).sum().item()
                                        for n, p in net.named_parameters()},
                              "rms": {n: p.grad.pow(2).mean().sqrt().item()
                                      for n, p in net.named_parameters()}}))
    opt.step()
    opt.zero_grad()
"""


def test_watch_stores_rms_and_the_noise_scale_from_microbatches(tmp_path, capfd, monkeypatch):
    script = tmp_path / "accumulate.py"
    script.write_text(ACCUMULATE)
    monkeypatch.setenv("PYTHONPATH", SRC)
    out = tmp_path / "run"
    assert main(["watch", "--out", str(out), "--stats", "rms,gns", "--gns-from",
                 "microbatches", "--batch-size", "4", "--", sys.executable, str(script)]) == 0
    printed = _printed(capfd.readouterr().out, "step")
    run = gt.open_run(out)
    rms = {(int(r.step), r.name): r.value for r in run.frame(stats="rms").itertuples()}
    for step, seen in enumerate(printed):
        for name, value in seen["rms"].items():
            assert rms[(step, name)] == pytest.approx(value, rel=1e-6)
    gns = {(int(r.step), r.name): r.value for r in run.frame(stats="gns").itertuples()}
    # The Monitor is made at the first optimizer step, after its backwards: no estimate there.
    assert all(math.isnan(v) for (step, _), v in gns.items() if step == 0)
    ema = None
    for step in (1, 2, 3):  # the oracle: b = 4, B = 8, each increment times 2 (loss / 2)
        seen = printed[step]
        small = sum(4 * sum(inc.values()) for inc in seen["increments"]) / 2
        big = sum(seen["total"].values())
        trace = (small - big) / (1 / 4 - 1 / 8)
        sq = (big / 4 - small / 8) / (1 / 4 - 1 / 8)
        ema = (trace, sq) if ema is None else (ema[0] + 0.05 * (trace - ema[0]),
                                               ema[1] + 0.05 * (sq - ema[1]))
        assert gns[(step, "<all>")] == pytest.approx(ema[0] / ema[1], rel=1e-4)


def test_cli_usage_errors(tmp_path, capsys):
    assert main(["watch"]) == 2
    assert "no command to run" in capsys.readouterr().err
    assert main(["watch", "--stats", "norm,bogus", "--", "python", "x.py"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["watch", "--stats", "gns", "--", "python", "x.py"]) == 2
    assert "and --gns-from ('ranks'" in capsys.readouterr().err
    assert main(["watch", "--stats", "gns", "--gns-from", "ranks", "--", "python", "x.py"]) == 2
    assert "--gns-from ranks needs --batch-size N" in capsys.readouterr().err
    assert main(["watch", "--stats", "gain", "--", "python", "x.py"]) == 2
    assert "add 'grad_output' to kinds" in capsys.readouterr().err
    assert main(["watch", "--out", str(tmp_path), "--", str(tmp_path / "no-such-program")]) == 127
    assert "cannot run" in capsys.readouterr().err
    with gt.Monitor(nn.Linear(1, 1), store=tmp_path / "taken"):
        pass
    assert main(["watch", "--out", str(tmp_path / "taken"), "--", "python", "x.py"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["watch", "--help"])
    assert exit_.value.code == 0
    assert "gradtap watch [options] -- COMMAND" in capsys.readouterr().out


@pytest.mark.parametrize("fused", [False, True])
def test_grad_scaler_steps_unscaled_and_the_skipped_overflow_step(tmp_path, monkeypatch, fused):
    # What an AMP loop does, unmodified: scale, backward, (unscale_ to clip,) scaler.step,
    # update. Step 0 overflows, so the scaler skips it (an unfused optimizer's step() is not
    # even called): still one Monitor step, stored as an overflow.
    monkeypatch.setenv(child.MAIN_ENV, str(os.getpid()))
    monkeypatch.delenv("RANK", raising=False)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = (torch.optim.Adam(net.parameters(), lr=1e-3, fused=True) if fused
           else torch.optim.SGD(net.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    original_step = torch.amp.GradScaler.step
    child.install({"out": str(tmp_path / "run")})
    try:
        seen = []
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(torch.randn(5, 3)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == 0:
                net[0].weight.grad[0, 0] = math.inf
            scale = scaler.get_scale()
            if not fused:
                scaler.unscale_(opt)  # as a loop that clips does; the watch starts after it
                scale = 1.0
            seen.append({n: (p.grad / scale).norm().item() for n, p in net.named_parameters()})
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        child.uninstall()
    assert torch.amp.GradScaler.step is original_step and "step" not in vars(scaler)
    run = gt.open_run(tmp_path / "run")
    assert run.steps == [0, 1, 2]
    amp = run.frame(names="<scaler>")
    assert amp[amp.stat == "nonfinite"].value.tolist() == [1.0, 0.0, 0.0]
    assert amp[amp.stat == "amp_scale"].value.tolist() == [1024.0, 512.0, 512.0]
    _assert_norms(tmp_path / "run", seen)
