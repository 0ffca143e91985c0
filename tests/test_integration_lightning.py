"""The Lightning callback in a real ``Trainer.fit``: one Monitor step per optimizer step,
norms equal to what the optimizer received (an optimizer-step hook in the test is the oracle),
the EWMA carried across a checkpoint resume, ``detect=True`` skipping a NaN step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

import gradtap as gt  # noqa: E402
from gradtap.integrations.lightning import GradtapCallback  # noqa: E402

# Lightning's own warnings about this tiny setup (few batches, no dataloader workers).
pytestmark = pytest.mark.filterwarnings(
    "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")


class Tiny(pl.LightningModule):
    def __init__(self, poison_step: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.seen: list[dict[str, float | None]] = []  # the oracle: what each step received
        self.losses: list[tuple[int, float]] = []  # (optimizer step, training_step's loss)
        self.poison_step = poison_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        loss = (out - y).pow(2).mean()
        self.losses.append((self.trainer.global_step, loss.item()))
        return loss

    def forward(self, x):
        if self.poison_step is not None and self.trainer.global_step == self.poison_step:
            # A NaN made in this module's own forward, between its children's calls.
            return self.net[2](self.net[1](self.net[0](x) * float("nan")))
        return self.net(x)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)

        # Lightning calls step(closure) and the closure runs the backward inside step(), so
        # the gradients the update used are read right after it (before zero_grad).
        def after_step(opt, args, kwargs):
            self.seen.append({n: (None if p.grad is None else p.grad.norm().item())
                              for n, p in self.named_parameters()})

        opt.register_step_post_hook(after_step)
        return opt


def data(n=16, repeat=False):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, generator=g).repeat(n // 2, 1) if repeat else torch.randn(
        n, 4, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=2)


def trainer(tmp_path, cb, max_steps, **kw):
    return pl.Trainer(max_steps=max_steps, accumulate_grad_batches=2, callbacks=[cb],
                      default_root_dir=tmp_path, logger=pl.loggers.CSVLogger(tmp_path),
                      enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", devices=1, **kw)


@pytest.mark.parametrize("samples", [16, 6])  # 6: each epoch's last step has one micro-batch
def test_one_step_per_optimizer_step_with_the_norms_the_optimizer_received(tmp_path, samples):
    model = Tiny()
    cb = GradtapCallback(ewma=0.9)
    trainer(tmp_path, cb, max_steps=4, enable_checkpointing=False).fit(model, data(samples))
    run = gt.open_run(tmp_path / "lightning_logs" / "version_0" / "gradtap")
    assert run.steps == [0, 1, 2, 3] and len(model.seen) == 4
    # Clean names: as in the LightningModule, no wrapper prefix.
    assert sorted(run.names) == sorted([*(n for n, _ in model.named_parameters()), "<loss>"])
    # The loss Lightning backpropagated in each step: each micro-batch's over
    # accumulate_grad_batches, summed.
    steps, losses = run.series("<loss>", "value")
    expected = [sum(v for s, v in model.losses if s == step) / 2 for step in range(4)]
    assert steps.tolist() == [0, 1, 2, 3]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    df = run.frame(stats="norm")
    for step, seen in enumerate(model.seen):
        for name, norm in seen.items():
            got = df[(df.step == step) & (df.name == name)].value.item()
            assert got == pytest.approx(norm, rel=1e-5)


class BeforeClip(pl.Callback):
    """The oracle of the gradient before Lightning's clip: on_before_optimizer_step runs
    before it."""

    def __init__(self):
        self.seen: list[dict[str, float]] = []
        self.totals: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = {n: p.grad for n, p in pl_module.named_parameters() if p.grad is not None}
        self.seen.append({n: g.norm().item() for n, g in grads.items()})
        self.totals.append(torch.nn.utils.get_total_norm(list(grads.values())).item())


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_norms_are_taken_before_gradient_clipping(tmp_path, algorithm):
    clip_val = 1e-3 if algorithm == "norm" else 1e-4
    model, before = Tiny(), BeforeClip()
    cb = GradtapCallback()
    t = trainer(tmp_path, cb, max_steps=3, enable_checkpointing=False, gradient_clip_val=clip_val,
                gradient_clip_algorithm=algorithm)
    t.callbacks.append(before)
    t.fit(model, data())
    plain = Tiny()
    trainer(tmp_path / "plain", BeforeClip(), max_steps=3, enable_checkpointing=False,
            gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm).fit(plain, data())
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), name  # bit for bit as without gradtap
    run = gt.open_run(tmp_path / "lightning_logs" / "version_0" / "gradtap")
    assert run.steps == [0, 1, 2] and len(model.seen) == len(before.seen) == 3
    df = run.frame(stats="norm")
    factors = run.frame(stats="clip_factor")
    for step, (seen, clipped) in enumerate(zip(before.seen, model.seen)):
        mine = df[(df.step == step) & ~df.name.str.startswith("<")].set_index("name").value
        assert mine.to_dict() == pytest.approx(seen, rel=1e-5)  # before the clip
        per = factors[(factors.step == step) & (factors.name != "<clip>")]
        per = per.set_index("name").value.to_dict()
        assert per == pytest.approx({n: clipped[n] / v for n, v in seen.items()}, rel=1e-4)
        assert max(per.values()) < 0.5  # the optimizer got clipped gradients
    if algorithm == "norm":
        _, total = run.series("<clip>", "norm")
        assert total.tolist() == before.totals  # what the clip computed, exactly
        _, factor = run.series("<clip>", "clip_factor")
        assert factor.tolist() == pytest.approx(
            [min(1.0, clip_val / (n + 1e-6)) for n in before.totals], rel=1e-6)
    else:
        assert "<clip>" not in run.names


def test_ewma_survives_a_checkpoint_resume(tmp_path):
    # Every batch is the same and the checkpoint is at an epoch's end (8 samples, batches of
    # 2, accumulation 2: two optimizer steps per epoch), so the resumed training is the
    # uninterrupted one.
    straight = GradtapCallback(ewma=0.9, store=tmp_path / "straight")
    trainer(tmp_path / "a", straight, max_steps=-1, max_epochs=2,
            enable_checkpointing=False).fit(Tiny(), data(8, repeat=True))

    first = GradtapCallback(ewma=0.9)
    t = trainer(tmp_path / "b", first, max_steps=-1, max_epochs=1, enable_checkpointing=False)
    t.fit(Tiny(), data(8, repeat=True))
    t.save_checkpoint(tmp_path / "b" / "mid.ckpt")
    resumed = GradtapCallback(ewma=0.9)
    trainer(tmp_path / "b", resumed, max_steps=-1, max_epochs=2, enable_checkpointing=False).fit(
        Tiny(), data(8, repeat=True), ckpt_path=tmp_path / "b" / "mid.ckpt")

    a = gt.open_run(tmp_path / "straight")
    b = gt.open_run(tmp_path / "b" / "lightning_logs" / "version_1" / "gradtap")
    assert b.steps == [2, 3]
    for name in a.ewma:
        for key in ("updates", "mean_norm", "var_mean", "var_max"):
            assert b.ewma[name][key] == pytest.approx(a.ewma[name][key], rel=1e-5), (name, key)


def test_detect_skips_the_anomalous_step(tmp_path):
    model = Tiny(poison_step=1)
    cb = GradtapCallback(detect=True)
    t = pl.Trainer(max_steps=3, accumulate_grad_batches=2, callbacks=[cb],
                   default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    t.fit(model, data())
    assert cb.skipped == [1]
    # Named when training_step calls the module (the detector watches its calls).
    assert [(a.module_name, a.where, a.step) for a in cb.anomalies[:1]] == [("", "forward", 1)]
    assert all(v is None for v in model.seen[1].values())  # the optimizer got no gradients
    assert all(v is not None for v in model.seen[2].values())
    df = gt.open_run(tmp_path / "gradtap").frame(stats="nonfinite")
    assert (df[df.step == 1].value > 0).all() and (df[df.step != 1].value == 0).all()
    # The anomalies are saved beside the statistics, for the report (origin included).
    from gradtap.report import build_report_data, read_anomalies

    saved, source = read_anomalies(tmp_path / "gradtap")
    assert source == "gradtap callback (detect=True)"
    assert [(a["module_name"], a["where"], a["step"]) for a in saved] == [
        (a.module_name, a.where, a.step) for a in cb.anomalies]
    report = build_report_data(tmp_path / "gradtap")
    assert report.anomaly_source == source and len(report.anomalies) == len(cb.anomalies)


# ------------------------------------------------------------------------ mixed precision


class Half(Tiny):
    """Tiny with SGD (unfused) or Adam(fused=True): the gradients the optimizer used are
    read after its step (unscaled by then in both cases)."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self(x).float() - y).pow(2).mean()
        self.losses.append((self.trainer.global_step, loss.item()))
        return loss

    def configure_optimizers(self):
        opt = (torch.optim.Adam(self.parameters(), lr=1e-3, fused=True) if self.fused
               else torch.optim.SGD(self.parameters(), lr=1e-2))

        def after_step(opt, args, kwargs):
            self.seen.append({n: p.grad.norm().item() for n, p in self.named_parameters()})

        opt.register_step_post_hook(after_step)
        return opt


