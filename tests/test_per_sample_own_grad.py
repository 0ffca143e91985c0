"""``gt.per_sample(..., own_grad=True)``: ``.grad`` filled from the per-sample gradients.

Oracles, all in float64: ``.grad`` from a plain backward of the same model without
per_sample (autograd), and per-sample gradients from a loop over samples
(``torch.autograd.grad`` of each sample's loss term on that sample alone) or from
``torch.func.vmap(grad(...))``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradtap as gt
from tests._models import assert_no_hooks
from tests.test_per_sample_models import _bert, _gpt2, close, loop_oracle

N, T, E = 3, 5, 8


pytestmark = pytest.mark.usefixtures("float64_seeded")


class Block(nn.Module):
    """Embedding, a post-norm transformer block with ``nn.MultiheadAttention``, a head."""

    def __init__(self, *, batch_first: bool = True, kv: bool = False, need_weights: bool = False,
                 masks: bool = False, kdim: int | None = None) -> None:
        super().__init__()
        self.batch_first, self.kv, self.need_weights, self.masks = batch_first, kv, need_weights, masks
        self.emb = nn.Embedding(11, E)
        self.mem = nn.Linear(E, kdim or E) if kv else None
        self.attn = nn.MultiheadAttention(E, 2, batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.ln1, self.ln2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.ff = nn.Sequential(nn.Linear(E, 2 * E), nn.ReLU(), nn.Linear(2 * E, E))
        self.head = nn.Linear(E, 4)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens)  # [N, T, E]
        kv = torch.tanh(self.mem(h)) if self.mem is not None else h
        if not self.batch_first:
            h, kv = h.transpose(0, 1), kv.transpose(0, 1)
        kw: dict = {}
        if self.masks:
            kw["attn_mask"] = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
            kw["key_padding_mask"] = tokens == 0
        a, w = self.attn(h, kv, kv, need_weights=self.need_weights, **kw)
        h = self.ln1(h + a)
        h = self.ln2(h + self.ff(h))
        if not self.batch_first:
            h = h.transpose(0, 1)
        out = self.head(h.mean(1))
        if self.need_weights:  # a gradient reaching the attention weights too
            out = out + w.sum((1, 2))[:, None]
        return out


def batch() -> dict[str, Tensor]:
    tokens = torch.randint(1, 11, (N, T))
    tokens[0, -2:] = 0  # padding, masked when the block uses masks
    return {"tokens": tokens, "y": torch.randint(0, 4, (N,))}


def loss_of(model: nn.Module, b: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(b["tokens"]), b["y"])


def autograd_grads(model: nn.Module, loss: Callable, b: dict, scale: float = 1.0) -> dict:
    model.zero_grad(set_to_none=True)
    (loss(model, b) * scale).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def run(model: nn.Module, loss: Callable, b: dict, *, scale: float = 1.0, **kw) -> gt.PerSample:
    with gt.per_sample(model, own_grad=True, **kw) as ps:
        (loss(model, b) * scale).backward()
    assert_no_hooks(model)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert not any("forward" in vars(m) for m in model.modules())
    return ps


def slice_batch(b: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    return {k: v[i:i + 1] for k, v in b.items()}


def loop(model: nn.Module, b: dict[str, Tensor]) -> dict[str, Tensor]:
    params = dict(model.named_parameters())
    per = [torch.autograd.grad(loss_of(model, slice_batch(b, i)), list(params.values()),
                               allow_unused=True) for i in range(N)]
    return {k: torch.stack([g[j] if g[j] is not None else torch.zeros_like(p) for g in per])
            for j, (k, p) in enumerate(params.items())}


BLOCKS = {
    "self-attention": {},
    "key-value-from-another-layer": {"kv": True},
    "kdim-vdim": {"kv": True, "kdim": 6},
    "masks": {"masks": True},
    "attention-weights-in-the-loss": {"need_weights": True, "masks": True},
}


@pytest.mark.parametrize("quantities", [("grad", "norm"), ("norm",), ("variance",)],
                         ids=["grads", "norms", "variance"])
@pytest.mark.parametrize("config", list(BLOCKS), ids=list(BLOCKS))
def test_attention_block_grad_and_per_sample_match_autograd_and_the_loop(config, quantities):
    model, b = Block(**BLOCKS[config]), batch()
    expected = autograd_grads(model, loss_of, b)
    ref = loop(model, b)
    ps = run(model, loss_of, b, quantities=quantities)
    for k, p in model.named_parameters():
        close(p.grad, expected[k], f".grad {k}")
        if "grad" in quantities:
            close(ps.grad[k], ref[k], f"grad {k}")
        if "norm" in quantities:
            close(ps.norms[k], ref[k].flatten(1).norm(dim=1), f"norm {k}")
        if "variance" in quantities:
            close(ps.variance[k], ref[k].var(0, correction=0), f"variance {k}")


def test_attention_matches_torch_func_vmap_and_its_replay_is_not_used(monkeypatch):
    from gradtap._samples.rules import attention

    model, b = Block(), batch()

    def replay(*args, **kwargs):
        raise AssertionError("the attention core was replayed")

    monkeypatch.setattr(attention, "_core_backward", replay)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(p, tokens, y):
        out = torch.func.functional_call(model, p, (tokens[None],))
        return F.cross_entropy(out, y[None])

    with warnings.catch_warnings():  # vmap runs the attention kernel as a loop
        warnings.simplefilter("ignore")
        ref = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(
            params, b["tokens"], b["y"])
    ps = run(model, loss_of, b)
    for k in params:
        close(ps.grad[k], ref[k], f"grad {k}")


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_gradient_accumulates_over_two_backwards_like_autograd(loss_reduction):
    model, b1, b2 = Block(), batch(), batch()
    scale = N if loss_reduction == "sum" else 1.0
    g1 = autograd_grads(model, loss_of, b1, scale)
    g2 = autograd_grads(model, loss_of, b2, scale)
    model.head.weight.grad = torch.ones_like(model.head.weight)  # an earlier gradient
    with gt.per_sample(model, own_grad=True, loss_reduction=loss_reduction) as ps:
        (loss_of(model, b1) * scale).backward()
        grads1 = {k: v.clone() for k, v in ps.grad.items()}
        ps.clear()
        (loss_of(model, b2) * scale).backward()
        grads2 = ps.grad
    for k, p in model.named_parameters():
        extra = 1.0 if k == "head.weight" else 0.0
        close(p.grad, g1[k] + g2[k] + extra, f".grad {k}")
        reduce = (lambda g: g.mean(0)) if loss_reduction == "mean" else (lambda g: g.sum(0))
        close(reduce(grads1[k]), g1[k], f"batch 1 {k}")
        close(reduce(grads2[k]), g2[k], f"batch 2 {k}")


@pytest.mark.parametrize("config", ["self-attention", "attention-weights-in-the-loss"])
def test_two_backwards_over_one_forward_add_both_shares(config):
    """``retain_graph=True``: each backward adds its own share of ``.grad``, and the per-sample
    gradients are those of the two losses' sum."""
    model, b = Block(**BLOCKS[config]), batch()

    def both(m: nn.Module, bb: dict[str, Tensor]) -> Tensor:
        out = m(bb["tokens"])
        return 0.3 * F.cross_entropy(out, bb["y"]) + 0.7 * out.square().sum(1).mean()

    expected = autograd_grads(model, both, b)
    params = dict(model.named_parameters())
    per = [torch.autograd.grad(both(model, slice_batch(b, i)), list(params.values()))
           for i in range(N)]
    with gt.per_sample(model, own_grad=True) as ps:
        out = model(b["tokens"])
        (0.3 * F.cross_entropy(out, b["y"])).backward(retain_graph=True)
        (0.7 * out.square().sum(1).mean()).backward()
        grads = ps.grad
    assert_no_hooks(model)
    for j, (k, p) in enumerate(params.items()):
        close(p.grad, expected[k], f".grad {k}")
        close(grads[k], torch.stack([g[j] for g in per]), f"grad {k}")


