"""Activation offload in a plain PyTorch loop.

    python examples/offload_plain.py

On a GPU the saved activations of the transformer leave device memory during forward; on a
CPU-only machine ``devices=("cpu",)`` drives the same path (host to host), so you can see the
statistics anywhere.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from lightmem import offload_activations


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, batch_first=True), num_layers=4
    ).to(device)
    head = nn.Linear(256, 10).to(device)
    optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-3)
    offload = offload_activations(model, min_bytes="256KiB", devices=(device,), host_budget="2GiB")
    for step in range(int(os.environ.get("LIGHTMEM_EXAMPLE_STEPS", "3"))):
        x = torch.randn(16, 128, 256, device=device)
        y = torch.randint(0, 10, (16,), device=device)
        with offload:
            loss = F.cross_entropy(head(model(x).mean(dim=1)), y)
        loss.backward()  # reloads run here, ahead of need
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    print(offload.stats)


if __name__ == "__main__":
    main()
