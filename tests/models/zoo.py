"""Tiny Hugging Face models built in code from their configs, for the real-model suite
(torchvision's models are in ``vision.py``, registered here too).

Each :class:`Spec` builds one model (random weights, no download), its inputs for a batch of
``N`` samples, and a scalar loss of the model's output. Every loss is a mean over samples of
a per-sample term ``s_n`` that depends on sample ``n`` only, so the per-sample oracle can run
each sample alone (``test_models.py`` checks that property too).

Sizes are tiny (1-2 layers, hidden sizes 16-32, short sequences, small images) and every
dropout, drop-path, layer-drop and SpecAugment probability is 0, so train mode is
deterministic; BatchNorm still uses batch statistics there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers as hf
from torch import Tensor, nn

hf.logging.set_verbosity_error()  # no notes on configs, default losses or slow kernels

N = 3  # samples per batch
VOCAB = 64
SEQ = 8


@dataclass(frozen=True)
class Spec:
    """How to build, feed and score one tiny model."""

    name: str
    modality: str  # "text", "vision" or "audio"
    build: Callable[[], nn.Module]
    # Keyword arguments for forward, plus "target" (dim 0 indexes samples) for the loss only.
    inputs: Callable[[torch.Generator], dict[str, Any]]
    loss: Callable[[Any, Tensor | None], Tensor]  # (output, target) -> a mean over samples
    skip: str | None = None  # why this model cannot be built here (its tests are skipped)


ZOO: dict[str, Spec] = {}


def register(spec: Spec) -> Spec:
    assert spec.name not in ZOO, spec.name
    ZOO[spec.name] = spec
    return spec


def params() -> list[Any]:
    """Every model name as a pytest parameter; those that cannot be built here are skipped,
    saying why."""
    return [pytest.param(name, marks=pytest.mark.skipif(spec.skip is not None,
                                                         reason=spec.skip or ""))
            for name, spec in ZOO.items()]


def build(name: str) -> nn.Module:
    """The model ``name`` in train mode, float32, with weights from a fixed seed."""
    torch.manual_seed(0)
    model = ZOO[name].build()
    return model.float().train()


def make_inputs(name: str, seed: int = 0) -> dict[str, Any]:
    """A batch of ``N`` samples for ``name``: forward's keyword arguments and the target."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return ZOO[name].inputs(gen)


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of forward in ``batch``."""
    return {k: v for k, v in batch.items() if k != "target"}


def loss_of(name: str, batch: dict[str, Any]) -> Callable[[Any], Tensor]:
    """``output -> scalar loss`` for ``batch``."""
    target = batch.get("target")
    return lambda out: ZOO[name].loss(out, target)


def run(name: str, model: nn.Module, batch: dict[str, Any]) -> Tensor:
    """Forward then the spec's scalar loss."""
    return loss_of(name, batch)(model(**model_inputs(batch)))


def torch_init(model: nn.Module) -> nn.Module:
    """Re-initialize every layer with PyTorch's defaults (BatchNorm: weight 1, bias 0).

    For models whose Hugging Face initialization makes a tiny random copy's activations
    vanish layer after layer (gradients around 1e-37), or blow up through a normalization
    of near-zero vectors: either would leave the checks nothing to compare.
    """
    torch.manual_seed(0)
    for m in model.modules():
        if hasattr(m, "reset_parameters") and m is not model:
            m.reset_parameters()
    return model


# -- loss helpers: each is a mean over dim 0 of a per-sample term ------------------------------

def _weights(shape: tuple[int, ...], seed: int) -> Tensor:
    """Fixed weights that make a loss's gradient differ from element to element."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-sample mean next-token cross entropy, then the mean over samples."""
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                reduction="none")
    return per_token.view(labels.shape[0], -1).mean(1).mean()


def feature_loss(h: Tensor, seed: int) -> Tensor:
    """``mean_n sum_j w_j * tanh(h_nj)`` over the non-batch dims of ``h``."""
    w = _weights(tuple(h.shape[1:]), seed)
    return (torch.tanh(h) * w).flatten(1).sum(1).mean()


def class_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits, labels)


def _ids(gen: torch.Generator, shape: tuple[int, ...] = (N, SEQ), low: int = 3) -> Tensor:
    return torch.randint(low, VOCAB, shape, generator=gen)


def _labels(gen: torch.Generator, classes: int = 5) -> Tensor:
    return torch.randint(0, classes, (N,), generator=gen)


