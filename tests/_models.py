"""Test helpers shared by several test files: example models and a hook-hygiene check."""

from __future__ import annotations

from torch import nn

from gradtap.examples import ResNetLike, convnet, mlp, small_cnn

__all__ = ["ResNetLike", "assert_no_hooks", "convnet", "mlp", "small_cnn"]

_MODULE_HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def assert_no_hooks(model: nn.Module) -> None:
    """No hook left in any hook dict of any module or parameter of ``model``."""
    for name, module in model.named_modules():
        for attr in _MODULE_HOOK_DICTS:
            hooks = getattr(module, attr, None)
            assert not hooks, f"module {name!r} still has {attr}: {hooks}"
        assert module._is_full_backward_hook is None or not module._backward_hooks, name
    for name, p in model.named_parameters():
        assert not p._backward_hooks, f"parameter {name!r} has tensor hooks"
        assert p._post_accumulate_grad_hooks is None, f"parameter {name!r} has post-accumulate hooks"
