"""The offload properties on a real GPU: skipped where CUDA is not available."""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from conftest import assert_bitwise_equal
from models import CASES, make_case

from lightmem import offload_activations
from lightmem.offload.transport import CudaTransport


@pytest.fixture(autouse=True)
def deterministic():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    yield


def _cuda_grads(case, context=None, autocast=False):
    model, loss_fn = make_case(case)
    model = model.cuda()
    cuda_loss = _to_cuda(loss_fn)
    ctx = context(model) if context else None
    torch.manual_seed(1234)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast)
    with amp:
        if ctx is not None:
            with ctx:
                loss = cuda_loss(model)
        else:
            loss = cuda_loss(model)
    loss.backward()
    torch.cuda.synchronize()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, ctx


def _to_cuda(loss_fn):
    # make_case closes over CPU inputs; move them by patching the closure cells once.
    for cell in loss_fn.__closure__ or ():
        if isinstance(cell.cell_contents, torch.Tensor):
            cell.cell_contents = cell.cell_contents.cuda()
    return loss_fn


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_cuda_gradients_bitwise_equal(case, autocast):
    expected, _ = _cuda_grads(case, autocast=autocast)
    actual, off = _cuda_grads(case, lambda m: offload_activations(m, min_bytes=0), autocast=autocast)
    assert_bitwise_equal(expected, actual)
    assert isinstance(off.transport, CudaTransport)
    assert off.stats.offloaded_tensors > 0


def test_host_buffers_are_pinned_and_reused():
    model, loss_fn = make_case("transformer")
    model = model.cuda()
    loss_fn = _to_cuda(loss_fn)
    off = offload_activations(model, min_bytes=0)
    for _ in range(3):
        with off:
            loss = loss_fn(model)
        loss.backward()
    torch.cuda.synchronize()
    allocations = off._pool.allocations
    for _ in range(5):
        with off:
            loss = loss_fn(model)
        loss.backward()
    torch.cuda.synchronize()
    assert off._pool.allocations == allocations
    slabs = off._pool._slabs
    assert slabs and all(slab.tensor.is_pinned() for slab in slabs)
    del loss
    gc.collect()
    torch.cuda.synchronize()
    assert off.live_entries == 0


def test_offload_lowers_peak_device_memory():
    model, loss_fn = make_case("transformer")
    model = model.cuda()
    loss_fn = _to_cuda(loss_fn)
    loss_fn(model).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss = loss_fn(model)
    baseline_forward_peak = torch.cuda.max_memory_allocated()
    loss.backward()
    model.zero_grad(set_to_none=True)
    del loss
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with offload_activations(model, min_bytes=0, prefetch=0):
        loss = loss_fn(model)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < baseline_forward_peak
    loss.backward()


def test_copies_to_host_run_on_a_side_stream():
    model, loss_fn = make_case("transformer")
    model = model.cuda()
    loss_fn = _to_cuda(loss_fn)
    off = offload_activations(model, min_bytes=0)
    streams = set()
    original = CudaTransport.copy_to_host

    def spy(self, dst, src, stream):
        streams.add(stream)
        return original(self, dst, src, stream)

    CudaTransport.copy_to_host = spy
    try:
        with off:
            loss = loss_fn(model)
        loss.backward()
    finally:
        CudaTransport.copy_to_host = original
    torch.cuda.synchronize()
    assert streams and torch.cuda.current_stream() not in streams