def _image(gen: torch.Generator, size: int = 32, channels: int = 3) -> Tensor:
    return torch.randn(N, channels, size, size, generator=gen)


# -- text -------------------------------------------------------------------------------------

def _gpt2_config() -> hf.GPT2Config:
    return hf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                         eos_token_id=2, use_cache=False)


# The model computes its own loss from the logits it also returns (labels=).
register(Spec(
    "gpt2", "text",
    lambda: hf.GPT2LMHeadModel(_gpt2_config()),
    lambda g: {"input_ids": (ids := _ids(g)), "labels": ids},
    lambda out, t: out.loss,
))


def _gpt2_checkpointed() -> nn.Module:
    model = hf.GPT2LMHeadModel(_gpt2_config())
    # Non-reentrant checkpointing of every block; the non-deprecated name of
    # gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}).
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


register(Spec(
    "gpt2_checkpointing", "text",
    _gpt2_checkpointed,
    lambda g: {"input_ids": (ids := _ids(g)), "labels": ids},
    lambda out, t: out.loss,
))

# last_hidden_state is also hidden_states[-1]: one tensor under two output paths.
register(Spec(
    "bert", "text",
    lambda: hf.BertModel(hf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)),
    lambda g: {"input_ids": _ids(g), "token_type_ids": torch.randint(0, 2, (N, SEQ), generator=g),
               "output_hidden_states": True},
    lambda out, t: (feature_loss(out.last_hidden_state, 1) + feature_loss(out.pooler_output, 2)
                 + 0.5 * feature_loss(out.hidden_states[-1], 3)
                 + 0.25 * feature_loss(out.hidden_states[1], 4)),
))

# The decoder bias is one Parameter held by a module and by its child.
register(Spec(
    "albert", "text",
    lambda: hf.AlbertForMaskedLM(hf.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=37, max_position_embeddings=16,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    lambda g: {"input_ids": (ids := _ids(g)), "labels": ids},
    lambda out, t: out.loss,
))

# Each block returns the position bias that the next block uses.
register(Spec(
    "t5", "text",
    lambda: hf.T5ForConditionalGeneration(hf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2,
        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        use_cache=False)),
    lambda g: {"input_ids": _ids(g), "labels": _ids(g, (N, 6))},
    lambda out, t: out.loss + feature_loss(out.encoder_last_hidden_state, 5),
))

register(Spec(
    "bart", "text",
    lambda: hf.BartForConditionalGeneration(hf.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=37,
        decoder_ffn_dim=37, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None, use_cache=False)),
    lambda g: {"input_ids": _ids(g), "decoder_input_ids": _ids(g, (N, 6)), "target": _ids(g, (N, 6))},
    lambda out, t: lm_loss(out.logits, t),
))

register(Spec(
    "llama", "text",
    lambda: hf.LlamaForCausalLM(hf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)),
    lambda g: {"input_ids": _ids(g), "target": _ids(g)},
    lambda out, t: lm_loss(out.logits, t),
))

register(Spec(
    "mamba", "text",
    lambda: hf.MambaForCausalLM(hf.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
        conv_kernel=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)),
    lambda g: {"input_ids": _ids(g), "target": _ids(g)},
    lambda out, t: lm_loss(out.logits, t),
))

# -- vision -----------------------------------------------------------------------------------

register(Spec(
    "vit", "vision",
    lambda: hf.ViTForImageClassification(hf.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=5)),
    lambda g: {"pixel_values": _image(g, 16), "labels": _labels(g)},
    lambda out, t: out.loss,
))

# Bottleneck layers end in a ConvLayer without activation, then `hidden_state += residual`.
register(Spec(
    "resnet", "vision",
    lambda: hf.ResNetForImageClassification(hf.ResNetConfig(
        embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck",
        num_labels=5)),
    lambda g: {"pixel_values": _image(g), "labels": _labels(g)},
    lambda out, t: out.loss,
))

register(Spec(
    "convnext", "vision",
    lambda: hf.ConvNextForImageClassification(hf.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5, image_size=32,
        layer_scale_init_value=0.5)),
    lambda g: {"pixel_values": _image(g), "target": _labels(g)},
    lambda out, t: class_loss(out.logits, t),
))

