"""Model-state offload on a real GPU: skipped where CUDA is not available.

On CUDA the host step runs the optimizer's CPU implementation, so the reference is a loop that
does forward and backward on the GPU and steps the same optimizer on CPU copies of the parameters
(the CUDA kernels of Adam give other last bits). Copies run on side streams: the tests delay the
compute stream and keep large gradients in flight to give races a chance to show.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from gpu.race_kit import deterministic, step_on_host_copies  # noqa: F401 - deterministic is an autouse fixture
from lightmem import offload_optimizer
from lightmem.transfer.transport import CudaTransport

OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw-decay": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    width = 2048  # 4 x 16 MiB weights: copies take long enough to race
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)), nn.Linear(width, 1)).cuda()


def _batches(count: int):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 2048, generator=generator).cuda(), torch.randn(64, 1, generator=generator).cuda()) for _ in range(count)]


def _backward(model, inputs, targets, accumulate, delay):
    if delay:
        torch.cuda._sleep(50_000_000)  # compute runs well behind the host thread
    (nn.functional.mse_loss(model(inputs), targets) / accumulate).backward()


def _reference(optimizer_name, steps, accumulate, delay, clip=True):
    """GPU forward/backward; the same optimizer stepping CPU copies with the kernel lightmem runs
    there (fused, as these leave foreach/fused unset or ask for it); parameters copied back."""
    model = _model()
    host = [p.detach().cpu().requires_grad_() for p in model.parameters()]
    optimizer = OPTIMIZERS[optimizer_name](host)
    for group in optimizer.param_groups:
        group["fused"] = True
    batches = iter(_batches(steps * accumulate))
    for _ in range(steps):
        for _ in range(accumulate):
            _backward(model, *next(batches), accumulate, delay)
        step_on_host_copies(model, host, optimizer, clip=clip)
    return model, optimizer


def _offloaded(
    optimizer_name, steps, accumulate, delay, max_grad_inflight_bytes="64MiB", overlap_step=False, clip_grad_norm=None
):
    model = _model()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    off = offload_optimizer(
        model, optimizer, max_grad_inflight_bytes=max_grad_inflight_bytes, overlap_step=overlap_step,
        clip_grad_norm=clip_grad_norm,
    )  # fmt: skip
    assert isinstance(off.transport, CudaTransport)
    batches = iter(_batches(steps * accumulate))
    for _ in range(steps):
        for index in range(accumulate):
            with off.accumulating() if index < accumulate - 1 else contextlib.nullcontext():
                _backward(model, *next(batches), accumulate, delay)
            assert all(p.grad is None for p in model.parameters())
        if not overlap_step and clip_grad_norm is None:  # else the offloader clips
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.state_dict()
    stats = off.stats
    off.close()
    return model, state, stats


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "compute-delayed"])
def test_equals_the_same_optimizer_stepping_on_cpu(optimizer_name, delay):
    expected_model, expected_opt = _reference(optimizer_name, steps=3, accumulate=2, delay=delay)
    model, state, stats = _offloaded(optimizer_name, steps=3, accumulate=2, delay=delay)
    _assert_equal(expected_model, expected_opt, model, state, _as_constructed(optimizer_name))
    assert stats.steps == 3


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "compute-delayed"])
def test_the_step_overlapped_with_backward_equals_the_same_optimizer_stepping_on_cpu(optimizer_name, delay):
    # The worker thread waits for each gradient's copy event and steps while backward is queued.
    expected_model, expected_opt = _reference(optimizer_name, steps=3, accumulate=1, delay=delay, clip=False)
    model, state, stats = _offloaded(optimizer_name, steps=3, accumulate=1, delay=delay, overlap_step=True)
    _assert_equal(expected_model, expected_opt, model, state, _as_constructed(optimizer_name))
    assert (stats.steps, stats.overlapped_steps) == (3, 3)


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "compute-delayed"])
def test_clipping_by_norm_as_gradients_land_with_accumulation_equals_the_same_optimizer_stepping_on_cpu(optimizer_name, delay):
    # Each gradient's norm is taken as its copy lands; the step of all starts when backward ends.
    expected_model, expected_opt = _reference(optimizer_name, steps=3, accumulate=2, delay=delay)
    model, state, stats = _offloaded(optimizer_name, steps=3, accumulate=2, delay=delay, overlap_step=True, clip_grad_norm=1.0)
    _assert_equal(expected_model, expected_opt, model, state, _as_constructed(optimizer_name))
    assert (stats.steps, stats.overlapped_steps) == (3, 3)


def _as_constructed(optimizer_name: str) -> Any:
    """The ``fused`` flag the user's optimizer was built with (None where left unset)."""
    return OPTIMIZERS[optimizer_name]([torch.zeros(1, requires_grad=True)]).defaults["fused"]


