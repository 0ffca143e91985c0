"""Per-sample rules for normalization layers with an affine transform.

All of them compute ``y = x_hat * weight + bias`` with ``x_hat`` normalized within one sample
(LayerNorm, RMSNorm over the trailing dims; GroupNorm, InstanceNorm over a sample's groups or
channels; BatchNorm in eval mode with its running statistics), so sample n's gradients are
``weight: sum (go_n * x_hat_n)`` and ``bias: sum go_n`` over every position that shares a
parameter element. ``x_hat`` is recomputed from the kept input with the functional op
without affine parameters. BatchNorm in training mode (or without running statistics)
normalizes with statistics of the whole batch, which couples the samples: it is refused.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradtap._samples.rule import PerSampleRule

__all__ = ["BATCH_NORM", "GROUP_NORM", "INSTANCE_NORM", "LAYER_NORM", "RMS_NORM",
           "check_batchnorm", "grad_batchnorm", "grad_groupnorm", "grad_instancenorm",
           "grad_layernorm", "grad_rmsnorm"]


def _affine(x_hat: Tensor, grad_out: Tensor, names: frozenset[str], shape: tuple[int, ...],
            channel_first: bool) -> dict[str, Tensor]:
    """Sum ``go * x_hat`` and ``go`` over every position sharing a parameter element.

    ``shape`` is the parameter's shape; positions are the dims between the sample dim and
    the parameter's dims (trailing layout) or after the channel dim (channel-first layout).
    """
    n = grad_out.shape[0]
    view: tuple[int, ...]
    if channel_first:
        view, dim = (n, shape[0], -1), 2
    else:
        view, dim = (n, -1, *shape), 1
    out: dict[str, Tensor] = {}
    if "weight" in names:
        out["weight"] = (grad_out * x_hat).reshape(view).sum(dim)
    if "bias" in names:
        out["bias"] = grad_out.reshape(view).sum(dim)
    return out


def _batched(module: nn.Module, inp: Tensor, least: int) -> None:
    if inp.dim() < least:
        raise ValueError(
            f"{type(module).__name__}: per-sample gradients need a batched input with at least "
            f"{least} dims ([N, C, ...]), got shape {tuple(inp.shape)}"
        )


def grad_layernorm(
    module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Per-sample gradients ``weight, bias: [N, *normalized_shape]``."""
    m = cast(nn.LayerNorm, module)
    shape = tuple(m.normalized_shape)
    x_hat = F.layer_norm(inp, shape, None, None, m.eps)
    return _affine(x_hat, grad_out, names, shape, channel_first=False)


def grad_rmsnorm(
    module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Per-sample gradients ``weight: [N, *normalized_shape]``."""
    m = cast(nn.RMSNorm, module)
    shape = tuple(m.normalized_shape)
    x_hat = F.rms_norm(inp, shape, None, m.eps)
    return _affine(x_hat, grad_out, names, shape, channel_first=False)


def grad_groupnorm(
    module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Per-sample gradients ``weight, bias: [N, num_channels]``."""
    _batched(module, inp, 2)
    m = cast(nn.GroupNorm, module)
    x_hat = F.group_norm(inp, m.num_groups, None, None, m.eps)
    return _affine(x_hat, grad_out, names, (m.num_channels,), channel_first=True)


def _running(module: nn.Module, inp: Tensor) -> Tensor:
    m = cast(nn.modules.batchnorm._NormBase, module)  # BatchNorm*d, InstanceNorm*d
    assert m.running_mean is not None and m.running_var is not None  # checked by the caller
    shape = (1, -1) + (1,) * (inp.dim() - 2)
    mean = m.running_mean.view(shape)
    var = m.running_var.view(shape)
    return (inp - mean) * torch.rsqrt(var + m.eps)


def grad_instancenorm(
    module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Per-sample gradients ``weight, bias: [N, num_features]`` (``affine=True``)."""
    m = cast(nn.modules.instancenorm._InstanceNorm, module)
    _batched(m, inp, m._get_no_batch_dim() + 1)
    if m.track_running_stats and not m.training:
        x_hat = _running(m, inp)
    else:
        # No running buffers passed: F.instance_norm would update them in place.
        x_hat = F.instance_norm(inp, None, None, None, None, True, 0.0, m.eps)
    return _affine(x_hat, grad_out, names, (m.num_features,), channel_first=True)


def check_batchnorm(module: nn.Module) -> str | None:
    """BatchNorm couples samples unless it is in eval mode with running statistics."""
    if module.training or module.running_mean is None or module.running_var is None:
        return (
            "it normalizes with statistics of the whole batch (training mode or "
            "track_running_stats=False), so one sample's gradient depends on the others; "
            "call .eval() on it (with running statistics), or leave it out of select="
        )
    return None


def grad_batchnorm(
    module: nn.Module, inp: Tensor, grad_out: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Per-sample gradients ``weight, bias: [N, num_features]`` (eval mode only)."""
    _batched(module, inp, 2)
    x_hat = _running(module, inp)
    num_features = cast(nn.modules.batchnorm._BatchNorm, module).num_features
    return _affine(x_hat, grad_out, names, (num_features,), channel_first=True)


# LayerNorm and RMSNorm normalize trailing dims: any sample dim works. The others take
# [N, C, ...] inputs.
LAYER_NORM = PerSampleRule(grad=grad_layernorm)
RMS_NORM = PerSampleRule(grad=grad_rmsnorm)
GROUP_NORM = PerSampleRule(grad=grad_groupnorm, batch_dim=0)
INSTANCE_NORM = PerSampleRule(grad=grad_instancenorm, batch_dim=0)
BATCH_NORM = PerSampleRule(grad=grad_batchnorm, check=check_batchnorm, batch_dim=0)
