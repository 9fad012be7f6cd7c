"""Device memory in the GPU's order of execution, and two GPUs in one forward (issue 21).

Skipped where CUDA is not available (the two-GPU test where fewer than two exist). Peaks are read
as ``active_bytes.all.peak`` and ``max_memory_reserved``: ``max_memory_allocated`` drops a block
at its free, before the GPU has passed the work recorded on it, so it would hide reload memory
that is still held.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from gpu import race_kit as kit

from lightmem import offload_activations


def _peaks(model: nn.Module, x: torch.Tensor, off, stall_backward: bool) -> dict[str, int]:
    """Active and reserved peaks of one step from an empty cache (gradients already allocated)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    loss = kit.loss_under(model, x, off)
    if stall_backward:  # the GPU runs ~0.1 s behind: the host queues the whole backward first
        kit.stall(torch.cuda.current_stream())
    loss.backward()
    del loss
    torch.cuda.synchronize()
    return {
        "active": torch.cuda.memory_stats()["active_bytes.all.peak"],
        "reserved": torch.cuda.max_memory_reserved(),
    }


@pytest.mark.parametrize("stall_backward", (False, True), ids=("gpu_keeps_up", "gpu_lags_backward"))
def test_device_memory_active_and_reserved_fall_with_offload(stall_backward):
    model, x = kit.make_model("cuda", depth=8), kit.make_input("cuda")
    kit.baseline_step(model, x)  # warm-up: cuBLAS workspace, gradients allocated once
    off = offload_activations(model, prefetch="128MiB")
    with off:  # a first step: the pool's slabs are page-locked at the next step boundary
        kit.loss_of(model, x).backward()
    baseline = _peaks(model, x, None, stall_backward)
    offloaded = _peaks(model, x, off, stall_backward)
    moved = off.stats.offloaded_bytes
    assert moved == 17 * kit.ACTIVATION_BYTES
    # Without offload all 17 activations are alive when backward starts; with it, the window of
    # 2 reloads, the running node's reads and the copies in flight. Half of the moved bytes is the
    # margin. Reloads bounded only in host time would hold every reload while the GPU lags.
    for kind in ("active", "reserved"):
        assert offloaded[kind] <= baseline[kind] - moved // 2, (kind, baseline, offloaded)


class _TwoDeviceMlp(nn.Module):
    """The race kit's MLP with its first half on cuda:0 and its second on cuda:1."""

    def __init__(self) -> None:
        super().__init__()
        self.first = kit.make_model("cuda:0", depth=2)
        self.second = kit.make_model("cuda:1", depth=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).to("cuda:1"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_devices_in_one_forward_bitwise_equal_with_a_small_inflight_bound():
    x = kit.make_input("cuda:0")
    model = _TwoDeviceMlp()
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    expected = kit.grads(model)
    # One activation in flight: every copy past it makes the oldest entry's own device wait.
    off = offload_activations(model, max_inflight_bytes=kit.ACTIVATION_BYTES)
    for _ in range(2):  # the second step runs on page-locked memory
        model.zero_grad(set_to_none=True)
        kit.stall(torch.cuda.current_stream("cuda:0"))  # device 0 lags while device 1 runs
        with off:
            loss = model(x).square().mean()
        loss.backward()
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        assert not kit.differs(expected, kit.grads(model))
    assert off.stats.inflight_waits > 0
    assert off.stats.offloaded_bytes >= 8 * kit.ACTIVATION_BYTES


def test_the_block_clock_times_each_block_on_the_device_without_waiting_for_it():
    # plan='auto' times blocks with CudaBlockClock (issue 38): a block whose kernel sleeps ~0.1 s
    # reads about that, the host is never held (read() is None while the step still runs), and
    # a block entered twice in a step is summed.
    from lightmem.device_memory import CudaBlockClock

    clock = CudaBlockClock()
    torch.cuda.synchronize()
    kit.stall(torch.cuda.current_stream())  # the GPU runs ~0.1 s behind from here
    for name in ("slow", "fast", "fast"):
        clock.enter(name)
        if name == "slow":
            torch.cuda._sleep(kit.SLEEP_CYCLES)
        else:
            torch.ones(1, device="cuda").add_(1)
        clock.exit(name)
    clock.end_step()
    assert clock.read() is None  # the step's events have not run yet: nothing waits for them
    torch.cuda.synchronize()
    seconds = clock.read()
    assert set(seconds) == {"slow", "fast"}
    assert 0.02 < seconds["slow"] < 1.0 and seconds["fast"] < seconds["slow"] / 10
    assert clock.read() is None
