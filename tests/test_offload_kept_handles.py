"""Saves left on the device hold the tensor itself when they can, and never make a reference cycle.

A handle holds a saved tensor as it is when its grad_fn is an earlier node than the one saving it
(the cheap case: no ``detach()``), and a detached alias otherwise: an op's own output, an output
written in place through a view, a custom ``autograd.Function``'s output (its forward may make
nodes of its own). A wrong choice makes a cycle through C++ that keeps the storage alive forever,
seen here as ``resident_bytes`` above 0 after the graph is dropped.
"""

from __future__ import annotations

import gc

import pytest
import torch

from lightmem import offload_activations


class _ExpWithInnerGraph(torch.autograd.Function):
    """Saves its own output; its forward builds an autograd graph of its own."""

    @staticmethod
    def forward(ctx, x):
        with torch.enable_grad():
            inner = x.detach().requires_grad_().sin().cos()  # nodes made after this Function's node
        out = x.exp() + 0 * inner.detach()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


def _own_output(x):
    return x.exp()  # exp saves its result


def _output_written_through_a_view(x):
    y = x * 1
    view = y[:, :16]
    view.exp_()  # saves its result: the view, whose grad_fn is made on access
    return y


def _earlier_output(x):
    return x.sin().sin()  # each sin saves its input, an earlier node's output


def _custom_function_output(x):
    return _ExpWithInnerGraph.apply(x)


CASES = [_own_output, _output_written_through_a_view, _earlier_output, _custom_function_output]


@pytest.mark.parametrize("forward", CASES, ids=[f.__name__.strip("_") for f in CASES])
def test_kept_saves_leave_nothing_and_give_exact_gradients(forward):
    x = torch.randn(32, 32, requires_grad=True)
    expected = torch.autograd.grad(forward(x).sum(), x)[0]
    off = offload_activations(min_bytes="1MiB", devices=("cpu",))
    with off:
        loss = forward(x).sum()
    assert off.resident_bytes > 0 and off.stats.kept_bytes > 0
    (grad,) = torch.autograd.grad(loss, x)
    assert torch.equal(grad, expected)
    with off:
        dropped = forward(x).sum()
    del loss, dropped
    gc.collect()
    assert off.resident_bytes == 0
