"""Per-sample gradients on Hugging Face models whose outputs or tables are unusual, against
a loop of one backward per sample (float64, configs built in code, no download).

DeBERTa-v2 with relative attention returns the last hidden state twice (as
``last_hidden_state`` and as the last entry of ``hidden_states``), and normalizes the
relative-position table that every sample's attention reads with a LayerNorm of the encoder:
that LayerNorm's per-sample gradients come from a replay of the encoder, whose output
gradient must count once, not once per path.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import gradtap as gt

hf = pytest.importorskip("transformers")

pytestmark = pytest.mark.models


def _deberta() -> torch.nn.Module:
    cfg = hf.DebertaV2Config(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, type_vocab_size=0,
        relative_attention=True, max_relative_positions=16, position_buckets=8,
        pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm",
        position_biased_input=False, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pooler_dropout=0.0, pooler_hidden_size=16,
        num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    return hf.DebertaV2ForSequenceClassification(cfg).double().eval()


def test_deberta_relative_layernorm_per_sample_matches_loop() -> None:
    model = _deberta()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 64, (3, 10), generator=gen)
    labels = torch.tensor([2, 0, 1])
    names = [q for q, p in model.named_parameters() if p.requires_grad]
    loop: dict[str, list[torch.Tensor]] = {q: [] for q in names}
    for n in range(3):
        model.zero_grad()
        model(input_ids=ids[n:n + 1], labels=labels[n:n + 1]).loss.backward()
        for q, p in model.named_parameters():
            loop[q].append(p.grad.clone() if p.grad is not None else torch.zeros_like(p))
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # replays are announced; the numbers are the test
        with gt.per_sample(model) as ps:
            model(input_ids=ids, labels=labels).loss.backward()
    for q in names:
        want = torch.stack(loop[q])
        scale = float(want.abs().max()) or 1.0
        # DeBERTa computes its attention scale in float32: 1e-6 of the largest element.
        assert torch.allclose(ps.grad[q], want, rtol=0, atol=1e-6 * scale), q
    p = model.deberta.encoder.LayerNorm.weight
    assert torch.allclose(ps.grad["deberta.encoder.LayerNorm.weight"].mean(0), p.grad,
                          rtol=1e-9, atol=0)
