"""An asynchronous CPU transport that follows CUDA's stream rules, for testing the offload protocol.

``SimulatedAsyncTransport`` simulates one or more devices. The host is the calling thread. Each
device has compute streams, a device-to-host and a host-to-device copy stream, and a caching
allocator for reload memory. Every stream, compute included, is its own executor (a worker thread
that runs what was queued on it in order, each operation after a random delay), so the GPU lags
the host as it does on CUDA. It must never be kinder than CUDA (docs/gpu-path.md lists, point by
point, what it models and what it cannot):

- **A wait on a compute stream orders device work only.** ``wait(compute, event)`` never blocks
  the host and never makes a host buffer current: only ``host_wait``, ``synchronize`` and a
  completed ``done`` do. A host read of a buffer that a queued copy will write sees the old bytes.
- **Compute lags the host.** Events recorded on a compute stream complete when its executor
  reaches them, after the work queued before them; ``lag_compute()`` stops it until
  ``catch_up_compute()`` or until the host must see one of its events complete.
- **A non-blocking copy writes its destination when its stream runs it**, and the destination's
  version counter is bumped when the copy is queued (as ``copy_(..., non_blocking=True)`` does):
  a read that races a queued copy gives silently different values, never autograd's in-place
  error.
- **Several compute streams per device**: ``with transport.stream(k): ...`` makes compute stream
  ``k`` of the current device current (``torch.cuda.stream``); each orders only its own work.
- **The caching allocators round as torch's do**: reload memory in 512-byte blocks
  (``memory_stats()``), ``pinned_empty`` (``torch.empty(..., pin_memory=True)``) in powers of two,
  cached after free (``pinned_stats()``); ``page_lock`` counts ``cudaHostRegister`` at exact size.
- **Events are counted** (``live_events``), so a leak of events shows.
- **Graph capture is per stream** (``begin_capture()``): while the current stream captures, an
  event query, a host wait and side-stream work raise, as they are illegal or corrupt the capture
  on CUDA, and are counted.

Torch's own kernels run at once on the calling thread (they cannot be delayed), so eager compute
reads device memory at the moment the host queues the op. The device work a compute stream was
ordered after must therefore be visible to it at its wait: ``wait(compute, event)`` performs the
device side of the copies ``event`` depends on right there (a copy to host reads its source; a
copy to the device writes its destination, after the host bytes it reads), and leaves their host
side (writing a host buffer, completing the event) to the copy stream's executor.

Mistakes in the protocol show as wrong numbers instead of silent luck:

- a reload buffer starts filled with NaN bytes (as uninitialised device memory would be garbage);
- a host buffer is NaN-filled the moment it becomes reusable in the pool;
- a device-to-host copy whose source the caller did not keep alive until the copy ran reads NaN
  bytes, as it would read reused memory on a GPU.

Tests switch on the other hazards of a GPU, all without real delays (each outcome is exact):

- ``hold_copies_to_host()`` / ``hold_copies_to_device()``: the copy streams run nothing queued
  from then on until released, or until the host must see one of their events complete
  (``host_wait``, ``synchronize``): then exactly the operations that event depends on run. A
  compute wait performs only the device side, as above.
- ``lag_compute()``: the compute streams run nothing queued from then on until
  ``catch_up_compute()`` or a host wait that depends on them. A side stream that waits for such an
  event is counted (``side_waits_on_lagging_compute``).

Device memory (``memory_stats()``, with ``torch.cuda.memory_stats()``'s keys) is the reload memory
the simulated caching allocator gives: blocks are kept per allocating stream and reused on it at
once after a free (stream order), except a block recorded for another stream (``record_stream``),
which stays reserved and active until the events recorded at its free have completed (processed
at the next allocation, as CUDA's allocator does). ``allocated_bytes`` drops at the free, as
torch's does, so it hides those blocks; ``active_bytes`` and ``reserved_bytes`` do not.

Ground truth the protocol is checked against, counted where it would corrupt data on a GPU:
``device_reuse_hazards`` (a reload copy wrote a block without being ordered after the compute
work queued before the block's previous free), ``unordered_source_frees`` (a device tensor read by a queued
copy to host was freed while neither a compute stream of its device was ordered after the copy
nor the host had seen the copy complete), ``stale_reads`` and ``reuse_hazards`` (host buffers);
``ordered_after_copies(stream)`` says whether a compute stream was ordered after every copy to its
device.

It is not part of the public API and not fast; it exists so the waiting and lifetime logic that
CUDA depends on runs in the CPU test suite.
"""

from __future__ import annotations

import atexit
import contextlib
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightmem.testing.streams import (
    Allocator,
    ComputeStream,
    Copy,
    Counter,
    Device,
    DeviceBlock,
    Event,
    PinnedAllocator,
    Runtime,
    Stream,
    POISON_BYTE,
    alias_of,
    device_block_size,
    fill_poison,
    is_compute,
)


