"""Host buffers for offloaded storages: reused across steps, bounded by the steps that use them.

Requests are rounded up to one of 16 size classes per power of two (waste below 1/16), so a step
that repeats the previous step's shapes finds its buffers in O(1) and allocates nothing. Shapes
that change (dynamic padding, a smaller last batch, images of several sizes) are bounded by one
rule: the pool never holds more than ``HEADROOM`` times the largest number of requested bytes in
use at once during the current step or the ``TRIM_WINDOW_STEPS`` steps before it.

- A request whose class has no free block is served from the smallest free block of a larger class
  up to ``HEADROOM`` times its size, so a shorter sequence reuses a longer one's buffers.
- A new block is allocated only after evicting cached free blocks, least recently freed first,
  until the new total fits under that limit.
- At every step boundary (``end_step``, called when the offload context is entered) the pool trims
  to the limit of the window, so after shapes shrink the memory of the large steps goes back to
  the OS exactly ``TRIM_WINDOW_STEPS`` steps later.

Blocks are accounted by capacity and get their memory only from ``HostPool._allocate`` and give it
back only in ``HostBlock.close``; a backend that sub-allocates page-aligned slices of pinned slabs
from torch's pinned allocator replaces those two and keeps the rest. On CUDA today the buffers are
page-locked with ``cudaHostRegister`` at their exact size.

Releases come from ``__del__`` finalizers that garbage collection may run on any thread, also
inside ``acquire`` on the same thread. ``release`` therefore never blocks: it appends to a queue
(``deque.append`` is atomic) and drains it only if the lock is free; whatever it could not drain
is drained at the next ``acquire``, ``end_step`` or read of the byte counters.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightmem.config import available_ram_bytes, warn_once

if TYPE_CHECKING:
    from lightmem.offload.transport import Transport

HEADROOM = 1.25
"""Held bytes stay at most this multiple of the largest requested bytes in use (see module doc)."""
TRIM_WINDOW_STEPS = 8
"""Steps (offload context entries) whose peak the pool keeps room for after they have passed."""

_POISON_BYTE = 0xFF  # every float dtype reads 0xFF.. bytes as NaN
_PENDING_POLL_S = 1e-4


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its size class: 16 classes per power of two, at least 512 bytes."""
    if nbytes <= 512:
        return 512
    step = 1 << max(9, nbytes.bit_length() - 5)
    return (nbytes + step - 1) // step * step


def _class_step(capacity: int) -> int:
    """The distance from size class ``capacity`` to the next one up."""
    return 1 << max(9, capacity.bit_length() - 5) if capacity > 512 else 512


