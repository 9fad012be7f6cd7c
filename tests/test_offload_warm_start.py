"""The warm start (issue 37 item 3): host memory page-locked ahead of need, on background threads,
in chunks that join the pool as each is registered.

On the simulated GPU with page-locking on, a copy between the device and pageable host memory
blocks the host (counted in ``pageable_copies``), a copy whose host range is not inside one
registration counts as pageable, and ``cudaHostRegister`` records the thread that called it.
Threads are ordered with events (``hold_registrations``, ``waiting``), never with sleeps.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings

import pytest
import torch
from conftest import assert_bitwise_equal, run_grads
from fake_cudart import use_simulated_runtime

from lightmem import offload_activations
from lightmem.metrics.names import key
from lightmem.metrics.probes import HostProbe
from lightmem.testing.simulated import SimulatedAsyncTransport
from lightmem.transfer import page_lock, pool
from lightmem.transfer.transport import SyncTransport

NUMEL = 12288
NBYTES = NUMEL * 4  # each saved activation of the chain: 48 KiB
SAVES = 10
KiB = 1024
MiB = 1024**2
GiB = 1024**3


class _Chain(torch.nn.Module):
    """``SAVES`` sines in a row: each saves its input (48 KiB), and nothing else keeps it alive."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-2.0, 2.0, NUMEL))

    def forward(self) -> torch.Tensor:
        x = self.weight.clone()
        for _ in range(SAVES):
            x = x.sin()
        return x.sum()


@pytest.fixture
def gpu(monkeypatch):
    """The simulated GPU, whose runtime lightmem's page-locking calls reach."""
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0, page_locking=True)
    use_simulated_runtime(monkeypatch, transport)
    yield transport
    gc.collect()  # pools the test dropped unregister in this runtime, not in torch's CPU-only one
    transport.runtime.release_registrations()
    for thread in _page_lock_threads():  # none may register in the next test's runtime
        thread.join()
    transport.close()


def _offloader(transport, model=None, **kwargs):
    return offload_activations(model, min_bytes=0, devices=("cpu",), transport=transport, **kwargs)


def _step(model, off):
    """One step; the simulated GPU catches up before backward, so backward reloads every entry."""
    model.zero_grad(set_to_none=True)
    with off:
        loss = model()
    off.transport.synchronize()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _expected_grads():
    grads, _ = run_grads(_Chain(), lambda m: m())
    return grads


def _page_lock_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(page_lock.THREAD_NAME)]


# -- ahead of need -------------------------------------------------------------------------------


def test_prepare_host_page_locks_off_the_training_thread_and_the_first_step_copies_into_it(gpu):
    model = _Chain()
    off = _offloader(gpu, model)
    before = page_lock.registration_stats()
    prepared = off.prepare_host(SAVES * NBYTES)
    grads = _step(model, off)
    gpu.synchronize()
    assert prepared == int(SAVES * NBYTES * pool.HEADROOM) == off.host_bytes_held
    assert gpu.pageable_copies == 0  # every copy to host and back used page-locked memory
    assert threading.get_ident() not in gpu.runtime.register_threads
    after = page_lock.registration_stats()
    assert after.registrations - before.registrations == 1
    assert after.pinned_bytes - before.pinned_bytes == prepared
    assert_bitwise_equal(_expected_grads(), grads)
    off.release_host_memory()
    assert gpu.runtime.page_locked_bytes == 0


def test_huge_page_chunks_are_2mib_aligned_registered_whole_and_give_bitwise_gradients(gpu, monkeypatch):
    monkeypatch.setattr(page_lock, "HUGE_PAGES", True)
    model = _Chain()
    off = _offloader(gpu, model)
    prepared = off.prepare_host(SAVES * NBYTES, wait=True)
    starts = list(gpu.runtime.ranges)
    grads = _step(model, off)
    gpu.synchronize()
    assert prepared == int(SAVES * NBYTES * pool.HEADROOM)
    assert [start % page_lock.HUGE_PAGE_BYTES for start in starts] == [0]
    assert gpu.pageable_copies == 0
    assert_bitwise_equal(_expected_grads(), grads)
    off.release_host_memory()
    assert gpu.runtime.page_locked_bytes == 0