@pytest.mark.parametrize("fused", [False, True])
def test_16_mixed_unscaled_norms_and_an_overflow_recorded_not_skipped(tmp_path, fused):
    from lightning.pytorch.plugins.precision import MixedPrecision

    # Lightning's "16-mixed" on CPU with an explicit CPU GradScaler. Step 0's scale (2^40)
    # overflows float16 in backward for sure; the back-off then makes it 2^10.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, backoff_factor=2.0 ** -30)
    model = Half(fused)
    cb = GradtapCallback(detect=True)
    trainer(tmp_path, cb, max_steps=4, enable_checkpointing=False,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]).fit(model, data())
    run = gt.open_run(tmp_path / "lightning_logs" / "version_0" / "gradtap")
    assert run.steps == [0, 1, 2, 3]
    amp = run.frame(names="<scaler>")
    flags = amp[amp.stat == "nonfinite"].value.tolist()
    # 1 once the scaler checked (unfused: unscale_ ran before the hook); with a fused
    # optimizer it checks inside step(), after the hook: the count of inf/NaN elements.
    assert flags[0] == 1.0 if not fused else flags[0] >= 1.0
    assert flags[1:] == [0.0, 0.0, 0.0]
    assert amp[amp.stat == "amp_scale"].value.tolist()[:2] == [2.0 ** 40, 2.0 ** 10]
    # The overflow is recorded, not counted as an anomaly that skips the step.
    assert cb.overflows == [0] and cb.skipped == []
    # (one per backward of the step's two micro-batches)
    assert cb.anomalies and {(a.kind, a.step) for a in cb.anomalies} == {("overflow", 0)}
    # The scaler skipped step 0 itself (an unfused optimizer's step() is not called, a fused
    # one's is, with found_inf set); on steps 1-3 the Monitor's norms are those of the
    # unscaled gradients the optimizer received.
    assert len(model.seen) == (4 if fused else 3)
    # The loss Lightning backpropagated was scaled (by 2^40 at step 0): stored unscaled.
    expected = [sum(v for s, v in model.losses if s == step) / 2 for step in range(4)]
    assert run.series("<loss>", "value")[1].tolist() == pytest.approx(expected, rel=1e-6)
    df = run.frame(stats="norm")
    for step, seen in zip([1, 2, 3], model.seen[-3:]):
        for name, norm in seen.items():
            got = df[(df.step == step) & (df.name == name)].value.item()
            assert got == pytest.approx(norm, rel=1e-5), (step, name)