def _assert_equal(expected_model, expected_opt, model, state, fused: Any = True):
    """Bitwise weights and state; the param groups as the reference's, except ``fused``: the
    reference is built with ``fused=True`` to run the kernel lightmem runs on the host, while
    lightmem's ``state_dict`` reports the flag as the user constructed it (``fused``; the README
    promises that), so a checkpoint loads back into the optimizer the user wrote."""
    torch.cuda.synchronize()
    differing = [
        name for (name, a), b in zip(expected_model.state_dict().items(), model.state_dict().values())
        if not torch.equal(a, b)
    ]  # fmt: skip
    assert not differing, differing
    expected_state = expected_opt.state_dict()
    expected_groups = [{**group, "fused": fused} for group in expected_state["param_groups"]]
    assert expected_groups == state["param_groups"]
    for index, values in expected_state["state"].items():
        for key, value in values.items():
            assert torch.equal(value, state["state"][index][key].to(value.device)), (index, key)


def test_device_gradients_stay_within_the_in_flight_bound():
    _, _, stats = _offloaded("sgd-momentum", steps=2, accumulate=1, delay=True, max_grad_inflight_bytes="16MiB")
    # One 16 MiB weight gradient may wait at a time (plus a bias when the bound is not yet passed).
    assert stats.peak_device_grad_bytes <= 16 * 2**20 + 2048 * 4 + 16 * 2**20


def _backward_bf16(model, inputs, targets, accumulate, delay):
    if delay:
        torch.cuda._sleep(50_000_000)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(inputs).float(), targets) / accumulate
    loss.backward()


@pytest.mark.parametrize("delay", [False, True], ids=["plain", "compute-delayed"])
def test_bf16_device_parameters_equal_bf16_autocast_stepping_fp32_copies_on_cpu(delay):
    # device_dtype=bf16 on a model whose every weight autocast reads in bf16 (linear): the bf16
    # device weights are what autocast would cast the fp32 masters to, and the widened bf16
    # gradients what it would give the fp32 weights, so the run equals bf16 autocast with fp32
    # weights on the GPU and the fp32 step on CPU copies, bitwise.
    steps, accumulate = 3, 2
    model = _model()
    host = [p.detach().cpu().requires_grad_() for p in model.parameters()]
    reference = torch.optim.AdamW(host, lr=1e-3, weight_decay=0.1, fused=True)
    batches = iter(_batches(steps * accumulate))
    for _ in range(steps):
        for _ in range(accumulate):
            _backward_bf16(model, *next(batches), accumulate, delay)
        step_on_host_copies(model, host, reference)

    offloaded = _model()
    fp32_bytes = sum(p.nbytes for p in offloaded.parameters())
    optimizer = torch.optim.AdamW(offloaded.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    off = offload_optimizer(offloaded, optimizer, device_dtype=torch.bfloat16)
    assert sum(p.nbytes for p in offloaded.parameters()) == fp32_bytes // 2
    batches = iter(_batches(steps * accumulate))
    for _ in range(steps):
        for _ in range(accumulate):
            _backward_bf16(offloaded, *next(batches), accumulate, delay)
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert off.stats.param_bytes_in == fp32_bytes // 2
    torch.cuda.synchronize()
    masters = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    for master, param in zip(masters, offloaded.parameters()):
        assert torch.equal(master.to(torch.bfloat16), param.cpu())  # the device holds the masters' rounding
    state = optimizer.state_dict()
    off.close()
    _assert_equal(model, reference, offloaded, state)