class HostBlock:
    """One host allocation of ``capacity`` bytes; ``storage`` is the untyped storage to slice.

    ``event`` is the last copy that reads or writes the block once it has been released; the
    block's memory is never given back before that event has completed, however the block dies.
    """

    __slots__ = (
        "_done", "_on_free", "_span", "_span_bytes", "capacity", "event", "registered", "requested",
        "storage", "tensor",
    )  # fmt: skip

    def __init__(
        self, capacity: int, pin: bool, poison: bool, done: Callable[[Any], bool],
        on_free: Callable[[torch.Tensor], None] | None = None,
    ) -> None:  # fmt: skip
        self.capacity = capacity
        self.requested = 0
        self.event: Any = None
        self._done = done
        self._on_free = on_free
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
        """Give the memory back, after the last copy into or out of it has completed."""
        event = self.event
        if event is not None:
            # Dropped with its pool (an exception, a context garbage-collected mid-step): a copy
            # on a side stream may still write these bytes.
            while not self._done(event):
                time.sleep(_PENDING_POLL_S)
            self.event = None
        if self._on_free is not None:
            on_free, self._on_free = self._on_free, None
            on_free(self.tensor)
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
    """Size-classed pool of host blocks with a hard byte budget, a free-RAM floor and a bound
    that follows the steps (see the module docstring).

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
        self._held_bytes = 0
        self.peak_held_bytes = 0
        self._in_use_bytes = 0
        self._requested_bytes = 0  # what callers asked for, of the blocks in use
        self._step_peak_requested = 0
        self._window: deque[int] = deque(maxlen=TRIM_WINDOW_STEPS)
        self._limit_bytes = 0  # HEADROOM x the window's peak (the current step's is added live)
        self.allocations = 0
        self.evictions = 0
        self.floor_hits = 0
        self._free: dict[int, list[HostBlock]] = {}
        self._idle: dict[HostBlock, None] = {}  # every free block, least recently freed first
        self._classes: dict[int, int] = {}  # nbytes -> size class; a step repeats its sizes
        self._pending: list[HostBlock] = []  # released, waiting for block.event
        self._returned: deque[HostBlock] = deque()  # released, not yet seen under the lock
        self._lock = threading.Lock()
        self._pin = transport.pin_memory
        self._poison = transport.poison_released
        self._done = transport.done
        self._on_free = transport.poison if transport.poison_released else None

    @property
    def held_bytes(self) -> int:
        """Bytes of host blocks the pool holds: in use, waiting for a copy, or cached."""
        self._try_drain()
        return self._held_bytes

    @property
    def in_use_bytes(self) -> int:
        """Bytes of host blocks handed out and not yet reusable (capacities)."""
        self._try_drain()
        return self._in_use_bytes

    def acquire(self, nbytes: int) -> HostBlock | None:
        capacity = self._classes.get(nbytes)
        if capacity is None:
            capacity = self._classes[nbytes] = size_class(nbytes)
        with self._lock:
            if self._returned or self._pending:
                self._drain()
            requested = self._requested_bytes + nbytes
            if requested > self._step_peak_requested:
                self._step_peak_requested = requested
            free = self._free.get(capacity)
            if free:
                block = free.pop()
            else:
                block = self._larger_free(nbytes, capacity)
                if block is None:
                    block = self._grow(capacity)
                    if block is None:
                        return None
            if self._idle:
                self._idle.pop(block, None)
            block.requested = nbytes
            self._requested_bytes = requested
            self._in_use_bytes += block.capacity
            return block

    def _larger_free(self, nbytes: int, capacity: int) -> HostBlock | None:
        """The smallest free block of a larger class within ``HEADROOM`` times ``nbytes``."""
        if not self._idle:
            return None
        largest = int(nbytes * HEADROOM)
        capacity += _class_step(capacity)
        while capacity <= largest:
            free = self._free.get(capacity)
            if free:
                return free.pop()
            capacity += _class_step(capacity)
        return None

    def _grow(self, capacity: int) -> HostBlock | None:
        limit = max(self._limit_bytes, int(self._step_peak_requested * HEADROOM))
        if self._held_bytes + capacity > limit:
            self._evict(self._held_bytes + capacity - limit)
        excess = self._held_bytes + capacity - self.budget_bytes
        if excess > 0:
            if self._held_bytes - self._in_use_bytes < excess:  # evicting cannot make room
                return None
            self._evict(excess)
        if available_ram_bytes() - capacity < self.min_available_bytes:
            self._evict(capacity)
            if available_ram_bytes() - capacity < self.min_available_bytes:
                self.floor_hits += 1
                return None
        block = self._allocate(capacity)
        self.allocations += 1
        self._held_bytes += capacity
        if self._held_bytes > self.peak_held_bytes:
            self.peak_held_bytes = self._held_bytes
        return block

    def _allocate(self, capacity: int) -> HostBlock:
        return HostBlock(capacity, self._pin, self._poison, self._done, self._on_free)

    def release(self, block: HostBlock, event: Any = None) -> None:
        """Return ``block`` once ``event`` has completed. Never blocks: safe from finalizers."""
        block.event = event
        self._returned.append(block)
        self._try_drain()

    def end_step(self) -> None:
        """Step boundary: remember this step's peak and trim to the window's limit."""
        with self._lock:
            self._drain()
            self._window.append(self._step_peak_requested)
            self._step_peak_requested = self._requested_bytes  # graphs still alive carry over
            self._limit_bytes = int(max(self._window) * HEADROOM)
            if self._held_bytes > self._limit_bytes:
                self._evict(self._held_bytes - self._limit_bytes)

    def reset_peak(self) -> int:
        """Start a new peak of ``held_bytes`` from the current value, and return it."""
        self.peak_held_bytes = self.held_bytes
        return self._held_bytes

    def clear(self) -> None:
        """Free every cached block (blocks in use stay with their owners)."""
        with self._lock:
            self._drain()
            self._evict(self._held_bytes)

    def _try_drain(self) -> None:
        if self._returned and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        """Under the lock: take in released blocks, and make free those whose copy has completed."""
        returned = self._returned
        pending = self._pending
        while returned:
            pending.append(returned.popleft())
        if not pending:
            return
        done = self._done
        still_pending = []
        for block in pending:
            if block.event is None or done(block.event):
                block.event = None
                self._make_free(block)
            else:
                still_pending.append(block)
        self._pending = still_pending

    def _make_free(self, block: HostBlock) -> None:
        if self._poison:
            self.transport.poison(block.tensor)
        self._in_use_bytes -= block.capacity
        self._requested_bytes -= block.requested
        block.requested = 0
        self._free.setdefault(block.capacity, []).append(block)
        self._idle[block] = None

    def _evict(self, wanted_bytes: int) -> None:
        """Give free blocks back to the OS, least recently freed first, until ``wanted_bytes``."""
        freed = 0
        idle = self._idle
        while idle and freed < wanted_bytes:
            block = next(iter(idle))
            del idle[block]
            self._free[block.capacity].remove(block)
            block.close()
            self._held_bytes -= block.capacity
            self.evictions += 1
            freed += block.capacity
