"""Benchmark workloads: each builder returns ``(model, example_input, target)``.

The models come from :mod:`gradtap.examples` (plain ``nn.Module`` code, no downloads); inputs
are seeded random tensors and targets class indices for ``F.cross_entropy``. Other benchmarks
may import these builders.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gradtap import examples
from gradtap.demo_spike import TinyLM

__all__ = ["mlp", "resnet18_like", "small_cnn", "transformer_lm"]


def _data(shape: tuple[int, ...], seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)


def mlp(batch: int = 128, hidden: int = 512, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """ReLU MLP 784 -> hidden x3 -> 10 on random inputs [batch, 784]."""
    torch.manual_seed(seed)
    return (examples.mlp(784, hidden, depth=3), *_data((batch, 784), seed))


def small_cnn(batch: int = 64, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """Three conv-BN-ReLU-pool stages and a linear head on random inputs [batch, 3, 32, 32]."""
    torch.manual_seed(seed)
    return (examples.small_cnn(3, 10), *_data((batch, 3, 32, 32), seed))


def resnet18_like(batch: int = 16, width: int = 64, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """ResNet-18 layout (2-2-2-2 basic blocks, BatchNorm; width 64 = ResNet-18's channels,
    11.2M parameters) on random inputs [batch, 3, 32, 32]."""
    torch.manual_seed(seed)
    return (examples.resnet18_like(width=width), *_data((batch, 3, 32, 32), seed))




def transformer_lm(batch: int = 16, tokens: int = 64, dim: int = 128, layers: int = 2,
                   vocab: int = 512, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """A small causal transformer LM (4 heads) on random tokens [batch, tokens]; the target is
    the next token ([batch, tokens], for ``F.cross_entropy`` over the flattened logits)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (batch, tokens + 1), generator=g)
    # the spike demo's causal pre-norm LM, at the benchmark's sizes
    return TinyLM(vocab, dim, 4, layers, tokens), seq[:, :-1], seq[:, 1:]


def bare_stat_kernels(model: nn.Module) -> object:
    """The floor of the Monitor's default statistics: only the reduction passes they need (a
    sum, a foreach norm, a min/max pass) over every parameter gradient and one host copy, with
    no bookkeeping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    minmax = [torch.aminmax(g) for g in grads]
    scalars = [g.sum() for g in grads] + list(torch._foreach_norm(grads))
    scalars += [m.max for m in minmax] + [m.min for m in minmax]
    return torch.stack(scalars).cpu().numpy()