def test_a_huge_page_buffer_is_exactly_sized_aligned_and_outlives_its_mapping_name():
    buffer = page_lock.host_buffer(3 * MiB + 5, huge_pages=True)
    gc.collect()  # only the tensor refers to the mapping now
    buffer.fill_(7)
    assert (buffer.nbytes, buffer.data_ptr() % page_lock.HUGE_PAGE_BYTES) == (3 * MiB + 5, 0)
    assert int(buffer.sum()) == 7 * (3 * MiB + 5)
    assert page_lock.host_buffer(4096, huge_pages=False).nbytes == 4096


@contextlib.contextmanager
def _registrations_held_until_asked(gpu, monkeypatch):
    """Registrations wait inside ``cudaHostRegister`` until a request for host memory waits for a
    chunk under way (``ChunkRegistrar.wait_for``): that request then waits, whatever the threads'
    timing. A request that finds no chunk under way (one of a step in pageable memory) releases
    nothing: it would let a later chunk be made before the request meant to wait for it."""
    asked = threading.Event()
    wait_for = page_lock.ChunkRegistrar.wait_for

    def noted(self, nbytes):
        if not self.done and self.under_way(nbytes):
            asked.set()
        return wait_for(self, nbytes)

    monkeypatch.setattr(page_lock.ChunkRegistrar, "wait_for", noted)
    gpu.runtime.hold_registrations()
    releaser = threading.Thread(target=lambda: (asked.wait(), gpu.runtime.release_registrations()))
    releaser.start()
    try:
        yield
    finally:
        asked.set()
        releaser.join()


def test_a_request_waits_for_the_chunk_being_page_locked_instead_of_taking_pageable_memory(gpu, monkeypatch):
    model = _Chain()
    off = _offloader(gpu, model)
    before = page_lock.registration_stats()
    with _registrations_held_until_asked(gpu, monkeypatch):
        off.prepare_host(SAVES * NBYTES)
        _step(model, off)  # its first request finds the chunk still being registered
    gpu.synchronize()
    assert gpu.pageable_copies == 0
    assert page_lock.registration_stats().chunk_waits - before.chunk_waits == 1
    off.release_host_memory()


def test_a_block_never_spans_two_chunks(gpu, monkeypatch):
    # 48 KiB blocks in 64 KiB chunks: carving across a chunk's end would put the second block over
    # two registrations, which the simulated GPU counts as a pageable copy.
    monkeypatch.setattr(pool, "CHUNK_FIRST_BYTES", 64 * KiB)
    monkeypatch.setattr(pool, "CHUNK_MAX_BYTES", 64 * KiB)
    model = _Chain()
    off = _offloader(gpu, model)
    before = page_lock.registration_stats().registrations
    off.prepare_host(SAVES * 64 * KiB, wait=True)  # every chunk registered before the count below
    grads = _step(model, off)
    gpu.synchronize()
    assert page_lock.registration_stats().registrations - before == 12  # 800 KiB: 11 x 64 KiB and 96 KiB
    assert gpu.pageable_copies == 0
    assert_bitwise_equal(_expected_grads(), grads)
    off.release_host_memory()


def test_the_simulated_gpu_counts_a_copy_over_two_registrations_as_pageable(gpu):
    # Two cudaHostRegister calls over adjacent ranges: CUDA does not promise that a copy spanning
    # both is a page-locked copy, so the simulation never treats it as one.
    host = torch.empty(2 * 4096, dtype=torch.uint8)
    gpu.runtime.cudaHostRegister(host.data_ptr(), 4096, 0)
    gpu.runtime.cudaHostRegister(host.data_ptr() + 4096, 4096, 0)
    _, to_host, _ = gpu.streams(torch.device("cpu"))
    source = torch.ones(2048, dtype=torch.uint8)
    gpu.copy_to_host(host[1024:3072], source, to_host)  # inside the first registration
    assert gpu.pageable_copies == 0
    gpu.copy_to_host(host[3072:5120], source, to_host)  # over both
    gpu.synchronize()
    assert gpu.pageable_copies == 1
    assert torch.equal(host[1024:5120], torch.ones(4096, dtype=torch.uint8))


def test_prepare_host_stays_within_the_host_budget(gpu):
    off = _offloader(gpu, _Chain(), host_budget=300 * KiB)
    assert off.prepare_host(SAVES * NBYTES) == 300 * KiB
    assert off.host_bytes_held == 300 * KiB
    off.release_host_memory()


