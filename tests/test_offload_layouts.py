"""Saved tensors whose layout the engine must reproduce, or must not trust, after moving them.

An offloaded dense tensor is copied as one typed tensor and given back as it is; any other save
is rebuilt as a view of its reloaded storage. These cases check the edges of both: a lazily negated
view (its bytes are the base's), a tensor reshaped in place after its save (its copy must not
follow the new shape), and dtypes that ``copy_`` cannot copy as such (moved as bytes). Each runs
on the synchronous CPU transport and on the simulated asynchronous one, against plain autograd.
"""

from __future__ import annotations

import pytest
import torch

from lightmem import offload_activations
from lightmem.testing.simulated import SimulatedAsyncTransport

MODIFIED = "modified by an inplace operation"
TRANSPORTS = ["sync", "simulated"]


def _offload(transport: str):
    if transport == "sync":
        return offload_activations(min_bytes=0, devices=("cpu",))
    simulated = SimulatedAsyncTransport(seed=0, max_delay_s=0.001)
    return offload_activations(min_bytes=0, devices=("cpu",), transport=simulated)


def _negated_view_saved(kind: str):
    x = torch.randn(256, requires_grad=True, generator=torch.Generator().manual_seed(0))
    w = torch.randn(256, requires_grad=True, generator=torch.Generator().manual_seed(1))
    if kind == "conj-imag":  # the imaginary part of a conjugate view is a negated view
        negated = torch.complex(x, x * 3).conj().imag
    else:
        negated = torch._neg_view(x * 2)
    return (negated * w).sum(), w  # mul saves the negated view for w's gradient


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", ["conj-imag", "neg_view"])
def test_a_saved_negated_view_keeps_its_sign(kind, transport):
    loss, w = _negated_view_saved(kind)
    (expected,) = torch.autograd.grad(loss, w)
    off = _offload(transport)
    with off:
        loss, w = _negated_view_saved(kind)
    (actual,) = torch.autograd.grad(loss, w)
    assert torch.equal(actual, expected)
    assert off.stats.offloaded_tensors > 0


def _reshaped_in_place_after_its_save(how: str):
    x = torch.randn(4, 256, requires_grad=True)
    y = x.tanh()  # saves its output y
    {"t_": y.t_, "unsqueeze_": lambda: y.unsqueeze_(0), "as_strided_": lambda: y.as_strided_((256, 4), (1, 256))}[how]()
    return y.sin()  # the next save: y's copy to host would run here


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("how", ["t_", "unsqueeze_", "as_strided_"])
def test_a_saved_tensor_reshaped_in_place_fails_in_backward_like_autograd(how, transport):
    with pytest.raises(RuntimeError, match=MODIFIED):
        _reshaped_in_place_after_its_save(how).sum().backward()
    off = _offload(transport)
    with off:
        out = _reshaped_in_place_after_its_save(how)  # the forward runs, as without hooks
    with pytest.raises(RuntimeError, match=MODIFIED):
        out.sum().backward()
    del out
    if transport == "simulated":
        off.transport.synchronize()  # copies still queued hold their entries until they ran
    assert off.live_entries == 0 and off.host_bytes_in_use == 0


class _SavesItsSecondInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, saved):
        ctx.save_for_backward(saved)
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        _SavesItsSecondInput.unpacked = saved.view(torch.uint8).clone()
        return grad, None


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", [torch.uint4, torch.int4, torch.bits8])
def test_a_dtype_without_a_copy_kernel_moves_as_bytes(dtype, transport):
    raw = torch.randint(0, 255, (4096,), dtype=torch.uint8)
    x = torch.randn(8, requires_grad=True)
    off = _offload(transport)
    with off:
        y = _SavesItsSecondInput.apply(x, raw.view(dtype))
    y.sum().backward()
    assert torch.equal(_SavesItsSecondInput.unpacked, raw)
    assert off.stats.offloaded_bytes == 4096
