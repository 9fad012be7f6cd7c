"""Host buffers for offloaded storages: reused across steps, capped by a budget.

Requests are rounded up to one of 16 size classes per power of two (waste below 1/16), so in
steady state every step finds the buffers of the previous step and allocates nothing. On CUDA the
buffers are page-locked with ``cudaHostRegister`` at their exact size, which avoids the
power-of-two rounding of PyTorch's pinned caching allocator.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from lightmem.config import available_ram_bytes, warn_once

if TYPE_CHECKING:
    from lightmem.offload.transport import Transport

_POISON_BYTE = 0xFF  # every float dtype reads 0xFF.. bytes as NaN


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its size class: 16 classes per power of two, at least 512 bytes."""
    if nbytes <= 512:
        return 512
    step = 1 << max(9, nbytes.bit_length() - 5)
    return (nbytes + step - 1) // step * step


class HostBlock:
    """One host allocation of ``capacity`` bytes; ``storage`` is the untyped storage to slice."""

    __slots__ = ("_span", "_span_bytes", "capacity", "registered", "storage", "tensor")

    def __init__(self, capacity: int, pin: bool, poison: bool) -> None:
        self.capacity = capacity
        if pin:
            self.tensor, self.registered = _pinned_empty(capacity)
        else:
            self.tensor, self.registered = torch.empty(capacity, dtype=torch.uint8), False
        if poison:
            self.tensor.fill_(_POISON_BYTE)
        self.storage = self.tensor.untyped_storage()
        self._span: torch.UntypedStorage | None = None
        self._span_bytes = -1

    def span(self, nbytes: int) -> torch.UntypedStorage:
        """The first ``nbytes`` of the block as a storage (cached: a step reuses its sizes)."""
        if nbytes != self._span_bytes:
            self._span = self.storage[0:nbytes]
            self._span_bytes = nbytes
        return self._span

    def __del__(self) -> None:
        self.close()  # a pinned block must be unregistered however it dies

    def close(self) -> None:
        if self.registered:  # pragma: no cover - needs CUDA
            self.registered = False
            try:
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            except Exception:
                pass


def _pinned_empty(nbytes: int) -> tuple[torch.Tensor, bool]:  # pragma: no cover - needs CUDA
    """Exact-size page-locked host memory; falls back to the caching pinned allocator."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    try:
        registered = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)) == 0
    except Exception:
        registered = False
    if registered:
        return buffer, True
    warn_once(
        "lightmem: cudaHostRegister failed; using torch's pinned allocator, which rounds host "
        "buffers up to a power of two"
    )
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False


class HostPool:
    """Size-classed pool of host blocks with a hard byte budget and a free-RAM floor.

    ``acquire`` returns ``None`` instead of exceeding ``budget_bytes`` or pushing the machine's
    available memory under ``min_available_bytes``; the caller then keeps the tensor on the device.
    ``release(block, event)`` returns a block once ``event`` (the last copy that reads or writes
    it) has completed; until then it is not handed out again.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        budget_bytes: int,
        min_available_bytes: int,
    ) -> None:
        self.transport = transport
        self.budget_bytes = budget_bytes
        self.min_available_bytes = min_available_bytes
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.in_use_bytes = 0
        self.allocations = 0
        self.floor_hits = 0
        self._free: defaultdict[int, list[HostBlock]] = defaultdict(list)
        self._classes: dict[int, int] = {}  # nbytes -> size class; a step repeats its sizes
        self._pending: list[tuple[HostBlock, Any]] = []
        self._lock = threading.Lock()
        self._pin = transport.pin_memory
        self._poison = transport.poison_released

    def acquire(self, nbytes: int) -> HostBlock | None:
        capacity = self._classes.get(nbytes)
        if capacity is None:
            capacity = self._classes[nbytes] = size_class(nbytes)
        with self._lock:
            if self._pending:
                self._reap()
            free = self._free.get(capacity)
            if free:
                block = free.pop()
                self.in_use_bytes += capacity
                return block
            excess = self.held_bytes + capacity - self.budget_bytes
            if excess > 0:
                if self.held_bytes - self.in_use_bytes < excess:  # trimming cannot make room
                    return None
                self._trim(excess)
            if available_ram_bytes() - capacity < self.min_available_bytes:
                self._trim(capacity)
                if available_ram_bytes() - capacity < self.min_available_bytes:
                    self.floor_hits += 1
                    return None
            block = HostBlock(capacity, self._pin, self._poison)
            self.allocations += 1
            self.held_bytes += capacity
            if self.held_bytes > self.peak_held_bytes:
                self.peak_held_bytes = self.held_bytes
            self.in_use_bytes += capacity
            return block

    def reset_peak(self) -> int:
        """Start a new peak of ``held_bytes`` from the current value, and return it."""
        self.peak_held_bytes = self.held_bytes
        return self.held_bytes

    def release(self, block: HostBlock, event: Any = None) -> None:
        with self._lock:
            if event is not None and not self.transport.done(event):
                self._pending.append((block, event))
                return
            self._make_free(block)

    def _make_free(self, block: HostBlock) -> None:
        if self._poison:
            self.transport.poison(block.tensor)
        self.in_use_bytes -= block.capacity
        self._free[block.capacity].append(block)

    def _reap(self) -> None:
        still_pending = []
        for block, event in self._pending:
            if self.transport.done(event):
                self._make_free(block)
            else:
                still_pending.append((block, event))
        self._pending = still_pending

    def _trim(self, wanted_bytes: int) -> None:
        """Give cached free blocks back to the OS, largest first, until ``wanted_bytes`` are freed."""
        freed = 0
        for capacity in sorted(self._free, reverse=True):
            blocks = self._free[capacity]
            while blocks and freed < wanted_bytes:
                blocks.pop().close()
                self.held_bytes -= capacity
                freed += capacity
        for capacity in [c for c, blocks in self._free.items() if not blocks]:
            del self._free[capacity]

    def clear(self) -> None:
        """Free every cached block (blocks in use stay with their owners)."""
        with self._lock:
            self._reap()
            self._trim(self.held_bytes)
