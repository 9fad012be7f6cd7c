"""Factories for ``lightmem estimate``: ``factory(batch_size) -> (model, batch[, loss_fn])``.

    lightmem estimate examples/estimate_factories.py:gpt2_large --batch-size 8 --budget 80GiB --precision bf16-mixed
    lightmem estimate examples.estimate_factories:tiny_gpt --batch-size 32 --budget 64MiB --device cpu

``gpt2_large`` builds a GPT-2-large-sized model (774M parameters, 36 layers, width 1280,
sequence 1024) on the meta device: no memory is used for its weights, and the estimator never
needs their values. ``tiny_gpt`` is a small model with naive attention (so the advice has
something to say) that runs anywhere in a second.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, fused: bool) -> None:
        super().__init__()
        self.heads = heads
        self.fused = fused
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:  # the textbook version: keeps a (seq x seq) score matrix per head for backward
            scores = q @ k.transpose(-2, -1) / math.sqrt(width // self.heads)
            mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            out = F.dropout(scores.softmax(dim=-1), p, self.training) @ v
        return self.proj(
            F.dropout(out.transpose(1, 2).reshape(batch, seq, width), self.dropout, self.training)
        )


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, fused: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout, fused)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 layout: token and position embeddings, pre-norm blocks, tied output head."""

    def __init__(
        self,
        vocab: int,
        seq: int,
        width: int,
        depth: int,
        heads: int,
        dropout: float = 0.1,
        fused: bool = True,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout, fused) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def gpt2_large(batch_size: int) -> tuple[nn.Module, torch.Tensor, object]:
    """GPT-2 large (774M parameters) on the meta device, sequences of 1024 tokens."""
    with torch.device("meta"):
        model = GPT(vocab=50257, seq=1024, width=1280, depth=36, heads=20)
    tokens = torch.zeros(batch_size, 1025, dtype=torch.long)
    return model, tokens, next_token_loss


def tiny_gpt(batch_size: int) -> tuple[nn.Module, torch.Tensor, object]:
    """A 4-layer GPT with naive attention, sequences of 256 tokens."""
    torch.manual_seed(0)
    model = GPT(vocab=512, seq=256, width=128, depth=4, heads=4, fused=False)
    tokens = torch.randint(0, 512, (batch_size, 257))
    return model, tokens, next_token_loss


def deep_convnet(batch_size: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """The 206.5M-parameter conv net of ``examples/deep_convnet.py`` (a user's Keras model that fit
    a 2 GB card but could not train) on the meta device, with 16x16 single-channel images."""

    def conv(cin: int, cout: int) -> nn.Module:
        return nn.Conv2d(cin, cout, 3, padding=1)

    with torch.device("meta"):
        layers: list[nn.Module] = [conv(1, 256), nn.MaxPool2d(2), conv(256, 512), nn.MaxPool2d(2), conv(512, 1024)]
        layers += [conv(1024, 1024) for _ in range(21)]
        layers += [nn.MaxPool2d(2), conv(1024, 256), conv(256, 32), nn.MaxPool2d(2), nn.Flatten()]
        layers += [nn.Linear(32, 4), nn.Linear(4, 1)]
        model = nn.Sequential(*layers)
    batch = (torch.rand(batch_size, 1, 16, 16), torch.rand(batch_size, 1))
    return model, batch, lambda net, b: F.mse_loss(net(b[0]), b[1])


class Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1x1 reduce, 3x3, 1x1 expand, each with BatchNorm; a projected
    shortcut when the shape changes."""

    expansion = 4

    def __init__(self, inputs: int, width: int, stride: int = 1) -> None:
        super().__init__()
        outputs = width * self.expansion
        self.conv1 = nn.Conv2d(inputs, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, outputs, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    """The ImageNet ResNet layout (torchvision's module names): a 7x7 stem at full resolution, max
    pooling, stages of bottleneck blocks (``layer1``...; ResNet-50's depths by default), global
    average pooling and one linear classifier."""

    def __init__(self, depths: tuple[int, ...] = (3, 4, 6, 3), base_width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, base_width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base_width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages = []
        inputs = base_width
        for index, depth in enumerate(depths):
            width = base_width * 2**index
            blocks = []
            for block in range(depth):
                blocks.append(Bottleneck(inputs, width, stride=2 if block == 0 and index > 0 else 1))
                inputs = width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = len(stages)
        for index, stage in enumerate(stages):
            setattr(self, f"layer{index + 1}", stage)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inputs, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for index in range(self.stages):
            x = getattr(self, f"layer{index + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def resnet50(batch_size: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """ResNet-50 (25.6M parameters) on ImageNet-sized images (3x224x224), weights and batch on the
    meta device: the estimate needs neither values nor memory."""
    with torch.device("meta"):
        model = ResNet()
        batch = (torch.empty(batch_size, 3, 224, 224), torch.zeros(batch_size, dtype=torch.long))
    return model, batch, classification_loss
