"""Tiny models and a Lightning module for the optimizer-offload exactness tests."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw-decay": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def tiny_net() -> nn.Module:
    """Linear, BatchNorm (running statistics: buffers), Dropout (RNG), Linear."""
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))


def regression_loader(batches: int = 8, batch_size: int = 4, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batches * batch_size, 8, generator=generator)
    targets = torch.randn(batches * batch_size, 1, generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=batch_size, shuffle=False)


class LitTiny(pl.LightningModule):
    def __init__(self, optimizer: str = "adamw-decay", manual: bool = False) -> None:
        super().__init__()
        self.net = tiny_net()
        self.optimizer_name = optimizer
        self.manual = manual
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs).float(), targets.to(torch.float32))
        if self.manual:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            optimizer.step()
            return None
        return loss

    def configure_optimizers(self):
        optimizer = OPTIMIZERS[self.optimizer_name](self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)}
