"""A small GPT-like LightningModule and a synthetic data module, shared by the examples."""

from __future__ import annotations

import math

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(batch, seq, dim)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class GPT(pl.LightningModule):
    def __init__(
        self, vocab: int = 512, dim: int = 256, depth: int = 6, heads: int = 8, seq: int = 128,
        dropout: float = 0.1, lr: float = 3e-4,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) / math.sqrt(dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(tokens))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the output head reads: with ``lightmem.linear_cross_entropy`` the loss starts here."""
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def _loss(self, batch: tuple[torch.Tensor]) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class CountingData(pl.LightningDataModule):
    """Sequences that count upward modulo the vocabulary: learnable, so the loss visibly falls."""

    def __init__(self, vocab: int = 512, seq: int = 128, batch_size: int = 16, samples: int = 512) -> None:
        super().__init__()
        self.vocab, self.seq, self.batch_size, self.samples = vocab, seq, batch_size, samples

    def _dataset(self, seed: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, self.vocab, (self.samples, 1), generator=generator)
        return TensorDataset((starts + torch.arange(self.seq + 1)) % self.vocab)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(1), batch_size=self.batch_size)
