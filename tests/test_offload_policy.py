"""Which saved tensors move: devices, size threshold, parameters, scopes, dedupe, budget, in-place."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_bitwise_equal, run_grads
from models import TinyGPT, gpt_loss
from torch import nn

from lightmem import offload_activations
from lightmem.config import warn_once
from lightmem.offload import hooks


@pytest.fixture
def offloaded_storages(monkeypatch):
    """Data pointers of every storage the offloader copies to host."""
    seen: list[int] = []
    original = hooks.Offloader._offload

    def spy(self, storage, *args):
        seen.append(storage.data_ptr())
        return original(self, storage, *args)

    monkeypatch.setattr(hooks.Offloader, "_offload", spy)
    return seen


def test_threshold_counts_exact_bytes():
    x = torch.randn(1024, requires_grad=True)  # 4096-byte storages
    with offload_activations(min_bytes=4096, devices=("cpu",)) as off:
        big = x.exp()  # saves its 4096-byte result
        small = x[:8].clone().sin()  # saves a 32-byte input
    (big.sum() + small.sum()).backward()
    stats = off.stats
    assert stats.offloaded_tensors == 1
    assert stats.offloaded_bytes == 4096
    assert stats.kept_bytes == 32
    assert stats.reloaded_bytes == 4096


def test_storage_saved_twice_moves_once_and_each_saver_gets_its_view():
    x = torch.randn(64, 64, requires_grad=True)
    with offload_activations(min_bytes=0, devices=("cpu",)) as off:
        y = x * 2  # 16384-byte storage, saved by three ops below
        a = y.sin()  # saves y
        b = y.cos()  # saves y again
        c = y[:, :8].tanh()  # saves a tanh result; its input view is not saved
        d = y.t().exp()  # saves its own result
        e = y[10:20].sigmoid()  # saves its result
        f = y[::2] * y[1::2]  # saves two views of y
    (a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + f.sum()).backward()
    expected = torch.autograd.grad(
        ((x * 2).sin().sum() + (x * 2).cos().sum() + (x * 2)[:, :8].tanh().sum() + (x * 2).t().exp().sum()
         + (x * 2)[10:20].sigmoid().sum() + ((x * 2)[::2] * (x * 2)[1::2]).sum()), x
    )[0]  # fmt: skip
    assert torch.equal(x.grad, expected)
    stats = off.stats
    # y once (16384), tanh result (64*8*4=2048), exp result (16384), sigmoid result (10*64*4=2560)
    assert stats.offloaded_bytes == 16384 + 2048 + 16384 + 2560
    assert stats.deduplicated_bytes == 3 * 16384  # cos and the two views of y reuse y's entry
    assert stats.reloaded_bytes == stats.offloaded_bytes


class _SavesWeightView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(256, 256))
        self.register_buffer("scale", torch.full((256,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # mm saves weight.t(): a plain Tensor that shares the parameter's storage; mul saves the buffer
        return (x @ self.weight.t()) * self.scale


def test_parameters_and_buffers_are_recognised_by_storage(offloaded_storages):
    model = _SavesWeightView()
    protected = {model.weight.untyped_storage().data_ptr(), model.scale.untyped_storage().data_ptr()}
    x = torch.randn(8, 256, requires_grad=True)
    with offload_activations(model, min_bytes=0, devices=("cpu",)) as off:
        out = model(x)
    out.sum().backward()
    assert offloaded_storages and not protected & set(offloaded_storages)
    assert off.stats.packed_tensors == 3  # x and weight.t() by mm, scale by mul
    assert off.stats.offloaded_bytes == 8 * 256 * 4  # only x


def test_parameters_are_not_offloaded_under_torch_compile(offloaded_storages):
    torch._dynamo.reset()
    model = _SavesWeightView()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(8, 256, requires_grad=True)
    compiled(x).sum().backward()  # compile outside the hooks
    expected = model.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    protected = {model.weight.untyped_storage().data_ptr(), model.scale.untyped_storage().data_ptr()}
    with offload_activations(model, min_bytes=0, devices=("cpu",)) as off:
        out = compiled(x)
    out.sum().backward()
    assert torch.equal(model.weight.grad, expected)
    assert off.stats.packed_tensors > 0
    assert not protected & set(offloaded_storages)


def _gpt():
    torch.manual_seed(0)
    model = TinyGPT(depth=2).eval()
    tokens = torch.randint(0, 128, (2, 17))
    return model, tokens


def test_exclude_keeps_tensors_saved_inside_the_matching_module(offloaded_storages):
    model, tokens = _gpt()
    with offload_activations(model, min_bytes=0, devices=("cpu",), exclude=["lm_head"]) as off:
        loss = gpt_loss(model, tokens)
    loss.backward()
    # lm_head saves only its input: the (2, 16, 64) float32 output of ln_f
    assert off.stats.kept_bytes == 2 * 16 * 64 * 4
    assert off.stats.offloaded_tensors > 0


def test_include_offloads_only_inside_matching_modules():
    model, tokens = _gpt()
    with offload_activations(model, min_bytes=0, devices=("cpu",), include=["blocks.1.mlp"]) as off:
        loss = gpt_loss(model, tokens)
    loss.backward()
    # the MLP saves: fc1 input (2*16*64*4), GELU input (2*16*256*4), fc2 input (2*16*256*4)
    assert off.stats.offloaded_bytes == 2 * 16 * 64 * 4 + 2 * (2 * 16 * 256 * 4)


def test_exclude_inside_include_wins_for_the_inner_module():
    model, tokens = _gpt()
    with offload_activations(
        model, min_bytes=0, devices=("cpu",), include=["blocks.1.mlp"], exclude=["blocks.1.mlp.0"]
    ) as off:
        loss = gpt_loss(model, tokens)
    loss.backward()
    assert off.stats.offloaded_bytes == 2 * (2 * 16 * 256 * 4)


def test_unknown_pattern_is_an_error_naming_the_closest_modules():
    model, _ = _gpt()
    with pytest.raises(ValueError) as error:
        offload_activations(model, devices=("cpu",), exclude=["lm_haed"])
    assert str(error.value) == (
        "offload_activations(exclude=...): 'lm_haed' matches no module of the model; closest names: lm_head"
    )


def test_patterns_without_a_model_are_an_error():
    with pytest.raises(ValueError, match="module patterns need the model"):
        offload_activations(include=["blocks.*"])


@pytest.mark.parametrize("saved_by", ["offloaded", "kept"])
def test_in_place_change_after_pack_raises_like_autograd(saved_by):
    x = torch.randn(1024, requires_grad=True)
    min_bytes = 0 if saved_by == "offloaded" else "1GiB"
    with offload_activations(min_bytes=min_bytes, devices=("cpu",)):
        y = x * 2
        z = y.sin()  # saves y
    y.mul_(3)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[torch.FloatTensor \[1024\]\] "
                       r"is at version 1; expected version 0 instead"):  # fmt: skip
        z.sum().backward()


def test_in_place_relu_saves_its_modified_output_without_error():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 1))
    x = torch.randn(16, 32)
    expected, _ = run_grads(model, lambda m: m(x).sum())
    actual, _ = run_grads(model, lambda m: m(x).sum(), lambda m: offload_activations(m, min_bytes=0, devices=("cpu",)))
    assert_bitwise_equal(expected, actual)


def test_host_budget_keeps_the_overflow_on_the_device_and_warns_once():
    warn_once.__globals__["_warned"].clear()
    x = torch.randn(1024, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with offload_activations(min_bytes=0, devices=("cpu",), host_budget=10_000) as off:
            outs = [(x * (i + 1)).exp() for i in range(4)]  # each exp saves a 4096-byte result
            # the multiplications save nothing (scalar factor); two results fit in 10,000 bytes
    sum(o.sum() for o in outs).backward()
    assert off.stats.offloaded_bytes == 2 * 4096
    assert off.stats.budget_kept_bytes == 2 * 4096
    assert off.stats.peak_host_bytes <= 10_000
    budget_warnings = [w for w in caught if "host memory for offload is exhausted" in str(w.message)]
    assert len(budget_warnings) == 1
    offloaded_grad = x.grad
    x.grad = None
    sum(o.sum() for o in [(x * (i + 1)).exp() for i in range(4)]).backward()
    assert torch.equal(offloaded_grad, x.grad)


def test_host_floor_stops_offload_before_the_machine_runs_out():
    x = torch.randn(1024, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload_activations(min_bytes=0, devices=("cpu",), host_min_available=1.0) as off:
            y = x.exp()
    y.sum().backward()
    assert off.stats.offloaded_bytes == 0
    assert off.stats.budget_kept_bytes == 4096


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_bytes": "lots"}, "offload_activations(min_bytes=...): expected a byte count (int), or a string"),
        ({"min_bytes": -1}, "offload_activations(min_bytes=...): a size cannot be negative; got -1"),
        ({"devices": ("gpu",)}, "offload_activations(devices=...): unknown device type 'gpu'; accepted: cpu, cuda"),
        ({"host_budget": 1.5}, "offload_activations(host_budget=...): expected a byte count (int)"),
        ({"prefetch": "1 banana"}, "offload_activations(prefetch=...): expected a byte count"),
        ({"include": [""]}, "offload_activations(include=...): every pattern must be a non-empty string"),
    ],
)
def test_bad_configuration_fails_at_construction_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError) as error:
        offload_activations(nn.Linear(2, 2), **kwargs)
    assert str(error.value).startswith(message)


def test_parameter_changed_in_place_between_forward_and_backward_raises():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    with offload_activations(model, min_bytes=0, devices=("cpu",)):
        loss = model(torch.randn(256, 64)).sum()
    with torch.no_grad():
        model[2].weight.mul_(10)  # e.g. another optimizer's step before this backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_tensors_on_devices_that_are_not_offloaded_are_still_version_checked():
    a = torch.randn(1000, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload_activations(devices=("cuda",)):  # nothing on CPU moves
            b = a * 2
            c = b.sin()
    with torch.no_grad():
        b.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.sum().backward()


def test_sparse_and_nested_saved_tensors_stay_where_they_are():
    indices = torch.randint(0, 64, (2, 300), generator=torch.Generator().manual_seed(0))
    adjacency = torch.sparse_coo_tensor(indices, torch.randn(300), (64, 64)).coalesce()
    h = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    torch.sparse.mm(adjacency, h @ w).sum().backward()
    expected = w.grad.clone()
    w.grad = None
    with offload_activations(min_bytes=0, devices=("cpu",)) as off:
        out = torch.sparse.mm(adjacency, h @ w)  # saves the sparse adjacency
    out.sum().backward()
    assert torch.equal(w.grad, expected)
    assert off.stats.offloaded_tensors > 0  # the dense ones still moved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], requires_grad=True)
        with offload_activations(min_bytes=0, devices=("cpu",)):
            product = nested * nested
    assert product.is_nested


def test_autocast_copies_of_parameters_are_not_offloaded():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with offload_activations(model, min_bytes="1MiB", devices=("cpu",)) as off:
            loss = model(torch.randn(8, 1024)).float().sum()
    loss.backward()
    # the second layer saves the bfloat16 copy of its weight (2 MiB); that is a parameter, not an activation
    assert off.stats.offloaded_bytes == 0


@pytest.mark.parametrize("min_bytes", [0, "1MiB"])
def test_autocast_copies_of_parameters_are_kept_and_counted_as_kept_at_any_size(min_bytes):
    """The bf16 copy of a weight is device memory the graph holds: kept, counted in kept_bytes."""
    model = nn.Linear(512, 512, bias=False)
    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    with amp, offload_activations(model, min_bytes=min_bytes, devices=("cpu",)) as off:
        loss = model(torch.randn(4, 512, requires_grad=True)).float().sum()  # mm saves both
    input_copy, weight_copy = 4 * 512 * 2, 512 * 512 * 2  # both bf16; the weight's is a parameter copy
    assert off.stats.offloaded_bytes == (input_copy if min_bytes == 0 else 0)
    assert off.stats.kept_bytes == (weight_copy if min_bytes == 0 else input_copy + weight_copy)
    assert off.resident_bytes == off.stats.kept_bytes
    loss.backward()
