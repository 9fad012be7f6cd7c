"""Device memory in the device's order of execution (issue 21 §1, §2), on the simulated transport.

The host runs ahead of the GPU: a reload freed on the host returns to the caching allocator only
as the allocator's stream order allows. These tests let the simulated compute stream lag through
the whole backward and read the simulated device's ``memory_stats()``: the reserved and active
reload bytes must stay within the prefetch window plus what the running backward node reads.
A sabotage variant restores the window counted in host time and must break that bound.

Two simulated devices in one forward check that a copy's source is freed only once its own
device's compute stream is ordered after the copy.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise_equal, run_grads

from lightmem import offload_activations
from lightmem.testing.simulated import SimulatedAsyncTransport, is_compute

LAYERS = 24
NUMEL = 65536
NBYTES = NUMEL * 4  # each layer saves 256 KiB
WINDOW = 2 * NBYTES  # prefetch="512KiB"
NODE_READS = NBYTES  # a sine's backward reads its one saved input
BOUND = WINDOW + NODE_READS


class _Chain(torch.nn.Module):
    """``LAYERS`` sines in a row: each saves its input (256 KiB), and nothing else keeps it alive."""

    def __init__(self, layers: int = LAYERS, numel: int = NUMEL) -> None:
        super().__init__()
        self.layers = layers
        self.weight = torch.nn.Parameter(torch.linspace(-2.0, 2.0, numel))

    def forward(self) -> torch.Tensor:
        x = self.weight.clone()  # saves nothing
        for _ in range(self.layers):
            x = x.sin()
        return x.sum()


def _lagging_backward(transport):
    """The chain's step with every copy to host done, then a backward through which compute lags."""
    model = _Chain()
    expected, _ = run_grads(model, lambda m: m())
    model_copy = _Chain()
    off = offload_activations(model_copy, min_bytes=0, devices=("cpu",), transport=transport, prefetch="512KiB")
    with off:
        loss = model_copy()
    transport.synchronize()
    transport.lag_compute()  # from here to the end of backward the GPU is behind the host
    loss.backward()
    stats = transport.memory_stats()  # read before compute catches up
    transport.catch_up_compute()
    actual = {name: p.grad.clone() for name, p in model_copy.named_parameters()}
    return expected, actual, off, stats


def test_device_memory_of_reloads_stays_within_the_prefetch_window_while_compute_lags():
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    expected, actual, off, stats = _lagging_backward(transport)
    assert_bitwise_equal(expected, actual)
    assert off.stats.reloaded_bytes == LAYERS * NBYTES
    assert off.stats.prefetch_hits == LAYERS - 1
    # Reached and never passed: the window ahead plus the node running.
    assert stats["reserved_bytes.all.peak"] == BOUND
    assert stats["active_bytes.all.peak"] == BOUND
    assert stats["allocated_bytes.all.peak"] == BOUND
    assert transport.device_reuse_hazards == 0
    transport.close()


def test_device_memory_is_given_back_when_backward_ends():
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0)
    _, _, off, _ = _lagging_backward(transport)
    stats = transport.memory_stats()
    assert stats["allocated_bytes.all.current"] == 0 and stats["active_bytes.all.current"] == 0
    assert stats["reserved_bytes.all.current"] == BOUND  # cached, as torch's allocator keeps it
    transport.close()


class _HostTimeWindow(SimulatedAsyncTransport):
    """The reload protocol before issue 21: reload memory allocated on the copy stream and recorded
    for compute (``record_stream``), copies never ordered after compute; the prefetch window is
    then counted only in host time."""

    def alloc_like(self, template, device, stream):
        _, _, to_device = self.streams(device)
        tensor = super().alloc_like(template, device, to_device)
        self.record_stream(tensor, stream)
        return tensor

    def wait(self, stream, event):
        if not is_compute(stream) and stream.name == "h2d" and is_compute(event.stream):
            return
        super().wait(stream, event)