def test_prepared_memory_the_steps_do_not_use_goes_back_trim_window_steps_later(gpu):
    model = _Chain()
    off = _offloader(gpu, model)
    off.prepare_host(10 * SAVES * NBYTES)
    held = []
    for _ in range(pool.TRIM_WINDOW_STEPS + 1):
        _step(model, off)
        gpu.synchronize()
        held.append(off.host_bytes_held)
    prepared = int(10 * SAVES * NBYTES * pool.HEADROOM)
    # Then the pool holds its bound, HEADROOM x the step, queued at that boundary: the step's
    # requests wait for it rather than copy into pageable memory.
    assert held == [prepared] * pool.TRIM_WINDOW_STEPS + [int(SAVES * NBYTES * pool.HEADROOM)]
    assert gpu.pageable_copies == 0
    assert threading.get_ident() not in gpu.runtime.register_threads
    off.release_host_memory()


def test_prepare_host_wait_returns_once_the_chunks_are_page_locked(gpu):
    off = _offloader(gpu, _Chain())
    off.prepare_host(SAVES * NBYTES, wait=True)
    assert gpu.runtime.page_locked_bytes == int(SAVES * NBYTES * pool.HEADROOM)
    assert _page_lock_threads() == []
    off.release_host_memory()


def test_chunks_grow_from_the_first_size_to_the_cap_and_a_small_rest_joins_the_last():
    assert pool.chunk_sizes(5 * GiB) == [256 * MiB, 512 * MiB, GiB, 2 * GiB, 1280 * MiB]
    assert pool.chunk_sizes(300 * MiB) == [300 * MiB]
    assert pool.chunk_sizes(2 * GiB, at_least=GiB) == [GiB, GiB]
    assert pool.chunk_sizes(0) == []


# -- at the step boundary ------------------------------------------------------------------------


def test_the_step_boundary_page_locks_on_a_background_thread_and_the_next_step_copies_into_it(gpu):
    model = _Chain()
    off = _offloader(gpu, model)
    _step(model, off)  # no prepare_host: the first step's memory is pageable
    gpu.synchronize()
    assert gpu.pageable_copies == 2 * SAVES  # to host and back
    grads = _step(model, off)
    gpu.synchronize()
    assert gpu.pageable_copies == 2 * SAVES
    assert gpu.runtime.register_threads and threading.get_ident() not in gpu.runtime.register_threads
    assert_bitwise_equal(_expected_grads(), grads)
    off.release_host_memory()
    assert gpu.runtime.page_locked_bytes == 0


def test_without_the_warm_start_the_boundary_registers_on_the_training_thread(gpu, monkeypatch):
    # The behaviour before the warm start, kept behind pool.WARM_START for benchmarks/warm_start.py.
    monkeypatch.setattr(pool, "WARM_START", False)
    model = _Chain()
    off = _offloader(gpu, model)
    assert off.prepare_host(SAVES * NBYTES) == 0
    for _ in range(2):
        _step(model, off)
    assert gpu.runtime.register_threads == [threading.get_ident()]
    off.release_host_memory()


# -- closing, failures, no CUDA ------------------------------------------------------------------


def test_release_host_memory_during_background_registration_leaves_nothing_page_locked_and_no_thread(gpu):
    off = _offloader(gpu, _Chain())
    before = page_lock.registration_stats().pinned_bytes
    gpu.runtime.hold_registrations()
    off.prepare_host(SAVES * NBYTES)
    gpu.runtime.waiting.wait()  # a chunk is inside cudaHostRegister
    releasing = threading.Thread(target=off.release_host_memory)
    releasing.start()  # cancels what is queued and waits for the chunk being registered
    gpu.runtime.release_registrations()
    releasing.join()
    assert gpu.runtime.page_locked_bytes == 0
    assert _page_lock_threads() == []
    assert off.host_bytes_held == 0
    assert page_lock.registration_stats().pinned_bytes == before


def test_a_context_dropped_during_background_registration_gives_its_chunk_back(gpu):
    off = _offloader(gpu, _Chain())
    before = page_lock.registration_stats().pinned_bytes
    gpu.runtime.hold_registrations()
    off.prepare_host(SAVES * NBYTES)
    gpu.runtime.waiting.wait()
    threads = _page_lock_threads()
    del off
    gc.collect()
    gpu.runtime.release_registrations()
    for thread in threads:
        thread.join()
    assert threads and gpu.runtime.page_locked_bytes == 0
    assert page_lock.registration_stats().pinned_bytes == before


