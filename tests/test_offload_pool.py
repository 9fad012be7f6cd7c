"""Host pool: size classes, reuse, budget, release after the last copy."""

from __future__ import annotations

import pytest

from lightmem.offload.pool import HostPool, size_class
from lightmem.offload.transport import SyncTransport


@pytest.mark.parametrize("nbytes", [8192, 8193, 12345, 1_000_000, 3 * 2**20 + 1, 2**30 + 12345])
def test_size_classes_waste_less_than_one_sixteenth(nbytes):
    capacity = size_class(nbytes)
    assert nbytes <= capacity < nbytes * 17 / 16


@pytest.mark.parametrize("nbytes", [1, 511, 512, 513, 4097, 8191])
def test_small_sizes_round_to_512_bytes(nbytes):
    assert size_class(nbytes) == max(512, -(-nbytes // 512) * 512)


def test_released_block_is_reused_for_the_same_size_class():
    pool = HostPool(SyncTransport(), budget_bytes=2**30, min_available_bytes=0)
    block = pool.acquire(1_000_000)
    pool.release(block)
    assert pool.acquire(999_000) is block
    assert pool.allocations == 1
    assert pool.held_bytes == size_class(1_000_000) == pool.in_use_bytes


def test_budget_is_a_hard_cap():
    pool = HostPool(SyncTransport(), budget_bytes=3 * 2**20, min_available_bytes=0)
    small = pool.acquire(2**20)
    big = pool.acquire(2 * 2**20)
    assert big is not None and pool.held_bytes == 3 * 2**20
    assert pool.acquire(512) is None  # would exceed the budget; nothing cached to trim
    pool.release(small)
    assert pool.acquire(2**20) is small
    assert pool.held_bytes == 3 * 2**20


def test_floor_of_available_memory_refuses_growth():
    pool = HostPool(SyncTransport(), budget_bytes=2**40, min_available_bytes=2**62)
    assert pool.acquire(4096) is None
    assert pool.floor_hits == 1 and pool.held_bytes == 0


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
    assert other is not block
    pool.release(other)
    event.complete = True
    first, second = pool.acquire(4096), pool.acquire(4096)
    assert {id(first), id(second)} == {id(block), id(other)}


def test_clear_gives_cached_blocks_back():
    pool = HostPool(SyncTransport(), budget_bytes=2**30, min_available_bytes=0)
    in_use = pool.acquire(4096)
    pool.release(pool.acquire(8192))
    pool.clear()
    assert pool.held_bytes == in_use.capacity
