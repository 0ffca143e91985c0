"""``gt.dp_sgd`` against a float64 per-sample loop (each sample's gradient from its own
forward and ``torch.autograd.grad``, clipped, summed, divided by ``q N``), on an MLP, a CNN
with GroupNorm, Embedding + LayerNorm + MultiheadAttention, an RMSNorm model and a frozen base
with a LoRA-style adapter, tied weights; the noise's size, freshness and reproducibility; the accountant;
the errors at construction; hook hygiene."""

from __future__ import annotations

import copy
import math

import dp_accounting as dpa
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtap as gt
from gradtap._privacy.accounting import calibrate_noise, epsilon
from gradtap.errors import UnsupportedModuleError
from tests._models import assert_no_hooks

Q, N_DATA, LR = 0.1, 80, 0.5  # q N = 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(tokens))
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head((h + a).mean(1))


class LoRA(nn.Module):
    """A frozen base Linear with a trainable low-rank adapter, as PEFT builds one."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(6, 3)
        self.lora_a = nn.Linear(6, 2, bias=False)
        self.lora_b = nn.Linear(2, 3, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class Tied(nn.Module):
    """An embedding whose table is also the output layer's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(tokens)).mean(1))


class Sequence(nn.Module):
    """Linear layers on ``[B, T, d]`` inputs, averaged over the tokens (few tokens: the
    norms take the Gram form, ``T (I + O) < O I``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(12, 10)
        self.outer = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x))).mean(1)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 3 * 3, 3))


def _conv_gram() -> nn.Module:
    """Its second convolution's norms take the Gram form (one output position)."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3), nn.Flatten(),
                         nn.Linear(4, 3))


def _rms() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.RMSNorm(5), nn.Tanh(), nn.Linear(5, 3))


MODELS = {
    "mlp": (_mlp, lambda b: torch.randn(b, 6)),
    "cnn_groupnorm": (_cnn, lambda b: torch.randn(b, 2, 5, 5)),
    "embedding_layernorm_mha": (Attention, lambda b: torch.randint(0, 11, (b, 4))),
    "rmsnorm": (_rms, lambda b: torch.randn(b, 6)),
    "conv_gram": (_conv_gram, lambda b: torch.randn(b, 3, 5, 5)),
    "lora": (LoRA, lambda b: torch.randn(b, 6)),
    "sequence_linear": (Sequence, lambda b: torch.randn(b, 2, 12)),
    "tied_embedding": (Tied, lambda b: torch.randint(0, 11, (b, 4))),
}


def _batch(kind: str, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = MODELS[kind][1](b)
    return (x.double() if x.is_floating_point() else x), torch.randint(0, 3, (b,))


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _per_sample_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     reduction: str = "mean") -> list[list[torch.Tensor]]:
    """Each sample's gradient of every trainable parameter, from a forward of its own."""
    params = _trainable(model)
    return [list(torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1],
                                                     reduction=reduction), params))
            for i in range(len(x))]


def _oracle_sum(grads: list[list[torch.Tensor]], params: list[nn.Parameter], c: float,
                clipping: str) -> list[torch.Tensor]:
    total = [torch.zeros_like(p) for p in params]
    for gs in grads:
        if clipping == "flat":
            norm = math.sqrt(sum(float(g.square().sum()) for g in gs))
            coefs = [min(1.0, c / (norm + 1e-6))] * len(gs)
        else:
            bound = c / math.sqrt(len(gs))
            coefs = [min(1.0, bound / (float(g.norm()) + 1e-6)) for g in gs]
        total = [t + k * g for t, k, g in zip(total, coefs, gs, strict=True)]
    return total


