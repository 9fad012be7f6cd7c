"""offload_optimizer in a plain PyTorch loop on CPU: bitwise the same training as without it (the
optimizer constructed with the fused kernel lightmem runs on the host), on the synchronous and the
simulated asynchronous transport; bounded device gradients; exact stats; checkpoints that cross
over both ways; exact errors."""

from __future__ import annotations

import pytest
import torch
from exact import assert_same, assert_state_equal
from optimizer_models import HOST_KERNEL, OPTIMIZERS, assert_given_back, regression_batches, tiny_net
from torch import nn

from lightmem import offload_optimizer
from lightmem.testing.simulated import SimulatedAsyncTransport


def _train(optimizer_name, offload=None, steps=4, accumulate=2, clip=0.5, set_to_none=True, model_and_opt=None):
    """SGD/Adam/AdamW with accumulation, clipping by norm over the optimizer's params, StepLR;
    without ``offload``, the optimizer is constructed with the kernel lightmem runs on the host."""
    if model_and_opt is None:
        torch.manual_seed(0)
        model = tiny_net()
        optimizer = OPTIMIZERS[optimizer_name](model.parameters(), **({} if offload else HOST_KERNEL))
    else:
        model, optimizer = model_and_opt
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    handle = offload(model, optimizer) if offload is not None else None
    batches = iter(regression_batches(steps * accumulate))
    torch.manual_seed(2)  # dropout
    for _ in range(steps):
        for _ in range(accumulate):
            inputs, targets = next(batches)
            (nn.functional.mse_loss(model(inputs), targets) / accumulate).backward()
        params = [param for group in optimizer.param_groups for param in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        scheduler.step()
    return model, optimizer, handle, torch.get_rng_state()


def _cpu(transport=None, **kwargs):
    return lambda model, optimizer: offload_optimizer(model, optimizer, devices=("cpu",), transport=transport, **kwargs)


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "adamw-decay", "adagrad"])
@pytest.mark.parametrize("transport", ["sync", "simulated"])
def test_training_is_bitwise_equal_to_the_same_optimizer_without_offload(optimizer, transport):
    simulated = SimulatedAsyncTransport(seed=3, max_delay_s=0.001) if transport == "simulated" else None
    model_a, opt_a, _, rng_a = _train(optimizer)
    model_b, opt_b, handle, rng_b = _train(optimizer, _cpu(simulated))
    handle.wait_for_params()
    assert_given_back(model_a, model_b, opt_a, opt_b)  # while offloaded: state_dict in standard form, as constructed
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)  # and after giving the optimizer back
    assert_same(rng_a, rng_b, "RNG state")
    assert all(p_a is p_b for p_a, p_b in zip(model_b.parameters(), opt_b.param_groups[0]["params"]))
    if simulated is not None:
        assert (simulated.stale_reads, simulated.reuse_hazards, simulated.host_races) == (0, 0, 0)
        simulated.close()


def test_zeroing_in_place_accumulates_like_the_device():
    model_a, opt_a, _, _ = _train("adam", set_to_none=False)
    model_b, opt_b, handle, _ = _train("adam", _cpu(), set_to_none=False)
    assert_given_back(model_a, model_b, opt_a, opt_b)
    handle.close()


def test_device_gradients_are_released_and_bounded_by_max_grad_inflight_bytes():
    simulated = SimulatedAsyncTransport(seed=0, max_delay_s=0.001)
    torch.manual_seed(0)
    model = tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with offload_optimizer(model, optimizer, devices=("cpu",), transport=simulated, max_grad_inflight_bytes=0) as off:
        model(torch.randn(4, 8)).sum().backward()
        assert [param.grad for param in model.parameters()] == [None] * 6
        optimizer.step()
        # At most one gradient (the largest: 16x8 fp32) waited on the device for its copy at a time.
        assert off.stats.peak_device_grad_bytes == 16 * 8 * 4
    simulated.close()


def test_stats_count_host_bytes_and_traffic_exactly():
    torch.manual_seed(0)
    model = tiny_net()  # 8*16+16 + 16+16 + 16+1 = 193 fp32 parameters
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with offload_optimizer(model, optimizer, devices=("cpu",)) as off:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        stats = off.stats
        # Host copies and gradient buffers are carved from arenas, each tensor on a 64-byte line:
        # the six tensors take 512 + 5 x 64 = 832 bytes (for 772 of values).
        assert (stats.host_param_bytes, stats.host_grad_bytes) == (832, 2 * 832)  # + accumulation staging
        assert stats.host_state_bytes == 2 * 193 * 4 + 6 * 4  # exp_avg, exp_avg_sq, six step counters
        assert (stats.grad_bytes_out, stats.param_bytes_in, stats.steps) == (2 * 193 * 4, 193 * 4, 1)
        assert off.host_bytes_held == stats.host_bytes == 3 * 832 + 2 * 193 * 4 + 24


