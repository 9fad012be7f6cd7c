"""Saved-tensor hooks for the fake step: record what autograd saves, and simulate lightmem's offload.

Without offload, ``pack`` only tells the tracer which storages autograd keeps for backward. With an
``OffloadSettings``, which saved tensors move is decided by the engine's own code
(``lightmem.offload.policy``: eligibility, parameter and buffer storages and their autocast copies,
``min_bytes``, scope, dedupe, host budget), run here on fake tensors. A moved tensor is dropped
from the graph at pack time and a fake tensor of the same layout is allocated again when backward
needs it, so the reload is counted where it happens. Which reload happens when (reference counting
of saves, misses, the prefetch walk in reverse pack order within the window) is the engine's own
protocol too (``lightmem.offload.protocol``); this module provides its reload action (a fake
allocation the tracer counts).

On a device whose copies to host run asynchronously (CUDA), a moved tensor stays on the device
until its copy has run: the engine lets at most ``max_inflight_bytes`` of them wait (one larger
than that alone), and compute waits for the oldest past it. The simulation holds each moved
storage until later moves push it out of that window, as if copies ran no faster than the bound
allows, and lets the last window go when backward starts.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from lightmem.config import OffloadSettings
from lightmem.estimate.trace.dry_run_device import DRY_RUN_DEVICE
from lightmem.estimate.trace.tracer import StorageTracer
from lightmem.offload.policy import LEAVE, MOVE, OffloadPolicy, fits_host_budget, host_bytes, same_save
from lightmem.offload.protocol import Entry, Handle, Reloads, Session
from lightmem.offload.scope import ModuleScope
from lightmem.offload.stats import OffloadStats


def _layout(tensor: Tensor) -> tuple:
    """What a save needs to be viewed again in its storage (the simulation keeps every save's)."""
    return (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())


class _KeptRecord:
    """A storage the engine would keep on the device; later saves of it are not decided again."""

    __slots__ = ("alias", "version")

    def __init__(self, alias: Tensor, version: int) -> None:
        self.alias = weakref.ref(alias)
        self.version = version


class _Entry(Entry):
    """One offloaded storage, shared by every save of it; ``block`` is the top-level block that
    saved it (reloads count there). Its host block returns when the last save is gone."""

    __slots__ = ("block",)

    def __init__(
        self, owner: SavedTensorHooks, nbytes: int, alias: Tensor, version: int, block: str | None
    ) -> None:
        Entry.__init__(self, owner, nbytes, alias, version)
        self.block = block

    def __del__(self) -> None:
        owner = self.owner
        if self.restored is not None:
            owner._discard(self)
        owner.host_bytes -= host_bytes(self.nbytes)


class SavedTensorHooks(Reloads):
    """Pack/unpack hooks for ``torch.autograd.graph.saved_tensors_hooks`` around the fake forward.

    Args:
        tracer: receives the saved storages and the reload allocations.
        block_of: returns the top-level block whose forward is running (for per-block figures).
        offload: what to offload, or None to only record saves.
        model: the model, for ``include`` / ``exclude`` module patterns.
        protected: ids of parameter and buffer storages (``id(tensor.untyped_storage())``),
            which are never offloaded.
        asynchronous: copies to host run on a side stream (CUDA): moved storages wait on the device
            within ``max_inflight_bytes`` (module docstring); False: copies are synchronous.
    """

    def __init__(
        self,
        tracer: StorageTracer,
        block_of: Any,
        offload: OffloadSettings | None,
        model: nn.Module,
        protected: set[int],
        asynchronous: bool = False,
    ) -> None:
        self.tracer = tracer
        self.block_of = block_of
        self.offload = offload
        self.scope: ModuleScope | None = None
        self.policy: OffloadPolicy | None = None
        if offload is not None:
            # Fake tensors live on the CPU whatever device is estimated, and have no data pointer.
            self.policy = OffloadPolicy(
                min_bytes=offload.min_bytes, devices=("cpu",), plain_type=FakeTensor, storage_key=id
            )
            self.policy.protected = protected
            if offload.include is not None or offload.exclude is not None:
                self.scope = self.policy.scope = ModuleScope(
                    model, offload.include, offload.exclude,
                    include_flag=offload.flag("include"), exclude_flag=offload.flag("exclude"),
                    include_min_bytes=offload.include_min_bytes,
                )  # fmt: skip
        self._by_storage: dict[int, _Entry | _KeptRecord] = {}
        self._session = Session()  # the protocol's entries, in pack order
        self._prefetch_bytes = offload.prefetch_bytes if offload is not None else 0
        self._lock = threading.RLock()
        self.stats = OffloadStats()  # the protocol's counters: reloads, prefetch hits and misses
        self._resident_bytes = 0  # reloaded storages the protocol holds (the tracer counts memory)
        self._inflight: deque[tuple[Tensor, int]] = deque()
        self._inflight_bytes = 0
        self._inflight_limit = offload.max_inflight_bytes if offload is not None and asynchronous else None
        self.offloaded_bytes = 0
        self.offloaded_by_block: dict[str | None, int] = {}
        """Bytes moved to host by the block that saved them (None: outside every block)."""
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.largest_host_bytes = 0
        """The largest host block one moved storage holds (the pool's cap allows one past its bound)."""

    def attach(self) -> None:
        if self.scope is not None:
            self.scope.attach()

    def detach(self) -> None:
        if self.scope is not None:
            self.scope.detach()
        self._by_storage = {}  # dedupe looks within one forward, as the engine's does

    # -- forward ---------------------------------------------------------------------------------

    def pack(self, tensor: Tensor) -> Any:
        block = self.block_of()
        policy = self.policy
        if policy is None:
            self.tracer.mark_saved(tensor, block)
            return tensor
        verdict, alias, _, nbytes, key = policy.decide(tensor)
        if verdict == LEAVE:
            self.tracer.mark_saved(tensor, block)
            return tensor
        version = tensor._version
        entry = self._by_storage.get(key)
        if entry is None or not same_save(entry, alias, version):
            offload = self.offload
            if verdict != MOVE or not fits_host_budget(self.host_bytes, nbytes, offload.host_budget_bytes):
                self._by_storage[key] = _KeptRecord(alias, version)  # the engine keeps it on the device
                self.tracer.mark_saved(tensor, block)
                return tensor
            entry = self._by_storage[key] = _Entry(self, nbytes, alias, version, block)
            self.offloaded_bytes += nbytes
            self.offloaded_by_block[block] = self.offloaded_by_block.get(block, 0) + nbytes
            held = host_bytes(nbytes)  # the host block it takes
            self.host_bytes += held
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
            self.largest_host_bytes = max(self.largest_host_bytes, held)
            entry.layout = _layout(tensor)
            if self._inflight_limit is not None:
                self._copy_in_flight(alias, nbytes)
            return entry  # the first save's handle, as in the engine
        elif type(entry) is _KeptRecord:
            self.tracer.mark_saved(tensor, block)
            return tensor
        return Handle(entry, version, _layout(tensor))

    def _copy_in_flight(self, storage_owner: Tensor, nbytes: int) -> None:
        """``storage_owner``'s storage waits on the device for its copy; the oldest copies are done
        once the window would hold more than ``max_inflight_bytes`` (one alone may)."""
        inflight = self._inflight
        inflight.append((storage_owner, nbytes))
        self._inflight_bytes += nbytes
        while len(inflight) > 1 and self._inflight_bytes > self._inflight_limit:
            self._inflight_bytes -= inflight.popleft()[1]

    def forward_done(self) -> None:
        """Backward starts: the copies still in flight have run."""
        self._inflight.clear()
        self._inflight_bytes = 0

    @property
    def reloaded_bytes(self) -> int:
        return self.stats.reloaded_bytes

    # -- backward --------------------------------------------------------------------------------

    def unpack(self, handle: Any) -> Tensor:
        kind = type(handle)
        if kind is _Entry:  # the first save of an entry holds the entry itself
            entry = handle
        elif kind is Handle:
            entry = handle.entry
        else:
            return handle
        restored = self._take(handle, entry)  # the engine's protocol: reload on a miss, count the view
        dtype, size, stride, offset = handle.layout
        view = restored.view(dtype).as_strided(size, stride, offset)
        session = entry.session
        if session.cursor > 0 and self._prefetch_bytes > 0:  # candidates lie below the cursor
            self._prefetch(session)
        return view

    def _reload(self, entry: _Entry) -> Tensor:
        """The protocol's reload action: a fake storage the tracer counts as an activation."""
        restored = torch.empty(entry.nbytes, dtype=torch.uint8, device=DRY_RUN_DEVICE)
        record = self.tracer.mark_saved(restored, entry.block)
        record.recomputed = True  # a reload is an activation brought back, not a temporary
        return restored
