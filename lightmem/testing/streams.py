"""The simulated GPU's parts, for ``SimulatedAsyncTransport`` (``lightmem.testing.simulated``).

Streams that run what is queued on them on threads of their own (``Stream``, ``ComputeStream``),
the events recorded on them and the copies queued on them (``Event``, ``Copy``), one device's
streams and reload allocator (``Device``, ``Allocator``, ``DeviceBlock``), torch's host caching
allocator for ``pin_memory=True`` (``PinnedAllocator``) and the CUDA runtime's page-locking calls
(``Runtime``). The transport composes them and keeps CUDA's rules; each part here only keeps its
own state.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

DEVICE_BLOCK_BYTES = 512
"""The CUDA caching allocator rounds every block to a multiple of 512 bytes."""


def device_block_size(nbytes: int) -> int:
    """The bytes torch's CUDA caching allocator gives a request of ``nbytes`` (512-byte rounding)."""
    return max(DEVICE_BLOCK_BYTES, -(-nbytes // DEVICE_BLOCK_BYTES) * DEVICE_BLOCK_BYTES)


def pinned_block_size(nbytes: int) -> int:
    """The bytes torch's host caching allocator (``pin_memory=True``) takes for ``nbytes``: the next
    power of two (torch 2.13 at its default settings)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


class Counter:
    __slots__ = ("lock", "value")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value = 0

    def add(self, amount: int) -> None:
        with self.lock:
            self.value += amount


class Event:
    """``flag`` is set when the event has completed; ``needs`` maps each stream to the number of
    operations of it this event depends on (transitively)."""

    __slots__ = ("__weakref__", "counter", "flag", "needs", "stream")

    def __init__(self, done: bool = False, stream: Any = None, counter: Counter | None = None) -> None:
        self.flag = threading.Event()
        self.stream = stream
        self.needs: dict[Any, int] = {}
        self.counter = counter
        if counter is not None:
            counter.add(1)
        if done:
            self.flag.set()

    def __del__(self) -> None:
        if self.counter is not None:
            self.counter.add(-1)


class Copy:
    """A copy queued on a copy stream, in two halves that may run at different times: ``read``
    (its source into a private snapshot) and ``write`` (the snapshot into its destination). The
    stream's executor runs both; a compute stream's wait runs the device side early."""

    __slots__ = (
        "after", "done_read", "done_write", "lock", "on_run", "read_source", "snapshot", "write_destination",
    )  # fmt: skip

    def __init__(
        self, read_source: Callable[[], torch.Tensor | None], write_destination: Callable[[torch.Tensor | None], None],
        after: dict[Any, int], on_run: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.read_source = read_source
        self.write_destination = write_destination
        self.after = after  # operations of other streams this copy waits for
        self.on_run = on_run  # ground truth, when the copy stream runs it (the host may see it done after)
        self.snapshot: torch.Tensor | None = None
        self.done_read = self.done_write = False
        self.lock = threading.RLock()

    def read(self) -> None:
        with self.lock:
            if not self.done_read:
                self.snapshot = self.read_source()
                self.done_read = True

    def write(self) -> None:
        with self.lock:
            self.read()
            if not self.done_write:
                self.write_destination(self.snapshot)
                self.done_write = True
                # The memory it touched is free to die now, though the executor runs it later.
                self.snapshot = self.read_source = self.write_destination = None  # type: ignore[assignment]

    def __call__(self) -> None:
        self.write()
        if self.on_run is not None:
            on_run, self.on_run = self.on_run, None
            on_run()


class Stream:
    """A FIFO of operations run by one daemon thread, each after a random delay; can be held."""

    def __init__(self, name: str, device: int, rng: random.Random, max_delay_s: float) -> None:
        self.name = name
        self.device = device
        self._rng = rng
        self._max_delay_s = max_delay_s
        self.queued = 0  # operations submitted
        self.observed = 0  # operations the host has seen complete
        self.needs: dict[Any, int] = {}  # what the operations queued so far wait for, transitively
        self.copies: dict[int, Copy] = {}  # position -> copy not yet run by the executor
        self.copies_end = 0  # the position after the last copy queued
        self.capturing = False
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
            if type(operation) is Copy:
                self.copies[position] = operation
                self.copies_end = position + 1
        self._queue.put((position, operation))
        return position

    def record(self, counter: Counter | None = None) -> Event:
        event = Event(stream=self, counter=counter)
        position = self.submit(event.flag.set)
        event.needs = {**self.needs, self: position + 1}
        return event

    def copies_before(self, position: int) -> list[Copy]:
        with self._gate:
            return [copy for index, copy in sorted(self.copies.items()) if index < position]

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
            if type(operation) is Copy:
                with self._gate:
                    self.copies.pop(position, None)
            del operation  # the tensors it captured die here, not when the next one arrives

    def close(self) -> None:
        self.release()
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, device={self.device})"


class ComputeStream(Stream):
    """A compute stream of one simulated device: an executor of its own that lags the host."""

    def __init__(self, device: int, index: int, rng: random.Random, max_delay_s: float) -> None:
        super().__init__(f"compute{index}-", device, rng, max_delay_s)
        self.index = index
        self.ordered_after: dict[Stream, int] = {}  # side stream -> its operations this stream waited for


class DeviceBlock:
    """Reload memory of the simulated caching allocator: ``backing`` is reused, slices handed out."""

    __slots__ = ("backing", "free_event", "nbytes", "pending", "previous_free", "recorded_for", "stream")

    def __init__(self, nbytes: int, device: torch.device, stream: Any) -> None:
        self.backing = torch.UntypedStorage(nbytes, device=device)
        self.nbytes = nbytes
        self.stream = stream
        self.recorded_for: list[ComputeStream] = []  # record_stream(...) while handed out
        self.pending: list[Event] = []  # recorded at the free: the allocator waits for them
        self.free_event: Event | None = None  # ground truth: compute work queued before the free
        self.previous_free: Event | None = None  # the free before this hand-out


class Allocator:
    """One simulated device's caching allocator for reload memory, with CUDA's statistics."""

    def __init__(self) -> None:
        self.free: list[DeviceBlock] = []
        self.by_address: dict[int, DeviceBlock] = {}
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


class Device:
    def __init__(self, index: int, rng: random.Random, max_delay_s: float) -> None:
        self.index = index
        self._rng = rng
        self._max_delay_s = max_delay_s
        self.computes = [self._new_compute(0)]
        self.current = 0
        self.to_host = Stream("d2h", index, random.Random(rng.random()), max_delay_s)
        self.to_device = Stream("h2d", index, random.Random(rng.random()), max_delay_s)
        self.allocator = Allocator()

    def _new_compute(self, index: int) -> ComputeStream:
        return ComputeStream(self.index, index, random.Random(self._rng.random()), self._max_delay_s)

    @property
    def compute(self) -> ComputeStream:
        """The current compute stream of this device."""
        return self.computes[self.current]

    def compute_stream(self, index: int) -> ComputeStream:
        while len(self.computes) <= index:
            self.computes.append(self._new_compute(len(self.computes)))
        return self.computes[index]

    def streams(self) -> list[Stream]:
        return [*self.computes, self.to_host, self.to_device]


class PinnedAllocator:
    """torch's host caching allocator for ``pin_memory=True``: power-of-two blocks, cached after free."""

    def __init__(self) -> None:
        self.cached: dict[int, int] = {}  # block size -> free blocks of it
        self.reserved = 0
        self.allocated = 0
        self.requested = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> int:
        size = pinned_block_size(nbytes)
        with self.lock:
            if self.cached.get(size):
                self.cached[size] -= 1
            else:
                self.reserved += size
            self.allocated += size
            self.requested += nbytes
        return size

    def give_back(self, size: int, nbytes: int) -> None:
        with self.lock:
            self.cached[size] = self.cached.get(size, 0) + 1
            self.allocated -= size
            self.requested -= nbytes

    def empty_cache(self) -> None:
        with self.lock:
            self.reserved -= sum(size * count for size, count in self.cached.items())
            self.cached.clear()


class Runtime:
    """What lightmem calls of ``torch.cuda.cudart()`` to page-lock host memory, on the simulated GPU:
    registrations are ranges the copies consult (``SimulatedAsyncTransport(page_locking=True)``).

    A registration takes effect when its call returns, as on CUDA. Tests order background
    registrations without sleeping: ``hold_registrations()`` makes calls wait (``waiting`` is set
    while one does) until ``release_registrations()``; ``register_threads`` lists the thread of
    each call; ``register_error`` makes calls fail with that CUDA error code."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}  # start address -> bytes
        self.register_threads: list[int] = []
        self.register_error = 0
        self.waiting = threading.Event()
        self._open = threading.Event()
        self._open.set()

    def hold_registrations(self) -> None:
        """``cudaHostRegister`` calls from now on wait before they take effect, until released."""
        self._open.clear()

    def release_registrations(self) -> None:
        self._open.set()

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.register_threads.append(threading.get_ident())
        if not self._open.is_set():
            self.waiting.set()
            self._open.wait()
        if self.register_error:
            return self.register_error
        self.ranges[pointer] = nbytes
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
        return 0 if self.ranges.pop(pointer, None) is not None else 712  # cudaErrorHostMemoryNotRegistered

    @property
    def page_locked_bytes(self) -> int:
        return sum(self.ranges.values())


POISON_BYTE = 0xFF
"""What poisoned memory is filled with: every float dtype reads 0xFF.. bytes as NaN."""


def is_compute(stream: Any) -> bool:
    """Whether ``stream`` is a simulated compute stream."""
    return isinstance(stream, ComputeStream)


def alias_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory under a version counter of its own: the write of a queued copy when its
    stream runs it, which must not bump the counter again (the queueing did)."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
    )


def fill_poison(tensor: torch.Tensor) -> None:
    start = tensor.storage_offset() * tensor.element_size()
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    raw.set_(tensor.untyped_storage(), start, (tensor.nbytes,)).fill_(POISON_BYTE)
