"""Run by tests/test_optimizer_offload_param_groups.py: plain DDP on 2 CPU processes (gloo) with
``no_sync`` accumulation, each variant without lightmem and with ``offload_optimizer``:

- ``plain``: a ``no_sync`` backward, a synchronised one, the step;
- ``add_mid``: a param group added between the two (its ``no_sync`` gradient must stay for DDP);
- ``unfreeze``: a parameter frozen at the start unfrozen after the first step;
- ``zero_mid``: ``zero_grad()`` after the ``no_sync`` backward (its gradients discarded).

Writes ``report.json``: per variant, whether each rank equals DDP without lightmem bitwise, and
whether the ranks agree."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from process_group import leave
from torch import nn

VARIANTS = ("plain", "add_mid", "unfreeze", "zero_mid")


def run(rank: int, variant: str, offload: bool) -> list[torch.Tensor]:
    from lightmem import offload_optimizer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    if variant == "unfreeze":
        net[0].bias.requires_grad_(False)
    ddp = nn.parallel.DistributedDataParallel(net)
    params = list(net[1].parameters()) if variant == "add_mid" else list(net.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.1, **({} if offload else {"fused": True}))
    handle = offload_optimizer(ddp, optimizer, devices=("cpu",)) if offload else None
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(3):
        if variant == "unfreeze" and step == 1:
            net[0].bias.requires_grad_(True)
        with ddp.no_sync():
            ddp(torch.randn(2, 4, generator=generator)).sum().backward()
        if variant == "zero_mid":
            optimizer.zero_grad()
        if variant == "add_mid" and step == 0:
            optimizer.add_param_group({"params": list(net[0].parameters())})
        ddp(torch.randn(2, 4, generator=generator)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    if handle is not None:
        handle.close()
    return [param.detach().clone() for param in net.parameters()]


def worker(rank: int, port: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    report = {}
    for variant in VARIANTS:
        expected, actual = run(rank, variant, False), run(rank, variant, True)
        equal = all(torch.equal(a, b) for a, b in zip(expected, actual))
        gathered: list = [None, None]
        dist.all_gather_object(gathered, ([t.tolist() for t in actual], equal))
        report[variant] = {"equal_per_rank": [g[1] for g in gathered], "ranks_agree": gathered[0][0] == gathered[1][0]}
    if rank == 0:
        (Path(out) / "report.json").write_text(json.dumps(report))
    leave()  # the DDP wrappers' reducers freed first: gloo's threads must not outlive the group


if __name__ == "__main__":
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = str(sock.getsockname()[1])
    mp.start_processes(worker, args=(free_port, sys.argv[1]), nprocs=2, start_method="spawn")
