"""What CUDA's caching allocator reserves for a step: the step's allocations, replayed through its rules.

A fixed share of the allocated peak for "fragmentation" cannot say when a batch fits: measured under
caps set with ``torch.cuda.set_per_process_memory_fraction`` (expandable segments off), ResNet-50
trained at batch 143 under 12 GiB with 11.82 GiB allocated (1.5% of its activations to spare) and
failed at 144, while the GPT of ``benchmarks/plans_hold.py`` trained at 11 under 16 GiB with 14.12
GiB allocated and failed at 12 with 1 GiB to spare, and a plan checkpointing 13 of its blocks at
batch 22 ran out at 11.8 GiB allocated with 3.97 GiB of split blocks stranded. What is stranded
depends on the order and sizes of the step's requests, so this module replays them through the
allocator (``c10/cuda/CUDACachingAllocator.cpp``, default settings, one stream):

- requests are rounded to 512 bytes; up to 1 MiB they come from the small pool, larger ones from
  the large pool (``cuda_model.round_request_bytes``);
- a request takes the smallest cached free block of its pool that holds it (best fit; ties by
  address) and splits off the rest when the allocator's ``should_split`` says so
  (``cuda_model.splits``); a freed block merges with free neighbours of its segment;
- with no cached block to take, a segment is opened (``cuda_model.segment_bytes``) if the cap
  leaves room for it; else every cached segment with nothing in use is released and the request
  tried again; else the step runs out of memory. Only segments partly in use stay reserved;
- with expandable segments, each pool is one range of addresses, mapped in pages (2 MiB small,
  20 MiB large) as it grows: a request takes a cached free block or maps pages at the lowest free
  addresses, any remainder is split off, and a release unmaps every page holding nothing in use.

The step is replayed as training runs it: the parameters (and cuBLAS workspaces) first, then three
steps, the first without optimizer state (an optimizer creates it in its first step), each freeing
the previous step's gradients where the traced step does. ``reserved_bytes`` is the smallest cap
under which the replay runs: what a budget must leave for the step. Against those measurements (the
ResNet-50 and GPT batches each side of their largest, the GPT's plan at 22) every one lands on the
side of its cap the GPU showed but ResNet-50 at 144, replayed with 0.03 GiB to spare
(``tests/test_caching_allocator.py`` pins the GPT's).

Not modelled: streams other than the compute stream (a block freed while a copy on another stream
still reads it is held until the copy is done; under pressure the allocator waits for such copies
before releasing, so they cost time, not room), the cache left by work before training (lightmem's
own speed measure at fit start leaves none it cannot release), cuDNN's per-call workspaces, and
``max_split_size_mb`` / ``roundup_power2_divisions`` / ``garbage_collection_threshold``.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from lightmem.estimate.device.cuda_memory import (
    LARGE_SEGMENT_BYTES,
    MIN_BLOCK_BYTES,
    ROUND_LARGE_BYTES,
    SMALL_REQUEST_BYTES,
    SMALL_SEGMENT_BYTES,
    round_request_bytes,
    segment_bytes,
    splits,
)
from lightmem.estimate.trace.records import ALLOCATE, FREE, StepAllocations

ADDRESS_SPACE_BYTES = 1 << 48
"""The addresses an expandable segment reserves (more than any device holds)."""
NEED_GRANULE_BYTES = ROUND_LARGE_BYTES
"""What every segment size and page is a multiple of."""
assert SMALL_SEGMENT_BYTES % NEED_GRANULE_BYTES == LARGE_SEGMENT_BYTES % NEED_GRANULE_BYTES == 0
STEPS = 3
"""Steps replayed: the first (no optimizer state yet), then two whose caches carry over."""


class OutOfMemory(Exception):
    """The replay asked for more than the cap allows, after releasing every cached segment it could."""


class _Block:
    __slots__ = ("address", "size", "used", "mapped", "prev", "next", "small", "segment")

    def __init__(self, address: int, size: int, small: bool, segment: int, mapped: bool = True) -> None:
        self.address, self.size, self.small, self.segment, self.mapped = address, size, small, segment, mapped
        self.used = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


def _room(block: _Block) -> int:
    """A cached free block's size with the unmapped addresses after it, which it can grow into."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


