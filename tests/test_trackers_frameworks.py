"""The callbacks log into the trainers' own trackers: Lightning's TensorBoardLogger and
CSVLogger files, and the Hugging Face Trainer's report_to TensorBoard event files, hold gradtap's
keys at the trainers' global steps and logging cadence (read back with tensorboard's reader and
the CSV module), equal to the run store's values."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from torch import nn

import gradtap as gt
from tests._trackers import tensorboard_scalars


def global_norms(run) -> dict[int, float]:
    """The global gradient norm of each stored step, from the stored per-tensor norms."""
    params = [n for n in run.names if not n.startswith("<")]
    per = [dict(zip(*(a.tolist() for a in run.series(n, "norm")))) for n in params]
    return {s: math.sqrt(sum(p[s] ** 2 for p in per)) for s in run.steps}


# Lightning's own warnings about this tiny setup (few batches, no dataloader workers).
@pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
def test_lightning_logs_through_its_tensorboard_and_csv_loggers(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from gradtap.integrations.lightning import GradtapCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            self.global_steps: list[int] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return (self.net(x) - y).pow(2).mean()

        def on_before_optimizer_step(self, optimizer):
            self.global_steps.append(self.trainer.global_step)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                       batch_size=2)
    model = Tiny()
    loggers = [pl.loggers.TensorBoardLogger(tmp_path, name="tb"),
               pl.loggers.CSVLogger(tmp_path, name="csv")]
    trainer = pl.Trainer(max_steps=6, log_every_n_steps=2, callbacks=[GradtapCallback(
        store=tmp_path / "run")], logger=loggers, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1)
    trainer.fit(model, data)
    run = gt.open_run(tmp_path / "run")
    norms = global_norms(run)
    logged = [s for s in model.global_steps if s % 2 == 0]  # the trainer's cadence: every 2
    assert model.global_steps == run.steps == list(range(6)) and logged == [0, 2, 4]
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert sorted(scalars["grad/global_norm"]) == logged
    for s in logged:
        assert scalars["grad/global_norm"][s] == pytest.approx(norms[s], rel=1e-6)
        assert scalars["grad/max_norm"][s] == pytest.approx(
            max(run.series(n, "norm")[1][s] for n, _ in model.named_parameters()), rel=1e-6)
    (path,) = (tmp_path / "csv").rglob("metrics.csv")
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("grad/global_norm")]
    assert [int(r["step"]) for r in rows] == logged
    for r in rows:
        assert float(r["grad/global_norm"]) == pytest.approx(norms[int(r["step"])], rel=1e-12)
        assert "loss" not in r  # the trainer logs its own loss; gradtap's would clash


def _hf_train(tmp_path, report_to):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from gradtap.integrations.transformers import GradtapCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))
    g = torch.Generator().manual_seed(1)
    ds = [{"input_ids": x, "labels": x} for x in torch.randint(0, 32, (8, 6), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=2,
        report_to=report_to, logging_steps=2, use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, seed=0, save_strategy="no")
    transformers.Trainer(model=model, args=args, train_dataset=ds,
                         callbacks=[GradtapCallback(store=tmp_path / "run")]).train()
    return gt.open_run(tmp_path / "run")


def test_hf_trainer_logs_into_its_report_to_tensorboard_at_its_global_steps(tmp_path):
    run = _hf_train(tmp_path, ["tensorboard"])
    scalars = tensorboard_scalars(tmp_path / "runs")  # the TensorBoardCallback's own folder
    hf_steps = sorted(scalars["train/loss"])  # the Trainer's logging cadence and global step
    assert hf_steps == [2, 4, 6]
    assert sorted(scalars["grad/global_norm"]) == hf_steps
    norms = global_norms(run)
    # global step s logs the gradients of its optimizer step: Monitor step s - 1
    for s in hf_steps:
        assert scalars["grad/global_norm"][s] == pytest.approx(norms[s - 1], rel=1e-6)
    assert "loss" not in scalars  # the Trainer logs its own (train/loss)


# MLflow's SQLAlchemy store uses a loader strategy SQLAlchemy 2.1 deprecates (not our code).
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_hf_trainer_logs_into_its_report_to_mlflow_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    old = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        run = _hf_train(tmp_path, ["mlflow"])
    finally:
        mlflow.set_tracking_uri(old)
    client = MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    run_id = found.info.run_id
    hf_steps = sorted(m.step for m in client.get_metric_history(run_id, "loss")
                      if m.step in (2, 4, 6))
    ours = {m.step: m.value for m in client.get_metric_history(run_id, "grad/global_norm")}
    norms = global_norms(run)
    assert sorted(ours) == hf_steps == [2, 4, 6]
    for s in hf_steps:
        assert ours[s] == pytest.approx(norms[s - 1], rel=1e-12)


SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
"""


def test_watch_log_to_tensorboard_writes_the_summary_of_each_step(tmp_path, monkeypatch, capfd):
    import sys
    from pathlib import Path

    from gradtap.cli import main

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("PYTHONPATH", str(Path(gt.__file__).resolve().parent.parent))
    monkeypatch.chdir(tmp_path)
    assert main(["watch", "--out", "run", "--log-to", "tensorboard:tb", "--",
                 sys.executable, str(script)]) == 0
    said = [line for line in capfd.readouterr().err.splitlines()
            if line.startswith("gradtap watch:")]
    assert said == ["gradtap watch: run stored in run (4 steps)"]  # no tracker complained
    scalars = tensorboard_scalars(tmp_path / "tb")
    norms = global_norms(gt.open_run(tmp_path / "run"))
    assert scalars["grad/global_norm"] == pytest.approx(norms, rel=1e-6)
    assert sorted(norms) == [0, 1, 2, 3]


def test_watch_rejects_an_unknown_tracker(capsys):
    from gradtap.cli import main

    assert main(["watch", "--log-to", "neptune", "--", "python", "x.py"]) == 2
    assert "--log-to 'neptune': expected tensorboard:DIR, wandb or mlflow" in capsys.readouterr().err
