"""Small example models used by the CLI, the demo, the benchmarks and the tests.

All are plain ``nn.Module`` code with no downloads: ``convnet()`` (two convs, three linears,
for 1x28x28 inputs), ``mlp()``, ``small_cnn()`` and ``resnet18_like()``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["BasicBlock", "ConvNet", "ResNetLike", "convnet", "mlp", "resnet18_like", "small_cnn"]


class ConvNet(nn.Module):
    """Two convolutions and three linear layers for ``[N, 1, 28, 28]`` inputs (LeNet-like)."""

    def __init__(self, num_classes: int = 10, in_size: int = 28) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU()
        side = ((in_size // 2) - 4) // 2
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = x.flatten(1)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


class BasicBlock(nn.Module):
    """ResNet basic block: conv-norm-ReLU(inplace)-conv-norm, ``out += identity``, ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetLike(nn.Module):
    """A ResNet-18 layout (2-2-2-2 basic blocks) for small images, with a chosen width.

    ``norm="batch"`` uses BatchNorm2d (like ResNet-18), ``norm="group"`` GroupNorm with
    ``min(8, channels)`` groups (for per-sample gradients, whose samples must not be coupled).
    """

    def __init__(self, width: int = 16, num_classes: int = 10, in_channels: int = 3,
                 norm: str = "batch") -> None:
        super().__init__()
        if norm == "batch":
            make_norm: Callable[[int], nn.Module] = nn.BatchNorm2d
        elif norm == "group":
            def make_norm(c: int) -> nn.Module:
                return nn.GroupNorm(min(8, c), c)
        else:
            raise ValueError(f"norm must be 'batch' or 'group'; got {norm!r}")
        w = width
        self.conv1 = nn.Conv2d(in_channels, w, 3, 1, 1, bias=False)
        self.bn1 = make_norm(w)
        self.relu = nn.ReLU(inplace=True)
        layers, cin = [], w
        for i, cout in enumerate([w, 2 * w, 4 * w, 8 * w]):
            stride = 1 if i == 0 else 2
            layer = nn.Sequential(BasicBlock(cin, cout, stride, make_norm),
                                  BasicBlock(cout, cout, 1, make_norm))
            layers.append(layer)
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.pool(x).flatten(1))


def convnet(num_classes: int = 10) -> ConvNet:
    """Two-conv, three-linear net for ``[N, 1, 28, 28]`` inputs (``gradtap explain --example convnet``)."""
    return ConvNet(num_classes)


def mlp(in_features: int = 784, hidden: int = 512, depth: int = 3, num_classes: int = 10) -> nn.Sequential:
    """A ReLU MLP with ``depth`` hidden layers."""
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def small_cnn(in_channels: int = 3, num_classes: int = 10) -> nn.Sequential:
    """Three conv-BN-ReLU stages and a linear head, for ``[N, C, 32, 32]`` inputs."""
    def stage(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*stage(in_channels, 16), *stage(16, 32), *stage(32, 64),
                         nn.Flatten(), nn.Linear(64 * 4 * 4, num_classes))


def resnet18_like(width: int = 16, num_classes: int = 10, norm: str = "batch") -> ResNetLike:
    """ResNet-18 layout for ``[N, 3, 32, 32]`` inputs; ``norm="group"`` for GroupNorm."""
    return ResNetLike(width=width, num_classes=num_classes, norm=norm)
