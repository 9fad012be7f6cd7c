"""Run by tests/test_tiling_distributed.py: tiled MLPs under DDP and FSDP2, 2 CPU processes (gloo).

Each rank trains two micro-batches (the first under DDP's ``no_sync``) of its own data with the
MLPs tiled and not, and writes, per strategy, the largest difference of the gradients relative to
the largest gradient entry (after the strategy reduced them) to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tile_models import Block, blocks

from lightmem import apply_tiling


def _batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(2, 37, 16, generator=generator) for _ in range(2)]


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _ddp(rank: int) -> float:
    from torch.nn.parallel import DistributedDataParallel

    model = blocks()
    tiled = copy.deepcopy(model)
    apply_tiling(tiled, "SwiGLU", tile_tokens=8)
    grads = []
    for net in (DistributedDataParallel(model), DistributedDataParallel(tiled)):
        first, second = _batches(rank)
        with net.no_sync():
            net(first).square().mean().backward()
        net(second).square().mean().backward()  # the reducer marks each parameter ready once
        grads.append([p.grad for p in net.module.parameters()])
    return max(_relative(actual, expected) for expected, actual in zip(*grads))


def _fsdp2(rank: int) -> float:
    from torch.distributed.fsdp import fully_shard

    model = blocks()
    tiled = copy.deepcopy(model)
    apply_tiling(tiled, "SwiGLU", tile_tokens=8)
    grads = []
    for net in (model, tiled):
        for module in net:
            if isinstance(module, Block):
                fully_shard(module)
        fully_shard(net)
        for batch in _batches(rank):
            net(batch).square().mean().backward()
        grads.append([p.grad.full_tensor() for p in net.parameters()])
    return max(_relative(actual, expected) for expected, actual in zip(*grads))


def main(rank: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        report = {"ddp": _ddp(rank), "fsdp2": _fsdp2(rank)}
        (out / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    # fork: the ranks start with torch and lightmem already imported (seconds each on 2 cores)
    torch.multiprocessing.start_processes(main, args=(Path(sys.argv[1]),), nprocs=2, start_method="fork")
