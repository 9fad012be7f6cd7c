"""What the training device can give this process: the budget ``plan="auto"`` plans for when no
``device_budget`` is given, and the allocator peak its prediction is checked against.

One rule, used by ``LightMem(plan="auto")`` at fit start and by ``lightmem estimate --plan`` without
``--budget``: the device's free memory (what no process holds: other processes and every CUDA
context, ours included, are already out of it), plus what this process's caching allocator holds
(its own to reuse: the model's parameters are already there at fit start), less
``FRAGMENTATION_MARGIN`` of that sum for the allocator's fragmentation. The CUDA context is already
out of that budget, so the plans made for it set aside only what may still be allocated outside the
caching allocator (``overhead_for_measured_budget``), not the planner's default allowance, which
counts the context again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lightmem.config import format_bytes

FRAGMENTATION_MARGIN = 0.05
"""Share of the usable device memory left unplanned: the caching allocator rounds blocks and splits
them, so a step whose tensors need all of it fails to allocate before reaching it."""


NCCL_ALLOWANCE_BYTES = 512 << 20
"""What a plan for a measured budget sets aside with several ranks: NCCL allocates its buffers
outside the caching allocator as collectives first need them, some after fit start. An allowance,
not a figure measured here (no GPU)."""


def overhead_for_measured_budget(world_size: int) -> int:
    """The ``overhead_bytes`` of a plan for a measured budget: nothing on one device (its context is
    out of the free memory measured), ``NCCL_ALLOWANCE_BYTES`` with several ranks."""
    return NCCL_ALLOWANCE_BYTES if world_size > 1 else 0


class DeviceMemory(Protocol):
    """A training device's memory as this process sees it."""

    source: str
    """Where the figures come from, for the fit-start line: ``torch.cuda.mem_get_info on cuda:0``."""

    def free_and_total_bytes(self) -> tuple[int, int]:
        """Bytes no process holds, and the device's capacity."""

    def held_bytes(self) -> int:
        """Bytes this process's caching allocator holds (reserved), free for its own reuse."""

    def peak_allocated_bytes(self) -> int:
        """The allocator's peak of allocated bytes (``max_memory_allocated``: since the process
        started or the user's last reset; lightmem never resets it, and measures a training batch
        by how far it raises it: ``lightmem.auto_plan``)."""


class CudaMemory:
    """A CUDA device, read through ``torch.cuda`` (host-side reads; none synchronises)."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.source = f"torch.cuda.mem_get_info on cuda:{self.index}"

    def free_and_total_bytes(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.index)
        return int(free), int(total)

    def held_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.index))

    def peak_allocated_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.index))


_simulated: DeviceMemory | None = None
"""Set only by ``lightmem.testing.device.simulated_device``: the device every fit and the CLI then see."""


def training_device_memory(device: torch.device) -> DeviceMemory | None:
    """The memory of ``device`` (a simulated one in tests); None where it is not a CUDA device."""
    if _simulated is not None:
        return _simulated
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaMemory(device)
    return None


def memory_to_measure(
    device: torch.device, *, flag: str, budget_flag: str, subject: str, device_named: str, example: str
) -> DeviceMemory:
    """The memory of ``device``, to measure a budget from: the one check and message of
    ``LightMem(plan="auto")`` and ``lightmem estimate --plan`` without a budget.

    Args:
        flag: what asked for a plan, as the user spelled it (``--plan``).
        budget_flag: the flag that gives a budget (``--budget``).
        subject: what plans, in the message (``'auto'``, ``it``).
        device_named: how the user named the device (``the training device``, ``--device``).
        example: a call with a budget, e.g. ``--budget 24GiB``.

    Raises:
        ValueError: ``device`` is not a CUDA device this process can read; the message names it,
            says whether there is a CUDA device here, and what to pass.
    """
    memory = training_device_memory(device)
    if memory is None:
        why = "" if torch.cuda.is_available() else " (no CUDA device here)"
        raise ValueError(
            f"{flag}: without {budget_flag}, {subject} plans for the memory "
            f"the CUDA device can give this process, and {device_named} is {device.type!r}{why}; pass the "
            f"budget to plan for, e.g. {example}"
        )
    return memory


@dataclass(frozen=True)
class DeviceBudget:
    """What the device can give this process, measured once, and how it was reached."""

    budget_bytes: int
    free_bytes: int
    held_bytes: int
    total_bytes: int
    margin_bytes: int
    source: str

    def describe(self) -> str:
        """``18.05 GiB (cuda:0 ...: 18.50 GiB free + 500.00 MiB held by this process, less 5% ...)``."""
        return (
            f"{format_bytes(self.budget_bytes)} ({self.source}: {format_bytes(self.free_bytes)} free of "
            f"{format_bytes(self.total_bytes)} + {format_bytes(self.held_bytes)} held by this process, less "
            f"{FRAGMENTATION_MARGIN:.0%} ({format_bytes(self.margin_bytes)}) for allocator fragmentation)"
        )


def measure_device_budget(memory: DeviceMemory) -> DeviceBudget:
    """The budget rule (module docstring), read now."""
    free, total = memory.free_and_total_bytes()
    held = memory.held_bytes()
    usable = free + held
    margin = int(usable * FRAGMENTATION_MARGIN)
    return DeviceBudget(usable - margin, free, held, total, margin, memory.source)
