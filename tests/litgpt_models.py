"""LitGPT's own models as its users build them (``pip install litgpt``): ``Config.from_name`` of a
family with small overrides, nothing downloaded, and the losses LitGPT's scripts compute."""

from __future__ import annotations

import functools
import types

import pytorch_lightning as pl
import torch
from litgpt.config import Config
from litgpt.model import GPT
from litgpt.utils import chunked_cross_entropy
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 512, 32
SMALL = {"n_layer": 2, "n_embd": 64, "n_head": 4, "padded_vocab_size": VOCAB, "block_size": 128}
FAMILIES = {
    "pythia": ("pythia-14m", {}),
    "llama3": ("Llama-3.2-1B", {"n_query_groups": 2, "intermediate_size": 128}),  # grouped-query attention
    "gemma2": ("gemma-2-2b", {"n_query_groups": 2, "head_size": 16, "intermediate_size": 128}),  # soft-capping
    "phi2": ("phi-2", {}),  # a head with a bias
}
"""Each family's smallest model's config with two layers of width 64 (Gemma-2: its own head size,
256, would be 4 x 256 wide heads of a width-64 model)."""


def litgpt_model(family: str, seed: int = 0, **overrides) -> GPT:
    name, family_overrides = FAMILIES[family]
    torch.manual_seed(seed)
    return GPT(Config.from_name(name, **{**SMALL, **family_overrides, **overrides}))


def tokens(batch: int = 4, seq: int = SEQ, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Token rows of ``seq + 1``: the inputs and, shifted by one, the targets."""
    return torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def pretrain_loss(model: GPT, data: torch.Tensor) -> torch.Tensor:
    """LitGPT's pretraining step (litgpt/pretrain.py): whole logits, the cross-entropy in row chunks."""
    input_ids, targets = data[:, :-1], data[:, 1:]
    logits = model(input_ids)
    return chunked_cross_entropy(logits, targets)


def finetune_loss(model: GPT, data: torch.Tensor) -> torch.Tensor:
    """LitGPT's fine-tuning step (litgpt/finetune/full.py): the head itself in chunks of positions."""
    logits = model(data, lm_head_chunk_size=16)
    logits[-1] = logits[-1][..., :-1, :]
    return chunked_cross_entropy(logits, data[..., 1:])


def token_loader(batches: int = 4, batch: int = 4, seq: int = SEQ) -> DataLoader:
    return DataLoader(TensorDataset(tokens(batches * batch, seq)), batch_size=batch, shuffle=False)


class _LitBody:
    def __init__(self, family: str = "pythia", **overrides) -> None:
        super().__init__()
        self.model = litgpt_model(family, **overrides)

    def training_step(self, batch, batch_idx):
        return pretrain_loss(self.model, batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class LitLitGPT(_LitBody, pl.LightningModule):
    """A LitGPT ``GPT`` in a LightningModule, as LitGPT's users write one (``self.model``)."""


@functools.cache
def lit_litgpt_class(package: types.ModuleType) -> type:
    """``LitLitGPT`` on ``package.LightningModule`` (``pytorch_lightning`` or ``lightning.pytorch``)."""
    return LitLitGPT if package is pl else type("LitLitGPT", (_LitBody, package.LightningModule), {})