_LIVE: weakref.WeakSet[SimulatedAsyncTransport] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # A worker killed at interpreter exit in the middle of a torch op aborts the process.
    for transport in list(_LIVE):
        transport.close()


class SimulatedAsyncTransport:
    """CUDA's stream semantics on CPU worker threads; see the module docstring."""

    pin_memory = False
    poison_released = True
    synchronous = False

    def __init__(self, seed: int = 0, max_delay_s: float = 0.002, devices: int = 1, page_locking: bool = False) -> None:
        rng = random.Random(seed)
        self.page_locking = page_locking
        """Host memory is pageable unless page-locked through ``runtime`` (``cudaHostRegister``):
        a copy to pageable host memory blocks the host, a copy from it is staged at once. Off,
        every host buffer counts as page-locked (no registration anywhere)."""
        if page_locking:
            self.pin_memory = True
        self.runtime = Runtime()
        """``torch.cuda.cudart()`` for page-locking: ``cudaHostRegister`` / ``cudaHostUnregister``."""
        self.pageable_copies = 0
        """Copies between the device and pageable host memory (synchronous or staged on CUDA)."""
        self._devices = [Device(index, rng, max_delay_s) for index in range(devices)]
        self._current = 0
        self._waited_s = 0.0
        self._events = Counter()
        self._inflight: dict[int, int] = {}  # host buffer address -> queued copies touching it
        self._inflight_lock = threading.Lock()
        self._pinned = PinnedAllocator()
        self.stale_reads = 0
        """Copies whose source had been freed before the copy ran (would be corruption on CUDA)."""
        self.reuse_hazards = 0
        """Host buffers handed back for reuse while a queued copy still touched them."""
        self.unordered_source_frees = 0
        """Sources of queued copies to host freed before their device was ordered after the copy."""
        self.capture_violations = 0
        """Event queries, host waits or side-stream work requested while a graph was being captured."""
        self.side_waits_on_lagging_compute = 0
        """Side-stream waits for a compute event that had not completed (compute running behind)."""
        self.device_reuse_hazards = 0
        """Reload copies that wrote a block without being ordered after the compute work queued
        before its last free (ordering, not luck: a free that happened to have run counts too)."""
        self.record_stream_calls = 0
        self.host_races = 0
        """Host writes to a buffer a queued copy reads (to the device) or writes (to host) before the
        copy stream ran it: on a GPU the copy reads the new bytes, or overwrites the host's."""
        self.host_waits = 0
        """Host waits that found their event incomplete and blocked the calling thread."""
        self.max_held_source_bytes = 0
        """The most device bytes kept alive only for queued copies to host (sampled at each copy)."""
        self._sources: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self._copies = 0  # copies to host submitted (keys of ``_sources``)
        self._closed = False
        _LIVE.add(self)

    # -- devices and streams ------------------------------------------------------------------

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        """Tensors saved inside belong to simulated device ``index`` (``torch.cuda.device``)."""
        previous, self._current = self._current, index
        try:
            yield
        finally:
            self._current = previous

    @contextlib.contextmanager
    def stream(self, index: int) -> Iterator[ComputeStream]:
        """Compute stream ``index`` of the current device is current inside (``torch.cuda.stream``);
        stream 0 is the default one."""
        device = self._devices[self._current]
        stream = device.compute_stream(index)
        previous, device.current = device.current, index
        try:
            yield stream
        finally:
            device.current = previous

    def current_stream(self) -> ComputeStream:
        return self._devices[self._current].compute

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

    @property
    def live_events(self) -> int:
        """Events created by ``record`` that are still alive (a leak grows it step after step)."""
        return self._events.value

    # -- page-locked host memory ----------------------------------------------------------------

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)``: torch's host caching
        allocator takes the next power of two and keeps it cached after the tensor dies."""
        size = self._pinned.take(nbytes)
        tensor = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        weakref.finalize(tensor.untyped_storage(), self._pinned.give_back, size, nbytes)
        return tensor

    def pinned_stats(self) -> dict[str, int]:
        """Page-locked host memory as torch's host caching allocator holds it: ``reserved`` (cached
        included), ``allocated`` (rounded blocks in use), ``requested`` (what was asked for)."""
        pinned = self._pinned
        with pinned.lock:
            return {"reserved": pinned.reserved, "allocated": pinned.allocated, "requested": pinned.requested}

    def empty_pinned_cache(self) -> None:
        """``torch._C._host_emptyCache()``: cached page-locked blocks go back to the OS."""
        self._pinned.empty_cache()

    def is_page_locked(self, host: torch.Tensor) -> bool:
        """Whether every byte of ``host`` lies in one registration: a range spanning two separate
        ``cudaHostRegister`` calls is not assumed page-locked (CUDA does not promise it)."""
        if not self.page_locking:
            return True
        address = host.data_ptr()
        end = address + host.nbytes
        ranges = list(self.runtime.ranges.items())
        return any(start <= address and end <= start + size for start, size in ranges)

    # -- hazards a test switches on ----------------------------------------------------------

    def capturing(self) -> bool:
        """Whether the current compute stream captures a graph."""
        return self.current_stream().capturing

    @property
    def capturing_graph(self) -> bool:
        return self.capturing()

    @capturing_graph.setter
    def capturing_graph(self, value: bool) -> None:
        self.current_stream().capturing = value

    @contextlib.contextmanager
    def begin_capture(self) -> Iterator[None]:
        """Capture a graph on the current compute stream inside (``torch.cuda.graph``)."""
        stream = self.current_stream()
        stream.capturing = True
        try:
            yield
        finally:
            stream.capturing = False

    def _any_capturing(self) -> bool:
        return any(stream.capturing for device in self._devices for stream in device.computes)

    def _check_capture(self, what: str) -> None:
        # torch captures in cudaStreamCaptureModeGlobal: these calls are illegal from any thread
        # while any stream captures.
        if self._any_capturing():
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
        """Compute work queued from now on does not run until compute catches up (or the host
        waits for it)."""
        for device in self._devices:
            for compute in device.computes:
                compute.hold()

    def catch_up_compute(self, stop_lagging: bool = True) -> None:
        """The compute streams run everything queued so far; the host waits until they have."""
        for device in self._devices:
            for compute in device.computes:
                self._drain(compute)
                if stop_lagging:
                    compute.release()

    # -- stream primitives --------------------------------------------------------------------

    def record(self, stream: Any) -> Event:
        if not is_compute(stream):
            self._check_capture("an event recorded on a side stream")
        return stream.record(self._events)

    def _force(self, event: Event) -> None:
        """Let everything ``event`` depends on run (the host is about to block on it)."""
        for stream, position in list(event.needs.items()):
            stream.allow(position)

    def _device_side(self, needs: dict[Any, int]) -> None:
        """Perform now the device side of the copies ``needs`` covers (see the module docstring):
        a copy to host reads its source; a copy to the device is made whole, after the copies to
        host whose host bytes it reads."""
        for stream, position in list(needs.items()):
            if is_compute(stream):
                continue
            if stream.name == "d2h":
                for copy in stream.copies_before(position):
                    copy.read()
            else:
                self._complete({stream: position})

    def _complete(self, needs: dict[Any, int]) -> None:
        """Run the copies ``needs`` covers whole (both halves), in the calling thread."""
        for stream, position in list(needs.items()):
            if not is_compute(stream):
                for copy in stream.copies_before(position):
                    if not copy.done_write:
                        self._complete(copy.after)
                        copy.write()

    def wait(self, stream: Any, event: Event | None) -> None:
        if event is None:
            return
        if is_compute(stream):
            for side, position in event.needs.items():
                if not is_compute(side) and side.device == stream.device:
                    stream.ordered_after[side] = max(stream.ordered_after.get(side, 0), position)
            self._device_side(event.needs)
        else:
            self._check_capture("a side stream waiting for an event (it would join the capture)")
            if is_compute(event.stream) and not event.flag.is_set():
                self.side_waits_on_lagging_compute += 1
        for other, position in event.needs.items():
            if position > stream.needs.get(other, 0):
                stream.needs[other] = position
        stream.submit(event.flag.wait)

    def ordered_after_copies(self, stream: ComputeStream) -> bool:
        """Whether compute ``stream`` is ordered after every copy to its device queued so far."""
        to_device = self._devices[stream.device].to_device
        return stream.needs.get(to_device, 0) >= to_device.copies_end

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
        torch.autograd.graph.increment_version(dst)  # as copy_(non_blocking=True) does when queued
        destination = alias_of(dst)
        host_written = self._watch_host(dst)  # checked when the copy writes, before it does
        del dst

        def read() -> torch.Tensor | None:
            source = src_ref()
            self._sources.pop(index, None)
            if source is None:
                self.stale_reads += 1
                return None
            dtype, offset, size, stride = layout
            return torch.empty(0, dtype=dtype, device=source.device).set_(source, offset, size, stride).clone()

        def write(snapshot: torch.Tensor | None) -> None:
            host_written()
            if snapshot is None:
                fill_poison(destination)
            else:
                destination.copy_(snapshot)
            self._untrack(host)

        copy = Copy(read, write, dict(stream.needs))
        position = stream.submit(copy)
        if not self.is_page_locked(destination):
            # Into pageable memory the CUDA runtime copies synchronously: the host blocks until
            # the copy (and the copies before it on its stream) has run.
            self.pageable_copies += 1
            self._complete({stream: position + 1})

    def _source_freed(self, stream: Stream, position: int) -> None:
        computes = self._devices[stream.device].computes
        ordered = max(compute.ordered_after.get(stream, 0) for compute in computes)
        if position >= max(stream.observed, ordered):
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
        torch.autograd.graph.increment_version(dst)  # as copy_(non_blocking=True) does when queued
        destination = alias_of(dst)
        del dst
        on_run = self._watch_host(src)

        def read() -> torch.Tensor:
            snapshot = src.clone()
            self._untrack(host)
            return snapshot

        after = dict(stream.needs)

        def write(snapshot: torch.Tensor | None) -> None:
            # Unsafe unless ordered after the free: a flag that happens to be set is luck.
            if previous_free is not None:
                freed_on = previous_free.stream
                if after.get(freed_on, 0) < previous_free.needs[freed_on]:
                    self.device_reuse_hazards += 1
            destination.copy_(snapshot)

        copy = Copy(read, write, after, on_run)
        stream.submit(copy)
        if not self.is_page_locked(src):
            self.pageable_copies += 1
            copy.read()  # staged: the runtime copies pageable memory into its own buffer at once

    def _watch_host(self, host: torch.Tensor) -> Callable[[], None]:
        """A check, for when the copy stream runs a copy touching ``host``: had the host written its
        bytes since the copy was queued? (Compared byte for byte: a fused optimizer kernel writes
        in place without bumping the version counter, and NaN bytes compare equal as bytes.)"""
        start = host.storage_offset() * host.element_size()
        raw = torch.empty(0, dtype=torch.uint8, device=host.device).set_(host.untyped_storage(), start, (host.nbytes,))
        queued = raw.clone()

        def check() -> None:
            if not torch.equal(raw, queued):
                self.host_races += 1

        return check

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
        host_buffer.fill_(POISON_BYTE)

    # -- the caching allocator ----------------------------------------------------------------

    def alloc_like(self, template: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
        allocator = self._devices[stream.device].allocator
        nbytes = template.nbytes
        block = self._take_block(allocator, device_block_size(nbytes), device, stream)
        storage = block.backing[0:nbytes]
        torch.empty(0, dtype=torch.uint8, device=device).set_(storage).fill_(POISON_BYTE)
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

    def _take_block(self, allocator: Allocator, nbytes: int, device: torch.device, stream: Any) -> DeviceBlock:
        with allocator.lock:
            allocator.process_events()
            for index, block in enumerate(allocator.free):
                if block.nbytes == nbytes and block.stream is stream and not block.pending:
                    del allocator.free[index]
                    break
            else:
                block = DeviceBlock(nbytes, device, stream)
                allocator.by_address[block.backing.data_ptr()] = block
                allocator.add("reserved", nbytes)
            block.previous_free, block.free_event = block.free_event, None
            block.recorded_for = []
            allocator.add("allocated", nbytes)
            allocator.add("active", nbytes)
            return block

    def _free_block(self, allocator: Allocator, block: DeviceBlock) -> None:
        # Ground truth: the work queued on the block's stream before the free may still read it.
        block.free_event = block.stream.record()
        block.pending = [stream.record() for stream in block.recorded_for]
        with allocator.lock:
            allocator.add("allocated", -block.nbytes)
            if not block.pending:
                allocator.add("active", -block.nbytes)
            allocator.free.append(block)

    # -- queries ------------------------------------------------------------------------------

    def done(self, event: Event | None) -> bool:
        if event is None:
            return True
        self._check_capture("an event queried")
        if not event.flag.is_set():
            return False
        for stream, position in event.needs.items():
            if position > stream.observed:
                stream.observed = position
        return True

    def waited_s(self) -> float:
        return self._waited_s

    def host_wait(self, event: Event | None) -> None:
        """Block the calling thread until ``event`` has run (``torch.cuda.Event.synchronize``)."""
        if event is None:
            return
        self._check_capture("a host wait for an event")
        if not event.flag.is_set():
            self.host_waits += 1
            start = time.perf_counter()
            self._force(event)
            event.flag.wait()
            self._waited_s += time.perf_counter() - start
        for stream, position in event.needs.items():
            if position > stream.observed:
                stream.observed = position

    def _drain(self, stream: Stream) -> None:
        event = stream.record()
        self._force(event)
        event.flag.wait()
        stream.observed = max(stream.observed, event.needs[stream])

    def synchronize(self) -> None:
        """Block until every stream of every device has drained (``torch.cuda.synchronize``)."""
        self._check_capture("a synchronize")
        for device in self._devices:
            for stream in device.streams():
                self._drain(stream)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for device in self._devices:
                for stream in device.streams():
                    stream.release()
                for stream in device.streams():
                    stream.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
