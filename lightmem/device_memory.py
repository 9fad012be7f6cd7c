"""What the training device can give this process: the budget ``plan="auto"`` plans for when no
``device_budget`` is given, the caching allocator's view of a step (reserved memory, expandable
segments), and the allocator peaks a plan's prediction is checked against.

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

import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lightmem.config import format_bytes
from lightmem.devices import DeviceSpeeds, measure_device_speeds

_ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_expandable_set_here = False


def allocator_configured_by_user() -> str | None:
    """``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) as set in the environment, or None."""
    for name in _ALLOC_CONF_VARIABLES:
        value = os.environ.get(name)
        if value:
            return f"{name}={value}"
    return None


def expandable_segments_on() -> bool:
    """Whether this process's CUDA caching allocator uses expandable segments: set in the
    environment, or by lightmem (``use_expandable_segments``)."""
    if _expandable_set_here:
        return True
    conf = (allocator_configured_by_user() or "").lower().replace(" ", "")
    return "expandable_segments:true" in conf


def _allocator_settings_setter() -> Any:
    """torch's setter of the caching allocator's settings at run time (its name moved between
    releases), or None in a build without one."""
    for name in ("_accelerator_setAllocatorSettings", "_cuda_cudaCachingAllocator_set_allocator_settings"):
        setter = getattr(torch._C, name, None)
        if setter is not None:
            return setter
    return None


def use_expandable_segments() -> str:
    """Turn expandable segments on for this process's CUDA caching allocator, unless the user
    configured the allocator; returns the line to print at fit start. Segments made before stay
    as they were; every segment from now on can grow.

    Nothing changes when ``PYTORCH_CUDA_ALLOC_CONF`` is set (the user's settings win) or the
    torch build has no CUDA allocator to configure.
    """
    global _expandable_set_here
    configured = allocator_configured_by_user()
    if configured is not None:
        state = "on" if expandable_segments_on() else "off"
        return (
            f"lightmem: the CUDA allocator is configured by {configured}: lightmem leaves it as it is "
            f"(expandable segments {state}; plans replay the allocator so)"
        )
    setter = _allocator_settings_setter()
    if setter is None or not torch.cuda.is_available():
        return ""
    try:
        setter("expandable_segments:True")
    except (RuntimeError, ValueError) as error:  # a build or platform without them
        return f"lightmem: the CUDA allocator's expandable segments could not be turned on ({error}): plans " \
            "replay the allocator without them"
    _expandable_set_here = True
    return (
        "lightmem: plan='auto' turned on the CUDA allocator's expandable segments "
        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for this process; plans replay the allocator with "
        "them). Set PYTORCH_CUDA_ALLOC_CONF yourself to choose."
    )

FRAGMENTATION_MARGIN = 0.05
"""Share of the usable device memory left unplanned: the caching allocator rounds blocks and splits
them, so a step whose tensors need all of it fails to allocate before reaching it."""


OVERHEAD_GRAIN_BYTES = 64 << 20
"""The memory outside the allocator is set aside in steps of this (what it measures moves by a few
MiB between reads: cuBLAS and cuDNN handles, the driver's own)."""


def outside_bytes(memory: DeviceMemory) -> int:
    """Device memory in use outside this process's caching allocator: its CUDA context and the
    libraries' handles (and any other process's memory)."""
    free, total = memory.free_and_total_bytes()
    return max(0, total - free - memory.held_bytes())


def overhead_for_given_budget(memory: DeviceMemory | None, default_bytes: int) -> int | None:
    """The ``overhead_bytes`` of a plan for a given ``device_budget``: what the device holds outside
    this process's caching allocator now (its CUDA context, libraries' handles), rounded up to
    ``OVERHEAD_GRAIN_BYTES`` and never more than ``default_bytes`` (the planner's 1 GiB: memory other
    processes hold is no part of this one's budget); None without a device to read (the default).
    At fit start the H100 held 0.51 GiB outside the allocator, the H200 0.74 GiB (torch 2.11, CUDA 13)."""
    if memory is None:
        return None
    outside = -(-outside_bytes(memory) // OVERHEAD_GRAIN_BYTES) * OVERHEAD_GRAIN_BYTES
    return min(outside, default_bytes)


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
        started or the user's last reset; lightmem resets it only where its own measure of the
        device raised it, ``measured_speeds``, and measures a training batch by how far it raises
        it: ``lightmem.auto_plan``)."""

    def peak_reserved_bytes(self) -> int:
        """The allocator's peak of reserved bytes (``max_memory_reserved``), read the same way."""

    def alloc_retries(self) -> int:
        """How often the allocator released its cache to serve a request (``num_alloc_retries``):
        a reserved peak with retries was held under the device's limit, not reached freely."""

    def speeds(self) -> DeviceSpeeds | None:
        """The device's speeds (measured, or from the table), or None."""

    def reset_peaks(self) -> None:
        """Set the allocator's peaks to what it holds now (``reset_peak_memory_stats``)."""

    def step_clock(self) -> Any:
        """A clock that times a step on the device (``start()``, then ``stop()`` -> seconds or
        None when not ready), or None."""

    def block_clock(self) -> Any:
        """A clock that times blocks within a step on the device (``CudaBlockClock``), or None."""


class CudaStepClock:
    """Times a training step on the current CUDA stream with events; ``stop`` reads the previous
    step's time, so it never waits for the GPU."""

    def __init__(self) -> None:
        self._pending: tuple[Any, Any] | None = None
        self._start: Any = None

    def start(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> float | None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        previous, self._pending = self._pending, (self._start, end)
        if previous is None or not previous[1].query():
            return None
        return previous[0].elapsed_time(previous[1]) / 1e3


class CudaBlockClock:
    """Times each block's forward on the current CUDA stream with a pair of events: ``enter(name)``
    and ``exit(name)`` around it, ``end_step()`` after the step. ``read()`` returns the seconds per
    block (summed over its calls) of the oldest step whose events have all completed, or None: it
    never waits for the GPU."""

    def __init__(self) -> None:
        self._open: dict[str, Any] = {}
        self._step: list[tuple[str, Any, Any]] = []
        self._done: list[list[tuple[str, Any, Any]]] = []

    def enter(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._open[name] = event

    def exit(self, name: str) -> None:
        start = self._open.pop(name, None)
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._step.append((name, start, end))

    def end_step(self) -> None:
        self._open.clear()
        if self._step:
            self._done.append(self._step)
        self._step = []

    def read(self) -> dict[str, float] | None:
        if not self._done or not self._done[0][-1][2].query():
            return None
        seconds: dict[str, float] = {}
        for name, start, end in self._done.pop(0):
            seconds[name] = seconds.get(name, 0.0) + start.elapsed_time(end) / 1e3
        return seconds


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

    def peak_reserved_bytes(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.index))

    def alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.index).get("num_alloc_retries", 0))

    def speeds(self) -> DeviceSpeeds:
        return measure_device_speeds(torch.device("cuda", self.index))

    def reset_peaks(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def step_clock(self) -> CudaStepClock:
        return CudaStepClock()

    def block_clock(self) -> CudaBlockClock:
        return CudaBlockClock()


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


def measured_speeds(memory: DeviceMemory) -> tuple[DeviceSpeeds | None, bool]:
    """The device's speeds, and whether measuring them raised the allocator's peaks (its products
    and copies allocate hundreds of MiB): then the peaks are reset, so that a training batch that
    stays below the measure's own high is still seen to raise them (issue 39: with a small model
    the measured peak stayed 0). The user's peaks from before the fit are lost only then."""
    before = memory.peak_allocated_bytes(), memory.peak_reserved_bytes()
    speeds = memory.speeds()
    after = memory.peak_allocated_bytes(), memory.peak_reserved_bytes()
    raised = after[0] > before[0] or after[1] > before[1]
    if raised:
        memory.reset_peaks()
    return speeds, raised
