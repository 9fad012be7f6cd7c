"""What CUDA's caching allocator counts that the CPU trace cannot see.

- block sizes (``cuda_block_bytes``): the allocator's round_size, segment sizes and split rule
  (c10/cuda/CUDACachingAllocator.cpp), so a 25 MiB weight counts 26 MiB as in
  ``torch.cuda.max_memory_allocated``;
- cuBLAS workspaces (``CublasWorkspaces``): one per cuBLAS handle and stream, allocated through
  the caching allocator at a thread's first matmul and kept for the life of the process.

How the ops of a CUDA step allocate otherwise is in ``cuda_ops``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightmem.devices import HOPPER_NAMES

# -- the caching allocator's block sizes ----------------------------------------------------------
# Constants of c10/cuda/CUDACachingAllocator.cpp (default allocator settings: no
# max_split_size_mb, no roundup_power2_divisions, expandable_segments off).
MIN_BLOCK_BYTES = 512  # kMinBlockSize: every block is a multiple of it
SMALL_REQUEST_BYTES = 1 << 20  # kSmallSize: requests up to 1 MiB come from the small pool
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer: small-pool segments
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer: segment for requests between 1 and 10 MiB
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: from here a request gets its own segment
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: own segments are a multiple of 2 MiB


def round_request_bytes(nbytes: int) -> int:
    """The allocator's ``round_size``: at least 512 bytes, a multiple of 512."""
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def segment_bytes(size: int) -> int:
    """The allocator's ``get_allocation_size``: the segment a rounded request opens with cudaMalloc."""
    if size <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def splits(size: int, block: int) -> bool:
    """The allocator's ``should_split``: whether a free ``block`` serving a rounded request of
    ``size`` bytes gives the rest back to the pool, or is handed out whole.

    The small pool splits off any remainder of 512 bytes or more; the large pool only a remainder
    of more than 1 MiB, so up to 1 MiB of slack stays in the allocated block.
    """
    remaining = block - size
    if size <= SMALL_REQUEST_BYTES:
        return remaining >= MIN_BLOCK_BYTES
    return remaining > SMALL_REQUEST_BYTES


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes ``torch.cuda.memory_allocated`` counts for a request of ``nbytes``, served from a
    new segment.

    Under 10 MiB that is the request rounded up to 512 bytes: the 2 MiB or 20 MiB segment is
    split. From 10 MiB a request opens a segment rounded up to 2 MiB, and keeps all of it when
    splitting would leave 1 MiB or less (25 MiB -> 26 MiB; 24.5 MiB -> 24.5 MiB). A request of
    0 bytes allocates nothing.
    """
    if nbytes == 0:
        return 0
    size = round_request_bytes(nbytes)
    segment = segment_bytes(size)
    return size if splits(size, segment) else segment


# -- cuBLAS workspaces ----------------------------------------------------------------------------
# ATen/cuda/CublasHandlePool.cpp: without CUBLAS_WORKSPACE_CONFIG the workspace is ":4096:2:16:8"
# (2 x 4096 KiB + 8 x 16 KiB), or ":4096:8" (32 MiB) on a device of compute capability 9.0.
DEFAULT_CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
HOPPER_CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 8
_CUBLAS_OPS = {
    getattr(torch.ops.aten, name)
    for name in (
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation",
        "_scaled_mm", "_int_mm",
    )
    if hasattr(torch.ops.aten, name)
}  # fmt: skip


def cublas_workspace_bytes(gpu: str) -> int:
    """One cuBLAS workspace on ``gpu`` (a name of ``devices.GPU_TABLE``)."""
    return HOPPER_CUBLAS_WORKSPACE_BYTES if gpu in HOPPER_NAMES else DEFAULT_CUBLAS_WORKSPACE_BYTES


@dataclass
class CublasWorkspaces:
    """Which cuBLAS workspaces a CUDA step holds, learnt from the ops the trace runs.

    torch keeps one workspace per cuBLAS handle and stream, and a handle per thread: the forward
    (and the optimizer) run on the Python thread, backward on autograd's device thread, so a step
    that multiplies matrices in both holds two. They are allocated at the first step's first
    matmul of each thread and never freed, so a steady-state step has them from its start.
    """

    bytes_each: int
    threads: set[str]

    @classmethod
    def for_gpu(cls, gpu: str) -> CublasWorkspaces:
        return cls(cuda_block_bytes(cublas_workspace_bytes(gpu)), set())

    def see(self, func: Any, phase: str) -> None:
        if func._overloadpacket in _CUBLAS_OPS:
            self.threads.add("autograd" if phase == "backward" else "python")

    @property
    def total_bytes(self) -> int:
        return self.bytes_each * len(self.threads)


def allocation_rounding(device: str) -> Callable[[int], int] | None:
    """The bytes the device's allocator hands out for a request (None: exactly the request)."""
    return cuda_block_bytes if device == "cuda" else None
