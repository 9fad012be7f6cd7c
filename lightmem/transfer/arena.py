"""Host tensors carved from one allocation of their exact size: ``HostArena``.

Model-state offload keeps the host copies of the parameters, their gradient buffers and their
accumulation staging in arenas: tensors that live as long as the offload and are copied to and from
the device every step, so they want page-locked memory of their exact size, given back at once.
"""

from __future__ import annotations

import torch

from lightmem.config import format_bytes, warn_once
from lightmem.transfer.page_lock import HostAllocationError
from lightmem.transfer.slab import HostSlab
from lightmem.transfer.transport import Transport

ALIGN_BYTES = 64
"""Each tensor of an arena starts on a cache line (vector loads of the host kernels)."""


class HostArena:
    """Host tensors shaped like ``like`` carved from one allocation of their exact (aligned) size.

    Copies between host and device run asynchronously only from page-locked memory. Page-locked
    one tensor at a time (``pin_memory=True``), torch's host caching allocator would round each up
    to a power of two (1.3-1.7x on transformer shapes) and keep it cached after ``close``; the
    arena is one ``HostSlab``, page-locked with ``cudaHostRegister`` at its exact size as the
    activation pool's slabs are, and unregistered by ``close``. Where page-locking fails it stays
    pageable (copies are then staged by the CUDA runtime), with one warning.
    """

    def __init__(
        self, like: list[torch.Tensor], transport: Transport, device: torch.device, page_locked: bool = True
    ) -> None:
        offsets, total = [], 0
        for tensor in like:
            offsets.append(total)
            total += _aligned(tensor.nbytes)
        try:
            pin = transport.pin_memory and page_locked  # no copy reads or writes a tensor not page-locked
            self.slab = HostSlab(max(total, 1), pin, poison=False, device=device)
        except HostAllocationError as error:
            warn_once(
                f"lightmem: optimizer offload could not page-lock {format_bytes(total)} of host memory "
                f"({error}); its copies are staged through pageable memory and run synchronously"
            )
            self.slab = HostSlab(max(total, 1), False, poison=False, device=device)
        self.nbytes = total
        storage = self.slab.tensor.untyped_storage()
        base = self.slab.tensor.storage_offset()
        # Each tensor is its own, not a view of the slab: a version counter of its own, so an
        # in-place write to one gradient (clipping) shows on that gradient alone (the overlapped host step checks them).
        self.tensors = [
            torch.empty(0, dtype=tensor.dtype, device=storage.device).set_(
                storage, (base + offset) // tensor.element_size(), tensor.shape, _contiguous_strides(tensor.shape)
            )
            for offset, tensor in zip(offsets, like)
        ]

    def close(self) -> None:
        self.slab.close()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
