"""Copies to host not yet seen complete: the device memory they hold, bounded.

Two holders, one rule (past the bound, compute waits for the oldest copy and its device tensor
goes): ``InflightCopies`` for saved activations (held weakly, over all devices), and
``InflightTensors`` for gradients already taken off their parameter (held strongly, one device).

A saved tensor is held on the device until its copy to host has run (its memory must not be
reused before the copy reads it). Seeing a copy complete is a poll (``transport.done``) at the
next pack or unpack, so when the copy stream drains slower than compute produces activations
(slow PCIe: the regime where offload matters most) nothing would ever release device memory.

``InflightCopies`` keeps those entries oldest first with their byte total, over all devices. Past
``max_bytes`` the compute stream of the oldest entry's device (the stream that saved it) waits for
its copy's event and the entry lets go of its device tensor. On
CUDA that wait is queued on the stream (``wait_event``), not a host synchronisation; freeing the
tensor right after it is safe because the caching allocator hands its memory only to work queued
on the compute stream later, which runs after the copy has read it.

An entry still in flight when backward reaches it is served from the device tensor it still holds
(``served_view``): its bytes are exactly the saved ones (the version check has passed), so a
reload into a second buffer would only cost memory and a copy.

The entries are held weakly: one whose graph is freed (backward has read it, or the graph was
dropped) while its copy still runs is ``retire``d as it dies, the same way the bound lets go of
the oldest (its compute stream waits for the copy, and the device tensor goes with the entry).
Held strongly, the window stayed on the device until the host saw its copies complete, which a
host running ahead of the GPU may see only once backward is queued: up to ``max_bytes`` of the
forward's last activations then stayed allocated to the end of backward, beside every gradient.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Protocol

import torch
from torch import Tensor

from lightmem.transfer.transport import Transport


class CountsWaits(Protocol):
    """Where the waits the bound makes are counted (activation offload's ``OffloadStats``)."""

    inflight_waits: int


class InflightCopies:
    """Entries whose copy to host may still run, oldest first (weak references); see the module
    docstring."""

    __slots__ = ("bytes", "entries", "max_bytes", "transport")

    def __init__(self, max_bytes: int, transport: Transport) -> None:
        self.max_bytes = max_bytes
        self.transport = transport
        self.entries: deque[Any] = deque()
        self.bytes = 0

    def add(self, entry: Any, stats: CountsWaits) -> None:
        """Track ``entry`` (its copy is queued); past the bound, compute waits for the oldest."""
        self.entries.append(weakref.ref(entry))
        self.bytes += entry.nbytes
        if self.bytes > self.max_bytes:
            self._bound(stats)

    def _bound(self, stats: CountsWaits) -> None:
        entries = self.entries
        while entries and self.bytes > self.max_bytes:
            oldest = entries.popleft()()
            if oldest is None:  # retired as it died: its bytes are counted out
                continue
            self.bytes -= oldest.nbytes
            if self._compute_waits_for_copy(oldest):
                stats.inflight_waits += 1
            oldest.release_source()

    def retire(self, entry: Any) -> None:
        """``entry`` dies with its copy still tracked here: its compute stream waits for the copy
        (unless it is seen complete), so the device tensor that goes with the entry is reused only
        by work ordered after the copy has read it."""
        self.bytes -= entry.nbytes
        self._compute_waits_for_copy(entry)

    def _compute_waits_for_copy(self, entry: Any) -> bool:
        """Unless ``entry``'s copy is seen complete, the compute stream of its own device waits for
        it (only work ordered after the copy may reuse its memory, and another device's stream
        orders nothing there); True when it waits."""
        if self.transport.done(entry.host_event):
            return False
        self.transport.wait(entry.streams[0], entry.host_event)
        return True

    def settle(self) -> None:
        """Let go of the device tensors whose copy to host has finished."""
        entries = self.entries
        done = self.transport.done
        while entries:
            entry = entries[0]()
            if entry is None:  # retired as it died
                entries.popleft()
                continue
            if not done(entry.host_event):
                return
            entries.popleft()
            self.bytes -= entry.nbytes
            entry.release_source()


class InflightTensors:
    """Device tensors whose copy to host may still run, oldest first, held strongly (nothing else
    holds them: model-state offload has already cleared ``param.grad``), on one device.

    ``add`` one as its copy is queued, ``retire`` after each: tensors whose copy has run are let
    go, and past ``max_bytes`` the compute stream waits for the oldest copy. That wait lets the
    device memory go (work queued after it runs after the copy read it); it protects no host read:
    whoever reads the host copy host-waits its event.
    """

    __slots__ = ("bytes", "entries", "max_bytes", "transport")

    def __init__(self, max_bytes: int, transport: Transport) -> None:
        self.max_bytes = max_bytes
        self.transport = transport
        self.entries: deque[tuple[Any, Tensor]] = deque()  # (copy event, device tensor kept alive)
        self.bytes = 0

    def add(self, event: Any, tensor: Tensor) -> None:
        self.entries.append((event, tensor))
        self.bytes += tensor.nbytes

    def retire(self, compute: Any) -> None:
        """Drop tensors whose copy has run; past the bound, ``compute`` waits for the oldest."""
        transport, entries = self.transport, self.entries
        while entries:
            event, tensor = entries[0]
            if not transport.done(event):
                if self.bytes <= self.max_bytes:
                    break
                transport.wait(compute, event)
            entries.popleft()
            self.bytes -= tensor.nbytes

    def release_all(self, device: torch.device) -> None:
        """Let every tensor go; the compute stream of ``device`` waits for the copies that may
        still run (its memory is reused only after them), the host goes on."""
        transport, compute = self.transport, None
        for event, _ in self.entries:
            if not transport.done(event):
                compute = compute if compute is not None else transport.streams(device)[0]
                transport.wait(compute, event)
        self.entries.clear()
        self.bytes = 0


def served_view(entry: Any, layout: tuple[Any, ...] | None) -> Tensor | None:
    """The save ``layout`` describes (``None``: the entry's alias itself) in the device tensor
    ``entry`` still holds for its unfinished copy, or ``None`` when the copy has finished."""
    source = entry.in_flight_alias
    return None if source is None else saved_view(source, layout, entry.device)


def saved_view(tensor: Tensor, layout: tuple[Any, ...] | None, device: torch.device) -> Tensor:
    """The save a handle's ``layout`` describes in ``tensor``'s storage: ``tensor`` itself for
    ``None`` (a save of the dense tensor), else a view built on the storage.

    The layout's last item is the negative bit (``torch._neg_view``, ``z.conj().imag``): a lazily
    negated view reads the same bytes as its base, so a view rebuilt on the storage carries it again.
    """
    if layout is None:
        return tensor
    dtype, size, stride, offset, negative = layout
    view = torch.empty(0, dtype=dtype, device=device).set_(tensor.untyped_storage(), offset, size, stride)
    return torch._neg_view(view) if negative else view

