"""An asynchronous CPU transport that behaves like CUDA streams, for testing the offload protocol.

``SimulatedAsyncTransport`` runs every copy later, on one worker thread per "stream", after a
random delay, and gives events CUDA's record/wait meaning. It also makes mistakes in the protocol
visible as wrong numbers instead of silent luck:

- a reload buffer starts filled with NaN bytes (as uninitialised device memory would be garbage);
- a host buffer is NaN-filled the moment it becomes reusable in the pool;
- a device-to-host copy whose source the caller did not keep alive until the copy ran reads NaN
  bytes, as it would read reused memory on a GPU.

The compute "stream" is the calling thread, which is synchronous: waits queued on it block the
caller. Tests can make the other hazards of a GPU appear too:

- ``hold_copies_to_host()``: copies to host do not run until ``release_copies_to_host()``, or
  until the compute stream waits for one (then exactly the copies up to it run): the slow-PCIe
  regime where copies lag behind compute.
- ``lag_compute()``: the compute stream runs behind the calling thread: events recorded on it stay
  incomplete until ``catch_up_compute()`` (or until compute itself must block). A side stream
  that waits for such an event is counted (``side_waits_on_lagging_compute``), and reload memory
  is given by a caching allocator that, like CUDA's, reuses a freed block on its allocating
  stream at once unless the block was recorded for another stream (``record_stream``); a block
  reused while the compute work queued before its free has not run is counted
  (``device_reuse_hazards``).
- ``capturing_graph = True``: CUDA graph capture; querying an event or queueing work on a side
  stream then raises (both are illegal or corrupt the capture on CUDA) and is counted.

It is not part of the public API and not fast; it exists so the waiting and lifetime logic that
CUDA depends on runs in the CPU test suite.
"""

from __future__ import annotations

import atexit
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

COMPUTE = "compute"
_POISON = 0xFF


class _Event:
    __slots__ = ("copies", "flag", "on_compute")

    def __init__(self, done: bool = False) -> None:
        self.flag = threading.Event()
        self.copies = -1  # on the d2h stream: how many copies to host were queued before it
        self.on_compute = False
        if done:
            self.flag.set()


class _DeviceBlock:
    """Reload memory of the simulated caching allocator: ``backing`` is reused, slices handed out."""

    __slots__ = ("backing", "consumer_events", "free_event", "nbytes", "recorded", "stream")

    def __init__(self, nbytes: int, device: torch.device, stream: Any) -> None:
        self.backing = torch.UntypedStorage(nbytes, device=device)
        self.nbytes = nbytes
        self.stream = stream
        self.recorded = False  # record_stream(consumer) was called while handed out
        self.consumer_events: list[_Event] = []  # what the allocator waits for before reuse
        self.free_event: _Event | None = None  # ground truth: compute work queued before the free


class _WorkerStream:
    """A FIFO of operations run by one daemon thread, each after a random delay."""

    def __init__(self, name: str, rng: random.Random, max_delay_s: float) -> None:
        self.name = name
        self._rng = rng
        self._max_delay_s = max_delay_s
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"lightmem-sim-{name}", daemon=True)
        self._thread.start()

    def submit(self, operation: Callable[[], None]) -> None:
        self._queue.put(operation)

    def _run(self) -> None:
        while True:
            operation = self._queue.get()
            if operation is None:
                return
            if self._max_delay_s > 0:
                time.sleep(self._rng.uniform(0.0, self._max_delay_s))
            operation()

    def close(self) -> None:
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()


_LIVE: weakref.WeakSet[SimulatedAsyncTransport] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # A worker killed at interpreter exit in the middle of a torch op aborts the process.
    for transport in list(_LIVE):
        transport.close()


