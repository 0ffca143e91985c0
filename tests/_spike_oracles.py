"""Float64 references for the spike-control transforms, written from the published formulas
(step by step, on the host, one tensor at a time), and a small training run with injected
gradient spikes that drives either a gradtap handle or a reference.

A reference is ``ref(step, named_params, optimizer) -> {name: factor}``: called after the
backward and before ``optimizer.step()``, it rewrites ``p.grad`` and returns the factor each
gradient was multiplied by (norm after / norm before for the unit- and element-wise rules).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradtap as gt

#: Steps where the whole loss is multiplied by 100, and where one layer (``conv.weight``) gets
#: a spike of its own (a term of the loss only it sees).
SPIKES_ALL = (28, 40, 52, 75, 104)
SPIKES_LAYER = (34, 47, 90)

Ref = Callable[[int, list[tuple[str, nn.Parameter]], torch.optim.Optimizer], dict[str, float]]


class Net(nn.Module):
    """Conv1d (a [4, 2, 3] weight: unit-wise over rows of 6), two Linear layers, biases."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.fc = nn.Linear(24, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.head(torch.tanh(self.fc(h)))


def make_net(seed: int = 0, dtype: torch.dtype = torch.float64) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def loss_at(net: Net, step: int, scale: float = 1.0) -> Tensor:
    """The loss of step ``step``, with the injected spikes; ``scale`` multiplies it (AMP)."""
    g = torch.Generator().manual_seed(1000 + step)
    dtype = net.conv.weight.dtype
    x = torch.randn(16, 2, 8, generator=g).to(dtype)
    y = torch.randn(16, 3, generator=g).to(dtype)
    loss = F.mse_loss(net(x), y)
    if step in SPIKES_ALL:
        loss = loss * 100.0
    if step in SPIKES_LAYER:
        direction = torch.randn(net.conv.weight.shape, generator=g).to(dtype)
        loss = loss + 20.0 * (net.conv.weight * direction).sum()
    return loss * scale


def make_opt(net: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(net.parameters(), lr=1e-2)
    return torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)


def run_gradtap(rules: dict, steps: int, *, when: str = "step", opt: str = "sgd",
                dtype: torch.dtype = torch.float64) -> tuple[Net, list[dict[str, float]]]:
    """Train with ``gt.transform(net, rules, when=...)``; the params and the factors of each step."""
    net = make_net(dtype=dtype)
    optimizer = make_opt(net, opt)
    factors = []
    with gt.transform(net, rules, when=when,
                      optimizer=optimizer if when == "step" else None) as h:
        for step in range(steps):
            loss_at(net, step).backward()
            optimizer.step()
            factors.append({n: float(f) for n, f in h.last_factors.items()})
            optimizer.zero_grad()
    return net, factors


def run_reference(ref: Ref | None, steps: int, *, opt: str = "sgd",
                  select: Callable[[str], bool] = lambda n: True
                  ) -> tuple[Net, list[dict[str, float]]]:
    """Train with ``ref`` applied to the selected parameters' gradients before each step."""
    net = make_net()
    optimizer = make_opt(net, opt)
    factors = []
    named = [(n, p) for n, p in net.named_parameters() if select(n)]
    for step in range(steps):
        loss_at(net, step).backward()
        factors.append({} if ref is None else ref(step, named, optimizer))
        optimizer.step()
        optimizer.zero_grad()
    return net, factors


def assert_same_params(a: nn.Module, b: nn.Module, rtol: float = 1e-9) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=1e-12,
                                   msg=lambda m, n=n: f"{n}: {m}")


def assert_same_factors(got: Sequence[dict[str, float]], want: Sequence[dict[str, float]],
                        rtol: float = 1e-9) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == set(w), (step, sorted(g), sorted(w))
        for n in w:
            assert math.isclose(g[n], w[n], rel_tol=rtol, abs_tol=1e-12), (step, n, g[n], w[n])


def _norm(t: Tensor) -> float:
    return float(t.double().norm())


# ------------------------------------------------------------------------------ references

