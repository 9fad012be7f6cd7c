"""The CUDA estimate counts what torch.cuda.max_memory_allocated counts.

The block sizes follow c10/cuda/CUDACachingAllocator.cpp (round_size, get_allocation_size,
should_split with the default settings); the cuBLAS workspace sizes follow
ATen/cuda/CublasHandlePool.cpp. tests/gpu/test_cuda_allocator_rules_cuda.py checks the same
numbers against the real allocator where a GPU exists.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightmem import estimate_memory
from lightmem.estimate.device.cuda_memory import cuda_block_bytes

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize(
    ("request_bytes", "block_bytes"),
    [
        (0, 0),  # no allocation at all
        (1, 512),  # small requests: at least 512 bytes
        (512, 512),
        (513, 1024),  # a multiple of 512
        (MiB, MiB),  # the largest small request: split off its 2 MiB segment
        (MiB + 1, MiB + 512),  # large pool: a 20 MiB segment, split
        (10 * MiB - 512, 10 * MiB - 512),  # still from a 20 MiB segment
        (10 * MiB, 10 * MiB),  # its own segment, a multiple of 2 MiB: nothing left over
        (24 * MiB + 512 * KiB, 24 * MiB + 512 * KiB),  # 1.5 MiB left in the 26 MiB segment: split
        (25 * MiB - 512, 25 * MiB - 512),  # 1 MiB + 512 B left: split
        (25 * MiB, 26 * MiB),  # exactly 1 MiB left: not split, the block is the whole segment
        (25 * MiB + 1, 26 * MiB),
        (25 * MiB + 512 * KiB, 26 * MiB),
    ],
)
def test_block_bytes_follow_the_caching_allocators_round_and_split_rules(request_bytes, block_bytes):
    assert cuda_block_bytes(request_bytes) == block_bytes


def _linear_25mib() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(1280, 5120, bias=False)  # a 25 MiB float32 weight


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def test_a_25mib_weight_and_its_gradient_count_26mib_each_on_cuda_and_25mib_on_cpu():
    x = torch.randn(8, 1280)
    on_cuda = estimate_memory(_linear_25mib(), x, _loss, optimizer="sgd", device="cuda")
    on_cpu = estimate_memory(_linear_25mib(), x, _loss, optimizer="sgd", device="cpu")
    assert (on_cuda.breakdown["parameters"], on_cuda.breakdown["gradients"]) == (26 * MiB, 26 * MiB)
    assert (on_cpu.breakdown["parameters"], on_cpu.breakdown["gradients"]) == (25 * MiB, 25 * MiB)


def test_forward_and_backward_matmuls_hold_one_cublas_workspace_each():
    x = torch.randn(8, 1280)
    default = estimate_memory(_linear_25mib(), x, _loss, optimizer="sgd", device="cuda")
    hopper = estimate_memory(_linear_25mib(), x, _loss, optimizer="sgd", device="cuda", gpu="h100")
    on_cpu = estimate_memory(_linear_25mib(), x, _loss, optimizer="sgd", device="cpu")
    assert default.breakdown["workspaces"] == 2 * (8 * MiB + 128 * KiB)  # torch's ":4096:2:16:8"
    assert hopper.breakdown["workspaces"] == 2 * 32 * MiB  # ":4096:8" on compute capability 9.0
    assert on_cpu.breakdown["workspaces"] == 0
    # Workspaces are allocated memory: in the peak, which the breakdown sums to; the overhead
    # allowance (context, NCCL) stays apart.
    assert hopper.peak_bytes - default.peak_bytes == 2 * (32 * MiB - 8 * MiB - 128 * KiB)
    assert sum(hopper.breakdown.values()) == hopper.peak_bytes
    assert hopper.total_bytes == hopper.reserved_bytes + (1 << 30)


def test_a_step_without_matmuls_holds_no_cublas_workspace():
    model = nn.Sequential(nn.LayerNorm(256), nn.GELU())
    est = estimate_memory(model, torch.randn(8, 256), lambda m, x: m(x).sum(), device="cuda")
    assert est.breakdown["workspaces"] == 0


def test_the_workspace_row_appears_in_the_report_only_when_there_are_workspaces():
    x = torch.randn(8, 1280)
    on_cuda = estimate_memory(_linear_25mib(), x, _loss, optimizer="sgd", device="cuda").to_text()
    on_cpu = estimate_memory(_linear_25mib(), x, _loss, optimizer="sgd", device="cpu").to_text()
    rows = [line.split() for line in on_cuda.splitlines() if line.startswith("workspaces")]
    assert rows == [["workspaces", "16.25", "MiB"]]
    assert "workspaces" not in on_cpu


def test_an_unknown_gpu_name_is_refused_with_the_accepted_names():
    with pytest.raises(ValueError) as error:
        estimate_memory(_linear_25mib(), torch.randn(8, 1280), _loss, device="cuda", gpu="k80")
    assert str(error.value) == (
        "estimate_memory(gpu=...): unknown GPU 'k80'; accepted: auto, hopper, sm90, h100, h800, h100pcie, h200, "
        "h20, gh200, default, a100, a800, a10, a10g, a30, a40, a6000, l4, l40, l40s, v100, t4, rtx3090, rtx4090"
    )
