"""The stream protocol CUDA depends on, exercised on CPU with SimulatedAsyncTransport.

Copies run late on worker threads; reload buffers start as NaN bytes; host buffers turn to NaN
bytes the moment the pool may reuse them; a device-to-host copy whose source was not kept alive
reads NaN bytes. Gradients must still be bitwise equal. Each sabotage test removes one wait of the
protocol and shows that the suite notices.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import assert_bitwise_equal, run_grads
from models import CASES, TinyGPT, make_case

from lightmem import offload_activations
from lightmem.offload import hooks
from lightmem.testing.simulated import SimulatedAsyncTransport, is_compute


def _offload_with(transport, **kwargs):
    kwargs.setdefault("min_bytes", 0)
    return lambda model: offload_activations(model, devices=("cpu",), transport=transport, **kwargs)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", CASES)
def test_gradients_bitwise_equal_under_asynchronous_copies(case, seed, monkeypatch):
    # Copies run on worker threads after random delays, but what each counter sees is fixed by
    # the held copies to host: a copy runs only when the in-flight bound makes compute wait for
    # it, so the newest entries (within the bound) are still in flight when backward begins and
    # every older one is reloaded, the first on a miss and the rest ahead of need.
    serve_in_flight = seed < 2
    if not serve_in_flight:  # every entry is reloaded, also one whose copy to host still runs
        monkeypatch.setattr(hooks, "served_view", lambda *args: None)
    model, loss_fn = make_case(case)
    expected, _ = run_grads(model, loss_fn)
    transport = SimulatedAsyncTransport(seed=seed, max_delay_s=0.0005)
    transport.hold_copies_to_host()
    prefetch = "64KiB" if seed % 2 else "16MiB"  # a narrow and a wide prefetch window
    context = _offload_with(transport, prefetch=prefetch, max_inflight_bytes="64KiB")
    actual, off = run_grads(model, loss_fn, context)
    assert_bitwise_equal(expected, actual)
    assert transport.stale_reads == 0 and transport.unordered_source_frees == 0 and transport.host_races == 0
    stats = off.stats
    assert stats.prefetch_misses >= 1 and stats.prefetch_hits > 0
    if serve_in_flight:
        assert stats.inflight_served > 0
    else:
        assert stats.inflight_served == 0
    transport.release_copies_to_host()
    transport.synchronize()
    gc.collect()
    assert off.live_entries == 0 and off.host_bytes_in_use == 0
    transport.close()


def test_gradients_bitwise_equal_under_bf16_autocast_and_retained_graph():
    model, loss_fn = make_case("transformer")
    model.eval()

    def twice(m):
        loss = loss_fn(m)
        return loss, loss

    expected, _ = run_grads(model, loss_fn, autocast=True)
    transport = SimulatedAsyncTransport(seed=7, max_delay_s=0.0005)
    actual, _ = run_grads(model, loss_fn, _offload_with(transport), autocast=True)
    assert_bitwise_equal(expected, actual)
    transport.close()


def _sabotaged_run(transport, hold_to_host=False, hold_to_device=False, **flags):
    """True when the step gives gradients that differ from the reference (or garbage crashes it).

    ``hold_to_host``: copies to host run only when something waits for them (every entry is in
    flight when backward begins); ``hold_to_device``: copies are done before backward and the
    reloads run only when something waits for them. Either makes the missing wait bite every
    time, not when a thread happens to be late.
    """
    model, loss_fn = make_case("transformer")
    expected, _ = run_grads(model, loss_fn)
    if hold_to_host:
        transport.hold_copies_to_host()

    def before_backward():
        if hold_to_device:
            transport.synchronize()
            transport.hold_copies_to_device()

    def release():  # before the pool is dropped: it waits for the copies into its blocks
        transport.release_copies_to_host()
        transport.release_copies_to_device()

    try:
        actual, _ = run_grads(model, loss_fn, _offload_with(transport, **flags), before_backward=before_backward)
    except (IndexError, RuntimeError):  # NaN bytes read as token indices
        release()
        return True
    release()
    return any(not torch.equal(expected[name], actual[name]) for name in expected)


class _NoComputeWait(SimulatedAsyncTransport):
    """The compute stream reads reloaded storages without waiting for their copies."""

    def wait(self, stream, event):
        if is_compute(stream):
            return
        super().wait(stream, event)


class _NoWaitForHostBytes(SimulatedAsyncTransport):
    """The host-to-device stream does not wait for the device-to-host copy to finish."""

    def wait(self, stream, event):
        if not is_compute(stream) and stream.name == "h2d" and not is_compute(event.stream):
            return
        super().wait(stream, event)


def test_sabotage_compute_not_waiting_for_reload_is_detected():
    transport = _NoComputeWait(seed=1, max_delay_s=0.0)
    assert _sabotaged_run(transport, hold_to_device=True)
    transport.close()


def test_sabotage_reload_not_waiting_for_offload_copy_is_detected(monkeypatch):
    # An entry whose copy to host has not run is served from the device tensor it still holds, so
    # here a reload only follows a completed copy. On CUDA it also follows a copy the compute
    # stream merely queued a wait for (the in-flight bound): the reload must wait for it itself.
    # Reloading in-flight entries instead of serving them makes that case visible on the CPU.
    monkeypatch.setattr(hooks, "served_view", lambda *args: None)
    transport = _NoWaitForHostBytes(seed=1, max_delay_s=0.0)
    assert _sabotaged_run(transport, hold_to_host=True)
    transport.close()


def test_sabotage_source_released_before_its_copy_ran_is_detected(monkeypatch):
    def careless_settle(self):  # lets go of saved tensors without asking whether their copy ran
        pending = self._pending
        while pending.entries:
            entry = pending.entries.popleft()()
            if entry is not None:
                pending.bytes -= entry.nbytes
                entry.release_source()

    monkeypatch.setattr(hooks.Offloader, "_settle", careless_settle)
    transport = SimulatedAsyncTransport(seed=1, max_delay_s=0.0)
    assert _sabotaged_run(transport, hold_to_host=True)
    assert transport.stale_reads > 0 and transport.unordered_source_frees > 0
    transport.close()


def test_in_place_change_while_the_copy_is_queued_raises_instead_of_wrong_gradients():
    transport = SimulatedAsyncTransport(seed=1, max_delay_s=0.02)
    x = torch.randn(4096, requires_grad=True)
    with offload_activations(min_bytes=0, devices=("cpu",), transport=transport, prefetch=0):
        a = x * 2
        b = a.sin()  # saves a
        a.mul_(3)  # plain autograd raises at backward; the queued copy would read the new bytes
        del a
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()


def _drop_graphs_while_reloads_are_queued(transport) -> int:
    """Backward through the loss only: its first unpack prefetches the entries before it, which
    nothing consumes; the graph is then freed while those reloads are still queued."""
    torch.manual_seed(0)
    model = TinyGPT()
    tokens = torch.randint(0, 128, (4, 33))
    off = offload_activations(model, min_bytes=0, devices=("cpu",), transport=transport, prefetch="64MiB")
    for _ in range(3):
        with off:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), tokens[:, 1:].reshape(-1))
        torch.autograd.grad(loss, logits)
        del loss, logits
    transport.synchronize()
    with off:  # reaps the pending buffers
        model(tokens[:, :-1])
    return transport.reuse_hazards


def test_host_buffers_wait_for_their_last_copy_before_reuse():
    assert _drop_graphs_while_reloads_are_queued(SimulatedAsyncTransport(seed=3, max_delay_s=0.002)) == 0


# -- the GPU's negative controls (tests/gpu/race_kit.py EXPOSING) on the simulated GPU -----------

_ROLES = {"d2h": "to_host", "h2d": "to_device"}


def _role(stream) -> str:
    return "compute" if is_compute(stream) else _ROLES[stream.name]


class _DroppingOneKind(SimulatedAsyncTransport):
    """Drops every wait of one kind: (stream that waits, stream that recorded the event)."""

    def __init__(self, kind, **kwargs):
        super().__init__(seed=1, max_delay_s=0.0, **kwargs)
        self.kind = kind
        self.dropped = 0

    def wait(self, stream, event):
        if event is not None and (_role(stream), _role(event.stream)) == self.kind:
            self.dropped += 1
            return
        super().wait(stream, event)


def _reloads_while_compute_lags(transport) -> None:
    """A chain of sines (64 KiB saved each), every copy to host done, backward with compute held
    behind the host and one reload ahead: each reload reuses the block of one just read."""
    weight = torch.nn.Parameter(torch.linspace(-2.0, 2.0, 16384))
    with offload_activations(min_bytes=0, devices=("cpu",), transport=transport, prefetch="64KiB"):
        x = weight.clone()
        for _ in range(10):
            x = x.sin()
        loss = x.sum()
    transport.synchronize()
    transport.lag_compute()
    loss.backward()
    transport.catch_up_compute()


# kind -> how the simulated GPU shows its absence, as the GPU kit's Exposure does on a real one
_SIMULATED_EXPOSURES = {
    # reloaded while their copies to host still run, with no compute wait for any copy
    ("to_device", "to_host"): "reload_in_flight",
    # the in-flight bound lets go of memory whose copy has not read it
    ("compute", "to_host"): "small_inflight_bound",
    ("compute", "to_device"): "hold_to_device",
    ("to_device", "compute"): "compute_lags_backward",
}


@pytest.mark.parametrize("kind", sorted(_SIMULATED_EXPOSURES), ids="<-".join)
def test_removing_one_kind_of_wait_is_noticed_on_the_simulated_gpu(kind, monkeypatch):
    exposure = _SIMULATED_EXPOSURES[kind]
    transport = _DroppingOneKind(kind)
    if exposure == "compute_lags_backward":  # torch's kernels run when queued: only the ground truth shows it
        _reloads_while_compute_lags(transport)
        assert transport.device_reuse_hazards > 0
    elif exposure == "reload_in_flight":
        monkeypatch.setattr(hooks, "served_view", lambda *args: None)
        assert _sabotaged_run(transport, hold_to_host=True, max_inflight_bytes="1GiB")
    elif exposure == "small_inflight_bound":
        assert _sabotaged_run(transport, hold_to_host=True, max_inflight_bytes="64KiB")
        assert transport.unordered_source_frees > 0
    else:
        assert _sabotaged_run(transport, hold_to_device=True)
    assert transport.dropped > 0
    transport.close()


def test_the_simulated_controls_are_the_gpu_controls_but_one():
    # The copy to host not waiting for compute would read an activation before the kernel writing
    # it ran; the simulation runs torch's kernels when queued, so only tests/gpu can show it.
    from gpu import race_kit

    assert set(race_kit.EXPOSING) == {*_SIMULATED_EXPOSURES, ("to_host", "compute")}