class Scale(nn.Module):
    """A module without a rule: its parameter keeps autograd's path."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.randn(E))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s


class WithRuleless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.scale, self.fc2 = nn.Linear(E, E), Scale(), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.scale(torch.tanh(self.fc1(x)))
        # fc2.weight is also used outside fc2's calls: its owner is the model, no rule.
        return self.fc2(h) + h @ self.fc2.weight.T


def test_parameters_with_a_use_lacking_a_rule_keep_autograds_path():
    model = WithRuleless()
    b = {"x": torch.randn(N, E), "y": torch.randint(0, 3, (N,))}

    def loss(m, bb):
        return F.cross_entropy(m(bb["x"]), bb["y"])

    expected = autograd_grads(model, loss, b)
    ref = loop_oracle(model, loss, b)
    seen: set[str] = set()
    handles = [p.register_hook(lambda g, k=k: seen.add(k)) for k, p in model.named_parameters()]
    with pytest.warns(UserWarning, match="torch.func replay"), \
            gt.per_sample(model, own_grad=True) as ps:
        loss(model, b).backward()
    for h in handles:
        h.remove()
    assert_no_hooks(model)
    assert set(ps._ownable) == {"fc1", "fc2"}
    # autograd computed the gradients outside the owned calls only: of fc1 (its input does
    # not require grad), of scale.s (no rule), and of fc2.weight's use outside fc2 (its
    # call's share is per_sample's)
    assert seen == {"fc1.weight", "fc1.bias", "scale.s", "fc2.weight"}
    for k, p in model.named_parameters():
        close(p.grad, expected[k], f".grad {k}")
        close(ps.grad[k], ref[k], f"grad {k}")


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_hooks_and_create_graph_as_documented():
    model, b = Block(), batch()
    expected = autograd_grads(model, loss_of, b)
    tensor_hooks: list[str] = []
    post: dict[str, Tensor | None] = {}
    handles = []
    for k, p in model.named_parameters():
        handles.append(p.register_hook(lambda g, k=k: tensor_hooks.append(k)))
        handles.append(p.register_post_accumulate_grad_hook(
            lambda p, k=k: post.__setitem__(k, None if p.grad is None else p.grad.clone())))
    with gt.per_sample(model, own_grad=True) as ps:
        loss_of(model, b).backward(create_graph=True)
    for h in handles:
        h.remove()
    owned = {k for k, _ in model.named_parameters()} - {"emb.weight"}
    # The first layer's input (token ids) does not require grad: autograd's path, hooks run.
    assert set(tensor_hooks) == set(post) == {"emb.weight"}
    close(post["emb.weight"], expected["emb.weight"], "post-accumulate emb.weight")
    for k, p in model.named_parameters():
        close(p.grad, expected[k], f".grad {k}")
        # create_graph: autograd's .grad carries a graph, the owned ones do not
        assert p.grad.requires_grad == (k not in owned), k
    assert set(ps.names) == owned | {"emb.weight"}


class SeqFirst(nn.Module):
    """Sequence-first attention (samples at dim 1) between two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.attn, self.out = nn.Linear(E, E), nn.MultiheadAttention(E, 2), nn.Linear(E, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(self.attn(h, h, h, need_weights=False)[0])


def test_sequence_first_attention():
    model = SeqFirst()
    b = {"x": torch.randn(T, N, E)}

    def loss(m, bb):
        return m(bb["x"]).square().mean()

    expected = autograd_grads(model, loss, b)
    params = dict(model.named_parameters())
    per = [torch.autograd.grad(loss(model, {"x": b["x"][:, i:i + 1]}), list(params.values()))
           for i in range(N)]
    ps = run(model, loss, b, batch_dim=1)
    for j, (k, p) in enumerate(params.items()):
        close(p.grad, expected[k], f".grad {k}")
        close(ps.grad[k], torch.stack([g[j] for g in per]), f"grad {k}")


def test_no_grad_forward_and_eval_leave_parameters_alone():
    model, b = Block(), batch()
    with gt.per_sample(model, own_grad=True):
        with torch.no_grad():
            model(b["tokens"])
        assert all(type(p) is nn.Parameter for p in model.parameters())
    with gt.per_sample(model, own_grad=True):
        model(b["tokens"])  # the batch size is known from here on
        with pytest.raises(RuntimeError):  # a call that raises inside, parameters swapped
            model.ff[0](torch.randn(N, T, 3, requires_grad=True))
        assert all(type(p) is nn.Parameter for p in model.parameters())


@pytest.mark.parametrize(("build", "replayed"), [(_gpt2, False), (_bert, True)],
                         ids=["gpt2", "bert"])
def test_tiny_transformers_grad_matches_autograd_and_the_loop(build, replayed):
    """GPT-2's positions ``[1, T]`` meet the batch at an add (closed form, no replay); BERT's
    token types are a buffer expanded to ``[N, T]`` before their lookup (replayed)."""
    pytest.importorskip("transformers")
    model, loss, b = build()
    model.double()
    expected = autograd_grads(model, loss, b)
    ref = loop_oracle(model, loss, b)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ps = run(model, loss, b)
    assert any("torch.func replay" in str(w.message) for w in seen) == replayed
    assert ps._ownable, "some calls are owned"
    for k, p in model.named_parameters():
        close(p.grad, expected[k], f".grad {k}", rtol=1e-6)
        close(ps.grad[k], ref[k], f"grad {k}", rtol=1e-6)


class Checkpointed(Block):
    """The block with its attention and feed-forward under non-reentrant checkpoints."""

    def forward(self, tokens: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.emb(tokens)
        a, _ = checkpoint(lambda h: self.attn(h, h, h, need_weights=False), h,
                          use_reentrant=False)
        h = self.ln1(h + a)
        h = self.ln2(h + checkpoint(self.ff, h, use_reentrant=False))
        return self.head(h.mean(1))


def test_checkpoint_recomputation_uses_the_parameters_as_the_forward_did():
    model, b = Checkpointed(), batch()
    expected = autograd_grads(model, loss_of, b)
    ref = loop(model, b)
    ps = run(model, loss_of, b)
    for k, p in model.named_parameters():
        close(p.grad, expected[k], f".grad {k}")
        close(ps.grad[k], ref[k], f"grad {k}")


def test_checkpointed_attention_without_own_grad():
    # The tap gives attn(h, h, h)'s repeated argument an alias; the checkpoint's recomputation
    # gets the same one, so it saves the tensors the forward saved.
    model, b = Checkpointed(), batch()
    expected = autograd_grads(model, loss_of, b)
    ref = loop(model, b)
    model.zero_grad(set_to_none=True)
    with gt.per_sample(model) as ps:
        loss_of(model, b).backward()
    for k, p in model.named_parameters():
        close(p.grad, expected[k], f".grad {k}")
        close(ps.grad[k], ref[k], f"grad {k}")


@pytest.mark.parametrize("need_weights", [False, True])
def test_attention_dropout_in_training_draws_the_modules_own_masks(need_weights):
    # The own forward is the module's function, random draws included: with the same seed
    # .grad is autograd's (the replay refuses dropout; the own forward reads the masks used).
    model, b = Block(need_weights=need_weights), batch()
    model.attn.dropout = 0.3
    torch.manual_seed(1)
    expected = autograd_grads(model, loss_of, b)
    torch.manual_seed(1)
    ps = run(model, loss_of, b)
    for k, p in model.named_parameters():
        close(p.grad, expected[k], f".grad {k}")
        assert ps.grad[k].shape == (N, *p.shape)


def test_a_second_own_grad_on_the_same_modules_is_refused_until_the_first_is_removed():
    # Both would detach the parameters (the second one's forward hook putting back the first
    # one's detached copies) and add the calls' share to .grad twice.
    model, b = Block(), batch()
    expected = autograd_grads(model, loss_of, b)
    with gt.per_sample(model, own_grad=True) as ps:
        with pytest.raises(ValueError, match=r"module 'attn' \(MultiheadAttention\) already has "
                                             r"its calls' share of \.grad computed by another"):
            gt.per_sample(model, "attn", own_grad=True)
        loss_of(model, b).backward()
    assert_no_hooks(model)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    ref = loop(model, b)
    for k, p in model.named_parameters():
        close(p.grad, expected[k], f".grad {k}")
        close(ps.grad[k], ref[k], f"grad {k}")
    model.zero_grad(set_to_none=True)
    with gt.per_sample(model, "attn", own_grad=True) as a, \
            gt.per_sample(model, "head", own_grad=True) as h:  # modules apart: both own theirs
        loss_of(model, b).backward()
    for k, p in model.named_parameters():
        close(p.grad, expected[k], f".grad {k}")
    for k in a.names:
        close(a.grad[k], ref[k], f"grad {k}")
    for k in h.names:
        close(h.grad[k], ref[k], f"grad {k}")
    model.zero_grad(set_to_none=True)
    run(model, loss_of, b)  # the first one removed, its modules are free again