def _bound(grads: list[list[torch.Tensor]]) -> float:
    """A clipping bound that clips some samples and not others: the median norm."""
    norms = sorted(math.sqrt(sum(float(g.square().sum()) for g in gs)) for gs in grads)
    return norms[len(norms) // 2] if norms else 1.0


def _check_step(kind: str, b: int, clipping: str, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = MODELS[kind][0]().double()
    ref = copy.deepcopy(model)
    x, y = _batch(kind, b, seed + 1)
    grads = _per_sample_loop(ref, x, y)
    c = _bound(grads)
    expected = _oracle_sum(grads, _trainable(ref), c, clipping)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(_trainable(model), lr=LR)
    with gt.dp_sgd(model, opt, max_grad_norm=c, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0, clipping=clipping) as dp:  # type: ignore[arg-type]
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert dp.steps == 1
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    for name, e in zip(names, expected, strict=True):
        delta = params[name].detach() - before[name]
        torch.testing.assert_close(delta, -LR * e / (Q * N_DATA), rtol=1e-10, atol=1e-13,
                                   msg=lambda m, name=name: f"{kind} {name}: {m}")
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen: bit-identical
            assert torch.equal(p.detach(), before[name]), name
    assert_no_hooks(model)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("b", [0, 1, 2, 5, 16])
@pytest.mark.parametrize("kind", list(MODELS))
def test_one_step_equals_the_per_sample_loop(kind: str, b: int, clipping: str) -> None:
    _check_step(kind, b, clipping)


def test_every_batch_size_up_to_16_in_one_run() -> None:
    """One dp_sgd over consecutive steps of batch sizes 0..16 (the engine is cleared at
    each step), each step equal to the loop's."""
    torch.manual_seed(3)
    model = _mlp().double()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp = gt.dp_sgd(model, opt, max_grad_norm=0.3, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0)
    for b in [*range(17), 0, 3]:
        x, y = _batch("mlp", b, 100 + b)
        total = _oracle_sum(_per_sample_loop(ref, x, y), _trainable(ref), 0.3, "flat")
        with torch.no_grad():
            for p, t in zip(ref.parameters(), total, strict=True):
                p -= LR * t / (Q * N_DATA)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, r, rtol=1e-12, atol=1e-14)
    assert dp.steps == 19
    dp.detach()
    assert_no_hooks(model)


def test_sum_reduction_and_a_step_without_backward() -> None:
    torch.manual_seed(4)
    model = _mlp().double()
    ref = copy.deepcopy(model)
    x, y = _batch("mlp", 6, 5)
    expected = _oracle_sum(_per_sample_loop(ref, x, y, "sum"), _trainable(ref), 0.2, "flat")
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp = gt.dp_sgd(model, opt, max_grad_norm=0.2, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0, loss_reduction="sum")
    F.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    for p, b0, e in zip(model.parameters(), before, expected, strict=True):
        torch.testing.assert_close(p.detach() - b0, -LR * e / (Q * N_DATA), rtol=1e-10,
                                   atol=1e-13)
    after = [p.detach().clone() for p in model.parameters()]
    opt.step()  # no backward since: a step of noise only (none here), counted
    assert dp.steps == 2
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), after, strict=True))
    dp.detach()


def _noise_deltas(seed: int | None, steps: int = 2, sigma: float = 1.3,
                  c: float = 0.7) -> list[torch.Tensor]:
    """The updates of a zero-gradient model: noise alone."""
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    dp = gt.dp_sgd(model, opt, max_grad_norm=c, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=sigma, generator=gen)
    deltas = []
    for _ in range(steps):
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        (model(torch.randn(4, 100)) * 0).sum().backward()
        opt.step()
        opt.zero_grad()
        deltas.append(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)
    dp.detach()
    return deltas


def test_noise_std_fresh_and_reproducible() -> None:
    sigma, c = 1.3, 0.7
    first, second = _noise_deltas(7, sigma=sigma, c=c)
    expected = sigma * c * LR / (Q * N_DATA)
    for d in (first, second):
        assert d.numel() == 10100
        assert abs(float(d.std()) / expected - 1) < 0.05
        assert abs(float(d.mean())) < 4 * expected / math.sqrt(d.numel())
    corr = float(torch.corrcoef(torch.stack([first, second]))[0, 1])
    assert abs(corr) < 0.05  # fresh each step
    again = _noise_deltas(7, sigma=sigma, c=c)
    assert torch.equal(again[0], first) and torch.equal(again[1], second)
    other = _noise_deltas(8, sigma=sigma, c=c)
    assert not torch.equal(other[0], first)


@pytest.mark.parametrize("kind", ["rdp", "pld", "prv"])
def test_epsilon_is_dp_accountings_answer(kind: str) -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.05, dataset_size=200,
                   noise_multiplier=1.1, accountant=kind)
    assert dp.epsilon(1e-5) == 0.0
    for _ in range(30):
        opt.step()  # empty steps count
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.1)),
                                    30)
    own = dpa.rdp.RdpAccountant() if kind == "rdp" else dpa.pld.PLDAccountant()
    reference = own.compose(event).get_epsilon(1e-5)
    assert dp.epsilon(1e-5) == pytest.approx(reference, rel=1e-6)
    assert dp.epsilon(1e-5) == pytest.approx(epsilon(1.1, 0.05, 30, 1e-5, kind), rel=1e-6)
    dp.detach()


