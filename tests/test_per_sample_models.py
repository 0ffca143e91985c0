"""Per-sample gradients on models whose layers cannot be split one call at a time.

Every test compares ``gt.per_sample`` with a per-sample loop oracle: ``torch.autograd.grad``
of each sample's own loss term, computed on that sample alone, in float64. The models have
inputs shared by all samples (position ids ``[1, T]``, a ``[1, T, D]`` position table, a
relative bias on ``[T, T]`` buckets), tied weights (a module tied to another, and a weight
used functionally outside its module), outputs modified in place, samples folded with other
rows (attention windows), one call per sample, and real tiny transformers built from configs.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradtap as gt
from gradtap.errors import GradtapError, UnsupportedModuleError
from tests._models import assert_no_hooks

N, T, V, D = 3, 5, 11, 6
Batch = dict[str, Tensor]
Loss = Callable[[nn.Module, Batch], Tensor]


pytestmark = pytest.mark.usefixtures("float64_seeded")


def close(actual: Tensor, expected: Tensor, what: str, rtol: float = 1e-7) -> None:
    """float64 comparison; entries far below the largest get an absolute tolerance from it."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    atol = max(1e-9, rtol * 1e-1 * float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def sample_slice(batch: Batch, i: int) -> Batch:
    return {k: v[i:i + 1] if v.dim() and v.shape[0] == N else v for k, v in batch.items()}


def loop_oracle(model: nn.Module, loss: Loss, batch: Batch,
                names: list[str] | None = None) -> dict[str, Tensor]:
    """``d l_n / d p`` for each sample n, from a forward and backward of that sample alone."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad
              and (names is None or k in names)}
    per: list[tuple[Tensor | None, ...]] = [
        torch.autograd.grad(loss(model, sample_slice(batch, i)), list(params.values()),
                            allow_unused=True)
        for i in range(N)
    ]
    return {k: torch.stack([g[j] if g[j] is not None else torch.zeros_like(p) for g in per])
            for j, (k, p) in enumerate(params.items())}


@contextmanager
def collected() -> Iterator[list[str]]:
    """The messages of gradtap's per-sample warnings raised inside the block."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages: list[str] = []
        yield messages
    messages += [str(w.message) for w in caught if "gradtap.per_sample" in str(w.message)]
    others = [str(w.message) for w in caught if "gradtap.per_sample" not in str(w.message)]
    assert not others, others


def check(model: nn.Module, loss: Loss, batch: Batch, *, quantities=("grad", "norm"),
          loss_reduction: str = "mean", rtol: float = 1e-7, **kw) -> tuple[gt.PerSample, list[str]]:
    """Run ``gt.per_sample`` on one backward and compare every asked quantity with the oracle."""
    model.zero_grad(set_to_none=True)
    with collected() as messages, gt.per_sample(model, quantities=quantities,
                                                loss_reduction=loss_reduction, **kw) as ps:
        total = loss(model, batch)
        (total * (N if loss_reduction == "sum" else 1)).backward()
        names = ps.names
        results = {q: getattr(ps, "norms" if q == "norm" else q) for q in quantities}
    assert_no_hooks(model)
    grads = {k: p.grad for k, p in model.named_parameters() if k in names}
    ref = loop_oracle(model, loss, batch, names)
    for k, r in ref.items():
        if "grad" in quantities:
            close(results["grad"][k], r, f"grad {k}", rtol)
            close(results["grad"][k].mean(0) if loss_reduction == "mean"
                  else results["grad"][k].sum(0), grads[k], f"reduced grad {k} vs .grad", rtol)
        if "norm" in quantities:
            close(results["norm"][k], r.flatten(1).norm(dim=1), f"norm {k}", rtol)
        if "variance" in quantities:
            close(results["variance"][k], r.var(0, correction=0), f"variance {k}", rtol)
    return ps, messages