class CachingAllocator:
    """The allocator's bookkeeping for one device and stream (module docstring), under ``cap_bytes``
    of reserved memory (None: no cap)."""

    def __init__(self, cap_bytes: int | None, expandable: bool) -> None:
        self.cap = cap_bytes
        self.expandable = expandable
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.retries = 0
        self._free: dict[bool, list[tuple[int, int, int, _Block]]] = {True: [], False: []}
        """Cached free blocks of each pool by (size, address): the allocator's best-fit order."""
        self._segments = itertools.count()
        self._next_address = 0
        self._heads: dict[bool, _Block] = {}
        """With expandable segments: the block at the start of each pool's address range."""
        if expandable:
            for small in (True, False):
                self._heads[small] = _Block(0, ADDRESS_SPACE_BYTES, small, next(self._segments), mapped=False)

    # -- the pool of cached free blocks ---------------------------------------------------------------

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.address, id(block), block))

    def _remove(self, block: _Block) -> None:
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address, id(block)))]

    def _page(self, small: bool) -> int:
        return SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES

    # -- malloc and free ------------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> _Block:
        size = round_request_bytes(nbytes)
        small = size <= SMALL_REQUEST_BYTES
        block = self._cached(size, small)
        if block is None:
            block = self._grow(size, small)
            if block is None:
                self.retries += 1
                self.release()
                block = self._grow(size, small)
            if block is None:
                raise OutOfMemory(size)
        rest = block.size - size
        if rest >= MIN_BLOCK_BYTES and (self.expandable or splits(size, block.size)):
            remainder = _Block(block.address + size, rest, small, block.segment)
            remainder.prev, remainder.next = block, block.next
            if block.next is not None:
                block.next.prev = remainder
            block.next, block.size = remainder, size
            self._insert(remainder)
        block.used = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        self.allocated -= block.size
        block.used = False
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.used and neighbour.mapped:
                self._remove(neighbour)
                block = self._merge(block, neighbour)
        self._insert(block)

    def _merge(self, block: _Block, other: _Block) -> _Block:
        """``other`` (a neighbour of ``block`` in its segment) joins ``block``; the merged block."""
        first, second = (other, block) if other is block.prev else (block, other)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _cached(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        index = bisect.bisect_left(pool, (size,))
        if index == len(pool):
            return None
        if self.expandable:
            # Best fit counts the unmapped addresses a block can grow into (get_free_block).
            while index + 1 < len(pool) and _room(pool[index + 1][3]) < _room(pool[index][3]):
                index += 1
        return pool.pop(index)[3]

    def _grow(self, size: int, small: bool) -> _Block | None:
        """A new segment (or, with expandable segments, newly mapped pages) holding ``size``; None when
        the cap leaves no room for it (the check is on the whole segment, as the allocator's)."""
        opened = segment_bytes(size)
        if self.cap is not None and self.reserved + opened > self.cap:
            return None
        if self.expandable:
            return self._map(size, small)
        block = _Block(self._next_address, opened, small, next(self._segments))
        self._next_address += opened
        self.reserved += opened
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _map(self, size: int, small: bool) -> _Block:
        """Map pages at the lowest addresses where a free block and the unmapped range after it (or an
        unmapped range alone) hold ``size``; the block made of them (out of the pool)."""
        page = self._page(small)
        block = self._unmapped_start(size, small)
        if block.mapped:  # a cached free block the mapping extends
            self._remove(block)
        else:
            block = self._map_into(block, size, page)
        while True:  # map_block merges what it maps with a free block after it
            following = block.next
            if following is not None and following.mapped and not following.used:
                self._remove(following)
                block = self._merge(block, following)
            elif block.size < size:
                assert following is not None and not following.mapped
                block = self._merge(block, self._map_into(following, size - block.size, page))
            else:
                return block

    def _unmapped_start(self, size: int, small: bool) -> _Block:
        """find_expandable_block: the lowest unmapped range that, with the free block before it,
        holds ``size`` (the last one always does)."""
        block: _Block | None = self._heads[small]
        while block is not None:
            if not block.mapped:
                start = block.prev if block.prev is not None and not block.prev.used else block
                room, cursor = 0, start
                while cursor is not None and not cursor.used and room < size:
                    room += cursor.size
                    cursor = cursor.next
                if room >= size:
                    return start
            block = block.next
        raise AssertionError("the address range is never exhausted")

    def _map_into(self, block: _Block, size: int, page: int) -> _Block:
        """Map the first ``size`` bytes of unmapped ``block``, in whole pages; the mapped block."""
        mapped = min(-(-size // page) * page, block.size)
        if mapped < block.size:
            rest = _Block(block.address + mapped, block.size - mapped, block.small, block.segment, mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, mapped
        block.mapped = True
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def release(self) -> None:
        """release_cached_blocks: every cached segment with nothing in use goes back to the device;
        with expandable segments, every whole page of a cached free block is unmapped."""
        for small in (True, False):
            pool, self._free[small] = self._free[small], []
            for *_, block in pool:
                if self.expandable:
                    self._unmap(block)
                elif block.prev is None and block.next is None:
                    self.reserved -= block.size
                else:
                    self._insert(block)

    def _unmap(self, block: _Block) -> None:
        page = self._page(block.small)
        begin = -(-block.address // page) * page
        end = (block.address + block.size) // page * page
        if end <= begin:
            self._insert(block)
            return
        if begin > block.address:  # the part of a page before the unmapped range stays cached
            before = _Block(block.address, begin - block.address, block.small, block.segment)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            else:
                self._heads[block.small] = before
            block.prev = before
            self._insert(before)
        if end < block.address + block.size:
            after = _Block(end, block.address + block.size - end, block.small, block.segment)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            self._insert(after)
        block.address, block.size, block.mapped = begin, end - begin, False
        self.reserved -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.mapped:
                block = self._merge(block, neighbour)


@dataclass(frozen=True)
class Replay:
    """What a replay reached: the allocator's peaks and the times it released its cache to go on."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    retries: int


def replay(allocations: StepAllocations, cap_bytes: int | None, expandable: bool, steps: int = STEPS) -> Replay:
    """Run ``steps`` training steps of ``allocations`` through the allocator under ``cap_bytes``.

    Raises:
        OutOfMemory: a request does not fit the cap, with every cached segment released.
    """
    allocator = CachingAllocator(cap_bytes, expandable)
    for nbytes in allocations.persistent:
        allocator.malloc(nbytes)
    previous: dict[int, collections.deque[_Block]] = collections.defaultdict(collections.deque)
    sizes, events = allocations.sizes, allocations.events
    live: dict[int, _Block] = {}

    def play(part: Sequence[tuple[int, int]]) -> None:
        for kind, value in part:
            if kind == ALLOCATE:
                live[value] = allocator.malloc(sizes[value])
            elif kind == FREE:
                allocator.free(live.pop(value))
            elif previous[value]:
                allocator.free(previous[value].popleft())

    for step in range(steps):
        batch = [allocator.malloc(nbytes) for nbytes in allocations.inputs]
        live.clear()
        if step == 0:  # the optimizer's state is made in the first step's optimizer step
            play(events[: allocations.state_at])
            for nbytes in allocations.state:
                allocator.malloc(nbytes)
            play(events[allocations.state_at :])
        else:
            play(events)
        for slot, block in live.items():
            if slot in allocations.carried:
                previous[sizes[slot]].append(block)
            else:
                allocator.free(block)
        for block in batch:
            allocator.free(block)
    return Replay(allocator.peak_allocated, allocator.peak_reserved, allocator.retries)


def runs_under(allocations: StepAllocations, cap_bytes: int, expandable: bool) -> bool:
    try:
        replay(allocations, cap_bytes, expandable)
    except OutOfMemory:
        return False
    return True


def reserved_bytes(allocations: StepAllocations, expandable: bool) -> int:
    """The smallest cap on reserved memory under which the step trains: what a budget must leave for
    it (the allocator releases its cache and retries before it fails). Every segment and page is a
    multiple of ``NEED_GRANULE_BYTES``, so is every cap the allocator checks against: the answer is
    exact, found by bisection over those multiples."""
    grain = NEED_GRANULE_BYTES
    free = replay(allocations, None, expandable)
    peak = max(free.peak_allocated_bytes, allocations.requested_peak_bytes)
    low = (peak - 1) // grain  # in grains: below the allocated peak nothing runs
    high = -(-free.peak_reserved_bytes // grain)
    while not runs_under(allocations, high * grain, expandable):  # the cap checks whole segments
        low, high = high, high + max(1, (high - low) * 2)
    if high - low > 1 and not runs_under(allocations, (high - 1) * grain, expandable):
        return high * grain  # what it reserves uncapped: no release helps (often so without expandable segments)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if runs_under(allocations, middle * grain, expandable) else (middle, high)
    return high * grain


class Reserve:
    """What one traced step needs reserved, worked out only as far as asked: whether it runs under a
    cap (one replay) or the least cap it runs under (``reserved_bytes``: a dozen). Without requests to
    replay (a CPU step), its allocated peak."""

    def __init__(self, peak_bytes: int, allocations: StepAllocations | None, expandable: bool) -> None:
        self.peak_bytes, self.allocations, self.expandable = peak_bytes, allocations, expandable
        self._bytes: int | None = None if allocations is not None else peak_bytes
        self._runs: dict[int, bool] = {}

    @property
    def bytes(self) -> int:
        if self._bytes is None:
            assert self.allocations is not None
            self._bytes = max(self.peak_bytes, reserved_bytes(self.allocations, self.expandable))
        return self._bytes

    def fits(self, available_bytes: int) -> bool:
        if self.peak_bytes > available_bytes:  # the least cap is never under the allocated peak
            return False
        if self._bytes is not None:
            return self._bytes <= available_bytes
        if available_bytes not in self._runs:
            assert self.allocations is not None
            self._runs[available_bytes] = runs_under(self.allocations, available_bytes, self.expandable)
        return self._runs[available_bytes]
