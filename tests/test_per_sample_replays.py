"""Per-sample gradients that come from replaying a call with its arguments as passed.

Calls with non-tensor arguments (a module passed as a keyword, only an int), calls that return
a value reduced over the batch (a model computing its own loss), a table read through
``.weight`` inside an enclosing call, time-major tensors inside a batch-first model with a tied
head, and a model that returns a tensor it also used itself. Every test compares
``gt.per_sample`` with a per-sample loop oracle: ``torch.autograd.grad`` of each sample's loss,
computed by running that sample alone, in float64.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradtap as gt
from tests._models import assert_no_hooks

pytestmark = pytest.mark.usefixtures("float64_seeded")

N, T, V, D = 3, 5, 11, 4


def check(model: nn.Module, total: Callable[[], Tensor], alone: Callable[[int], Tensor], *,
          loss_reduction: str = "mean", **kw: object) -> list[str]:
    """``gt.per_sample`` on ``total()`` against ``d alone(i) / d p`` for each sample i (and
    its mean or sum against ``.grad``); returns the modules gradtap replayed."""
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gt.per_sample(model, loss_reduction=loss_reduction,  # type: ignore[arg-type]
                           **kw) as ps:
            total().backward()
        got, norms = ps.grad, ps.norms
    assert_no_hooks(model)
    params = dict(model.named_parameters())
    for k, g in got.items():
        ref = torch.stack([torch.autograd.grad(alone(i), params[k], allow_unused=True)[0]
                           if params[k] in _used(alone, i) else torch.zeros_like(params[k])
                           for i in range(N)])
        torch.testing.assert_close(g, ref, msg=lambda m, k=k: f"grad {k}: {m}")
        torch.testing.assert_close(norms[k], ref.reshape(N, -1).norm(dim=1),
                                   msg=lambda m, k=k: f"norm {k}: {m}")
        reduced = g.mean(0) if loss_reduction == "mean" else g.sum(0)
        grad = params[k].grad
        torch.testing.assert_close(reduced, torch.zeros_like(reduced) if grad is None else grad)
    found = [re.search(r"replay of (.*?) \(a forward", str(w.message)) for w in caught]
    return [m[1] for m in found if m is not None]


def _used(alone: Callable[[int], Tensor], i: int) -> set[Tensor]:
    """The parameters sample i's loss depends on (allow_unused gives None for the others)."""
    loss = alone(i)
    leaves: set[Tensor] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None:
            continue
        if hasattr(fn, "variable"):
            leaves.add(fn.variable)
        stack.extend(f for f, _ in fn.next_functions)
    return leaves


# --------------------------------------------------------------------------------------------
# non-tensor arguments
# --------------------------------------------------------------------------------------------


class EmbeddingDecoder(nn.Module):
    """No rule; reads the embedding layer it is handed (a module argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(V))

    def forward(self, hidden_states: Tensor, embedding_layer: nn.Embedding) -> Tensor:
        return hidden_states @ embedding_layer.weight.t() + self.bias


class MaskedLM(nn.Module):
    def __init__(self, loss_inside: bool) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(V, D)
        self.body = nn.Linear(D, D)
        self.embedding_decoder = EmbeddingDecoder()
        self.loss_inside = loss_inside

    def forward(self, ids: Tensor, labels: Tensor | None = None) -> Tensor:
        h = self.body(self.embeddings(ids))
        logits = self.embedding_decoder(h, embedding_layer=self.embeddings)
        if not self.loss_inside:
            return logits
        assert labels is not None
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("loss_inside", [True, False])
def test_module_argument_is_passed_to_the_replay(loss_inside: bool) -> None:
    m, ids = MaskedLM(loss_inside), torch.randint(0, V, (N, T))

    def loss(i: slice) -> Tensor:
        if loss_inside:
            return m(ids[i], ids[i])
        return F.cross_entropy(m(ids[i]).flatten(0, 1), ids[i].flatten())

    check(m, lambda: loss(slice(None)), lambda i: loss(slice(i, i + 1)))


class Latents(nn.Module):
    """No rule, called with only the batch size: a learned array expanded to the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(2, D))

    def forward(self, batch_size: int) -> Tensor:
        return self.latents.expand(batch_size, -1, -1)