register(Spec(
    "mobilenet_v2", "vision",
    lambda: hf.MobileNetV2ForImageClassification(hf.MobileNetV2Config(
        image_size=32, depth_multiplier=0.25, finegrained_output=False,
        classifier_dropout_prob=0.0, num_labels=5)),
    lambda g: {"pixel_values": _image(g), "target": _labels(g)},
    lambda out, t: class_loss(out.logits, t),
))

register(Spec(
    "efficientnet", "vision",
    lambda: torch_init(hf.EfficientNetForImageClassification(hf.EfficientNetConfig(
        image_size=32, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=128,
        dropout_rate=0.0, drop_connect_rate=0.0, num_labels=5))),
    lambda g: {"pixel_values": _image(g), "target": _labels(g)},
    lambda out, t: class_loss(out.logits, t),
))

register(Spec(
    "swin", "vision",
    lambda: hf.SwinForImageClassification(hf.SwinConfig(
        image_size=16, patch_size=2, embed_dim=16, depths=[2, 1], num_heads=[2, 2],
        window_size=4, mlp_ratio=2.0, drop_path_rate=0.0, num_labels=5)),
    lambda g: {"pixel_values": _image(g, 16), "labels": _labels(g)},
    lambda out, t: out.loss,
))

# The continuous position bias MLP has ReLU(inplace=True) after a Linear whose output is a view.
register(Spec(
    "swinv2", "vision",
    lambda: hf.Swinv2ForImageClassification(hf.Swinv2Config(
        image_size=16, patch_size=2, embed_dim=16, depths=[2, 1], num_heads=[2, 2],
        window_size=4, mlp_ratio=2.0, drop_path_rate=0.0, num_labels=5)),
    lambda g: {"pixel_values": _image(g, 16), "labels": _labels(g)},
    lambda out, t: out.loss,
))


def _superpoint_loss(out: Any, target: Tensor | None) -> Tensor:
    # Padded keypoint slots hold zeros, so a sample's terms do not depend on the batch.
    w = _weights((out.descriptors.shape[-1],), 6)
    per_sample = out.scores.sum(1) + (out.descriptors * w).sum((1, 2))
    return per_sample.mean() + 0.1 * feature_loss(out.hidden_states[-1], 7)


# The keypoint and descriptor decoders run once per image; the encoder's last output is also
# its last hidden state.
register(Spec(
    "superpoint", "vision",
    lambda: torch_init(hf.SuperPointForKeypointDetection(hf.SuperPointConfig(
        encoder_hidden_sizes=[8, 8, 16, 16], decoder_hidden_size=32, descriptor_decoder_dim=16,
        max_keypoints=12))),
    lambda g: {"pixel_values": _image(g, 16), "output_hidden_states": True},
    _superpoint_loss,
))

# -- audio ------------------------------------------------------------------------------------

_SPEECH = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
    conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
    num_conv_pos_embedding_groups=2, hidden_dropout=0.0, activation_dropout=0.0,
    attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
    mask_time_prob=0.0, mask_feature_prob=0.0, vocab_size=12, classifier_proj_size=16,
)

# CTC with a per-sample mean: torch's "mean" reduction divides each sample's loss by its
# target length, then takes the mean over samples.
register(Spec(
    "wav2vec2", "audio",
    lambda: hf.Wav2Vec2ForCTC(hf.Wav2Vec2Config(**_SPEECH, ctc_loss_reduction="mean")),
    lambda g: {"input_values": torch.randn(N, 400, generator=g),
               "labels": torch.randint(3, 12, (N, 5), generator=g)},
    lambda out, t: out.loss,
))

register(Spec(
    "hubert", "audio",
    lambda: hf.HubertForSequenceClassification(hf.HubertConfig(**_SPEECH, num_labels=4)),
    lambda g: {"input_values": torch.randn(N, 400, generator=g), "target": _labels(g, 4)},
    lambda out, t: class_loss(out.logits, t),
))

register(Spec(
    "whisper", "audio",
    lambda: hf.WhisperForConditionalGeneration(hf.WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=37,
        decoder_ffn_dim=37, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, use_cache=False)),
    lambda g: {"input_features": torch.randn(N, 8, 16, generator=g),
               "decoder_input_ids": _ids(g, (N, 6)), "target": _ids(g, (N, 6))},
    lambda out, t: (lm_loss(out.logits, t)
                 + feature_loss(out.encoder_last_hidden_state, 8)),
))

# -- torchvision ------------------------------------------------------------------------------

from tests.models import vision  # noqa: E402, F401  (registers its specs in ZOO)
