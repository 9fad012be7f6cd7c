"""Models whose forward updates buffers: BatchNorm statistics and a step counter (checkpoint exactness)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class StepCounter(nn.Module):
    """Counts its training forwards in a buffer, and the count shapes the output (like a schedule)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
        return x * (1.0 + 0.01 * self.steps)


class ResBlock(nn.Module):
    def __init__(self, channels: int, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels, momentum=momentum)
        self.drop = nn.Dropout2d(0.1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.counter = StepCounter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(F.relu(self.bn1(self.conv1(x))))
        return self.counter(F.relu(x + self.bn2(self.conv2(y))))


class Head(nn.Module):
    def __init__(self, channels: int, classes: int, momentum: float | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, channels)
        self.bn = nn.BatchNorm1d(channels, momentum=momentum)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(F.relu(self.bn(self.fc(x)))))


class TinyResNet(nn.Module):
    """4 residual blocks (BatchNorm2d, block 2 with ``momentum=None``, Dropout2d, a step counter) and a
    BatchNorm1d head."""

    def __init__(self, channels: int = 8, classes: int = 10, cumulative_average: bool = True) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(
            *[ResBlock(channels, momentum=None if i == 2 and cumulative_average else 0.1) for i in range(4)]
        )
        self.head = Head(channels, classes, momentum=None if cumulative_average else 0.1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)).mean(dim=(2, 3)))


def image_batches(steps: int = 4, batch_size: int = 8, size: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(steps * batch_size, 3, size, size, generator=generator)
    labels = torch.randint(0, 10, (steps * batch_size,), generator=generator)
    return images, labels


def image_loader(steps: int = 4, batch_size: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(*image_batches(steps, batch_size)), batch_size=batch_size, shuffle=False)


class LitResNet(pl.LightningModule):
    def __init__(self, cumulative_average: bool = True) -> None:
        super().__init__()
        self.model = TinyResNet(cumulative_average=cumulative_average)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
