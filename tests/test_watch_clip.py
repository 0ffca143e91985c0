"""`gradtap watch` on an unmodified script that clips its gradients: the stored statistics are
those of the gradient before the clip (accumulated over the step's backwards), the step also
stores the clip's total norm and factor, and the script runs bit for bit as without gradtap.
The oracle is the script itself: it saves what `clip_grad_norm_` returned and the gradient
norms it saw before and after the clip, and its final parameters. The scripts' runs without
gradtap (the oracles) are made once for the module, all in one Python process (see
``plain``); each run under ``gradtap watch`` is a process of its own, as a user's would be."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradtap as gt
from gradtap.cli import main
from gradtap.report.data import build_report_data
from tests._shared_run import once_per_session

SRC = str(Path(gt.__file__).resolve().parent.parent)

# A small GPT-like language model (embedding, one causal transformer block, a head) trained
# with AdamW; the clip is `clip_grad_norm_(..., 0.25)` or `clip_grad_value_(..., 0.05)`,
# `MICRO` backwards per optimizer step. Writes its own record to `record.json` and its final
# parameters to `params.pt` in the working directory.
SCRIPT = """
import json, sys
import torch
from torch import nn

CLIP, MICRO = sys.argv[1], int(sys.argv[2])

class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 32)
    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.block(self.embed(ids), src_mask=mask, is_causal=True))

torch.manual_seed(0)
model = TinyGPT()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
data = torch.randint(0, 32, (6 * MICRO, 4, 9), generator=torch.Generator().manual_seed(1))
record = []
for step in range(6):
    for k in range(MICRO):
        ids = data[step * MICRO + k]
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))
        (loss / MICRO).backward()
    before = {n: p.grad.norm().item() for n, p in model.named_parameters()}
    if CLIP == "norm":
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25).item()
    else:
        total = None
        torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.05)
    after = {n: p.grad.norm().item() for n, p in model.named_parameters()}
    record.append({"total": total, "before": before, "after": after})
    opt.step()
    opt.zero_grad()
    print("step", step, "loss", loss.item())
json.dump(record, open("record.json", "w"))
torch.save(dict(model.named_parameters()), "params.pt")
"""


# Runs scripts as `python SCRIPT ARGS...` would, one after the other in this process: each in
# its own folder (its working directory), with its own sys.argv, its output (fd 1) in the
# folder's stdout.txt.
PLAIN_DRIVER = """
import json, os, runpy, sys
for case in json.loads(sys.argv[1]):
    os.chdir(case["cwd"])
    sys.argv = [case["script"], *case["args"]]
    sys.stdout.flush()
    saved = os.dup(1)
    with open("stdout.txt", "w") as out:
        os.dup2(out.fileno(), 1)
        try:
            runpy.run_path(case["script"], run_name="__main__")
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
"""


def _available(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


def _plain_runs(root: Path) -> None:
    scripts = {"train.py": SCRIPT, "hf.py": HF, "pl.py": LIGHTNING}
    for name, text in scripts.items():
        (root / name).write_text(text)
    # The plain-torch cases first: the frameworks' imports come after them.
    cases = [("train.py", [clip, str(micro)]) for clip, micro in PLAIN_CASES]
    if _available("transformers", "accelerate"):
        cases.append(("hf.py", []))
    if _available("lightning"):
        cases += [("pl.py", [str(clip)]) for clip in LIGHTNING_CLIPS]
    todo = []
    for script, args in cases:
        folder = root / "-".join([Path(script).stem, *args])
        folder.mkdir()
        todo.append({"cwd": str(folder), "script": str(root / script), "args": args})
    done = subprocess.run([sys.executable, "-c", PLAIN_DRIVER, json.dumps(todo)], cwd=root,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of every script's run without gradtap: ``<script>-<args>/`` holds its
    stdout.txt and what it wrote (record.json, params.pt)."""
    return once_per_session(tmp_path_factory, "watch-clip-plain", _plain_runs)


