"""Saved-tensor hooks for the fake step: record what autograd saves, and simulate lightmem's offload.

Without offload, ``pack`` only tells the tracer which storages autograd keeps for backward. With an
``OffloadSettings``, which saved tensors move is decided by the engine's own code
(``lightmem.offload.policy``: eligibility, parameter and buffer storages and their autocast copies,
``min_bytes``, scope, dedupe, host budget), run here on fake tensors. A moved tensor is dropped
from the graph at pack time and a fake tensor of the same layout is allocated again when backward
needs it, so the reload is counted where it happens. Reloads ahead of need follow the policy's
prefetch window in reverse pack order, as the engine's do.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from lightmem.config import OffloadSettings
from lightmem.estimate.tracer import StorageTracer
from lightmem.offload.policy import (
    LEAVE,
    MOVE,
    OffloadPolicy,
    fits_host_budget,
    host_bytes,
    prefetch_admits,
    same_save,
)
from lightmem.offload.scope import ModuleScope


class _KeptRecord:
    """A storage the engine would keep on the device; later saves of it are not decided again."""

    __slots__ = ("alias", "version")

    def __init__(self, alias: Tensor, version: int) -> None:
        self.alias = weakref.ref(alias)
        self.version = version


class _Entry:
    """One offloaded storage, shared by every save of it."""

    __slots__ = (
        "__weakref__",
        "alias",
        "block",
        "done",
        "handles",
        "index",
        "nbytes",
        "prefetched",
        "restored",
        "unpacks",
        "version",
    )

    def __init__(self, nbytes: int, index: int, alias: Tensor, version: int, block: str | None) -> None:
        self.alias = weakref.ref(alias)
        self.nbytes = nbytes
        self.index = index
        self.version = version
        self.restored: Tensor | None = None  # a uint8 fake tensor over the reloaded storage
        self.handles = 0
        self.unpacks = 0
        self.prefetched = False
        self.block = block
        self.done = False  # every save has been unpacked in this backward


class _Handle:
    """What autograd holds for one save of an offloaded storage."""

    __slots__ = ("dtype", "entry", "offset", "owner", "seen", "size", "stride")

    def __init__(self, owner: SavedTensorHooks, entry: _Entry, tensor: Tensor) -> None:
        self.owner = owner
        self.entry = entry
        self.dtype = tensor.dtype
        self.size = tuple(tensor.shape)
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.seen = False
        entry.handles += 1

    def __del__(self) -> None:
        entry = self.entry
        entry.handles -= 1
        if self.seen:
            entry.unpacks -= 1
        if entry.restored is not None and entry.unpacks >= entry.handles:
            self.owner._let_go(entry)


class SavedTensorHooks:
    """Pack/unpack hooks for ``torch.autograd.graph.saved_tensors_hooks`` around the fake forward.

    Args:
        tracer: receives the saved storages and the reload allocations.
        block_of: returns the top-level block whose forward is running (for per-block figures).
        offload: what to offload, or None to only record saves.
        model: the model, for ``include`` / ``exclude`` module patterns.
        protected: ids of parameter and buffer storages (``id(tensor.untyped_storage())``),
            which are never offloaded.
    """

    def __init__(
        self,
        tracer: StorageTracer,
        block_of: Any,
        offload: OffloadSettings | None,
        model: nn.Module,
        protected: set[int],
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
                )  # fmt: skip
        self._entries: list[Any] = []  # weak references, in pack order
        self._by_storage: dict[int, _Entry | _KeptRecord] = {}
        self._cursor = sys.maxsize
        self._inflight_bytes = 0
        self.offloaded_bytes = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.reloaded_bytes = 0

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
            host = host_bytes(nbytes)
            entry = _Entry(nbytes, len(self._entries), alias, version, block)
            self._entries.append(weakref.ref(entry, lambda _ref, host=host: self._host_release(host)))
            self._by_storage[key] = entry
            self.offloaded_bytes += nbytes
            self.host_bytes += host
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        elif type(entry) is _KeptRecord:
            self.tracer.mark_saved(tensor, block)
            return tensor
        return _Handle(self, entry, tensor)

    def _host_release(self, host: int) -> None:
        self.host_bytes -= host

    # -- backward --------------------------------------------------------------------------------

    def unpack(self, handle: Any) -> Tensor:
        if type(handle) is not _Handle:
            return handle
        entry = handle.entry
        if entry.restored is None:
            self._cursor = min(self._cursor, entry.index)
            self._reload(entry)
        elif entry.prefetched:
            entry.prefetched = False
            self._inflight_bytes -= entry.nbytes
        restored = entry.restored
        view = restored.view(handle.dtype).as_strided(handle.size, handle.stride, handle.offset)
        if not handle.seen:
            handle.seen = True
            entry.unpacks += 1
            if entry.unpacks >= entry.handles:
                entry.done = True
                self._let_go(entry)
        if self.offload is not None and self.offload.prefetch_bytes > 0:
            self._prefetch()
        return view

    def _reload(self, entry: _Entry) -> None:
        restored = torch.empty(entry.nbytes, dtype=torch.uint8)
        record = self.tracer.mark_saved(restored, entry.block)
        record.recomputed = True  # a reload is an activation brought back, not a temporary
        entry.restored = restored
        self.reloaded_bytes += entry.nbytes

    def _prefetch(self) -> None:
        index = min(self._cursor, len(self._entries)) - 1
        while index >= 0:
            entry = self._entries[index]()
            if entry is not None and entry.restored is None and not entry.done:
                limit = self.offload.prefetch_bytes if self.offload is not None else 0
                if not prefetch_admits(self._inflight_bytes, entry.nbytes, limit):
                    return
                self._reload(entry)
                entry.prefetched = True
                self._inflight_bytes += entry.nbytes
            self._cursor = index
            index -= 1

    def _let_go(self, entry: _Entry) -> None:
        if entry.prefetched:
            entry.prefetched = False
            self._inflight_bytes -= entry.nbytes
        entry.restored = None
