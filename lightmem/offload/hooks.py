"""The offload engine: saved-tensor pack/unpack hooks, host entries, reloads and prefetch.

Protocol (every wait lives here; transports only provide the primitives):

forward, pack(t)            an entry and its host block; t is held and its copy deferred until
                            the op that saved t has returned (an op may save an argument and
                            then write it, as rrelu does with its noise): the next pack of a
                            later op (a new autograd node), the context's exit, or an unpack.
forward, copy(entry)        d2h waits for compute; copy t's storage -> host block on d2h, as one
                            tensor copy into the block viewed with the storage's dtype and shape
                            when a tensor covers the storage densely (else byte for byte);
                            entry.host_event = event on d2h; t is held until that event has
                            completed, so its memory is not reused before the copy has read it
                            (the role record_stream plays elsewhere). A synchronous transport
                            (CPU) has no streams or events: the copy is done when it returns.
forward, in flight          past max_inflight_bytes of copies not seen complete, the oldest
                            entry's own compute stream waits for it and its tensor is let go
                            (inflight.py).
backward, reload(entry)     allocate on compute (the stream that reads it; the caching allocator
                            reuses a freed reload in stream order, so device memory holds what
                            the host holds: the prefetch window and the running node's reads,
                            however far the host runs ahead of the GPU); h2d waits for an event
                            compute records now (its work so far, which ends with the readers
                            of the reloads already consumed: the copy stream runs at most the
                            window ahead of compute) and for entry.host_event (the host bytes
                            are complete); copy on h2d; entry.reload_event = host_event = event
                            on h2d. No host thread waits.
                            An entry whose copy to host is still in flight is served from the
                            device tensor it holds instead. A synchronous transport (CPU) makes
                            the reload in one call (``transport.load``: a clone).
backward, unpack(handle)    compute waits for reload_event (the first save's stream and every
                            other compute stream that saved the same storage: each reads it),
                            then reads the reloaded tensor itself (a save of the dense tensor)
                            or a view of its storage.
graph freed (entry dies)    host block returns to the pool after entry.host_event; an unused
                            reload makes compute wait for its copy before the storage is freed;
                            a device tensor still held for its copy to host makes its compute
                            stream wait for that copy before it goes (inflight.py: retire).

Streams are the entry's (``entry.streams``, taken when it is saved): autograd runs an op's
backward on its forward's stream, and with several devices each entry is ordered on its own.

Lifetimes follow the autograd graph: autograd holds one handle per save (the first save of a
storage holds the entry itself, each later save a ``protocol.Handle`` that refers to it), and an
entry returns its host block when the last handle is gone. The reference counting and the prefetch
walk are ``protocol.py``'s, which the estimator runs too; this module provides its reload action
(``Offloader._reload``) and what a free must wait for (``_HostEntry.__del__``). No handle holds a
tensor whose grad_fn could reach the handle (``_held``): autograd passes a saved output with its
own grad_fn to pack, and holding it would make a cycle (tensor -> grad_fn -> handle -> tensor)
through C++ that Python's collector cannot break. In-place changes are caught through the saved
tensor's version counter, which an entry keeps alive without the storage (``_version_holder``)
while anything could still write the storage (``_HostEntry.release_source``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction

from lightmem.compiled import never_traced
from lightmem.config import warn_once
from lightmem.offload.policy import LEAVE, MOVE, OffloadPolicy, same_save
from lightmem.offload.protocol import Entry, Handle, Reloads, Session
from lightmem.offload.scope import ModuleScope
from lightmem.offload.stats import OffloadStats
from lightmem.transfer.inflight import InflightCopies, saved_view, served_view
from lightmem.transfer.pool import HostPool
from lightmem.transfer.slab import HostBlock
from lightmem.transfer.transport import Transport

_sequence_nr = torch._C._autograd._get_sequence_nr  # the next autograd node's number (per thread)


CAPTURED_RELOAD_MESSAGE = (
    "lightmem: backward reached a tensor offloaded to host while a CUDA graph is being captured; a "
    "reload cannot be captured (it needs a side stream and event queries). Capture the forward "
    "too (saves made while capturing stay on the device), or keep the captured region outside "
    "the offload context."
)


def _held(tensor: Tensor) -> Tensor:
    """What a handle may hold of a saved tensor: never one whose grad_fn could reach the handle.

    A node's edges point to nodes that existed when it was made, so the output of an earlier node
    (a smaller sequence number than the newest node of this thread, the one saving it) cannot
    reach the saving node: it is held as it is, saving a ``detach()`` (the largest cost of a save
    left on the device). An output of the saving node (the newest), a view node made on access,
    and Python ``autograd.Function`` nodes (whose forward may make nodes of its own) are detached.
    """
    grad_fn = tensor.grad_fn
    if grad_fn is None or (
        grad_fn._sequence_nr() < _sequence_nr() - 1 and not isinstance(grad_fn, BackwardCFunction)
    ):
        return tensor
    return tensor.detach()


_storage_use_count = torch._C._storage_Use_Count

# Dtypes copied as typed tensors; any other (sub-byte "shell" dtypes such as uint4, whose copy_
# has no kernel) is copied as bytes.
_TYPED_COPY_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32", "bool",
        "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)  # fmt: skip


def _version_holder(tensor: Tensor, empty: Tensor) -> Tensor:
    """A tensor sharing ``tensor``'s version counter but none of its memory.

    ``detach()`` shares the version counter; assigning ``.data`` swaps the storage for an empty
    one and keeps the counter, so in-place changes through any alias stay visible after the saved
    tensor itself (and its storage on the device) is gone.
    """
    holder = tensor.detach()
    holder.data = empty
    return holder


class _KeptStorage(weakref.ref):
    """A saved storage left on the device; counts as resident while any save of it lives.

    It is the weak reference to the saved tensor's alias (for ``same_save``) itself: one object
    per kept storage, made without a Python ``__init__`` (``Offloader.pack`` sets its fields and
    counts its bytes), on the hot path of every save.
    """

    __slots__ = ("nbytes", "owner", "version")

    @property
    def alias(self) -> _KeptStorage:
        return self

    @never_traced
    def __del__(self) -> None:
        self.owner._resident_bytes -= self.nbytes


# What autograd holds for a saved tensor that stays where it is is a tuple, the cheapest object
# Python builds: ``(tensor, version)`` when it is left alone (parameters, other devices, sparse or
# nested layouts, tensor subclasses, freed storages), ``(tensor, version, kept_storage)`` when
# policy keeps it on the device (size, scope, budget). Hooks switch off autograd's own version
# check, so unpack does it. ``tensor`` never has a grad_fn (see the module doc).


class _HostEntry(Entry):
    """One device storage copied to a host block, shared by every save of that storage.

    ``host`` is the block as a tensor shaped like ``alias`` when ``alias`` covers its storage
    densely (the common case: then the copy and the reload are one tensor copy each, and a save
    of ``alias`` itself gets the reloaded tensor back as it is), else as the storage's bytes;
    ``restored``, the reloaded storage, is shaped as ``host``. Its reference counting (``handles``,
    ``unpacks``, ``generation``) and prefetch state are the protocol's (``protocol.Entry``).
    """

    __slots__ = (
        "block", "dense", "device", "host", "host_event", "readers", "reload_event", "streams", "version_final",
        "version_holder",
    )  # fmt: skip

    def __init__(
        self, owner: Offloader, block: HostBlock, nbytes: int, alias: Tensor, storage: torch.UntypedStorage,
        version: int,
    ) -> None:  # fmt: skip
        Entry.__init__(self, owner, nbytes, alias, version)
        self.block = block
        self.device = device = storage.device
        dtype = alias.dtype
        if (
            alias.is_contiguous()
            and alias.nbytes == nbytes
            and alias.storage_offset() == 0
            and dtype in _TYPED_COPY_DTYPES
        ):
            self.dense = True
            self.host = block.view(dtype, alias.size())
            source = alias
            self.version_holder = alias  # until the copy has run; then see release_source
        else:
            self.dense = False
            self.host = block.raw(nbytes)
            source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            self.version_holder = _version_holder(alias, owner._empty_on(device))
        self.version_final = version
        # Until the copy to host has run, the device tensor it reads is held so that its memory
        # is not reused before the copy reads it; see Offloader._copy_deferred and _settle.
        self.in_flight_alias: Tensor | None = source
        self.host_event: Any = None
        self.reload_event: Any = None
        # (compute, to_host, to_device) of the device and stream that saved it: autograd runs an
        # op's backward on its forward's stream. None with a synchronous transport.
        self.streams: tuple[Any, Any, Any] | None = None
        # Other compute streams that saved the same storage (a later save on another stream): each
        # reads the reload too, so each waits for its copy.
        self.readers: list[Any] | None = None
        owner._live_entries += 1

    def written_since_save(self) -> bool:
        """Whether the dense tensor held for the copy was written (or reshaped) in place since its
        save. It is then not copied: every unpack of it raises autograd's in-place error, so its
        bytes are never read, and a new shape or strides (``t_()``, ``unsqueeze_()``) would no
        longer match the host view the copy writes."""
        return self.dense and self.in_flight_alias._version != self.version

    def release_source(self) -> None:
        """Let go of the device tensor held for the copy to host, which has run.

        In-place changes are still caught afterwards through a version holder (a tensor sharing
        the saved tensor's version counter but none of its memory). It is needed only while some
        tensor can still write the storage, so it is skipped when nothing else refers
        to the tensor or its storage: ``_use_count`` counts its owners in C++ (autograd, views),
        the storage's use count its tensors (a ``detach()`` shares the storage, not the owner),
        and after letting go the weak reference tells whether Python held it elsewhere. Then the
        tensor is gone, nothing can change it any more, and its version is final.
        """
        alias = self.in_flight_alias
        self.in_flight_alias = None
        if not self.dense:  # the holder was made at pack; the source is a bytes view
            return
        # Use counts: this tensor only; the storage's: this tensor and the temporary storage object.
        if alias._use_count() == 1 and _storage_use_count(alias.untyped_storage()._cdata) == 2:
            self.version_final = alias._version
            self.version_holder = None  # it was the tensor itself
            del alias
            alias = self.alias()  # alive only if Python still refers to it elsewhere
            if alias is None:
                return
        self.version_holder = _version_holder(alias, self.owner._empty_on(self.device))

    @never_traced
    def __del__(self) -> None:
        owner = self.owner
        with owner._lock:
            try:
                if self.in_flight_alias is not None and self.host_event is not None:
                    owner._pending.retire(self)  # its copy still runs: compute waits before its memory goes
                if self.restored is not None:
                    if self.reload_event is not None:  # never consumed: its copy may still be writing
                        owner._transport.wait(self.streams[0], self.reload_event)
                    owner._discard(self)
                owner._pool.release(self.block, self.host_event)
            finally:
                owner._live_entries -= 1


# What autograd holds for a saved tensor whose storage went to host memory is the entry itself
# (its first save) or a ``Handle`` (protocol.py, a later save); either's ``layout`` is ``None`` for
# a save of the entry's dense alias itself (it gets the reloaded tensor), else what ``saved_view``
# needs to view the save in the entry's storage.


def _layout(tensor: Tensor, alias: Tensor, entry: _HostEntry) -> tuple[Any, ...] | None:
    """A handle's ``layout``: ``None`` for a save of the entry's dense alias itself, else what
    ``saved_view`` needs to view the save in the entry's storage."""
    if tensor is alias and entry.dense:
        return None
    return (tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset(), tensor.is_neg())


def _modified_error(tensor_type: str, size: Any, version: int, expected: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{tensor_type} {list(size)}] is at version {version}; expected version "
        f"{expected} instead. (Reported by lightmem's offload hooks, which saved this tensor. "
        "Clone the tensor before modifying it in place.)"
    )