def token_loss(model: nn.Module, batch: Batch) -> Tensor:
    logits = model(batch["ids"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["ids"].reshape(-1))


def vector_loss(model: nn.Module, batch: Batch) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def ids() -> Batch:
    return {"ids": torch.randint(0, V, (N, T))}


# --------------------------------------------------------------------------------------------
# inputs shared by all samples
# --------------------------------------------------------------------------------------------


class TokensAndPositions(nn.Module):
    """GPT-2 style: token embeddings plus position embeddings looked up on ids ``[1, T]``;
    ``scaled``: the positions are scaled before they meet the batch (a shared op in between,
    so their per-sample gradients need a replay)."""

    def __init__(self, dropout: float = 0.0, scaled: bool = False) -> None:
        super().__init__()
        self.scaled = scaled
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(8, D)
        self.ln = nn.LayerNorm(D)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(D, V)
        self.register_buffer("position_ids", torch.arange(8)[None], persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        p = self.pos(self.position_ids[:, : tokens.shape[1]])
        h = self.tok(tokens) + (0.5 * p if self.scaled else p)
        return self.head(self.drop(torch.tanh(self.ln(h))))


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("quantities", [("grad", "norm"), ("norm", "variance")])
def test_position_ids_shared_by_all_samples(quantities: tuple, loss_reduction: str) -> None:
    """Met by the batch at the add: the gradient there splits them (no replay); scaled
    before, they are replayed."""
    _, messages = check(TokensAndPositions(), token_loss, ids(), quantities=quantities,
                        loss_reduction=loss_reduction)
    assert messages == []
    _, messages = check(TokensAndPositions(scaled=True), token_loss, ids(),
                        quantities=quantities, loss_reduction=loss_reduction)
    assert len(messages) == 1, messages
    assert "'pos'" in messages[0] and "has one row for 3 samples (shared by all of them" in messages[0]
    assert "replay of the model" in messages[0]


class LearnedPositions(nn.Module):
    """A position table returned as ``[1, T, D]``: no rule, and no row per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, D))

    def forward(self, x: Tensor) -> Tensor:
        return self.table[: x.shape[1]].unsqueeze(0)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = LearnedPositions()
        self.mix = nn.Linear(D, D)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok(tokens)
        return torch.tanh(self.mix(h + self.pos(h)))


class WithEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(D, V)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(tokens))


def test_position_module_returning_one_row_for_all_samples() -> None:
    _, messages = check(WithEncoder(), token_loss, ids())
    assert len(messages) == 1, messages
    # The innermost call around it that has a row per sample is replayed: the encoder's.
    assert "'encoder.pos'" in messages[0] and "replay of 'encoder' (Encoder)" in messages[0]
    assert "its output 'output' of shape (1, 5, 6) has 1 rows" in messages[0]


class RelativeBiasAttention(nn.Module):
    """Self-attention with a T5-style bias: an Embedding called on ``[T, T]`` buckets."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.bias = nn.Embedding(5, heads)
        self.head = nn.Linear(D, V)

    def forward(self, tokens: Tensor) -> Tensor:
        n, t = tokens.shape
        x = self.tok(tokens)
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        rel = torch.arange(t)[None, :] - torch.arange(t)[:, None]
        buckets = rel.clamp(-2, 2) + 2  # [T, T]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores + self.bias(buckets).permute(2, 0, 1).unsqueeze(0)
        h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, t, -1)
        return self.head(h + x)


def test_relative_bias_on_buckets_shared_by_all_samples() -> None:
    _, messages = check(RelativeBiasAttention(), token_loss, ids())
    assert len(messages) == 1 and "'bias'" in messages[0], messages
    assert "its input 'input' has 5 rows along batch_dim=0 for 3 samples" in messages[0]


# --------------------------------------------------------------------------------------------
# tied weights
# --------------------------------------------------------------------------------------------


class TiedHead(nn.Module):
    """The output head's weight is the token embedding: two modules hold one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


class FunctionalHead(TiedHead):
    """The embedding is used again outside any call of a module that holds it."""

    def forward(self, tokens: Tensor) -> Tensor:
        return F.linear(torch.tanh(self.mix(self.emb(tokens))), self.emb.weight)


@pytest.mark.parametrize("quantities", [("grad", "norm"), ("norm", "variance")])
def test_tied_embedding_and_head_sum_both_uses(quantities: tuple) -> None:
    ps, messages = check(TiedHead(), token_loss, ids(), quantities=quantities)
    assert messages == []  # both uses have a rule: no replay
    assert ps.names == ["emb.weight", "mix.weight", "mix.bias"]


def test_weight_used_outside_its_module_is_caught_and_replayed() -> None:
    _, messages = check(FunctionalHead(), token_loss, ids())
    assert len(messages) == 1, messages
    assert "'emb'" in messages[0] and "do not add up to its gradient" in messages[0]


def test_parameter_used_only_by_its_parent_is_replayed() -> None:
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:  # self.lin is never called
            return F.linear(torch.tanh(x), self.lin.weight, self.lin.bias)

    batch = {"x": torch.randn(N, 4), "y": torch.randint(0, 3, (N,))}
    _, messages = check(Parent(), vector_loss, batch)
    assert len(messages) == 1 and "'lin'" in messages[0], messages


# --------------------------------------------------------------------------------------------
# outputs modified in place
# --------------------------------------------------------------------------------------------


class MaskedProjection(nn.Module):
    """``h = proj(x); h[mask] = 0``, optionally after ``F.dropout(p=0)`` (which returns h)."""

    def __init__(self, dropout_first: bool) -> None:
        super().__init__()
        self.dropout_first = dropout_first
        self.proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        if self.dropout_first:
            h = F.dropout(h, 0.0, True)
        h[x[..., 0] > 0.5] = 0
        return self.out(torch.tanh(h).mean(1))


@pytest.mark.parametrize("dropout_first", [False, True])
@pytest.mark.parametrize("quantities", [("grad", "norm"), ("norm", "variance")])
def test_output_masked_in_place(dropout_first: bool, quantities: tuple) -> None:
    batch = {"x": torch.randn(N, 5, 4), "y": torch.randint(0, 3, (N,))}
    model = MaskedProjection(dropout_first)
    ps, messages = check(model, vector_loss, batch, quantities=quantities)
    # Exact either way: from the rule when the record's output gradient can be trusted,
    # else from a replay, with a warning naming the module.
    assert all("'proj'" in m for m in messages), messages
    if "grad" in quantities:
        assert ps.grad["proj.weight"].abs().sum() > 0


# --------------------------------------------------------------------------------------------
# no row per sample: samples folded with other rows, one call per sample
# --------------------------------------------------------------------------------------------


class WindowBlock(nn.Module):
    """Swin-style: the Linear sees ``[N * W, L, D]``, samples folded with windows."""

    def __init__(self, windows: int = 2) -> None:
        super().__init__()
        self.windows = windows
        self.proj = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        w = x.reshape(n * self.windows, t // self.windows, d)
        w = torch.tanh(self.proj(w))
        return self.norm(w.reshape(n, t, d) + x)


class Windowed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.block = WindowBlock()
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.inp(x)).mean(1))


@pytest.mark.parametrize("quantities", [("grad", "norm"), ("norm", "variance")])
def test_windows_folded_into_the_batch(quantities: tuple) -> None:
    batch = {"x": torch.randn(N, 4, 4), "y": torch.randint(0, 3, (N,))}
    _, messages = check(Windowed(), vector_loss, batch, quantities=quantities)
    assert len(messages) == 1, messages
    assert ("'block.proj': its input 'input' has 6 rows along batch_dim=0 for 3 samples"
            in messages[0])
    assert "replay of 'block' (WindowBlock)" in messages[0]


class DecodedPerSample(nn.Module):
    """SuperPoint-style: a decoder called once per sample on ``h[i:i+1]``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, D)
        self.dec = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.enc(x))
        return torch.cat([self.dec(h[i:i + 1]) for i in range(h.shape[0])])


