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
