"""Small models of realistic shape for the test suite (fast on 2 CPU cores)."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(dim // self.heads)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = self.dropout(scores.softmax(dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(batch, seq, dim)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, depth: int = 4, heads: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def gpt_hidden_states(model: TinyGPT, tokens: torch.Tensor) -> torch.Tensor:
    """What ``model``'s head reads: its forward without ``lm_head``."""
    x = model.embed(tokens) + model.pos[:, : tokens.shape[1]]
    for block in model.blocks:
        x = block(x)
    return model.ln_f(x)


def chunked_gpt_loss(model: TinyGPT, tokens: torch.Tensor, chunk_rows: int | None = 32) -> torch.Tensor:
    """``gpt_loss`` with ``lightmem.linear_cross_entropy``: the logits never whole."""
    import lightmem

    hidden = gpt_hidden_states(model, tokens[:, :-1])
    return lightmem.linear_cross_entropy(hidden, model.lm_head.weight, tokens[:, 1:], chunk_rows=chunk_rows)


class ConvNet(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
            nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


class LSTMTagger(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 32, hidden: int = 64, tags: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        return self.out(hidden)


def make_case(name: str, seed: int = 0) -> tuple[nn.Module, callable]:
    """A fresh model and a ``loss(model)`` closure with fixed inputs, by name."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "transformer":
        model = TinyGPT()
        tokens = torch.randint(0, 128, (4, 33), generator=generator)
        return model, lambda m: gpt_loss(m, tokens)
    if name == "cnn":
        model = ConvNet()
        images = torch.randn(8, 3, 16, 16, generator=generator)
        labels = torch.randint(0, 10, (8,), generator=generator)
        return model, lambda m: F.cross_entropy(m(images), labels)
    if name == "lstm":
        model = LSTMTagger()
        tokens = torch.randint(0, 100, (4, 20), generator=generator)
        tags = torch.randint(0, 8, (4, 20), generator=generator)

        def lstm_loss(m: nn.Module) -> torch.Tensor:
            # oneDNN has no bfloat16 LSTM on every CPU; the native kernel runs it under autocast.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.backends.mkldnn.flags(enabled=False):
                    return F.cross_entropy(m(tokens).reshape(-1, 8), tags.reshape(-1))

        return model, lstm_loss
    raise KeyError(name)


CASES = ("transformer", "cnn", "lstm")