def test_a_chunk_that_cannot_be_page_locked_warns_once_and_the_step_uses_pageable_memory(gpu):
    gpu.runtime.register_error = 2  # cudaErrorMemoryAllocation
    model = _Chain()
    off = _offloader(gpu, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off.prepare_host(SAVES * NBYTES)
        for _ in range(2):  # the step boundary tries again
            grads = _step(model, off)
            gpu.synchronize()
            assert off.stats.offloaded_tensors == SAVES and off.stats.host_alloc_failed_bytes == 0
    warned = [w for w in caught if "could not be allocated or page-locked" in str(w.message)]
    assert len(warned) == 1 and "CUDA error 2" in str(warned[0].message)
    assert gpu.pageable_copies == 2 * 2 * SAVES
    assert gpu.runtime.page_locked_bytes == 0
    assert_bitwise_equal(_expected_grads(), grads)
    off.release_host_memory()


def test_prepare_host_without_page_locking_does_nothing():
    off = _offloader(SyncTransport(), _Chain())
    assert off.prepare_host(SAVES * NBYTES) == 0
    assert off.host_bytes_held == 0 and _page_lock_threads() == []


def test_prepare_host_rejects_a_size_it_cannot_read_naming_itself():
    off = _offloader(SyncTransport(), _Chain())
    with pytest.raises(ValueError, match="prepare_host"):
        off.prepare_host("a lot")


# -- metrics ---------------------------------------------------------------------------------------


def test_page_locking_time_and_the_time_training_waited_for_it_are_logged_per_logged_step(monkeypatch):
    readings = iter([
        page_lock.RegistrationStats(registration_s=1.0, prefault_s=0.5, blocked_s=0.25),
        page_lock.RegistrationStats(registration_s=3.0, prefault_s=0.5, blocked_s=0.25),
    ])  # fmt: skip
    after = page_lock.RegistrationStats(registration_s=3.0, prefault_s=0.5, blocked_s=0.25)
    monkeypatch.setattr(page_lock, "registration_stats", lambda: next(readings, after))
    probe = HostProbe(lambda: 0)
    first, second = probe.collect(), probe.collect()
    assert (first[key("host/page_lock_ms")], first[key("host/page_lock_wait_ms")]) == (1500.0, 250.0)
    assert (second[key("host/page_lock_ms")], second[key("host/page_lock_wait_ms")]) == (2000.0, 0.0)


# -- the GPU negative controls' timing (tests/gpu/race_kit.py, issue 39) ----------------------------


@pytest.mark.parametrize("settled", [False, True])
def test_the_race_kits_step_after_a_pageable_one_waits_for_page_locking_unless_settled(gpu, settled, monkeypatch):
    # On the H100 the compute<-to_host control could not fail: its measured step, the one after a
    # first step in pageable memory, waited on the host for the chunks page-locked at the step
    # boundary, and the time-based stall on the copy stream ran out meanwhile. The kit now settles
    # the host memory first (race_kit.settle_host_memory) and asserts the forward waited for none.
    # Unsettled, the registrations of the step boundary are held until the forward asks for their
    # memory, so that it waits whatever the threads' timing (without, it waited in 17 runs of 18;
    # released by the first step's requests, which found no chunk under way, in 25 of 30 under load).
    from gpu import race_kit

    model = _Chain()
    off = _offloader(gpu, model)
    with contextlib.nullcontext() if settled else _registrations_held_until_asked(gpu, monkeypatch):
        _step(model, off)  # the first step: pageable slabs
        if settled:
            race_kit.settle_host_memory(off)
        waits = race_kit.page_lock_waits()
        grads = _step(model, off)
    waited = race_kit.page_lock_waits() - waits
    assert waited == 0 if settled else waited >= 1
    assert_bitwise_equal(_expected_grads(), grads)
    off.release_host_memory()


def test_a_kernel_that_refuses_the_huge_page_advice_still_gets_its_chunk(monkeypatch):
    # A kernel built without transparent huge pages answers MADV_HUGEPAGE with EINVAL: the buffer is
    # then made of plain pages, never a failed chunk (which would leave the step's copies pageable).
    import mmap

    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(page_lock.mmap, "mmap", Refusing)
    buffer = page_lock.host_buffer(3 * MiB, huge_pages=True)
    buffer.fill_(1)
    assert (buffer.nbytes, int(buffer.sum())) == (3 * MiB, 3 * MiB)
