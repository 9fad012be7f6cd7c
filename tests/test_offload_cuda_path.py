"""The CUDA path's hazards, each shown on CPU (issue 10 items 1, 2, 3, 5).

Page-locking failures are driven through a fake CUDA runtime; the in-flight bound, graph capture
and reload allocation through SimulatedAsyncTransport's held copies, capture flag and lagging
compute stream. Each protection has a sabotage test that removes it and must be noticed.
"""

from __future__ import annotations

import copy
import gc
from types import SimpleNamespace
import warnings

import pytest
import torch
from conftest import assert_bitwise_equal, run_grads
from fake_cudart import TORCH_CUDART_BINDINGS, FakeCudart, FakeDevice, use_fake_runtime, use_simulated_runtime
from models import make_case

from lightmem import offload_activations
from lightmem.offload import hooks
from lightmem.testing.simulated import SimulatedAsyncTransport, is_compute
from lightmem.transfer import inflight, pool
from lightmem.transfer.transport import SyncTransport

NUMEL = 16384
NBYTES = NUMEL * 4  # each saved activation of the sine chain: 64 KiB
SAVES = 10


class _Chain(torch.nn.Module):
    """``SAVES`` sines in a row: each saves its input (64 KiB), and nothing else keeps it alive."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-2.0, 2.0, NUMEL))

    def forward(self) -> torch.Tensor:
        x = self.weight.clone()  # saves nothing
        for _ in range(SAVES):
            x = x.sin()
        return x.sum()


def _chain_loss(model):
    return model()


def _offload_with(transport, **kwargs):
    kwargs.setdefault("min_bytes", 0)
    return lambda model: offload_activations(model, devices=("cpu",), transport=transport, **kwargs)


# -- 1. pinned host memory: a failure never leaves CUDA in an error state, never raises -----------


def test_the_fake_runtime_binds_exactly_what_torch_binds():
    names = {name for name in vars(FakeCudart) if name.startswith("cuda")}
    assert names == set(TORCH_CUDART_BINDINGS)


class _PinnedSync(SyncTransport):
    pin_memory = True


def _pinned_run(monkeypatch, cudart, model_case="transformer", steps=2, **kwargs):
    """``steps`` steps with page-locked host memory; returns the context and the warnings."""
    use_fake_runtime(monkeypatch, cudart)
    model, loss_fn = make_case(model_case)
    expected, _ = run_grads(model, loss_fn)
    model = copy.deepcopy(model)
    off = offload_activations(model, devices=("cpu",), transport=_PinnedSync(), min_bytes=0, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1234)
            with off:
                loss = loss_fn(model)
            loss.backward()
            actual = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            assert_bitwise_equal(expected, actual)
    assert cudart.missing == []  # nothing torch does not bind was called
    return off, [w for w in caught if "could not be allocated or page-locked" in str(w.message)]


def test_failed_registration_clears_cuda_error_and_the_step_uses_pageable_memory(monkeypatch):
    cudart = FakeCudart(register_code=712)  # cudaErrorHostMemoryAlreadyRegistered
    off, warned = _pinned_run(monkeypatch, cudart)
    stats = off.stats  # the second step: the boundary before it tried to page-lock its memory
    assert cudart.last_error == 0  # the next kernel launch would raise it otherwise
    assert stats.host_alloc_failed_bytes == 0 and stats.budget_kept_bytes == 0
    assert stats.offloaded_bytes + stats.kept_bytes == _eligible_bytes(make_case("transformer"))
    assert len(warned) == 1 and "CUDA error 712" in str(warned[0].message)


def test_without_the_warm_start_a_failed_registration_keeps_the_steps_tensors_on_the_device(monkeypatch):
    monkeypatch.setattr(pool, "WARM_START", False)  # one slab page-locked at the boundary, as before
    cudart = FakeCudart(register_code=712)
    off, warned = _pinned_run(monkeypatch, cudart)
    stats = off.stats
    assert cudart.last_error == 0
    assert stats.offloaded_tensors == 0 and stats.budget_kept_bytes == 0
    assert stats.host_alloc_failed_bytes > 0
    assert stats.host_alloc_failed_bytes + stats.kept_bytes == _eligible_bytes(make_case("transformer"))
    assert len(warned) == 1 and "CUDA error 712" in str(warned[0].message)


def _eligible_bytes(case) -> int:
    """Bytes of saved storages the same run offloads when host memory is plentiful."""
    model, loss_fn = case
    _, off = run_grads(model, loss_fn, _offload_with(SyncTransport()))
    return off.stats.offloaded_bytes + off.stats.kept_bytes


@pytest.mark.parametrize("warm_start", [True, False])
def test_registration_that_raises_is_not_raised_from_pack(monkeypatch, warm_start):
    monkeypatch.setattr(pool, "WARM_START", warm_start)
    off, warned = _pinned_run(monkeypatch, FakeCudart(raises=True), model_case="cnn")
    eligible = _eligible_bytes(make_case("cnn")) - off.stats.kept_bytes
    if warm_start:  # the chunk failed in the background: the step used pageable memory
        assert off.stats.offloaded_bytes == eligible and off.stats.host_alloc_failed_bytes == 0
    else:  # the boundary's registration failed: the step kept its tensors on the device
        assert off.stats.offloaded_tensors == 0 and off.stats.host_alloc_failed_bytes == eligible
    assert len(warned) == 1 and "cudaHostRegister" in str(warned[0].message)


def test_host_allocation_failure_is_not_raised_from_pack_and_retried_next_step(monkeypatch):
    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(pool, "HostSlab", no_memory)
    model = _Chain()
    transport = SyncTransport()
    off = offload_activations(model, min_bytes=0, devices=("cpu",), transport=transport)
    with pytest.warns(UserWarning, match="could not be allocated or page-locked"):
        with off:
            loss = model()
    loss.backward()
    assert off.stats.host_alloc_failed_bytes == SAVES * NBYTES
    assert off.stats.offloaded_tensors == 0
    monkeypatch.undo()  # memory is back: the next step tries again
    with off:
        loss = model()
    loss.backward()
    assert off.stats.offloaded_bytes == SAVES * NBYTES and off.stats.host_alloc_failed_bytes == 0


def test_first_step_registers_nothing_and_the_step_boundary_page_locks_one_chunk(monkeypatch):
    cudart = FakeCudart()
    before = pool.registration_stats()
    off, warned = _pinned_run(monkeypatch, cudart, steps=1)
    assert off.stats.offloaded_tensors > 0 and not warned
    assert cudart.registered == {}  # no cudaHostRegister inside a saved-tensor hook
    with off:  # the step boundary: page-locking starts in the background
        pass
    off.prepare_host(wait=True)
    assert len(cudart.registered) == 1
    after = pool.registration_stats()
    assert after.registrations - before.registrations == 1
    assert after.pinned_bytes - before.pinned_bytes == off.host_bytes_held
    off.release_host_memory()
    assert pool.registration_stats().pinned_bytes == before.pinned_bytes


def test_registered_slabs_are_unregistered_when_given_back(monkeypatch):
    cudart = FakeCudart()
    off, warned = _pinned_run(monkeypatch, cudart, steps=3)
    assert off.stats.offloaded_tensors > 0 and not warned
    assert cudart.registered and not cudart.unregistered
    gc.collect()
    off.release_host_memory()
    assert cudart.unregistered == set(cudart.registered) and cudart.last_error == 0


def test_failed_unregistration_is_reported_and_its_error_cleared(monkeypatch):
    cudart = FakeCudart(unregister_code=1)  # cudaErrorInvalidValue
    off, _ = _pinned_run(monkeypatch, cudart, steps=2)
    gc.collect()
    with pytest.warns(UserWarning, match=r"cudaHostUnregister of \d+ bytes failed \(CUDA error 1\)"):
        off.release_host_memory()
    assert cudart.last_error == 0
    assert cudart.missing == []


def test_registration_runs_in_the_context_of_the_saved_tensors_device(monkeypatch):
    cudart = FakeCudart()
    use_fake_runtime(monkeypatch, cudart)
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    host_pool = pool.HostPool(_PinnedSync(), budget_bytes=2**30, min_available_bytes=0)
    on_cuda_1 = SimpleNamespace(device=torch.device("cuda", 1))  # a rank on cuda:1, no set_device
    block = host_pool.acquire(2**20, on_cuda_1)
    host_pool.release(block)
    host_pool.end_step()  # page-locks the step's memory as one chunk, in the background
    host_pool.wait_for_chunks()
    assert list(cudart.registered.values()) == [1]
    assert FakeDevice.current is None
    host_pool.clear()
    assert cudart.unregistered == set(cudart.registered)


# -- 2. the bytes in flight to host are bounded ------------------------------------------------


def test_inflight_bound_holds_device_bytes_and_serves_in_flight_entries_without_reload():
    model = _Chain()
    expected, _ = run_grads(model, _chain_loss)
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    transport.hold_copies_to_host()
    actual, off = run_grads(model, _chain_loss, _offload_with(transport, max_inflight_bytes=3 * NBYTES))
    assert_bitwise_equal(expected, actual)
    stats = off.stats
    assert transport.max_held_source_bytes == 3 * NBYTES  # never more than the bound, and reached
    assert stats.inflight_waits == SAVES - 3  # each copy past the third waited for the oldest
    assert stats.inflight_served == 3  # the three still in flight are read from the device
    assert stats.reloaded_bytes == (SAVES - 3) * NBYTES
    assert (stats.prefetch_misses, stats.prefetch_hits) == (1, SAVES - 4)
    assert transport.stale_reads == 0
    transport.release_copies_to_host()
    transport.close()


def test_in_flight_device_memory_goes_once_backward_has_read_it_though_the_copies_still_run():
    # The host runs ahead of the GPU: it may see the window's copies complete only after backward.
    # Holding their device tensors until then kept max_inflight_bytes on the device beside every
    # gradient at the end of backward (found with issue 39). An entry that dies (its graph is
    # freed) with its copy still running makes its compute stream wait for the copy, and goes.
    model = _Chain()
    expected, _ = run_grads(model, _chain_loss)
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    transport.hold_copies_to_host()
    actual, off = run_grads(model, _chain_loss, _offload_with(transport, max_inflight_bytes=3 * NBYTES))
    gc.collect()
    assert_bitwise_equal(expected, actual)
    assert off.stats.inflight_served == 3
    assert transport.held_source_bytes() == 0  # the copies are still held; their sources are gone
    assert transport.unordered_source_frees == 0 and transport.stale_reads == 0
    assert off._offloader._pending.bytes == 0
    transport.release_copies_to_host()
    transport.close()


def test_sabotage_in_flight_memory_let_go_without_a_compute_wait_is_detected(monkeypatch):
    def careless_retire(self, entry):
        self.bytes -= entry.nbytes

    monkeypatch.setattr(inflight.InflightCopies, "retire", careless_retire)
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    transport.hold_copies_to_host()
    _, off = run_grads(_Chain(), _chain_loss, _offload_with(transport, max_inflight_bytes=3 * NBYTES))
    gc.collect()
    assert transport.unordered_source_frees == 3  # freed while the copy that reads them was queued
    transport.release_copies_to_host()  # before the pool goes: it waits for the copies into its blocks
    del off
    transport.close()


def test_sabotage_no_inflight_bound_is_detected(monkeypatch):
    monkeypatch.setattr(inflight.InflightCopies, "_bound", lambda self, stats: None)
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    transport.hold_copies_to_host()
    _, off = run_grads(_Chain(), _chain_loss, _offload_with(transport, max_inflight_bytes=3 * NBYTES))
    assert transport.max_held_source_bytes == (SAVES - 1) * NBYTES  # every queued copy held
    transport.release_copies_to_host()  # before the pool goes: it waits for the copies into its blocks
    del off
    transport.close()


def test_sabotage_in_flight_entry_reloaded_into_a_second_buffer_is_detected(monkeypatch):
    monkeypatch.setattr(hooks, "served_view", lambda *args: None)
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    transport.hold_copies_to_host()
    _, off = run_grads(_Chain(), _chain_loss, _offload_with(transport, max_inflight_bytes=3 * NBYTES))
    assert off.stats.reloaded_bytes == SAVES * NBYTES
    transport.close()


def test_max_inflight_bytes_flag_is_validated():
    with pytest.raises(ValueError, match=r"offload_activations\(max_inflight_bytes=...\)"):
        offload_activations(devices=("cpu",), max_inflight_bytes=-1)
    assert offload_activations(devices=("cpu",)).max_inflight_bytes == 256 * 2**20


# -- 3. CUDA graph capture: saved tensors stay in place, nothing is queried or queued -----------


def _capture_run(transport, sabotage=False):
    model = _Chain()
    expected, _ = run_grads(model, lambda m: m() + m())
    model_copy = _Chain()
    off = offload_activations(model_copy, min_bytes=0, devices=("cpu",), transport=transport)
    if sabotage:
        off._offloader._capturing = None  # the offloader no longer asks
    with off:
        eager = model_copy()  # offloaded, copies held in flight
        transport.capturing_graph = True
        try:
            captured = model_copy()  # as under torch.cuda.graph / make_graphed_callables
        finally:
            transport.capturing_graph = False
    (eager + captured).backward()
    actual = {name: p.grad.clone() for name, p in model_copy.named_parameters()}
    return expected, actual, off


def test_graph_capture_keeps_saved_tensors_in_place_and_queries_nothing():
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    transport.hold_copies_to_host()
    expected, actual, off = _capture_run(transport)
    transport.release_copies_to_host()
    assert_bitwise_equal(expected, actual)
    assert transport.capture_violations == 0
    assert off.stats.capture_kept_bytes == SAVES * NBYTES
    assert off.stats.offloaded_bytes == SAVES * NBYTES  # the eager forward's
    transport.close()


def test_sabotage_offloading_while_capturing_is_detected():
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    transport.hold_copies_to_host()
    with pytest.raises(RuntimeError, match="simulated CUDA graph capture") as raised:
        _capture_run(transport, sabotage=True)  # its frames (and offloader) live in the traceback
    assert transport.capture_violations > 0
    transport.capturing_graph = False
    transport.release_copies_to_host()  # before the pool goes: it waits for the copies into its blocks
    del raised
    transport.close()


# -- 5. reload buffers: allocated on the compute stream, copied once compute has reached them ----


def _lagging_backward(transport):
    """Forward as usual; backward while the compute stream runs behind the calling thread."""
    model = _Chain()
    expected, _ = run_grads(model, _chain_loss)
    model_copy = _Chain()
    # One reload ahead: each reuses the memory of one that backward has just freed.
    off = offload_activations(model_copy, min_bytes=0, devices=("cpu",), transport=transport, prefetch=NBYTES)
    with off:
        loss = model_copy()
    transport.synchronize()  # every copy to host has run: backward reloads all of them
    # Compute is an executor of its own: forward's copies may have waited for it too. Count backward's.
    transport.side_waits_on_lagging_compute = 0
    transport.lag_compute()
    loss.backward()
    transport.catch_up_compute()
    actual = {name: p.grad.clone() for name, p in model_copy.named_parameters()}
    return expected, actual, off


def test_reload_copies_wait_for_compute_and_never_overwrite_memory_compute_still_reads():
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    expected, actual, off = _lagging_backward(transport)
    assert_bitwise_equal(expected, actual)
    assert off.stats.reloaded_bytes == SAVES * NBYTES
    assert transport.side_waits_on_lagging_compute == SAVES  # each copy waits for compute's point
    assert transport.record_stream_calls == 0  # the memory is the compute stream's own
    assert transport.device_reuse_hazards == 0
    assert transport.memory_stats()["reserved_bytes.all.peak"] == 2 * NBYTES  # the node's + one ahead
    transport.close()


class _CopyNotAfterCompute(SimulatedAsyncTransport):
    """Reload copies do not wait for the compute stream's point at their allocation."""

    def wait(self, stream, event):
        if not is_compute(stream) and stream.name == "h2d" and is_compute(event.stream):
            return
        super().wait(stream, event)


