"""On a GPU, a tensor an op saves and then writes (RReLU's noise) is copied after the writing
kernel: skipped where CUDA is not available (written blind: no GPU on the development machines)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from lightmem import offload_activations  # noqa: E402


def _grads(offload: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.RReLU(), nn.Linear(4096, 8)).cuda().train()
    x = torch.randn(2048, 1024, device="cuda")  # RReLU's noise: 32 MiB, one copy on the side stream
    torch.manual_seed(1)
    if offload:
        with offload_activations(model, min_bytes="1MiB", devices=("cuda",)) as off:
            loss = model(x).square().mean()
        assert off.stats.offloaded_bytes >= 2048 * 4096 * 4
    else:
        loss = model(x).square().mean()
    loss.backward()
    torch.cuda.synchronize()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_rrelu_noise_is_copied_after_the_kernel_that_writes_it():
    expected, actual = _grads(offload=False), _grads(offload=True)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
