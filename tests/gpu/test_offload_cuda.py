"""The offload properties on real models and a real GPU: skipped where CUDA is not available.

Race tests (delayed streams, negative controls, the sanitizer) are in test_races_cuda.py.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from conftest import assert_bitwise_equal
from models import CASES, make_case

from lightmem import offload_activations
from lightmem.transfer.transport import CudaTransport


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


def test_host_buffers_are_page_locked():
    from gpu import race_kit as kit

    model, x = kit.make_model("cuda"), kit.make_input("cuda")
    off = offload_activations(model)
    with off:  # a first step: its slabs are page-locked at the next step boundary, not in a hook
        kit.loss_of(model, x).backward()
    with off:
        loss = kit.loss_of(model, x)
    entries = [ref() for ref in off._offloader._session.refs]
    # is_pinned asks the driver (cudaPointerGetAttributes): memory CUDA does not know as
    # page-locked host memory is not pinned, whatever lightmem believes.
    pinned = [entry.host.is_pinned() for entry in entries]
    loss.backward()
    torch.cuda.synchronize()
    assert len(pinned) == 7 and all(pinned)


def test_offload_lowers_peak_device_memory_over_forward_and_backward():
    from gpu import race_kit as kit

    model, x = kit.make_model("cuda", depth=8), kit.make_input("cuda")
    prefetch = 2 * kit.ACTIVATION_BYTES
    off = offload_activations(model, prefetch=prefetch)
    # Warm-up: cuBLAS workspace; the gradient buffers, kept and accumulated into from now on, so
    # both runs hold them for the whole step; and a first offloaded step, whose host memory is
    # pageable (a copy into it blocks the host) and page-locked at the step boundary.
    kit.loss_of(model, x).backward()
    kit.loss_under(model, x, off).backward()
    peaks = {}
    for name, context in (("baseline", None), ("offload", off)):
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = kit.loss_under(model, x, context)
        loss.backward()
        del loss
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
    stats = off.stats
    offloaded = stats.offloaded_bytes
    assert offloaded == 17 * kit.ACTIVATION_BYTES
    # The documented device cost (docs/offload-protocol.md). Without offload the 17 activations
    # are alive when backward starts; offload frees all of them but x, which the caller holds
    # (moving it frees nothing), and holds instead the copies in flight (max_inflight_bytes),
    # the prefetch window and what the running backward node reads (a reload, and at the end the
    # reload of x beside the caller's x). With the gradients allocated throughout, both peaks are
    # at the start of backward. The H100 run of 2026-11-27 set the gradients to None: the offload
    # peak then came at the end of backward, with all 8 gradients (512 MiB) allocated that the
    # baseline's peak (at the start) did not hold yet, in a first step whose copies to host were
    # pageable: 1,746,435,072 B against 2,216,081,920 B, short of a bound of half the offloaded.
    freed = offloaded - x.nbytes
    held = off.max_inflight_bytes + prefetch + 2 * kit.ACTIVATION_BYTES
    report = {**peaks, "inflight_waits": stats.inflight_waits, "inflight_served": stats.inflight_served}
    assert peaks["offload"] <= peaks["baseline"] - freed + held, report


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