def test_sabotage_reload_copy_not_ordered_after_compute_is_detected():
    transport = _CopyNotAfterCompute(seed=0, max_delay_s=0.0)
    _lagging_backward(transport)
    assert transport.side_waits_on_lagging_compute == 0
    assert transport.device_reuse_hazards > 0  # a copy wrote memory that lagging compute still read
    transport.close()


# -- the bound and in-flight serving on real models, at the default min_bytes --------------------


def _hf_model(kind: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=256, n_positions=128, n_embd=128, n_layer=3, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("kind", ("gpt2", "llama"))
def test_inflight_bound_on_real_models_at_the_default_min_bytes(kind, monkeypatch):
    bound = 4 * 2**20
    held = []
    add = inflight.InflightCopies.add

    def add_and_measure(self, entry, stats):
        add(self, entry, stats)
        held.append(self.bytes)

    monkeypatch.setattr(inflight.InflightCopies, "add", add_and_measure)
    tokens = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))

    def loss_fn(model):
        return model(input_ids=tokens, labels=tokens).loss

    model = _hf_model(kind)
    expected, _ = run_grads(model, loss_fn)
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    transport.hold_copies_to_host()
    at_defaults = _offload_with(transport, min_bytes="1MiB", max_inflight_bytes=bound)
    actual, off = run_grads(model, loss_fn, at_defaults)
    assert_bitwise_equal(expected, actual)
    stats = off.stats
    assert stats.offloaded_bytes > 4 * bound  # the default min_bytes moves the big activations
    assert max(held) <= bound and stats.inflight_waits > 0 and stats.inflight_served > 0
    assert stats.reloaded_bytes < stats.offloaded_bytes  # the entries served were not reloaded
    assert transport.stale_reads == 0
    transport.release_copies_to_host()
    transport.close()


