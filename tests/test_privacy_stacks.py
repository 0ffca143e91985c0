"""DP-SGD where people train: gradient accumulation over a logical batch, loss scaling with a
``GradScaler`` and compiled models, each against a per-sample loop (or the plain run)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import gradtap as gt
from tests._models import assert_no_hooks
from tests.test_privacy_dpsgd import (
    LR,
    MODELS,
    N_DATA,
    Q,
    _batch,
    _bound,
    _oracle_sum,
    _per_sample_loop,
    _trainable,
)


def _delta_check(model: nn.Module, before: dict[str, torch.Tensor],
                 expected: list[torch.Tensor]) -> None:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    for name, e in zip(names, expected, strict=True):
        torch.testing.assert_close(params[name].detach() - before[name],
                                   -LR * e / (Q * N_DATA), rtol=1e-10, atol=1e-13,
                                   msg=lambda m, name=name: f"{name}: {m}")


class _Scale(nn.Module):
    """A module without a layer rule: its per-sample gradients come from a replay."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w)


def _replayed() -> nn.Module:
    return nn.Sequential(_Scale(), nn.Linear(6, 3))


@pytest.mark.filterwarnings("ignore:.*replay")
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("kind", ["mlp", "embedding_layernorm_mha", "lora", "replayed"])
def test_micro_batches_equal_a_per_sample_loop_over_the_logical_batch(kind: str,
                                                                      clipping: str) -> None:
    torch.manual_seed(0)
    model = (_replayed() if kind == "replayed" else MODELS[kind][0]()).double()
    ref = copy.deepcopy(model)
    x, y = _batch("mlp" if kind == "replayed" else kind, 9, 1)
    grads = _per_sample_loop(ref, x, y)
    c = _bound(grads)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(_trainable(model), lr=LR)
    with gt.dp_sgd(model, opt, max_grad_norm=c, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0, clipping=clipping) as dp:  # type: ignore[arg-type]
        for lo, hi in [(0, 4), (4, 4), (4, 5), (5, 9)]:  # sizes 4, 0, 1, 4
            F.cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
            with torch.no_grad():  # an evaluation forward between micro-batches
                model(x[:2])
        opt.step()
        assert dp.steps == 1
    _delta_check(model, before, _oracle_sum(grads, _trainable(ref), c, clipping))
    assert_no_hooks(model)


def test_two_backwards_over_one_forward_are_one_micro_batch() -> None:
    torch.manual_seed(0)
    model = MODELS["mlp"][0]().double()
    ref = copy.deepcopy(model)
    x, y = _batch("mlp", 5, 2)
    params = _trainable(ref)
    grads = [list(torch.autograd.grad(
        F.cross_entropy(ref(x[i:i + 1]), y[i:i + 1]) + ref(x[i:i + 1]).square().sum(),
        params)) for i in range(5)]
    c = _bound(grads)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with gt.dp_sgd(model, opt, max_grad_norm=c, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0):
        out = model(x)
        F.cross_entropy(out, y).backward(retain_graph=True)
        out.square().sum(1).mean().backward()
        opt.step()
    _delta_check(model, before, _oracle_sum(grads, params, c, "flat"))


def _scaled_run(scaler: torch.amp.GradScaler | None, batches: list[torch.Tensor],
                sigma: float = 0.0) -> tuple[nn.Module, gt.DPSGD, torch.Generator]:
    torch.manual_seed(0)
    model = MODELS["mlp"][0]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(3)
    dp = gt.dp_sgd(model, opt, max_grad_norm=0.5, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=sigma, generator=gen, scaler=scaler)
    for x in batches:
        y = torch.arange(len(x)) % 3
        for part in (x[:3], x[3:]):  # two micro-batches
            loss = F.cross_entropy(model(part), y[:len(part)])
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    dp.detach()
    return model, dp, gen


