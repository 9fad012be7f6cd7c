"""A deep conv net whose parameters fit a 2 GB GPU but whose training step does not: why does
training need so much more memory than the parameters, and what would fit?

    python examples/deep_convnet.py

The network has 206.5 M parameters (826 MB in float32), a size a user once met on a 2 GB GTX 960:
the parameters fit, yet the step ran out of memory. ``estimate_memory`` shows why before any real
step: gradients are as large as the parameters, and the optimizer and the workspace need the rest;
with ``offload_optimizer`` (gradients, optimizer state and step on the host) it fits. It then trains
a few real steps on the CPU with LightMem checkpointing the conv stack.
"""

from __future__ import annotations

import os
import sys

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightmem import LightMem, estimate_memory


def conv(cin: int, cout: int) -> nn.Module:
    return nn.Conv2d(cin, cout, 3, padding=1)


class DeepConvNet(pl.LightningModule):
    """The Keras model of the question, layer for layer (channels first)."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [conv(1, 256), nn.MaxPool2d(2), conv(256, 512), nn.MaxPool2d(2), conv(512, 1024)]
        layers += [conv(1024, 1024) for _ in range(21)]
        layers += [nn.MaxPool2d(2), conv(1024, 256), conv(256, 32), nn.MaxPool2d(2), nn.Flatten()]
        layers += [nn.Linear(32, 4), nn.Linear(4, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    pl.seed_everything(0)
    with torch.device("meta"):  # no real memory for the estimate
        meta_model = DeepConvNet()
    params = sum(p.numel() for p in meta_model.parameters())
    print(f"parameters: {params:,} ({params * 4 / 1e6:.0f} MB in float32)")
    batch = (torch.rand(1, 1, 16, 16), torch.rand(1, 1))
    estimate = estimate_memory(meta_model, batch, device="cuda", budget="2GiB")
    estimate.print()
    # What the advice proposes first: only the parameters on the device, the rest on the host.
    offloaded = estimate_memory(meta_model, batch, device="cuda", budget="2GiB", offload_optimizer=True)
    print(
        f"With LightMem(offload_optimizer=True): {offloaded.total_bytes / 2**30:.2f} GiB on the device "
        f"({'fits' if offloaded.fits else 'does not fit'} 2 GiB), "
        f"{offloaded.scenarios['offload_optimizer'].host_bytes / 2**30:.2f} GiB on the host"
    )

    steps = int(os.environ.get("LIGHTMEM_EXAMPLE_STEPS", "4"))
    data = TensorDataset(torch.rand(32, 1, 16, 16), torch.rand(32, 1))
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_model_summary=False, callbacks=[LightMem(checkpoint=["Conv2d"], checkpoint_every=4)],
    )  # fmt: skip
    trainer.fit(DeepConvNet(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    sys.exit(main())
