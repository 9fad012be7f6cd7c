"""Page-locking host memory with ``cudaHostRegister``: the calls, their errors and counters, and
the chunks page-locked on background threads ahead of need (the warm start, docs/host-pool.md).

One ``cudaHostRegister`` call of 51.6 GB of fresh memory took 15.8 s on an H100 host (3.3 GB/s,
issue 37), on the training thread; much of that is expected to be page population, which one call
does on one core (not measured yet: ``benchmarks/warm_start.py``). So a chunk is made in three
stages on a background thread: allocated, its pages touched from torch's intra-op threads
(``PREFAULT``), then registered; ``REGISTER_THREADS`` chunks are made at once (torch's binding
releases the GIL during the call). A chunk is one registration, so a copy into any range of it is
into page-locked memory; a range spanning two chunks is never assumed page-locked.

A failed call is never an error of the caller's: CUDA's per-thread last error is cleared on the
thread that made the call (``cudaGetLastError`` through ``cuda.bindings`` where installed, else
through the CUDA runtime library torch loaded: torch's own ``_cudart`` does not bind it).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

REGISTER_THREADS = 4
"""Background threads making chunks at once (each pre-faults and registers one chunk at a time)."""
PREFAULT = True
"""Touch every page of a chunk from torch's intra-op threads before registering it, so the
registration call does not fault the pages in one by one on its own core."""
HUGE_PAGES = True
"""Back chunks with transparent huge pages (an anonymous mapping with ``MADV_HUGEPAGE``, 2 MiB
aligned): 512 times fewer pages to fault in and to pin. On an H100 host (THP "madvise") pre-faulting
and registering ran at 24-27 GB/s against 12-13 GB/s with 4 KiB pages, and the first step of a
48 GiB offload took 1.8x a steady one against 2.7x (docs/gpu-runs/2026-11-27-h100-warm48.txt).
The kernel ignores the advice where THP is "never"; ``False`` restores ``torch.empty``."""
HUGE_PAGE_BYTES = 2 * 2**20
THREAD_NAME = "lightmem-page-lock"
"""The name every background page-locking thread starts with."""

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class HostAllocationError(RuntimeError):
    """Host memory for a slab could not be allocated or page-locked (CUDA's error already cleared)."""


@dataclass
class RegistrationStats:
    """Page-locking in this process: what ``registration_stats()`` returns."""

    pinned_bytes: int = 0
    """Host bytes page-locked by lightmem now."""
    registrations: int = 0
    unregistrations: int = 0
    """``cudaHostUnregister`` calls (memory given back): a steady workload makes none after warm-up."""
    registration_s: float = 0.0
    """Seconds spent in ``cudaHostRegister``, summed over the threads that called it."""
    failures: int = 0
    """Registrations and unregistrations CUDA refused (each error was cleared)."""
    background_registrations: int = 0
    """Of ``registrations``, those made on a background thread (chunks)."""
    prefault_s: float = 0.0
    """Seconds spent touching the pages of chunks before registering them (background threads)."""
    blocked_s: float = 0.0
    """Seconds a thread that needed page-locked memory was held up by page-locking: registrations
    made on its own thread, and waits for a chunk still being page-locked in the background."""
    chunk_waits: int = 0
    """Requests for host memory that waited for a chunk being page-locked."""


_REGISTRATION = RegistrationStats()
_STATS_LOCK = threading.RLock()  # RLock: a finalizer that unregisters may run inside an update


def registration_stats() -> RegistrationStats:
    """A copy of the process's page-locking counters (``python -m lightmem.selfcheck`` reports them)."""
    with _STATS_LOCK:
        return RegistrationStats(**vars(_REGISTRATION))


def count(**deltas: float) -> None:
    """Add ``deltas`` to the process's counters (from any thread)."""
    with _STATS_LOCK:
        for name, delta in deltas.items():
            setattr(_REGISTRATION, name, getattr(_REGISTRATION, name) + delta)


def _cudart() -> Any:
    """torch's CUDA runtime binding (one indirection, so tests drive its failures on a CPU). It
    binds cudaHostRegister/Unregister but not cudaGetLastError: see ``_clear_cuda_error``."""
    return torch.cuda.cudart()


_runtime_cache: list[Any] = []


def _runtime_library() -> Any:
    """The CUDA runtime shared library torch loaded (ctypes), or ``None`` where none is loaded."""
    if not _runtime_cache:
        library = None
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart" in line}
            for path in sorted(paths):
                library = ctypes.CDLL(path)
                break
        except OSError:
            pass
        _runtime_cache.append(library)
    return _runtime_cache[0]


def _cuda_bindings_runtime() -> Any:
    """``cuda.bindings.runtime`` (NVIDIA's cuda-python) where installed, else ``None``."""
    try:
        from cuda.bindings import runtime
    except Exception:
        return None
    return runtime


def _clear_cuda_error() -> None:
    """Reset CUDA's per-thread last error, which a failed runtime call leaves set: the next kernel
    launch's check would raise it as an unrelated "CUDA error" far from here."""
    runtime = _cuda_bindings_runtime()
    if runtime is not None:
        runtime.cudaGetLastError()
        return
    library = _runtime_library()
    if library is not None:
        library.cudaGetLastError()


@contextlib.contextmanager
def device_context(device: torch.device | None) -> Iterator[None]:
    """The CUDA context of ``device`` (registration runs in it; not the current device's)."""
    if device is None or device.type != "cuda" or device.index is None:
        yield
        return
    with torch.cuda.device(device.index):
        yield


def register(buffer: torch.Tensor, device: torch.device | None, background: bool = False) -> None:
    """``cudaHostRegister`` of ``buffer``'s bytes in ``device``'s context.

    Raises ``HostAllocationError`` when registration fails, after clearing the error the failed
    call left in this thread's last error.
    """
    nbytes = buffer.nbytes
    start = time.perf_counter()
    try:
        cudart = _cudart()
        with device_context(device):
            code = int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    except Exception as error:  # no CUDA runtime, or the binding raised
        count(failures=1, registration_s=time.perf_counter() - start)
        raise HostAllocationError(f"cudaHostRegister of {nbytes} bytes raised {error!r}") from None
    seconds = time.perf_counter() - start
    if code != 0:
        count(failures=1, registration_s=seconds)
        _clear_cuda_error()
        raise HostAllocationError(f"cudaHostRegister of {nbytes} bytes returned CUDA error {code}")
    count(
        registrations=1, registration_s=seconds, pinned_bytes=nbytes, background_registrations=int(background)
    )


def page_locked_empty(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    """Exact-size host memory page-locked on the calling thread (which waits for it: counted in
    ``blocked_s``); raises ``HostAllocationError`` as ``register`` does."""
    start = time.perf_counter()
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    try:
        register(buffer, device)
    finally:
        count(blocked_s=time.perf_counter() - start)
    return buffer


def unregister(buffer: torch.Tensor, device: torch.device | None) -> None:
    """``cudaHostUnregister`` with its return checked: a failure is cleared and warned about once
    (the memory is then still page-locked, and freeing it is CUDA's business)."""
    count(pinned_bytes=-buffer.nbytes, unregistrations=1)
    try:
        with device_context(device):
            code = int(_cudart().cudaHostUnregister(buffer.data_ptr()))
    except Exception as error:
        code, detail = -1, repr(error)
    else:
        detail = f"CUDA error {code}"
    if code != 0:
        count(failures=1)
        if code > 0:
            _clear_cuda_error()
        warnings.warn(
            f"lightmem: cudaHostUnregister of {buffer.nbytes} bytes failed ({detail})", stacklevel=2
        )


def transparent_huge_pages() -> str:
    """The kernel's THP setting ("always", "madvise" or "never"), or "unknown" where unreadable."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            text = setting.read()
    except OSError:
        return "unknown"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"


def host_buffer(nbytes: int, huge_pages: bool | None = None) -> torch.Tensor:
    """``nbytes`` of fresh host memory (uint8): ``torch.empty``, or with ``huge_pages`` (default
    ``HUGE_PAGES``) a 2 MiB aligned slice of an anonymous mapping advised ``MADV_HUGEPAGE``. The
    tensor keeps its mapping alive (``torch.frombuffer`` holds the buffer until its storage dies)."""
    if not (HUGE_PAGES if huge_pages is None else huge_pages) or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # EINVAL on a kernel built without THP: plain pages then
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[skip : skip + nbytes]


def prefault(buffer: torch.Tensor) -> None:
    """Touch one byte of every page of ``buffer`` (torch's intra-op threads share the work), so
    the kernel populates its pages in parallel rather than inside one registration call."""
    start = time.perf_counter()
    buffer[::_PAGE_BYTES].fill_(0)
    buffer[-1:].fill_(0)  # the last page, when the buffer does not start on a page boundary
    count(prefault_s=time.perf_counter() - start)


class Chunk:
    """Host memory to page-lock in the background: ``tensor`` once registered, or ``error``."""

    __slots__ = ("device", "error", "generation", "nbytes", "sequence", "tensor")

    def __init__(self, nbytes: int, device: torch.device | None, sequence: int) -> None:
        self.nbytes = nbytes
        self.sequence = sequence  # its place in the order chunks were submitted
        self.device = device
        self.tensor: torch.Tensor | None = None
        self.error = ""
        self.generation = 0  # the registrar's, when a thread took it

    def make(self) -> None:
        """Allocate, pre-fault and register; a failure is kept in ``error``, never raised."""
        try:
            buffer = host_buffer(self.nbytes)
            if PREFAULT:
                prefault(buffer)
            register(buffer, self.device, background=True)
        except Exception as error:  # host OOM, a failed registration: the pool warns once
            self.error = str(error)
            return
        self.tensor = buffer

    def give_back(self) -> None:
        """Unregister a chunk nobody will use (its registration finished after a cancel)."""
        if self.tensor is not None:
            tensor, self.tensor = self.tensor, None
            unregister(tensor, self.device)


class ChunkRegistrar:
    """Makes chunks (``Chunk.make``) on up to ``REGISTER_THREADS`` background threads, for one pool.

    ``submit`` queues chunks; a thread starts for each while fewer run, and ends when nothing is
    queued. A chunk made is appended to ``done`` (``deque.append`` is atomic), which the pool reads
    when it looks for room: a chunk is used only once its registration has returned. ``cancel``
    drops what is queued; a chunk being made when it is cancelled is given back by its own thread
    once made, so nothing waits on a registration that cannot be interrupted, and a pool dropped
    mid-registration (this object holds no reference to it) leaks no page-locked memory.
    """

    def __init__(self) -> None:
        # Re-entrant: a finalizer run by garbage collection inside a locked section (a pool dropped
        # on this thread) cancels its registrar, which may be this one.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._queued: deque[Chunk] = deque()
        self._running: list[Chunk] = []
        self._threads: list[threading.Thread] = []  # for join: also those about to end
        self._working = 0  # threads that will still take a queued chunk
        self._generation = 0  # raised by each cancel: chunks made for an older one are given back
        self._submitted = 0  # chunks submitted so far (each chunk's sequence)
        self.done: deque[Chunk] = deque()
        _LIVE.add(self)

    def submit(self, sizes: list[int], device: torch.device | None) -> None:
        with self._lock:
            for nbytes in sizes:
                self._queued.append(Chunk(nbytes, device, self._submitted))
                self._submitted += 1
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            while self._working < min(REGISTER_THREADS, len(self._queued) + len(self._running)):
                name = f"{THREAD_NAME}-{self._working}"
                thread = threading.Thread(target=self._work, name=name, daemon=True)
                self._working += 1
                self._threads.append(thread)
                thread.start()

    def _work(self) -> None:
        try:
            while self._make_next():
                pass
        except BaseException:  # never a queue that no thread serves, nor a wait that never ends
            with self._lock:
                self._working -= 1
                self._changed.notify_all()
            raise

    def _make_next(self) -> bool:
        """Make the next queued chunk; False (this thread then ends) when none is queued."""
        with self._lock:
            if not self._queued:
                self._working -= 1  # under the lock that saw the queue empty: submit starts another
                self._changed.notify_all()
                return False
            chunk = self._queued.popleft()
            chunk.generation = self._generation
            self._running.append(chunk)
        try:
            chunk.make()
        finally:
            with self._lock:
                self._running.remove(chunk)
                wanted = chunk.generation == self._generation
                if wanted:
                    self.done.append(chunk)
                self._changed.notify_all()
            if not wanted:
                chunk.give_back()
        return True

    def queued_bytes(self) -> int:
        """Bytes of chunks not yet started (not yet allocated)."""
        with self._lock:
            return sum(chunk.nbytes for chunk in self._queued)

    def wait_for(self, nbytes: int) -> bool:
        """Block until a chunk is in ``done``, if one queued or being made could hold ``nbytes``;
        return at once (False) when none could."""
        with self._lock:
            while not self.done:
                if not self.under_way(nbytes):
                    return False
                self._changed.wait()
            return True

    def under_way(self, nbytes: int) -> bool:
        """Whether a chunk queued or being made (for the current generation) could hold ``nbytes``."""
        with self._lock:
            running = [chunk for chunk in self._running if chunk.generation == self._generation]
            return any(chunk.nbytes >= nbytes for chunk in (*self._queued, *running))

    def cancel(self, running: bool = True) -> int:
        """Drop the queued chunks (and, with ``running``, those being made: their threads give them
        back); returns their bytes. Chunks already in ``done`` stay there."""
        with self._lock:
            dropped = sum(chunk.nbytes for chunk in self._queued)
            self._queued.clear()
            if running:
                dropped += sum(chunk.nbytes for chunk in self._running if chunk.generation == self._generation)
                self._generation += 1
            self._changed.notify_all()
        return dropped

    def join(self) -> None:
        """Wait until every thread has ended (after ``cancel``: at most the chunks being made)."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()


_LIVE: weakref.WeakSet[ChunkRegistrar] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # A daemon thread killed at interpreter exit in the middle of a torch op aborts the process.
    for registrar in list(_LIVE):
        registrar.cancel()
        registrar.join()
