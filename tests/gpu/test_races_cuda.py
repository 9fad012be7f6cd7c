"""The stream protocol under forced overlap on a real GPU, with a negative control per wait.

Skipped where CUDA is not available. See race_kit.py for how a missing wait is made visible.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from gpu import race_kit as kit

from lightmem import offload_activations
from lightmem.transfer.transport import CudaTransport

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("delay", (None, *kit.DELAYS))
def test_gradients_bitwise_equal_with_a_stream_held_back(delay):
    model, x = kit.make_model(CUDA), kit.make_input(CUDA)
    expected = kit.baseline_step(model, x)
    off = offload_activations(model)  # the defaults: devices=("cuda",), min_bytes="1MiB"
    actual = kit.offloaded_step(model, x, off, delay)
    assert isinstance(off.transport, CudaTransport)
    assert not kit.differs(expected, actual)
    assert (off.stats.offloaded_tensors, off.stats.offloaded_bytes) == (7, 7 * kit.ACTIVATION_BYTES)


@pytest.mark.parametrize("kind", sorted(kit.EXPOSING), ids="<-".join)
def test_each_negative_control_gives_the_right_gradients_with_every_wait(kind):
    # The control's own setting, waits kept: a wrong result in the next test is the missing wait's.
    exposure = kit.EXPOSING[kind]
    model, x = kit.make_model(CUDA), kit.make_input(CUDA)
    expected = kit.baseline_step(model, x)
    off = kit.exposed_offloader(model, exposure)
    actual = kit.exposed_step(model, x, off, exposure)
    assert not kit.differs(expected, actual)
    if exposure.nan_after_forward:
        assert off.stats.inflight_waits > 0  # the bound made compute wait: that is the wait dropped
    if exposure.reload_in_flight:
        assert off.stats.inflight_waits == 0 and off.stats.inflight_served == 0


@pytest.mark.parametrize("kind", sorted(kit.EXPOSING), ids="<-".join)
def test_removing_one_wait_gives_wrong_gradients(kind):
    exposure = kit.EXPOSING[kind]
    model, x = kit.make_model(CUDA), kit.make_input(CUDA)
    expected = kit.baseline_step(model, x)
    off = kit.exposed_offloader(model, exposure)
    dropped = kit.drop_wait(off.transport, CUDA, kind)
    actual = kit.exposed_step(model, x, off, exposure)
    assert dropped, f"the protocol never asked for a {kind} wait"
    assert kit.differs(expected, actual), f"without the {kind} waits the result was still right"


def test_every_cross_stream_wait_has_a_negative_control():
    model, x = kit.make_model(CUDA), kit.make_input(CUDA)
    off = offload_activations(model)
    kinds = kit.wait_kinds(off.transport, CUDA)
    kit.offloaded_step(model, x, off, backward_passes=2)
    assert kinds and kinds <= set(kit.EXPOSING), "add a negative control for the new wait"


@pytest.mark.parametrize("delay", (None, "copy_to_device", "compute_in_backward"))
def test_retain_graph_second_backward_bitwise_equal(delay):
    model, x = kit.make_model(CUDA), kit.make_input(CUDA)
    expected = kit.baseline_step(model, x, backward_passes=2)
    off = offload_activations(model)
    actual = kit.offloaded_step(model, x, off, delay, backward_passes=2)
    assert not kit.differs(expected, actual)
    # Each pass reads the 7 offloaded activations once: from a reload, or (no reload) from the
    # device tensor still held while its copy to host runs. With no delay the host runs ahead of
    # the GPU, so up to max_inflight_bytes (4 x 64 MiB) are still in flight when a pass reaches
    # them; the H100 served 8 of the 14 reads so and reloaded 6 x 64 MiB.
    stats = off.stats
    in_flight_bound = off.max_inflight_bytes // kit.ACTIVATION_BYTES
    assert stats.reloaded_bytes == (2 * 7 - stats.inflight_served) * kit.ACTIVATION_BYTES
    assert stats.inflight_served <= 2 * in_flight_bound
    if delay is not None:  # the copies to host were seen complete before backward
        assert stats.inflight_served == 0
    del actual
    torch.cuda.synchronize()
    assert off.live_entries == 0


def test_tensors_under_the_default_min_bytes_stay_on_the_device():
    model, x = kit.make_model(CUDA), kit.make_input(CUDA)[:32].clone()  # 512 KiB activations
    off = offload_activations(model)
    with off:
        loss = kit.loss_of(model, x)
    loss.backward()
    torch.cuda.synchronize()
    assert off.stats.offloaded_tensors == 0
    assert off.stats.kept_bytes == 7 * 32 * kit.WIDTH * 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
@pytest.mark.parametrize("delay", (None, *kit.DELAYS))
def test_second_device_while_device_zero_is_current(delay):
    second = torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0
    model, x = kit.make_model(second), kit.make_input(second)
    expected = kit.baseline_step(model, x)
    off = offload_activations(model)
    actual = kit.offloaded_step(model, x, off, delay)
    assert not kit.differs(expected, actual)
    assert off.stats.offloaded_bytes == 7 * kit.ACTIVATION_BYTES


def _sanitized(*args: str) -> subprocess.CompletedProcess:
    script = Path(__file__).with_name("sanitized_step.py")
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300)


def test_cuda_sanitizer_finds_no_race():
    result = _sanitized()
    assert result.returncode == 0, result.stderr[-4000:]
    assert "CSAN" not in result.stderr
    assert result.stdout.strip() == "bitwise equal"


def test_cuda_sanitizer_reports_the_race_when_the_copy_to_host_does_not_wait():
    result = _sanitized("to_host", "compute")
    assert result.returncode != 0
    assert "CSAN detected a possible data race" in result.stderr
