"""Image models laid out the ways users write them, not torchvision's way: the planner must find their
repeated blocks and search every kind of configuration for each (issue 50).

- ``UserResNet``: a stem ``nn.Sequential``, every bottleneck in one ``nn.Sequential`` named ``blocks``,
  a head ``nn.Sequential`` (``user_resnet50`` is ResNet-50 so);
- ``TrunkNet``: the blocks in an ``nn.ModuleList`` named ``trunk``, looped over in ``forward``;
- ``StagedNet``: stages as ``nn.Sequential``s inside an ``nn.ModuleList`` (nested containers);
- ``TwoKindsNet``: blocks of two classes taking turns in one ``nn.Sequential``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Bottleneck(nn.Module):
    """ResNet's bottleneck: 1x1 reduce, 3x3, 1x1 expand, each with BatchNorm; a projected shortcut
    when the shape changes. Written as a user writes it (functional ReLUs, a ``shortcut``), not as
    ``examples.estimate_factories.Bottleneck`` (ReLU modules, ``downsample``). The planner's answers
    for the two differ (at batch 570 under 12 GiB, which of the stem's modules it offloads), and the
    tests and ``benchmarks/allocator_fit.py`` pin this one's."""

    def __init__(self, inputs: int, width: int, stride: int = 1) -> None:
        super().__init__()
        outputs = 4 * width
        self.conv1 = nn.Conv2d(inputs, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, outputs, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(outputs)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs))
            if stride != 1 or inputs != outputs
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = F.relu(self.bn2(self.conv2(out)), inplace=True)
        return F.relu(self.bn3(self.conv3(out)) + self.shortcut(x), inplace=True)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and an identity shortcut (channels unchanged)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(out)) + x, inplace=True)


def _stem(width: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    )  # fmt: skip


def _bottlenecks(depths: tuple[int, ...], width: int) -> list[list[Bottleneck]]:
    """ResNet's stages of bottlenecks (the first of each stage after the first halves the resolution)."""
    stages, inputs = [], width
    for index, depth in enumerate(depths):
        stage = []
        for block in range(depth):
            stage.append(Bottleneck(inputs, width * 2**index, stride=2 if block == 0 and index > 0 else 1))
            inputs = 4 * width * 2**index
        stages.append(stage)
    return stages


def _head(inputs: int, classes: int) -> nn.Sequential:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes))


class UserResNet(nn.Module):
    """A stem, every bottleneck in one ``nn.Sequential`` named ``blocks``, a head."""

    def __init__(self, depths: tuple[int, ...] = (2, 2), width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = _stem(width)
        self.blocks = nn.Sequential(*(block for stage in _bottlenecks(depths, width) for block in stage))
        self.head = _head(4 * width * 2 ** (len(depths) - 1), classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)))


class TrunkNet(nn.Module):
    """The same network with its blocks in an ``nn.ModuleList`` named ``trunk``."""

    def __init__(self, depths: tuple[int, ...] = (2, 2), width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = _stem(width)
        self.trunk = nn.ModuleList(block for stage in _bottlenecks(depths, width) for block in stage)
        self.head = _head(4 * width * 2 ** (len(depths) - 1), classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.trunk:
            x = block(x)
        return self.head(x)


class StagedNet(nn.Module):
    """Stages as ``nn.Sequential``s of bottlenecks, held in an ``nn.ModuleList`` named ``stages``."""

    def __init__(self, depths: tuple[int, ...] = (2, 2), width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = _stem(width)
        self.stages = nn.ModuleList(nn.Sequential(*stage) for stage in _bottlenecks(depths, width))
        self.head = _head(4 * width * 2 ** (len(depths) - 1), classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


class TwoKindsNet(nn.Module):
    """Bottlenecks and basic blocks taking turns in one ``nn.Sequential`` named ``body``."""

    def __init__(self, pairs: int = 2, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = _stem(4 * width)
        layers: list[nn.Module] = []
        for _ in range(pairs):
            layers += [Bottleneck(4 * width, width), BasicBlock(4 * width)]
        self.body = nn.Sequential(*layers)
        self.head = _head(4 * width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(images)))


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def image_batch(size: int, resolution: int = 224, classes: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels on the meta device: the planner needs their shapes only."""
    with torch.device("meta"):
        return torch.empty(size, 3, resolution, resolution), torch.zeros(size, dtype=torch.long)


def user_resnet50() -> UserResNet:
    """ResNet-50 (25.6M parameters) in ``UserResNet``'s layout, on the meta device."""
    with torch.device("meta"):
        return UserResNet(depths=(3, 4, 6, 3), width=64, classes=1000)