def test_an_offloaded_checkpoint_resumes_without_lightmem_and_the_reverse():
    expected_model, expected_opt, _, _ = _train("adamw-decay", steps=4)
    for first, second in [(_cpu(), None), (None, _cpu())]:
        model, optimizer, handle, _ = _train("adamw-decay", first, steps=2)
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if handle is not None:
            handle.close()
        torch.manual_seed(0)
        resumed_model = tiny_net()
        resumed_opt = OPTIMIZERS["adamw-decay"](resumed_model.parameters())
        handle = second(resumed_model, resumed_opt) if second is not None else None
        resumed_model.load_state_dict(saved["model"])  # the host copies follow
        resumed_opt.load_state_dict(saved["optimizer"])
        if second is None:
            # The checkpoint says fused=None, as the user constructed it (lightmem's choice is not
            # saved as theirs); resumed without lightmem on CPU, it takes the same kernel to go on bitwise.
            assert resumed_opt.param_groups[0]["fused"] is None
            resumed_opt.param_groups[0]["fused"] = True
        _train_more(resumed_model, resumed_opt)
        if handle is not None:
            handle.close()
        reference_model, reference_opt, _, _ = _train("adamw-decay", steps=2)
        _train_more(reference_model, reference_opt)
        # Resumed under lightmem from a checkpoint that says fused=True (saved without lightmem by
        # the reference kernel), that explicit choice is kept and stays after close.
        assert_state_equal(reference_model, resumed_model, reference_opt, resumed_opt)


def _train_more(model, optimizer):
    torch.manual_seed(7)
    for inputs, targets in regression_batches(2, seed=5):
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_an_optimizer_that_is_not_a_torch_optimizer_is_refused():
    with pytest.raises(ValueError) as error:
        offload_optimizer(nn.Linear(2, 2), object(), devices=("cpu",))
    assert str(error.value) == (
        "offload_optimizer: expected a torch.optim.Optimizer (its step runs on host copies of the "
        "parameters); got object"
    )


def test_lbfgs_is_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError) as error:
        offload_optimizer(model, torch.optim.LBFGS(model.parameters()), devices=("cpu",))
    assert str(error.value) == (
        "offload_optimizer: LBFGS re-evaluates the closure at parameter values it moved to inside one "
        "step, which the device forward would not see with the step on the host; use a first-order "
        "optimizer (SGD, Adam, AdamW, ...) or turn the option off"
    )


def test_a_capturable_optimizer_is_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError) as error:
        offload_optimizer(model, torch.optim.Adam(model.parameters(), capturable=True), devices=("cpu",))
    assert str(error.value) == (
        "offload_optimizer: Adam(capturable=True) (param group 0) steps only on CUDA/XPU tensors and "
        "cannot run on the host; construct it with capturable=False"
    )


def test_parameters_on_several_devices_are_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError) as error:
        offload_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), devices=("cpu",))
    assert str(error.value) == (
        "offload_optimizer: the optimizer's parameters are on several devices (cpu, meta); optimizer "
        "offload handles one device per process"
    )


def test_parameters_on_a_device_type_not_named_are_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError) as error:
        offload_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert str(error.value) == (
        "offload_optimizer: the parameters are on cpu, not a device type in "
        "offload_optimizer(devices=...) ['cuda']; pass devices=('cpu',) to drive the path there"
    )


def test_the_model_must_come_first():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError) as error:
        offload_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, devices=("cpu",))
    assert str(error.value) == "offload_optimizer: expected the model (an nn.Module) first; got SGD"


def test_copies_that_lag_behind_compute_keep_gradients_on_the_device_until_backward_ends():
    # The slow-link regime: no copy to host runs until something waits for it. Every gradient then
    # stays on the device (all 193 fp32 values, under the 64 MiB bound) until the end of backward
    # waits for the copies, and the training is still exact.
    simulated = SimulatedAsyncTransport(seed=5, max_delay_s=0.0)
    simulated.hold_copies_to_host()
    model_a, opt_a, _, _ = _train("adam", steps=2)
    model_b, opt_b, handle, _ = _train("adam", _cpu(simulated), steps=2)
    assert handle.stats.peak_device_grad_bytes == 193 * 4
    assert_given_back(model_a, model_b, opt_a, opt_b)
    handle.close()
    assert (simulated.stale_reads, simulated.reuse_hazards) == (0, 0)
    simulated.close()


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed")


@pytest.mark.parametrize("zero_grad_after_failure", [True, False])
def test_a_backward_that_raises_leaves_the_same_gradients_as_on_the_device(zero_grad_after_failure):
    # The last layer's gradient is accumulated before the failure: on the device it stays in
    # param.grad (zero_grad clears it, or the next backward adds to it); offloaded, the same.
    def run(offload):
        torch.manual_seed(0)
        first, last = nn.Linear(8, 8), nn.Linear(8, 1)
        model = nn.Sequential(first, last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **({} if offload else HOST_KERNEL))
        handle = offload(model, optimizer) if offload else None
        inputs = torch.randn(4, 8)
        with pytest.raises(RuntimeError, match="backward failed"):
            last(_FailingBackward.apply(first(inputs))).sum().backward()
        if zero_grad_after_failure:
            optimizer.zero_grad()
        model(inputs).sum().backward()
        # Clipping reads every gradient before the step: all must have landed with the backward.
        torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 0.5)
        optimizer.step()
        if handle is not None:
            handle.close()
        return model, optimizer

    model_a, opt_a = run(None)
    model_b, opt_b = run(_cpu())
    assert_given_back(model_a, model_b, opt_a, opt_b)


def test_sparse_embedding_gradients_are_refused_before_anything_changes():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    groups_before = optimizer.param_groups[0]["params"]
    with pytest.raises(ValueError) as error:
        offload_optimizer(model, optimizer, devices=("cpu",))
    assert str(error.value) == (
        "offload_optimizer: module '0' is Embedding(sparse=True): its sparse gradients cannot be "
        "offloaded; construct it with sparse=False or turn the option off"
    )
    assert optimizer.param_groups[0]["params"] == groups_before