def test_decoder_called_once_per_sample() -> None:
    batch = {"x": torch.randn(N, 4), "y": torch.randint(0, 3, (N,))}
    _, messages = check(DecodedPerSample(), vector_loss, batch)
    assert len(messages) == 1 and "'dec'" in messages[0], messages


class WideOutside(nn.Module):
    """A Linear wide enough for the sketched check, whose weight is used once more outside its
    calls."""

    def __init__(self, width: int = 80) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x))
        extra = F.linear(h, self.fc.weight).mean(-1, keepdim=True)  # cross-entropy is shift-
        return self.head(h) + 0.5 * extra * torch.tensor([1.0, 0.0, 0.0])  # invariant: 1 logit


def test_sketched_check_catches_a_small_use_outside_the_calls() -> None:
    model = WideOutside()
    batch = {"x": torch.randn(N, 80), "y": torch.randint(0, 3, (N,))}
    ps, messages = check(model, vector_loss, batch)
    assert "fc.weight" in ps._sketches  # the check on fc.weight ran on the projection
    assert len(messages) == 1 and "'fc'" in messages[0], messages
    assert "do not add up to its gradient" in messages[0]


def test_check_catches_a_wrong_split_and_replays() -> None:
    """A rule whose per-sample gradients do not add up to .grad is caught and replaced."""
    from gradtap._samples.rule import PER_SAMPLE
    from gradtap._samples.rules.linear import LINEAR, grad_linear

    def doubled(module: nn.Module, inp: Tensor, go: Tensor, names: frozenset[str]) -> dict:
        return {k: 2 * g for k, g in grad_linear(module, inp, go, names).items()}

    PER_SAMPLE.register(nn.Linear, replace=True)(dataclasses.replace(LINEAR, grad=doubled))
    try:
        _, messages = check(TiedHead(), token_loss, ids())
    finally:
        PER_SAMPLE.register(nn.Linear, replace=True)(LINEAR)
    assert len(messages) == 1 and "replay of the model" in messages[0], messages
    assert "'mix'" in messages[0] and "'emb', 'head'" in messages[0]
    assert "do not add up to its gradient" in messages[0]