def test_the_callback_watches_output_gradients_too(tmp_path):
    cb = GradtapCallback(kinds=("param_grad", "grad_output"))  # its option check used to refuse
    trainer(tmp_path, cb, max_steps=2, enable_checkpointing=False).fit(Tiny(), data())
    run = gt.open_run(tmp_path / "lightning_logs" / "version_0" / "gradtap")
    assert set(run.frame().kind) == {"param_grad", "grad_output", "health"}  # health: the loss
    assert run.steps == [0, 1]


class Indexed(torch.utils.data.Dataset):
    """Rows as dicts with their dataset index under ``"sample_ids"``; row 9 holds a NaN."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(16, 4, generator=g)
        self.x[9, 2] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.x[i].sum(0, keepdim=True), "sample_ids": i}


class FromDicts(Tiny):
    def training_step(self, batch, batch_idx):
        return (self(batch["x"]) - batch["y"]).pow(2).mean()


def test_detect_samples_names_the_dataset_rows_behind_an_anomaly(tmp_path):
    model = FromDicts()
    cb = GradtapCallback(detect="samples")
    t = pl.Trainer(max_steps=4, callbacks=[cb], default_root_dir=tmp_path, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, accelerator="cpu")
    t.fit(model, torch.utils.data.DataLoader(Indexed(), batch_size=4))
    assert cb.skipped == [2]  # rows 8..11
    (a,) = cb.anomalies
    assert (a.where, a.step, a.samples, a.sample_ids) == ("forward", 2, (1,), (9,))
    from gradtap.report import read_anomalies

    saved, _ = read_anomalies(tmp_path / "gradtap")
    assert [(s["samples"], s["sample_ids"]) for s in saved] == [([1], [9])]