def test_backward_captured_over_offloaded_tensors_raises_a_clear_error():
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    model = _Chain()
    with offload_activations(model, min_bytes=0, devices=("cpu",), transport=transport):
        loss = model()
    transport.synchronize()
    transport.capturing_graph = True
    try:
        with pytest.raises(RuntimeError) as raised:
            loss.backward()
    finally:
        transport.capturing_graph = False
    assert str(raised.value) == hooks.CAPTURED_RELOAD_MESSAGE
    assert transport.capture_violations == 0
    transport.close()


class _PinnedSimulated(SimulatedAsyncTransport):
    pin_memory = True


def test_step_boundary_page_locks_the_first_steps_memory_also_after_unconsumed_reloads(monkeypatch):
    # A backward through the loss only: its unpack reloads and prefetches the sines' entries,
    # which nothing reads; the graph is then dropped. The pageable slabs of that first step are
    # still replaced by one page-locked slab at a step boundary.
    cudart = FakeCudart()
    use_fake_runtime(monkeypatch, cudart)
    pinned_before = pool.registration_stats().pinned_bytes
    transport = _PinnedSimulated(seed=0, max_delay_s=0.002)
    model = _Chain()
    off = offload_activations(model, min_bytes=0, devices=("cpu",), transport=transport, prefetch="64MiB")
    with off:
        out = model.weight.clone()
        for _ in range(SAVES):
            out = out.sin()
        loss = (out * out).sum()  # its backward reads out: the first unpack, which prefetches
    transport.synchronize()  # every copy to host has run: backward reloads
    torch.autograd.grad(loss, out)
    del loss, out
    assert off.stats.reloaded_bytes == (SAVES + 1) * NBYTES
    assert cudart.registered == {}
    # The first boundary reshapes the pool before the offloader lets go of the entries whose
    # copies it now sees complete; the second replaces the pageable slabs.
    for _ in range(2):
        with off:
            pass
    off.prepare_host(wait=True)
    assert len(cudart.registered) == 1 and off.host_bytes_in_use == 0
    assert off.host_bytes_held == pool.registration_stats().pinned_bytes - pinned_before
    off.release_host_memory()
    transport.close()


