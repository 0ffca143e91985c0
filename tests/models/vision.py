"""torchvision's models built in code, for the real-model suite (registered in ``zoo.ZOO``).

Random weights (``weights=None``, ``weights_backbone=None``: nothing is downloaded), 5
classes, and 32x32 images, on which the five stride-2 stages of most come down to 1x1 before
the global pooling. Every dropout and stochastic-depth probability is 0 (checked
when a model is built), so train mode is deterministic; BatchNorm still uses batch statistics
there (``test_models.py`` runs the per-sample check in eval mode for those, on running
statistics taken from a batch of random images, see ``_batch_statistics``).

The ResNet, DenseNet, MobileNet, EfficientNet, ShuffleNet, ConvNeXt, SqueezeNet, GoogLeNet,
MnasNet, RegNet and segmentation models are the named models as torchvision builds them, but
for the initial values noted at ConvNeXt and ViT. The transformers get a small config of the
same class: maxvit_t needs a 224x224 input (its partitions of 7 must divide every stage's
grid), and vit_b_16's and swin_t's sizes would only add time. Each keeps its distinctive
pattern (a class token, shifted windows, block and grid partitions).

torchvision has no build beside every torch this suite runs under; where it does not import,
every spec here is still registered, with ``skip`` saying why, so its tests show as skipped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.models.zoo import N, Spec, class_loss, register

try:
    from torchvision import models as tvm
    from torchvision.ops import StochasticDepth
except Exception as e:  # absent, or built against another torch (its compiled ops fail)
    tvm = StochasticDepth = None
    SKIP: str | None = ("torchvision not importable beside this torch; vision models run in the "
                        f"torch 2.14.1 job (make test-compat) ({type(e).__name__}: {e})")
else:
    SKIP = None

CLASSES = 5


def _image(gen: torch.Generator, size: int = 32) -> dict[str, Any]:
    return {"x": torch.randn(N, 3, size, size, generator=gen),
            "target": torch.randint(0, CLASSES, (N,), generator=gen)}


def _segmentation(gen: torch.Generator, size: int = 32, arg: str = "x") -> dict[str, Any]:
    return {arg: torch.randn(N, 3, size, size, generator=gen),
            "target": torch.randint(0, CLASSES, (N, size, size), generator=gen)}


def _pixel_loss(out: dict[str, Tensor], target: Tensor) -> Tensor:
    # Every image has as many pixels: the mean over pixels is the mean over samples of each
    # sample's own mean.
    return F.cross_entropy(out["out"], target)


def _no_dropout(model: nn.Module) -> nn.Module:
    """Sets every Dropout's probability to 0 (for those a constructor argument cannot reach)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return model


def _batch_statistics(model: nn.Module, size: int = 32) -> nn.Module:
    """``model`` with BatchNorm's running statistics taken from one batch of random images.

    The fresh ones (mean 0, variance 1) are far from a randomly initialized model's
    activations: in eval mode (the per-sample check) MobileNet's, EfficientNet's and MnasNet's
    signal fades to constant logits. One forward of 32 random images in train mode, with a
    cumulative average, gives eval mode the statistics train mode would use.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    with torch.no_grad():
        model.train()(torch.randn(32, 3, size, size, generator=torch.Generator().manual_seed(7)))
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    return model


def _deterministic(model: nn.Module) -> nn.Module:
    """``model``, after checking that no dropout or stochastic depth is left on."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.modules.dropout._DropoutNd, StochasticDepth)):
            assert m.p == 0, f"{name}: {type(m).__name__} with p={m.p}"
        if isinstance(m, nn.MultiheadAttention):
            assert m.dropout == 0, f"{name}: attention dropout {m.dropout}"
    return model


def _classifier(name: str, build, size: int = 32) -> None:
    register(Spec(f"torchvision_{name}", "vision",
                  lambda: _batch_statistics(_deterministic(build()), size),
                  lambda g: _image(g, size), class_loss, skip=SKIP))


# Residual `out += identity` after a BatchNorm, then ReLU(inplace=True).
_classifier("resnet18", lambda: tvm.resnet18(num_classes=CLASSES))

# Each dense layer takes the list of all earlier feature maps and concatenates it; BatchNorm,
# then ReLU(inplace=True) on the BatchNorm's output.
_classifier("densenet121", lambda: tvm.densenet121(num_classes=CLASSES))

