"""Host buffers for offloaded storages: carved from a few large slabs, bounded by recent steps.

Each request gets an ``ALIGN_BYTES``-aligned range of a slab (first fit, address order), and a
released range merges with its free neighbours. One forward allocates in order and its backward
frees in reverse, so a step carves its slab like a stack: the free list stays one or two ranges
long, a shorter sequence simply uses less of the slab, and no size class ever sits idle.

The bound: the pool holds at most ``HEADROOM`` times the largest aligned bytes in use at once
during the current step or the ``TRIM_WINDOW_STEPS`` steps before it.

- A request that fits nowhere gets an overflow slab of its exact size (first step, a step larger
  than any before), after freeing empty overflow slabs that would push past that bound.
- At each step boundary (``end_step``, called when the offload context is entered), if nothing is
  in use, the slabs are replaced by one slab of ``HEADROOM`` times the window's peak whenever
  there were several or the one held exceeds that: after shapes grow, the next step finds room in
  one slab; after they shrink, the memory goes back exactly ``TRIM_WINDOW_STEPS`` steps later.

The unit of memory is ``HostSlab`` (one allocation, given back whole by ``close``); blocks are
views into it. On CUDA a slab is ordinary host memory page-locked with ``cudaHostRegister`` at its
exact size (docs/offload-protocol.md says why not torch's pinned allocator), in the context of
the device whose tensors it holds (a rank on ``cuda:k`` creates no context on GPU 0).

Page-locking never runs on the training thread (the warm start, docs/host-pool.md). Memory is
page-locked in chunks on background threads (``lightmem.transfer.page_lock``), each chunk its own
slab that joins the pool once registered, ahead of the slabs still pageable, so a block never
spans two registrations. The page-locked chunks (counted from when they are queued) follow two
rules, applied at each step boundary in this order, and nowhere else:

- **The cap.** The chunks hold at most the *bound*, ``HEADROOM`` times the window's peak (or what
  ``prepare`` asked for, during its ``TRIM_WINDOW_STEPS`` boundaries), plus the window's largest
  block: a block never spans two chunks, so room at chunk ends may be lost, at most about one
  block. Past the cap (the window's peak fell), empty chunks go back, those too small for the
  window's largest block first, newest first. Nothing else gives a chunk back (not a request, not
  a step that used less) but the RAM floor: a request that would take available RAM under
  ``min_available_bytes`` first gives back every empty slab it needs, page-locked or not.
- **Growth.** Chunks are queued only for demand: what the last step put in pageable memory (at
  least that, up to the bound), or what recent steps used beyond the chunks, each chunk at least
  the largest block that spilled; never past the cap. Where the cap leaves no room for a block
  that spilled, empty chunks too small for it go back to make that room.

A chunk is queued only up to the cap and given back only above it, so one boundary never undoes
another: a step of the shapes of the window's steps fits the chunks after at most two boundaries,
and from then on registers nothing, gives nothing back and copies nothing to pageable memory
(``tests/test_offload_pool_steady.py``). ``prepare(nbytes)``, called by whoever knows a step's host
bytes before its first forward, queues ``HEADROOM`` times that (within the budget and the RAM
floor). Pageable slabs are a step's stopgap: made for a request no chunk can hold, given back at
the next boundary once empty.

A request that finds no room waits for a chunk being page-locked that could hold it
(``WAIT_FOR_CHUNKS``), rather than take fresh pageable memory, whose copies the CUDA runtime stages
synchronously after faulting its pages in; where none could, it gets a pageable slab as before.
``WARM_START = False`` restores the behaviour before: slabs made during a step stay pageable and
are replaced at the next step boundary by one slab page-locked there, on the training thread.
``registration_stats()`` reports the page-locked bytes held in the process, the time registration
took and the time a thread waited for it.

A slab that cannot be allocated or page-locked is never an error of the caller's: CUDA's last
error is cleared, one warning says so, and the pool tries again at the next step boundary. A
pageable slab that cannot be allocated refuses the request (the tensor stays on the device,
counted by the offloader); a chunk that cannot be page-locked leaves its requests to pageable
memory.

Releases come from ``__del__`` finalizers that garbage collection may run on any thread, also
inside ``acquire`` on the same thread. ``release`` therefore never blocks: it appends to a queue
(``deque.append`` is atomic) and drains it only if the lock is free; whatever it could not drain
is drained at the next ``acquire``, ``end_step`` or read of the byte counters. Memory still
written by a queued copy is never given back: a dropped pool waits for its pending copies first.
The background threads never take the pool's lock: a chunk they made waits in a queue of their
own until the pool, under its lock, adopts it.

This is lightmem's one file over 600 lines, on purpose: ``HostPool`` is one resource with two
policies over it, the bound (what a step may carve) and the cap and growth of its page-locked
chunks (what it holds and gives back), and the invariants above hold only as long as both are read
beside each other, with the release path that feeds them. Split across files, one could quietly
undo the other. The memory it manages, ``HostSlab`` and ``HostBlock``, lives in
``lightmem.transfer.slab``.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightmem.compiled import never_traced
from lightmem.config import available_ram_bytes
from lightmem.transfer.page_lock import (
    ChunkRegistrar,
    HostAllocationError,
    RegistrationStats,
    count,
    registration_stats,
)

from lightmem.transfer.slab import MAX_CACHED_BLOCKS, HostBlock, HostSlab

if TYPE_CHECKING:
    from lightmem.transfer.transport import Transport

HEADROOM = 1.25
"""Held bytes stay at most this multiple of the largest bytes in use at once (module docstring)."""
TRIM_WINDOW_STEPS = 8
"""Steps (offload context entries) whose peak the pool keeps room for after they have passed."""
ALIGN_BYTES = 512
"""Every block starts and ends on this boundary."""
WARM_START = True
"""Page-lock in chunks on background threads (the module docstring); False: one slab page-locked at
the step boundary on the training thread, as before (``benchmarks/warm_start.py`` compares them)."""
WAIT_FOR_CHUNKS = True
"""A request that finds no room waits for a chunk being page-locked that could hold it, rather
than take fresh pageable memory (faulted in, then copied synchronously by the CUDA runtime)."""
CHUNK_FIRST_BYTES = 256 * 2**20
"""The first chunk queued at once: small, so page-locked memory is ready soon."""
CHUNK_MAX_BYTES = 2 * 2**30
"""Chunk sizes double from ``CHUNK_FIRST_BYTES`` up to this (or the largest request, if larger)."""



def bound_bytes(peak_bytes: int) -> int:
    """The pool's bound for a window whose largest bytes in use at once are ``peak_bytes``:
    ``HEADROOM`` times them, aligned (the chunks' cap adds the window's largest block)."""
    return int(peak_bytes * HEADROOM) // ALIGN_BYTES * ALIGN_BYTES


__all__ = [
    "ALIGN_BYTES", "CHUNK_FIRST_BYTES", "CHUNK_MAX_BYTES", "HEADROOM", "TRIM_WINDOW_STEPS", "bound_bytes",
    "WAIT_FOR_CHUNKS", "WARM_START", "HostAllocationError", "HostBlock", "HostPool", "HostSlab",
    "RegistrationStats", "chunk_sizes", "registration_stats", "size_class",
]  # fmt: skip

_PENDING_POLL_S = 1e-4


def size_class(nbytes: int) -> int:
    """The bytes a request of ``nbytes`` takes in the pool: rounded up to ``ALIGN_BYTES``."""
    return max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)


def chunk_sizes(nbytes: int, at_least: int = 0) -> list[int]:
    """Chunks for ``nbytes`` of page-locked memory (rounded up to ``ALIGN_BYTES``), summing to
    exactly that: from ``CHUNK_FIRST_BYTES`` doubling up to ``CHUNK_MAX_BYTES``, none under
    ``at_least`` (the largest block one must hold); a rest under ``CHUNK_FIRST_BYTES`` or under
    ``at_least`` joins the last chunk. ``[]`` when ``nbytes`` is under ``at_least``: no chunk of
    that total could hold such a block."""
    remaining = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    at_least = -(-at_least // ALIGN_BYTES) * ALIGN_BYTES
    if remaining < at_least:
        return []
    sizes: list[int] = []
    size = CHUNK_FIRST_BYTES
    smallest_rest = max(CHUNK_FIRST_BYTES, at_least)
    while remaining > 0:
        take = min(max(size, at_least), remaining)
        if remaining - take < smallest_rest:
            take = remaining
        sizes.append(take)
        remaining -= take
        size = min(2 * size, CHUNK_MAX_BYTES)
    return sizes


class HostPool:
    """Host blocks carved from slabs, with a hard byte budget, a free-RAM floor and a bound that
    follows the steps (see the module docstring).

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
        self._window: deque[int] = deque(maxlen=TRIM_WINDOW_STEPS)  # peaks of requested bytes
        self._step_peak_bytes = 0  # of in-use (aligned) bytes, this step
        # What this step asked for, refused requests included: the next step's slab is sized for
        # the demand (within the budget), or a tight budget would keep refusing on slack alone.
        self._step_demand_requested = 0
        self._step_demand_bytes = 0
        self._window_bytes: deque[int] = deque(maxlen=TRIM_WINDOW_STEPS)
        self._overflow_bytes = 0  # in use outside the main slab
        self._step_overflow_peak = 0
        self._limit_bytes = 0  # HEADROOM x the window's peak (the current step's is added live)
        self.allocations = 0
        self.floor_hits = 0
        self.alloc_failures = 0
        self.alloc_error = ""
        self.alloc_failed = False
        """A slab could not be allocated or page-locked this step: requests needing one are refused."""
        self._slabs: list[HostSlab] = []  # the main slab first, then overflow slabs
        self._sizes: dict[int, int] = {}  # nbytes -> aligned size; a step repeats its sizes
        self._pending: list[HostBlock] = []  # released, waiting for block.event
        self._returned: deque[HostBlock] = deque()  # released, not yet seen under the lock
        # Free blocks not yet merged into their slab, by size: a step that repeats the last one's
        # sizes takes them back in O(1); the first request of another size merges them all.
        self._recent: dict[int, list[HostBlock]] = {}
        # Per size, how many leading slabs have no free range that large: a step larger than any
        # before gets a slab per few blocks, and scanning them all for each request would be
        # quadratic. Taking only shrinks free ranges and new slabs are appended, so it holds until
        # a range is given back or a slab removed (both clear it).
        self._no_room_below: dict[int, int] = {}
        self._lock = threading.Lock()
        self._pin = transport.pin_memory
        self._device: torch.device | None = None  # of the tensors last given a new slab
        self._poison = transport.poison_released
        self._done: Callable[[Any], bool] = transport.done
        # Test transports check that no queued copy touches memory that is reused or given back.
        self._on_free = transport.poison if transport.poison_released else None
        # The warm start (module docstring): chunks page-locked in the background, counted in
        # held bytes from when they are queued until adopted (or failed, or cancelled).
        self._registrar = ChunkRegistrar() if self._pin else None
        self._warming_bytes = 0
        self._prepared_bytes = 0  # HEADROOM x what prepare() was told, kept room for ...
        self._prepared_boundaries = 0  # ... during this many more step boundaries
        self._pageable_bytes = 0  # in use in slabs that are not page-locked (with page-locking on)
        self._step_pageable_peak = 0
        self._step_pageable_largest = 0  # the largest block that went to pageable memory this step
        self._step_largest = 0  # the largest block handed out this step
        self._window_largest: deque[int] = deque(maxlen=TRIM_WINDOW_STEPS)

    @property
    def held_bytes(self) -> int:
        """Bytes of host slabs the pool holds: in use, waiting for a copy, or free."""
        self._try_drain()
        return self._held_bytes

    @property
    def in_use_bytes(self) -> int:
        """Bytes of blocks handed out and not yet reusable (aligned sizes)."""
        self._try_drain()
        return self._in_use_bytes

    @property
    def step_peak_in_use_bytes(self) -> int:
        """The most bytes of blocks in use at once since the last step boundary."""
        return self._step_peak_bytes

    def acquire(self, nbytes: int, storage: torch.UntypedStorage | None = None) -> HostBlock | None:
        """A block of at least ``nbytes`` for ``storage``'s bytes (its device is asked only when a
        slab is made: page-locking runs in that device's context), or ``None`` (see the class)."""
        size = self._sizes.get(nbytes)
        if size is None:
            if len(self._sizes) >= MAX_CACHED_BLOCKS:
                self._sizes.clear()
            size = self._sizes[nbytes] = size_class(nbytes)
        with self._lock:
            if self._returned or self._pending:
                self._drain()
            requested = self._requested_bytes + nbytes
            recent = self._recent.get(size)
            if recent:  # a step repeating its sizes: the block freed last for this size
                block = recent.pop()
            else:
                if self._recent:
                    self._merge_recent()
                if self._registrar is not None and self._registrar.done:
                    self._adopt()
                slabs = self._slabs
                first = self._no_room_below.get(size, 0)
                for index in range(first, len(slabs)):
                    block = slabs[index].take(size)
                    if block is not None:
                        self._no_room_below[size] = index
                        break
                else:
                    self._no_room_below[size] = len(slabs)
                    block = self._grow(size, requested, storage)
                    if block is None:
                        if requested > self._step_demand_requested:
                            self._step_demand_requested = requested
                        if self._in_use_bytes + size > self._step_demand_bytes:
                            self._step_demand_bytes = self._in_use_bytes + size
                        return None
            if block.slab is not self._slabs[0]:
                self._overflow_bytes += size
                if self._overflow_bytes > self._step_overflow_peak:
                    self._step_overflow_peak = self._overflow_bytes
            if self._pin and not block.slab.registered:
                pageable = self._pageable_bytes = self._pageable_bytes + size
                if pageable > self._step_pageable_peak:
                    self._step_pageable_peak = pageable
                if size > self._step_pageable_largest:
                    self._step_pageable_largest = size
            if size > self._step_largest:
                self._step_largest = size
            block.requested = nbytes
            self._requested_bytes = requested
            if requested > self._step_peak_requested:
                self._step_peak_requested = requested
            in_use = self._in_use_bytes = self._in_use_bytes + size
            if in_use > self._step_peak_bytes:
                self._step_peak_bytes = in_use
            return block

    def _grow(self, size: int, requested: int, storage: torch.UntypedStorage | None) -> HostBlock | None:
        if storage is not None:
            self._device = storage.device
        if self._registrar is not None and WAIT_FOR_CHUNKS:
            block = self._wait_for_chunk(size)
            if block is not None:
                return block
        step_peak = max(self._step_peak_requested, requested)
        limit = max(self._limit_bytes, bound_bytes(step_peak))
        # With the warm start chunks go back only at a step boundary (``_warm_for_next_step``).
        pageable_only = self._registrar is not None and WARM_START
        if self._held_bytes + size > limit:
            self._free_empty_slabs(self._held_bytes + size - limit, pageable_only)
        # A step larger than the slab: one overflow slab up to the bound takes the rest of it.
        slab_bytes = max(size, min(limit, self.budget_bytes) - self._held_bytes)
        excess = self._held_bytes + slab_bytes - self.budget_bytes
        if excess > 0:
            self._free_empty_slabs(excess, pageable_only)
            if self._held_bytes + size > self.budget_bytes and self._registrar is not None:
                # No chunk under way could hold it: chunks not yet started give it their budget.
                self._release_reservation(self._registrar.cancel(running=False))
            if self._held_bytes + size > self.budget_bytes:
                return None
            slab_bytes = max(size, self.budget_bytes - self._held_bytes)
        if available_ram_bytes() - slab_bytes < self.min_available_bytes:
            self._free_empty_slabs(slab_bytes)
            slab_bytes = size
            if available_ram_bytes() - size < self.min_available_bytes:
                self.floor_hits += 1
                return None
        slab = self._new_slab(slab_bytes)  # pageable: page-locked at the next step boundary
        return None if slab is None else slab.take(size)

    def _new_slab(self, capacity: int, pin: bool = False) -> HostSlab | None:
        if self.alloc_failed:  # failed this step already: no new attempt (and no new error) per request
            return None
        try:
            slab = HostSlab(capacity, pin, self._poison, self._on_free, self._device)
        except Exception as error:  # host OOM or a failed registration: never the caller's error
            self.alloc_failed = True
            self._note_failure(
                str(error), "saved tensors that needed more stay on the device (counted in "
                "OffloadStats.host_alloc_failed_bytes) and the pool tries again each step",
            )  # fmt: skip
            return None
        self._slabs.append(slab)
        self.allocations += 1
        self._held_bytes += capacity
        if self._held_bytes > self.peak_held_bytes:
            self.peak_held_bytes = self._held_bytes
        return slab

    def prepare(self, nbytes: int, device: torch.device | None = None) -> int:
        """Queue page-locking, in the background, for a step that will hold ``nbytes`` of blocks:
        ``HEADROOM`` times that, less what is held page-locked or under way, within the budget
        and the RAM floor. Returns the bytes queued (0 without page-locking or ``WARM_START``)."""
        if self._registrar is None or not WARM_START:
            return 0
        with self._lock:
            if device is not None:
                self._device = device
            if self._registrar.done:
                self._adopt()
            wanted = min(bound_bytes(nbytes), self.budget_bytes)
            self._prepared_bytes = wanted
            self._prepared_boundaries = TRIM_WINDOW_STEPS
            self._limit_bytes = max(self._limit_bytes, wanted)
            return self._warm(wanted - self._page_locked_bytes() - self._warming_bytes)

    def wait_for_chunks(self) -> None:
        """Block until every chunk queued has been page-locked (or has failed) and joined the pool."""
        if self._registrar is None:
            return
        start = time.perf_counter()
        self._registrar.join()
        count(blocked_s=time.perf_counter() - start)
        with self._lock:
            self._adopt()

    def _page_locked_bytes(self) -> int:
        return sum(slab.capacity for slab in self._slabs if slab.registered)

    def _warm(self, wanted: int, at_least: int = 0) -> int:
        """Under the lock: queue chunks for ``wanted`` bytes (each at least ``at_least``: none when
        the room left is less) within the budget and the RAM floor; they count as held from now on.
        Returns the bytes queued."""
        assert self._registrar is not None
        room = min(
            self.budget_bytes - self._held_bytes,
            available_ram_bytes() - self.min_available_bytes - self._registrar.queued_bytes(),
        )
        if wanted <= 0:
            return 0
        sizes = chunk_sizes(min(wanted, room), at_least)
        if not sizes:
            return 0
        queued = sum(sizes)
        self._warming_bytes += queued
        self._held_bytes += queued
        if self._held_bytes > self.peak_held_bytes:
            self.peak_held_bytes = self._held_bytes
        device = self._device
        if device is not None and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # the background thread's is 0
        self._registrar.submit(sizes, device)
        return queued

    def _adopt(self) -> list[HostSlab]:
        """Under the lock: the chunks made since the last call join the pool, ahead of the
        pageable slabs; returns them. A chunk that failed warns once and gives its bytes back."""
        assert self._registrar is not None
        adopted = []
        done = self._registrar.done
        while done:
            chunk = done.popleft()
            self._warming_bytes -= chunk.nbytes
            if chunk.tensor is None:
                self._held_bytes -= chunk.nbytes
                self._note_failure(
                    chunk.error, "saved tensors go to pageable host memory instead (copies there are staged "
                    "and synchronous) and the pool tries again at each step boundary",
                )  # fmt: skip
                self._release_reservation(self._registrar.cancel())  # the rest would fail alike
                continue
            slab = HostSlab(
                chunk.nbytes, True, self._poison, self._on_free, chunk.device, page_locked=chunk.tensor
            )  # fmt: skip
            chunk.tensor = None
            slab.sequence = chunk.sequence
            slabs = self._slabs
            # In the order the chunks were queued, whichever thread finished first: a step carves
            # the same layout whatever the threads' timing.
            index = next(
                (i for i, other in enumerate(slabs) if not other.registered or other.sequence > chunk.sequence),
                len(slabs),
            )  # fmt: skip
            if index == 0 and slabs:  # the main slab changes: blocks in the old one count as overflow
                if self._recent:
                    self._merge_recent()
                self._overflow_bytes += slabs[0].used
            slabs.insert(index, slab)
            self.allocations += 1
            adopted.append(slab)
        if adopted:
            self._no_room_below = {}
        return adopted

    def _release_reservation(self, nbytes: int) -> None:
        self._warming_bytes -= nbytes
        self._held_bytes -= nbytes

    def _wait_for_chunk(self, size: int) -> HostBlock | None:
        """Under the lock, in ``acquire``: a block of ``size`` from a chunk page-locked in the
        background, waiting for the chunks under way that could hold it; ``None`` when none can.
        The background threads never take the pool's lock, so holding it while waiting is safe."""
        registrar = self._registrar
        assert registrar is not None
        waited_s, waits = 0.0, 0
        try:
            while True:
                for slab in self._adopt():
                    block = slab.take(size)
                    if block is not None:
                        return block
                start = time.perf_counter()
                if not registrar.wait_for(size):
                    return None
                waited_s += time.perf_counter() - start
                waits += 1
        finally:
            if waits:
                count(blocked_s=waited_s, chunk_waits=waits)

    def _note_failure(self, error: str, consequence: str) -> None:
        self.alloc_failures += 1
        self.alloc_error = error
        if self.alloc_failures == 1:  # one warning per pool, whatever the bytes asked each time
            warnings.warn(
                "lightmem: host memory for offload could not be allocated or page-locked "
                f"({error}); {consequence}",
                stacklevel=3,
            )

    def release(self, block: HostBlock, event: Any = None) -> None:
        """Return ``block`` once ``event`` has completed. Never blocks: safe from finalizers."""
        lock = self._lock
        if lock.acquire(False):  # never blocks
            try:
                if event is None or self._done(event):
                    self._make_free(block)
                else:
                    block.event = event
                    self._pending.append(block)
            finally:
                lock.release()
        else:  # held by this thread (a finalizer run inside acquire) or another: the next drain
            block.event = event
            self._returned.append(block)

    def end_step(self) -> None:
        """Step boundary: remember this step's peak; reshape the slabs to the window's bound."""
        with self._lock:
            self._drain()
            if self._pending and self._pin and any(not slab.registered for slab in self._slabs):
                self._wait_for_pending()
            self.alloc_failed = False
            self._window.append(max(self._step_peak_requested, self._step_demand_requested))
            self._window_bytes.append(max(self._step_peak_bytes, self._step_demand_bytes))
            self._window_largest.append(self._step_largest)
            self._step_largest = 0
            self._step_demand_requested = self._step_demand_bytes = 0
            overflow_peak = self._step_overflow_peak
            pageable_peak, pageable_largest = self._step_pageable_peak, self._step_pageable_largest
            # Blocks of graphs still alive carry over into the next step.
            self._step_peak_requested = self._requested_bytes
            self._step_peak_bytes = self._step_overflow_peak = self._in_use_bytes
            self._step_pageable_peak, self._step_pageable_largest = self._pageable_bytes, 0
            limit = bound_bytes(max(self._window))
            if self._prepared_boundaries:
                self._prepared_boundaries -= 1
                limit = max(limit, self._prepared_bytes)
            self._limit_bytes = limit
            if self._registrar is not None and WARM_START:
                self._warm_for_next_step(pageable_peak, pageable_largest, limit)
                if not (self._in_use_bytes or self._pending):
                    self._overflow_bytes = 0
                return
            if self._pin and self._slabs and self._slabs[0].registered:
                self._free_empty_pageable()
            if self._in_use_bytes or self._pending:
                if self._held_bytes > limit:
                    self._free_empty_slabs(self._held_bytes - limit)
                if self._pin and any(not slab.registered for slab in self._slabs):
                    # Graphs overlap every boundary (the next forward starts before the last
                    # backward ends): page-lock a slab beside the ones in use rather than never.
                    self._page_lock_beside(overflow_peak, limit)
                return
            slabs = self._slabs
            pageable = self._pin and any(not slab.registered for slab in slabs)
            if len(slabs) > 1 or self._held_bytes > limit or pageable:
                # One slab that fits the window's peak as carved last time (main slab plus what
                # spilled over), at most the bound.
                main = slabs[0].capacity if slabs else 0
                target = min(max(max(self._window_bytes), main + overflow_peak), limit, self.budget_bytes)
                self._free_empty_slabs(self._held_bytes)
                if target and available_ram_bytes() - target >= self.min_available_bytes:
                    self._new_slab(target, pin=self._pin)
            self._overflow_bytes = 0

    def _warm_for_next_step(self, pageable_peak: int, pageable_largest: int, bound: int) -> None:
        """Under the lock, at a step boundary with the warm start: the pool's two rules over its
        page-locked chunks (the module docstring), given back first, then grown, so one boundary
        never undoes the other. Pageable slabs with nothing in use always go back (chunks take
        their bytes)."""
        if self._registrar.done:  # type: ignore[union-attr]
            self._adopt()
        if self._recent:
            self._merge_recent()
        for slab in [slab for slab in self._slabs if slab.used == 0 and not slab.registered]:
            self._slabs.remove(slab)
            self._close(slab)
        largest = max(self._window_largest, default=0)
        cap = min(bound + largest, self.budget_bytes)
        planned = self._page_locked_bytes() + self._warming_bytes
        # Given back: only what the pool holds past the cap.
        if planned > cap:
            planned -= self._give_back_chunks(planned - cap, largest)
        # Grown: for what the last step put in pageable memory, or what recent steps used beyond
        # the chunks, up to the bound (at least the spill), never past the cap.
        if not pageable_peak and planned >= max(self._window_bytes, default=0):
            return
        room = cap - planned
        if room < pageable_largest:  # chunks too small for the block that spilled make room
            room += self._give_back_chunks(pageable_largest - room, pageable_largest, only_smaller=True)
        wanted = min(max(bound - planned, pageable_peak), room)
        if wanted < pageable_largest:
            wanted = pageable_largest if pageable_largest <= room else 0
        self._warm(wanted, max(pageable_largest, min(largest, wanted)))

    def _give_back_chunks(self, nbytes: int, block_bytes: int, only_smaller: bool = False) -> int:
        """Under the lock: page-locked chunks with nothing in use go back until ``nbytes`` are
        freed, those too small for a block of ``block_bytes`` first (with ``only_smaller``, only
        those), newest first; returns the bytes freed."""
        chunks = [slab for slab in reversed(self._slabs) if slab.registered and slab.used == 0]
        chunks.sort(key=lambda slab: slab.capacity >= block_bytes)  # stable: newest first within
        freed = 0
        for slab in chunks:
            if freed >= nbytes or (only_smaller and slab.capacity >= block_bytes):
                break
            self._slabs.remove(slab)
            self._close(slab)
            freed += slab.capacity
        return freed

    def _page_lock_beside(self, overflow_peak: int, limit: int) -> None:
        """Under the lock: a page-locked slab for the window's peak (the blocks carried over from
        the last step included) goes first, so the next requests take it; the slabs still in use
        stay until empty, then go back (their blocks count as overflow from now on). Within the
        budget and the RAM floor, or not at all."""
        self._free_empty_pageable()
        main = self._slabs[0]
        target = min(max(max(self._window_bytes), main.capacity + overflow_peak), limit, self.budget_bytes)
        if not target or self._held_bytes + target > self.budget_bytes:
            return
        if available_ram_bytes() - target < self.min_available_bytes:
            return
        if self._recent:
            self._merge_recent()
        slab = self._new_slab(target, pin=True)
        if slab is None:
            return
        self._slabs.remove(slab)
        self._slabs.insert(0, slab)
        self._no_room_below = {}
        self._overflow_bytes += main.used

    def _free_empty_pageable(self) -> None:
        """Give back pageable slabs with nothing in use once a page-locked one leads."""
        if self._recent:
            self._merge_recent()
        for slab in list(self._slabs[1:]):
            if slab.used == 0 and not slab.registered and self._slabs[0].registered:
                self._slabs.remove(slab)
                self._close(slab)

    def _wait_for_pending(self) -> None:
        """Under the lock, at a step boundary after a step that made pageable slabs: when every
        block in use only waits for its last copy (reloads the GPU has not run yet), wait for
        those copies, so the slabs can be replaced by one page-locked slab now. Deliberate and
        bounded: once per step that grew the pool, never inside a hook."""
        if self._in_use_bytes != sum(block.capacity for block in self._pending):
            return  # a graph is still alive: its blocks stay where they are
        for block in self._pending:
            while not self._done(block.event):
                time.sleep(_PENDING_POLL_S)
        self._drain()

    def reset_peak(self) -> int:
        """Start a new peak of ``held_bytes`` from the current value, and return it."""
        self.peak_held_bytes = self.held_bytes
        return self._held_bytes

    def clear(self) -> None:
        """Give every slab with nothing in use back to the OS (blocks in use stay with their owners);
        page-locking under way is cancelled, and waited for where a registration is in a call."""
        with self._lock:
            self._drain()
            if self._registrar is not None:
                self._release_reservation(self._registrar.cancel())
                start = time.perf_counter()
                self._registrar.join()  # its threads give back what they were registering
                count(blocked_s=time.perf_counter() - start)
                self._adopt()  # chunks made before the cancel
                self._prepared_boundaries = 0
            self._free_empty_slabs(self._held_bytes)

    def _try_drain(self) -> None:
        if (self._returned or self._pending) and self._lock.acquire(blocking=False):
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
        size = block.capacity
        self._in_use_bytes -= size
        self._requested_bytes -= block.requested
        if self._pin and not block.slab.registered:
            self._pageable_bytes -= size
        if block.slab is not self._slabs[0]:
            self._overflow_bytes -= size
        recent = self._recent.get(size)
        if recent is None:
            self._recent[size] = [block]
        else:
            recent.append(block)

    def _merge_recent(self) -> None:
        """Give the recently freed blocks back to their slabs, merged with their neighbours."""
        self._no_room_below = {}
        for size, blocks in self._recent.items():
            for block in blocks:
                slab = block.slab
                slab.used -= size
                slab.give_back(block.offset, size)
        self._recent = {}

    def _free_empty_slabs(self, wanted_bytes: int, pageable_only: bool = False) -> None:
        """Give slabs with nothing in use back to the OS, newest first, until ``wanted_bytes``
        (with ``pageable_only``, page-locked ones stay)."""
        if self._recent:
            self._merge_recent()
        freed = 0
        for slab in reversed(list(self._slabs)):
            if freed >= wanted_bytes:
                return
            if slab.used == 0 and not (pageable_only and slab.registered):
                self._slabs.remove(slab)
                self._close(slab)
                freed += slab.capacity

    def _close(self, slab: HostSlab) -> None:
        self._no_room_below = {}  # the slabs after it move down
        slab.close()
        self._held_bytes -= slab.capacity

    @never_traced
    def __del__(self) -> None:
        # Dropped with blocks still written or read by queued copies (an exception, a context
        # garbage-collected mid-step): their slabs must outlive those copies.
        try:
            blocks = list(self._returned) + self._pending
        except AttributeError:  # __init__ did not finish
            return
        for block in blocks:
            event = block.event
            if event is not None:
                while not self._done(event):
                    time.sleep(_PENDING_POLL_S)
        registrar = self._registrar
        if registrar is not None:  # its threads give back what they are registering, unwaited
            registrar.cancel()
            while registrar.done:
                registrar.done.popleft().give_back()
        for slab in self._slabs:
            slab.close()  # also breaks the slab <-> cached block cycle, so the memory goes now