# -- one storage saved on two compute streams (issue 30, section 2.3) ------------------------------


class _TwoStreams(torch.nn.Module):
    """One activation saved by an op on the default stream and by an op on compute stream 1."""

    def __init__(self, transport: SimulatedAsyncTransport) -> None:
        super().__init__()
        self.transport = transport
        self.weight = torch.nn.Parameter(torch.linspace(-2.0, 2.0, NUMEL))

    def forward(self) -> torch.Tensor:
        x = self.weight * 2.0
        first = x.sin()  # saves x on the default stream
        with self.transport.stream(1):
            second = x.cos()  # saves x again, on stream 1
        return (first + second).sum()

    def __deepcopy__(self, memo):
        twin = _TwoStreams(self.transport)
        twin.load_state_dict(self.state_dict())
        return twin


def test_every_compute_stream_that_saved_a_storage_waits_for_its_reload():
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    model = _TwoStreams(transport)
    expected, _ = run_grads(model, lambda m: m())

    def before_backward():
        transport.synchronize()  # every copy to host ran: backward reloads x
        transport.hold_copies_to_device()

    actual, off = run_grads(model, lambda m: m(), _offload_with(transport), before_backward=before_backward)
    assert_bitwise_equal(expected, actual)
    assert off.stats.deduplicated_bytes == NBYTES and off.stats.reloaded_bytes == NBYTES
    with transport.stream(1) as second:
        assert transport.ordered_after_copies(second)  # it read the reload: it waited for the copy
    assert transport.ordered_after_copies(transport.current_stream())
    transport.release_copies_to_device()
    transport.close()