def test_a_grad_scaler_clips_the_unscaled_gradients_and_skips_with_it() -> None:
    torch.manual_seed(9)
    good = [torch.randn(7, 6) for _ in range(2)]
    plain, _, _ = _scaled_run(None, good)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14)
    scaled, dp, _ = _scaled_run(scaler, good)
    for p, r in zip(scaled.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    assert dp.steps == 2

    # A batch with an inf: the scaler skips the step, the batch is dropped (no noise drawn,
    # nothing left for the next step), and the accountant counts it.
    bad = good[0].clone()
    bad[4, 0] = float("inf")
    _, _, gen_plain = _scaled_run(None, [good[1]], sigma=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14)
    skipped, dp, gen = _scaled_run(scaler, [bad, good[1]], sigma=1.0)
    assert scaler.get_scale() == 2.0 ** 13  # the skip halved it
    assert dp.steps == 2
    assert torch.equal(gen.get_state(), gen_plain.get_state())  # one step's noise drawn
    again, _, _ = _scaled_run(None, [good[1]], sigma=1.0)
    for p, r in zip(skipped.parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    # detached: the scaler is a plain one again
    assert not {"scale", "unscale_", "step", "update"} & set(vars(scaler))
    assert "__wrapped__" not in vars(torch.amp.GradScaler.step)
    assert_no_hooks(skipped)


def test_a_scaler_not_given_or_a_fused_optimizer_is_refused() -> None:
    model = MODELS["mlp"][0]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                   noise_multiplier=1.0)
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(F.cross_entropy(model(torch.randn(3, 6)), torch.tensor([0, 1, 2]))).backward()
    with pytest.raises(NotImplementedError, match="pass scaler=scaler"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert dp.steps == 0
    dp.detach()
    scaler.step(opt)  # detached: the scaler steps as usual
    fused = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    with pytest.raises(NotImplementedError, match="fused=False"):
        gt.dp_sgd(model, fused, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                  noise_multiplier=1.0, scaler=scaler)
    with pytest.raises(TypeError, match="GradScaler"):
        gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                  noise_multiplier=1.0, scaler=object())  # type: ignore[arg-type]
    assert_no_hooks(model)


@pytest.mark.parametrize("mode", ["wrapper", "inplace"])
def test_a_compiled_model_runs_eagerly_and_equals_eager(mode: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["mlp"][0]().double()
    ref = copy.deepcopy(model)
    x, y = _batch("mlp", 6, 3)
    grads = _per_sample_loop(ref, x, y)
    c = _bound(grads)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    if mode == "wrapper":
        run: nn.Module = torch.compile(model, backend="aot_eager")
    else:
        model.compile(backend="aot_eager")
        run = model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.warns(UserWarning, match="on a compiled model runs"):
        dp = gt.dp_sgd(run, opt, max_grad_norm=c, sample_rate=Q, dataset_size=N_DATA,
                       noise_multiplier=0.0)
    with dp:
        for lo, hi in [(0, 2), (2, 6)]:
            F.cross_entropy(run(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    _delta_check(model, before, _oracle_sum(grads, _trainable(ref), c, "flat"))
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", [
    "mlp", "cnn_groupnorm", "rmsnorm", "conv_gram", "lora", "sequence_linear", "tied_embedding",
    "embedding_layernorm_mha"])
def test_two_weighted_backwards_over_one_forward_add_up_per_sample(kind: str) -> None:
    torch.manual_seed(0)
    model = MODELS[kind][0]().double()
    ref = copy.deepcopy(model)
    x, y = _batch(kind, 5, 1)
    grads = _per_sample_loop(ref, x, y)
    c = _bound(grads)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    with gt.dp_sgd(model, opt, max_grad_norm=c, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0):
        out = model(x)
        (0.3 * F.cross_entropy(out, y)).backward(retain_graph=True)
        (0.7 * F.cross_entropy(out, y)).backward()
        opt.step()
    _delta_check(model, before, _oracle_sum(grads, _trainable(ref), c, "flat"))


class _SeqFirst(nn.Module):
    """A sequence-first classifier: tokens ``[T, B]`` through an Embedding, a
    ``batch_first=False`` encoder layer (or GRU, whose per-sample gradients come from a
    replay), a LayerNorm and a Linear head at every position, then the mean over positions
    (every layer sees the samples at dim 1, as ``batch_dim`` says)."""

    def __init__(self, core: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.core = (nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0) if core == "attention"
                     else nn.GRU(8, 8))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.core(self.emb(tokens))
        h = h[0] if isinstance(h, tuple) else h
        return self.head(self.norm(h)).mean(0)


@pytest.mark.filterwarnings("ignore:.*replay")
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("core", ["attention", "gru"])
def test_a_sequence_first_model_with_batch_dim_1(core: str, clipping: str) -> None:
    torch.manual_seed(0)
    model = _SeqFirst(core).double()
    ref = copy.deepcopy(model)
    tokens, y = torch.randint(0, 11, (5, 7)), torch.randint(0, 3, (7,))  # T=5, B=7
    params = _trainable(ref)
    grads = [list(torch.autograd.grad(F.cross_entropy(ref(tokens[:, i:i + 1]), y[i:i + 1]),
                                      params)) for i in range(7)]
    c = _bound(grads)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(_trainable(model), lr=LR)
    with gt.dp_sgd(model, opt, max_grad_norm=c, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0, clipping=clipping, batch_dim=1):  # type: ignore[arg-type]
        F.cross_entropy(model(tokens), y).backward()
        opt.step()
    _delta_check(model, before, _oracle_sum(grads, params, c, clipping))
    assert_no_hooks(model)


def test_a_sequence_first_model_without_batch_dim_says_which() -> None:
    model = _SeqFirst("attention")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=r"'core.self_attn' \(MultiheadAttention\) takes "
                                         r"inputs with the sample dim at 1; use batch_dim=1"):
        gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=Q, dataset_size=N_DATA,
                  noise_multiplier=1.0)