class SimulatedAsyncTransport:
    """CUDA-like stream semantics on CPU worker threads; see the module docstring."""

    pin_memory = False
    poison_released = True
    synchronous = False

    def __init__(self, seed: int = 0, max_delay_s: float = 0.002) -> None:
        rng = random.Random(seed)
        self._d2h = _WorkerStream("d2h", random.Random(rng.random()), max_delay_s)
        self._h2d = _WorkerStream("h2d", random.Random(rng.random()), max_delay_s)
        self._waited_s = 0.0
        self._inflight: dict[int, int] = {}  # host buffer address -> queued copies touching it
        self._inflight_lock = threading.Lock()
        self.stale_reads = 0
        """Copies whose source had been freed before the copy ran (would be corruption on CUDA)."""
        self.reuse_hazards = 0
        """Host buffers handed back for reuse while a queued copy still touched them."""
        self.capturing_graph = False
        self.capture_violations = 0
        """Event queries or side-stream work requested while a graph was being captured."""
        self.side_waits_on_lagging_compute = 0
        """Side-stream waits for a compute event that had not completed (compute running behind)."""
        self.device_reuse_hazards = 0
        """Reload blocks handed out again while compute work queued before their free had not run."""
        self.record_stream_calls = 0
        self.max_held_source_bytes = 0
        """The most device bytes kept alive only for queued copies to host (sampled at each copy)."""
        self.lag_grace_s = 1.0
        self._sources: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self._lagging: list[_Event] | None = None  # compute events not yet run, while lagging
        self._gate = threading.Condition()
        self._held = False
        self._copies_queued = 0  # copies to host submitted
        self._copies_allowed = 0  # of those, how many may run while held
        self._free_blocks: list[_DeviceBlock] = []
        self._blocks_lock = threading.Lock()
        self._closed = False
        _LIVE.add(self)

    def streams(self, device: torch.device) -> tuple[Any, Any, Any]:
        return COMPUTE, self._d2h, self._h2d

    # -- hazards a test switches on ----------------------------------------------------------

    def capturing(self) -> bool:
        return self.capturing_graph

    def _check_capture(self, what: str) -> None:
        if self.capturing_graph:
            self.capture_violations += 1
            raise RuntimeError(f"simulated CUDA graph capture: {what} while capturing")

    def hold_copies_to_host(self) -> None:
        """Copies to host queued from now on do not run until released (or waited for)."""
        with self._gate:
            self._held = True
            self._copies_allowed = self._copies_queued

    def release_copies_to_host(self) -> None:
        with self._gate:
            self._held = False
            self._gate.notify_all()

    def _allow_copies(self, count: int) -> None:
        with self._gate:
            if count > self._copies_allowed:
                self._copies_allowed = count
                self._gate.notify_all()

    def lag_compute(self) -> None:
        """Compute events recorded from now on stay incomplete until ``catch_up_compute``."""
        self._lagging = []

    def catch_up_compute(self, stop_lagging: bool = True) -> None:
        lagging = self._lagging
        if lagging is not None:
            for event in lagging:
                event.flag.set()
            lagging.clear()
            if stop_lagging:
                self._lagging = None

    # -- stream primitives --------------------------------------------------------------------

    def record(self, stream: Any) -> _Event:
        if stream is COMPUTE:
            if self._lagging is None:
                return _Event(done=True)
            event = _Event()
            event.on_compute = True
            self._lagging.append(event)
            return event
        self._check_capture("an event recorded on a side stream")
        event = _Event()
        if stream is self._d2h:
            event.copies = self._copies_queued
        stream.submit(event.flag.set)
        return event

    def wait(self, stream: Any, event: _Event | None) -> None:
        if event is None:
            return
        if stream is COMPUTE:
            if not event.flag.is_set():
                start = time.perf_counter()
                # The copy stream waited for makes progress (exactly up to a held copy to host);
                # compute's own queued work runs meanwhile, if the copy waits for it.
                if event.copies >= 0:
                    self._allow_copies(event.copies)
                else:
                    self._allow_copies(self._copies_queued)
                if self._lagging is not None and not event.flag.wait(self.lag_grace_s):
                    self.catch_up_compute(stop_lagging=False)
                event.flag.wait()
                self._waited_s += time.perf_counter() - start
            return
        self._check_capture("a side stream waiting for an event (it would join the capture)")
        if event.on_compute and not event.flag.is_set():
            self.side_waits_on_lagging_compute += 1
        stream.submit(event.flag.wait)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        # Hold the device source's storage weakly: only the caller may keep its memory from
        # reuse, as with CUDA's caching allocator.
        self._check_capture("a copy queued on a side stream")
        self.max_held_source_bytes = max(self.max_held_source_bytes, self.held_source_bytes())
        storage = src.untyped_storage()
        layout = (src.dtype, src.storage_offset(), src.size(), src.stride())
        src_ref = weakref.ref(storage)
        index = self._copies_queued
        self._sources[index] = (src_ref, storage.nbytes())
        del src, storage
        host = self._track(dst)
        self._copies_queued += 1

        def run() -> None:
            with self._gate:
                while self._held and index >= self._copies_allowed:
                    self._gate.wait()
            source = src_ref()
            if source is None:
                self.stale_reads += 1
                start = dst.storage_offset() * dst.element_size()
                torch.empty(0, dtype=torch.uint8).set_(dst.untyped_storage(), start, (dst.nbytes,)).fill_(_POISON)
            else:
                dtype, offset, size, stride = layout
                dst.copy_(torch.empty(0, dtype=dtype, device=source.device).set_(source, offset, size, stride))
            del source
            self._sources.pop(index, None)
            self._untrack(host)

        stream.submit(run)

    def held_source_bytes(self) -> int:
        """Device bytes of queued copies to host whose source is still alive."""
        return sum(nbytes for ref, nbytes in list(self._sources.values()) if ref() is not None)

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        # The host source is protected by the pool's release-after-event protocol, which the
        # poisoning of released buffers checks.
        self._check_capture("a copy queued on a side stream")
        host = self._track(src)

        def run() -> None:
            dst.copy_(src)
            self._untrack(host)

        stream.submit(run)

    def _track(self, host: torch.UntypedStorage) -> int:
        address = host.data_ptr()
        with self._inflight_lock:
            self._inflight[address] = self._inflight.get(address, 0) + 1
        return address

    def _untrack(self, address: int) -> None:
        with self._inflight_lock:
            self._inflight[address] -= 1
            if not self._inflight[address]:
                del self._inflight[address]

    def poison(self, host_buffer: torch.Tensor) -> None:
        """Called by the pool when ``host_buffer`` becomes reusable or is given back: no queued
        copy may touch any byte of it."""
        start = host_buffer.data_ptr()
        end = start + host_buffer.nbytes
        with self._inflight_lock:
            if any(start <= address < end for address in self._inflight):
                self.reuse_hazards += 1
        host_buffer.fill_(_POISON)

    def alloc_like(self, template: torch.Tensor, device: torch.device, stream: Any, consumer: Any) -> torch.Tensor:
        block = self._take_block(template.nbytes, device, stream)
        storage = block.backing[0 : template.nbytes]
        torch.empty(0, dtype=torch.uint8, device=device).set_(storage).fill_(_POISON)
        weakref.finalize(storage, self._free_block, block)
        if consumer is not stream:
            self.record_stream(block, consumer)
        return torch.empty(0, dtype=template.dtype, device=device).set_(storage, 0, template.size(), template.stride())

    def record_stream(self, block: _DeviceBlock, consumer: Any) -> None:
        """``tensor.record_stream(consumer)``: the block is reused only after consumer's work
        queued up to its free has run."""
        self.record_stream_calls += 1
        block.recorded = True

    def _take_block(self, nbytes: int, device: torch.device, stream: Any) -> _DeviceBlock:
        with self._blocks_lock:
            for index, block in enumerate(self._free_blocks):
                if (
                    block.nbytes == nbytes
                    and block.stream is stream
                    and all(event.flag.is_set() for event in block.consumer_events)
                ):
                    del self._free_blocks[index]
                    if block.free_event is not None and not block.free_event.flag.is_set():
                        self.device_reuse_hazards += 1
                    block.consumer_events = []
                    block.free_event = None
                    block.recorded = False
                    return block
        return _DeviceBlock(nbytes, device, stream)

    def _free_block(self, block: _DeviceBlock) -> None:
        # The compute work queued before the free may still read the block: ground truth, and
        # what the allocator waits for when the block was recorded for the compute stream.
        block.free_event = self.record(COMPUTE)
        if block.recorded:
            block.consumer_events.append(block.free_event)
        with self._blocks_lock:
            self._free_blocks.append(block)

    def done(self, event: _Event | None) -> bool:
        if event is None:
            return True
        self._check_capture("an event queried")
        return event.flag.is_set()

    def waited_s(self) -> float:
        return self._waited_s

    def host_wait(self, event: _Event | None) -> None:
        # The compute "stream" is the calling thread: its wait is a host wait.
        self.wait(COMPUTE, event)

    def synchronize(self) -> None:
        """Block until both worker streams have drained (for tests)."""
        for stream in (self._d2h, self._h2d):
            event = self.record(stream)
            event.flag.wait()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._d2h.close()
            self._h2d.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