def adagc_ref(rel: float = 1.05, beta: float = 0.98, warmup: int = 100, abs_max: float = 1.0
              ) -> Ref:
    """AdaGC (Wang et al. 2025, Algorithm 1): global clipping while t < T_start, then each
    tensor against an EMA of its own clipped norms."""
    gamma: dict[str, float] = {}

    def ref(step, named, opt):
        t = step + 1
        out = {}
        if t < warmup:
            total = math.sqrt(sum(_norm(p.grad) ** 2 for _, p in named))
            h = min(1.0, abs_max / (total + 1e-8))
            for n, p in named:
                p.grad = p.grad * h
                gamma[n] = _norm(p.grad) if t == 1 else min(gamma[n], _norm(p.grad))
                out[n] = h
        else:
            for n, p in named:
                h = min(1.0, rel * gamma[n] / (_norm(p.grad) + 1e-8))
                p.grad = p.grad * h
                gamma[n] = beta * gamma[n] + (1 - beta) * _norm(p.grad)
                out[n] = h
        return out

    return ref


def agc_ref(clip: float = 0.01, eps: float = 1e-3) -> Ref:
    """AGC (Brock et al. 2021), unit-wise over output units (rows), as timm writes it."""

    def unit_norm(x: Tensor) -> Tensor:
        return x.norm(2.0) if x.dim() <= 1 else x.norm(2.0, dim=tuple(range(1, x.dim())), keepdim=True)

    def ref(step, named, opt):
        out = {}
        for n, p in named:
            g = p.grad
            bound = unit_norm(p.detach()).clamp(min=eps) * clip
            gn = unit_norm(g)
            new = torch.where(gn < bound, g, g * (bound / gn.clamp(min=1e-6)))
            out[n] = _norm(new) / _norm(g) if _norm(g) > 0 else 1.0
            p.grad = new
        return out

    return ref


def adagn_ref(beta1: float = 0.7, beta2: float = 0.9) -> Ref:
    """Stable-SPAM's AdaGN: EMAs of the norm and the squared norm, bias-corrected."""
    m: dict[str, float] = {}
    v: dict[str, float] = {}

    def ref(step, named, opt):
        t = step + 1
        out = {}
        for n, p in named:
            x = _norm(p.grad)
            m[n] = beta1 * m.get(n, 0.0) + (1 - beta1) * x
            v[n] = beta2 * v.get(n, 0.0) + (1 - beta2) * x * x
            c = (m[n] / (1 - beta1 ** t)) / (math.sqrt(v[n] / (1 - beta2 ** t)) + 1e-8)
            out[n] = c / x if x > 0 else 1.0
            if x > 0:
                p.grad = p.grad / x * c
        return out

    return ref


def spam_ref(threshold: float = 5000) -> Ref:
    """SPAM's spike-aware clipping against Adam's exp_avg_sq (before its update)."""

    def ref(step, named, opt):
        out = {}
        for n, p in named:
            st = opt.state.get(p)
            if not st:
                out[n] = 1.0
                continue
            g, v = p.grad, st["exp_avg_sq"]
            mask = g ** 2 > threshold * v
            new = g.clone()
            new[mask] = g[mask].sign() * torch.sqrt(v[mask] * threshold)
            out[n] = _norm(new) / _norm(g) if _norm(g) > 0 else 1.0
            p.grad = new
        return out

    return ref


def zclip_ref(groups: Sequence[Callable[[str], bool]], per_tensor: bool = False, **kwargs) -> Ref:
    """The ``zclip`` package's ``ZClip``: one instance per rule (or per tensor), each stepping
    a module that holds only those parameters."""
    from zclip import ZClip

    clippers: dict[str, tuple[ZClip, nn.Module]] = {}

    def holder(params: list[nn.Parameter]) -> nn.Module:
        m = nn.Module()
        for i, p in enumerate(params):
            m.register_parameter(f"p{i}", p)
        return m

    def ref(step, named, opt):
        if not clippers:
            if per_tensor:
                for n, p in named:
                    clippers[n] = (ZClip(**kwargs), holder([p]))
            else:
                for k, sel in enumerate(groups):
                    clippers[str(k)] = (ZClip(**kwargs), holder([p for n, p in named if sel(n)]))
        for clipper, module in clippers.values():
            clipper.step(module)
        return {}

    return ref
