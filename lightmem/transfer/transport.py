"""How bytes move between device and host: stream primitives the offloader composes.

The offloader (``hooks.py``) owns the protocol: which stream waits for which event, when a host
buffer may be reused, when a reload buffer may be read. A transport only supplies the primitives,
so the same protocol runs on CUDA streams (``CudaTransport``), as plain synchronous copies
(``SyncTransport``, CPU tensors), and on the worker threads of ``SimulatedAsyncTransport`` that
tests use to exercise the protocol without a GPU.

Stream handles are opaque to the offloader; ``None`` stands for "already done" events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from time import perf_counter as _perf_counter
from typing import Any, Protocol

import torch

from lightmem.config import warn_once


class Transport(Protocol):
    pin_memory: bool
    """Host buffers must be page-locked (CUDA)."""
    poison_released: bool
    """Call ``poison(buffer)`` when a host buffer becomes reusable (test transports)."""
    capturing: Callable[[], bool] | None
    """Whether a CUDA graph is being captured on the current stream; ``None`` where none can be."""
    synchronous: bool
    """Copies have completed when they return: the offloader then skips streams and events."""

    def streams(self, device: torch.device) -> tuple[Any, Any, Any]:
        """(compute, device_to_host, host_to_device) streams for ``device``; compute is the current
        stream. Asked once per saved tensor that moves, when it is saved: the entry keeps them
        (autograd runs an op's backward on its forward's stream)."""

    def record(self, stream: Any) -> Any:
        """An event that completes when the work queued on ``stream`` so far has completed."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` after this call starts after ``event`` completes."""

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue ``dst <- src`` (same dtype and shape) on ``stream``; the caller keeps the device
        ``src`` alive until it ran. Called with grad mode off."""

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue ``dst <- src`` on ``stream``; the host ``src`` is protected by the pool's events."""

    def alloc_like(self, template: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
        """An uninitialised tensor like the host ``template`` on ``device``, allocated on ``stream``
        (the compute stream that reads it): the caching allocator reuses its memory for work
        queued on ``stream`` after its free, so another stream writing it must first wait for an
        event ``stream`` recorded after the allocation."""

    def load(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A new tensor on ``device`` holding the host ``src``'s bytes, copied before it returns.
        Used only when ``synchronous`` (one call instead of ``alloc_like`` and ``copy_to_device``)."""

    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed (``None`` has)."""

    def waited_s(self) -> float:
        """Total seconds the compute stream has waited for copies so far."""

    def host_wait(self, event: Any) -> None:
        """Block the calling thread until ``event`` has completed (before host code reads or
        writes a host buffer a queued copy touches)."""


class SyncTransport:
    """Synchronous copies on the calling thread: the path for CPU tensors (and any device)."""

    pin_memory = False
    poison_released = False
    capturing = None
    synchronous = True

    def __init__(self) -> None:
        self._waited_s = 0.0

    def streams(self, device: torch.device) -> tuple[None, None, None]:
        return None, None, None

    def record(self, stream: Any) -> None:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        return None

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        # A synchronous copy blocks the training thread for its whole duration: that is the wait.
        start = _perf_counter()
        dst.copy_(src)
        self._waited_s += _perf_counter() - start

    copy_to_device = copy_to_host

    def alloc_like(self, template: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
        return torch.empty_like(template) if device.type == "cpu" else torch.empty_like(template, device=device)

    def load(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        # clone() allocates and copies in one dispatch: cheaper than empty_like() then copy_().
        start = _perf_counter()
        tensor = src.clone() if device.type == "cpu" else src.to(device, copy=True)
        self._waited_s += _perf_counter() - start
        return tensor

    def done(self, event: Any) -> bool:
        return True

    def waited_s(self) -> float:
        return self._waited_s

    def host_wait(self, event: Any) -> None:
        return None


class CudaTransport:  # pragma: no cover - exercised by tests/gpu on a CUDA machine
    """Copies on side CUDA streams, ordered by events.

    One device-to-host and one host-to-device stream per device, so offload of step N's forward
    overlaps compute and reloads overlap backward compute. Waits of the compute stream are timed
    with CUDA events only when the copy had not finished when the wait was queued; at most
    ``MAX_TIMED_WAITS`` such pairs are pending at once (completed ones are read back as new waits
    come), so events never pile up when nobody asks ``waited_s()``.
    """

    MAX_TIMED_WAITS = 64

    pin_memory = True
    poison_released = False
    synchronous = False
    # Asked on every save and every done/wait: torch's C function itself, without the Python
    # wrapper's frame (``torch.cuda.is_current_stream_capturing`` only forwards to it).
    capturing = staticmethod(
        getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
    )

    def __init__(self) -> None:
        self._side: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._timed: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._waited_s = 0.0
        self.untimed_waits = 0
        """Compute waits left untimed because ``MAX_TIMED_WAITS`` timings were still pending."""

    def streams(self, device: torch.device) -> tuple[Any, Any, Any]:
        index = device.index if device.index is not None else torch.cuda.current_device()
        side = self._side.get(index)
        if side is None:
            side = (torch.cuda.Stream(index), torch.cuda.Stream(index))
            self._side[index] = side
        return torch.cuda.current_stream(index), side[0], side[1]

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return stream.record_event()

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event | None) -> None:
        if event is None:
            return
        # current_stream() builds a new Stream object on each call: compare streams, not objects.
        # No query while a graph is captured (illegal there); the offloader moves nothing then.
        if (
            stream == torch.cuda.current_stream(stream.device)
            and not self.capturing()
            and not event.query()
        ):
            if len(self._timed) >= self.MAX_TIMED_WAITS:
                self._read_timings()
            if len(self._timed) < self.MAX_TIMED_WAITS:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                stream.wait_event(event)
                end.record(stream)
                self._timed.append((start, end))
                return
            self.untimed_waits += 1
        stream.wait_event(event)

    def _read_timings(self) -> None:
        """Add the waits whose end has run (oldest first: a stream completes in order)."""
        timed = self._timed
        while timed and timed[0][1].query():
            start, end = timed.popleft()
            self._waited_s += start.elapsed_time(end) / 1e3

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    copy_to_device = copy_to_host

    def alloc_like(self, template: torch.Tensor, device: torch.device, stream: torch.cuda.Stream) -> torch.Tensor:
        # On the compute stream that reads it, without record_stream: a block recorded for another
        # stream returns to the cache only when the GPU has passed its free, so while the host
        # runs ahead every reload would take fresh memory (hooks.py orders the copy instead).
        with torch.cuda.stream(stream):
            return torch.empty_like(template, device=device)

    def done(self, event: torch.cuda.Event | None) -> bool:
        # Never seen complete while a graph is captured: querying an event is illegal there.
        return event is None or (not self.capturing() and event.query())

    def host_wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            start = _perf_counter()
            event.synchronize()
            self._waited_s += _perf_counter() - start

    def waited_s(self) -> float:
        if not self.capturing():
            self._read_timings()
        return self._waited_s


def default_transport(devices: tuple[str, ...]) -> Transport:
    """CUDA side streams where ``devices`` names CUDA and it is available; synchronous copies otherwise."""
    if "cuda" in devices:
        if torch.cuda.is_available():
            return CudaTransport()
        if devices == ("cuda",):
            warn_once(
                "lightmem: CUDA is not available, so offload_activations(devices=('cuda',)) has "
                "nothing to offload; saved tensors stay where they are"
            )
    return SyncTransport()
