"""The simulated GPU follows CUDA's rules, not kinder ones (issue 30, section 1): each test shows one
rule on the transport's primitives, as lightmem's code uses them."""

from __future__ import annotations

import gc

import pytest
import torch

from lightmem.testing.simulated import SimulatedAsyncTransport
from lightmem.testing.streams import device_block_size, pinned_block_size

CPU = torch.device("cpu")


@pytest.fixture
def gpu():
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    yield transport
    transport.release_copies_to_host()
    transport.release_copies_to_device()
    transport.catch_up_compute()
    transport.close()


def _copy_to_host(gpu, source, host):
    compute, to_host, _ = gpu.streams(CPU)
    gpu.wait(to_host, gpu.record(compute))
    gpu.copy_to_host(host, source, to_host)
    return gpu.record(to_host)


def test_a_compute_wait_leaves_the_host_free_and_the_host_buffer_old(gpu):
    gpu.hold_copies_to_host()
    source, host = torch.ones(4), torch.zeros(4)  # the caller keeps the device source alive
    event = _copy_to_host(gpu, source, host)
    compute, _, _ = gpu.streams(CPU)
    gpu.wait(compute, event)  # returns at once: it orders device work only
    assert gpu.host_waits == 0 and not gpu.done(event)
    assert torch.equal(host, torch.zeros(4))  # a host read protected by a compute wait: old bytes
    gpu.host_wait(event)
    assert gpu.host_waits == 1 and torch.equal(host, torch.ones(4))


def test_a_compute_wait_lets_later_compute_see_the_copy_and_reuse_its_source(gpu):
    # On the device the copy has read its source before any work queued after the wait runs:
    # compute may overwrite the source; the host bytes still arrive intact, later.
    gpu.hold_copies_to_host()
    source, host = torch.full((4,), 7.0), torch.zeros(4)
    event = _copy_to_host(gpu, source, host)
    gpu.wait(gpu.streams(CPU)[0], event)
    source.fill_(-1.0)  # compute after the wait
    gpu.host_wait(event)
    assert torch.equal(host, torch.full((4,), 7.0))


def test_a_copy_to_the_device_is_visible_to_compute_after_its_wait_before_the_host_sees_it_done(gpu):
    gpu.hold_copies_to_device()
    compute, _, to_device = gpu.streams(CPU)
    device = torch.zeros(4)
    gpu.copy_to_device(device, torch.ones(4), to_device)
    event = gpu.record(to_device)
    assert torch.equal(device, torch.zeros(4))  # queued, not run
    gpu.wait(compute, event)
    assert torch.equal(device, torch.ones(4)) and not gpu.done(event)


@pytest.mark.parametrize("host_waits_first", [True, False])
def test_a_host_write_to_the_source_of_a_queued_copy_is_a_race(gpu, host_waits_first):
    # A compute wait makes the copy's device side happen (eager compute reads it); the copy
    # engine still reads the host bytes later, so only a host wait lets the host write them.
    gpu.hold_copies_to_device()
    compute, _, to_device = gpu.streams(CPU)
    host, device = torch.ones(4), torch.zeros(4)
    gpu.copy_to_device(device, host, to_device)
    event = gpu.record(to_device)
    gpu.wait(compute, event)
    if host_waits_first:
        gpu.host_wait(event)
    host.add_(1.0)  # the optimizer's next step writes the host copy
    gpu.release_copies_to_device()
    gpu.synchronize()
    assert gpu.host_races == (0 if host_waits_first else 1)


def test_compute_is_an_executor_that_lags_the_host(gpu):
    gpu.lag_compute()
    compute = gpu.current_stream()
    event = gpu.record(compute)
    assert not gpu.done(event)  # the GPU has not reached the point the host recorded
    gpu.host_wait(event)  # the host blocks until it has
    assert gpu.done(event)


def test_a_copy_bumps_its_destinations_version_when_queued_and_not_again_when_it_runs(gpu):
    gpu.hold_copies_to_host()
    source, host = torch.ones(4), torch.zeros(4)
    before = host._version
    event = _copy_to_host(gpu, source, host)
    assert host._version == before + 1
    gpu.host_wait(event)
    assert host._version == before + 1 and torch.equal(host, torch.ones(4))


def test_a_copy_whose_source_died_before_it_ran_reads_garbage(gpu):
    gpu.hold_copies_to_host()
    host = torch.zeros(4)
    event = _copy_to_host(gpu, torch.ones(4), host)  # nothing keeps the source alive
    gpu.host_wait(event)
    assert gpu.stale_reads == 1 and bool(host.isnan().all())


def test_several_compute_streams_each_order_only_their_own_work(gpu):
    gpu.hold_copies_to_device()
    default, _, to_device = gpu.streams(CPU)
    gpu.copy_to_device(torch.zeros(4), torch.ones(4), to_device)
    event = gpu.record(to_device)
    with gpu.stream(1) as side:
        assert gpu.streams(CPU)[0] is side and side is not default
        gpu.wait(side, event)
    assert gpu.ordered_after_copies(side) and not gpu.ordered_after_copies(default)
    gpu.wait(default, gpu.record(side))  # default.wait_stream(side): ordered through it
    assert gpu.ordered_after_copies(default)


@pytest.mark.parametrize(
    ("nbytes", "pinned", "device"),
    [(1, 1, 512), (512, 512, 512), (513, 1024, 1024), (3 * 2**20, 4 * 2**20, 3 * 2**20), (5_000_000, 2**23, 5_000_192)],
)
def test_allocators_round_as_torchs_do(nbytes, pinned, device):
    assert pinned_block_size(nbytes) == pinned
    assert device_block_size(nbytes) == device


def test_page_locked_blocks_are_rounded_and_stay_cached_after_free(gpu):
    buffer = gpu.pinned_empty(3 * 2**20)
    assert gpu.pinned_stats() == {"reserved": 4 * 2**20, "allocated": 4 * 2**20, "requested": 3 * 2**20}
    del buffer
    gc.collect()
    assert gpu.pinned_stats() == {"reserved": 4 * 2**20, "allocated": 0, "requested": 0}  # cached
    again = gpu.pinned_empty(4 * 2**20 - 1)  # the cached block is reused
    assert gpu.pinned_stats()["reserved"] == 4 * 2**20
    del again
    gc.collect()
    gpu.empty_pinned_cache()
    assert gpu.pinned_stats()["reserved"] == 0


def test_device_memory_is_counted_in_512_byte_blocks(gpu):
    compute, _, _ = gpu.streams(CPU)
    reload = gpu.alloc_like(torch.empty(250), CPU, compute)  # 1000 bytes
    assert gpu.memory_stats()["allocated_bytes.all.current"] == 1024
    del reload


def test_events_are_counted_while_alive(gpu):
    before = gpu.live_events
    events = [gpu.record(gpu.current_stream()) for _ in range(5)]
    assert gpu.live_events == before + 5
    del events
    gc.collect()
    assert gpu.live_events == before


def test_graph_capture_is_per_stream_and_forbids_queries_and_host_waits(gpu):
    event = gpu.record(gpu.current_stream())
    with gpu.stream(1), gpu.begin_capture():
        assert gpu.capturing()
        with gpu.stream(0):
            assert not gpu.capturing()  # the default stream does not capture
        with pytest.raises(RuntimeError, match="an event queried while capturing"):
            gpu.done(event)
        with pytest.raises(RuntimeError, match="a host wait for an event while capturing"):
            gpu.host_wait(event)
    assert not gpu.capturing() and gpu.capture_violations == 2
