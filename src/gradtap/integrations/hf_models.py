"""Hugging Face ``transformers`` models built from a config in code, with a dummy input.

This is what ``gradtap explain --hf MODEL_TYPE --config k=v,...`` runs. Nothing is downloaded:
the config is ``transformers.AutoConfig.for_model(model_type, **overrides)`` and the model
``<auto class>.from_config(config)`` with random weights, put in eval mode (no dropout, no
SpecAugment masking), so the same seed gives the same numbers. transformers is an optional
dependency (``pip install gradtap[transformers]``), imported by these functions only.

The dummy input (batch 2) follows the model's ``main_input_name`` and its config:

* ``input_ids``: 8 token ids (fewer if ``max_position_embeddings`` is smaller) drawn from
  ``[0, vocab_size)``;
* ``pixel_values``: ``[2, num_channels, *image_size]`` from a standard normal;
* ``input_values``: raw audio long enough for 8 frames after the feature extractor's
  convolutions (``conv_kernel``/``conv_stride``), or ``[2, max_length, num_mel_bins]`` for
  spectrogram models;
* ``input_features``: ``[2, num_mel_bins, 2 * max_source_positions]`` (Whisper's fixed
  length) or ``[2, 32, input_feat_per_channel * input_channels]`` (Speech2Text);
* for encoder-decoder models whose forward takes them, ``decoder_input_ids`` (8 ids, fewer if
  ``max_target_positions`` is smaller); and ``use_cache=False`` where the forward takes it,
  so no key/value cache appears among the outputs.
"""

from __future__ import annotations

import ast
import difflib
import inspect
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from gradtap.errors import GradtapError, missing_extra

__all__ = [
    "AUTO_ORDER",
    "TASKS",
    "HFModelError",
    "build_model",
    "describe_inputs",
    "dummy_inputs",
    "model_and_inputs",
    "parse_config",
]

#: ``--task`` name -> the transformers auto class that builds the model. ``"auto"`` (the
#: default) picks the first of :data:`AUTO_ORDER` that has a class for the model type.
TASKS: dict[str, str] = {
    "pretraining": "AutoModelForPreTraining",
    "base": "AutoModel",
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "image-classification": "AutoModelForImageClassification",
    "audio-classification": "AutoModelForAudioClassification",
    "ctc": "AutoModelForCTC",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
}

#: ``task="auto"``: the model's own training head when transformers names one (GPT-2's LM
#: head, BERT's pre-training heads, T5's and BART's conditional generation); else, for an
#: encoder-decoder, its sequence-to-sequence head; else the first head it has; else no head.
AUTO_ORDER: tuple[str, ...] = (
    "pretraining", "seq2seq-lm", "speech-seq2seq", "causal-lm", "masked-lm",
    "image-classification", "ctc", "audio-classification", "base",
)
_ENCODER_DECODER_ONLY = ("seq2seq-lm", "speech-seq2seq")


_BATCH = 2
_LENGTH = 8