# Squeeze-excitation with Hardsigmoid, Hardswish, and an in-place Dropout(p=0) in the head.
_classifier("mobilenet_v3_small", lambda: tvm.mobilenet_v3_small(num_classes=CLASSES, dropout=0.0))

# MBConv blocks with squeeze-excitation; StochasticDepth at p=0 returns its input as is.
_classifier("efficientnet_b0", lambda: tvm.efficientnet_b0(
    num_classes=CLASSES, dropout=0.0, stochastic_depth_prob=0.0))

# Each unit splits the channels with chunk, concatenates and shuffles them (view, transpose,
# contiguous, view).
_classifier("shufflenet_v2_x0_5", lambda: tvm.shufflenet_v2_x0_5(num_classes=CLASSES))

# Permute modules around LayerNorm and the pointwise Linears, a learned layer scale, then
# `result += input`. The layer scale starts at 0.5 instead of 1e-6: at 1e-6 each block's
# branch would be a millionth of its residual, below what the checks can tell apart.
_classifier("convnext_tiny", lambda: tvm.convnext_tiny(
    num_classes=CLASSES, stochastic_depth_prob=0.0, layer_scale=0.5))

# Fire modules: a squeeze conv, then two expand convs concatenated, each with in-place ReLU.
_classifier("squeezenet1_1", lambda: tvm.squeezenet1_1(num_classes=CLASSES, dropout=0.0))

# Inception blocks concatenate four branches.
_classifier("googlenet", lambda: tvm.googlenet(
    num_classes=CLASSES, aux_logits=False, transform_input=False, init_weights=True,
    dropout=0.0))

_classifier("mnasnet0_5", lambda: tvm.mnasnet0_5(num_classes=CLASSES, dropout=0.0))

# Grouped bottlenecks with squeeze-excitation.
_classifier("regnet_y_400mf", lambda: tvm.regnet_y_400mf(num_classes=CLASSES))


def _vit() -> nn.Module:
    model = tvm.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                  hidden_dim=32, mlp_dim=64, num_classes=CLASSES)
    # torchvision starts the head at zero, which would leave every other gradient zero.
    model.heads.head.reset_parameters()
    return model


# A class token (a parameter of the root, used outside every child call) concatenated to the
# patch embeddings; nn.MultiheadAttention in each layer.
_classifier("vit", _vit)

# swin_t's class at a small size: the second block of each stage shifts its windows (window
# 4 on 16x16 and 8x8 token grids), then patch merging.
_classifier("swin", lambda: tvm.SwinTransformer(
    patch_size=[2, 2], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
    stochastic_depth_prob=0.0, num_classes=CLASSES))

# maxvit_t's class at a small size: each layer is an MBConv, then attention within windows and
# within a grid (WindowPartition / WindowDepartition modules, SwapAxes for the grid). As in
# maxvit_t's last two stages (14x14 and 7x7 with partitions of 7), the first stage's 8x8 grid
# holds four 4x4 windows and the last stage's 4x4 grid is a single window.
_classifier("maxvit", lambda: tvm.maxvit.MaxVit(
    input_size=(32, 32), stem_channels=8, partition_size=4, block_channels=[16, 32],
    block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0, num_classes=CLASSES))


# -- segmentation: a dict output, upsampled to the input's size --------------------------------

def _segmenter(name: str, build, arg: str = "x") -> None:
    register(Spec(f"torchvision_{name}", "vision",
                  lambda: _batch_statistics(_deterministic(build())),
                  lambda g: _segmentation(g, arg=arg), _pixel_loss, skip=SKIP))


# Two branches of the backbone's features, one gating the other through a pooled sigmoid.
_segmenter("lraspp_mobilenet_v3_large", lambda: tvm.segmentation.lraspp_mobilenet_v3_large(
    num_classes=CLASSES, weights_backbone=None), arg="input")

# ASPP: parallel atrous convolutions and an image-pooling branch, concatenated; its projection
# has a fixed Dropout(0.5), set to 0 here.
_segmenter("deeplabv3_mobilenet_v3_large", lambda: _no_dropout(
    tvm.segmentation.deeplabv3_mobilenet_v3_large(num_classes=CLASSES, weights_backbone=None,
                                                  aux_loss=False)))