class Offloader(Reloads):
    """Pack/unpack hooks and the state behind them; ``offload_activations`` is its public face."""

    def __init__(
        self,
        *,
        min_bytes: int,
        devices: tuple[str, ...],
        prefetch_bytes: int,
        max_inflight_bytes: int,
        pool: HostPool,
        transport: Transport,
        budget_note: str,
    ) -> None:
        self.stats = OffloadStats()
        self.policy = OffloadPolicy(min_bytes=min_bytes, devices=devices)
        self._decide = self.policy.decide
        self._prefetch_bytes = prefetch_bytes
        self._pool = pool
        self._transport = transport
        self._budget_note = budget_note
        self._session = Session()
        self._by_storage: dict[int, _HostEntry | _KeptStorage] = {}
        self._resident_bytes = 0
        self._live_entries = 0
        self._wait_base_s = 0.0
        self._deferred: list[_HostEntry] = []  # entries whose copy waits for their op to return
        self._deferred_after = -1  # the autograd sequence number when the last of them was saved
        self._deferred_bytes = 0
        self._pending = InflightCopies(max_inflight_bytes, transport)  # copies to host still queued
        self._inflight = self._pending.entries  # the same deque, read on every pack and unpack
        self._capturing = transport.capturing
        self._synchronous = transport.synchronous
        self._empty: dict[torch.device, Tensor] = {}  # storage for version holders, per device
        # Backward runs one autograd thread per device; handles die on any thread.
        self._lock = threading.RLock()

    # -- forward -------------------------------------------------------------------------------

    @never_traced  # called by autograd, also between the graphs of a compiled model (lightmem.compiled)
    def pack(self, tensor: Tensor) -> Any:
        stats = self.stats
        stats.packed_tensors += 1
        capturing = self._capturing
        if capturing is not None and capturing():  # no event may be queried, no side stream joined
            return self._keep_captured(tensor)
        if self._deferred and _sequence_nr() != self._deferred_after:
            self._copy_deferred()  # a later op has begun: the ops that saved them have returned
        if self._inflight:
            self._settle()
        verdict, alias, storage, nbytes, key = self._decide(tensor)
        version = tensor._version
        if verdict == LEAVE:
            kept = None
        else:
            by_storage = self._by_storage
            kept = by_storage.get(key)
            if kept is not None and same_save(kept, alias, version):
                if type(kept) is _HostEntry:
                    stats.deduplicated_bytes += kept.nbytes
                    if kept.streams is not None:
                        self._note_reader(kept)
                    return Handle(kept, version, _layout(tensor, alias, kept))
            else:
                if verdict == MOVE:
                    block = self._pool.acquire(nbytes, storage)
                    if block is not None:
                        entry = by_storage[key] = self._offload(storage, block, nbytes, alias, version)
                        if tensor is not alias or not entry.dense:
                            entry.layout = _layout(tensor, alias, entry)
                        return entry  # the first save's handle
                    self._note_budget(nbytes)
                else:
                    stats.kept_bytes += nbytes
                kept = by_storage[key] = _KeptStorage(alias)
                kept.owner = self
                kept.nbytes = nbytes
                kept.version = version
                resident = self._resident_bytes = self._resident_bytes + nbytes
                if resident > stats.peak_resident_bytes:
                    stats.peak_resident_bytes = resident
        # What the handle may hold: ``_held(tensor)``, inlined on this path of every kept save.
        grad_fn = tensor.grad_fn
        if grad_fn is not None and (
            grad_fn._sequence_nr() >= _sequence_nr() - 1 or isinstance(grad_fn, BackwardCFunction)
        ):
            tensor = tensor.detach()
        return (tensor, version) if kept is None else (tensor, version, kept)

    def _offload(
        self, storage: torch.UntypedStorage, block: HostBlock, nbytes: int, alias: Tensor, version: int
    ) -> _HostEntry:
        entry = _HostEntry(self, block, nbytes, alias, storage, version)
        if not self._synchronous:
            entry.streams = self._transport.streams(entry.device)
        # The copy waits until the op that saved the tensor has returned: an op may write an
        # argument after saving it (rrelu_with_noise's noise, schema ``Tensor(b!) noise``).
        self._deferred.append(entry)
        self._deferred_after = _sequence_nr()
        stats = self.stats
        # Until its copy to host has run, a saved tensor is on the device too; under compile a whole
        # graph's saves arrive at once, when the graph has run, and this is where its peak shows.
        self._deferred_bytes += nbytes
        resident = self._resident_bytes + self._deferred_bytes + self._pending.bytes
        if resident > stats.peak_resident_bytes:
            stats.peak_resident_bytes = resident
        stats.offloaded_tensors += 1
        stats.offloaded_bytes += nbytes
        return entry

    def _note_reader(self, entry: _HostEntry) -> None:
        """A later save of ``entry``'s storage: on a compute stream other than its first save's,
        that stream reads the reload too (autograd runs the op's backward on its forward's stream)."""
        compute = self._transport.streams(entry.device)[0]
        if compute == entry.streams[0]:
            return
        readers = entry.readers
        if readers is None:
            entry.readers = [compute]
        elif not any(compute == reader for reader in readers):
            readers.append(compute)

    def _empty_on(self, device: torch.device) -> Tensor:
        """An empty tensor on ``device``: the storage of version holders."""
        empty = self._empty.get(device)
        if empty is None:
            empty = self._empty[device] = torch.empty(0, dtype=torch.uint8, device=device)
        return empty

    def _copy_deferred(self) -> None:
        """Queue the copies to host of the tensors saved by ops that have since returned (none of
        a tensor ``written_since_save``)."""
        deferred = self._deferred
        if not deferred:
            return
        self._deferred = []
        self._deferred_bytes = 0
        transport = self._transport
        grad = torch.is_grad_enabled()  # off in pack; a copy must never join an autograd graph
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            if self._synchronous:  # done when it returns: nothing to order, nothing to hold
                copy_to_host = transport.copy_to_host
                for entry in deferred:  # no local for the source: release_source counts its referents
                    if not entry.written_since_save():
                        copy_to_host(entry.host, entry.in_flight_alias, None)
                    entry.release_source()
                return
            for entry in deferred:
                if entry.written_since_save():
                    entry.release_source()
                    continue
                compute, to_host, _ = entry.streams
                transport.wait(to_host, transport.record(compute))
                transport.copy_to_host(entry.host, entry.in_flight_alias, to_host)
                entry.host_event = transport.record(to_host)
                if transport.done(entry.host_event):
                    entry.release_source()
                else:
                    self._pending.add(entry, self.stats)
        finally:
            if grad:
                torch._C._set_grad_enabled(True)

    def _settle(self) -> None:
        """Let go of saved tensors whose copy to host has finished."""
        self._pending.settle()

    def _keep_captured(self, tensor: Tensor) -> tuple[Tensor, int]:
        """A save during CUDA graph capture stays where it is (docs/offload-protocol.md: "The CUDA path")."""
        verdict, _, _, nbytes, _ = self._decide(tensor)
        if verdict == MOVE:
            self.stats.capture_kept_bytes += nbytes
        return (_held(tensor), tensor._version)

    def _note_budget(self, nbytes: int) -> None:
        if self._pool.alloc_failed:  # the pool warned once; never the GPU's out-of-memory
            self.stats.host_alloc_failed_bytes += nbytes
            return
        self.stats.budget_kept_bytes += nbytes
        warn_once(
            f"lightmem: host memory for offload is exhausted ({self._budget_note}); further saved "
            "tensors stay on the device. Raise the budget or min_bytes; OffloadStats."
            "budget_kept_bytes counts what stayed."
        )

    # -- backward ------------------------------------------------------------------------------

    @never_traced
    def unpack(self, handle: Any) -> Tensor:
        if type(handle) is tuple:  # a save that stayed where it was: one type check on this path
            tensor = handle[0]
            if tensor._version != handle[1]:
                raise _modified_error(tensor.type(), tensor.size(), tensor._version, handle[1])
            return tensor
        with self._lock:  # an entry or a Handle
            return self._unpack_offloaded(handle)

    def _unpack_offloaded(self, handle: _HostEntry | Handle) -> Tensor:
        capturing = self._capturing
        if capturing is not None and capturing():
            raise RuntimeError(CAPTURED_RELOAD_MESSAGE)
        if self._deferred:
            self._copy_deferred()
        if self._inflight:
            self._settle()
        entry = handle if type(handle) is _HostEntry else handle.entry
        layout = handle.layout
        holder = entry.version_holder
        current = entry.version_final if holder is None else holder._version
        if current != handle.version:
            dtype, size = (entry.host.dtype, entry.host.size()) if layout is None else layout[:2]
            tensor_type = torch.empty(0, dtype=dtype, device=entry.device).type()
            raise _modified_error(tensor_type, size, current, handle.version)
        if entry.restored is None:
            view = served_view(entry, layout)
            if view is not None:  # its copy to host still runs: the device tensor is still held
                self.stats.inflight_served += 1
                return view
        restored = self._take(handle, entry)  # protocol.py: reload on a miss, count the view
        event = entry.reload_event
        if event is not None:
            wait = self._transport.wait
            wait(entry.streams[0], event)
            if entry.readers is not None:  # every stream that reads it, not only the first save's
                for reader in entry.readers:
                    wait(reader, event)
            entry.reload_event = None
        view = restored if layout is None else saved_view(restored, layout, entry.device)
        session = entry.session
        if session.cursor > 0 and self._prefetch_bytes > 0:  # candidates lie below the cursor
            self._prefetch(session)
        return view

    def _reload(self, entry: _HostEntry) -> Tensor:
        """The reload action of the protocol: ``entry``'s storage, back on its device."""
        transport = self._transport
        if self._synchronous:
            restored = transport.load(entry.host, entry.device)
        else:
            compute, _, to_device = entry.streams
            # On the compute stream, which reads it: the caching allocator reuses the memory of
            # reloads freed after their reader in stream order, so the device holds what the host
            # holds (the prefetch window and the running node's reads), however far the host
            # runs ahead. The copy therefore starts only when compute has reached this point
            # (the readers of the memory it may reuse have run): the copy stream runs ahead of
            # compute by at most the window, and no host thread waits.
            restored = transport.alloc_like(entry.host, entry.device, compute)
            transport.wait(to_device, transport.record(compute))
            transport.wait(to_device, entry.host_event)
            transport.copy_to_device(restored, entry.host, to_device)
            entry.reload_event = entry.host_event = transport.record(to_device)
        return restored

    @property
    def scope(self) -> ModuleScope | None:
        """The include/exclude rules, when given (part of the policy)."""
        return self.policy.scope

    @scope.setter
    def scope(self, scope: ModuleScope | None) -> None:
        self.policy.scope = scope

    # -- per-context bookkeeping ----------------------------------------------------------------

    def begin(self, protected_storages: set[int]) -> None:
        self._copy_deferred()
        self._settle()
        self.stats = OffloadStats(
            peak_host_bytes=self._pool.reset_peak(), peak_resident_bytes=self._resident_bytes
        )
        self._wait_base_s = self._transport.waited_s()
        self.policy.protected = protected_storages
        self._session = Session()
        self._by_storage = {}

    def end(self) -> None:
        # Every op of the forward has returned: nothing can write a saved tensor unseen any more.
        self._copy_deferred()
        # Dedupe only looks within one forward; afterwards entries live only through the graph.
        self._by_storage = {}

    def refresh_stats(self) -> OffloadStats:
        self.stats.wait_s = self._transport.waited_s() - self._wait_base_s
        self.stats.peak_host_bytes = self._pool.peak_held_bytes
        return self.stats

    @property
    def live_entries(self) -> int:
        """Host entries still referenced by some autograd graph (0 once every graph is freed)."""
        self._copy_deferred()
        self._settle()
        return self._live_entries

    @property
    def resident_bytes(self) -> int:
        return self._resident_bytes
