"""The public surface: __all__ is sorted, holds the public names of every landed capability,
and every public object has a docstring."""

from __future__ import annotations

import inspect

import gradtap as gt

# The public names, per capability that has landed (README.md and docs/semantics.md document
# them). Adding a capability means adding its names here, deliberately.
CONTRACT = {
    "records": {"tap", "GradRecord", "explain", "SelectionError", "GradtapError"},
    "convolution": {"functional", "explicit_conv", "hvp", "hessian_trace", "top_eigenvalue"},
    "detect": {"detect", "Detector", "Anomaly", "GradientAnomaly", "load_dump"},
    "per_sample": {"per_sample", "UnsupportedModuleError"},
    "monitor": {"Monitor", "Run", "open_run", "to_tensorboard", "StoreError", "Spike"},
    "transforms": {"Transform", "add_noise", "centralize", "chain", "clip_global_norm",
                   "clip_norm", "clip_value", "ewma", "flip", "normalize", "scale", "stateless",
                   "transform", "TransformHandle", "zero"},
    "spike_control": {"zclip", "adagc", "agc", "adagn", "spam_clip"},
    "privacy": {"dp_sgd", "poisson_batches"},
}


def test_all_is_sorted_and_resolvable():
    assert list(gt.__all__) == sorted(gt.__all__)
    for name in gt.__all__:
        assert hasattr(gt, name), name


def test_contract_names_are_exported():
    exported = set(gt.__all__)
    for capability, names in CONTRACT.items():
        assert names <= exported, f"{capability}: missing {sorted(names - exported)}"


def test_every_public_object_has_a_docstring():
    missing = [n for n in gt.__all__ if not inspect.getdoc(getattr(gt, n))]
    assert not missing, missing


def test_functional_surface():
    assert {"conv", "conv_input_grad", "conv_weight_grad"} <= set(gt.functional.__all__)
