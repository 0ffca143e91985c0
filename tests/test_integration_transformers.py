"""The Hugging Face callback in a real ``Trainer.train`` on a tiny GPT-2 built from a config:
one Monitor step per optimizer step, norms equal to what the optimizer received (an optimizer
step pre-hook in the test is the oracle), taken before clipping, the EWMA carried across a
checkpoint resume, ``detect=True`` skipping a NaN step."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

import gradtap as gt  # noqa: E402
from gradtap.integrations.transformers import GradtapCallback  # noqa: E402


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def dataset(n=8, repeat=False):
    g = torch.Generator().manual_seed(1)
    ids = (torch.randint(0, 32, (2, 6), generator=g).repeat(n // 2, 1) if repeat
           else torch.randint(0, 32, (n, 6), generator=g))
    return [{"input_ids": x, "labels": x} for x in ids]


class Oracle:
    """An optimizer whose step pre-hook records the gradients each update receives."""

    def __init__(self, model, lr=1e-2):
        self.names = {p: n for n, p in model.named_parameters()}
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.seen: list[dict[str, float | None]] = []
        self.opt.register_step_pre_hook(self._record)

    def _record(self, opt, args, kwargs):
        self.seen.append({self.names[p]: (None if p.grad is None else p.grad.norm().item())
                          for g in opt.param_groups for p in g["params"]})


def train(tmp_path, cb, model, max_steps, ds=None, resume=None, loss_kwargs=None, **kw):
    oracle = Oracle(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=2,
        report_to=[], use_cpu=True, disable_tqdm=True,
        logging_steps=1, dataloader_num_workers=0, seed=0, lr_scheduler_type="constant", **{"save_strategy": "no", "gradient_accumulation_steps": 2, **kw})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds or dataset(),
                                   callbacks=[] if cb is None else [cb],
                                   optimizers=(oracle.opt, None))
    if loss_kwargs is not None:  # whether the model normalises its loss by the step's items
        trainer.model_accepts_loss_kwargs = loss_kwargs
    trainer.train(resume_from_checkpoint=resume)
    return oracle, trainer


@pytest.mark.parametrize("samples", [8, 6])  # 6: each epoch's last step has one micro-batch
def test_one_step_per_optimizer_step_with_the_norms_the_optimizer_received(tmp_path, samples):
    model = tiny_gpt2()
    oracle, _ = train(tmp_path, GradtapCallback(), model, max_steps=4, ds=dataset(samples),
                      max_grad_norm=0.0)
    run = gt.open_run(tmp_path / "gradtap")
    assert run.steps == [0, 1, 2, 3] and len(oracle.seen) == 4
    names = [n for n, p in model.named_parameters()]  # tied weights appear once
    assert sorted(run.names) == sorted([*names, "<loss>"])
    df = run.frame(stats="norm")
    for step, seen in enumerate(oracle.seen):
        for name, norm in seen.items():
            got = df[(df.step == step) & (df.name == name)].value.item()
            assert got == pytest.approx(norm, rel=1e-5), (step, name)


@pytest.mark.parametrize("samples", [8, 6])
@pytest.mark.parametrize("loss_kwargs", [True, False])
def test_the_loss_of_each_step_is_the_one_the_trainer_logs(tmp_path, samples, loss_kwargs):
    _, trainer = train(tmp_path, GradtapCallback(), tiny_gpt2(), max_steps=4,
                       ds=dataset(samples), loss_kwargs=loss_kwargs)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    steps, values = gt.open_run(tmp_path / "gradtap").series("<loss>", "value")
    assert steps.tolist() == [0, 1, 2, 3] and len(logged) == 4
    assert values.tolist() == pytest.approx(logged, rel=1e-6)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_norms_are_taken_before_gradient_clipping(tmp_path, accumulate):
    # The oracle of the gradient before the clip: the norm the Trainer logs (what its clip
    # returned); of the clip: torch's factor; of the run: the same run without the callback.
    model = tiny_gpt2()
    oracle, trainer = train(tmp_path, GradtapCallback(), model, max_steps=3,
                            max_grad_norm=1e-3, gradient_accumulation_steps=accumulate)
    plain_model = tiny_gpt2()
    plain_oracle, _ = train(tmp_path / "plain", None, plain_model, max_steps=3,
                            max_grad_norm=1e-3, gradient_accumulation_steps=accumulate)
    for (name, p), (_, q) in zip(model.named_parameters(), plain_model.named_parameters()):
        assert torch.equal(p, q), name  # bit for bit as without gradtap
    assert oracle.seen == plain_oracle.seen
    run = gt.open_run(tmp_path / "gradtap")
    df = run.frame(stats="norm")
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert run.steps == [0, 1, 2] and len(logged) == 3
    steps, clip_norm = run.series("<clip>", "norm")
    assert clip_norm.tolist() == logged  # the Trainer's own pre-clip norm, exactly
    _, factor = run.series("<clip>", "clip_factor")
    assert factor.tolist() == pytest.approx([min(1.0, 1e-3 / (n + 1e-6)) for n in logged],
                                            rel=1e-6)
    for step, seen in enumerate(oracle.seen):
        clipped = math.sqrt(sum(v**2 for v in seen.values()))
        assert clipped == pytest.approx(1e-3, rel=1e-3)  # the optimizer got clipped gradients
        mine = df[(df.step == step) & ~df.name.str.startswith("<")]
        total = math.sqrt((mine.value ** 2).sum())
        assert total == pytest.approx(logged[step], rel=1e-4)  # the Trainer's pre-clip norm
        per = run.frame(stats="clip_factor")
        per = per[(per.step == step) & (per.name != "<clip>")]
        assert sorted(per.name) == sorted(seen) and per.value.tolist() == pytest.approx(
            [factor[step]] * len(seen), rel=1e-12)


def test_ewma_survives_a_checkpoint_resume(tmp_path):
    ds = dataset(8, repeat=True)  # every batch the same: the resume sees what the run saw
    straight = GradtapCallback(ewma=0.9, store=tmp_path / "straight")
    train(tmp_path / "a", straight, tiny_gpt2(), max_steps=4, ds=ds)

    train(tmp_path / "b", GradtapCallback(ewma=0.9), tiny_gpt2(), max_steps=2, ds=ds,
          save_strategy="steps", save_steps=2)
    assert (tmp_path / "b" / "checkpoint-2" / "gradtap_state.pt").is_file()
    train(tmp_path / "b", GradtapCallback(ewma=0.9), tiny_gpt2(), max_steps=4, ds=ds,
          resume=str(tmp_path / "b" / "checkpoint-2"))

    a = gt.open_run(tmp_path / "straight")
    b = gt.open_run(tmp_path / "b" / "gradtap-2")
    assert b.steps == [2, 3]
    a_norms = a.frame(stats="norm")
    b_norms = b.frame(stats="norm")
    merged = a_norms[a_norms.step >= 2].merge(b_norms, on=["step", "name"])
    assert len(merged) == len(b_norms)
    assert merged.value_x.to_numpy() == pytest.approx(merged.value_y.to_numpy(), rel=1e-5)
    for name in a.ewma:
        for key in ("updates", "mean_norm", "var_mean", "var_max"):
            assert b.ewma[name][key] == pytest.approx(a.ewma[name][key], rel=1e-5), (name, key)


def test_detect_skips_the_anomalous_step(tmp_path):
    model = tiny_gpt2()
    calls = [0]

    def poison(module, args, output):
        calls[0] += 1
        if calls[0] in (3, 4):  # both micro-batches of optimizer step 1
            return output * float("nan")

    handle = model.transformer.h[0].mlp.register_forward_hook(poison)
    cb = GradtapCallback(detect=True)
    oracle, _ = train(tmp_path, cb, model, max_steps=3, max_grad_norm=0.0)
    handle.remove()
    assert cb.skipped == [1]
    assert all(v is None for v in oracle.seen[1].values())  # the optimizer got no gradients
    assert all(v is not None and math.isfinite(v) for v in oracle.seen[2].values())
    assert cb.anomalies and cb.anomalies[0].module_name.startswith("transformer.h.0.mlp")
    df = gt.open_run(tmp_path / "gradtap").frame(stats="nonfinite")
    assert (df[df.step == 1].value > 0).any() and (df[df.step != 1].value == 0).all()
    # The anomalies are saved beside the statistics, for the report (origin included).
    from gradtap.report import read_anomalies

    saved, source = read_anomalies(tmp_path / "gradtap")
    assert source == "gradtap callback (detect=True)"
    assert [(a["module_name"], a["step"]) for a in saved] == [
        (a.module_name, a.step) for a in cb.anomalies]


def test_fp16_grad_scaler_unscaled_norms_and_an_overflow_recorded_not_skipped(tmp_path):
    # Accelerate makes no GradScaler on CPU: the test gives the Trainer's accelerator a CPU
    # one (Accelerate then scales the loss, unscales before clipping and steps through it).
    # A forced overflow: an inf in one gradient of step 0's backward (float16 overflow is not
    # reachable on CPU, where the gradients stay float32).
    model = tiny_gpt2()
    calls = []

    def overflow(p):
        calls.append(1)
        if len(calls) == 1:
            p.grad.fill_(math.inf)

    model.transformer.wpe.weight.register_post_accumulate_grad_hook(overflow)
    oracle = Oracle(model)
    cb = GradtapCallback(detect=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
        report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        lr_scheduler_type="constant", save_strategy="no", max_grad_norm=0.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(),
                                   callbacks=[] if cb is None else [cb],
                                   optimizers=(oracle.opt, None))
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    trainer.train()
    run = gt.open_run(tmp_path / "gradtap")
    assert run.steps == [0, 1, 2]
    amp = run.frame(names="<scaler>")
    assert amp[amp.stat == "nonfinite"].value.tolist()[1:] == [0.0, 0.0]
    assert amp[amp.stat == "nonfinite"].value.tolist()[0] >= 1.0
    assert amp[amp.stat == "amp_scale"].value.tolist()[:2] == [2.0 ** 10, 2.0 ** 9]
    assert cb.overflows == [0] and cb.skipped == []
    assert {a.kind for a in cb.anomalies} <= {"overflow"}
    assert len(oracle.seen) == 2  # the scaler skipped step 0's update
    df = run.frame(stats="norm")
    for step, seen in zip([1, 2], oracle.seen):
        for name, norm in seen.items():
            got = df[(df.step == step) & (df.name == name)].value.item()
            assert got == pytest.approx(norm, rel=1e-5), (step, name)


def test_detect_samples_names_the_batch_row_behind_an_anomaly(tmp_path):
    model = tiny_gpt2()
    calls = [0]

    def poison(module, args, output):
        calls[0] += 1
        if calls[0] in (3, 4):  # step 1's first micro-batch and its replay: the second row
            output = output.clone()
            output[1] = float("nan")
            return output

    handle = model.transformer.h[0].mlp.register_forward_hook(poison)
    cb = GradtapCallback(detect="samples")
    train(tmp_path, cb, model, max_steps=3, max_grad_norm=0.0)
    handle.remove()
    assert cb.skipped == [1]
    a = cb.anomalies[0]
    assert a.module_name.startswith("transformer.h.0.mlp") and a.where == "forward"
    assert a.samples == (1,) and a.sample_ids is None  # positions: no ids reach the model


@pytest.mark.parametrize("calls", [(3,), (4,), (3, 4)])  # the first, the last or both
def test_one_anomaly_per_bad_step_under_gradient_accumulation(tmp_path, calls):
    # gradient_accumulation_steps=2: forward calls 3 and 4 are optimizer step 1's micro-batches
    model = tiny_gpt2()
    seen = [0]

    def poison(module, args, output):
        seen[0] += 1
        if seen[0] in calls:
            return output * float("nan")

    handle = model.transformer.h[0].mlp.register_forward_hook(poison)
    cb = GradtapCallback(detect=True)
    train(tmp_path, cb, model, max_steps=3, max_grad_norm=0.0)
    handle.remove()
    assert cb.skipped == [1]
    assert [(a.step, a.kind) for a in cb.anomalies] == [(1, "nan")]
    from gradtap.report import read_anomalies

    saved, _ = read_anomalies(tmp_path / "gradtap")
    assert [(a["step"], a["kind"]) for a in saved] == [(1, "nan")]
