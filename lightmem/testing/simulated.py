"""An asynchronous CPU transport that behaves like CUDA streams, for testing the offload protocol.

``SimulatedAsyncTransport`` simulates one or more devices. Each has a compute stream (the calling
thread), a device-to-host and a host-to-device stream (worker threads that run each operation
after a random delay), and a caching allocator for reload memory. Events have CUDA's record/wait
meaning, and mistakes in the protocol show as wrong numbers instead of silent luck:

- a reload buffer starts filled with NaN bytes (as uninitialised device memory would be garbage);
- a host buffer is NaN-filled the moment it becomes reusable in the pool;
- a device-to-host copy whose source the caller did not keep alive until the copy ran reads NaN
  bytes, as it would read reused memory on a GPU.

A CPU tensor's simulated device is the one current when the offloader asks for its streams (at
its save): ``with transport.device(1): ...`` runs part of a forward "on device 1".

Tests switch on the other hazards of a GPU, all without real delays (each outcome is exact):

- ``hold_copies_to_host()`` / ``hold_copies_to_device()``: the copy streams run nothing queued
  from then on until released, or until the host must see one of their events complete (compute
  waits for it, ``synchronize``): then exactly the operations that event depends on run.
- ``lag_compute()``: the compute streams run behind the calling thread. Events recorded on them
  stay incomplete until ``catch_up_compute()``, or until compute waits for work that depends on
  them (then compute catches up exactly through what that work needs: on a GPU it reaches that
  point before the waiting kernel runs). A side stream that waits for such an event is counted
  (``side_waits_on_lagging_compute``).
- ``capturing_graph = True``: CUDA graph capture; querying an event or queueing work on a side
  stream then raises (both are illegal or corrupt the capture on CUDA) and is counted.

Device memory (``memory_stats()``, with ``torch.cuda.memory_stats()``'s keys) is the reload memory
the simulated caching allocator gives: blocks are kept per allocating stream and reused on it at
once after a free (stream order), except a block recorded for another stream (``record_stream``),
which stays reserved and active until the events recorded at its free have completed (processed
at the next allocation, as CUDA's allocator does). ``allocated_bytes`` drops at the free, as
torch's does, so it hides those blocks; ``active_bytes`` and ``reserved_bytes`` do not.

Ground truth the protocol is checked against, counted where it would corrupt data on a GPU:
``device_reuse_hazards`` (a reload copy wrote a block while compute work queued before the
block's previous free had not run), ``unordered_source_frees`` (a device tensor read by a queued
copy to host was freed while neither its own device's compute stream was ordered after the copy
nor the host had seen the copy complete), ``stale_reads`` and ``reuse_hazards`` (host buffers).

It is not part of the public API and not fast; it exists so the waiting and lifetime logic that
CUDA depends on runs in the CPU test suite.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

_POISON = 0xFF


class _Event:
    """``flag`` is set when the event has completed; ``needs`` maps each stream to the position
    in it this event depends on (ops of a side stream before it; a compute stream's event number)."""

    __slots__ = ("flag", "needs", "stream")

    def __init__(self, done: bool = False, stream: Any = None) -> None:
        self.flag = threading.Event()
        self.stream = stream
        self.needs: dict[Any, int] = {}
        if done:
            self.flag.set()


class ComputeStream:
    """One simulated device's compute stream: the calling thread, lagging behind it on request."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.lagging: list[_Event] | None = None  # events recorded while lagging, not yet run
        self.recorded = 0  # events recorded while lagging: their numbers
        self.ordered_after: dict[_WorkerStream, int] = {}  # side stream -> ops compute waited for
        self._lock = threading.Lock()

    def record(self) -> _Event:
        with self._lock:
            if self.lagging is None:
                return _Event(done=True, stream=self)
            self.recorded += 1
            event = _Event(stream=self)
            event.needs = {self: self.recorded}
            self.lagging.append(event)
            return event

    def catch_up(self, through: int | None = None) -> None:
        """Run the lagging compute work up to event number ``through`` (all of it for ``None``)."""
        with self._lock:
            lagging = self.lagging
            if lagging is None:
                return
            count = 0
            for event in lagging:
                if through is not None and event.needs[self] > through:
                    break
                count += 1
            ready, lagging[:count] = lagging[:count], []
        for event in ready:  # in order: a later event never completes before an earlier one
            event.flag.set()

    def __repr__(self) -> str:
        return f"ComputeStream(device={self.device})"


class _WorkerStream:
    """A FIFO of operations run by one daemon thread, each after a random delay; can be held."""

    def __init__(self, name: str, device: int, rng: random.Random, max_delay_s: float) -> None:
        self.name = name
        self.device = device
        self._rng = rng
        self._max_delay_s = max_delay_s
        self.queued = 0  # operations submitted
        self.observed = 0  # operations the host has seen complete
        self.needs: dict[Any, int] = {}  # what the operations queued so far wait for, transitively
        self._held = False
        self._allowed = 0  # while held, operations before this position may run
        self._gate = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[int, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"lightmem-sim-{name}{device}", daemon=True)
        self._thread.start()

    def submit(self, operation: Callable[[], None]) -> int:
        """Queue ``operation``; returns its position (operations before it run first)."""
        with self._gate:
            position = self.queued
            self.queued += 1
        self._queue.put((position, operation))
        return position

    def record(self) -> _Event:
        event = _Event(stream=self)
        position = self.submit(event.flag.set)
        event.needs = {**self.needs, self: position + 1}
        return event

    def hold(self) -> None:
        with self._gate:
            self._held = True
            self._allowed = self.queued

    def release(self) -> None:
        with self._gate:
            self._held = False
            self._gate.notify_all()

    def allow(self, position: int) -> None:
        """Let the operations before ``position`` run even while held."""
        with self._gate:
            if position > self._allowed:
                self._allowed = position
                self._gate.notify_all()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            position, operation = item
            del item
            with self._gate:
                while self._held and position >= self._allowed:
                    self._gate.wait()
            if self._max_delay_s > 0:
                time.sleep(self._rng.uniform(0.0, self._max_delay_s))
            operation()
            del operation  # the tensors it captured die here, not when the next one arrives

    def close(self) -> None:
        self.release()
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __repr__(self) -> str:
        return f"_WorkerStream({self.name}, device={self.device})"


class _DeviceBlock:
    """Reload memory of the simulated caching allocator: ``backing`` is reused, slices handed out."""

    __slots__ = ("backing", "free_event", "nbytes", "pending", "previous_free", "recorded_for", "stream")

    def __init__(self, nbytes: int, device: torch.device, stream: Any) -> None:
        self.backing = torch.UntypedStorage(nbytes, device=device)
        self.nbytes = nbytes
        self.stream = stream
        self.recorded_for: list[ComputeStream] = []  # record_stream(...) while handed out
        self.pending: list[_Event] = []  # recorded at the free: the allocator waits for them
        self.free_event: _Event | None = None  # ground truth: compute work queued before the free
        self.previous_free: _Event | None = None  # the free before this hand-out


class _Allocator:
    """One simulated device's caching allocator for reload memory, with CUDA's statistics."""

    def __init__(self) -> None:
        self.free: list[_DeviceBlock] = []
        self.by_address: dict[int, _DeviceBlock] = {}
        self.current = {"allocated": 0, "active": 0, "reserved": 0}
        self.peak = dict(self.current)
        self.lock = threading.Lock()

    def add(self, kind: str, nbytes: int) -> None:
        value = self.current[kind] = self.current[kind] + nbytes
        if value > self.peak[kind]:
            self.peak[kind] = value

    def process_events(self) -> None:
        """Blocks whose recorded events have all completed become free for reuse (and inactive)."""
        for block in self.free:
            if block.pending and all(event.flag.is_set() for event in block.pending):
                block.pending = []
                self.add("active", -block.nbytes)


class _Device:
    def __init__(self, index: int, rng: random.Random, max_delay_s: float) -> None:
        self.compute = ComputeStream(index)
        self.to_host = _WorkerStream("d2h", index, random.Random(rng.random()), max_delay_s)
        self.to_device = _WorkerStream("h2d", index, random.Random(rng.random()), max_delay_s)
        self.allocator = _Allocator()


_LIVE: weakref.WeakSet[SimulatedAsyncTransport] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # A worker killed at interpreter exit in the middle of a torch op aborts the process.
    for transport in list(_LIVE):
        transport.close()


def is_compute(stream: Any) -> bool:
    """Whether ``stream`` is a simulated compute stream."""
    return isinstance(stream, ComputeStream)


class SimulatedAsyncTransport:
    """CUDA-like stream semantics on CPU worker threads; see the module docstring."""

    pin_memory = False
    poison_released = True
    synchronous = False

    def __init__(self, seed: int = 0, max_delay_s: float = 0.002, devices: int = 1) -> None:
        rng = random.Random(seed)
        self._devices = [_Device(index, rng, max_delay_s) for index in range(devices)]
        self._current = 0
        self._waited_s = 0.0
        self._inflight: dict[int, int] = {}  # host buffer address -> queued copies touching it
        self._inflight_lock = threading.Lock()
        self.stale_reads = 0
        """Copies whose source had been freed before the copy ran (would be corruption on CUDA)."""
        self.reuse_hazards = 0
        """Host buffers handed back for reuse while a queued copy still touched them."""
        self.unordered_source_frees = 0
        """Sources of queued copies to host freed before their device was ordered after the copy."""
        self.capturing_graph = False
        self.capture_violations = 0
        """Event queries or side-stream work requested while a graph was being captured."""
        self.side_waits_on_lagging_compute = 0
        """Side-stream waits for a compute event that had not completed (compute running behind)."""
        self.device_reuse_hazards = 0
        """Reload copies that wrote a block while compute work queued before its last free had not run."""
        self.record_stream_calls = 0
        self.max_held_source_bytes = 0
        """The most device bytes kept alive only for queued copies to host (sampled at each copy)."""
        self._sources: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self._copies = 0  # copies to host submitted (keys of ``_sources``)
        self._closed = False
        _LIVE.add(self)

    # -- devices ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        """Tensors saved inside belong to simulated device ``index`` (``torch.cuda.device``)."""
        previous, self._current = self._current, index
        try:
            yield
        finally:
            self._current = previous

    def streams(self, device: torch.device) -> tuple[Any, Any, Any]:
        current = self._devices[self._current]
        return current.compute, current.to_host, current.to_device

    def memory_stats(self, device: int | None = None) -> dict[str, int]:
        """``torch.cuda.memory_stats()``'s keys for the reload memory of simulated ``device``
        (the current one by default)."""
        allocator = self._devices[self._current if device is None else device].allocator
        with allocator.lock:
            stats = {}
            for kind in ("allocated", "active", "reserved"):
                stats[f"{kind}_bytes.all.current"] = allocator.current[kind]
                stats[f"{kind}_bytes.all.peak"] = allocator.peak[kind]
            return stats

    # -- hazards a test switches on ----------------------------------------------------------

    def capturing(self) -> bool:
        return self.capturing_graph

    def _check_capture(self, what: str) -> None:
        if self.capturing_graph:
            self.capture_violations += 1
            raise RuntimeError(f"simulated CUDA graph capture: {what} while capturing")

    def hold_copies_to_host(self) -> None:
        """Copies to host queued from now on do not run until released (or waited for)."""
        for device in self._devices:
            device.to_host.hold()

    def release_copies_to_host(self) -> None:
        for device in self._devices:
            device.to_host.release()

    def hold_copies_to_device(self) -> None:
        """Reload copies queued from now on do not run until released (or waited for)."""
        for device in self._devices:
            device.to_device.hold()

    def release_copies_to_device(self) -> None:
        for device in self._devices:
            device.to_device.release()

    def lag_compute(self) -> None:
        """Compute events recorded from now on stay incomplete until compute catches up."""
        for device in self._devices:
            compute = device.compute
            with compute._lock:
                if compute.lagging is None:
                    compute.lagging = []

    def catch_up_compute(self, stop_lagging: bool = True) -> None:
        for device in self._devices:
            device.compute.catch_up()
            if stop_lagging:
                device.compute.lagging = None

    # -- stream primitives --------------------------------------------------------------------

    def record(self, stream: Any) -> _Event:
        if is_compute(stream):
            return stream.record()
        self._check_capture("an event recorded on a side stream")
        return stream.record()

    def _force(self, event: _Event) -> None:
        """Let everything ``event`` depends on run (the host is about to block on it)."""
        for stream, position in list(event.needs.items()):
            if is_compute(stream):
                stream.catch_up(position)
            else:
                stream.allow(position)

    def wait(self, stream: Any, event: _Event | None) -> None:
        if event is None:
            return
        if is_compute(stream):
            for side, position in event.needs.items():
                if not is_compute(side) and side.device == stream.device:
                    stream.ordered_after[side] = max(stream.ordered_after.get(side, 0), position)
            self.host_wait(event)  # the compute stream is the training thread here
            return
        self._check_capture("a side stream waiting for an event (it would join the capture)")
        if is_compute(event.stream) and not event.flag.is_set():
            self.side_waits_on_lagging_compute += 1
        for other, position in event.needs.items():
            if position > stream.needs.get(other, 0):
                stream.needs[other] = position
        stream.submit(event.flag.wait)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        # Hold the device source's storage weakly: only the caller may keep its memory from
        # reuse, as with CUDA's caching allocator.
        self._check_capture("a copy queued on a side stream")
        self.max_held_source_bytes = max(self.max_held_source_bytes, self.held_source_bytes())
        storage = src.untyped_storage()
        layout = (src.dtype, src.storage_offset(), src.size(), src.stride())
        src_ref = weakref.ref(storage)
        index = self._copies
        self._copies += 1
        self._sources[index] = (src_ref, storage.nbytes())
        position = stream.queued  # the copy's position: submitted next (one host thread queues)
        weakref.finalize(storage, self._source_freed, stream, position)
        del src, storage
        host = self._track(dst)

        def run() -> None:
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

    def _source_freed(self, stream: _WorkerStream, position: int) -> None:
        compute = self._devices[stream.device].compute
        if position >= max(stream.observed, compute.ordered_after.get(stream, 0)):
            self.unordered_source_frees += 1

    def held_source_bytes(self) -> int:
        """Device bytes of queued copies to host whose source is still alive."""
        return sum(nbytes for ref, nbytes in list(self._sources.values()) if ref() is not None)

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        # The host source is protected by the pool's release-after-event protocol, which the
        # poisoning of released buffers checks.
        self._check_capture("a copy queued on a side stream")
        host = self._track(src)
        allocator = self._devices[stream.device].allocator
        block = allocator.by_address.get(dst.untyped_storage().data_ptr())
        previous_free = None if block is None else block.previous_free

        def run() -> None:
            if previous_free is not None and not previous_free.flag.is_set():
                self.device_reuse_hazards += 1
            dst.copy_(src)
            self._untrack(host)

        stream.submit(run)

    def _track(self, host: torch.Tensor) -> int:
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

    # -- the caching allocator ----------------------------------------------------------------

    def alloc_like(self, template: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
        allocator = self._devices[stream.device].allocator
        nbytes = template.nbytes
        block = self._take_block(allocator, nbytes, device, stream)
        storage = block.backing[0:nbytes]
        torch.empty(0, dtype=torch.uint8, device=device).set_(storage).fill_(_POISON)
        weakref.finalize(storage, self._free_block, allocator, block)
        return torch.empty(0, dtype=template.dtype, device=device).set_(storage, 0, template.size(), template.stride())

    def record_stream(self, tensor: torch.Tensor, stream: ComputeStream) -> None:
        """``tensor.record_stream(stream)`` for a tensor from ``alloc_like``: at its free, an event
        is recorded on ``stream`` and the block is reused only once it has completed."""
        self.record_stream_calls += 1
        address = tensor.untyped_storage().data_ptr()
        for device in self._devices:
            block = device.allocator.by_address.get(address)
            if block is not None:
                block.recorded_for.append(stream)

    def _take_block(self, allocator: _Allocator, nbytes: int, device: torch.device, stream: Any) -> _DeviceBlock:
        with allocator.lock:
            allocator.process_events()
            for index, block in enumerate(allocator.free):
                if block.nbytes == nbytes and block.stream is stream and not block.pending:
                    del allocator.free[index]
                    break
            else:
                block = _DeviceBlock(nbytes, device, stream)
                allocator.by_address[block.backing.data_ptr()] = block
                allocator.add("reserved", nbytes)
            block.previous_free, block.free_event = block.free_event, None
            block.recorded_for = []
            allocator.add("allocated", nbytes)
            allocator.add("active", nbytes)
            return block

    def _free_block(self, allocator: _Allocator, block: _DeviceBlock) -> None:
        # Ground truth: the work queued on the block's device before the free may still read it.
        block.free_event = self._devices[block.stream.device].compute.record()
        block.pending = [stream.record() for stream in block.recorded_for]
        with allocator.lock:
            allocator.add("allocated", -block.nbytes)
            if not block.pending:
                allocator.add("active", -block.nbytes)
            allocator.free.append(block)

    # -- queries ------------------------------------------------------------------------------

    def done(self, event: _Event | None) -> bool:
        if event is None:
            return True
        self._check_capture("an event queried")
        if not event.flag.is_set():
            return False
        for stream, position in event.needs.items():
            if not is_compute(stream) and position > stream.observed:
                stream.observed = position
        return True

    def waited_s(self) -> float:
        return self._waited_s

    def host_wait(self, event: _Event | None) -> None:
        """Block the calling thread until ``event`` has run (``torch.cuda.Event.synchronize``)."""
        if event is None or event.flag.is_set():
            return
        start = time.perf_counter()
        self._force(event)
        event.flag.wait()
        self._waited_s += time.perf_counter() - start

    def synchronize(self) -> None:
        """Block until every stream of every device has drained (``torch.cuda.synchronize``)."""
        for device in self._devices:
            device.compute.catch_up()
            for stream in (device.to_host, device.to_device):
                event = stream.record()
                self._force(event)
                event.flag.wait()
                stream.observed = max(stream.observed, event.needs[stream])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for device in self._devices:
                device.compute.catch_up()
                device.to_host.close()
                device.to_device.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
