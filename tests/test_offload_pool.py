"""Host pool: blocks carved from slabs, reuse, coalescing, budget, release after the last copy."""

from __future__ import annotations

import pytest

from lightmem.transfer.pool import ALIGN_BYTES, HEADROOM, HostPool, HostSlab, size_class
from lightmem.transfer.transport import SyncTransport


def _pool(budget_bytes: int = 2**30) -> HostPool:
    return HostPool(SyncTransport(), budget_bytes=budget_bytes, min_available_bytes=0)


@pytest.mark.parametrize("nbytes", [1, 511, 512, 513, 4097, 8191, 1_000_000])
def test_requests_round_up_to_the_alignment(nbytes):
    assert size_class(nbytes) == max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)


def test_released_range_is_reused_and_a_smaller_request_fits_in_it():
    pool = _pool()
    block = pool.acquire(1_000_000)
    pool.release(block)
    again = pool.acquire(999_000)
    assert (again.slab, again.offset) == (block.slab, 0)
    assert pool.allocations == 1
    assert pool.in_use_bytes == size_class(999_000)
    assert pool.held_bytes == int(1_000_000 * HEADROOM) // ALIGN_BYTES * ALIGN_BYTES


def test_freed_neighbours_merge_so_a_larger_request_fits_without_allocating():
    pool = _pool()
    pool.release(pool.acquire(3 * 2**20))  # one slab with room for three MiB
    a, b, c = pool.acquire(2**20), pool.acquire(2**20), pool.acquire(2**20)
    assert [block.offset for block in (a, b, c)] == [0, 2**20, 2 * 2**20] and pool.allocations == 1
    pool.release(b)
    pool.release(a)
    merged = pool.acquire(2 * 2**20)
    assert (merged.slab, merged.offset) == (c.slab, 0) and pool.allocations == 1


def test_budget_is_a_hard_cap():
    pool = _pool(budget_bytes=3 * 2**20)
    first, _ = pool.acquire(2**20), pool.acquire(2**20)
    assert pool.held_bytes == 2 * int(HEADROOM * 2**20)  # each slab with room for growth
    assert pool.acquire(2**20) is None  # a third slab would pass the budget; none is empty
    assert pool.held_bytes == 2 * int(HEADROOM * 2**20)
    pool.release(first)
    again = pool.acquire(2**20)
    assert (again.slab, again.offset) == (first.slab, first.offset)


def test_floor_of_available_memory_refuses_growth():
    pool = HostPool(SyncTransport(), budget_bytes=2**40, min_available_bytes=2**62)
    assert pool.acquire(4096) is None
    assert pool.floor_hits == 1 and pool.held_bytes == 0


def test_step_boundary_merges_the_slabs_of_a_growing_step_into_one():
    pool = _pool()
    blocks = [pool.acquire(nbytes) for nbytes in (2**20, 3 * 2**20, 2**20, 2**21)]
    assert len({block.slab for block in blocks}) > 1
    for block in blocks:
        pool.release(block)
    pool.end_step()
    assert pool.held_bytes <= HEADROOM * 7 * 2**20
    allocations = pool.allocations
    blocks = [pool.acquire(nbytes) for nbytes in (2**20, 3 * 2**20, 2**20, 2**21)]
    (slab,) = {block.slab for block in blocks}
    # No new slab, and the pool holds exactly this one: the step boundary merged them.
    assert pool.allocations == allocations and pool.held_bytes == slab.capacity


class _Event:
    def __init__(self) -> None:
        self.complete = False


class _ManualTransport(SyncTransport):
    def done(self, event):
        return event is None or event.complete


def test_block_released_with_a_pending_event_is_not_reused_until_it_completes():
    pool = HostPool(_ManualTransport(), budget_bytes=2**30, min_available_bytes=0)
    block = pool.acquire(4096)
    event = _Event()
    pool.release(block, event)
    other = pool.acquire(4096)
    assert (other.slab, other.offset) != (block.slab, block.offset)
    assert pool.in_use_bytes == 2 * 4096
    pool.release(other)
    event.complete = True
    assert pool.in_use_bytes == 0


def test_clear_gives_slabs_with_nothing_in_use_back():
    pool = _pool()
    in_use = pool.acquire(4096)
    pool.release(pool.acquire(8 * 2**20))
    pool.clear()
    assert pool.held_bytes == in_use.slab.capacity and pool.in_use_bytes == 4096


def test_a_first_step_of_many_equal_requests_scans_each_slab_once(monkeypatch):
    """A step larger than any before takes a slab per block here (each keeps a 1 KiB remainder):
    a request must not scan the full ones again, or the first step is quadratic."""
    pool = _pool()
    takes = []
    take = HostSlab.take
    monkeypatch.setattr(HostSlab, "take", lambda slab, size: takes.append(slab) or take(slab, size))
    blocks = [pool.acquire(4096) for _ in range(200)]
    assert pool.allocations == 200 and len({block.slab for block in blocks}) == 200
    assert len(takes) == 200 + 199  # the new slab once each, the one before it once (now full)
    for block in blocks:
        pool.release(block)
    pool.end_step()
    takes.clear()
    blocks = [pool.acquire(4096) for _ in range(200)]
    (slab,) = {block.slab for block in blocks}
    assert pool.allocations == 201 and pool.held_bytes == slab.capacity  # one slab, made at the step boundary
