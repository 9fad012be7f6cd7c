"""An asynchronous CPU transport that behaves like CUDA streams, for testing the offload protocol.

``SimulatedAsyncTransport`` runs every copy later, on one worker thread per "stream", after a
random delay, and gives events CUDA's record/wait meaning. It also makes mistakes in the protocol
visible as wrong numbers instead of silent luck:

- a reload buffer starts filled with NaN bytes (as uninitialised device memory would be garbage);
- a host buffer is NaN-filled the moment it becomes reusable in the pool;
- a device-to-host copy whose source the caller did not keep alive until the copy ran reads NaN
  bytes, as it would read reused memory on a GPU.

The compute "stream" is the calling thread, which is synchronous: waits queued on it block the
caller. It is not part of the public API and not fast; it exists so the waiting and lifetime logic
that CUDA depends on runs in the CPU test suite.
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
    __slots__ = ("flag",)

    def __init__(self, done: bool = False) -> None:
        self.flag = threading.Event()
        if done:
            self.flag.set()


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
        self._closed = False
        _LIVE.add(self)

    def streams(self, device: torch.device) -> tuple[Any, Any, Any]:
        return COMPUTE, self._d2h, self._h2d

    def record(self, stream: Any) -> _Event:
        if stream is COMPUTE:
            return _Event(done=True)
        event = _Event()
        stream.submit(event.flag.set)
        return event

    def wait(self, stream: Any, event: _Event | None) -> None:
        if event is None:
            return
        if stream is COMPUTE:
            if not event.flag.is_set():
                start = time.perf_counter()
                event.flag.wait()
                self._waited_s += time.perf_counter() - start
            return
        stream.submit(event.flag.wait)

    def copy_to_host(self, dst: torch.UntypedStorage, src: torch.UntypedStorage, stream: Any) -> None:
        # Hold the device source weakly: only the caller may keep its memory from reuse, as with
        # CUDA's caching allocator.
        src_ref = weakref.ref(src)
        del src
        host = self._track(dst)

        def run() -> None:
            source = src_ref()
            if source is None:
                self.stale_reads += 1
                torch.empty(0, dtype=torch.uint8).set_(dst).fill_(_POISON)
            else:
                dst.copy_(source)
            self._untrack(host)

        stream.submit(run)

    def copy_to_device(self, dst: torch.UntypedStorage, src: torch.UntypedStorage, stream: Any) -> None:
        # The host source is protected by the pool's release-after-event protocol, which the
        # poisoning of released buffers checks.
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

    def alloc(self, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        storage = torch.UntypedStorage(nbytes, device=device)
        torch.empty(0, dtype=torch.uint8, device=device).set_(storage).fill_(_POISON)
        return storage

    def alloc_tensor(self, size: Any, stride: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = torch.empty_strided(size, stride, dtype=dtype, device=device)
        torch.empty(0, dtype=torch.uint8, device=device).set_(tensor.untyped_storage()).fill_(_POISON)
        return tensor

    def done(self, event: _Event | None) -> bool:
        return event is None or event.flag.is_set()

    def waited_s(self) -> float:
        return self._waited_s

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
