"""Host entries follow the autograd graph: every path leaves no host buffer or device tensor behind."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from conftest import assert_bitwise_equal
from models import make_case
from torch import nn

from lightmem import offload_activations


def _nothing_left(off) -> None:
    gc.collect()
    assert off.live_entries == 0
    assert off.host_bytes_in_use == 0
    assert off.resident_bytes == 0


def _live_tensors() -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # touching some torch module attributes warns
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def gpt():
    model, loss_fn = make_case("transformer")
    return model.eval(), loss_fn  # eval: no dropout, so repeated forwards are identical


def test_retain_graph_second_backward_reloads_again(gpt):
    model, loss_fn = gpt
    loss = loss_fn(model)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    with offload_activations(model, min_bytes=0, devices=("cpu",)) as off:
        loss = loss_fn(model)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_bitwise_equal(expected, _grads(model))
    assert off.stats.reloaded_bytes == 2 * off.stats.offloaded_bytes
    del loss
    _nothing_left(off)


def test_autograd_grad_returns_equal_results(gpt):
    model, loss_fn = gpt
    params = list(model.parameters())
    expected = torch.autograd.grad(loss_fn(model), params)
    with offload_activations(model, min_bytes=0, devices=("cpu",)) as off:
        loss = loss_fn(model)
    actual = torch.autograd.grad(loss, params)
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))
    del loss
    _nothing_left(off)


def test_two_forwards_in_one_context_before_one_backward(gpt):
    model, loss_fn = gpt
    (loss_fn(model) + 0.5 * loss_fn(model)).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    with offload_activations(model, min_bytes=0, devices=("cpu",)) as off:
        first = loss_fn(model)
        second = loss_fn(model)
    (first + 0.5 * second).backward()
    assert_bitwise_equal(expected, _grads(model))
    del first, second
    _nothing_left(off)


def test_two_contexts_before_one_backward(gpt):
    model, loss_fn = gpt
    (loss_fn(model) + 0.5 * loss_fn(model)).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    off = offload_activations(model, min_bytes=0, devices=("cpu",))
    with off:
        first = loss_fn(model)
    with off:
        second = loss_fn(model)
    (first + 0.5 * second).backward()
    assert_bitwise_equal(expected, _grads(model))
    del first, second
    _nothing_left(off)


def test_gradient_accumulation_over_micro_batches(gpt):
    model, loss_fn = gpt
    for _ in range(3):
        loss_fn(model).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    off = offload_activations(model, min_bytes=0, devices=("cpu",))
    for _ in range(3):
        with off:
            loss = loss_fn(model)
        loss.backward()
    assert_bitwise_equal(expected, _grads(model))
    del loss
    _nothing_left(off)


class _FailsHalfway(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.second = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.first(x).relu()  # saves tensors before the failure
        raise RuntimeError("boom in the middle of forward")


def test_exception_mid_forward_leaves_nothing_behind():
    model = _FailsHalfway()
    off = offload_activations(model, min_bytes=0, devices=("cpu",))
    with pytest.raises(RuntimeError, match="boom"):
        with off:
            model(torch.randn(32, 64))
    assert off.stats.offloaded_tensors > 0
    assert not off.active
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    _nothing_left(off)


def test_graph_dropped_without_backward_returns_host_buffers(gpt):
    model, loss_fn = gpt
    off = offload_activations(model, min_bytes=0, devices=("cpu",))
    with off:
        loss = loss_fn(model)
    assert off.live_entries > 0 and off.host_bytes_in_use > 0
    del loss
    _nothing_left(off)


def test_two_hundred_steps_do_not_grow_host_memory_or_live_tensors():
    model, loss_fn = make_case("transformer")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    off = offload_activations(model, min_bytes=0, devices=("cpu",))

    def step():
        with off:
            loss = loss_fn(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    gc.collect()
    held = off.host_bytes_held
    allocations = off._pool.allocations
    live_tensors = _live_tensors()
    for _ in range(200):
        step()
    gc.collect()
    assert off.host_bytes_held == held
    assert off._pool.allocations == allocations  # steady state: every buffer came from the pool
    assert _live_tensors() <= live_tensors  # no growth (other tests' leftovers may be freed meanwhile)
    assert off.host_bytes_held <= 1.10 * off.stats.offloaded_bytes
    _nothing_left(off)


def test_entering_an_active_context_again_is_an_error(gpt):
    model, _ = gpt
    off = offload_activations(model, devices=("cpu",))
    with off:
        with pytest.raises(RuntimeError, match="already active; it cannot be nested"):
            off.__enter__()


def test_exit_refuses_to_pop_hooks_entered_inside_it(gpt):
    model, _ = gpt
    off = offload_activations(model, devices=("cpu",))
    off.__enter__()
    inner = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    inner.__enter__()
    with pytest.raises(RuntimeError, match="other saved-tensor hooks were entered inside this context"):
        off.__exit__(None, None, None)
    inner.__exit__()
    torch._C._autograd._pop_saved_tensors_default_hooks()  # ours, left in place by the refusal
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