class HFModelError(GradtapError, ValueError):
    """A model type, config setting, task or dummy input that cannot be used."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise missing_extra("building Hugging Face models", "transformers", "transformers") from err
    return transformers


# --------------------------------------------------------------------------- --config parsing


def parse_config(text: str) -> dict[str, Any]:
    """Parse ``"k=v,k=v"`` into a dict; values are Python literals, else strings.

    Commas inside brackets or quotes do not split (``conv_kernel=[10,3]``). A value that
    ``ast.literal_eval`` reads (``2``, ``1e-5``, ``True``, ``None``, ``[8, 8]``, ``'x'``)
    becomes that object; anything else stays the string as written (``gelu_new``).

    Raises:
        HFModelError: an item is not ``key=value``, a key is not an identifier, or a key
            appears twice.

    Example:
        >>> from gradtap.integrations.hf_models import parse_config
        >>> parse_config("n_layer=2,layer_norm_epsilon=1e-5,activation_function=gelu,conv_kernel=[10,3]")
        {'n_layer': 2, 'layer_norm_epsilon': 1e-05, 'activation_function': 'gelu', 'conv_kernel': [10, 3]}
    """
    out: dict[str, Any] = {}
    if not text.strip():
        return out
    for item in _split_top_level(text):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise HFModelError(
                f"--config: expected key=value items separated by commas (e.g. "
                f"n_layer=2,n_embd=32); got {item.strip()!r}"
            )
        if key in out:
            raise HFModelError(f"--config: {key!r} is given twice")
        out[key] = _literal(value.strip())
    return out


def _split_top_level(text: str) -> list[str]:
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def _literal(value: str) -> Any:
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


# --------------------------------------------------------------------------- the model


def build_model(model_type: str, overrides: Mapping[str, Any] | None = None, task: str = "auto") -> nn.Module:
    """Build a transformers model with random weights from its config, offline, in eval mode.

    Args:
        model_type: a transformers model type (``"gpt2"``, ``"bert"``, ``"vit"``, ...).
        overrides: config settings, passed to ``AutoConfig.for_model``; each must be a setting
            of that model type's config class.
        task: ``"auto"`` (default: see :data:`AUTO_ORDER`) or a key of :data:`TASKS`
            (which auto class builds the model); ``"base"`` is ``AutoModel``, the model
            without a head.

    Raises:
        ImportError: transformers is not installed.
        HFModelError: unknown model type (the closest names are listed), unknown config
            setting (named, with the closest settings), a task the model type has no class
            for (the tasks it has are listed), or a config the model cannot be built from.

    Example:
        >>> from gradtap.integrations.hf_models import build_model
        >>> model = build_model("gpt2", {"n_layer": 1, "n_embd": 8, "n_head": 2})
        >>> type(model).__name__, model.training
        ('GPT2LMHeadModel', False)
        >>> type(build_model("gpt2", {"n_layer": 1, "n_embd": 8, "n_head": 2}, task="base")).__name__
        'GPT2Model'
    """
    tf = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    overrides = dict(overrides or {})
    if task != "auto" and task not in TASKS:
        raise HFModelError(f"--task: unknown task {task!r}; expected auto or one of {', '.join(TASKS)}")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=5, cutoff=0.6)
        hint = f"closest: {', '.join(close)}" if close else "no close name"
        raise HFModelError(
            f"unknown model type {model_type!r} for transformers {tf.__version__} ({hint})"
        )
    config_class = CONFIG_MAPPING[model_type]
    known = _config_keys(config_class)
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=5, cutoff=0.6)
            hint = f"closest: {', '.join(close)}" if close else "no close setting"
            raise HFModelError(
                f"--config: {config_class.__name__} ({model_type!r}) has no setting {key!r} ({hint})"
            )
    try:
        config = tf.AutoConfig.for_model(model_type, **overrides)
    except Exception as err:  # noqa: BLE001 - any config validation error, reported as one line
        raise HFModelError(
            f"cannot make a {model_type!r} config from {overrides}: {type(err).__name__}: {err}"
        ) from err
    tasks = [t for t, name in TASKS.items() if _has_class(getattr(tf, name), config)]
    if task == "auto":
        encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        task = next((t for t in AUTO_ORDER if t in tasks
                     and (encoder_decoder or t not in _ENCODER_DECODER_ONLY)), "base")
    auto = getattr(tf, TASKS[task])
    if task not in tasks:
        raise HFModelError(
            f"--task {task}: transformers has no {TASKS[task]} class for model type "
            f"{model_type!r}; tasks it has: {', '.join(tasks) or '(none of ' + ', '.join(TASKS) + ')'}"
        )
    try:
        model = auto.from_config(config)
    except Exception as err:  # noqa: BLE001 - e.g. sizes that do not fit together
        hint = ""
        if "divisible" in str(err) and "head" in str(err):
            heads = sorted(k for k in _config_keys(type(config)) if "head" in k and "dim" not in k)
            hint = (f" (a smaller hidden size needs fewer attention heads: set "
                    f"{' or '.join(heads[:3]) or 'the number of heads'} too, e.g. 2)")
        raise HFModelError(
            f"cannot build {TASKS[task]} for {model_type!r} from config {overrides}: "
            f"{type(err).__name__}: {err}{hint}"
        ) from err
    return model.eval()


def _config_keys(config_class: type) -> set[str]:
    """Every setting a config class knows: its fields, aliases and ``__init__`` keywords."""
    from transformers import PretrainedConfig

    keys: set[str] = set(getattr(config_class, "attribute_map", {}) or {})
    for cls in (config_class, PretrainedConfig):
        params = inspect.signature(cast(Any, cls).__init__).parameters.values()
        keys |= {p.name for p in params
                 if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    try:
        keys |= set(config_class().to_dict())
    except Exception:  # noqa: BLE001, S110 - a config without defaults: the signature is enough
        pass
    if hasattr(PretrainedConfig, "num_labels"):
        keys.add("num_labels")
    return keys


def _has_class(auto: Any, config: Any) -> bool:
    mapping = getattr(auto, "_model_mapping", None)
    if mapping is None:  # cannot tell beforehand; from_config will say
        return auto.__name__ == "AutoModel"
    try:
        return type(config) in mapping
    except Exception:  # noqa: BLE001 - a lazy mapping that fails to import a model module
        return False


# --------------------------------------------------------------------------- the dummy input


def dummy_inputs(model: nn.Module, batch: int = _BATCH, length: int = _LENGTH) -> dict[str, Any]:
    """Return keyword arguments for ``model(**inputs)``: a small random input it accepts.

    See the module docstring for the shapes. Token ids come from ``torch.randint`` and the
    rest from ``torch.randn``, so ``torch.manual_seed`` fixes them.

    Raises:
        HFModelError: the model's main input is none of ``input_ids``, ``pixel_values``,
            ``input_values``, ``input_features``, or its config lacks the sizes needed.

    Example:
        >>> from gradtap.integrations.hf_models import build_model, describe_inputs, dummy_inputs
        >>> model = build_model("vit", {"image_size": 16, "patch_size": 8, "hidden_size": 8,
        ...     "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16})
        >>> describe_inputs(dummy_inputs(model))
        'pixel_values [2, 3, 16, 16] float32'
    """
    config: Any = model.config
    forward = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    what = f"{type(model).__name__} ({config.model_type!r})"
    if main == "input_ids":
        x: Tensor = _token_ids(config, batch, length, "max_position_embeddings", what)
    elif main == "pixel_values":
        x = torch.randn(batch, _get(config, "num_channels", 3), *_image_size(config, what))
    elif main == "input_values":
        x = _audio(config, batch, length, what)
    elif main == "input_features":
        x = _features(config, batch, what)
    else:
        raise HFModelError(
            f"{what}: no dummy input for its main input {main!r} (known: input_ids, "
            "pixel_values, input_values, input_features); use FILE.py:FACTORY instead"
        )
    inputs: dict[str, Any] = {main: x}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in forward:
        vocab = getattr(config, "decoder_vocab_size", None) or config.vocab_size
        inputs["decoder_input_ids"] = _token_ids(config, batch, length, "max_target_positions",
                                                 what, vocab=vocab)
    if "use_cache" in forward:
        inputs["use_cache"] = False
    return inputs


def _get(config: Any, name: str, default: Any) -> Any:
    value = getattr(config, name, None)
    return default if value is None else value


def _token_ids(config: Any, batch: int, length: int, limit: str, what: str,
               vocab: int | None = None) -> Tensor:
    vocab = vocab if vocab is not None else getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise HFModelError(f"{what}: its config has no vocab_size to draw token ids from")
    most = getattr(config, limit, None)
    if isinstance(most, int) and most > 0:
        length = min(length, most)
    return torch.randint(0, vocab, (batch, length))


def _image_size(config: Any, what: str) -> tuple[int, int]:
    size = getattr(config, "image_size", None)
    if isinstance(size, int):
        return size, size
    if isinstance(size, (tuple, list)) and len(size) == 2:
        return int(size[0]), int(size[1])
    raise HFModelError(f"{what}: its config has no image_size (got {size!r}); set it with --config")


def _audio(config: Any, batch: int, frames: int, what: str) -> Tensor:
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    if kernels and strides:
        samples = frames  # invert length -> (length - kernel) // stride + 1, last layer first
        for k, s in zip(reversed(list(kernels)), reversed(list(strides)), strict=False):
            samples = (samples - 1) * int(s) + int(k)
        return torch.randn(batch, samples)
    bins, most = getattr(config, "num_mel_bins", None), getattr(config, "max_length", None)
    if isinstance(bins, int) and isinstance(most, int):
        return torch.randn(batch, most, bins)  # a spectrogram (Audio Spectrogram Transformer)
    raise HFModelError(
        f"{what}: cannot size its input_values: the config has neither conv_kernel/conv_stride "
        "nor num_mel_bins/max_length"
    )


def _features(config: Any, batch: int, what: str) -> Tensor:
    bins, sources = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if isinstance(bins, int) and isinstance(sources, int):
        # Whisper's encoder takes exactly 2 * max_source_positions frames (two convolutions,
        # the second with stride 2).
        return torch.randn(batch, bins, 2 * sources)
    per_channel = getattr(config, "input_feat_per_channel", None)
    if isinstance(per_channel, int):
        return torch.randn(batch, 4 * _LENGTH, per_channel * _get(config, "input_channels", 1))
    raise HFModelError(
        f"{what}: cannot size its input_features: the config has neither num_mel_bins/"
        "max_source_positions nor input_feat_per_channel"
    )


def describe_inputs(inputs: Mapping[str, Any]) -> str:
    """``"input_ids [2, 8] int64, decoder_input_ids [2, 8] int64"`` (tensors only).

    Example:
        >>> import torch
        >>> from gradtap.integrations.hf_models import describe_inputs
        >>> describe_inputs({"input_ids": torch.zeros(2, 8, dtype=torch.long), "use_cache": False})
        'input_ids [2, 8] int64'
    """
    return ", ".join(f"{k} {list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
                     for k, v in inputs.items() if isinstance(v, Tensor))


def model_and_inputs(
    model_type: str, overrides: Mapping[str, Any] | None = None, task: str = "auto"
) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`build_model`, :func:`dummy_inputs`, and one forward without grad to check them.

    Raises:
        ImportError: transformers is not installed.
        HFModelError: as :func:`build_model` and :func:`dummy_inputs`, or the forward failed
            on the dummy input (the input and the error are in the message).

    Example:
        >>> import gradtap as gt
        >>> from gradtap.integrations.hf_models import model_and_inputs
        >>> model, inputs = model_and_inputs("bert", dict(hidden_size=8, num_hidden_layers=1,
        ...     num_attention_heads=2, intermediate_size=16, vocab_size=30))
        >>> type(model).__name__
        'BertForPreTraining'
        >>> ex = gt.explain(model, inputs, select="bert.encoder.layer.0.output.dense")
        >>> [r.module_name for r in ex.records]
        ['bert.encoder.layer.0.output.dense']
    """
    model = build_model(model_type, overrides, task)
    inputs = dummy_inputs(model)
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as err:  # noqa: BLE001 - any failure of a third-party forward
        raise HFModelError(
            f"{type(model).__name__} ({model_type!r}) failed on the dummy input "
            f"({describe_inputs(inputs)}): {type(err).__name__}: {err}"
        ) from err
    return model, inputs