class Perceiver(nn.Module):
    """Returns its own loss, reduced over the batch as ``reduction`` says."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.latents = Latents()
        self.proj = nn.Linear(D, D)
        self.reduction = reduction

    def forward(self, x: Tensor) -> Tensor:  # x: [N, T, D]
        lat = self.latents(x.shape[0])
        attn = torch.softmax(lat @ self.proj(x).transpose(1, 2), -1)
        per_sample = (attn @ x).tanh().pow(2).sum((1, 2))
        return per_sample.mean() if self.reduction == "mean" else per_sample.sum()


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_call_with_only_an_int_argument(loss_reduction: str) -> None:
    m, x = Perceiver(loss_reduction), torch.randn(N, T, D)
    check(m, lambda: m(x), lambda i: m(x[i:i + 1]), loss_reduction=loss_reduction)


# --------------------------------------------------------------------------------------------
# calls that return a value reduced over the batch (a loss computed inside)
# --------------------------------------------------------------------------------------------


class TemperatureClassifier(nn.Module):
    """Returns its own batch-mean (or sum) loss; holds a parameter no rule maps."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.log_temperature = nn.Parameter(torch.tensor(0.3))
        self.reduction = reduction

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self.fc(x) / self.log_temperature.exp(), labels,
                               reduction=self.reduction)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_model_returning_its_own_loss(loss_reduction: str) -> None:
    m = TemperatureClassifier(loss_reduction)
    x, y = torch.randn(N, 5), torch.randint(0, 4, (N,))
    replayed = check(m, lambda: m(x, y), lambda i: m(x[i:i + 1], y[i:i + 1]),
                     loss_reduction=loss_reduction)
    assert replayed == [], replayed  # its own call, with the fc's rule: no warning


class LinearCrossEntropy(nn.Module):
    """A layer fusing a linear map and the cross entropy of the batch, as torch's
    ``nn.LinearCrossEntropyLoss`` of later releases: it returns the batch's mean loss."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, features))

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(x @ self.weight.t(), target)


@pytest.mark.parametrize("torch_own", [False, pytest.param(True, marks=pytest.mark.skipif(
    not hasattr(nn, "LinearCrossEntropyLoss"),
    reason=f"torch {torch.__version__} has no nn.LinearCrossEntropyLoss (the local "
           "equivalent runs instead)"))])
def test_fused_linear_cross_entropy_loss(torch_own: bool) -> None:
    m = nn.LinearCrossEntropyLoss(5, 4, reduction="mean") if torch_own else LinearCrossEntropy(5, 4)
    x, y = torch.randn(N, 5), torch.randint(0, 4, (N,))
    check(m, lambda: m(x, y), lambda i: m(x[i:i + 1], y[i:i + 1]))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(8, 8)

    def forward(self, x: Tensor, rel: Tensor) -> Tensor:  # rel: [K, D], shared by all samples
        return x + torch.softmax(self.query(x) @ rel.t(), -1) @ rel


class RelEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rel_embeddings = nn.Embedding(6, 8)
        self.norm = nn.LayerNorm(8)
        self.layers = nn.ModuleList(Attention() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        rel = self.norm(self.rel_embeddings.weight)  # read through .weight, never called
        for layer in self.layers:
            x = layer(x, rel)
        return x


class RelClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = RelEncoder()
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self.head(self.encoder(x)[:, 0]), labels)


def test_table_read_directly_inside_an_encoder_with_the_loss_inside() -> None:
    m, x, y = RelClassifier(), torch.randn(N, T, 8), torch.randint(0, 3, (N,))
    replayed = check(m, lambda: m(x, y), lambda i: m(x[i:i + 1], y[i:i + 1]))
    # The innermost call around every use of the table is the encoder's.
    assert replayed == ["'encoder' (RelEncoder)"], replayed


class TimeMajorBody(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embedding = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)

    def forward(self, ids: Tensor) -> Tensor:  # ids: [N, T]
        h = self.word_embedding(ids.t().contiguous())  # [T, N, D]: samples at dim 1 inside
        h = torch.tanh(self.mix(h) + h.mean(0))
        return h.permute(1, 0, 2)


class TiedLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.body = TimeMajorBody()
        self.head = nn.Linear(8, 20)
        if tied:
            self.head.weight = self.body.word_embedding.weight

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        logits = self.head(self.body(ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("tied", [True, False])
def test_time_major_body_with_a_tied_head_and_the_loss_inside(tied: bool) -> None:
    m, ids = TiedLM(tied), torch.randint(0, 20, (N, 7))
    check(m, lambda: m(ids, ids), lambda i: m(ids[i:i + 1], ids[i:i + 1]))


# --------------------------------------------------------------------------------------------
# an output the call also used itself
# --------------------------------------------------------------------------------------------


class Detector(nn.Module):
    """Object queries read through ``.weight``; returns the hidden state it made logits of."""

    def __init__(self) -> None:
        super().__init__()
        self.query_position_embeddings = nn.Embedding(6, D)
        self.decoder = nn.Linear(D, D)
        self.class_head = nn.Linear(D, 5)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        queries = self.query_position_embeddings.weight.unsqueeze(0).repeat(x.shape[0], 1, 1)
        h = self.decoder(queries + x.mean(1, keepdim=True))
        return {"logits": self.class_head(h), "last_hidden_state": h}


@pytest.mark.parametrize("use_hidden", [False, True])
def test_replay_takes_only_the_uses_after_the_call(use_hidden: bool) -> None:
    m, x, y = Detector(), torch.randn(N, 7, D), torch.randint(0, 5, (N, 6))

    def loss(i: slice) -> Tensor:
        out = m(x[i])
        extra = out["last_hidden_state"].pow(2).mean() if use_hidden else 0.0
        return F.cross_entropy(out["logits"].transpose(1, 2), y[i]) + extra

    check(m, lambda: loss(slice(None)), lambda i: loss(slice(i, i + 1)))