# --------------------------------------------------------------------------------------------
# selection, refusals, errors
# --------------------------------------------------------------------------------------------


def test_select_by_module_glob_class_list_and_predicate() -> None:
    model = Windowed()
    batch = {"x": torch.randn(N, 4, 4), "y": torch.randint(0, 3, (N,))}
    cases = {
        "block": ["block.proj.weight", "block.proj.bias", "block.norm.weight", "block.norm.bias"],
        nn.LayerNorm: ["block.norm.weight", "block.norm.bias"],
        (nn.Linear,): ["inp.weight", "inp.bias", "block.proj.weight", "block.proj.bias",
                       "head.weight", "head.bias"],
        WindowBlock: ["block.proj.weight", "block.proj.bias", "block.norm.weight",
                      "block.norm.bias"],
        ("inp", "*.bias"): ["inp.weight", "inp.bias", "block.proj.bias", "block.norm.bias",
                            "head.bias"],
    }
    for selector, expected in cases.items():
        ps, _ = check(model, vector_loss, batch, select=selector)
        assert ps.names == expected, selector
    ps, _ = check(model, vector_loss, batch, select=lambda name, module: name == "head")
    assert ps.names == ["head.weight", "head.bias"]
    tied = TiedHead()  # a module selects the tied weight it holds, under its first name
    ps, _ = check(tied, token_loss, ids(), select="head")
    assert ps.names == ["emb.weight"]
    with pytest.raises(gt.SelectionError, match="select='blok' matches no module or parameter; "
                                                "closest module or parameter names: block"):
        gt.per_sample(model, select="blok")


def test_fallback_false_names_the_module_instead_of_replaying() -> None:
    model = TokensAndPositions(scaled=True)
    with gt.per_sample(model, fallback=False) as ps:
        token_loss(model, ids()).backward()
    with pytest.raises(GradtapError, match=r"no per-sample gradients could be computed for "
                                           r"pos.weight \(module 'pos': its input 'input' of "
                                           r"shape \(1, 5\) has one row for 3 samples \(shared.*"
                                           r"\(fallback=False\)"):
        _ = ps.grad


def test_replay_refuses_dropout_in_training() -> None:
    model = TokensAndPositions(dropout=0.5, scaled=True)
    with gt.per_sample(model) as ps, pytest.raises(UnsupportedModuleError, match="dropout"):
        token_loss(model, ids()).backward()
    del ps
    assert_no_hooks(model)
    model.eval()  # in eval mode the replay is exact
    check(model, token_loss, ids())


class PositionsAdded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = LearnedPositions()
        self.mix = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.mix(x + self.pos(x)))


class ChangesItsArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.encoder = PositionsAdded()
        self.head = nn.Linear(D, V)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok(tokens) * 1.0
        h = self.encoder(x)
        x.mul_(2.0)  # after the call: a replay of the encoder would see other values
        return self.head(h + x)


