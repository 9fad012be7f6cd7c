"""The host step overlapped with backward (``overlap_step``): parameters stepped on the host as their
gradients land give bitwise the training of one step after backward (the same host kernel, without
lightmem); on the simulated GPU all but the last layer's parameters are stepped before backward
reaches it; what breaks the contract is raised, never silent; under Lightning the callback turns
it on only where nothing runs between backward and the step."""

from __future__ import annotations

import pytest
import torch
from exact import assert_same, assert_state_equal
from optimizer_models import (
    HOST_KERNEL,
    OPTIMIZERS,
    FailsInBackward,
    LitSharedReentrant,
    LitTiny,
    SmallGPT,
    assert_given_back,
    assert_no_hazards_then_close,
    assert_same_fit,
    fit_tiny,
    offloading_optimizer,
    regression_batches,
    small_gpt_loss,
    tiny_net,
)
from torch import nn

import lightmem.config.values
from lightmem import LightMem, offload_optimizer
from lightmem.testing.simulated import SimulatedAsyncTransport

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning"
)


def _train(optimizer_name, offload=None, steps=5, make_model=tiny_net):
    """A plain loop (backward, step, zero_grad, StepLR); without ``offload`` the reference, its
    optimizer constructed with the kernel lightmem runs on the host."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters(), **({} if offload else HOST_KERNEL))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    handle = offload(model, optimizer) if offload is not None else None
    torch.manual_seed(2)  # dropout
    for inputs, targets in regression_batches(steps):
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, handle, torch.get_rng_state()


def _overlapping(transport=None):
    return lambda model, opt: offload_optimizer(model, opt, devices=("cpu",), transport=transport, overlap_step=True)


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "adamw-decay", "adagrad"])
@pytest.mark.parametrize("transport", ["sync", "simulated"])
def test_stepping_during_backward_is_bitwise_one_step_after_backward(optimizer, transport):
    simulated = SimulatedAsyncTransport(seed=3, max_delay_s=0.001) if transport == "simulated" else None
    model_a, opt_a, _, rng_a = _train(optimizer)
    model_b, opt_b, handle, rng_b = _train(optimizer, _overlapping(simulated))
    assert handle.stats.overlapped_steps == 5
    handle.wait_for_params()
    assert_given_back(model_a, model_b, opt_a, opt_b)  # state_dict while offloaded, in torch's order
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    assert_same(rng_a, rng_b, "RNG state")
    assert_no_hazards_then_close(simulated)


def test_a_subset_step_is_bitwise_the_whole_step_for_every_kernel():
    # The premise of the overlap: each kernel updates a tensor on its own. The offloaded run steps
    # each layer in its own call; the reference steps all at once, for-loop, foreach and fused.
    for kernel in ({"foreach": False}, {"foreach": True}, {"fused": True}):
        runs = []
        for overlap in (False, True):
            torch.manual_seed(0)
            model = tiny_net()
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, **kernel)
            handle = offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=overlap)
            torch.manual_seed(2)
            for inputs, targets in regression_batches(3):
                nn.functional.mse_loss(model(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
            handle.close()
            runs.append((model, optimizer))
        (model_a, opt_a), (model_b, opt_b) = runs
        assert_state_equal(model_a, model_b, opt_a, opt_b)


def _parameters_after_each_step(loss_of, steps: int) -> list[list[torch.Tensor]]:
    """Without lightmem: ``[k]`` holds every parameter after ``k`` steps (fused AdamW)."""
    torch.manual_seed(0)
    model = SmallGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, fused=True)
    values = [[param.detach().clone() for param in model.parameters()]]
    for _ in range(steps):
        loss_of(model).backward()
        optimizer.step()
        optimizer.zero_grad()
        values.append([param.detach().clone() for param in model.parameters()])
    return values


def test_on_the_simulated_gpu_all_but_the_first_layer_are_stepped_before_backward_reaches_it():
    """The last node of backward is the embedding's: when it starts, every other parameter's
    gradient is final, and its host step is done, bitwise. Copies to host are held (they run
    only when the host waits for them) and compute lags, so no copy is early by luck."""
    loss_of = small_gpt_loss()
    expected = _parameters_after_each_step(loss_of, steps=2)
    transport = SimulatedAsyncTransport(seed=1, max_delay_s=0.0)
    transport.hold_copies_to_host()
    transport.lag_compute()
    torch.manual_seed(0)
    model = SmallGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    handle = offload_optimizer(model, optimizer, devices=("cpu",), transport=transport, overlap_step=True)
    host_copies = optimizer.param_groups[0]["params"]  # the embedding's weight first
    seen_at_last_node = []

    def at_the_last_node(grad_outputs):
        handle.wait_for_host_step()
        seen_at_last_node.append([host.detach().clone() for host in host_copies])

    def on_embedding_output(module, args, out):
        out.grad_fn.register_prehook(at_the_last_node)

    model.embedding.register_forward_hook(on_embedding_output)
    for step in range(2):
        loss_of(model).backward()
        (seen,) = seen_at_last_node
        seen_at_last_node.clear()
        assert torch.equal(seen[0], expected[step][0])  # the embedding: not stepped before its gradient
        for index in range(1, len(seen)):
            assert torch.equal(seen[index], expected[step + 1][index]), f"parameter {index}: not stepped in backward"
        optimizer.step()
        optimizer.zero_grad()
    handle.close()
    assert all(torch.equal(param, value) for param, value in zip(model.parameters(), expected[2]))
    assert_no_hazards_then_close(transport)


# -- what breaks the contract is raised, never silent -------------------------------------------


def _tiny(**kwargs):
    torch.manual_seed(0)
    model = tiny_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, **kwargs)
    return model, optimizer, offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=True)


def _backward(model):
    inputs, targets = regression_batches(1)[0]
    nn.functional.mse_loss(model(inputs), targets).backward()


def _host_params(optimizer):
    return [param for group in optimizer.param_groups for param in group["params"]]


@pytest.mark.parametrize(
    "clip",
    [lambda params: torch.nn.utils.clip_grad_norm_(params, 1e-3), lambda params: torch.nn.utils.clip_grad_value_(params, 1e-3)],
    ids=["by-norm", "by-value"],
)
def test_clipping_between_backward_and_step_is_raised_at_the_step(clip):
    model, optimizer, handle = _tiny()
    _backward(model)
    clip(_host_params(optimizer))  # every host gradient is in place after backward: all six change
    with pytest.raises(RuntimeError) as error:
        optimizer.step()
    assert str(error.value) == (
        "offload_optimizer(overlap_step=...): 6 parameters were stepped on the host as their gradients "
        "landed, and since then the gradients of 6 parameters (clipped, unscaled, accumulated or replaced) "
        "changed: they keep the step taken with the values at the end of backward. Turn overlap_step off "
        "where anything between backward and optimizer.step() changes gradients or param groups (clipping: "
        "give it to clip_grad_norm or clip_grad_value instead; a GradScaler; an LR change)"
    )
    optimizer.zero_grad()  # the overlap is over: the loop may go on (with those parameters stepped)
    handle.close()


def test_an_lr_change_between_backward_and_step_is_raised_at_the_step():
    model, optimizer, handle = _tiny()
    _backward(model)
    optimizer.param_groups[0]["lr"] = 0.5
    with pytest.raises(RuntimeError, match=r"since then param group 0's 'lr' \(0\.01 -> 0\.5\) changed"):
        optimizer.step()
    handle.close()


def test_a_second_backward_before_the_step_is_raised_in_it():
    model, optimizer, handle = _tiny()
    _backward(model)
    with pytest.raises(RuntimeError) as error:
        _backward(model)  # accumulation: the first backward's parameters are already stepped
    assert str(error.value) == (
        "offload_optimizer(overlap_step=...): a second gradient for a parameter already stepped came after "
        "a backward whose gradients were being stepped on the host as they landed (6 parameters stepped), "
        "before optimizer.step(): those parameters keep that step. With overlap_step every backward must be "
        "followed by optimizer.step(): run the backward passes that accumulate inside `with "
        "handle.accumulating():`, and skip no step after a backward that raised"
    )
    handle.close()


def test_a_backward_that_raises_after_some_steps_is_said_at_the_next_zero_grad():
    torch.manual_seed(0)
    first, last = nn.Linear(8, 16), nn.Linear(16, 1)
    model = nn.Sequential(first, last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    handle = offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=True)
    inputs, targets = regression_batches(1)[0]
    with pytest.raises(FloatingPointError):
        nn.functional.mse_loss(last(FailsInBackward.apply(first(inputs))), targets).backward()
    with pytest.raises(RuntimeError, match=r"optimizer.zero_grad\(\) came after a backward .* \(2 parameters stepped\)"):
        optimizer.zero_grad()
    _backward(model)  # the loop goes on: the next step is a whole one
    optimizer.step()
    optimizer.zero_grad()
    handle.close()
    assert [param.grad for param in model.parameters()] == [None] * 4


def test_loading_optimizer_state_between_backward_and_step_is_raised():
    model, optimizer, handle = _tiny()
    saved = optimizer.state_dict()
    _backward(model)
    with pytest.raises(RuntimeError, match=r"optimizer.load_state_dict\(\) came after a backward .* \(6 parameters stepped\)"):
        optimizer.load_state_dict(saved)
    handle.close()


def test_an_error_in_the_overlapped_step_surfaces_at_optimizer_step():
    model, optimizer, handle = _tiny()
    optimizer.param_groups[0]["betas"] = (0.9,)  # the step itself fails, on the worker
    _backward(model)
    with pytest.raises(RuntimeError, match="lightmem: the host step overlapped with backward failed") as error:
        optimizer.step()
    assert isinstance(error.value.__cause__, ValueError)
    optimizer.param_groups[0]["betas"] = (0.9, 0.999)
    handle.close()


def test_close_with_a_step_pending_warns_and_gives_every_gradient_back():
    model, optimizer, handle = _tiny()
    _backward(model)
    with pytest.warns(UserWarning, match="6 parameters were stepped on the host during a backward whose optimizer.step"):
        handle.close()
    assert all(param.grad is not None for param in model.parameters())
    assert [id(param) for param in _host_params(optimizer)] == [id(param) for param in model.parameters()]
    # The parameters stepped carry their step on the device too: weights agree with the state.
    stepped = [param for param in model.parameters() if optimizer.state.get(param)]
    assert stepped and all(optimizer.state[param]["step"].item() == 1.0 for param in stepped)


def test_close_gives_the_state_back_in_host_memory_when_the_device_cannot_take_it(monkeypatch):
    # After an out-of-memory error mid-fit, moving the optimizer state back to the device may fail
    # again: close still gives the optimizer its parameters, keeps the state on the host, and
    # leaves no hook behind.
    from lightmem.model_state.offloader import OptimizerOffloader

    model, optimizer, handle = _tiny()
    _backward(model)
    optimizer.step()
    swap = OptimizerOffloader._swap_optimizer

    def device_full(self, *, to_host, state_on_host=False):
        if not to_host and not state_on_host:
            raise torch.OutOfMemoryError("simulated: the device is full")
        swap(self, to_host=to_host, state_on_host=state_on_host)

    monkeypatch.setattr(OptimizerOffloader, "_swap_optimizer", device_full)
    with pytest.warns(UserWarning, match=r"the optimizer state could not move back to cpu \(OutOfMemoryError\); it stays in host memory"):
        handle.close()
    assert [id(param) for param in _host_params(optimizer)] == [id(param) for param in model.parameters()]
    assert "zero_grad" not in vars(optimizer)  # lightmem's wrapper is gone with every other hook
    assert all(value.device.type == "cpu" for state in optimizer.state.values() for value in state.values())


def test_an_optimizer_whose_step_it_cannot_split_is_refused():
    class OwnAdam(torch.optim.Adam):
        def step(self, closure=None):
            return super().step(closure)

    model = nn.Linear(2, 2)
    with pytest.raises(ValueError) as error:
        offload_optimizer(model, OwnAdam(model.parameters()), devices=("cpu",), overlap_step=True)
    assert str(error.value) == (
        "offload_optimizer(overlap_step=...): OwnAdam's step is not one lightmem knows to be per parameter "
        "(torch's SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop); leave it off"
    )


# -- under Lightning: on where nothing runs between the closure's backward and the step ------------


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "adamw-decay"])
def test_a_fit_with_accumulation_and_a_scheduler_overlaps_on_the_boundary_backward_only(optimizer, optimizer_offload_transport, caplog):
    # Accumulation 2: the first backward of each step runs outside optimizer.step's closure and
    # must not be stepped (its gradients are partial); stepping it would both change the bits and
    # raise at the second backward.
    settings = dict(accumulate_grad_batches=2, optimizer=optimizer)
    expected = fit_tiny(None, **settings)
    callback = offloading_optimizer()
    with caplog.at_level("INFO"):
        actual = fit_tiny(callback, **settings)
    assert "; host step overlapped with backward)." in caplog.text
    # The first step watches for nested backward passes and runs after backward; the other three overlap.
    (stats,) = callback.optimizer_offload_stats
    assert (stats.steps, stats.overlapped_steps) == (4, 3)
    assert_same_fit(expected, actual)


def test_either_lightning_package_overlaps(lightning_package):
    expected = fit_tiny(None, lightning_package, accumulate_grad_batches=2)
    actual = fit_tiny(offloading_optimizer(), lightning_package, accumulate_grad_batches=2)
    assert_same_fit(expected, actual)


class _LogsGradNorms(LitTiny):
    def on_before_optimizer_step(self, optimizer):
        pass


def test_a_module_hook_between_backward_and_step_turns_it_off(caplog):
    with caplog.at_level("INFO"):
        fit_tiny(offloading_optimizer(), module_class=_LogsGradNorms)
    assert "; host step after backward: the LightningModule overrides on_before_optimizer_step)." in caplog.text


def test_overlap_asked_for_where_the_fit_does_not_allow_it_fails_at_fit_start():
    with pytest.raises(ValueError) as error:
        fit_tiny(offloading_optimizer(offload_overlap_step=True), module_class=_LogsGradNorms)
    assert str(error.value) == (
        "LightMem(offload_overlap_step=...): not possible in this fit: the LightningModule overrides "
        "on_before_optimizer_step; leave it 'auto' or False"
    )


def test_overlap_off_steps_after_backward(caplog):
    expected = fit_tiny(None)
    with caplog.at_level("INFO"):
        actual = fit_tiny(offloading_optimizer(offload_overlap_step=False))
    assert "; host step after backward: overlap_step=False)." in caplog.text
    assert_same_fit(expected, actual)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"offload_overlap_step": "yes"}, "LightMem(offload_overlap_step=...): expected True, False or 'auto'; got 'yes'"),
        (
            {"offload_overlap_step": True, "offload_optimizer": False},
            "LightMem(offload_overlap_step=...): has no effect without LightMem(offload_optimizer=...); pass "
            "offload_optimizer=True or leave offload_overlap_step unset",
        ),
    ],
)
def test_bad_overlap_flags_fail_at_construction(flags, message):
    with pytest.raises(ValueError) as error:
        LightMem(**{"offload_optimizer": True, **flags})
    assert str(error.value) == message


def test_under_lightning_a_first_step_with_reentrant_checkpointing_keeps_the_step_after_backward(monkeypatch):
    monkeypatch.setattr(lightmem.config.values, "_warned", set())  # warned once per process: maybe by another test
    expected = fit_tiny(None, module_class=LitSharedReentrant)
    callback = offloading_optimizer()
    with pytest.warns(UserWarning, match="off from now on, the first step showed nested backward passes"):
        actual = fit_tiny(callback, module_class=LitSharedReentrant)
    assert callback.optimizer_offload_stats[0].overlapped_steps == 0
    assert_same_fit(expected, actual)
