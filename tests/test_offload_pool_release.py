"""Host pool release (issue 10, item 4): safe from finalizers, never ahead of a pending copy."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from lightmem.testing.simulated import SimulatedAsyncTransport
from lightmem.testing.streams import Event
from lightmem.transfer.pool import HostPool, size_class
from lightmem.transfer.transport import SyncTransport


class _Owner:
    """Stands for a ``_HostEntry``: gives its block back from ``__del__``."""

    def __init__(self, pool: HostPool, block) -> None:
        self.pool = pool
        self.block = block
        self.cycle = self  # only the cyclic garbage collector frees it

    def __del__(self) -> None:
        self.pool.release(self.block)


@pytest.mark.parametrize("trigger", ["last reference", "garbage collection"])
def test_release_from_a_finalizer_run_inside_acquire_does_not_deadlock(monkeypatch, trigger):
    pool = HostPool(SyncTransport(), budget_bytes=2**30, min_available_bytes=0)
    owners = [_Owner(pool, pool.acquire(4096))]
    if trigger == "garbage collection":
        owners[0] = None  # now only the reference cycle keeps it
    grow = pool._new_slab

    def grow_with_a_finalizer(capacity: int):
        # The allocation is where CPython may run a finalizer: force one here, lock held.
        owners.clear()
        gc.collect()
        return grow(capacity)

    monkeypatch.setattr(pool, "_new_slab", grow_with_a_finalizer)
    gc.disable()  # no collection before the one inside acquire
    try:
        got = []
        worker = threading.Thread(target=lambda: got.append(pool.acquire(2**20)), daemon=True)
        worker.start()
        worker.join(timeout=20)
    finally:
        gc.enable()
    assert not worker.is_alive(), "acquire deadlocked on a release from a finalizer"
    assert got[0] is not None
    assert pool.in_use_bytes == size_class(2**20)  # the deferred release was taken in


def _queued_copy_into_a_released_block(transport: SimulatedAsyncTransport):
    """A pool whose only block is released while a copy into it waits on a closed gate."""
    pool = HostPool(transport, budget_bytes=2**30, min_available_bytes=0)
    block = pool.acquire(2**20)
    source = torch.ones(2**18)
    gate = Event()
    _, to_host, _ = transport.streams(torch.device("cpu"))
    transport.wait(to_host, gate)
    transport.copy_to_host(block.view(torch.float32, source.size()), source, to_host)
    event = transport.record(to_host)
    pool.release(block, event)  # e.g. an entry freed by an exception mid-forward
    return pool, event, gate, source


def test_dropped_pool_waits_for_the_copy_still_writing_its_block_before_giving_memory_back():
    transport = SimulatedAsyncTransport(max_delay_s=0.0)
    pool, event, gate, source = _queued_copy_into_a_released_block(transport)
    assert not transport.done(event)
    opener = threading.Timer(0.2, gate.flag.set)
    opener.start()
    del pool  # the slab goes back to the OS only after the copy ran
    assert transport.done(event)
    assert transport.reuse_hazards == 0
    opener.join()
    transport.close()


def test_without_that_wait_the_simulated_transport_sees_memory_given_back_under_a_copy(monkeypatch):
    monkeypatch.setattr(HostPool, "__del__", lambda self: None)
    transport = SimulatedAsyncTransport(max_delay_s=0.0)
    pool, event, gate, source = _queued_copy_into_a_released_block(transport)
    del pool
    gc.collect()
    assert transport.reuse_hazards == 1
    gate.flag.set()  # the queued copy still holds its destination's memory on CPU: safe to run
    transport.synchronize()
    transport.close()