def test_argument_modified_in_place_after_the_call_is_not_replayed() -> None:
    _, messages = check(ChangesItsArgument(), token_loss, ids())
    assert len(messages) == 1 and "replay of the model" in messages[0], messages


class Counter:
    """Mutable state passed to a module (like a key/value cache): a replay would change it."""

    def __init__(self) -> None:
        self.calls = 0


class CountingEncoder(PositionsAdded):
    def forward(self, x: Tensor, counter: Counter) -> Tensor:  # type: ignore[override]
        counter.calls += 1
        return super().forward(x)


class WithCounter(ChangesItsArgument):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = CountingEncoder()
        self.counters: list[Counter] = []

    def forward(self, tokens: Tensor) -> Tensor:
        self.counters.append(Counter())
        return self.head(self.encoder(self.tok(tokens), self.counters[-1]))


def test_call_with_an_opaque_argument_is_not_replayed() -> None:
    model = WithCounter()
    _, messages = check(model, token_loss, ids())
    assert len(messages) == 1 and "replay of the model" in messages[0], messages
    assert model.counters[0].calls == 1  # the forward's own counter, untouched by the replay


def test_two_forwards_one_backward_and_clear_between_steps() -> None:
    model = WithEncoder()
    first, second = ids(), ids()
    with collected(), gt.per_sample(model) as ps:
        (token_loss(model, first) + token_loss(model, second)).backward()
        both = ps.grad["encoder.pos.table"]
        ps.clear()
        token_loss(model, second).backward()
        only = ps.grad["encoder.pos.table"]
    ref1 = loop_oracle(model, token_loss, first)["encoder.pos.table"]
    ref2 = loop_oracle(model, token_loss, second)["encoder.pos.table"]
    close(both, ref1 + ref2, "two forwards")
    close(only, ref2, "after clear")


# --------------------------------------------------------------------------------------------
# real tiny transformers, built from configs (no download)
# --------------------------------------------------------------------------------------------


def _gpt2() -> tuple[nn.Module, Loss, Batch]:
    import transformers as tf

    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                                             n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                             attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    return model, _lm_loss, {"input_ids": torch.randint(0, 50, (N, 6))}


def _gpt2_labels() -> tuple[nn.Module, Loss, Batch]:
    model, _, batch = _gpt2()  # the model computes its (token-mean) loss itself
    return model, lambda m, b: m(**b, labels=b["input_ids"]).loss, batch


def _bert() -> tuple[nn.Module, Loss, Batch]:
    import transformers as tf

    model = tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, layer_norm_eps=1e-5))
    return model, _lm_loss, {"input_ids": torch.randint(0, 50, (N, 6))}


def _t5() -> tuple[nn.Module, Loss, Batch]:
    import transformers as tf

    model = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0))
    tokens = torch.randint(0, 50, (N, 6))
    return model, _lm_loss, {"input_ids": tokens, "decoder_input_ids": tokens.flip(1)}


def _swin() -> tuple[nn.Module, Loss, Batch]:
    import transformers as tf

    model = tf.SwinModel(tf.SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=8,
                                       depths=[1, 1], num_heads=[2, 2], window_size=2,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                       drop_path_rate=0.0, layer_norm_eps=1e-5))
    return (model, lambda m, b: m(**b).last_hidden_state.square().mean(),
            {"pixel_values": torch.randn(N, 3, 16, 16)})


def _lm_loss(model: nn.Module, batch: Batch) -> Tensor:
    logits = model(**batch).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                           batch["input_ids"].reshape(-1))


@pytest.mark.parametrize("build", [_gpt2, _gpt2_labels, _bert, _t5, _swin],
                         ids=["gpt2", "gpt2-labels", "bert", "t5", "swin"])
def test_tiny_transformers_match_the_loop_oracle(build: Callable) -> None:
    pytest.importorskip("transformers")
    model, loss, batch = build()
    model.double()
    _, messages = check(model, loss, batch, rtol=1e-6)
    # GPT-2's positions [1, T] meet the batch at an add (closed form); BERT's token types
    # are a buffer expanded to [N, T] before their lookup, which a replay splits
    assert bool(messages) == (build not in (_gpt2, _gpt2_labels)), messages
