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
from lightmem.testing.simulated import COMPUTE, SimulatedAsyncTransport


def _offload_with(transport, **kwargs):
    kwargs.setdefault("min_bytes", 0)
    return lambda model: offload_activations(model, devices=("cpu",), transport=transport, **kwargs)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", CASES)
def test_gradients_bitwise_equal_under_asynchronous_copies(case, seed, monkeypatch):
    serve_in_flight = seed < 2
    if not serve_in_flight:  # every entry is reloaded, also one whose copy to host still runs
        monkeypatch.setattr(hooks, "served_view", lambda *args: None)
    model, loss_fn = make_case(case)
    expected, _ = run_grads(model, loss_fn)
    transport = SimulatedAsyncTransport(seed=seed, max_delay_s=0.0005)
    prefetch = "64KiB" if seed % 2 else "16MiB"  # a narrow and a wide prefetch window
    actual, off = run_grads(model, loss_fn, _offload_with(transport, prefetch=prefetch))
    assert_bitwise_equal(expected, actual)
    assert transport.stale_reads == 0
    if serve_in_flight:  # backward may overtake every copy to host on a fast model
        assert off.stats.prefetch_hits + off.stats.inflight_served > 0
    else:
        assert off.stats.prefetch_hits > 0 and off.stats.inflight_served == 0
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


def _sabotaged_run(transport, seeds=range(3)):
    """True when some run gives gradients that differ from the reference (or garbage crashes it)."""
    model, loss_fn = make_case("transformer")
    expected, _ = run_grads(model, loss_fn)
    for _ in seeds:
        try:
            actual, _ = run_grads(model, loss_fn, _offload_with(transport))
        except (IndexError, RuntimeError):  # NaN bytes read as token indices
            return True
        if any(not torch.equal(expected[name], actual[name]) for name in expected):
            return True
    return False


class _NoComputeWait(SimulatedAsyncTransport):
    """The compute stream reads reloaded storages without waiting for their copies."""

    def wait(self, stream, event):
        if stream is COMPUTE:
            return
        super().wait(stream, event)


class _NoWaitForHostBytes(SimulatedAsyncTransport):
    """The host-to-device stream does not wait for the device-to-host copy to finish."""

    def wait(self, stream, event):
        if stream is self._h2d:
            return
        super().wait(stream, event)




def test_sabotage_compute_not_waiting_for_reload_is_detected():
    assert _sabotaged_run(_NoComputeWait(seed=1, max_delay_s=0.002))


def test_sabotage_reload_not_waiting_for_offload_copy_is_detected(monkeypatch):
    # An entry whose copy to host has not run is served from the device tensor it still holds, so
    # here a reload only follows a completed copy. On CUDA it also follows a copy the compute
    # stream merely queued a wait for (the in-flight bound): the reload must wait for it itself.
    # Reloading in-flight entries instead of serving them makes that case visible on the CPU.
    monkeypatch.setattr(hooks, "served_view", lambda *args: None)
    assert _sabotaged_run(_NoWaitForHostBytes(seed=1, max_delay_s=0.002))


def test_sabotage_source_released_before_its_copy_ran_is_detected(monkeypatch):
    def careless_settle(self):  # lets go of saved tensors without asking whether their copy ran
        pending = self._pending
        while pending.entries:
            entry = pending.entries.popleft()
            pending.bytes -= entry.nbytes
            entry.release_source()

    monkeypatch.setattr(hooks.Offloader, "_settle", careless_settle)
    transport = SimulatedAsyncTransport(seed=1, max_delay_s=0.002)
    assert _sabotaged_run(transport)
    assert transport.stale_reads > 0


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
