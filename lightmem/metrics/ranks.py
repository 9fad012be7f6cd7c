"""The maximum of host-side figures over the ranks of a distributed job, without touching a GPU.

Memory figures are Python floats read on the host. Reducing them as a CUDA tensor (NCCL) would
need a copy back whose ``.tolist()`` waits for every kernel queued so far: a full device sync on
each logged step. They are reduced as a CPU tensor over gloo instead: the default group when it
has a CPU backend, otherwise one gloo group created on first use (every rank logs the same steps,
so every rank takes part in creating it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class RankMax:
    """``rank_max(values)``: the element-wise maximum of ``values`` over all ranks.

    Returns ``values`` unchanged when no process group is initialised or it has one rank.
    """

    def __init__(self) -> None:
        self._group: Any = None
        self._world: Any = None  # the default group the gloo group was made for

    def __getstate__(self) -> dict[str, Any]:
        return {"_group": None, "_world": None}  # process groups do not travel (ddp_spawn)

    def __call__(self, values: Sequence[float]) -> list[float]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return list(values)
        if self._group is None or self._world is not dist.group.WORLD:  # a new job, a new group
            self._world = dist.group.WORLD
            backend = str(dist.get_backend())
            self._group = dist.group.WORLD if "gloo" in backend else dist.new_group(backend="gloo")
        local = torch.tensor(list(values), dtype=torch.float64, device="cpu")  # no device sync
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._group)
        return local.tolist()
