"""LightningModules written the ways Lightning's docs and users write them, on either package:
one per idiom the planner's dry run must run without leaving a trace (issue 56).

Each is a TinyGPT (3 blocks) with dropout, trained on [4, 33] token batches. Their steps also
draw from ``random`` and NumPy (a trace there would change what the next real step draws), keep
objects on the module, and log.
"""

from __future__ import annotations

import functools
import random
import types

import numpy as np
import torch
import torchmetrics
import torch.nn.functional as F
from models import TinyGPT
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH, SEQ = 4, 33


def loader(batches: int = 4) -> DataLoader:
    tokens = torch.randint(0, 128, (batches * BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    return DataLoader(TensorDataset(tokens), batch_size=BATCH, shuffle=False)


class _Body:
    """The network and what every idiom's step shares."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT(depth=3)
        self.drop = nn.Dropout(0.1)
        self.losses: list[torch.Tensor] = []
        self.seen = 0
        self.draws: list[float] = []

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.model.embed(tokens[:, :-1]))
        x = x + self.model.pos[:, : x.shape[1]]
        for block in self.model.blocks:
            x = block(x)
        logits = self.model.lm_head(self.model.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def remember(self, loss: torch.Tensor, tokens: torch.Tensor) -> None:
        self.losses.append(loss.detach())
        self.seen += len(tokens)
        self.draws.append(random.random() + float(np.random.rand()))


class Automatic(_Body):
    """The issue's module: optimizer and scheduler kept on the module, a list and a counter."""

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.loss(tokens)
        self.remember(loss, tokens)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        self.my_opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.my_opt, 1, gamma=0.5)
        return {"optimizer": self.my_opt, "lr_scheduler": {"scheduler": self.sched, "interval": "step"}}


class ReturnsDict(Automatic):
    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.loss(tokens)
        self.remember(loss, tokens)
        return {"loss": loss, "tokens": len(tokens)}


class SkipsWithNone(Automatic):
    """Every other batch is skipped by returning None (the planner sees batch 0: it trains)."""

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.loss(tokens)
        self.remember(loss, tokens)
        return None if batch_idx % 2 else loss


class DataloaderIter(Automatic):
    def training_step(self, dataloader_iter):
        batch, batch_idx, _ = next(dataloader_iter)
        (tokens,) = batch
        loss = self.loss(tokens)
        self.remember(loss, tokens)
        return loss


class Lbfgs(Automatic):
    def configure_optimizers(self):
        self.my_opt = torch.optim.LBFGS(self.parameters(), lr=0.05, max_iter=3, history_size=4)
        return self.my_opt


class ReadsValues(Automatic):
    """A step that reads values: a torchmetrics metric updated and logged, ``.item()``, a NaN check,
    ``torch.allclose``, boolean-mask indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.accuracy = torchmetrics.classification.BinaryAccuracy()
        self.total = 0.0

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.loss(tokens)
        if torch.isnan(loss):
            return None
        assert torch.allclose(loss, loss)
        odd = tokens[:, 1:] % 2
        scores = self.model.embed(tokens[:, 1:])[..., 0].sigmoid()
        self.accuracy(scores, odd)
        self.log("accuracy", self.accuracy)
        picked = scores[odd.bool()]
        self.total += loss.item() + picked.sum().item()
        self.remember(loss, tokens)
        return loss


class ManualOne(_Body):
    """Manual optimization as the docs write it: zero_grad, manual_backward, step, the scheduler."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.loss(tokens)
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        self.remember(loss, tokens)
        self.log("train_loss", loss)

    def configure_optimizers(self):
        self.my_opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return [self.my_opt], [torch.optim.lr_scheduler.StepLR(self.my_opt, 1, gamma=0.9)]


class ManualTwo(_Body):
    """Two optimizers in turns (a GAN's shape): the body, then the head; toggle_optimizer;
    a backward that retains the graph for a second one; the docs' check that zero_grad cleared the
    gradients."""

    toggles = True
    """MemTracker (``measure_lightning_step``) cannot follow toggled parameters: measured without."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def toggle_optimizer(self, optimizer):
        if self.toggles:
            super().toggle_optimizer(optimizer)

    def untoggle_optimizer(self, optimizer):
        if self.toggles:
            super().untoggle_optimizer(optimizer)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        body, head = self.optimizers()
        self.toggle_optimizer(body)
        body.zero_grad()
        assert self.model.blocks[0].attn.qkv.weight.grad is None, "zero_grad left a gradient"
        loss = self.loss(tokens)
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(0.5 * loss)
        body.step()
        self.untoggle_optimizer(body)
        self.toggle_optimizer(head)
        head.zero_grad()
        loss2 = self.loss(tokens)
        self.manual_backward(loss2)
        head.step()
        self.untoggle_optimizer(head)
        self.remember(loss2, tokens)

    def configure_optimizers(self):
        head = list(self.model.lm_head.parameters()) + list(self.model.ln_f.parameters())
        ids = {id(p) for p in head}
        body = [p for p in self.parameters() if id(p) not in ids]
        return torch.optim.SGD(body, lr=0.01), torch.optim.Adam(head, lr=1e-3)


IDIOMS = {
    "automatic": Automatic, "dict": ReturnsDict, "none": SkipsWithNone, "dataloader_iter": DataloaderIter,
    "lbfgs": Lbfgs, "manual_one": ManualOne, "manual_two": ManualTwo, "reads_values": ReadsValues,
}  # fmt: skip


@functools.cache
def idiom_class(name: str, package: types.ModuleType) -> type:
    return type(IDIOMS[name].__name__, (IDIOMS[name], package.LightningModule), {})
