"""A host slab and its blocks: the unit of host memory offload holds (``HostSlab``: one allocation,
page-locked at its exact size on CUDA, given back whole by ``close``) and the ranges carved from it
(``HostBlock``: a view of the slab's memory). ``lightmem.transfer.pool`` decides how many slabs to
hold and which ranges to hand out; ``lightmem.transfer.arena`` uses one slab whole for model state.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from lightmem.compiled import never_traced
from lightmem.transfer.page_lock import page_locked_empty, unregister

POISON_BYTE = 0xFF
"""What a slab made to be poisoned is filled with: every float dtype reads 0xFF.. bytes as NaN."""
MAX_CACHED_BLOCKS = 4096
"""Block objects kept per slab for ranges that recur (and request sizes)."""


class HostSlab:
    """One host allocation of ``capacity`` bytes, carved into blocks; free ranges sorted by offset."""

    __slots__ = (
        "blocks", "capacity", "device", "free_offsets", "free_sizes", "on_free", "registered", "sequence",
        "tensor", "used",
    )  # fmt: skip

    def __init__(
        self, capacity: int, pin: bool, poison: bool, on_free: Callable[[torch.Tensor], None] | None = None,
        device: torch.device | None = None, page_locked: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """``page_locked``: the slab's memory, already registered (a chunk made in the background)."""
        self.capacity = capacity
        self.device = device
        self.sequence = -1  # a chunk's place in the order chunks were queued (``ChunkRegistrar``)
        self.on_free = None
        self.registered = False
        if page_locked is not None:
            self.tensor = page_locked
        elif pin:
            self.tensor = page_locked_empty(capacity, device)
        else:
            self.tensor = torch.empty(capacity, dtype=torch.uint8, device="cpu")
        self.registered = pin
        self.on_free = on_free
        if poison:
            self.tensor.fill_(POISON_BYTE)
        self.free_offsets = [0]
        self.free_sizes = [capacity]
        self.used = 0
        self.blocks: dict[tuple[int, int], HostBlock] = {}

    def take(self, size: int) -> HostBlock | None:
        """The first free range of at least ``size`` bytes, split off as a block, or ``None``."""
        sizes = self.free_sizes
        for index, free in enumerate(sizes):
            if free >= size:
                offsets = self.free_offsets
                offset = offsets[index]
                if free == size:
                    del offsets[index], sizes[index]
                else:
                    offsets[index] = offset + size
                    sizes[index] = free - size
                self.used += size
                block = self.blocks.get((offset, size))
                if block is None:
                    if len(self.blocks) >= MAX_CACHED_BLOCKS:
                        self.blocks.clear()
                    block = self.blocks[(offset, size)] = HostBlock(self, offset, size)
                return block
        return None

    def give_back(self, offset: int, size: int) -> None:
        """Return a range, merged with the free ranges on either side."""
        offsets, sizes = self.free_offsets, self.free_sizes
        index = bisect.bisect_left(offsets, offset)
        after = offset + size
        if index < len(offsets) and offsets[index] == after and not (
            index and offsets[index - 1] + sizes[index - 1] == offset
        ):  # the common case, a stack popped: grow the free range above downwards
            offsets[index] = offset
            sizes[index] += size
            return
        if index and offsets[index - 1] + sizes[index - 1] == offset:
            index -= 1
            offset = offsets[index]
            size += sizes[index]
            del offsets[index], sizes[index]
        if index < len(offsets) and offset + size == offsets[index]:
            size += sizes[index]
            del offsets[index], sizes[index]
        offsets.insert(index, offset)
        sizes.insert(index, size)

    @never_traced  # finalizers run wherever a reference drops, also inside a compiled model
    def __del__(self) -> None:
        self.close()  # a pinned slab must be unregistered however it dies

    def close(self) -> None:
        self.blocks = {}
        if self.on_free is not None:
            on_free, self.on_free = self.on_free, None
            on_free(self.tensor)
        if self.registered:
            self.registered = False
            unregister(self.tensor, self.device)


class HostBlock:
    """``capacity`` bytes at ``offset`` in ``slab``; a copy writes ``view(...)`` or ``raw(n)``.

    ``event`` is the last copy that reads or writes the block once it has been released.
    """

    __slots__ = ("_raw", "_view", "_view_key", "capacity", "event", "offset", "requested", "slab")

    def __init__(self, slab: HostSlab, offset: int, capacity: int) -> None:
        self.slab = slab
        self.requested = 0
        self.offset = offset
        self.capacity = capacity
        self.event: Any = None
        self._view: torch.Tensor | None = None
        self._view_key: tuple[torch.dtype, Any] | None = None
        self._raw: torch.Tensor | None = None

    def view(self, dtype: torch.dtype, size: Any) -> torch.Tensor:
        """The block's first bytes as a contiguous ``dtype`` tensor of ``size`` (cached: a step
        hands a block the same shape it had the step before, and building a view costs more than
        the copy into it)."""
        key = (dtype, size)
        if key != self._view_key:
            nbytes = size.numel() * dtype.itemsize
            self._view = self.slab.tensor[self.offset : self.offset + nbytes].view(dtype).view(size)
            self._view_key = key
        return self._view

    def raw(self, nbytes: int) -> torch.Tensor:
        """The block's first ``nbytes`` as a uint8 tensor (cached)."""
        raw = self._raw
        if raw is None or raw.numel() != nbytes:
            raw = self._raw = self.slab.tensor[self.offset : self.offset + nbytes]
        return raw

    @property
    def tensor(self) -> torch.Tensor:
        """The block's bytes as a uint8 tensor."""
        return self.slab.tensor[self.offset : self.offset + self.capacity]
