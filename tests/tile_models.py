"""Modules for the tiling tests: position-wise ones tiling must keep exact, and ones that mix
positions (or otherwise cannot be tiled) that it must refuse."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SwiGLU(nn.Module):
    """A Llama MLP: down(silu(gate(x)) * up(x)), with optional dropout on its output."""

    def __init__(self, dim: int = 16, hidden: int = 48, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=True)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.silu(self.gate(x)) * self.up(x)))


class SelfAttention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class Block(nn.Module):
    """Pre-norm transformer block: attention (mixes positions) then a SwiGLU MLP (position-wise)."""

    def __init__(self, dim: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = SwiGLU(dim, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def blocks(depth: int = 2, dim: int = 16, dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(dim, dropout) for _ in range(depth)])


class SequenceConv(nn.Module):
    """A convolution along the sequence (kernel 3): each output reads its neighbours."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(-1, -2)).transpose(-1, -2)


class CapacityMoE(nn.Module):
    """Top-1 routing over 2 experts, each taking at most half the tokens of the call (capacity factor
    1): a token past its expert's capacity is dropped (output 0), so tokens compete for slots. Every
    token prefers expert 0 here (a biased router), so with 4 tokens 2 are dropped, and alone none is."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.router = nn.Linear(dim, 2)
        with torch.no_grad():
            self.router.bias.copy_(torch.tensor([100.0, 0.0]))
        self.experts = nn.ModuleList([SwiGLU(dim), SwiGLU(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        choice = self.router(tokens).argmax(-1)
        capacity = max(1, tokens.shape[0] // 2)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().flatten()[:capacity]
            out = out.index_add(0, rows, expert(tokens[rows]))
        return out.reshape(x.shape)


class SignRoutedMoE(nn.Module):
    """Top-1 routing by the sign of the first feature over 2 experts, each taking at most half the
    tokens of the call: with tokens split evenly nothing is dropped, but one token changing sides
    pushes a later token past its expert's capacity (its output becomes 0)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        choice = (tokens[:, 0] < 0).long()
        capacity = max(1, tokens.shape[0] // 2)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().flatten()[:capacity]
            out = out.index_add(0, rows, expert(tokens[rows]))
        return out.reshape(x.shape)


def balanced_tokens(batch: int = 2, seq: int = 37, dim: int = 16) -> torch.Tensor:
    """Inputs whose first feature is +1 at even positions and -1 at odd ones (``SignRoutedMoE``
    sends them to its two experts evenly)."""
    x = torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(3))
    x[..., 0] = torch.tensor([1.0, -1.0]).repeat(seq)[:seq]
    return x


class BatchNormMLP(nn.Module):
    """Batch normalisation over every position of the batch, then a linear layer."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x.transpose(-1, -2)).transpose(-1, -2))


class IndexedPositions(nn.Module):
    """Adds a learned embedding of each position's index: its output depends on where a position is."""

    def __init__(self, dim: int = 16, positions: int = 256) -> None:
        super().__init__()
        self.table = nn.Embedding(positions, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + self.table(torch.arange(x.shape[-2], device=x.device)))


class ActivationObserver(nn.Module):
    """Position-wise output, but a buffer that records the largest input value seen (a quantisation
    observer): written from the input's values."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("largest", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.largest.copy_(torch.maximum(self.largest, x.detach().abs().max()))
        return self.proj(x)


class CountingMLP(SwiGLU):
    """A SwiGLU that counts its calls in a buffer (a step counter, as some schedules keep)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__(dim)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return super().forward(x)


class SharedScale(nn.Module):
    """A position-wise MLP that reads a parameter owned by another module (``owner``)."""

    def __init__(self, owner: nn.Module, dim: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.owner = [owner]  # not registered: the parameter is not the module's own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.owner[0].weight.sum()


class ScalarNoise(nn.Module):
    """Position-wise, with one random scale per call (the same for every position): each position
    run alone draws the same number as the positions together, from the same RNG state."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * (1 + 0.01 * torch.rand((), device=x.device))
