"""A simulated training device of a given capacity, for tests of ``plan="auto"`` without a GPU.

Its reserved peak is ``reserved_peak_bytes`` (set by the test; 0: its allocated peak), its speeds
those of ``gpu`` in the table of :mod:`lightmem.devices` (None: none, as a CPU), and its step clock
returns ``step_seconds`` per step when set (None: no clock), and its block clock ``block_seconds``
for each block's forward (None: no block clock). Measuring its speeds raises its
peaks to ``measure_peak_bytes``, as a GPU's timed products do.

Inside ``with simulated_device(capacity_bytes=...)`` every fit (``LightMem(plan="auto")`` without
``device_budget``) and ``lightmem estimate --plan`` without ``--budget`` read this device's memory
instead of CUDA's, through the one budget rule of :mod:`lightmem.device_memory`. Its allocator peak
is ``peak_bytes`` (set by the test, or changed between steps) plus, when a
``SimulatedAsyncTransport`` is given, the peak of the reload memory that transport measures. Like
``max_memory_allocated`` it is a high of the whole process: a fit measures a training batch by how
far it rises within it, so a test raises it inside the batch (``on_before_backward``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightmem import device_memory
from lightmem.devices import GPU_TABLE, DeviceSpeeds


class SimulatedDeviceMemory:
    """A device of ``capacity_bytes`` with ``used_by_others_bytes`` taken by other processes (and
    contexts) and ``held_bytes`` held by this process's allocator."""

    def __init__(
        self, capacity_bytes: int, *, used_by_others_bytes: int = 0, held_bytes: int = 0, peak_bytes: int = 0,
        transport: Any = None, reserved_peak_bytes: int = 0, gpu: str | None = None, step_seconds: float | None = None,
        measure_peak_bytes: int = 0, block_seconds: dict[str, float] | None = None, alloc_retries: int = 0,
        context_bytes: int = 0,
    ) -> None:  # fmt: skip
        self.capacity_bytes = capacity_bytes
        self.used_by_others_bytes = used_by_others_bytes
        self.held = held_bytes
        self.peak_bytes = peak_bytes
        self.reserved_peak_bytes = reserved_peak_bytes
        self.gpu = gpu
        self.step_seconds = step_seconds
        self.measure_peak_bytes = measure_peak_bytes
        """What measuring its speeds raises the allocator's peaks to (as a GPU's products do)."""
        self.block_seconds = block_seconds
        """Seconds of each named block's forward its block clock reads (None: no block clock)."""
        self.transport = transport
        self.retries = alloc_retries
        """The allocator's ``num_alloc_retries`` (set by the test)."""
        self.context_bytes = context_bytes
        """What this process holds outside its allocator (its CUDA context; set by the test)."""
        self.source = f"simulated device of {capacity_bytes} bytes"

    def free_and_total_bytes(self) -> tuple[int, int]:
        return self.capacity_bytes - self.used_by_others_bytes - self.context_bytes - self.held, self.capacity_bytes

    def alloc_retries(self) -> int:
        return self.retries

    def held_bytes(self) -> int:
        return self.held

    def peak_allocated_bytes(self) -> int:
        reload_peak = self.transport.memory_stats()["allocated_bytes.all.peak"] if self.transport is not None else 0
        return self.peak_bytes + reload_peak

    def peak_reserved_bytes(self) -> int:
        return max(self.reserved_peak_bytes, self.peak_allocated_bytes())

    def speeds(self) -> DeviceSpeeds | None:
        if self.gpu is None:
            return None
        self.peak_bytes = max(self.peak_bytes, self.measure_peak_bytes)
        self.reserved_peak_bytes = max(self.reserved_peak_bytes, self.measure_peak_bytes)
        return GPU_TABLE[self.gpu]

    def reset_peaks(self) -> None:
        self.peak_bytes = self.reserved_peak_bytes = 0

    def step_clock(self) -> _FixedClock | None:
        return _FixedClock(self) if self.step_seconds is not None else None

    def block_clock(self) -> _FixedBlockClock | None:
        return _FixedBlockClock(self) if self.block_seconds is not None else None


class _FixedClock:
    """A step clock that reads the simulated device's ``step_seconds`` at each stop."""

    def __init__(self, device: SimulatedDeviceMemory) -> None:
        self.device = device

    def start(self) -> None:
        return None

    def stop(self) -> float | None:
        return self.device.step_seconds


class _FixedBlockClock:
    """A block clock that reads, for each block entered in a step, the simulated device's
    ``block_seconds`` (of that name; a block it does not name is not timed) at the step's end."""

    def __init__(self, device: SimulatedDeviceMemory) -> None:
        self.device = device
        self._entered: dict[str, int] = {}
        self._steps: list[dict[str, float]] = []

    def enter(self, name: str) -> None:
        self._entered[name] = self._entered.get(name, 0) + 1

    def exit(self, name: str) -> None:
        return None

    def end_step(self) -> None:
        seconds = self.device.block_seconds or {}
        step = {name: seconds[name] * calls for name, calls in self._entered.items() if name in seconds}
        if step:
            self._steps.append(step)
        self._entered = {}

    def read(self) -> dict[str, float] | None:
        return self._steps.pop(0) if self._steps else None


@contextlib.contextmanager
def simulated_device(capacity_bytes: int, **kwargs: Any) -> Iterator[SimulatedDeviceMemory]:
    """Every training device is a ``SimulatedDeviceMemory(capacity_bytes, **kwargs)`` inside."""
    previous = device_memory._simulated
    device_memory._simulated = simulated = SimulatedDeviceMemory(capacity_bytes, **kwargs)
    try:
        yield simulated
    finally:
        device_memory._simulated = previous