def test_calibration_from_a_target() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.05, dataset_size=200,
                   target_epsilon=3.0, target_delta=1e-5, steps=40, accountant="rdp")
    assert dp.noise_multiplier == calibrate_noise(3.0, 1e-5, 0.05, 40, accountant="rdp")
    for _ in range(40):
        opt.step()
    assert 3.0 * (1 - 1e-3) < dp.epsilon(1e-5) <= 3.0
    dp.detach()


def _plain() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    ({"sample_rate": 0.0}, ValueError, "sample_rate"),
    ({"sample_rate": 1.5}, ValueError, "sample_rate"),
    ({"noise_multiplier": None}, ValueError, "no noise"),
    ({"noise_multiplier": None, "target_epsilon": 1.0}, ValueError, "missing target_delta"),
    ({"target_epsilon": 1.0, "target_delta": 1e-5, "steps": 10}, ValueError, "not both"),
    ({"clipping": "global"}, ValueError, "clipping"),
    ({"dataset_size": 0}, ValueError, "dataset_size"),
])
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    model, opt = _plain()
    args = {"max_grad_norm": 1.0, "sample_rate": 0.1, "dataset_size": 10,
            "noise_multiplier": 1.0, **kwargs}
    with pytest.raises(error, match=match):
        gt.dp_sgd(model, opt, **args)
    assert_no_hooks(model)


def test_batchnorm_in_training_mode_is_named() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedModuleError, match=r"'1' \(BatchNorm1d\).*GroupNorm"):
        gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                  noise_multiplier=1.0)
    model.eval()
    gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
              noise_multiplier=1.0).detach()


def test_an_optimizer_without_the_models_parameters() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"does not hold .*'2\.weight'"):
        gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                  noise_multiplier=1.0)
    other = nn.Linear(2, 2)
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="not the model's"):
        gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                  noise_multiplier=1.0)
    assert_no_hooks(model)


def test_detach_restores_the_plain_step() -> None:
    torch.manual_seed(9)
    model, opt = _plain()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    dp = gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                   noise_multiplier=1.0)
    dp.detach()
    dp.detach()
    assert_no_hooks(model)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    for m, o in ((model, opt), (ref, ref_opt)):
        F.cross_entropy(m(x), y).backward()
        o.step()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, r)
    assert dp.steps == 0


@pytest.mark.filterwarnings("ignore:Secure RNG turned off")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("b", [3, 8, 13])
def test_three_steps_equal_opacus_without_noise(b: int) -> None:
    """Opacus's DPOptimizer, noise 0, dividing by a loader batch size of q N: the same clip
    formula (``min(1, C / (norm + 1e-6))``), so the same parameters after three steps."""
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(11)
    model = _mlp().double()
    ref = copy.deepcopy(model)
    data = torch.utils.data.TensorDataset(torch.randn(N_DATA, 6, dtype=torch.float64),
                                          torch.randint(0, 3, (N_DATA,)))
    loader = torch.utils.data.DataLoader(data, batch_size=int(Q * N_DATA))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    engine = opacus.PrivacyEngine(accountant="rdp")
    ref, ref_opt, _ = engine.make_private(module=ref, optimizer=ref_opt, data_loader=loader,
                                          noise_multiplier=0.0, max_grad_norm=0.4,
                                          poisson_sampling=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    dp = gt.dp_sgd(model, opt, max_grad_norm=0.4, sample_rate=Q, dataset_size=N_DATA,
                   noise_multiplier=0.0)
    for step in range(3):
        x, y = data[step * b:(step + 1) * b]
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    for p, r in zip(model.parameters(), ref._module.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12)
    dp.detach()


def test_the_step_count_survives_a_checkpoint() -> None:
    model, opt = _plain()
    dp = gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                   noise_multiplier=1.0, accountant="rdp")
    for _ in range(7):
        opt.step()
    state = dp.state_dict()
    dp.detach()
    again = gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                      noise_multiplier=1.0, accountant="rdp")
    again.load_state_dict(state)
    assert again.steps == 7 and again.epsilon(1e-5) == dp.epsilon(1e-5) > 0
    with pytest.raises(ValueError, match="already followed by another dp_sgd"):
        gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                  noise_multiplier=1.0)
    again.detach()
    other = gt.dp_sgd(model, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=10,
                      noise_multiplier=2.0, accountant="rdp")
    with pytest.raises(ValueError, match="noise_multiplier"):
        other.load_state_dict(state)
    other.detach()
    assert_no_hooks(model)