def test_sabotage_device_memory_with_a_host_time_window_breaks_the_bound():
    transport = _HostTimeWindow(seed=0, max_delay_s=0.0)
    expected, actual, _, stats = _lagging_backward(transport)
    assert_bitwise_equal(expected, actual)  # the data is right: only the memory is not bounded
    assert stats["reserved_bytes.all.peak"] > BOUND
    assert stats["reserved_bytes.all.peak"] == LAYERS * NBYTES  # every reload held fresh memory
    assert stats["active_bytes.all.peak"] == LAYERS * NBYTES
    # torch's allocated_bytes drops at the free, before the GPU passes it: it hides the blocks.
    assert stats["allocated_bytes.all.peak"] <= BOUND
    transport.close()


# -- two devices in one forward -------------------------------------------------------------------

SMALL_NUMEL = 16384
SMALL_NBYTES = SMALL_NUMEL * 4  # 64 KiB
PER_DEVICE = 5


class _TwoDeviceChain(torch.nn.Module):
    """Sines on simulated device 0, then on device 1 (``device_map="auto"``, a hand-built pipeline)."""

    def __init__(self, transport: SimulatedAsyncTransport) -> None:
        super().__init__()
        self.transport = transport
        self.weight = torch.nn.Parameter(torch.linspace(-2.0, 2.0, SMALL_NUMEL))

    def forward(self) -> torch.Tensor:
        x = self.weight.clone()
        for device in (0, 1):
            with self.transport.device(device):
                for _ in range(PER_DEVICE):
                    x = x.sin()
        return x.sum()

    def __deepcopy__(self, memo):
        copy = _TwoDeviceChain(self.transport)
        copy.load_state_dict(self.state_dict())
        return copy


def _two_device_step(transport):
    model = _TwoDeviceChain(transport)
    expected, _ = run_grads(model, lambda m: m())
    transport.hold_copies_to_host()  # copies run only when compute waits for them
    context = lambda m: offload_activations(  # noqa: E731
        m, min_bytes=0, devices=("cpu",), transport=transport, max_inflight_bytes=3 * SMALL_NBYTES
    )
    actual, off = run_grads(model, lambda m: m(), context)
    transport.release_copies_to_host()
    transport.synchronize()
    return expected, actual, off


def test_cross_device_inflight_bound_frees_a_tensor_only_after_its_own_device_waits():
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0, devices=2)
    expected, actual, off = _two_device_step(transport)
    assert_bitwise_equal(expected, actual)
    assert off.stats.inflight_waits == 2 * PER_DEVICE - 3  # every copy past the third
    assert transport.unordered_source_frees == 0
    assert transport.stale_reads == 0
    transport.close()


def test_sabotage_cross_device_wait_on_the_newest_entrys_stream_is_detected(monkeypatch):
    from lightmem.transfer import inflight

    def bound_on_newest_stream(self, stats):  # the bound before issue 21: one stream for all
        compute = self.entries[-1]().streams[0]
        while self.entries and self.bytes > self.max_bytes:
            oldest = self.entries.popleft()()
            if oldest is None:
                continue
            self.bytes -= oldest.nbytes
            if not self.transport.done(oldest.host_event):
                self.transport.wait(compute, oldest.host_event)
                stats.inflight_waits += 1
            oldest.release_source()

    monkeypatch.setattr(inflight.InflightCopies, "_bound", bound_on_newest_stream)
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0, devices=2)
    _two_device_step(transport)
    assert transport.unordered_source_frees > 0  # device 0's tensors freed with only device 1 waiting
    transport.close()


@pytest.mark.parametrize("device", (0, 1))
def test_cross_device_reload_memory_is_counted_on_each_device(device):
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0, devices=2)
    _, _, off = _two_device_step(transport)
    stats = transport.memory_stats(device)
    assert off.stats.reloaded_bytes == (2 * PER_DEVICE - 3) * SMALL_NBYTES  # the three newest were served
    # Device 1 reloads two (its three newest were served), device 0 all five.
    reloads = 2 if device == 1 else PER_DEVICE
    assert stats["allocated_bytes.all.current"] == 0
    assert 0 < stats["reserved_bytes.all.peak"] <= reloads * SMALL_NBYTES
    transport.close()