# -- pageable host memory: slabs page-locked even when graphs overlap every boundary (2.8) ---------


def test_slabs_are_page_locked_even_when_graphs_overlap_every_step_boundary(monkeypatch):
    # Pipelined micro-batches: the next forward starts before the last backward ends, so blocks
    # are in use at every step boundary. Copies into pageable memory block the host (the CUDA
    # runtime copies them synchronously); the pool must page-lock a slab all the same.
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0, page_locking=True)
    use_simulated_runtime(monkeypatch, transport)
    model = _Chain()
    expected, _ = run_grads(_Chain(), _chain_loss)
    off = offload_activations(model, min_bytes=0, devices=("cpu",), transport=transport)
    pageable, losses = [], []
    for _ in range(6):
        transport.synchronize()  # at each boundary the GPU has caught up: the blocks in use are the live graph's
        with off:
            losses.append(model())
        if len(losses) == 2:
            transport.synchronize()  # every copy to host has run: backward reloads every entry
            losses.pop(0).backward()
        pageable.append(transport.pageable_copies)
    transport.synchronize()
    losses.pop().backward()
    # Step 1's copies to host are pageable, and so are their reloads in step 2. The boundary after
    # step 1 page-locks a chunk beside the slab still in use, which step 2's copies wait for; step 3
    # (two steps alive) waits for the chunk the boundary after step 2 queued for the blocks it
    # carried over. From step 2 on no copy to host is pageable.
    assert pageable == [SAVES, 2 * SAVES, 2 * SAVES, 2 * SAVES, 2 * SAVES, 2 * SAVES]
    transport.synchronize()
    gc.collect()
    assert off.live_entries == 0
    off.release_host_memory()
    assert transport.runtime.page_locked_bytes == 0
    transport.close()
