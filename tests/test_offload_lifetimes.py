"""Host entries follow the autograd graph: every path leaves no host buffer or device tensor behind.

Every lifetime test runs at the default threshold (``min_bytes="1MiB"``: most saved tensors stay
on the device, held by lightmem's handles) and at 0 (everything moves), on three models: the
repo's TinyGPT, and a 4-layer GPT-2 and Llama built from ``transformers`` configs (nothing
downloaded). At the default, TinyGPT keeps every saved tensor on the device; GPT-2 and Llama
keep most and offload their logits (2 MiB).
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from conftest import assert_bitwise_equal
from models import make_case
from torch import nn

from lightmem import offload_activations
from lightmem.offload.context import DEFAULT_MIN_BYTES

THRESHOLDS = pytest.mark.parametrize("min_bytes", [DEFAULT_MIN_BYTES, 0], ids=["default-1MiB", "min_bytes=0"])


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
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _hf_case(name: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = 4096  # logits of 2 x 64 tokens: 2 MiB, over the default threshold
    if name == "gpt2":
        config = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=vocab, n_positions=64,
                            bos_token_id=None, eos_token_id=None)  # fmt: skip
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                             max_position_embeddings=64, bos_token_id=None, eos_token_id=None)  # fmt: skip
        model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(input_ids=tokens, labels=tokens).loss


MODELS = ("tinygpt", "gpt2", "llama")


@pytest.fixture(params=MODELS)
def gpt(request):
    if request.param == "tinygpt":
        model, loss_fn = make_case("transformer")
    else:
        model, loss_fn = _hf_case(request.param)
    return model.eval(), loss_fn  # eval: no dropout, so repeated forwards are identical


@THRESHOLDS
def test_retain_graph_second_backward_reloads_again(gpt, min_bytes):
    model, loss_fn = gpt
    loss = loss_fn(model)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    with offload_activations(model, min_bytes=min_bytes, devices=("cpu",)) as off:
        loss = loss_fn(model)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_bitwise_equal(expected, _grads(model))
    assert off.stats.reloaded_bytes == 2 * off.stats.offloaded_bytes
    del loss
    _nothing_left(off)


@THRESHOLDS
def test_autograd_grad_returns_equal_results(gpt, min_bytes):
    model, loss_fn = gpt
    params = list(model.parameters())
    expected = torch.autograd.grad(loss_fn(model), params)
    with offload_activations(model, min_bytes=min_bytes, devices=("cpu",)) as off:
        loss = loss_fn(model)
    actual = torch.autograd.grad(loss, params)
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))
    del loss
    _nothing_left(off)


@THRESHOLDS
def test_autograd_grad_on_part_of_the_graph_then_dropped(gpt, min_bytes):
    model, loss_fn = gpt
    last = list(model.parameters())[-3:]  # the head's end: backward stops far from the input
    expected = torch.autograd.grad(loss_fn(model), last)
    with offload_activations(model, min_bytes=min_bytes, devices=("cpu",)) as off:
        loss = loss_fn(model)
    actual = torch.autograd.grad(loss, last)
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))
    assert off.stats.kept_bytes > 0 if min_bytes else off.stats.offloaded_bytes > 0
    del loss  # the rest of the graph was never run
    _nothing_left(off)


@THRESHOLDS
def test_two_forwards_in_one_context_before_one_backward(gpt, min_bytes):
    model, loss_fn = gpt
    (loss_fn(model) + 0.5 * loss_fn(model)).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    with offload_activations(model, min_bytes=min_bytes, devices=("cpu",)) as off:
        first = loss_fn(model)
        second = loss_fn(model)
    (first + 0.5 * second).backward()
    assert_bitwise_equal(expected, _grads(model))
    del first, second
    _nothing_left(off)


@THRESHOLDS
def test_two_contexts_before_one_backward(gpt, min_bytes):
    model, loss_fn = gpt
    (loss_fn(model) + 0.5 * loss_fn(model)).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    off = offload_activations(model, min_bytes=min_bytes, devices=("cpu",))
    with off:
        first = loss_fn(model)
    with off:
        second = loss_fn(model)
    (first + 0.5 * second).backward()
    assert_bitwise_equal(expected, _grads(model))
    del first, second
    _nothing_left(off)


@THRESHOLDS
def test_gradient_accumulation_over_micro_batches(gpt, min_bytes):
    model, loss_fn = gpt
    for _ in range(3):
        loss_fn(model).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    off = offload_activations(model, min_bytes=min_bytes, devices=("cpu",))
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


@THRESHOLDS
def test_exception_mid_forward_leaves_nothing_behind(min_bytes):
    model = _FailsHalfway()
    off = offload_activations(model, min_bytes=min_bytes, devices=("cpu",))
    with pytest.raises(RuntimeError, match="boom"):
        with off:
            model(torch.randn(4096, 64))  # a 1 MiB input: saved by first, at both thresholds
    assert off.stats.packed_tensors > 0
    assert not off.active
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    _nothing_left(off)


def _raise_in_third_layer(model: nn.Module):
    blocks = [m for name, m in model.named_modules() if name.endswith(("blocks.2", "h.2", "layers.2"))]
    assert len(blocks) == 1

    def fail(module, args, output):
        raise RuntimeError("boom in the third layer")

    return blocks[0].register_forward_hook(fail)


@THRESHOLDS
def test_exception_mid_forward_of_a_real_model_leaves_nothing_behind(gpt, min_bytes):
    model, loss_fn = gpt
    off = offload_activations(model, min_bytes=min_bytes, devices=("cpu",))
    handle = _raise_in_third_layer(model)
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="boom in the third layer"):
                with off:
                    loss_fn(model)
    finally:
        handle.remove()
    assert off.stats.packed_tensors > 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    _nothing_left(off)


@THRESHOLDS
def test_graphs_dropped_without_backward_leave_nothing(gpt, min_bytes):
    model, loss_fn = gpt
    off = offload_activations(model, min_bytes=min_bytes, devices=("cpu",))
    for _ in range(3):
        with off:
            loss = loss_fn(model)
        assert off.resident_bytes > 0 or off.host_bytes_in_use > 0
        del loss
    stats = off.stats
    assert stats.kept_bytes > 0 if min_bytes else stats.offloaded_bytes > 0
    _nothing_left(off)


@THRESHOLDS
def test_two_hundred_steps_do_not_grow_host_memory_or_live_tensors(min_bytes):
    model, loss_fn = make_case("transformer")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    off = offload_activations(model, min_bytes=min_bytes, devices=("cpu",))

    def step(backward: bool = True):
        with off:
            loss = loss_fn(model)
        if backward:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    gc.collect()
    held = off.host_bytes_held
    allocations = off._pool.allocations
    live_tensors = _live_tensors()
    for index in range(200):
        step(backward=index % 10 != 0)  # every tenth graph is dropped without backward
    gc.collect()
    assert off.host_bytes_held == held
    assert off._pool.allocations == allocations  # steady state: every buffer came from the pool
    assert _live_tensors() <= live_tensors  # no growth (other tests' leftovers may be freed meanwhile)
    assert off.host_bytes_held <= 1.10 * off.stats.offloaded_bytes
    _nothing_left(off)


@THRESHOLDS
def test_a_dropped_context_is_freed_at_once_without_the_cycle_collector(min_bytes):
    """Nothing of an offloader refers back to it in a cycle: dropping the context frees it, and
    with it the host pool's buffers, when the last reference goes, not at some later collection."""
    x = torch.randn(256, 256, requires_grad=True)
    off = offload_activations(min_bytes=min_bytes, devices=("cpu",))
    with off:
        loss = x.sin().sin().sum()
    loss.backward()
    # The stats object lives as long as the engine behind the context (which holds the pool).
    dropped = weakref.ref(off), weakref.ref(off.stats)
    gc.disable()
    try:
        del off, loss
        assert [ref() for ref in dropped] == [None, None]
    finally:
        gc.enable()
