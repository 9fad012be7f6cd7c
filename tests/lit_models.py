"""Lightning modules for the callback tests."""

from __future__ import annotations

import functools
import types

import pytorch_lightning as pl
import torch
from models import TinyGPT, gpt_loss
from torch.utils.data import DataLoader, TensorDataset


def token_loader(batches: int = 6, batch_size: int = 4, seq: int = 33, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (batches * batch_size, seq), generator=generator)
    return DataLoader(TensorDataset(tokens), batch_size=batch_size, shuffle=False)


class _LitGPTBody:
    """LitGPT's methods, on the LightningModule of either package (``lit_gpt_class``)."""

    def __init__(self, depth: int = 3, manual: bool = False, skip_every: int = 0, build_in_configure_model: bool = False) -> None:
        super().__init__()
        self.depth = depth
        self.manual = manual
        self.skip_every = skip_every
        self.automatic_optimization = not manual
        self.model = None if build_in_configure_model else TinyGPT(depth=depth)
        self.hooks_seen: dict[str, list] = {"train": [], "validation": [], "predict": []}

    def configure_model(self) -> None:
        if self.model is None:
            self.model = TinyGPT(depth=self.depth)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _record(self, phase: str) -> None:
        self.hooks_seen[phase].append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)

    def training_step(self, batch, batch_idx):
        self._record("train")
        (tokens,) = batch
        if self.skip_every and batch_idx % self.skip_every == self.skip_every - 1:
            return None
        loss = gpt_loss(self.model, tokens)
        if self.manual:
            optimizer = self.optimizers()
            optimizer.zero_grad(set_to_none=True)
            self.manual_backward(loss)
            optimizer.step()
            self._record("train")  # after backward: hooks must be gone
            return None
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self._record("validation")
        (tokens,) = batch
        self.log("val_loss", gpt_loss(self.model, tokens))

    def predict_step(self, batch, batch_idx):
        self._record("predict")
        return self.model(batch[0][:, :-1]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LitGPT(_LitGPTBody, pl.LightningModule):
    pass


@functools.cache
def lit_gpt_class(package: types.ModuleType) -> type:
    """LitGPT on ``package.LightningModule`` (``pytorch_lightning`` or ``lightning.pytorch``), one class per package."""
    return LitGPT if package is pl else type("LitGPT", (_LitGPTBody, package.LightningModule), {})


def cpu_trainer(callbacks=(), package=pl, **kwargs):
    """A quiet one-CPU Trainer of ``package`` (``pytorch_lightning`` or ``lightning.pytorch``) for
    4 steps; ``kwargs`` override any of its settings."""
    defaults = dict(
        accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    defaults.update(kwargs)
    return package.Trainer(callbacks=list(callbacks), **defaults)