def _run_watched(folder: Path, clip: str, micro: int, capfd: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> str:
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PYTHONPATH", SRC)
    capfd.readouterr()
    code = main(["watch", "--out", "run", "--", sys.executable,
                 str(folder.parent / "train.py"), clip, str(micro)])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    return captured.out


def _bit_identical(plain: Path, watched: Path) -> None:
    a = torch.load(plain / "params.pt", weights_only=True)
    b = torch.load(watched / "params.pt", weights_only=True)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# (clip, backwards per step) of the plain-torch script's runs.
PLAIN_CASES = [("norm", 1), ("norm", 2), ("value", 2)]


@pytest.mark.parametrize("micro", [1, 2])
def test_clip_grad_norm_the_norms_before_the_clip_and_its_factor(tmp_path, capfd, monkeypatch,
                                                                 micro, plain):
    (tmp_path / "train.py").write_text(SCRIPT)
    oracle = plain / f"train-norm-{micro}"
    watched_out = _run_watched(tmp_path / "watched", "norm", micro, capfd, monkeypatch)
    assert watched_out == (oracle / "stdout.txt").read_text()
    _bit_identical(oracle, tmp_path / "watched")
    record = json.loads((tmp_path / "watched" / "record.json").read_text())
    assert record == json.loads((oracle / "record.json").read_text())

    run = gt.open_run(tmp_path / "watched" / "run")
    assert run.steps == list(range(6))
    clip = run.frame(names="<clip>")
    norms = run.frame(stats="norm")
    factors = run.frame(stats="clip_factor")
    for step, seen in enumerate(record):
        at = clip[clip.step == step].set_index("stat").value
        # The total norm the script's clip returned, exactly; and torch's factor.
        assert at["norm"] == seen["total"]
        assert at["clip_factor"] == pytest.approx(min(1.0, 0.25 / (seen["total"] + 1e-6)),
                                                  rel=1e-6)
        assert at["clip_factor"] < 1.0  # this model's gradients are clipped at every step
        # Every tensor's statistics are those of its gradient before the clip ...
        mine = norms[(norms.step == step) & (norms.name != "<clip>")].set_index("name").value
        assert mine.to_dict() == pytest.approx(seen["before"], rel=1e-5)
        assert mine.to_dict() != pytest.approx(seen["after"], rel=1e-3)
        assert math.sqrt((mine ** 2).sum()) == pytest.approx(seen["total"], rel=1e-5)
        # ... and each tensor's factor is the one the clip applied to it.
        per = factors[(factors.step == step) & (factors.name != "<clip>")]
        assert sorted(per.name) == sorted(seen["before"])
        for name, before in seen["before"].items():
            assert per[per.name == name].value.item() == pytest.approx(
                seen["after"][name] / before, rel=1e-5)


def test_clip_grad_value_the_norms_before_the_clip_and_each_tensors_factor(tmp_path, capfd,
                                                                           monkeypatch, plain):
    (tmp_path / "train.py").write_text(SCRIPT)
    oracle = plain / "train-value-2"
    watched_out = _run_watched(tmp_path / "watched", "value", 2, capfd, monkeypatch)
    assert watched_out == (oracle / "stdout.txt").read_text()
    _bit_identical(oracle, tmp_path / "watched")
    record = json.loads((tmp_path / "watched" / "record.json").read_text())
    run = gt.open_run(tmp_path / "watched" / "run")
    assert "<clip>" not in run.names  # an elementwise clip has no total norm
    norms = run.frame(stats="norm")
    factors = run.frame(stats="clip_factor")
    clipped = 0
    for step, seen in enumerate(record):
        mine = norms[norms.step == step].set_index("name").value
        assert mine.to_dict() == pytest.approx(seen["before"], rel=1e-5)
        per = factors[factors.step == step].set_index("name").value
        expected = {n: seen["after"][n] / b for n, b in seen["before"].items()}
        assert per.to_dict() == pytest.approx(expected, rel=1e-5)
        clipped += sum(f < 0.999 for f in expected.values())
    assert clipped > 0  # the oracle is not trivially 1


def test_a_clip_before_the_first_step_under_a_grad_scaler_and_the_report(tmp_path, capfd,
                                                                        monkeypatch):
    # unscale_, clip, scaler.step: the watch starts at the first clip, with the scaler.
    script = tmp_path / "amp.py"
    script.write_text("""
import json, torch
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
totals = []
for step in range(3):
    loss = net(torch.randn(5, 3) * 20).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    totals.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5).item())
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print("totals", json.dumps(totals))
""")
    monkeypatch.setenv("PYTHONPATH", SRC)
    out = tmp_path / "run"
    assert main(["watch", "--out", str(out), "--report", "--", sys.executable,
                 str(script)]) == 0
    printed = capfd.readouterr().out
    totals = json.loads(printed.split("totals ", 1)[1])
    run = gt.open_run(out)
    assert run.series("<clip>", "norm")[1].tolist() == totals
    assert run.series("<scaler>", "amp_scale")[1].tolist() == [256.0] * 3
    # The report marks every clipped step with its factor; "<clip>" is no layer of its own.
    data = build_report_data(out)
    assert data.clipped == pytest.approx(
        {s: min(1.0, 0.5 / (t + 1e-6)) for s, t in enumerate(totals)}, rel=1e-6)
    assert "<clip>" not in {ly.name for ly in data.layers}
    assert "step 2: clipped (smallest factor" in (out / "report.html").read_text()


HF = """
import json
import torch
import transformers

torch.manual_seed(0)
cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2)
model = transformers.GPT2LMHeadModel(cfg)
ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": x, "labels": x} for x in ids]
args = transformers.TrainingArguments(
    output_dir="out", max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
    max_grad_norm=1e-3, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
    save_strategy="no", dataloader_num_workers=0, seed=0)
trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
trainer.train()
print("logged", json.dumps([h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]))
print("params", json.dumps([p.double().sum().item() for p in model.parameters()]))
"""


def test_a_hugging_face_trainer_script_stores_the_norm_the_trainer_logs(tmp_path, capfd,
                                                                          monkeypatch, plain):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    (tmp_path / "hf.py").write_text(HF)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", SRC)
    capfd.readouterr()
    assert main(["watch", "--out", "run", "--", sys.executable, "hf.py"]) == 0
    out = capfd.readouterr().out
    mine = [line for line in out.splitlines() if line.startswith(("logged", "params"))]
    assert mine == [line for line in (plain / "hf" / "stdout.txt").read_text().splitlines()
                    if line.startswith(("logged", "params"))]  # the same training
    logged = json.loads(mine[0].split(" ", 1)[1])
    run = gt.open_run(tmp_path / "run")
    assert run.series("<clip>", "norm")[1].tolist() == logged
    norms = run.frame(stats="norm")
    for step, total in enumerate(logged):
        mine_ = norms[(norms.step == step) & (norms.name != "<clip>")].value
        assert math.sqrt((mine_ ** 2).sum()) == pytest.approx(total, rel=1e-4)


LIGHTNING = """
import json, sys
import torch
from torch import nn
import lightning.pytorch as pl

CLIP = float(sys.argv[1])

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    def training_step(self, batch, i):
        x, y = batch
        return (self.net(x) - y).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class BeforeClip(pl.Callback):  # runs before Lightning's clip, after the step's backwards
    def on_before_optimizer_step(self, trainer, module, optimizer):
        grads = {n: p.grad for n, p in module.named_parameters()}
        print("norms", json.dumps({n: g.norm().item() for n, g in grads.items()}))
        print("total", torch.nn.utils.get_total_norm(list(grads.values())).item())

g = torch.Generator().manual_seed(1)
x = torch.randn(12, 4, generator=g)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                   batch_size=2)
model = Tiny()
pl.Trainer(max_steps=3, accumulate_grad_batches=2, callbacks=[BeforeClip()], logger=False,
           enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
           accelerator="cpu", devices=1, gradient_clip_val=CLIP or None).fit(model, data)
print("params", json.dumps([p.double().sum().item() for p in model.parameters()]))
"""


LIGHTNING_CLIPS = [0.0, 0.01]


@pytest.mark.parametrize("clip", LIGHTNING_CLIPS)
def test_a_lightning_script_its_closure_and_its_clip(tmp_path, capfd, monkeypatch, clip, plain):
    # Lightning steps its optimizer with a closure that runs the last micro-batch's backward
    # inside step(): the statistics are those of the whole step's gradient all the same.
    pytest.importorskip("lightning")
    (tmp_path / "pl.py").write_text(LIGHTNING)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", SRC)
    capfd.readouterr()
    assert main(["watch", "--out", "run", "--", sys.executable, "pl.py", str(clip)]) == 0
    out = capfd.readouterr().out
    assert out == (plain / f"pl-{clip}" / "stdout.txt").read_text()
    printed = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
               if line.startswith("norms ")]
    totals = [float(line.split()[1]) for line in out.splitlines() if line.startswith("total ")]
    run = gt.open_run(tmp_path / "run")
    assert run.steps == [0, 1, 2] and len(printed) == 3
    norms = run.frame(stats="norm")
    for step, seen in enumerate(printed):
        mine = norms[(norms.step == step) & (norms.name != "<clip>")].set_index("name").value
        assert mine.to_dict() == pytest.approx(seen, rel=1e-6)
    if clip:
        assert run.series("<clip>", "norm")[1].tolist() == totals
    else:
        assert "<clip>" not in run.names
