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

__all__ = ["Encoder", "mlp", "resnet18_like", "small_cnn", "transformer", "transformer_lm"]


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


class Encoder(nn.Module):
    """Token embedding, TransformerEncoder (post-norm, no dropout), mean-pooled classifier."""

    def __init__(self, vocab: int, dim: int, heads: int, ff: int, layers: int, classes: int = 10):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.emb(tokens)).mean(1))


def transformer(batch: int = 32, tokens: int = 64, dim: int = 128, layers: int = 2,
                seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """:class:`Encoder` (vocabulary 1000, 4 heads, feed-forward ``2 * dim``) on random token ids
    [batch, tokens] (the per-sample benchmark's transformer)."""
    torch.manual_seed(seed)
    model = Encoder(1000, dim, 4, 2 * dim, layers)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 1000, (batch, tokens), generator=g)
    return model, x, torch.randint(0, 10, (batch,), generator=g)


def bare_stat_kernels(model: nn.Module) -> object:
    """The floor of the Monitor's default statistics: only the reduction passes they need (a
    sum, a foreach norm, a min/max pass) over every parameter gradient and one host copy, with
    no bookkeeping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    minmax = [torch.aminmax(g) for g in grads]
    scalars = [g.sum() for g in grads] + list(torch._foreach_norm(grads))
    scalars += [m.max for m in minmax] + [m.min for m in minmax]
    return torch.stack(scalars).cpu().numpy()
