"""The estimator's CUDA allocator rules against the real caching allocator: skipped without CUDA.

Each case runs in a fresh process so that no cached block of an earlier test can serve the
request (a reused cached block may be up to 1 MiB larger than a new segment's block).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from lightmem.estimate.device.cuda_memory import cublas_workspace_bytes, cuda_block_bytes

MiB = 1 << 20
SIZES = (1, 513, MiB, MiB + 1, 10 * MiB - 512, 10 * MiB, 24 * MiB + MiB // 2, 25 * MiB - 512, 25 * MiB, 25 * MiB + 1)

_SCRIPT = r"""
import json, sys, torch
sizes = json.loads(sys.argv[1])
blocks = []
for size in sizes:
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    x = torch.empty(size, dtype=torch.uint8, device="cuda")
    blocks.append(torch.cuda.memory_allocated() - before)
    del x
torch.cuda.empty_cache()
a = torch.randn(64, 64, device="cuda", requires_grad=True)
b = torch.randn(64, 64, device="cuda")
before = torch.cuda.memory_allocated()
y = a @ b  # the Python thread's first matmul: its workspace
forward = torch.cuda.memory_allocated() - before - 64 * 64 * 4
y.sum().backward()  # autograd's device thread: a second handle, a second workspace
major, minor = torch.cuda.get_device_capability()
print(json.dumps({"blocks": blocks, "forward_workspace": forward, "sm": f"{major}{minor}"}))
"""


def test_block_sizes_and_cublas_workspace_match_the_real_allocator():
    env = {k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(SIZES)], env=env, capture_output=True, text=True, check=True
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["blocks"] == [cuda_block_bytes(size) for size in SIZES]
    gpu = "hopper" if measured["sm"] == "90" else "default"
    assert measured["forward_workspace"] == cuda_block_bytes(cublas_workspace_bytes(gpu))
